"""Finished tasks are indexed by when they finished, so live transitions touch no index.

Every transition changed `updated_unix_ns`, which the `(terminal, updated_unix_ns)` index held:
PostgreSQL could update no task row in place (HOT), and each status change left a dead tuple in
every index of the table. `finished_unix_ns` is set only by a terminal transition (NULL while
live) and replaces it in the index. On PostgreSQL the table also keeps half of each page free
for in-place updates (fillfactor 50: a batch commit moves every task of a page at once, and each
new row version must fit on its own page; at 80 only 56% of such updates were HOT, at 60 90%,
at 50 all), and autovacuum visits it after 5% of its rows changed instead of 20%
(docs/tuning.md, "Tables that do not bloat").

Revision ID: 0005_finished_index
Revises: 0004_commit_seq
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from cronoq_store import ddl

revision: str = "0005_finished_index"
down_revision: str | Sequence[str] | None = "0004_commit_seq"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Rolling deploys (cronoq_store.builds, docs/deploying.md): the oldest release that may write
# this schema, and whether this migration runs while that release serves.
OLDEST_WRITER = "0.1.0"
CLASS = "online"

STORAGE = {
    "fillfactor": "50",
    "autovacuum_vacuum_scale_factor": "0.05",
    "autovacuum_analyze_scale_factor": "0.05",
}
"""PostgreSQL storage parameters of cronoq_tasks (what 0005 sets, and its downgrade resets)."""


def _tasks(*columns: str) -> sa.TableClause:
    return sa.table("cronoq_tasks", *(sa.column(c) for c in columns), schema=ddl.schema())


def _storage_target() -> str:
    """The table's name as PostgreSQL DDL text (quoted by hand: the dialect's preparer
    doubles '%' for a compiled statement, and `op.execute` compiles the text again)."""

    def quote(name: str) -> str:
        return '"' + name.replace('"', '""') + '"'

    where = ddl.schema()
    return f"{quote(where)}.{quote('cronoq_tasks')}" if where else quote("cronoq_tasks")


def upgrade() -> None:
    # Online and guarded (cronoq_store.ddl): every step commits on its own, without a long
    # lock on the table the leader writes, and a run killed after any of them finds it done.
    # The column is nullable (no row rewritten); the backfill fills, in batches, only what is
    # still NULL; the index is built (and the old one dropped) concurrently; the storage
    # parameters take a lock that writes do not wait for.
    ddl.add_column("cronoq_tasks", sa.Column("finished_unix_ns", sa.BigInteger(), nullable=True))
    tasks = _tasks("id", "terminal", "updated_unix_ns", "finished_unix_ns")
    ddl.backfill(
        tasks,
        {"finished_unix_ns": tasks.c.updated_unix_ns},
        [tasks.c.terminal == sa.true(), tasks.c.finished_unix_ns.is_(None)],
    )
    ddl.create_index(op.f("ix_cronoq_tasks_finished_unix_ns"), "cronoq_tasks", ["finished_unix_ns"])
    ddl.drop_index(op.f("ix_cronoq_tasks_terminal_updated_unix_ns"), "cronoq_tasks")
    ddl.set_storage("cronoq_tasks", STORAGE)


def downgrade() -> None:
    if op.get_context().dialect.name == "postgresql":
        op.execute(f"ALTER TABLE {_storage_target()} RESET ({', '.join(STORAGE)})")
    ddl.create_index(
        op.f("ix_cronoq_tasks_terminal_updated_unix_ns"),
        "cronoq_tasks",
        ["terminal", "updated_unix_ns"],
    )
    ddl.drop_index(op.f("ix_cronoq_tasks_finished_unix_ns"), "cronoq_tasks")
    with op.batch_alter_table("cronoq_tasks", schema=ddl.schema()) as batch:
        batch.drop_column("finished_unix_ns")
