"""Every difference between SQLite, PostgreSQL and MariaDB/MySQL that the store must know.

Everything else is dialect-neutral Core. Keep this module small: when a difference can be
expressed portably, it does not belong here.
"""

from __future__ import annotations

__all__ = [
    "configure_sqlite",
    "redact",
    "translate",
]

import contextlib
import functools
import re
import socket
import sqlite3
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Final
from urllib.parse import parse_qsl

from sqlalchemy import (
    URL,
    BigInteger,
    Connection,
    Engine,
    Insert,
    Select,
    Table,
    bindparam,
    cast,
    event,
    func,
    literal,
    literal_column,
    make_url,
    select,
    table,
    true,
)
from sqlalchemy import column as sql_column
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine.interfaces import Dialect
from sqlalchemy.exc import CompileError
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.schema import CreateSchema
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from . import execution, galera
from .errors import InvalidValue, StoreError, StoreUnavailable

MIGRATION_LOCK_KEY: Final = 0x63726F6E6F71  # "cronoq"
MIGRATION_LOCK_NAME: Final = "cronoq_store.migrate"
MIGRATION_LOCK_TIMEOUT_S: Final = 300


def name(dialect: Dialect) -> str:
    """ "sqlite", "postgresql" or "mysql" (MariaDB included)."""
    return "mysql" if dialect.name in ("mysql", "mariadb") else dialect.name


def mysql_collation(dialect: Dialect) -> str:
    """A binary collation without trailing-space padding, so "a" and "a " are distinct keys."""
    return "utf8mb4_nopad_bin" if getattr(dialect, "is_mariadb", False) else "utf8mb4_0900_bin"


class db_now_ns(FunctionElement[int]):
    """Unix nanoseconds on the database's clock: one clock for every host sharing a server.

    One expression, compiled per dialect: `clock_timestamp()` on PostgreSQL (the time of
    evaluation, not of the transaction's start), `UTC_TIMESTAMP(6)` on MariaDB/MySQL (UTC, so
    the session's time zone and its daylight-saving jumps cannot shift it; `NOW(6)` through
    `UNIX_TIMESTAMP` is ambiguous for an hour each autumn). SQLite has no server: the processes
    sharing its file share the host's clock instead, bound as `b_host_now` (pass that parameter
    to judge a lease at another instant).
    """

    type = BigInteger()
    name = "db_now_ns"
    inherit_cache = True


def host_now_ns() -> int:
    """The host's wall clock in Unix nanoseconds, read when a SQLite statement runs."""
    return time.time_ns()


@compiles(db_now_ns)
def _db_now_unknown(element: db_now_ns, compiler: SQLCompiler, **kw: Any) -> str:
    raise CompileError(f"no database clock known for dialect {compiler.dialect.name!r}")


@compiles(db_now_ns, "postgresql")
def _db_now_postgresql(element: db_now_ns, compiler: SQLCompiler, **kw: Any) -> str:
    seconds = func.extract("epoch", func.clock_timestamp())  # numeric, microseconds exact
    return compiler.process(
        cast(seconds * 1_000_000_000, BigInteger), **{**kw, "literal_binds": True}
    )


@compiles(db_now_ns, "mysql", "mariadb")
def _db_now_mysql(element: db_now_ns, compiler: SQLCompiler, **kw: Any) -> str:
    micros = func.timestampdiff(
        literal_column("MICROSECOND"), literal("1970-01-01 00:00:00"), func.utc_timestamp(6)
    )
    return compiler.process(micros * 1000, **{**kw, "literal_binds": True})


@compiles(db_now_ns, "sqlite")
def _db_now_sqlite(element: db_now_ns, compiler: SQLCompiler, **kw: Any) -> str:
    host_now = bindparam("b_host_now", type_=BigInteger, callable_=host_now_ns)
    return compiler.process(host_now, **kw)


# SQLite: WAL, synchronous, busy timeout, and BEGIN IMMEDIATE for every transaction.


