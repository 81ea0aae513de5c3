"""The live schema against what this build expects: `cronoq-store check`, and part of `status`.

Each finding says what is wrong and what to run. It looks at the revision (behind, ahead, or a
database whose oldest writer is newer than this build), the tables, the indexes (missing, or on
PostgreSQL INVALID: left by a `CREATE INDEX CONCURRENTLY` that was killed), and on PostgreSQL
the task table's storage parameters (revision 0005's fillfactor and autovacuum settings). It
only reads, and reads catalogs only: no task row.
"""

from __future__ import annotations

from typing import Any, Final

from sqlalchemy import Connection, Engine, Index, MetaData, inspect, text
from sqlalchemy.schema import CreateIndex

from . import builds, dialects, migrate
from .errors import StoreError
from .schema import TABLES, tasks

STORAGE_REVISION: Final = "0005_finished_index"
"""The revision whose PostgreSQL storage parameters of `cronoq_tasks` are checked."""


def _finding(problem: str, fix: str) -> dict[str, str]:
    return {"problem": problem, "fix": fix}


def _qualified(name: str, schema: str | None, conn: Connection) -> str:
    quote = conn.dialect.identifier_preparer.quote
    return f"{quote(schema)}.{quote(name)}" if schema else quote(name)


def _create_index_sql(index: Index, schema: str | None, conn: Connection) -> str:
    """The DDL that builds `index`: CONCURRENTLY on PostgreSQL, so it blocks no commit."""
    if schema:
        table = index.table
        assert table is not None
        moved = table.to_metadata(MetaData(), schema=schema)
        index = next(ix for ix in moved.indexes if str(ix.name) == str(index.name))
    ddl = str(CreateIndex(index).compile(dialect=conn.dialect))
    if dialects.dialect_of(conn).builds_indexes_concurrently:
        ddl = ddl.replace("INDEX ", "INDEX CONCURRENTLY ", 1)
    return ddl + ";"


def _revision(conn: Connection, schema: str | None) -> list[dict[str, str]]:
    rev = migrate.current_revision(conn, schema=schema)
    head = migrate.head_revision()
    upgrade = "cronoq-store upgrade" + (f" --schema {schema}" if schema else "")
    if rev is None:
        return [_finding("no cronoq schema in this database", upgrade)]
    if rev == head:
        floor = migrate.oldest_writer_floor(conn, schema)
        if floor is not None and floor > builds.BUILD:
            return [_finding(builds.refusal(floor), f"deploy cronoq-store {builds.decode(floor)}")]
        return []
    try:
        migrate.require_known(rev, floor=migrate.oldest_writer_floor(conn, schema))
    except Exception as exc:
        return [_finding(str(exc), "run the build that migrated it; `cronoq-store history`")]
    return [_finding(f"at schema revision {rev!r}, behind this build's {head!r}", upgrade)]


def _indexes(conn: Connection, schema: str | None) -> list[dict[str, str]]:
    inspector = inspect(conn)
    found: list[dict[str, str]] = []
    for table in TABLES:
        if not inspector.has_table(table.name, schema=schema):
            upgrade = "cronoq-store upgrade" + (f" --schema {schema}" if schema else "")
            found.append(_finding(f"table {table.name} is missing", upgrade))
            continue
        have = {ix["name"] for ix in inspector.get_indexes(table.name, schema=schema)}
        for index in sorted(table.indexes, key=lambda ix: str(ix.name)):
            if str(index.name) not in have:
                found.append(
                    _finding(
                        f"index {index.name} on {table.name} is missing",
                        _create_index_sql(index, schema, conn),
                    )
                )
    return found


_INVALID_SQL: Final = """
SELECT i.relname AS name
FROM pg_index x
JOIN pg_class i ON i.oid = x.indexrelid
JOIN pg_class t ON t.oid = x.indrelid
JOIN pg_namespace n ON n.oid = t.relnamespace
WHERE NOT x.indisvalid AND t.relname LIKE 'cronoq\\_%' AND n.nspname = COALESCE(:schema,
    current_schema())
ORDER BY i.relname
"""


def _invalid_indexes(conn: Connection, schema: str | None) -> list[dict[str, str]]:
    """PostgreSQL: indexes a killed `CREATE INDEX CONCURRENTLY` left INVALID (they cost writes
    and serve no read)."""
    rows = conn.execute(text(_INVALID_SQL), {"schema": schema}).scalars().all()
    return [
        _finding(
            f"index {name} is INVALID (a concurrent build that did not finish)",
            f"REINDEX INDEX CONCURRENTLY {_qualified(name, schema, conn)};",
        )
        for name in rows
    ]


_RELOPTIONS_SQL: Final = """
SELECT c.reloptions
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.relname = :table AND c.relkind = 'r' AND n.nspname = COALESCE(:schema, current_schema())
"""


def _storage(conn: Connection, schema: str | None) -> list[dict[str, str]]:
    """PostgreSQL: `cronoq_tasks`'s storage parameters as revision 0005 sets them."""
    want: dict[str, str] = getattr(builds.revision_module(STORAGE_REVISION), "STORAGE", {})
    options = conn.execute(text(_RELOPTIONS_SQL), {"table": tasks.name, "schema": schema}).scalar()
    if options is None and not inspect(conn).has_table(tasks.name, schema=schema):
        return []
    have = dict(o.split("=", 1) for o in (options or []))
    wrong = {k: v for k, v in want.items() if have.get(k) != v}
    if not wrong:
        return []
    said = ", ".join(f"{k} = {have.get(k, 'default')} (want {v})" for k, v in wrong.items())
    settings = ", ".join(f"{k} = {v}" for k, v in want.items())
    return [
        _finding(
            f"table {tasks.name} storage parameters: {said}",
            f"ALTER TABLE {_qualified(tasks.name, schema, conn)} SET ({settings});",
        )
    ]


def check(bind: Engine | Connection, *, schema: str | None = None) -> dict[str, Any]:
    """The findings of the live schema against this build, each with what to run.

    Returns:
        `{"ok": bool, "revision": ..., "head": ..., "findings": [{"problem", "fix"}, ...]}`.

    Raises:
        StoreUnavailable: The database cannot be reached.
    """
    try:
        if isinstance(bind, Engine):
            with bind.connect() as conn:
                return _check(conn, schema)
        return _check(bind, schema)
    except StoreError:
        raise
    except Exception as exc:
        raise dialects.translate(exc) from exc


def _check(conn: Connection, schema: str | None) -> dict[str, Any]:
    findings = _revision(conn, schema)
    revision = migrate.current_revision(conn, schema=schema)
    if revision == migrate.head_revision():  # otherwise the upgrade is the fix
        findings += _indexes(conn, schema)
        impl = dialects.dialect_of(conn)
        if impl.builds_indexes_concurrently:
            findings += _invalid_indexes(conn, schema)
        if impl.storage_parameters:
            findings += _storage(conn, schema)
    return {
        "ok": not findings,
        "revision": revision,
        "head": migrate.head_revision(),
        "findings": findings,
    }
