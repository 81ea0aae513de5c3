"""Alembic environment for cronoq-store.

Runs on a connection handed in through `config.attributes["connection"]` (how
`cronoq_store.migrate` and apps sharing their engine call it), or else on a URL from
`-x url=...`, `CRONOQ_DATABASE_URL` or `sqlalchemy.url` in alembic.ini. The version table is
`cronoq_alembic_version`, so an app's own Alembic history in the same database is untouched, and
only `cronoq_` tables are compared by autogenerate.
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import Connection, create_engine, pool

from cronoq_store import dialects
from cronoq_store.migrate import VERSION_TABLE, cronoq_tables_only
from cronoq_store.schema import metadata

config = context.config


def _option(key: str, env: str) -> str | None:
    value = context.get_x_argument(as_dictionary=True).get(key) or os.environ.get(env)
    return value or None


def _run(connection: Connection) -> None:
    schema = config.attributes.get("schema") or _option("schema", "CRONOQ_SCHEMA")
    if schema:
        connection = connection.execution_options(schema_translate_map={None: schema})
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        version_table_schema=schema,
        render_as_batch=connection.dialect.name == "sqlite",
        include_name=cronoq_tables_only,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = _option("url", "CRONOQ_DATABASE_URL") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("no database: pass -x url=..., set CRONOQ_DATABASE_URL or sqlalchemy.url")
    engine = create_engine(url, poolclass=pool.NullPool, hide_parameters=True)  # rows are task data
    try:
        with engine.begin() as conn, dialects.migration_lock(conn):
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise SystemExit("cronoq-store migrations run online only (they take a migration lock)")
run_migrations_online()