READ_ONLY: Final = "cronoq_read_only"
"""Execution option marking a transaction that only reads (SQLite begins it deferred)."""


def configure_sqlite(engine: Engine, *, full_sync: bool, busy_timeout: timedelta) -> None:
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
    """
    sync = "FULL" if full_sync else "NORMAL"
    busy_ms = int(busy_timeout.total_seconds() * 1000)

    @event.listens_for(engine, "connect")
    def _connect(dbapi_connection: sqlite3.Connection, _record: object) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {busy_ms}")
            _wal(cursor, busy_timeout)
            cursor.execute(f"PRAGMA synchronous = {sync}")
            cursor.execute("PRAGMA foreign_keys = OFF")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        # Reads (marked READ_ONLY) start deferred: under WAL they never wait for the writer.
        read_only = conn.get_execution_options().get(READ_ONLY, False)
        execution.run(conn, "BEGIN" if read_only else "BEGIN IMMEDIATE")


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
            busy = getattr(exc, "sqlite_errorcode", 0) & 0xFF in _SQLITE_TRANSIENT
            if not busy or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def insert_ignoring(dialect: Dialect, target: Table) -> Insert | None:
    """An INSERT into `target` that skips a row whose primary key is stored already and
    returns the primary key of each row it inserted, or None where there is none to trust.

    PostgreSQL's `ON CONFLICT (pk) DO NOTHING` and SQLite's (3.35+, for RETURNING) name the
    primary key alone, so any other unique index (a live key in use) still refuses the row.
    MariaDB/MySQL have no such form: `INSERT IGNORE` and `ON DUPLICATE KEY` would also swallow
    a live-key conflict (and IGNORE turns bad values into warnings), so none is given there.
    """
    return _insert_ignoring(name(dialect), target)


@functools.cache
def _insert_ignoring(which: str, target: Table) -> Insert | None:
    key = list(target.primary_key.columns)
    if which == "postgresql":
        return postgresql.insert(target).on_conflict_do_nothing(index_elements=key).returning(*key)
    if which == "sqlite" and sqlite3.sqlite_version_info >= (3, 35):
        return sqlite.insert(target).on_conflict_do_nothing(index_elements=key).returning(*key)
    return None


def delete_joins(dialect: Dialect) -> bool:
    """Whether a DELETE of rows chosen by a subquery should join it rather than test IN.

    MariaDB/MySQL run a single-table `DELETE ... WHERE id IN (subquery)` as a dependent
    subquery probed for every row of the table, a full scan per prune batch; their
    multi-table DELETE joins the derived rows by primary key. SQLite has no such DELETE, and
    PostgreSQL plans the IN as a semi-join already.
    """
    return name(dialect) == "mysql"


def database_size_stmt(dialect: Dialect, schema: str | None) -> Select[Any]:
    """The size of the whole database in bytes, as each dialect reports it."""
    which = name(dialect)
    if which == "postgresql":
        return select(func.pg_database_size(func.current_database()))
    if which == "mysql":
        info = table(
            "tables",
            sql_column("table_schema"),
            sql_column("data_length"),
            sql_column("index_length"),
            schema="information_schema",
        )
        return select(func.coalesce(func.sum(info.c.data_length + info.c.index_length), 0)).where(
            info.c.table_schema == (schema if schema else func.database())
        )
    pages = func.pragma_page_count().table_valued("page_count")
    size = func.pragma_page_size().table_valued("page_size")
    return select(
        select(pages.c.page_count).scalar_subquery() * select(size.c.page_size).scalar_subquery()
    )


def server_role_stmt(dialect: Dialect) -> Select[Any] | None:
    """PostgreSQL: whether the server is a standby, its synchronous standbys as configured and
    as connected, and `synchronous_commit`: what decides whether a failover can lose
    acknowledged commits (docs/deploying.md). None elsewhere."""
    if name(dialect) != "postgresql":
        return None
    replication = table("pg_stat_replication", sql_column("sync_state"), schema="pg_catalog")
    connected = (
        select(func.count())
        .select_from(replication)
        .where(replication.c.sync_state.in_(("sync", "quorum")))
        .scalar_subquery()
    )
    return select(
        func.pg_is_in_recovery().label("standby"),
        func.current_setting("synchronous_standby_names").label("names"),
        func.current_setting("synchronous_commit").label("commit"),
        connected.label("connected"),
    )


def database_exists(conn: Connection, schema: str) -> bool:
    """MySQL: whether the server has a database named `schema` (its --schema)."""
    schemata = table("schemata", sql_column("schema_name"), schema="information_schema")
    found = conn.execute(select(literal(1)).where(schemata.c.schema_name == schema)).first()
    return found is not None


def create_database(conn: Connection, schema: str) -> None:
    """MySQL: create the database `schema` if it is missing (the tables name their charset)."""
    conn.execute(CreateSchema(schema, if_not_exists=True))


# Migrations run under one cross-process lock per database.


def _no_renewal() -> None:
    """What a migration lock that needs no renewal hands out."""


@contextlib.contextmanager
def migration_lock(conn: Connection, *, schema: str | None = None) -> Iterator[Callable[[], None]]:
    """Hold the migration lock on `conn` (which must be in a transaction) for the block.

    Yields `renew`, which the migration calls after each revision step, in the transaction that
    writes the step's version row: it extends a lock that can expire (Galera's) and fails if the
    lock was lost. `schema`: the database (MySQL) whose lock this is, if not `conn`'s own.
    """
    dialect = name(conn.dialect)
    if dialect == "sqlite":
        # The write transaction is the lock. An engine of ours began it with BEGIN IMMEDIATE;
        # on an app's engine pysqlite has not started one yet, so take it here.
        driver = conn.connection.driver_connection  # sqlite3's, or aiosqlite's
        if driver is not None and not driver.in_transaction:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        yield _no_renewal
    elif dialect == "postgresql":
        conn.execute(select(func.pg_advisory_xact_lock(MIGRATION_LOCK_KEY)))
        yield _no_renewal
    elif dialect == "mysql" and galera.is_galera(conn):
        # GET_LOCK holds on one node only: a row certification makes cluster-wide (galera.py).
        holder = galera.new_holder()
        galera.acquire(conn, holder, timeout_s=MIGRATION_LOCK_TIMEOUT_S, schema=schema)
        try:
            yield functools.partial(galera.renew, conn, holder, schema=schema)
            conn.exec_driver_sql("COMMIT")  # the last version row, before the lock is free
        except BaseException:
            # Freeing commits: the failed run's uncommitted writes must not ride along. A dead
            # session cannot free it: the lock then expires (galera.LOCK_TTL_S).
            if not conn.invalidated:
                with contextlib.suppress(sa_exc.SQLAlchemyError):
                    conn.exec_driver_sql("ROLLBACK")
                    galera.release(conn, holder, schema=schema)
            raise
        galera.release(conn, holder, schema=schema)
    elif dialect == "mysql":
        # MySQL commits DDL implicitly, so the lock must outlive transactions: a named lock.
        got = conn.execute(
            select(func.get_lock(MIGRATION_LOCK_NAME, MIGRATION_LOCK_TIMEOUT_S))
        ).scalar()
        if got != 1:
            raise StoreUnavailable("timed out waiting for the migration lock")
        try:
            yield _no_renewal
            # The lock outlives the transaction too: commit the last version-table write
            # before the next process may read it, or it would run the same step again.
            conn.exec_driver_sql("COMMIT")
        finally:
            # A session the server ended took its lock with it; releasing it on the dead
            # connection would only hide why the migration failed (PendingRollbackError).
            if not conn.invalidated:
                conn.execute(select(func.release_lock(MIGRATION_LOCK_NAME)))
    else:
        raise StoreError(f"unsupported dialect {conn.dialect.name!r}")


IDLE_INFO: Final = "cronoq_idle_s"
"""`Connection.info` key: the MariaDB session's idle_transaction_timeout as we last set it."""


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


