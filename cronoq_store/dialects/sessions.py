"""What each session is told: SQLite's pragmas and BEGIN, the server's bounds on an idle
transaction and a statement's wait; how another thread interrupts it is the database
class's (`DefaultImpl.interrupter`)."""

from __future__ import annotations

import contextlib
import os
import socket
import sqlite3
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Final

from sqlalchemy import URL, Connection, Engine, Select, event
from sqlalchemy.engine.interfaces import Dialect

from .base import Bounds, dialect_of
from .cursor import STORE_BEGIN, run
from .mysql import IDLE_INFO as IDLE_INFO
from .sqlite import SQLITE_TRANSIENT

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
        options = conn.get_execution_options()
        reads = read_only or options.get(READ_ONLY, False)
        run(conn, "BEGIN" if reads else "BEGIN IMMEDIATE", options=options)

    # What it begins a commit's (a writing) transaction with, for a commit that begins its own
    # (`face.transactions`, past SQLAlchemy's transaction).
    setattr(_begin, STORE_BEGIN, "BEGIN" if read_only else "BEGIN IMMEDIATE")


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


# The pool's reset of a connection coming back to it.

COMMITTED: Final = "cronoq_committed"
"""In a pooled connection's `info`: the store's transaction on it ended in a COMMIT
(`committed`, or set in `Line.info` directly)."""


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
        committed = record.info.pop(COMMITTED, False)
        if committed or state.transaction_was_reset or state.terminate_only:
            return  # nothing open, or SQLAlchemy rolled it back, or it is being closed
        dbapi_connection.rollback()


def committed(conn: Connection) -> None:
    """Mark `conn` as ended by a COMMIT: nothing is left for the pool to roll back."""
    conn.connection.info[COMMITTED] = True


def idle_bound_supported(dialect: Dialect) -> bool:
    """Whether the server can end a session idle inside its transaction: PostgreSQL (9.6+),
    MariaDB 10.3+. SQLite has no server; MySQL has no such setting."""
    return dialect_of(dialect).bounds_idle()


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
    lock: timedelta | None = None,
) -> tuple[Select[Any], dict[str, str]] | None:
    """`bound_idle(conn, idle)` (unless not `idle_too`) and, given a `timeout`, a bound on how
    long each statement of this transaction may wait (so a commit cannot hang), in one round
    trip where both need one.

    The statement bound: PostgreSQL's `statement_timeout` for this transaction only; MySQL's
    session lock wait timeout (whole seconds), set once per connection; SQLite waits only for
    other writers, and `busy_timeout` already bounds that. `lock` (with a `timeout`) bounds a
    wait for a lock shorter still: PostgreSQL's `lock_timeout`, MySQL's InnoDB lock wait. A
    commit holds the lease row while it waits, so the keeper's renewal queues behind it: its
    wait must end in time for the renewal (`face.plan`).

    On PostgreSQL both are transaction-local `set_config` calls, so one SELECT carries both: a
    commit pays one statement for its bounds, not two. MySQL's are session settings sent only
    when they change, and SQLite needs neither. With `defer`, PostgreSQL's statement and its
    parameters are returned instead of run, for the caller to send with its own
    (`lease.fencing`). Each server's way is its class's `bound` (`dialect_of`).
    """
    impl = dialect_of(conn)
    if not impl.server:  # a file has nothing to bound: its commit pays no second call
        return None
    return impl.bound(conn, Bounds(idle, timeout, lock, idle_too), defer=defer)


def interrupter(conn: Connection) -> Callable[[], None] | None:
    """`interrupter_of` `conn`'s driver connection."""
    return dialect_of(conn).interrupter(conn.connection.driver_connection)


def interrupter_of(dialect: Dialect, driver: Any) -> Callable[[], None] | None:
    """How another thread stops whatever the session of `driver` (a driver's connection)
    waits on (None: no way known), for an operation's deadline (`execution.Watchdog`): the
    database class's `interrupter` (`dialect_of`). Safe to call from any thread, and it never
    blocks: no new connection to the server.

    PostgreSQL (psycopg, sync and asyncio) and MariaDB/MySQL (PyMySQL, asyncmy): the socket is
    shut down, so the blocked read fails at once as a lost connection. SQLite: `interrupt()`,
    which rolls back the transaction it stops.
    """
    return dialect_of(dialect).interrupter(driver)


# The network under the store's own connections.

CONNECT_TIMEOUT: Final = 10.0
"""Seconds a connection attempt may take outside any operation's bound (`open`, a migration,
a status read): libpq's `connect_timeout` and PyMySQL's, unless the URL says otherwise."""

KEEPALIVE_IDLE: Final = 5
"""Seconds a connection of the store's may sit silent before TCP probes its peer."""
KEEPALIVE_INTERVAL: Final = 2
"""Seconds between unanswered probes."""
KEEPALIVE_COUNT: Final = 3
"""Unanswered probes after which the connection is dropped."""
TCP_USER_TIMEOUT_MS: Final = 10_000
"""Milliseconds data sent may stay unacknowledged before the kernel drops the connection."""


def net_options(url: URL, connect_args: dict[str, Any]) -> dict[str, Any]:
    """`connect_args` for an engine the store creates, with TCP keepalives, a TCP user timeout
    and a connect timeout added where the URL (or `connect_args`) does not set them: libpq's
    `keepalives*`, `tcp_user_timeout` and `connect_timeout` on psycopg. A server cut off
    silently (no RST, no ICMP) then costs a connection of the store's at most about
    `TCP_USER_TIMEOUT_MS`, or the probes' 11 s when idle, where a read outside any bound
    waited for TCP's own retransmissions (15 minutes). PyMySQL's are set on its socket once it
    connects (`tune_sockets`), its connect timeout (10 s) being its default already."""
    if url.get_driver_name() not in ("psycopg", "psycopg_async"):
        return connect_args
    defaults: dict[str, Any] = {
        "connect_timeout": str(int(CONNECT_TIMEOUT)),
        "keepalives": "1",
        "keepalives_idle": str(KEEPALIVE_IDLE),
        "keepalives_interval": str(KEEPALIVE_INTERVAL),
        "keepalives_count": str(KEEPALIVE_COUNT),
    }
    if _libpq_version() >= 120000:  # tcp_user_timeout came with libpq 12
        defaults["tcp_user_timeout"] = str(TCP_USER_TIMEOUT_MS)
    given = set(url.query) | set(connect_args)
    return {**{k: v for k, v in defaults.items() if k not in given}, **connect_args}


def _libpq_version() -> int:
    import psycopg

    return int(psycopg.pq.version())


def tune_sockets(engine: Engine) -> None:
    """On PyMySQL and asyncmy, give every new connection's socket TCP keepalives and a TCP
    user timeout (`net_options` says why); other drivers take them as options, or have no
    socket. (Socket options belong to the socket, not the descriptor: a duplicate sets them.)"""
    if engine.dialect.driver not in ("pymysql", "asyncmy"):
        return

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: Any, _record: object) -> None:
        driver = getattr(dbapi_connection, "driver_connection", dbapi_connection)
        sock = getattr(driver, "_sock", None)
        transport = getattr(driver, "_transport", None)
        if sock is None and transport is not None:  # asyncmy: the transport's socket
            raw = transport.get_extra_info("socket")
            sock = None if raw is None else socket.socket(fileno=os.dup(raw.fileno()))
            if sock is not None:
                with contextlib.closing(sock):
                    _keepalive(sock)
            return
        if isinstance(sock, socket.socket):
            _keepalive(sock)


def _keepalive(sock: socket.socket) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError, AttributeError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_COUNT)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, TCP_USER_TIMEOUT_MS)
