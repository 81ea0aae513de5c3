"""The lease row records the oldest build that may write the schema.

`oldest_writer` is that release, encoded as one number (`cronoq_store.builds.encode`: "0.1.0"
is 1000). The lease's take, renewal and fence statements of every build from 0.2.0 on match only
while it is at most their own version, so a later migration that raises it fences an older
build off at its next commit, and the refusal names both versions (docs/deploying.md,
"Upgrading a running system"). Each migration raises it to its own `OLDEST_WRITER`, never
lowers it. Online: one column with a constant default (metadata only on PostgreSQL, INSTANT on
MariaDB) and a one-row update; 0.1.0, which knows nothing of the column, writes on.

Revision ID: 0006_oldest_writer
Revises: 0005_finished_index
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from cronoq_store import builds, ddl

revision: str = "0006_oldest_writer"
down_revision: str | Sequence[str] | None = "0005_finished_index"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Rolling deploys (cronoq_store.builds, docs/deploying.md): the oldest release that may write
# this schema, and whether this migration runs while that release serves.
OLDEST_WRITER = "0.1.0"
CLASS = "online"


def upgrade() -> None:
    ddl.add_column(
        "cronoq_leader",
        sa.Column("oldest_writer", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
    )
    builds.raise_oldest_writer(OLDEST_WRITER)


def downgrade() -> None:
    with op.batch_alter_table("cronoq_leader", schema=ddl.schema()) as batch:
        batch.drop_column("oldest_writer")