# Errors: what is worth retrying becomes StoreUnavailable; the rest StoreError. Passwords never
# reach a message.

_SQLITE_TRANSIENT: Final = frozenset({5, 6})  # SQLITE_BUSY, SQLITE_LOCKED (primary codes)
_PG_TRANSIENT_SQLSTATE: Final = (
    "40001",  # serialization failure
    "40P01",  # deadlock
    "55P03",  # lock not available
    "57014",  # query canceled: the commit timeout's statement_timeout
    "57P01",  # admin shutdown (pg_terminate_backend)
    "57P02",
    "57P03",
    "08",  # connection exceptions
)
_MYSQL_TRANSIENT: Final = frozenset(
    {
        1205,  # lock wait timeout
        1213,  # deadlock
        2002,  # cannot connect
        2003,  # cannot connect
        2006,  # server has gone away
        2013,  # lost connection during query
        2055,  # lost connection
        1927,  # connection killed (MariaDB)
        1053,  # server shutdown in progress
        3024,  # query execution interrupted, maximum statement execution time exceeded
        1684,  # table skipped: its definition is being changed by concurrent DDL (Galera TOI)
        1047,  # Galera: the node is not ready (not in the primary component): try another time
    }
)
SECRET_QUERY_KEYS: Final = frozenset({"password", "passwd", "pwd", "sslpassword"})
"""URL query options whose value is a password (psycopg and PyMySQL accept them)."""
_PASSWORD = re.compile(
    r"(?i)\b(password|passwd|pwd|sslpassword)\s*=\s*('[^']*'|\"[^\"]*\"|[^\s&;,)'\"]+)"
)
# Up to the LAST '@' of the URL's text: an unencoded '@' in a password must not cut it short.
_URL_PASSWORD = re.compile(r"(\w+(?:\+\w+)?://[^:/@\s]*:)\S*@")


