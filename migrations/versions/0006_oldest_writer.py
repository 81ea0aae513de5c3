"""The database records the oldest build that may write its schema.

`cronoq_writers` holds one row: `oldest_writer`, that release encoded as one number
(`cronoq_store.builds.encode`: "0.1.0" is 1000). The lease's take, renewal and fence statements
of every build from 0.2.0 on match only while it is at most their own version (a scalar subquery
in the same statement: no round trip), so a later migration that raises it fences an older build
off at its next commit, and the refusal names both versions (docs/deploying.md, "Upgrading a
running system"). Each migration raises it to its own `OLDEST_WRITER`, never lowers it.

Online on every dialect: a new table and its one row, no lock on a table a leader writes (a
column on `cronoq_leader` would have needed its ACCESS EXCLUSIVE lock, queued behind and in
front of every commit's fence). 0.1.0, which knows nothing of the table, writes on.

Revision ID: 0006_oldest_writer
Revises: 0005_finished_index
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from cronoq_store import builds, ddl
from cronoq_store.dialects import mysql_collation

revision: str = "0006_oldest_writer"
down_revision: str | Sequence[str] | None = "0005_finished_index"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Rolling deploys (cronoq_store.builds, docs/deploying.md): the oldest release that may write
# this schema, and whether this migration runs while that release serves.
OLDEST_WRITER = "0.1.0"
CLASS = "online"


def upgrade() -> None:
    writers = ddl.create_table(
        "cronoq_writers",
        sa.Column("id", sa.SmallInteger(), autoincrement=False, nullable=False),
        sa.Column("oldest_writer", sa.BigInteger(), nullable=False),
        sa.CheckConstraint("id = 1", name=op.f("ck_cronoq_writers_single_row")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_cronoq_writers")),
        mysql_engine="InnoDB",
        mysql_charset="utf8mb4",
        mysql_collate=mysql_collation(op.get_context().dialect),
    )
    ddl.insert_missing(writers, [{"id": 1, "oldest_writer": 0}])
    builds.raise_oldest_writer(OLDEST_WRITER)


def downgrade() -> None:
    op.drop_table("cronoq_writers")
