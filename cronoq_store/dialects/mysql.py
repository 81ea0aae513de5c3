"""MariaDB and MySQL (PyMySQL, asyncmy): unbuffered cursors, sockets shut to interrupt."""

from __future__ import annotations

import functools
import importlib
import socket
import typing
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, ClassVar, Final

from sqlalchemy import Connection, Engine, Select, Update, event, text
from sqlalchemy.engine.interfaces import Dialect
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ClauseElement
from sqlalchemy.sql.expression import Executable

from .base import (
    Bounds,
    DefaultImpl,
    Risk,
    connect_with,
    is_on,
    reclass_connections,
)
from .cursor import observed
from .sockets import shut, shut_transport

__all__ = [
    "FAILED_ERRNO",
    "IDLE_INFO",
    "JEPSEN_GALERA",
    "FailsIfAny",
    "FailsUnlessOne",
    "MySQLImpl",
    "OnlyIfCounted",
]

JEPSEN_GALERA: Final = (
    "Jepsen's analysis of MariaDB Galera Cluster 12.1.2 (2026-03) found committed "
    "transactions lost: under the recommended settings when nodes crash in quick succession "
    "(no flush before acknowledgement), and occasionally with process crashes and network "
    "partitions even with innodb_flush_log_at_trx_commit=1"
)
"""Why a Galera node is never called safe (https://jepsen.io/analyses)."""