def redact(text: str) -> str:
    """`text` with anything that looks like a password replaced by ***: the one place every
    printed URL and database message goes through.

    Args:
        text: A URL or a message that may hold one (`user:secret@host`, `password=secret`).

    Returns:
        The text with each such password replaced by `***`.
    """
    return _PASSWORD.sub(r"\1=***", _URL_PASSWORD.sub(r"\1***@", text))


def safe_url(url: URL) -> str:
    """`url` as it may be printed: its password and any password query option masked."""
    query = {k: ("***" if k.lower() in SECRET_QUERY_KEYS else v) for k, v in url.query.items()}
    text = url.set(query=query).render_as_string(hide_password=True)
    return redact(text.replace("%2A%2A%2A", "***"))


def parse_url(text: str) -> URL:
    """A database URL, or `InvalidValue` naming what is wrong and never showing the password.

    A URL whose user or password holds an unencoded '@' is refused: SQLAlchemy would split it
    at the first one and hand the rest of the password to the driver as the host name, which
    then prints it in its error ("failed to resolve host 'ssW0rd@127.0.0.1'").
    """
    scheme, _, rest = text.partition("://")
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0] if "@" in rest else ""
    if authority.count("@") > 1 or (not authority and rest.split("?", 1)[0].count("@") > 1):
        raise InvalidValue(
            f"bad database URL {scheme}://...: more than one '@' before the host; "
            "a password (or user name) holding '@' must be percent-encoded, '@' as %40"
        )
    try:
        url = make_url(text)
    except (sa_exc.ArgumentError, ValueError) as exc:
        raise InvalidValue(redact(f"bad database URL: {exc}")) from exc
    if url.get_backend_name() not in {"sqlite", *_DRIVERS}:
        raise InvalidValue(
            f"bad database URL: {scheme}:// is not a database cronoq-store knows; {URL_FORMS}"
        )
    # SQLAlchemy drops an option with an empty value; `?prepare_threshold=` means None.
    query = text.partition("?")[2].partition("#")[0]
    blank = {k for k, v in parse_qsl(query, keep_blank_values=True) if not v}
    if PREPARE_THRESHOLD in blank and PREPARE_THRESHOLD not in url.query:
        url = url.update_query_dict({PREPARE_THRESHOLD: ""})
    return url


