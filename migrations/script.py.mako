"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from cronoq_store import builds, ddl

${imports if imports else ""}
revision: str = ${repr(up_revision)}
down_revision: str | Sequence[str] | None = ${repr(down_revision)}
branch_labels: str | Sequence[str] | None = ${repr(branch_labels)}
depends_on: str | Sequence[str] | None = ${repr(depends_on)}

# Rolling deploys (cronoq_store.builds, docs/deploying.md): the oldest release that may write
# this schema, and whether this migration runs while that release serves ("online"), or
# "needs the old build stopped" (then OLDEST_WRITER is the release that ships it).
OLDEST_WRITER = "0.1.0"
CLASS = "online"


# Every schema change here goes through cronoq_store.ddl (ddl.add_column, ddl.create_index,
# ddl.drop_index, ddl.set_storage, ddl.backfill, ddl.create_table, ...), never bare op.* DDL:
# the helpers run online beside a committing leader (a short lock wait, retried; indexes built
# CONCURRENTLY; backfills in batches), and each step commits on its own, so a run killed
# half-way must find what it already did and complete it on the next run. Add a guarded,
# online helper there for any other kind of change. Data updates go through ddl.backfill
# (its WHERE excludes the rows already done), or commit with the version row.


def upgrade() -> None:
    ${upgrades if upgrades else "pass"}
    builds.raise_oldest_writer(OLDEST_WRITER)  # last: it fences builds older than the floor


def downgrade() -> None:
    ${downgrades if downgrades else "pass"}
