"""The leader row counts commits, so a leader notices a database that lost some of them.

An asynchronous failover can promote a replica that misses the last commits: the lease row
then still names the old leader under its epoch, and its fence alone would let it go on
writing. `commit_seq` is raised by every commit; a leader whose last acknowledged commit is
above it steps down and records the gap in `lost_*` for the next recovery to report.

Revision ID: 0004_commit_seq
Revises: 0003_inbox
Create Date: 2026-12-04
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from cronoq_store import ddl

revision: str = "0004_commit_seq"
down_revision: str | Sequence[str] | None = "0003_inbox"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Rolling deploys (cronoq_store.builds, docs/deploying.md): the oldest release that may write
# this schema, and whether this migration runs while that release serves.
OLDEST_WRITER = "0.1.0"
CLASS = "online"


def upgrade() -> None:
    # Online and guarded (cronoq_store.ddl): each ALTER of the leader's lease row waits at most
    # a short lock timeout and retries, commits on its own, and a run killed between them finds
    # the first ones done. A constant default rewrites no row.
    ddl.add_column(
        "cronoq_leader",
        sa.Column("commit_seq", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
    )
    ddl.add_column("cronoq_leader", sa.Column("lost_epoch", sa.Integer(), nullable=True))
    ddl.add_column("cronoq_leader", sa.Column("lost_commits", sa.BigInteger(), nullable=True))
    ddl.add_column("cronoq_leader", sa.Column("lost_unix_ns", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    # Batch mode: SQLite rebuilds the table, the servers drop the columns in place.
    with op.batch_alter_table("cronoq_leader", schema=ddl.schema()) as batch:
        for name in ("lost_unix_ns", "lost_commits", "lost_epoch", "commit_seq"):
            batch.drop_column(name)