URL_FORMS: Final = (
    "write sqlite:///PATH (or a bare file path), postgresql+psycopg://USER:PASSWORD@HOST:PORT/DB "
    "or mysql+pymysql://USER:PASSWORD@HOST:PORT/DB"
)
"""The URL forms the store is tested with, for a message about a URL it cannot use."""


PREPARE_THRESHOLD: Final = "prepare_threshold"
"""psycopg's option: executions of a statement before it is prepared on the server (None:
never). Not a libpq option, so SQLAlchemy hands psycopg the URL's text as it is."""


def connect_options(url: URL) -> tuple[URL, dict[str, Any]]:
    """`url` without the driver options SQLAlchemy would pass on as text where the driver
    needs a number, and those options as the driver takes them (`connect_args`).

    Only psycopg's `prepare_threshold` is such an option (libpq's own take text): from a URL
    psycopg got '0' and failed at the first statement comparing it with a count
    (`TypeError`). `?prepare_threshold=0` is 0, `?prepare_threshold=` (or `none`) None.
    """
    if PREPARE_THRESHOLD not in url.query or url.get_driver_name() not in (
        "psycopg",
        "psycopg_async",
    ):
        return url, {}
    value = url.query[PREPARE_THRESHOLD]
    text = value if isinstance(value, str) else ",".join(value)
    threshold: int | None
    if text.strip().lower() in ("", "none"):
        threshold = None
    elif re.fullmatch(r"\s*\d+\s*", text):
        threshold = int(text)
    else:
        raise InvalidValue(
            f"bad database URL option prepare_threshold={text!r}: a whole number of executions "
            "before psycopg prepares a statement, or empty (or none) never to prepare"
        )
    return url.difference_update_query([PREPARE_THRESHOLD]), {PREPARE_THRESHOLD: threshold}


_HOST_WITH_PORT = re.compile(r"[^:,\[\]]+:\d+")


def check_url(url: URL) -> URL:
    """`url`, or `InvalidValue` for options that break the store or can never connect.

    `autocommit` in the URL: the store runs its own transactions, and psycopg reads any text
    (`autocommit=false` too) as true, so a commit's fence check and its writes would each
    commit on their own. PostgreSQL host lists: libpq reads `?host=a:5433,b:5434` as two host
    names with colons in them ("failed to resolve host 'b:5434'"), and a port list whose
    length fits neither one port nor one per host is refused at every connect: errors a
    leader would retry as unavailable forever.
    """
    if any(key.lower() == "autocommit" for key in url.query):
        raise InvalidValue(
            "bad database URL: leave autocommit out of it; the store begins and commits its "
            "own transactions (and psycopg reads autocommit=false as true)"
        )
    if url.get_backend_name() not in ("postgresql", "postgres"):
        return url
    hosts = url.query.get("host", ())
    hosts = (hosts,) if isinstance(hosts, str) else tuple(hosts)
    forms = (
        "one host= per server with its port (?host=h1:5432&host=h2:5432), or host and port "
        "lists (?host=h1,h2&port=5432,5432), with target_session_attrs=read-write"
    )
    for value in hosts:
        names = value.split(",")
        if len(names) > 1 and any(_HOST_WITH_PORT.fullmatch(n.strip()) for n in names):
            raise InvalidValue(
                f"bad database URL: host={value!r} puts ports inside a host list, which "
                f"libpq reads as host names; write {forms}"
            )
    port = url.query.get("port")
    if isinstance(port, str) and len(hosts) == 1:
        count, ports = len(hosts[0].split(",")), len(port.split(","))
        if ports not in (1, count):
            raise InvalidValue(f"bad database URL: {ports} ports for {count} hosts; write {forms}")
    return url


