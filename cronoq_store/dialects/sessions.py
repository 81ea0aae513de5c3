"""What each session is told: SQLite's pragmas and BEGIN, the server's bounds on an idle
transaction and a statement's wait, and how another thread interrupts it."""

from __future__ import annotations

import contextlib
import functools
import socket
import sqlite3
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Final

from sqlalchemy import URL, Connection, Engine, Select, bindparam, event, func, select, true
from sqlalchemy.engine.interfaces import Dialect

from .. import execution
from .statements import name
from .translation import SQLITE_TRANSIENT

# SQLite: WAL, synchronous, busy timeout, and BEGIN IMMEDIATE for every transaction.


READ_ONLY: Final = "cronoq_read_only"
"""Execution option marking a transaction that only reads (SQLite begins it deferred)."""


def configure_sqlite(
    engine: Engine, *, full_sync: bool, busy_timeout: timedelta, read_only: bool = False
) -> None:
    """Make `engine`'s connections durable and make every transaction take the write lock.

    pysqlite's own transaction handling is switched off (as SQLAlchemy documents) so that the
    transaction starts with BEGIN IMMEDIATE: the write lock is taken up front, a busy database
    waits `busy_timeout` instead of failing mid-transaction, and the leader row read inside a
    commit cannot change before the commit ends.

    Args:
        engine: A SQLite engine (pysqlite); the app's own, when it shares one with the store.
        full_sync: fsync every commit (`synchronous=FULL`) rather than risk the last commits
            on power loss (`NORMAL`).
        busy_timeout: How long a statement waits for another connection's write lock.
        read_only: Connections that cannot write (`PRAGMA query_only`), whose transactions
            all begin deferred, and that leave the journal mode as it is: for looking at a
            database beside its writer (`cronoq-store status`) without ever holding it up.
    """
    sync = "FULL" if full_sync else "NORMAL"
    busy_ms = int(busy_timeout.total_seconds() * 1000)

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: sqlite3.Connection, _record: object) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {busy_ms}")
            if read_only:
                cursor.execute("PRAGMA query_only = ON")
            else:
                _wal(cursor, busy_timeout)
                cursor.execute(f"PRAGMA synchronous = {sync}")
            cursor.execute("PRAGMA foreign_keys = OFF")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        # Reads (marked READ_ONLY) start deferred: under WAL they never wait for the writer.
        reads = read_only or conn.get_execution_options().get(READ_ONLY, False)
        execution.run(conn, "BEGIN" if reads else "BEGIN IMMEDIATE")


def _wal(cursor: sqlite3.Cursor, busy_timeout: timedelta) -> None:
    """Switch to WAL, waiting up to `busy_timeout` for another connection's lock.

    SQLite answers the switch with SQLITE_BUSY at once, without calling the busy handler,
    while another connection holds a write lock in rollback-journal mode (as a process that
    has just created the file does while others open it): retried here until that lock goes.
    """
    deadline = time.monotonic() + busy_timeout.total_seconds()
    pause = 0.001
    while True:
        try:
            cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            busy = getattr(exc, "sqlite_errorcode", 0) & 0xFF in SQLITE_TRANSIENT
            if not busy or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


IDLE_INFO: Final = "cronoq_idle_s"
"""`Connection.info` key: the MariaDB session's idle_transaction_timeout as we last set it."""


# The pool's reset of a connection coming back to it.

_COMMITTED: Final = "cronoq_committed"
"""In a pooled connection's `info`: the store's transaction on it ended in a COMMIT."""


def _rolls_back_idle(url: URL) -> bool:
    """Whether the driver sends ROLLBACK with no transaction open: PyMySQL does."""
    return url.get_driver_name() == "pymysql"


def pool_options(url: URL) -> dict[str, Any]:
    """`create_engine` options for a server engine the store owns: where the driver rolls back
    with a round trip, the pool does not; `reset_after_commit` does, when it must."""
    return {"pool_reset_on_return": None} if _rolls_back_idle(url) else {}


def reset_after_commit(engine: Engine) -> None:
    """Roll back a connection coming back to `engine`'s pool (made with `pool_options`) unless
    the store's transaction on it committed (`committed`).

    PyMySQL sends ROLLBACK whether or not a transaction is open, so the pool's rollback after
    every COMMIT was one round trip in five of a batch-1 commit. The server's status flags are
    no guide: a read leaves an open snapshot that no flag reports.
    """
    if not _rolls_back_idle(engine.url):
        return

    @event.listens_for(engine, "reset")
    def _reset(dbapi_connection: Any, record: Any, state: Any) -> None:
        committed = record.info.pop(_COMMITTED, False)
        if committed or state.transaction_was_reset or state.terminate_only:
            return  # nothing open, or SQLAlchemy rolled it back, or it is being closed
        dbapi_connection.rollback()


def committed(conn: Connection) -> None:
    """Mark `conn` as ended by a COMMIT: nothing is left for the pool to roll back."""
    conn.connection.info[_COMMITTED] = True


def idle_bound_supported(dialect: Dialect) -> bool:
    """Whether the server can end a session idle inside its transaction: PostgreSQL (9.6+),
    MariaDB 10.3+. SQLite has no server; MySQL has no such setting."""
    which = name(dialect)
    if which == "postgresql":
        return True
    if which == "mysql" and getattr(dialect, "is_mariadb", False):
        version = dialect.server_version_info or (0,)
        return tuple(version[:2]) >= (10, 3)
    return False


