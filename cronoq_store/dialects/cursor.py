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

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, NamedTuple

from sqlalchemy import Connection
from sqlalchemy import exc as sa_exc

from .. import compat
from ..errors import StoreError
from .base import dialect_of
from .compiled import COMPILED, Statement, driver_sql, schema_key

__all__ = [
    "COMMIT_SENT",
    "LINE",
    "OBSERVED",
    "STORE_BEGIN",
    "Flight",
    "Line",
    "Ran",
    "batches",
    "counted",
    "ended",
    "inserted_id",
    "line_of",
    "observed",
    "pipelines",
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


# A connection's facts, worked out once.

STORE_BEGIN: Final = "_cronoq_store_begin"
"""The attribute that marks the store's own `begin` listener (`configure_sqlite`), holding the
statement it begins a writing transaction with: a commit may send it itself
(`face.transactions.commit`, past SQLAlchemy's transaction)."""


class Line:
    """What the store works out once about one SQLAlchemy connection, for every commit run on
    it (`line_of`): its database's class, its DB-API connection, its `info`, how another
    thread interrupts it, whether its statements are `observed` and under which dialect and
    schema their compiled forms are kept (`where`), and whether a statement on the database's
    clock is given the host's (`host_clock`). How a transaction begins on it is asked on
    each commit (`driver_begin`): an app may add a listener to its engine at any time.

    A connection a leader keeps for its commits (`face.Face._keep_held`) pays for these once,
    not per commit. Only commits run on it, so its execution options stay as they were; its
    statement log is decided when it is first used, as SQLAlchemy's `Connection` reads its
    own `echo` once, when it opens. One whose DB-API connection goes (invalidated) is closed
    by its holder, never used again."""

    __slots__ = (
        "_begin",
        "_listeners",
        "commit",
        "dbapi",
        "host_clock",
        "impl",
        "info",
        "interrupter",
        "observed",
        "where",
    )

    def __init__(self, conn: Connection) -> None:
        fairy = conn.connection
        self.impl = impl = dialect_of(conn)
        self.dbapi: Any = fairy.dbapi_connection
        self.commit = impl.committer(self.dbapi)
        """Commits a transaction the store began on the driver (`DefaultImpl.committer`)."""
        self.info: dict[Any, Any] = fairy.info
        """`conn.info`, kept: once invalidated, reading `conn.info` would connect again."""
        self.interrupter = impl.interrupter(fairy.driver_connection)
        options = conn.get_execution_options()
        self.observed = observed(conn, options)
        """Whether its statements run through SQLAlchemy's execution (`cursor.observed`)."""
        translate = options.get("schema_translate_map")
        self.where: tuple[Any, ...] = (
            conn.dialect,
            None if translate is None else schema_key(translate),
        )
        """The dialect and schema its statements' compiled forms are kept under
        (`compiled.COMPILED`)."""
        self.host_clock = not impl.server
        """No server: the database's clock is the host's, passed with a statement that reads
        it (`statements.db_now_ns`, as `b_host_now`)."""
        self._listeners = compat.transaction_listeners(conn)
        self._begin: tuple[str, ...] | None = None

    def driver_begin(self) -> tuple[str, ...] | None:
        """What a transaction on this connection begins with when the store sends it itself,
        on the driver's own transaction (the store's `begin` listener's statements: SQLite's
        BEGIN IMMEDIATE; none where the driver begins one itself): when every `begin`
        listener is the store's own (`STORE_BEGIN`) and nothing listens to a commit or a
        rollback. None: only SQLAlchemy's transaction will do (another listener, or its
        listeners cannot be told: `compat.transaction_listeners`).

        Asked on each commit, worked out only when a listener came or went since the last
        (`compat.TransactionListeners`: a test of the empty ones and a comparison)."""
        listeners = self._listeners
        if listeners is None:
            return None
        if any(listeners.empty) or listeners.full != listeners.seen:
            self._begin = _store_begin(*listeners.take())
        return self._begin


def _store_begin(begin: list[Any], ends: bool) -> tuple[str, ...] | None:
    """The statements of `begin`, the `begin` listeners, when each is the store's own and
    nothing listens to the transaction's end (`ends`); else None (`Line.driver_begin`)."""
    if ends:
        return None
    sql: list[str] = []
    for listener in begin:
        statement = getattr(listener, STORE_BEGIN, None)
        if statement is None:
            return None
        sql.append(statement)
    return tuple(sql)


LINE: Final = "_cronoq_line"
"""The attribute of a SQLAlchemy `Connection` that keeps its `Line` (as `dialect_of` keeps
its class on the dialect: read with no call, `getattr(conn, LINE, None)`)."""


def line_of(conn: Connection) -> Line:
    """`conn`'s `Line`, made on first use and kept on it."""
    line: Line | None = getattr(conn, LINE, None)
    if line is None:
        line = Line(conn)
        with contextlib.suppress(AttributeError):  # a `Connection` without room: made anew
            setattr(conn, LINE, line)
    return line


# A transaction's statements sent together.


def pipelines(conn: Connection) -> bool:
    """Whether `conn` can send statements without waiting for each answer: sync psycopg's
    pipeline mode, on the DB-API cursor (`run`'s path: nothing observes the connection)."""
    return dialect_of(conn).pipelined and not observed(conn)


def batches(conn: Connection) -> bool:
    """Whether `conn` sends a flight's statements as one multi-statement packet (MariaDB on
    PyMySQL: the dialect's `batches`), on the DB-API cursor (tests replace it as
    `execution.batches`)."""
    return not observed(conn) and dialect_of(conn).batches(conn)


def ended(conn: Connection) -> bool:
    """Whether `conn`'s transaction has ended already: its COMMIT went in a flight
    (`Flight.commit`). Only a pipelined or batched connection can say yes."""
    if not pipelines(conn):  # batched: its last packet carried the COMMIT
        return dialect_of(conn).ended_in_flight(conn.connection.dbapi_connection)
    dbapi_conn: Any = conn.connection.dbapi_connection
    return bool(dbapi_conn.info.transaction_status == _IDLE)


_IDLE: Final = 0
"""libpq's PQTRANS_IDLE (`psycopg.pq.TransactionStatus.IDLE`): no transaction open."""


class Flight:
    """Statements of one transaction sent to the server together, answered in one round trip.

    On sync psycopg (`pipelines`) `add` queues a statement and `send` sends every queued one
    but the last in pipeline mode (driven on its libpq connection: `wire`), then the last on
    its own: a transaction's leading statements cost two round trips instead of one each.
    Elsewhere `add` runs the statement at once (`run`) and `send` only hands the results
    back, so the caller's code is the same on every dialect.

    On the server, an error aborts the statements after it (the transaction is failed):
    `send` raises it as `run` would, with `failed` set to the index of the statement that
    raised it.

    `commit` ends the transaction: pipelined, the COMMIT leaves with what is queued, and a
    transaction whose statements all fit in its last flight costs one round trip. An answer
    needed only after the fact (a count to log) is read by a `then` check, so that its
    statement can wait for that flight.
    """

    __slots__ = (
        "_dbapi",
        "_queue",
        "_ran",
        "_then",
        "_where",
        "batched",
        "conn",
        "defers",
        "failed",
        "pipelined",
        "watched",
    )

    def __init__(self, conn: Connection, line: Line | None = None) -> None:
        """A flight on `conn`; `line`: `conn`'s `dialects.Line`, when the caller has it (a
        commit's), which spares working its facts out again."""
        self.conn = conn
        # Worked out once for all of its statements (for a commit's, once per connection: its
        # `Line`): whether they are observed, and the dialect and schema their compiled forms
        # are kept under (`driver_sql`).
        if line is None:
            options = conn.get_execution_options()
            translate = options.get("schema_translate_map")
            self._where = (conn.dialect, None if translate is None else schema_key(translate))
            self.watched = watched = observed(conn, options)
            self.pipelined = not watched and pipelines(conn)
            self._dbapi: Any = None if watched else conn.connection.dbapi_connection
            may_batch = True
        else:
            self._where = line.where
            self.watched = watched = line.observed
            self.pipelined = line.impl.pipelined and not watched and pipelines(conn)
            self._dbapi = None if watched else line.dbapi
            may_batch = line.impl.may_batch
        # `watched`: whether its statements run through SQLAlchemy's execution (`observed`);
        # `_dbapi`: the DB-API connection they run on (`run_on`), None: through `run`.
        self.batched = may_batch and not self.pipelined and not watched and batches(conn)
        """MariaDB: `send` sends what is queued as one multi-statement packet (the dialect's
        `send_batch`), and `commit` the COMMIT in the last."""
        self.defers = self.pipelined or self.batched
        """Whether added statements wait for `send` (pipelined or batched): a check that
        must stop the statements behind it fails the flight instead of being read."""
        self._queue: list[tuple[str, Any, bool]] = []
        self._ran: list[Ran] = []
        self._then: list[Callable[[Sequence[Ran]], None]] = []
        self.failed: int | None = None
        """The index of the statement whose error `send` raised."""

    def then(self, check: Callable[[Sequence[Ran]], None]) -> None:
        """Call `check` with every result so far once what is queued is answered: at once
        where statements run as they are added, else after the next `send` or `commit`."""
        if self._queue:
            self._then.append(check)
        else:
            check(self._ran)

    def add(self, stmt: Statement, params: Mapping[str, Any] | None = None) -> int:
        """Queue (or run) `stmt` once with `params`; its index in `send`'s results."""
        params = params or {}
        keys = tuple(params)
        hit = COMPILED.get((stmt, keys, *self._where))
        sql, getter = driver_sql(self.conn, stmt, keys) if hit is None else hit
        return self._add(sql, params if getter is None else getter(params), False)

    def add_many(self, stmt: Statement, rows: Sequence[Mapping[str, Any]]) -> int:
        """Queue (or run) `stmt` once per row as one executemany; its index in `send`'s."""
        keys = tuple(rows[0])
        hit = COMPILED.get((stmt, keys, *self._where))
        sql, getter = driver_sql(self.conn, stmt, keys) if hit is None else hit
        return self._add(sql, rows if getter is None else [getter(r) for r in rows], True)

    def _add(self, sql: str, params: Any, many: bool) -> int:
        ran = self._ran
        if self.pipelined or self.batched:
            index = len(ran) + len(self._queue)
            self._queue.append((sql, params, many))
        else:  # nothing is ever queued
            index = len(ran)
            dbapi = self._dbapi
            try:
                if dbapi is None:
                    ran.append(run(self.conn, sql, params, many=many))
                else:
                    ran.append(run_on(self.conn, dbapi, sql, params, many))
            except sa_exc.DBAPIError:
                self.failed = index
                raise
        return index

    def send(self) -> Sequence[Ran]:
        """Send what is queued and wait for the answers; every result so far, by index."""
        if self._queue:
            if self.batched:
                self._send_batch()
            else:
                self._send(commit=False)
            self._checked()
        return self._ran

    def commit(self) -> Sequence[Ran]:
        """`send`, and commit the transaction: pipelined, the COMMIT goes in the same flight,
        behind the statements (the driver then finds no transaction open, and the
        transaction's end has nothing left to commit). Elsewhere the transaction's end
        commits, as always."""
        if self.pipelined:
            self._send(commit=True)
            self._checked()
        elif self.batched:  # the COMMIT in the last packet; the driver's commit() skips
            self.conn.info[COMMIT_SENT] = True
            self._send_batch(commit=True)
            self._checked()
        return self._ran

    def _checked(self) -> None:
        checks, self._then = self._then, []
        for check in checks:
            check(self._ran)

    def _send_batch(self, *, commit: bool = False) -> None:
        """Send what is queued in one multi-statement packet (`batched`), with the COMMIT
        behind it if `commit`: the server runs them in order and stops at the first error,
        which `send` raises."""
        conn = self.conn
        queue, self._queue = self._queue, []
        answers: list[tuple[int, Sequence[Any]]] = []
        dbapi_conn = conn.connection.dbapi_connection
        try:
            dialect_of(conn).send_batch(dbapi_conn, queue, answers, commit=commit)
        except conn.dialect.loaded_dbapi.Error as exc:
            self.failed = len(self._ran) + len(answers)
            sql, _, many = queue[len(answers)] if len(answers) < len(queue) else _COMMIT
            raise compat.driver_error(conn, exc, sql, many=many) from exc
        finally:
            self._ran.extend(Ran(counted(count), rows) for count, rows in answers)

    def _send(self, *, commit: bool) -> None:
        from .. import wire  # psycopg's: only a pipelined connection comes here

        conn = self.conn
        dbapi_conn: Any = conn.connection.dbapi_connection
        queue, self._queue = self._queue, []
        # Unless the COMMIT follows, the last statement goes on its own, once the others are
        # answered: PostgreSQL arms its idle-in-transaction timer on an answer outside
        # pipeline mode only, and a commit paused after its flight must still be cut off by
        # that bound (the lease TTL's). With the COMMIT in the flight nothing stays open.
        if commit:  # the driver's commit() would sync on its own: a second round trip
            queue.append(_COMMIT)
        head, last = (queue, None) if commit else (queue[:-1], queue[-1])
        # The flight that opens the transaction sends its BEGIN (psycopg's own would be a
        # round trip of its own before the flight); one that is the whole transaction does
        # even on an autocommit connection, as its COMMIT says it is one.
        idle = dbapi_conn.info.transaction_status == _IDLE
        begin = idle and (commit or not dbapi_conn.autocommit)
        answered = 0
        if head == [_COMMIT] and not begin:  # nothing to send with it: no pipeline to enter
            head, last = [], _COMMIT
        if commit:  # from here, an interrupted flight may have committed (`face.transaction`)
            conn.info[COMMIT_SENT] = True
        try:
            if head:
                try:
                    answers = wire.run(dbapi_conn, [_BEGIN, *head] if begin else head)
                except wire.Failed as failed:
                    answered = max(0, failed.index - begin)
                    raise failed.error from None
                for count, rows in answers[begin:]:
                    self._ran.append(Ran(counted(count), rows))
                    answered += 1
            if last is not None:
                sql, params, many = last  # an executemany still pipelines its rows, as psycopg's
                alone = not many or len(params) == 1
                try:
                    [(count, rows)] = wire.run(dbapi_conn, [last], pipeline=not alone)
                except wire.Failed as failed:
                    raise failed.error from None
                self._ran.append(Ran(counted(count), rows))
        except conn.dialect.loaded_dbapi.Error as exc:
            self.failed = len(self._ran) if answered == len(head) else len(self._ran) + answered
            sql, _, many = queue[min(answered, len(queue) - 1)]
            raise compat.driver_error(conn, exc, sql, many=many) from exc


COMMIT_SENT: Final = "cronoq_commit_sent"
"""`Connection.info` key: the transaction under way sent its COMMIT in a flight."""
_COMMIT: Final = ("COMMIT", None, False)
"""The COMMIT a flight ends with (`Flight.commit`)."""
_BEGIN: Final = ("BEGIN", None, False)
"""The BEGIN of the flight that opens a transaction."""