_DRIVERS: Final = {
    "postgresql": ("postgresql+psycopg", "postgresql", "psycopg"),
    "postgres": ("postgresql+psycopg", "postgresql", "psycopg"),
    "mysql": ("mysql+pymysql", "mysql", "pymysql"),
    "mariadb": ("mysql+pymysql", "mysql", "pymysql"),
}
"""Backend name: the URL scheme to write, the extra that installs its driver, the driver."""


def url_advice(url: URL) -> str:
    """What to do about a URL whose dialect or driver cannot be loaded ("" if we know none):
    the extra to install and the URL form the store is tested with."""
    backend = url.get_backend_name()
    if backend not in _DRIVERS:
        return ""
    scheme, extra, driver = _DRIVERS[backend]
    form = safe_url(url.set(drivername=scheme))
    install = f"pip install 'cronoq-store[{extra}]'"
    if backend == "postgres":
        return (
            f"SQLAlchemy does not know postgres:// (it names the dialect postgresql): "
            f"write {form} ({install})"
        )
    try:
        named = url.get_driver_name()
    except sa_exc.SQLAlchemyError:
        return ""
    if named == driver:
        return f"its driver {driver} is not installed: {install}"
    return (
        f"{url.drivername}:// means the {named} driver, which cronoq-store "
        f"does not install: write {form} ({install})"
    )


_PG_READ_ONLY: Final = "25006"  # read_only_sql_transaction: a hot standby, a read-only default
_MYSQL_READ_ONLY: Final = frozenset(
    {
        1290,  # the server runs with --read-only (read_only = ON)
        1836,  # running in read-only mode
    }
)


def read_only(exc: BaseException) -> bool:
    """Whether `exc` is a server refusing writes: a PostgreSQL hot standby (or a primary being
    demoted: SQLSTATE 25006), a MariaDB/MySQL server in read-only mode (errors 1290, 1836).

    That server is not the primary (now): the error is `StoreUnavailable`, and the connection
    that met it must be dropped, not pooled (`store.transaction` does), so that the next one
    asks the URL anew: a multi-host URL with target_session_attrs=read-write, or a DNS name
    that moved, reaches the new primary.
    """
    orig: Any = exc.orig if isinstance(exc, sa_exc.DBAPIError) else exc
    args: Any = getattr(orig, "args", ())
    if args and isinstance(args[0], int):  # MySQL drivers: (errno, message); PyMySQL also
        return args[0] in _MYSQL_READ_ONLY  # sets a generic sqlstate, HY000
    sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    return bool(sqlstate == _PG_READ_ONLY)


def _is_transient(exc: sa_exc.DBAPIError) -> bool:
    if exc.connection_invalidated or read_only(exc):
        return True
    orig: Any = exc.orig
    if isinstance(orig, sqlite3.Error):
        code = getattr(orig, "sqlite_errorcode", None)
        if code is not None:
            return code & 0xFF in _SQLITE_TRANSIENT
        return "locked" in str(orig) or "busy" in str(orig)
    args = getattr(orig, "args", ())
    if args and isinstance(args[0], int):  # MySQL drivers: (errno, message)
        return args[0] in _MYSQL_TRANSIENT
    sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    if isinstance(sqlstate, str):
        return sqlstate.startswith(_PG_TRANSIENT_SQLSTATE)
    return isinstance(exc, sa_exc.OperationalError) and type(orig).__module__.startswith("psycopg")


_CAUSES: Final = (
    (
        re.compile(
            r"Access denied for user '([^']*)'"
            r"|password authentication failed for user \"([^\"]*)\""
            r"|role \"([^\"]*)\" does not exist"
        ),
        "access denied for user {!r}: check the URL's user and password",
    ),
    (
        re.compile(r"Unknown database '([^']*)'|database \"([^\"]*)\" does not exist"),
        "no database {!r} on this server: create it, or fix the URL's database name",
    ),
    (
        re.compile(
            r"Can't connect to (?:MySQL|local MySQL) server|Connection refused"
            r"|failed to resolve host|Name or service not known|could not translate host name"
            r"|No route to host|timeout expired|Connection timed out|No such file or directory"
        ),
        "cannot reach the server: is it running, and are the URL's host and port right?",
    ),
)
"""Driver messages of one cause on every dialect (PostgreSQL's libpq and MariaDB's), and the
one wording `describe` gives it."""