def bound_idle(conn: Connection, idle: timedelta | None) -> None:
    """Make the server end this session if it sits idle inside the transaction past `idle`.

    Called first in every transaction that touches the leader row (takes, renewals, commits,
    releases) with `idle` = the lease TTL: a client stopped inside one (SIGSTOP, a VM pause)
    holds the row lock, and with it every standby, only until then; the server rolls the
    transaction back and closes the session. PostgreSQL: `idle_in_transaction_session_timeout`
    for this transaction only (`SET LOCAL`). MariaDB 10.3+: the session's
    `idle_transaction_timeout` (whole seconds, rounded up), set when it differs; any other
    transaction of the store passes None, which puts the server's default back on a
    connection we changed, so long reads are never cut. SQLite and MySQL: nothing (see
    docs/guarantees.md).
    """
    bound(conn, idle=idle, timeout=None)


def bound(
    conn: Connection,
    *,
    idle: timedelta | None,
    timeout: timedelta | None,
    idle_too: bool = True,
    defer: bool = False,
) -> tuple[Select[Any], dict[str, str]] | None:
    """`bound_idle(conn, idle)` (unless not `idle_too`) and, given a `timeout`, a bound on how
    long each statement of this transaction may wait (so a commit cannot hang), in one round
    trip where both need one.

    The statement bound: PostgreSQL's `statement_timeout` for this transaction only; MySQL's
    session lock wait timeout (whole seconds), set once per connection; SQLite waits only for
    other writers, and `busy_timeout` already bounds that.

    On PostgreSQL both are transaction-local `set_config` calls, so one SELECT carries both: a
    commit pays one statement for its bounds, not two. MySQL's are session settings sent only
    when they change, and SQLite needs neither. With `defer`, PostgreSQL's statement and its
    parameters are returned instead of run, for the caller to send with its own
    (`lease.fencing`).
    """
    which = name(conn.dialect)
    if which == "postgresql":
        settings: list[tuple[str, int]] = []
        if idle_too and idle is not None:
            settings.append(("idle_in_transaction_session_timeout", max(1, -(-idle // _MS))))
        if timeout is not None:
            settings.append(("statement_timeout", max(1, timeout // _MS)))
        if settings:
            params = {}
            for i, (setting, ms) in enumerate(settings):
                params[f"n{i}"], params[f"v{i}"] = setting, str(ms)
            if defer:
                return _set_local_stmt(len(settings)), params
            execution.run_stmt(conn, _set_local_stmt(len(settings)), params)
        return None
    if which != "mysql":
        return None
    if timeout is not None:
        seconds = max(1, -(-timeout // timedelta(seconds=1)))
        if conn.info.get("cronoq_lock_wait_s") != seconds:
            conn.exec_driver_sql(f"SET SESSION innodb_lock_wait_timeout = {seconds}")
            conn.info["cronoq_lock_wait_s"] = seconds
    if not idle_too or not idle_bound_supported(conn.dialect):
        return None
    seconds = 0 if idle is None else max(1, -(-idle // timedelta(seconds=1)))
    if conn.info.get(IDLE_INFO, 0) != seconds:
        value = str(seconds) if seconds else "DEFAULT"
        conn.exec_driver_sql(f"SET SESSION idle_transaction_timeout = {value}")
        conn.info[IDLE_INFO] = seconds
    return None


_MS: Final = timedelta(milliseconds=1)


@functools.cache
def _set_local_stmt(count: int) -> Select[Any]:
    """PostgreSQL: `SELECT set_config(:n0, :v0, true), ...`: `count` transaction-local
    settings in one statement."""
    return select(
        *(func.set_config(bindparam(f"n{i}"), bindparam(f"v{i}"), true()) for i in range(count))
    )


def interrupter(conn: Connection) -> Callable[[], None] | None:
    """How another thread stops whatever `conn`'s session waits on (None: no way known), for
    the transaction deadline (`execution.Watchdog`). Safe to call from any thread.

    PostgreSQL: psycopg's `cancel()`, a cancel request on a connection of its own (sync and
    asyncio connections alike). Note that a cancel during a COMMIT's wait for a synchronous
    standby does not undo it: the transaction has committed locally, and COMMIT returns with
    a WARNING; the caller must treat its outcome as unknown. MariaDB/MySQL (PyMySQL): the
    socket is shut down, so the blocked read fails as a lost connection. SQLite:
    `interrupt()`, which rolls back the transaction it stops.
    """
    driver: Any = conn.connection.driver_connection
    which = name(conn.dialect)
    if which == "postgresql":
        cancel: Callable[[], None] | None = getattr(driver, "cancel", None)
        return cancel
    if which == "sqlite":
        return driver.interrupt if isinstance(driver, sqlite3.Connection) else None
    if which == "mysql":
        sock = getattr(driver, "_sock", None)  # PyMySQL's; asyncmy has none to reach
        if isinstance(sock, socket.socket):
            return functools.partial(_shut, sock)
    return None


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already closed
        sock.shutdown(socket.SHUT_RDWR)
