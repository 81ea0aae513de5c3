"""The inbox: task specs apps enqueue in their own transactions, and the rows set aside.

Revision ID: 0003_inbox
Revises: 0002_next_id
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

from cronoq_store import ddl
from cronoq_store.dialects import mysql_collation

revision: str = "0003_inbox"
down_revision: str | Sequence[str] | None = "0002_next_id"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Rolling deploys (cronoq_store.builds, docs/deploying.md): the oldest release that may write
# this schema, and whether this migration runs while that release serves.
OLDEST_WRITER = "0.1.0"
CLASS = "online"

BLOB = sa.LargeBinary().with_variant(mysql.LONGBLOB(), "mysql", "mariadb")
LONG_TEXT = sa.Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")
INBOX_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _mysql_args() -> dict[str, str]:
    return {
        "mysql_engine": "InnoDB",
        "mysql_charset": "utf8mb4",
        "mysql_collate": mysql_collation(op.get_context().dialect),
    }


def upgrade() -> None:
    # Guarded (cronoq_store.ddl): MySQL commits each CREATE TABLE at once, and a run killed
    # between them finds the first done.
    ddl.create_table(
        "cronoq_inbox",
        sa.Column("id", INBOX_ID, autoincrement=True, nullable=False),
        sa.Column("enqueued_unix_ns", sa.BigInteger(), nullable=False),
        sa.Column("pool", sa.String(length=128), nullable=False),
        sa.Column("kind", sa.String(length=255), nullable=False),
        sa.Column("priority", sa.SmallInteger(), nullable=False),
        sa.Column("key", sa.String(length=512), nullable=True),
        sa.Column("payload", BLOB, nullable=False),
        sa.Column("deadline_unix_ns", sa.BigInteger(), nullable=True),
        sa.Column("fixed_at_unix_ns", sa.BigInteger(), nullable=True),
        sa.Column("fixed_tolerance_ns", sa.BigInteger(), nullable=True),
        sa.Column("fixed_on_miss", sa.String(length=8), nullable=True),
        sa.Column("duration_hint_ns", sa.BigInteger(), nullable=True),
        sa.Column("timeout_ns", sa.BigInteger(), nullable=True),
        sa.Column("retry", LONG_TEXT, nullable=True),
        sa.Column("deps", LONG_TEXT, nullable=False),
        sa.Column("resources", LONG_TEXT, nullable=False),
        sa.Column("tags", LONG_TEXT, nullable=False),
        sa.Column("labels", LONG_TEXT, nullable=False),
        sa.Column("tenant", sa.String(length=255), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_cronoq_inbox")),
        sqlite_autoincrement=True,
        **_mysql_args(),
    )
    ddl.create_table(
        "cronoq_inbox_rejects",
        sa.Column("inbox_id", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("enqueued_unix_ns", sa.BigInteger(), nullable=True),
        sa.Column("rejected_unix_ns", sa.BigInteger(), nullable=False),
        sa.Column("reason", LONG_TEXT, nullable=False),
        sa.Column("payload", BLOB, nullable=True),
        sa.Column("fields", LONG_TEXT, nullable=False),
        sa.PrimaryKeyConstraint("inbox_id", name=op.f("pk_cronoq_inbox_rejects")),
        **_mysql_args(),
    )


def downgrade() -> None:
    op.drop_table("cronoq_inbox_rejects")
    op.drop_table("cronoq_inbox")