def missing_table(exc: sa_exc.DBAPIError) -> bool:
    """Whether `exc` says a table does not exist (PostgreSQL 42P01, MySQL 1146, SQLite's "no
    such table"): the store's tables are not where the statement looked."""
    orig: Any = exc.orig
    if isinstance(orig, sqlite3.Error):
        return str(orig).startswith("no such table")
    args = getattr(orig, "args", ())
    if args and isinstance(args[0], int):
        return args[0] == 1146
    return getattr(orig, "sqlstate", None) == "42P01"


def describe(exc: BaseException) -> str | None:
    """The cause of a failed connection in the same words on every dialect (access denied,
    unknown database, unreachable server), or None: MariaDB's driver tuples such as
    `(1045, "Access denied ...")` and libpq's "FATAL: role ..." say one thing three ways.

    Looks through `exc`'s chain, so a `StoreError` raised from a driver error is described too.
    """
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, sa_exc.DBAPIError) and e.orig is not None:
            text = str(e.orig)
            for pattern, words in _CAUSES:
                found = pattern.search(text)
                if found is not None:
                    name = next((g for g in found.groups() if g is not None), None)
                    return redact(words.format(name) if name is not None else words)
        todo += (e.__cause__, e.__context__)
    return None


def hide_parameters(exc: BaseException) -> None:
    """Drop the bound parameters from every SQLAlchemy error in `exc`'s chain, in place.

    They are task data (payloads, labels: often personal data), and a chained error prints
    them in every traceback and `log.exception` of the store's error, whatever the engine's
    own `hide_parameters`. Emptied, not just flagged hidden: nothing keeps them alive.
    """
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, sa_exc.StatementError):
            e.params = None
            e.hide_parameters = True
        todo += (e.__cause__, e.__context__)


def translate(exc: BaseException) -> StoreError:
    """The store error for a database or pool exception (raise it `from exc`).

    `exc` loses its statement parameters here (`hide_parameters`), so the chain of the error
    raised from it shows no task data.

    Args:
        exc: What the driver, SQLAlchemy or the pool raised (a `StoreError` passes through).

    Returns:
        `StoreUnavailable` for what is worth retrying (a lost or refused connection, a busy or
        locked database, a timeout, a read-only server), else `StoreError`; the message in
        the words of `describe` where it knows the cause, passwords masked.

    Raises nothing: the error is returned, for the caller to raise from `exc`.
    """
    hide_parameters(exc)
    if isinstance(exc, StoreError):
        return exc
    if isinstance(exc, sa_exc.TimeoutError):  # the pool ran dry
        return StoreUnavailable(redact(f"no database connection available: {exc}"))
    if isinstance(exc, sa_exc.DBAPIError):
        message = (
            describe(exc) or redact(str(exc.orig) if exc.orig is not None else str(exc)).strip()
        )
        if _is_transient(exc):
            return StoreUnavailable(message)
        return StoreError(message)
    if isinstance(exc, ConnectionError | TimeoutError):
        return StoreUnavailable(redact(str(exc)))
    return StoreError(redact(f"{type(exc).__name__}: {exc}"))


def read_only_sql(dialect: Dialect) -> str | None:
    """The statement (for `exec_driver_sql`) that makes the transaction it starts read-only
    (PostgreSQL, MySQL), so a reader that must never write (the dashboard) cannot, even by
    mistake. None on SQLite, whose reader connections run with `PRAGMA query_only` instead."""
    which = name(dialect)
    if which in ("postgresql", "mysql"):
        return "SET TRANSACTION READ ONLY"
    return None
