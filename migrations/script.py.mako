"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from cronoq_store import ddl

${imports if imports else ""}
revision: str = ${repr(up_revision)}
down_revision: str | Sequence[str] | None = ${repr(down_revision)}
branch_labels: str | Sequence[str] | None = ${repr(branch_labels)}
depends_on: str | Sequence[str] | None = ${repr(depends_on)}


# Every schema change here goes through cronoq_store.ddl (ddl.add_column, ddl.create_index,
# ddl.drop_index, ddl.set_storage, ddl.backfill, ddl.create_table, ...), never bare op.* DDL:
# the helpers run online beside a committing leader (a short lock wait, retried; indexes built
# CONCURRENTLY; backfills in batches), and each step commits on its own, so a run killed
# half-way must find what it already did and complete it on the next run. Add a guarded,
# online helper there for any other kind of change. Data updates go through ddl.backfill
# (its WHERE excludes the rows already done), or commit with the version row.


def upgrade() -> None:
    ${upgrades if upgrades else "pass"}


def downgrade() -> None:
    ${downgrades if downgrades else "pass"}
