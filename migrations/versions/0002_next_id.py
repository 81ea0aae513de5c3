"""The id high-water mark becomes `next_id`, the first id never used.

`max_id` (the highest id committed) could not tell "task 0 was committed" from "nothing was",
so once task 0 was pruned a new leader would hand out id 0 again.

Revision ID: 0002_next_id
Revises: 0001_initial
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from cronoq_store import ddl

revision: str = "0002_next_id"
down_revision: str | Sequence[str] | None = "0001_initial"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Rolling deploys (cronoq_store.builds, docs/deploying.md): the oldest release that may write
# this schema, and whether this migration runs while that release serves.
OLDEST_WRITER = "0.1.0"
CLASS = "online"


def _leader(column: str) -> sa.TableClause:
    return sa.table("cronoq_leader", sa.column(column), schema=ddl.schema())


def upgrade() -> None:
    # Online and guarded (cronoq_store.ddl): the rename waits at most a short lock timeout and
    # retries, commits on its own, and a run killed after it finds it done. The update below
    # commits with this revision's version row, so it runs exactly once.
    ddl.rename_column(
        "cronoq_leader",
        "max_id",
        "next_id",
        existing_type=sa.BigInteger(),
        existing_nullable=False,
    )
    # max_id = 0 meant either "nothing committed" or "task 0 committed": tasks tell which.
    leader = _leader("next_id")
    tasks = sa.table("cronoq_tasks", sa.column("id"), schema=ddl.schema())
    used = sa.or_(leader.c.next_id > 0, sa.exists().where(tasks.c.id.is_not(None)))
    op.execute(leader.update().where(used).values(next_id=leader.c.next_id + 1))


def downgrade() -> None:
    leader = _leader("next_id")
    op.execute(leader.update().where(leader.c.next_id > 0).values(next_id=leader.c.next_id - 1))
    op.alter_column(
        "cronoq_leader",
        "next_id",
        new_column_name="max_id",
        existing_type=sa.BigInteger(),
        existing_nullable=False,
        schema=ddl.schema(),
    )
