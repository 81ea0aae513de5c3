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


# Every schema change here goes through cronoq_store.ddl (ddl.create_table, ddl.create_index,
# ddl.rename_column, ...), never bare op.* DDL: MySQL commits each DDL statement at once, so a
# run killed half-way must find what it already did and complete it on the next run. Add a
# guarded helper there for any other kind of change. Data updates must be safe to run again,
# or commit with the version row (after the last DDL statement).


def upgrade() -> None:
    ${upgrades if upgrades else "pass"}


def downgrade() -> None:
    ${downgrades if downgrades else "pass"}
