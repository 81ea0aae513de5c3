"""PostgreSQL (psycopg 3, sync and asyncio): pipelines, COPY, arrays, server-side cursors."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, ClassVar, Final

from sqlalchemy import URL, Connection, Engine, Select, bindparam, false, func, select, true
from sqlalchemy.engine.interfaces import Dialect

from .base import (
    Bounds,
    DefaultImpl,
    Risk,
    Rows,
    RowValues,
    connect_with,
    is_off,
    reclass_connections,
)
from .cursor import run_stmt
from .sockets import shut_fd

__all__ = ["PostgresqlImpl"]

_cursor_names = itertools.count()

PG_READ_ONLY: Final = "25006"  # read_only_sql_transaction: a hot standby, a read-only default
PG_DISK_FULL: Final = "53100"


_CASTS: dict[str, dict[str, str]] = {}
"""`pgarrays.kinds` of each SQL text `built_arrays` was given."""


class PostgresqlImpl(DefaultImpl):
    """PostgreSQL on psycopg. Sync psycopg pipelines a transaction's statements (`wire`),
    loads rows with COPY and streams from a named (server-side) cursor; psycopg, sync or
    asyncio, binds an IN list as one array."""

    name: ClassVar[str] = "postgresql"
    transient_codes: ClassVar[frozenset[Any]] = frozenset(
        {
            "40001",  # serialization failure
            "40P01",  # deadlock
            "55P03",  # lock not available
            "57014",  # query canceled: the commit timeout's statement_timeout
            "57P01",  # admin shutdown (pg_terminate_backend)
            "57P02",
            "57P03",
            "08",  # connection exceptions (a class: the SQLSTATE's first two characters)
        }
    )
    read_only_codes: ClassVar[frozenset[Any]] = frozenset({PG_READ_ONLY})
    disk_full_codes: ClassVar[frozenset[Any]] = frozenset({PG_DISK_FULL})
    notifies: ClassVar[bool] = True
    schema_word: ClassVar[str | None] = "PostgreSQL schema"
    creates_schemas: ClassVar[bool] = True
    builds_indexes_concurrently: ClassVar[bool] = True
    storage_parameters: ClassVar[bool] = True

    def __init__(self, dialect: Dialect) -> None:
        super().__init__(dialect)
        psycopg = dialect.driver in ("psycopg", "psycopg_async")
        sync_psycopg = dialect.driver == "psycopg" and not dialect.is_async
        self.pipelined = sync_psycopg
        self.copies = sync_psycopg
        # psycopg parses a statement of more than 50 parameters anew on every execution
        # (its cache stops there), a tenth of a 1000-row drain's time; one array, once.
        self.binds_arrays = psycopg
        # psycopg 3's notifies wait, sync or asyncio; its dumpers send an array in binary
        # without the escaping regex its text form runs element by element.
        self.listens = dialect.driver == "psycopg"
        self.binary_arrays = dialect.driver == "psycopg"

    @classmethod
    def engine_options(cls, url: URL) -> dict[str, Any]:
        """psycopg: no native HSTORE (the store has no such column), so a new engine's first
        connection does not look the type up: three round trips (a SAVEPOINT, the query, a
        RELEASE) of its initialisation."""
        return {"use_native_hstore": False} if cls.on_libpq(url) else {}

    @classmethod
    def on_libpq(cls, url: URL) -> bool:
        """psycopg, sync or asyncio."""
        return url.get_driver_name() in ("psycopg", "psycopg_async")

    def streaming_cursor(self, dbapi_connection: Any) -> Any | None:
        """Sync psycopg's named (server-side) cursor."""
        if not self.copies:  # sync psycopg: the same test
            return None
        return dbapi_connection.cursor(name=f"cronoq_stream_{next(_cursor_names)}")

    def built_arrays(
        self, driver_connection: Any, sql: str, params: Mapping[str, Any]
    ) -> Mapping[str, Any]:
        """psycopg's binary arrays (`%(name)b::TYPE`) built by `pgarrays`, each column's
        distinct values encoded once, where psycopg dumps element by element."""
        from . import pgarrays  # psycopg's own module: loaded only where psycopg runs

        casts = _CASTS.get(sql)
        if casts is None:
            casts = _CASTS.setdefault(sql, pgarrays.kinds(sql))
        return pgarrays.binary(driver_connection, params, casts) if casts else params

    def copy_rows(self, cursor: Any, sql: str, rows: Rows, values: RowValues) -> None:
        """psycopg's `cursor.copy`, one `write_row` per row."""
        with cursor.copy(sql) as copy:
            write = copy.write_row
            for row in rows:
                write(values(row))

    def short_lock_waits(
        self, conn: Connection, *, ms: int, seconds: int
    ) -> Callable[[], object] | None:
        """The session's `lock_timeout`, put back with `set_config` (a value with units)."""
        before = conn.exec_driver_sql("SHOW lock_timeout").scalar_one()
        conn.exec_driver_sql(f"SET lock_timeout = '{ms}ms'")
        return lambda: conn.execute(select(func.set_config("lock_timeout", before, false())))

    def interrupter(self, driver_connection: Any) -> Callable[[], None] | None:
        """Shut libpq's socket down (sync and asyncio), so the blocked read fails at once as a
        lost connection, whether or not the server can still be reached. (psycopg's `cancel()`
        sends a cancel request on a connection of its own: to a server cut off silently, it
        waited as long as the network let it, holding the GIL, and every thread of the process
        stood still.) The server ends the transaction when it notices the socket closed, or
        when its own bounds end the statement (`dialects.bound`); until then a COMMIT that was
        sent may still land, so its outcome is unknown."""
        pgconn = getattr(driver_connection, "pgconn", None)
        return None if pgconn is None else functools.partial(_shut_pgconn, pgconn)

    acknowledged: ClassVar[str] = (
        "the server has flushed the commit's WAL to this server's disk (fsync on, "
        "synchronous_commit not off); a failover to a standby keeps it only with synchronous "
        "replication (see 'server')"
    )

    durability_risks: ClassVar[tuple[Risk, ...]] = (
        Risk(
            "fsync",
            is_off,
            "nothing is flushed to disk: a crash of the machine loses commits "
            "and can corrupt the whole cluster",
        ),
        Risk(
            "synchronous_commit",
            lambda value: value == "off",
            "a commit is acknowledged before its WAL is flushed: "
            "a crash loses up to 3 x wal_writer_delay of acknowledged commits",
        ),
        Risk(
            "full_page_writes",
            is_off,
            "a page torn by a power loss cannot be repaired from the "
            "WAL: committed rows can be lost or the database corrupted",
        ),
    )
    """`fsync` off, `synchronous_commit` off, `full_page_writes` off."""

    def hook_cursors(self, engine: Engine, hooked: Callable[[type[Any]], type[Any]]) -> bool:
        """Sync psycopg: its `cursor_factory`."""
        if not self.pipelined:  # sync psycopg: the same test
            return False
        import psycopg

        connect_with(engine, "cursor_factory", psycopg.Cursor, hooked)
        return True

    def hook_commits(self, engine: Engine, committing: Callable[[type[Any]], type[Any]]) -> bool:
        """Sync psycopg: each connection becomes one of `committing`'s class (its COMMIT
        statements, sent in pipelines, are the caller's to watch)."""
        if not self.pipelined:
            return False
        reclass_connections(engine, committing)
        return True

    def bounds_idle(self) -> bool:
        """`idle_in_transaction_session_timeout` (9.6+)."""
        return True

    def bound(
        self, conn: Connection, bounds: Bounds, *, defer: bool
    ) -> tuple[Select[Any], dict[str, str]] | None:
        """Transaction-local `set_config` calls, all in one SELECT: the idle bound, the
        `statement_timeout` and a shorter `lock_timeout`; with `defer`, the statement and its
        parameters are returned for the caller to send with its own (`lease.fencing`)."""
        idle, timeout, lock, idle_too = bounds
        settings: list[tuple[str, int]] = []
        if idle_too and idle is not None:
            settings.append(("idle_in_transaction_session_timeout", max(1, -(-idle // _MS))))
        if timeout is not None:
            settings.append(("statement_timeout", max(1, timeout // _MS)))
            if lock is not None and lock < timeout:
                settings.append(("lock_timeout", max(1, lock // _MS)))
        if settings:
            params = {}
            for i, (setting, ms) in enumerate(settings):
                params[f"n{i}"], params[f"v{i}"] = setting, str(ms)
            if defer:
                return _set_local_stmt(len(settings)), params
            run_stmt(conn, _set_local_stmt(len(settings)), params)
        return None

    async_driver: ClassVar[str | None] = "psycopg"
    sync_drivers: ClassVar[frozenset[str]] = frozenset({"psycopg", "psycopg2"})
    wire: ClassVar[str | None] = "postgresql"
    default_port: ClassVar[int | None] = 5432
    plaintext_query: ClassVar[Mapping[str, str]] = {"sslmode": "disable", "gssencmode": "disable"}
    explain_json: ClassVar[str | None] = "EXPLAIN (FORMAT JSON)"
    analyze_sql: ClassVar[str | None] = "VACUUM ANALYZE"
    checkpoint_sql: ClassVar[str | None] = "CHECKPOINT"  # refused to an unprivileged user


_MS: Final = timedelta(milliseconds=1)


@functools.cache
def _set_local_stmt(count: int) -> Select[Any]:
    """`SELECT set_config(:n0, :v0, true), ...`: `count` transaction-local settings in one
    statement."""
    return select(
        *(func.set_config(bindparam(f"n{i}"), bindparam(f"v{i}"), true()) for i in range(count))
    )


def _shut_pgconn(pgconn: Any) -> None:
    """Shut down libpq's socket, read afresh (a closed connection has none: nothing to do)."""
    try:
        fd = pgconn.socket
    except Exception:  # psycopg's OperationalError: the connection is closed already
        return
    shut_fd(fd)
