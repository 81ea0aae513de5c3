"""The cursor runner: driver SQL run in a connection's transaction on its DB-API cursor
(`run`), or through SQLAlchemy's execution where the connection is `observed`; a driver
error leaves as SQLAlchemy's `DBAPIError` either way (`compat.driver_error`).

Which path runs is decided, never inferred from who listens (`observed`): the cursor, unless
the engine or connection asks for SQLAlchemy's execution with the `OBSERVED` execution option,
or SQLAlchemy's statement log is on (`echo`, or the `sqlalchemy.engine` logger at INFO), or the
driver is async. So a `before_cursor_execute` listener (OpenTelemetry's SQLAlchemy
instrumentation, a test's) costs the store nothing and sees only what SQLAlchemy executes;
to see every statement, set the option (docs/observability.md).

This is the connector's floor (procrastinate's "runs queries and wraps errors"): it knows no
database by name, and `execution` builds on it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final, NamedTuple

from sqlalchemy import Connection

from .. import compat
from ..errors import StoreError
from .compiled import Statement, driver_sql

__all__ = [
    "OBSERVED",
    "Ran",
    "counted",
    "inserted_id",
    "observed",
    "run",
    "run_many",
    "run_on",
    "run_stmt",
]


class Ran(NamedTuple):
    """What a statement did: rows it matched (the driver's rowcount; None where the driver
    cannot tell) and rows it returned."""

    rowcount: int | None
    rows: Sequence[Any]
    lastrowid: int | None = None
    """The key the driver says the statement's row got, where asked for (`inserted_id`)."""


_new: Final = tuple.__new__


def counted(rowcount: int) -> int | None:
    """A DB-API rowcount, None for the -1 of a driver that cannot tell."""
    return None if rowcount < 0 else rowcount


OBSERVED: Final = "cronoq_observed"
"""The execution option that runs the store's statements through SQLAlchemy's execution, so
that its listeners see every one (and PostgreSQL inserts with executemany, not COPY): e.g.
`store.engine.update_execution_options(cronoq_observed=True)`, or `execution_options=` of
`create_engine`. Off by default: the store then runs them on the DB-API cursor."""


def observed(conn: Connection, options: Mapping[str, Any] | None = None) -> bool:
    """Whether `conn`'s statements run through SQLAlchemy's execution: asked for (`OBSERVED`),
    SQLAlchemy's statement log on (`compat.logs_statements`: `echo`, or the logger at INFO),
    or an async driver (whose cursor only SQLAlchemy drives). Listeners do not count: an
    instrumented engine keeps the fast path (the module docstring). `options`: `conn`'s
    execution options, when the caller has read them already.
    """
    if options is None:
        options = conn.get_execution_options()
    return bool(conn.dialect.is_async or options.get(OBSERVED) or compat.logs_statements(conn))


def run(
    conn: Connection,
    sql: str,
    params: Any = None,
    *,
    many: bool = False,
    last: bool = False,
    options: Mapping[str, Any] | None = None,
) -> Ran:
    """Run driver SQL in `conn`'s transaction: on its DB-API cursor, or through
    `exec_driver_sql` when `observed`. `many`: `params` is a list, run as the driver's
    executemany. `last`: keep the driver's `lastrowid` (not every driver has one). `options`:
    `conn`'s execution options, when the caller has read them already (`observed`).

    A driver error leaves as SQLAlchemy's `DBAPIError` either way (parameters hidden: they are
    task data), and a lost connection is invalidated as SQLAlchemy would (`compat.driver_error`).
    """
    if observed(conn, options):
        result = conn.exec_driver_sql(sql, params)
        rows = result.all() if result.returns_rows else []
        return Ran(counted(result.rowcount), rows, result.lastrowid if last else None)
    return run_on(conn, conn.connection.dbapi_connection, sql, params, many, last)


def run_on(
    conn: Connection, dbapi_conn: Any, sql: str, params: Any, many: bool = False, last: bool = False
) -> Ran:
    """`run` on the DB-API connection `dbapi_conn` (`conn`'s), for a caller that decided once
    it is not `observed` (`execution.Flight`, for all of its statements).

    An executemany of one row runs as an execute, which psycopg sends as it is, where it
    wraps an executemany in a pipeline of its own (60 µs of CPU)."""
    cursor = dbapi_conn.cursor()
    try:
        if params is None:
            cursor.execute(sql)
        elif not many:
            cursor.execute(sql, params)
        elif len(params) == 1:
            cursor.execute(sql, params[0])
        else:
            cursor.executemany(sql, params)
        rows = cursor.fetchall() if cursor.description is not None else []
        count = cursor.rowcount
        # `Ran(...)` calls its generated `__new__`, which calls tuple's: one call, not two.
        return _new(Ran, (None if count < 0 else count, rows, cursor.lastrowid if last else None))
    except conn.dialect.loaded_dbapi.Error as exc:
        raise compat.driver_error(conn, exc, sql, cursor=cursor, many=many) from exc
    finally:
        cursor.close()


def run_stmt(conn: Connection, stmt: Statement, params: Mapping[str, Any] | None = None) -> Ran:
    """Run `stmt` once with `params` (compiled once: `driver_sql`)."""
    params = params or {}
    sql, getter = driver_sql(conn, stmt, tuple(params))
    return run(conn, sql, params if getter is None else getter(params))


def inserted_id(conn: Connection, stmt: Statement, params: Mapping[str, Any]) -> int:
    """Insert one row with `stmt` and return the key it got, as the driver's `lastrowid` tells
    (where `dialects.says_lastrowid`). It comes with the statement's own answer, where
    RETURNING sends a result set to read: on MariaDB a fifth of a one-row enqueue's CPU."""
    sql, getter = driver_sql(conn, stmt, tuple(params))
    ran = run(conn, sql, params if getter is None else getter(params), last=True)
    if ran.lastrowid is None:
        raise StoreError("the driver did not say which key the inserted row got")
    return int(ran.lastrowid)


def run_many(conn: Connection, stmt: Statement, rows: Sequence[Mapping[str, Any]]) -> Ran:
    """Run `stmt` once per row (all rows share one key set) as one driver executemany."""
    sql, getter = driver_sql(conn, stmt, tuple(rows[0]))
    return run(conn, sql, rows if getter is None else [getter(r) for r in rows], many=True)
