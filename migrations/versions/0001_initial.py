"""Initial schema: tasks, their dependencies, recurring schedules and the leader lease.

Revision ID: 0001_initial
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

from cronoq_store import ddl
from cronoq_store.dialects import mysql_collation

revision: str = "0001_initial"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Rolling deploys (cronoq_store.builds, docs/deploying.md): the oldest release that may write
# this schema, and whether this migration runs while that release serves.
OLDEST_WRITER = "0.1.0"
CLASS = "online"

BLOB = sa.LargeBinary().with_variant(mysql.LONGBLOB(), "mysql", "mariadb")
LONG_TEXT = sa.Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")


def _mysql_args() -> dict[str, str]:
    return {
        "mysql_engine": "InnoDB",
        "mysql_charset": "utf8mb4",
        "mysql_collate": mysql_collation(op.get_context().dialect),
    }


def upgrade() -> None:
    # Guarded (cronoq_store.ddl): MySQL commits each statement, so a run killed half-way is
    # completed by the next one.
    ddl.create_table(
        "cronoq_tasks",
        sa.Column("id", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("arrival_unix_ns", sa.BigInteger(), nullable=False),
        sa.Column("pool", sa.String(length=128), nullable=False),
        sa.Column("kind", sa.String(length=255), nullable=False),
        sa.Column("priority", sa.SmallInteger(), nullable=False),
        sa.Column("key", sa.String(length=512), nullable=True),
        sa.Column("live_key", sa.String(length=512), nullable=True),
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
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("terminal", sa.Boolean(create_constraint=False), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("updated_unix_ns", sa.BigInteger(), nullable=False),
        sa.Column("message", LONG_TEXT, nullable=True),
        sa.Column("output", BLOB, nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_cronoq_tasks")),
        **_mysql_args(),
    )
    ddl.create_index(op.f("ix_cronoq_tasks_live_key"), "cronoq_tasks", ["live_key"], unique=True)
    ddl.create_index(op.f("ix_cronoq_tasks_terminal_id"), "cronoq_tasks", ["terminal", "id"])
    ddl.create_index(
        op.f("ix_cronoq_tasks_terminal_updated_unix_ns"),
        "cronoq_tasks",
        ["terminal", "updated_unix_ns"],
    )
    ddl.create_index(op.f("ix_cronoq_tasks_key_id"), "cronoq_tasks", ["key", "id"])

    ddl.create_table(
        "cronoq_task_deps",
        sa.Column("task_id", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("ordinal", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("target_id", sa.BigInteger(), nullable=True),
        sa.Column("target_key", sa.String(length=512), nullable=True),
        sa.PrimaryKeyConstraint("task_id", "ordinal", name=op.f("pk_cronoq_task_deps")),
        **_mysql_args(),
    )
    ddl.create_index(op.f("ix_cronoq_task_deps_target_id"), "cronoq_task_deps", ["target_id"])
    ddl.create_index(op.f("ix_cronoq_task_deps_target_key"), "cronoq_task_deps", ["target_key"])

    ddl.create_table(
        "cronoq_recurring",
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("spec", LONG_TEXT, nullable=False),
        sa.Column("template_payload", BLOB, nullable=False),
        sa.Column("next_unix_ns", sa.BigInteger(), nullable=True),
        sa.Column("last_task_id", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_cronoq_recurring")),
        **_mysql_args(),
    )

    leader = ddl.create_table(
        "cronoq_leader",
        sa.Column("id", sa.SmallInteger(), autoincrement=False, nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("holder", sa.String(length=128), nullable=True),
        sa.Column("expires_unix_ns", sa.BigInteger(), nullable=False),
        sa.Column("max_id", sa.BigInteger(), nullable=False),
        sa.CheckConstraint("id = 1", name=op.f("ck_cronoq_leader_single_row")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_cronoq_leader")),
        **_mysql_args(),
    )
    ddl.insert_missing(
        leader, [{"id": 1, "epoch": 0, "holder": None, "expires_unix_ns": 0, "max_id": 0}]
    )


def downgrade() -> None:
    op.drop_table("cronoq_leader")
    op.drop_table("cronoq_recurring")
    op.drop_index(op.f("ix_cronoq_task_deps_target_key"), table_name="cronoq_task_deps")
    op.drop_index(op.f("ix_cronoq_task_deps_target_id"), table_name="cronoq_task_deps")
    op.drop_table("cronoq_task_deps")
    op.drop_index(op.f("ix_cronoq_tasks_key_id"), table_name="cronoq_tasks")
    op.drop_index(op.f("ix_cronoq_tasks_terminal_updated_unix_ns"), table_name="cronoq_tasks")
    op.drop_index(op.f("ix_cronoq_tasks_terminal_id"), table_name="cronoq_tasks")
    op.drop_index(op.f("ix_cronoq_tasks_live_key"), table_name="cronoq_tasks")
    op.drop_table("cronoq_tasks")