class MySQLImpl(DefaultImpl):
    """MariaDB/MySQL. PyMySQL streams from its unbuffered cursor; PyMySQL's and asyncmy's
    sessions are interrupted by shutting their socket down."""

    name: ClassVar[str] = "mysql"
    schema_word: ClassVar[str | None] = "MySQL database"
    index_hint: ClassVar[str | None] = "FORCE INDEX ({index})"
    dialect_names: ClassVar[tuple[str, ...]] = ("mysql", "mariadb")
    transient_codes: ClassVar[frozenset[Any]] = frozenset(
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
            1684,  # table skipped: its definition is being changed by concurrent DDL (Galera)
            1047,  # Galera: the node is not ready (not in the primary component)
        }
    )
    read_only_codes: ClassVar[frozenset[Any]] = frozenset(
        {
            1290,  # the server runs with --read-only (read_only = ON)
            1836,  # running in read-only mode
        }
    )
    disk_full_codes: ClassVar[frozenset[Any]] = frozenset(
        {
            1021,  # disk full, waiting for someone to free space
            1114,  # the table is full (InnoDB could not extend its tablespace)
        }
    )

    schema_is_database: ClassVar[bool] = True
    galera_possible: ClassVar[bool] = True
    alters_online: ClassVar[bool] = True
    gap_locks: ClassVar[bool] = True
    ranges_by_subquery: ClassVar[bool] = False

    def __init__(self, dialect: Dialect) -> None:
        super().__init__(dialect)
        self._pymysql = dialect.driver == "pymysql"
        self.may_batch = self._pymysql

    def set_up_engine(self, engine: Engine) -> None:
        """PyMySQL: its connections may send several statements in one packet
        (`CLIENT.MULTI_STATEMENTS`, beside the `FOUND_ROWS` SQLAlchemy sets): a flight's
        statements then cost one round trip (`batches`)."""
        if not self._pymysql:
            return
        flag = importlib.import_module("pymysql.constants.CLIENT").MULTI_STATEMENTS

        def multi_statements(_dialect: Any, _record: Any, _cargs: Any, cparams: Any) -> None:
            cparams["client_flag"] = cparams.get("client_flag", 0) | flag

        event.listen(engine, "do_connect", multi_statements)
        reclass_connections(engine, _ending)

    def batches(self, conn: Connection) -> bool:
        """MariaDB on PyMySQL, connected with `CLIENT.MULTI_STATEMENTS` (`set_up_engine`):
        a flight's statements go in one packet, and a check among them stops the rest by
        failing (`FailsUnlessOne`: a compound statement, MariaDB's, not MySQL's)."""
        if not self._pymysql or not getattr(self.dialect, "is_mariadb", False):
            return False
        flags = getattr(conn.connection.dbapi_connection, "client_flag", 0)
        return bool(flags & _MULTI_STATEMENTS)

    def send_batch(
        self, dbapi_connection: Any, queue: Sequence[Any], answers: list[Any], *, commit: bool
    ) -> None:
        """`queue`'s statements, their parameters bound by the driver (as its `execute`
        does), joined by `;` into packets of at most `BATCH_CHARS` (an executemany one
        statement per row, its counts summed), and the COMMIT last if `commit`. The server
        runs a packet's statements in order and stops at the first error: PyMySQL raises it
        where its result was due. Once the COMMIT is answered, the connection's `commit()`
        sends nothing (`ended_in_flight`) until it runs another statement."""
        # A statement hook (`testing.statements`, on the connection's cursor class) hears
        # each statement once answered, not the packet: the packet goes on a plain cursor.
        hook = getattr(dbapi_connection.cursorclass, "statement_hook", None)
        cursor = dbapi_connection.cursor(_plain_cursor())
        try:
            texts: list[str] = []
            sizes: list[int] = []  # statements per queued entry
            for sql, params, many in queue:
                if params is None:
                    rendered = [sql]
                elif many:
                    rendered = _many(cursor, sql, params)
                else:
                    rendered = [cursor.mogrify(sql, params)]
                texts.extend(rendered)
                sizes.append(len(rendered))
            if commit:
                texts.append("COMMIT")
            results = _results(cursor, _packets(texts))
            for (sql, _, _), size in zip(queue, sizes, strict=True):
                count, rows = 0, []
                for _ in range(size):
                    n, got = next(results)
                    count += max(n, 0)
                    rows.extend(got)
                answers.append((count, rows))
                if hook is not None:
                    hook(cursor, sql)
            if commit:
                next(results)  # the COMMIT's answer: committed
                dbapi_connection.cronoq_ended = True
        finally:
            cursor.close()  # reads what is left of the packet's answers

    def ended_in_flight(self, dbapi_connection: Any) -> bool:
        """`send_batch` sent the COMMIT, and nothing ran since."""
        return bool(getattr(dbapi_connection, "cronoq_ended", False))

    def streaming_cursor(self, dbapi_connection: Any) -> Any | None:
        """PyMySQL's unbuffered cursor (`SSCursor`)."""
        if not self._pymysql:
            return None
        return dbapi_connection.cursor(self.dialect.loaded_dbapi.cursors.SSCursor)

    def abandon(self, cursor: Any) -> None:
        """Mark a PyMySQL unbuffered result of a lost connection finished. Closed, or
        collected, it would read the rest of the result from the closed socket and fail (an
        AttributeError, "Exception ignored" when collected: PyMySQL pull request #810, open)."""
        result = getattr(cursor, "_result", None)
        if getattr(result, "unbuffered_active", False):
            result.unbuffered_active = False  # type: ignore[union-attr]

    def short_lock_waits(
        self, conn: Connection, *, ms: int, seconds: int
    ) -> Callable[[], object] | None:
        """The session's `lock_wait_timeout` (metadata locks: whole seconds)."""
        before = conn.exec_driver_sql("SELECT @@SESSION.lock_wait_timeout").scalar_one()
        conn.exec_driver_sql(f"SET SESSION lock_wait_timeout = {seconds}")
        return lambda: conn.exec_driver_sql(f"SET SESSION lock_wait_timeout = {int(before)}")

    def interrupter(self, driver_connection: Any) -> Any:
        """Shut the socket down (PyMySQL's, or asyncmy's transport's): the blocked read fails
        at once as a lost connection; the server ends the transaction when it notices."""
        sock = getattr(driver_connection, "_sock", None)  # PyMySQL's
        if isinstance(sock, socket.socket):
            return functools.partial(shut, sock)
        transport = getattr(driver_connection, "_transport", None)  # asyncmy's transport
        if transport is not None:
            return functools.partial(shut_transport, transport)
        return None

    acknowledged: ClassVar[str] = (
        "InnoDB has written and flushed its redo log for the commit "
        "(innodb_flush_log_at_trx_commit=1), and, with a binary log, the binary log too "
        "(sync_binlog=1)"
    )

    durability_risks: ClassVar[tuple[Risk, ...]] = (
        Risk(
            "innodb_flush_log_at_trx_commit",
            lambda value: value != "1",
            "the redo log is not flushed at each "
            "commit: a crash (of the machine with 2, of the server with 0) loses up "
            "to a second of acknowledged commits",
        ),
        Risk(
            "innodb_doublewrite",
            lambda value: value in ("off", "0"),
            "a page torn by a power loss cannot be repaired: "
            "committed rows can be lost or the tablespace corrupted",
        ),
        Risk(
            "sync_binlog",
            lambda value: value != "1",
            "the binary log is not flushed at each commit: after a crash "
            "of the machine, replicas and point-in-time recovery miss acknowledged "
            "commits",
            given="log_bin",
        ),
        Risk("wsrep_on", is_on, f"a Galera node: {JEPSEN_GALERA}"),
    )
    """InnoDB's redo log not flushed at each commit, no doublewrite buffer, a binary log
    not synced at each commit, and any Galera node (`JEPSEN_GALERA`)."""

    def hook_cursors(self, engine: Engine, hooked: Callable[[type[Any]], type[Any]]) -> bool:
        """PyMySQL: its `cursorclass`."""
        if not self._pymysql:
            return False
        cursors: Any = importlib.import_module("pymysql.cursors")  # no type stubs
        connect_with(engine, "cursorclass", cursors.Cursor, hooked)
        return True

    def hook_commits(self, engine: Engine, committing: Callable[[type[Any]], type[Any]]) -> bool:
        """PyMySQL: each connection becomes one of `committing`'s class."""
        if not self._pymysql:
            return False
        reclass_connections(engine, committing)
        return True

    def bounds_idle(self) -> bool:
        """MariaDB 10.3+'s `idle_transaction_timeout`; MySQL has no such setting."""
        if not getattr(self.dialect, "is_mariadb", False):
            return False
        version = self.dialect.server_version_info or (0,)
        return tuple(version[:2]) >= (10, 3)

    def bound(
        self, conn: Connection, bounds: Bounds, *, defer: bool
    ) -> tuple[Select[Any], dict[str, str]] | None:
        """Session settings, sent only when they change: the lock waits (whole seconds; the
        server's own again for a transaction with no `timeout`) and, on MariaDB 10.3+,
        `idle_transaction_timeout`, in one SET. On a batched connection
        (`batches`) it costs no round trip of its own: with `defer` it is returned for the
        caller's flight, its first statement; else it goes in one packet with the next
        statement the connection sends (`_ending`). Their new values are noted at once: the
        SET runs before anything else, or the connection fails with it."""
        idle, timeout, lock, idle_too = bounds
        changes: list[str] = []
        if timeout is not None:
            # Whole seconds: the statement's bound rounded up (the watchdog ends the
            # transaction on time), a shorter lock bound rounded down (its wait must end
            # before a renewal's).
            if lock is not None and lock < timeout:
                seconds = max(1, lock // timedelta(seconds=1))
            else:
                seconds = max(1, -(-timeout // timedelta(seconds=1)))
            if conn.info.get(LOCK_WAIT_INFO) != seconds:
                # Row locks (InnoDB) and table locks (metadata: an ALTER TABLE under way).
                changes.append(
                    f"innodb_lock_wait_timeout = {seconds}, lock_wait_timeout = {seconds}"
                )
                conn.info[LOCK_WAIT_INFO] = seconds
        elif conn.info.pop(LOCK_WAIT_INFO, None) is not None:
            # A session setting outlives the commit that set it: the server's waits back for
            # what runs here next, or a renewal queued behind a stalled commit would give up
            # as soon as that commit does.
            changes.append("innodb_lock_wait_timeout = DEFAULT, lock_wait_timeout = DEFAULT")
        if idle_too and self.bounds_idle():
            seconds = 0 if idle is None else max(1, -(-idle // timedelta(seconds=1)))
            if conn.info.get(IDLE_INFO, 0) != seconds:
                value = str(seconds) if seconds else "DEFAULT"
                changes.append(f"idle_transaction_timeout = {value}")
                conn.info[IDLE_INFO] = seconds
        if not changes:
            return None
        sql = f"SET SESSION {', '.join(changes)}"
        if self.batches(conn) and not observed(conn):  # SQLAlchemy's execution sees each
            if defer:
                return _set_stmt(sql), {}
            dbapi_conn: Any = conn.connection.dbapi_connection
            if hasattr(dbapi_conn, "cronoq_pending"):  # `_ending`'s: before the next statement
                pending = dbapi_conn.cronoq_pending
                dbapi_conn.cronoq_pending = sql if pending is None else f"{pending};\n{sql}"
                return None
        conn.exec_driver_sql(sql)
        return None

    async_driver: ClassVar[str | None] = "asyncmy"
    sync_drivers: ClassVar[frozenset[str]] = frozenset({"pymysql"})
    wire: ClassVar[str | None] = "mysql"
    default_port: ClassVar[int | None] = 3306
    explain_json: ClassVar[str | None] = "EXPLAIN FORMAT=JSON"
    analyze_sql: ClassVar[str | None] = "ANALYZE TABLE"

    def server_name(self) -> str:
        """MariaDB by its own name."""
        return "mariadb" if getattr(self.dialect, "is_mariadb", False) else self.name


BATCH_CHARS: Final = 4 << 20
"""Most characters of one multi-statement packet (a longer statement goes alone): a quarter of
MariaDB's default `max_allowed_packet`, room for a take's probe (`lease.probe`: 1 MiB, sent
as 2 MiB of hex) and the statements around it."""


@functools.cache
def _insert_values() -> Any:
    """PyMySQL's own pattern of an INSERT ... VALUES it sends many rows of in one statement
    (read once it is used: the package imports without PyMySQL installed)."""
    return importlib.import_module("pymysql.cursors").RE_INSERT_VALUES


_MULTI_STATEMENTS: Final = 1 << 16
"""PyMySQL's `CLIENT.MULTI_STATEMENTS`."""


def _many(cursor: Any, sql: str, rows: Sequence[Any]) -> list[str]:
    """An executemany's statements: an INSERT ... VALUES as multi-row INSERTs of at most
    about `BATCH_CHARS` each (as PyMySQL's `executemany` sends it), else one per row."""
    match = _insert_values().match(sql) if len(rows) > 1 else None
    if match is None:
        return [cursor.mogrify(sql, row) for row in rows]
    prefix, values, postfix = match.group(1) % (), match.group(2).rstrip(), match.group(3) or ""
    statements: list[str] = []
    part: list[str] = []
    size = 0
    for row in rows:
        one = cursor.mogrify(values, row)
        if part and size + len(one) > BATCH_CHARS:
            statements.append(prefix + ",".join(part) + postfix)
            part, size = [], 0
        part.append(one)
        size += len(one) + 1
    statements.append(prefix + ",".join(part) + postfix)
    return statements


def _packets(texts: Sequence[str]) -> list[str]:
    """`texts` joined by `;` into packets of at most `BATCH_CHARS` (a longer statement alone)."""
    packets: list[str] = []
    part: list[str] = []
    size = 0
    for one in texts:
        if part and size + len(one) > BATCH_CHARS:
            packets.append(";\n".join(part))
            part, size = [], 0
        part.append(one)
        size += len(one) + 2
    if part:
        packets.append(";\n".join(part))
    return packets


@functools.cache
def _plain_cursor() -> type[Any]:
    """PyMySQL's own buffered cursor class."""
    return importlib.import_module("pymysql.cursors").Cursor  # type: ignore[no-any-return]


@functools.cache
def _set_stmt(sql: str) -> Select[Any]:
    """A SET as a statement a flight compiles (once per text: `driver_sql`'s cache keys on
    the statement object)."""
    return typing.cast("Select[Any]", text(sql))


def _ending(base: type[Any]) -> type[Any]:
    """A subclass of PyMySQL's connection class `base` whose `commit()` sends nothing when
    the transaction's COMMIT went in its last packet (`MySQLImpl.send_batch`): PyMySQL's own
    sends COMMIT whatever is open, a round trip of its own. And its next statement carries
    the session settings `MySQLImpl.bound` left pending, in the same packet."""

    made: type[Any] | None = _ENDING.get(base)
    if made is not None:
        return made

    class EndsInFlight(base):  # type: ignore[misc]
        cronoq_ended = False
        cronoq_pending: str | None = None
        """Session settings to send in one packet with the next statement (`bound`)."""

        def query(self, sql: Any, unbuffered: bool = False) -> Any:
            self.cronoq_ended = False  # a statement after the COMMIT: a new transaction
            pending = self.cronoq_pending
            if pending is None:
                return super().query(sql, unbuffered)
            self.cronoq_pending = None
            if isinstance(sql, bytes):
                sql = pending.encode(self.encoding) + b";\n" + sql
            else:
                sql = f"{pending};\n{sql}"
            super().query(sql, False)  # the SET's answer: nothing to read
            return self.next_result(unbuffered)  # the statement's

        def commit(self) -> None:
            if self.cronoq_ended:
                self.cronoq_ended = False
                return
            super().commit()

        def rollback(self) -> None:
            self.cronoq_ended = False
            super().rollback()

    _ENDING[base] = EndsInFlight
    return EndsInFlight


_ENDING: dict[type[Any], type[Any]] = {}
"""`_ending`'s class for each PyMySQL connection class: made once."""


def _results(cursor: Any, packets: Sequence[str]) -> Any:
    """Each statement's (rowcount, rows), packet after packet: the next packet leaves once
    the last answer of the one before is read (so an error stops the rest)."""
    for packet in packets:
        cursor.execute(packet)
        while True:
            rows = cursor.fetchall() if cursor.description is not None else ()
            yield cursor.rowcount, rows
            if not cursor.nextset():
                break


class FailsUnlessOne(Executable, ClauseElement):
    """`update`, failing unless it matched exactly one row; `otherwise` where the database
    has no such form (PostgreSQL: a statement that fails by itself).

    On MariaDB a compound statement (`BEGIN NOT ATOMIC`) runs the UPDATE and SIGNALs
    division by zero (SQLSTATE 22012, `FAILED_ERRNO`) when its `ROW_COUNT()` (matched rows:
    SQLAlchemy connects PyMySQL with `FOUND_ROWS`) is not 1. In a multi-statement packet
    the server then runs none of the statements behind it."""

    inherit_cache = False
    _inline = False  # what SQLAlchemy's compiler asks of an UPDATE it compiled

    def __init__(self, update: Update, otherwise: Executable) -> None:
        self.update = update
        self.otherwise = otherwise


@compiles(FailsUnlessOne)
def _otherwise(element: FailsUnlessOne, compiler: SQLCompiler, **kw: Any) -> str:
    return compiler.process(element.otherwise, **kw)  # type: ignore[arg-type]


@compiles(FailsUnlessOne, "mysql", "mariadb")
def _compound(element: FailsUnlessOne, compiler: SQLCompiler, **kw: Any) -> str:
    update = compiler.process(element.update, **kw)
    return (
        f"BEGIN NOT ATOMIC {update}; IF ROW_COUNT() <> 1 THEN SIGNAL SQLSTATE '22012' "
        f"SET MYSQL_ERRNO = {FAILED_ERRNO}, MESSAGE_TEXT = 'cronoq: no row matched'; "
        "END IF; END"
    )


class FailsIfAny(Executable, ClauseElement):
    """MariaDB: a compound statement that SIGNALs (`FAILED_ERRNO`) when `query` finds a row,
    so that in a multi-statement packet nothing behind it runs. With `unless_counted`, the
    query is asked only when the statement before it did not count that many rows
    (`ROW_COUNT()`): a guard that costs no read when its statement matched them all."""

    inherit_cache = False

    def __init__(self, query: Select[Any], unless_counted: int | None = None) -> None:
        self.query = query
        self.unless_counted = unless_counted


@compiles(FailsIfAny, "mysql", "mariadb")
def _fails_if_any(element: FailsIfAny, compiler: SQLCompiler, **kw: Any) -> str:
    query = compiler.process(element.query, **kw)
    check = (
        f"IF EXISTS ({query}) THEN SIGNAL SQLSTATE '22012' SET MYSQL_ERRNO = {FAILED_ERRNO}, "
        "MESSAGE_TEXT = 'cronoq: a row matched'; END IF;"
    )
    if element.unless_counted is not None:
        check = f"IF ROW_COUNT() <> {int(element.unless_counted)} THEN {check} END IF;"
    return f"BEGIN NOT ATOMIC {check} END"


class OnlyIfCounted(Executable, ClauseElement):
    """MariaDB: `stmt`, run only if the statement before it counted `count` rows
    (`ROW_COUNT()`), as a compound statement: a packet's statement that depends on the one
    before it without waiting for its answer."""

    inherit_cache = False
    _inline = False  # what SQLAlchemy's compiler asks of an INSERT it compiled

    def __init__(self, stmt: Executable, count: int) -> None:
        self.stmt = stmt
        self.count = count


@compiles(OnlyIfCounted, "mysql", "mariadb")
def _only_if_counted(element: OnlyIfCounted, compiler: SQLCompiler, **kw: Any) -> str:
    stmt = compiler.process(element.stmt, **kw)  # type: ignore[arg-type]
    return f"BEGIN NOT ATOMIC IF ROW_COUNT() = {int(element.count)} THEN {stmt}; END IF; END"


FAILED_ERRNO: Final = 1365
"""MariaDB's error number of division by zero, which `FailsUnlessOne` raises."""

IDLE_INFO: Final = "cronoq_idle_s"
"""`Connection.info` key: the MariaDB session's idle_transaction_timeout as we last set it."""
LOCK_WAIT_INFO: Final = "cronoq_lock_wait_s"
"""`Connection.info` key: the MariaDB session's lock waits (whole seconds) as we last set them."""
