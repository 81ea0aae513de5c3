"""Guarded DDL for the migrations: each step skips what the database already holds.

MySQL and MariaDB commit every DDL statement at once, so a migration killed half-way leaves the
tables it created behind while its version row rolls back; run again, an unguarded
`CREATE TABLE` then fails for good ("Table 'cronoq_tasks' already exists"). Written with these
helpers, the next run (under the migration lock, so no other process is migrating) completes
the interrupted one instead. On PostgreSQL and SQLite DDL is transactional and every guard
finds nothing done.

Call them only from inside a revision's `upgrade()` (they use `alembic.op`). Every revision
must build its schema changes from these helpers (the script template says so): a step that
cannot be skipped when done (a data update, say) must be written so that running it again
after a kill is right, or run in the same transaction as the version row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op
from sqlalchemy.engine.reflection import Inspector


def schema() -> str | None:
    """The schema env.py maps the tables into (reflection and DDL by name do not see the map)."""
    options = op.get_bind().get_execution_options()
    name: str | None = (options.get("schema_translate_map") or {}).get(None)
    return name


def _inspector() -> Inspector:
    """A fresh inspector: a cached one would not see what this run has just created."""
    return sa.inspect(op.get_bind())


def has_table(name: str) -> bool:
    return _inspector().has_table(name, schema=schema())


def has_index(table: str, name: str) -> bool:
    inspector = _inspector()
    if not inspector.has_table(table, schema=schema()):
        return False
    return any(ix["name"] == name for ix in inspector.get_indexes(table, schema=schema()))


def has_column(table: str, name: str) -> bool:
    inspector = _inspector()
    if not inspector.has_table(table, schema=schema()):
        return False
    return any(c["name"] == name for c in inspector.get_columns(table, schema=schema()))


def create_table(name: str, *elements: Any, **kw: Any) -> sa.Table:
    """`op.create_table`, unless the table exists; the table either way (for inserts)."""
    if not has_table(name):
        table: sa.Table = op.create_table(name, *elements, **kw)
        return table
    return sa.Table(name, sa.MetaData(), *elements, **kw)


def create_index(name: str, table: str, columns: Sequence[str], **kw: Any) -> None:
    """`op.create_index`, unless an index of that name exists on `table`."""
    if not has_index(table, name):
        op.create_index(name, table, list(columns), **kw)


def rename_column(table: str, old: str, new: str, **kw: Any) -> None:
    """`op.alter_column(new_column_name=...)`, unless `old` is already renamed to `new`."""
    if has_column(table, new) and not has_column(table, old):
        return
    op.alter_column(table, old, new_column_name=new, schema=schema(), **kw)


def insert_missing(table: sa.Table, rows: Sequence[Mapping[str, Any]], key: str = "id") -> None:
    """Insert each of `rows` whose `key` is not stored yet (MySQL may have committed the table
    without them)."""
    column = table.c[key]
    stored = set(op.get_bind().execute(sa.select(column)).scalars())
    missing = [dict(r) for r in rows if r[key] not in stored]
    if missing:
        op.bulk_insert(table, missing)


def add_column(table: str, column: sa.Column[Any]) -> None:
    """`op.add_column`, unless `table` already has a column of that name."""
    if not has_column(table, column.name):
        op.add_column(table, column, schema=schema())


def drop_index(name: str, table: str) -> None:
    """`op.drop_index`, unless `table` has no index of that name (any more)."""
    if has_index(table, name):
        op.drop_index(name, table_name=table, schema=schema())
