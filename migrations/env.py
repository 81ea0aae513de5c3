"""Alembic environment for cronoq-store.

Runs on a connection handed in through `config.attributes["connection"]` (how
`cronoq_store.migrate` and apps sharing their engine call it), or else on a URL from
`-x url=...`, `CRONOQ_DATABASE_URL` or `sqlalchemy.url` in alembic.ini. The version table is
`cronoq_alembic_version`, so an app's own Alembic history in the same database is untouched, and
only `cronoq_` tables are compared by autogenerate. Offline (`--sql`) it prints the DDL for the
URL's dialect instead, from an empty database.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from alembic import context
from sqlalchemy import Connection, create_engine, inspect, make_url, pool
from sqlalchemy.exc import SQLAlchemyError

from cronoq_store import dialects
from cronoq_store.errors import SchemaError, StoreError
from cronoq_store.face.engines import create_private, sqlite_file
from cronoq_store.migrate import VERSION_TABLE, cronoq_tables_only
from cronoq_store.schema import metadata

config = context.config


def _option(key: str, env: str) -> str | None:
    value = context.get_x_argument(as_dictionary=True).get(key) or os.environ.get(env)
    return value or None


def _renewal(renew: Callable[[], None] | None) -> Callable[..., None]:
    """Alembic's hook after each revision step: renew the migration lock (see
    `dialects.migration_lock`), in the transaction that wrote the step's version row."""

    def after_step(**_: Any) -> None:
        if renew is not None:
            renew()

    return after_step


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
        on_version_apply=[_renewal(config.attributes.get("renew_lock"))],
        # Online: each revision commits on its own, and its steps commit theirs
        # (cronoq_store.ddl), so no lock is held across a whole upgrade.
        transaction_per_migration=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def _require_schema(conn: Connection) -> None:
    """This path migrates into an existing schema (`cronoq-store upgrade` creates one): say
    so in one line rather than fail on the first CREATE TABLE."""
    schema = _option("schema", "CRONOQ_SCHEMA")
    kind = {"postgresql": "PostgreSQL schema", "mysql": "MySQL database"}.get(
        dialects.name(conn.dialect)
    )
    if not schema or kind is None:
        return
    if kind == "MySQL database":
        found = dialects.database_exists(conn, schema)
    else:
        found = inspect(conn).has_schema(schema)
    if not found:
        raise SchemaError(
            f"no {kind} {schema!r} (-x schema=): this path migrates into an existing one; "
            f"create it, or run `cronoq-store --url URL --schema {schema} upgrade`, which does"
        )


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        # The steps commit one by one (online): a transaction the caller left open on the
        # connection is committed first, as `cronoq_store.migrate.upgrade` does.
        if connection.in_transaction():
            connection.commit()
        _run(connection)
        return
    url = _option("url", "CRONOQ_DATABASE_URL") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise SystemExit("no database: pass -x url=..., set CRONOQ_DATABASE_URL or sqlalchemy.url")
    where = "?"
    try:
        parsed = dialects.parse_url(url) if "://" in url else make_url(f"sqlite:///{url}")
        where = dialects.safe_url(parsed)
        if parsed.get_backend_name() == "sqlite":
            create_private(sqlite_file(parsed))  # 0600, as `cronoq-store upgrade` makes it
        engine = create_engine(parsed, poolclass=pool.NullPool, hide_parameters=True)  # task data
        try:
            schema = config.attributes.get("schema") or _option("schema", "CRONOQ_SCHEMA")
            with engine.connect() as conn, dialects.migration_lock(conn, schema=schema) as renew:
                config.attributes["renew_lock"] = renew
                _require_schema(conn)
                if conn.in_transaction():
                    conn.commit()
                _run(conn)
                if conn.in_transaction():
                    conn.commit()
        finally:
            engine.dispose()
    except (SQLAlchemyError, StoreError) as exc:
        # One line, as the CLI says it (`dialects.describe`), not Alembic's 90-line traceback.
        error = dialects.translate(exc)
        why = " ".join(str(error).split())
        raise SystemExit(f"cronoq migrations failed ({where}): {why}") from None


def run_migrations_offline() -> None:
    """`--sql`: the DDL for the URL's dialect, for a DBA to review and apply by hand to an empty
    database (`cronoq-store upgrade --sql` passes the URL in `config.attributes["url"]`). No
    migration lock and no connection: the script runs once, by hand. Every guarded step of
    `cronoq_store.ddl` assumes nothing exists yet."""
    url = (
        config.attributes.get("url")
        or _option("url", "CRONOQ_DATABASE_URL")
        or config.get_main_option("sqlalchemy.url")
    )
    if not url:
        raise SystemExit("no database URL for --sql: pass -x url=... or set CRONOQ_DATABASE_URL")
    parsed = dialects.parse_url(url) if "://" in url else make_url(f"sqlite:///{url}")
    schema = config.attributes.get("schema") or _option("schema", "CRONOQ_SCHEMA")
    if schema:
        raise SystemExit(
            "--sql writes the tables unqualified: leave out the schema, and run the script "
            "with the schema first on the search path (PostgreSQL) or as the database (MySQL)"
        )
    # MariaDB and MySQL differ (collations); offline nothing can ask the server, so a
    # mariadb:// URL says which: the MySQL dialect, told it is MariaDB.
    options: dict[str, Any] = {}
    if parsed.get_backend_name() == "mariadb":
        parsed = parsed.set(drivername=parsed.drivername.replace("mariadb", "mysql", 1))
        options["is_mariadb"] = True
    context.configure(
        url=parsed,
        dialect_opts=options,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        literal_binds=True,
        render_as_batch=parsed.get_backend_name() == "sqlite",
        transaction_per_migration=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
