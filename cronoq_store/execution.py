"""How the store's work runs, as opposed to what it runs: mechanics with no SQL of their own.

Statements are Core expressions, compiled by SQLAlchemy once per dialect, schema and key set
(`driver_sql`). How they then run is this module's business: on the DB-API cursor (`run`),
past SQLAlchemy's per-statement execution, a third of a small commit's CPU.

Which path runs is decided, never inferred from who listens (`observed`): the cursor, unless
the engine or connection asks for SQLAlchemy's execution with the `OBSERVED` execution option,
or SQLAlchemy's statement log is on (`echo`, or the `sqlalchemy.engine` logger at INFO), or the
driver is async. So a `before_cursor_execute` listener (OpenTelemetry's SQLAlchemy
instrumentation, a test's) costs the store nothing and sees only what SQLAlchemy executes;
to see every statement, set the option (docs/observability.md). What SQLAlchemy's execution
would add to a statement run on the cursor (its error wrapping) is `compat`'s.

Every compile cache of the store lives here, and so does the bulk work: IN lists in chunks
(`run_in`), inserts of many rows (`insert_many`: COPY on psycopg, executemany elsewhere).
"""

from __future__ import annotations

import gc
import heapq
import itertools
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Generator, Hashable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from functools import cache
from operator import itemgetter
from typing import Any, Final, NamedTuple

from sqlalchemy import (
    Connection,
    Delete,
    Engine,
    Insert,
    Select,
    Update,
    any_,
    bindparam,
    event,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Dialect
from sqlalchemy.sql import operators
from sqlalchemy.sql.elements import BinaryExpression, BindParameter, ColumnElement
from sqlalchemy.sql.visitors import replacement_traverse

from . import compat
from .dialects.base import dialect_of
from .errors import StoreError, StoreUnavailable

log = logging.getLogger(__name__)

__all__ = [
    "COMMIT_SENT",
    "CONNECT_TIMEOUT",
    "IN_CHUNK",
    "OBSERVED",
    "PING_IDLE",
    "SMALL_IN",
    "WATCHDOG",
    "Deadline",
    "Flight",
    "Ran",
    "Watchdog",
    "bound_connects",
    "bounded",
    "chunks",
    "collection_paused",
    "compile_key",
    "counted",
    "current_bound",
    "driver_sql",
    "ended",
    "insert_many",
    "insert_returning",
    "inserted_id",
    "observed",
    "ping_when_idle",
    "pipelines",
    "positional",
    "run",
    "run_in",
    "run_many",
    "run_stmt",
    "still_there",
    "stream",
]


class collection_paused:  # lower case: used as the function it was, `with collection_paused():`
    """Python's cyclic garbage collector off while objects are built to be kept (a
    recovery, an inbox read, a commit's rows until written), then back as it was.

    Recovering 100,000 tasks allocates about a million objects, all of them kept: every
    generation-0 pass on the way finds nothing to free, and those passes took 40% of
    recovery (a drain's read and commit of 1,000 items, a sixth). The objects hold no
    cycles, so nothing is left for the collector afterwards either; reference counting
    frees whatever is dropped meanwhile as usual. The collector is process-wide: a pause
    that finds it off leaves it to whoever turned it off.

    A class, not a generator: a leader's batch-1 commit enters two of these, and a
    generator-based context manager costs several times as much to enter and leave.
    """

    __slots__ = ("_paused",)

    def __enter__(self) -> None:
        self._paused = gc.isenabled()
        if self._paused:
            gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self._paused:
            gc.enable()


Statement = Insert | Update | Delete | Select[Any]
Params = Callable[[Mapping[str, Any]], Any]

_COMPILED: dict[tuple[Any, ...], tuple[str, Params | None]] = {}


def compile_key(conn: Connection, stmt: Any, variant: Hashable) -> tuple[Any, ...]:
    """What a statement's compiled form depends on: the statement (the object, not its id:
    a key must keep it alive), a `variant` of its parameters, the dialect and the schema."""
    translate = conn.get_execution_options().get("schema_translate_map")
    schema = None if translate is None else tuple(sorted(translate.items(), key=repr))
    return (stmt, variant, conn.dialect, schema)


def driver_sql(
    conn: Connection, stmt: Statement, keys: tuple[str, ...]
) -> tuple[str, Params | None]:
    """The driver SQL of `stmt` for parameter `keys`, and how to turn a mapping of them into
    the driver's parameters (None: the mapping itself, for a named paramstyle).

    Compiled once per statement, dialect, schema and key set. Running it as driver SQL skips
    SQLAlchemy's per-row parameter processing; the bound types the store uses (int, str,
    bytes, bool, None) need no bind processing on any supported driver.
    """
    translate = conn.get_execution_options().get("schema_translate_map")
    cache_key = compile_key(conn, stmt, keys)
    hit = _COMPILED.get(cache_key)
    if hit is None:
        compiled = stmt.compile(
            dialect=conn.dialect,
            column_keys=list(keys),
            schema_translate_map=translate,
            render_schema_translate=translate is not None,
        )
        # Binds the statement fills itself: constants (`id == 1`) and values computed when
        # it runs (SQLite's `b_host_now`, a `callable_`).
        own = {
            name: bind
            for bind, name in compiled.bind_names.items()
            if name not in keys and (bind.callable is not None or not bind.required)
        }
        missing = sorted(set(compiled.bind_names.values()) - set(keys) - set(own))
        if missing:
            raise StoreError(f"statement needs values for {missing}")
        order = compiled.positiontup
        getter: Params | None = None
        if compiled.positional and order is not None:
            getter = positional(tuple(order))
        if own:
            getter = _filled(own, getter)
        hit = _COMPILED[cache_key] = (str(compiled), getter)
    return hit


def _filled(own: Mapping[str, Any], then: Params | None) -> Params:
    """`then` applied to a mapping with the statement's own binds filled in."""

    def params(row: Mapping[str, Any]) -> Any:
        full = {n: b.callable() if b.callable is not None else b.value for n, b in own.items()}
        full.update(row)
        return full if then is None else then(full)

    return params


def positional(order: Sequence[str]) -> Params:
    """The positional parameters of a mapping, in `order` (always a tuple)."""
    if len(order) > 1:
        return itemgetter(*order)
    if order:
        key = order[0]
        return lambda r: (r[key],)
    return lambda r: ()


class Ran(NamedTuple):
    """What a statement did: rows it matched (the driver's rowcount; None where the driver
    cannot tell) and rows it returned."""

    rowcount: int | None
    rows: Sequence[Any]
    lastrowid: int | None = None
    """The key the driver says the statement's row got, where asked for (`inserted_id`)."""


def counted(rowcount: int) -> int | None:
    """A DB-API rowcount, None for the -1 of a driver that cannot tell."""
    return None if rowcount < 0 else rowcount


OBSERVED: Final = "cronoq_observed"
"""The execution option that runs the store's statements through SQLAlchemy's execution, so
that its listeners see every one (and PostgreSQL inserts with executemany, not COPY): e.g.
`store.engine.update_execution_options(cronoq_observed=True)`, or `execution_options=` of
`create_engine`. Off by default: the store then runs them on the DB-API cursor."""


def observed(conn: Connection) -> bool:
    """Whether `conn`'s statements run through SQLAlchemy's execution: asked for (`OBSERVED`),
    SQLAlchemy's statement log on (`compat.logs_statements`: `echo`, or the logger at INFO),
    or an async driver (whose cursor only SQLAlchemy drives). Listeners do not count: an
    instrumented engine keeps the fast path (the module docstring).
    """
    return bool(
        conn.dialect.is_async
        or conn.get_execution_options().get(OBSERVED)
        or compat.logs_statements(conn)
    )


def run(
    conn: Connection, sql: str, params: Any = None, *, many: bool = False, last: bool = False
) -> Ran:
    """Run driver SQL in `conn`'s transaction: on its DB-API cursor, or through
    `exec_driver_sql` when `observed`. `many`: `params` is a list, run as the driver's
    executemany. `last`: keep the driver's `lastrowid` (not every driver has one).

    A driver error leaves as SQLAlchemy's `DBAPIError` either way (parameters hidden: they are
    task data), and a lost connection is invalidated as SQLAlchemy would (`compat.driver_error`).
    """
    if observed(conn):
        result = conn.exec_driver_sql(sql, params)
        rows = result.all() if result.returns_rows else []
        return Ran(counted(result.rowcount), rows, result.lastrowid if last else None)
    dbapi_conn: Any = conn.connection.dbapi_connection
    cursor = dbapi_conn.cursor()
    try:
        if params is None:
            cursor.execute(sql)
        else:
            _executed(cursor, sql, params, many)
        rows = cursor.fetchall() if cursor.description is not None else []
        return Ran(counted(cursor.rowcount), rows, cursor.lastrowid if last else None)
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


def stream(conn: Connection, stmt: Select[Any], size: int) -> Generator[Sequence[Any], None, None]:
    """The rows of `stmt` (no parameters), `size` at a time, read from a cursor that holds
    no more than a chunk: a server-side cursor on psycopg and PyMySQL, SQLite's own (which
    steps through the result as it is fetched). Close the iterator when done with it early.

    On the DB-API cursor, as `run` runs statements: a recovery reads 100,000 rows this way,
    and SQLAlchemy's result (`yield_per`) cost 0.25-0.4 us more per row, a twentieth of a
    recovery. An observed connection (`observed`), or a driver with no such cursor known
    here, streams through SQLAlchemy's result.
    """
    impl = dialect_of(conn)
    cursor = None if observed(conn) else impl.streaming_cursor(conn.connection.dbapi_connection)
    if cursor is None:
        result = conn.execute(stmt.execution_options(yield_per=size))
        try:
            yield from result.partitions()
        finally:
            result.close()
        return
    sql, getter = driver_sql(conn, stmt, ())
    try:
        cursor.execute(sql, {} if getter is None else getter({}))  # parameters: `%%` is `%`
        while chunk := cursor.fetchmany(size):
            yield chunk
    except conn.dialect.loaded_dbapi.Error as exc:
        raise compat.driver_error(conn, exc, sql, cursor=cursor) from exc
    finally:
        if conn.invalidated:  # lost: nothing is left to read or close on the server
            impl.abandon(cursor)
        cursor.close()


PING_IDLE: Final = 1.0
"""Seconds a pooled connection may sit unused before its next checkout pings it."""

_CHECKED_IN: Final = "cronoq_checked_in"


def ping_when_idle(engine: Engine, idle: float = PING_IDLE) -> None:
    """Ping a pooled connection at checkout only when it sat unused for `idle` seconds.

    What `pool_pre_ping` is for (a restarted server costs a reconnect, not an error) at a
    fraction of its price: a leader committing back to back reuses connections within
    milliseconds, and a ping before each commit was a round trip and a tenth of its CPU. A
    connection lost within `idle` of its last use fails its statement instead, as one lost
    between a ping and the statement always could: `StoreUnavailable`, and the pool drops it.
    """
    dialect = engine.dialect

    @event.listens_for(engine, "checkin")
    def _checkin(_dbapi_connection: Any, record: Any) -> None:
        record.info[_CHECKED_IN] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checkout(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        since = record.info.get(_CHECKED_IN)
        if since is None or time.monotonic() - since < idle:
            return  # new (just connected), or used a moment ago
        _bind_current(dialect, dbapi_connection)
        if not _answers(dialect, dbapi_connection):
            # The pool discards this connection and checks out another (documented).
            raise sa_exc.DisconnectionError("connection lost while pooled")


def _answers(dialect: Dialect, dbapi_connection: Any) -> bool:
    """Whether a ping of `dbapi_connection` is answered (False if it was lost)."""
    try:
        return bool(dialect.do_ping(dbapi_connection))
    except dialect.loaded_dbapi.Error as exc:
        if not dialect.is_disconnect(exc, dbapi_connection, None):
            raise
        return False


def _bind_current(dialect: Dialect, dbapi_connection: Any) -> None:
    """Make the operation's deadline, if any, interrupt `dbapi_connection` (about to be
    pinged): a ping of a connection whose server went silent waits no longer than it."""
    deadline = _BOUND.get()
    if deadline is not None:
        driver = getattr(dbapi_connection, "driver_connection", dbapi_connection)
        WATCHDOG.bind(deadline, dialect_of(dialect).interrupter(driver))


def still_there(conn: Connection) -> bool:
    """Whether `conn`, kept checked out while unused for `PING_IDLE` or longer, may be used:
    the check the pool makes of an idle connection at checkout (`ping_when_idle`), for one
    that never went back to it. A lost one is invalidated. SQLite's is never lost."""
    if not dialect_of(conn).loses_connections:
        return True
    dbapi_conn = conn.connection.dbapi_connection
    _bind_current(conn.dialect, dbapi_conn)
    if _answers(conn.dialect, dbapi_conn):
        return True
    conn.invalidate()
    return False


class Deadline:
    """One operation's deadline with the `Watchdog`: when it passes, `interrupt` is called.

    Armed before the operation connects (`bounded`), so that connecting, the pool's ping and
    the transaction all count against it; `interrupt` is bound once there is a connection to
    interrupt (`Watchdog.bind`), and bound anew when the pool replaces it."""

    __slots__ = ("at", "fired", "interrupt", "interrupting", "settled")

    def __init__(self, at: float, interrupt: Callable[[], None] | None) -> None:
        self.at = at
        """Monotonic time at which the operation is interrupted."""
        self.interrupt = interrupt
        self.settled = False
        """The operation ended first: nothing to interrupt."""
        self.fired = False
        """The deadline passed first: the operation was (or is being) interrupted."""
        self.interrupting = False
        """The watchdog is calling `interrupt` now (`settle` waits for it to return)."""

    def left(self) -> float:
        """Seconds until the deadline (negative once it passed)."""
        return self.at - time.monotonic()


class Watchdog:
    """Interrupts transactions that outlive their deadline, from one daemon thread.

    A transaction can wait past every server-side bound: PostgreSQL applies no
    `statement_timeout` to a COMMIT waiting for a synchronous standby, and a server cut off
    silently (packets dropped, no RST) answers nothing, so a read waits for TCP to give up.
    The thread that waits cannot stop itself, so this one calls the operation's `interrupt`
    (a socket shutdown, SQLite's interrupt: `dialects.interrupter_of`) when its deadline
    passes. The call never blocks: one that did (a cancel request, which connects to the
    server anew) stalled this thread and, holding the GIL, every other.

    Arming and settling cost a lock and a heap push, never a thread switch: the thread sleeps
    until the earliest deadline and is woken only when a new one is earlier still. Settled
    entries leave the heap lazily (or in a sweep once they are most of it).
    """

    _SWEEP: Final = 1024

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._heap: list[tuple[float, int, Deadline]] = []
        self._order = itertools.count()
        self._settled = 0
        self._thread: threading.Thread | None = None
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        # A forked child has none of the parent's threads: start afresh on first use.
        self._cond = threading.Condition(threading.Lock())
        self._heap = []
        self._settled = 0
        self._thread = None

    def arm(self, seconds: float, interrupt: Callable[[], None] | None) -> Deadline:
        """A deadline `seconds` from now; `interrupt` (None: nothing to call) when it passes."""
        deadline = Deadline(time.monotonic() + seconds, interrupt)
        with self._cond:
            earlier = not self._heap or deadline.at < self._heap[0][0]
            heapq.heappush(self._heap, (deadline.at, next(self._order), deadline))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="cronoq-deadline-watchdog", daemon=True
                )
                self._thread.start()
            elif earlier:
                self._cond.notify()
        return deadline

    def bind(self, deadline: Deadline, interrupt: Callable[[], None] | None) -> None:
        """From now on `interrupt` stops `deadline`'s operation (its connection changed);
        called at once if the deadline passed already."""
        with self._cond:
            if not deadline.fired:
                deadline.interrupt = interrupt
                return
        if interrupt is not None:
            _interrupt(interrupt)

    def settle(self, deadline: Deadline) -> bool:
        """The operation ended: True if its deadline had passed first (it was interrupted,
        or is being: its connection must not be used again). Once an interrupt under way
        has returned, so that it never reaches a socket the caller closes after this. Idempotent."""
        with self._cond:
            if deadline.fired:
                while deadline.interrupting:
                    self._cond.wait()
                return True
            if deadline.settled:
                return False
            deadline.settled = True
            self._settled += 1
            if self._settled > self._SWEEP and self._settled * 2 > len(self._heap):
                self._heap = [e for e in self._heap if not e[2].settled]
                heapq.heapify(self._heap)
                self._settled = 0
        return False

    def _due(self) -> Deadline:
        """Wait for the next deadline that passes unsettled (holding the lock). The heap is
        read anew after every wait: a sweep (`settle`) replaces it meanwhile."""
        while True:
            heap = self._heap
            while heap and heap[0][2].settled:
                heapq.heappop(heap)
                self._settled -= 1
            now = time.monotonic()
            if heap and heap[0][0] <= now:
                deadline = heapq.heappop(heap)[2]
                deadline.fired = True
                return deadline
            self._cond.wait(heap[0][0] - now if heap else None)

    def _watch(self) -> None:
        while True:
            with self._cond:
                deadline = self._due()
                interrupt = deadline.interrupt
                if interrupt is None:
                    continue
                deadline.interrupting = True
            try:
                _interrupt(interrupt)
            finally:
                with self._cond:
                    deadline.interrupting = False
                    self._cond.notify_all()


def _interrupt(interrupt: Callable[[], None]) -> None:
    try:
        interrupt()
    except Exception:
        log.warning("could not interrupt an overdue transaction", exc_info=True)


WATCHDOG: Final = Watchdog()
"""The process's one watchdog, shared by every store and both faces."""

_BOUND: ContextVar[Deadline | None] = ContextVar("cronoq_bound", default=None)
"""The deadline of the operation this thread (or task) runs, while it connects and runs."""


class bounded:  # lower case: used as a function, `with bounded(seconds) as deadline:`
    """Arm a deadline `seconds` from now (None: no bound) for one operation, connecting
    included: a connect made meanwhile is given what is left of it (`bound_connects`), the
    pool's ping of an idle connection and the transaction are interrupted at it. Settled on
    leaving. A class, not a generator: every commit enters one."""

    __slots__ = ("_token", "deadline")

    def __init__(self, seconds: float | None) -> None:
        self.deadline = None if seconds is None else WATCHDOG.arm(seconds, None)

    def __enter__(self) -> Deadline | None:
        self._token = _BOUND.set(self.deadline)
        return self.deadline

    def __exit__(self, *exc: object) -> None:
        _BOUND.reset(self._token)
        if self.deadline is not None:
            WATCHDOG.settle(self.deadline)


def current_bound() -> Deadline | None:
    """The deadline of the operation under way in this context (`bounded`), if any."""
    return _BOUND.get()


CONNECT_TIMEOUT: Final = 10.0
"""Seconds a connection attempt may take outside any operation's bound (`open`, a migration,
a status read): libpq's `connect_timeout` and PyMySQL's, unless the URL says otherwise."""


def bound_connects(engine: Engine, key: str, *, whole: bool) -> None:
    """Give a connect of `engine`'s made within an operation's deadline (`bounded`) what is
    left of it as the driver's `key` (`connect_timeout`; in whole seconds if `whole`, as
    libpq counts them, which waits at least 2), and refuse to start one once nothing is left:
    connecting counts against the bound of the operation that connects."""

    @event.listens_for(engine, "do_connect")
    def _do_connect(_dialect: Any, _record: Any, _cargs: Any, cparams: dict[str, Any]) -> None:
        deadline = _BOUND.get()
        if deadline is None:
            return
        left = deadline.left()
        if left <= 0.05:
            raise StoreUnavailable(
                "no time left to connect within the operation's bound; not connected"
            )
        given = cparams.get(key)
        try:
            mine = float(given) if given is not None else CONNECT_TIMEOUT
        except (TypeError, ValueError):
            mine = CONNECT_TIMEOUT
        if mine <= 0:
            mine = CONNECT_TIMEOUT
        wait = min(mine, left)
        cparams[key] = max(1, math.ceil(wait)) if whole else wait


def pipelines(conn: Connection) -> bool:
    """Whether `conn` can send statements without waiting for each answer: sync psycopg's
    pipeline mode, on the DB-API cursor (`run`'s path: nothing observes the connection)."""
    return dialect_of(conn).pipelined and not observed(conn)


def ended(conn: Connection) -> bool:
    """Whether `conn`'s transaction has ended already: its COMMIT went in a flight
    (`Flight.commit`). Only a pipelined connection can say yes."""
    if not pipelines(conn):
        return False
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

    __slots__ = ("_queue", "_ran", "_then", "conn", "failed", "pipelined")

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.pipelined = pipelines(conn)
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
        sql, getter = driver_sql(self.conn, stmt, tuple(params))
        return self._add(sql, params if getter is None else getter(params), False)

    def add_many(self, stmt: Statement, rows: Sequence[Mapping[str, Any]]) -> int:
        """Queue (or run) `stmt` once per row as one executemany; its index in `send`'s."""
        sql, getter = driver_sql(self.conn, stmt, tuple(rows[0]))
        return self._add(sql, rows if getter is None else [getter(r) for r in rows], True)

    def add_in(self, stmt: Select[Any] | Update | Delete, ids: Sequence[Any]) -> int:
        """Queue (or run) `stmt` with its IN list bound to `ids` (`run_in`); its index."""
        if self.pipelined:  # psycopg: the list is one array parameter, as `run_in` binds it
            return self.add(_in_as_any(stmt), {"ids": list(ids)})
        index = len(self._ran)
        try:
            self._ran.append(run_in(self.conn, stmt, ids))
        except sa_exc.DBAPIError:
            self.failed = index
            raise
        return index

    def insert_many(self, stmt: Insert, rows: Sequence[Mapping[str, Any]]) -> None:
        """Insert `rows` on their own (`insert_many`: COPY cannot ride in a pipeline), after
        what is queued: a bulk insert must not overtake the statements added before it (a
        new task takes the key a transition before it released)."""
        self.send()
        insert_many(self.conn, stmt, rows)

    def _add(self, sql: str, params: Any, many: bool) -> int:
        index = len(self._ran) + len(self._queue)
        if self.pipelined:
            self._queue.append((sql, params, many))
        else:
            try:
                self._ran.append(run(self.conn, sql, params, many=many))
            except sa_exc.DBAPIError:
                self.failed = index
                raise
        return index

    def send(self) -> Sequence[Ran]:
        """Send what is queued and wait for the answers; every result so far, by index."""
        if self._queue:
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
        return self._ran

    def _checked(self) -> None:
        checks, self._then = self._then, []
        for check in checks:
            check(self._ran)

    def _send(self, *, commit: bool) -> None:
        from . import wire  # psycopg's: only a pipelined connection comes here

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


def _executed(cursor: Any, sql: str, params: Any, many: bool) -> Any:
    """`cursor` having run `sql`: an executemany of one row as an execute, which psycopg
    sends as it is, where it wraps an executemany in a pipeline of its own (60 µs of CPU)."""
    if many and len(params) == 1:
        cursor.execute(sql, params[0])
    elif many:
        cursor.executemany(sql, params)
    else:
        cursor.execute(sql, params)
    return cursor


# IN lists and bulk inserts: the store's two shapes of bulk work, each compiled once per
# dialect, schema and size (or key set), and run as one statement per chunk.

IN_CHUNK: Final = 1000
"""Most values bound into one IN list."""


def chunks(values: Sequence[Any], size: int = IN_CHUNK) -> Iterator[Sequence[Any]]:
    """`values` in slices of at most `size`, each small enough for one IN list."""
    for start in range(0, len(values), size):
        yield values[start : start + size]


SMALL_IN: Final = 8
"""IN lists up to this long are compiled once per length, as the full chunk is."""
_FULL_IN: dict[tuple[Any, ...], tuple[str, tuple[str, ...] | None]] = {}
"""IN statements of a full chunk or a short list: SQL, and parameter names unless positional."""


def run_in(conn: Connection, stmt: Select[Any] | Update | Delete, ids: Sequence[Any]) -> Ran:
    """Run `stmt` (its one expanding parameter "ids" bound to `ids`).

    On psycopg the list is one array parameter (`_in_as_any`). Elsewhere a full chunk (the
    usual case in large commits and in prune), and a short list (a small commit's), run a form
    compiled once with that many plain placeholders, instead of rendering the placeholders on
    every execution (a third of a batch-1 commit's statement overhead).
    """
    if dialect_of(conn).binds_arrays:
        return run_stmt(conn, _in_as_any(stmt), {"ids": list(ids)})
    count = len(ids)
    if count != IN_CHUNK and not 0 < count <= SMALL_IN:
        return _expanded(conn, stmt, ids)
    translate = conn.get_execution_options().get("schema_translate_map")
    key = compile_key(conn, stmt, count)
    hit = _FULL_IN.get(key)
    if hit is None:
        compiled = stmt.compile(
            dialect=conn.dialect,
            schema_translate_map=translate,
            render_schema_translate=translate is not None,
        )
        state = compiled.construct_expanded_state({"ids": list(range(count))})
        names = tuple(state.positiontup or state.parameters)
        if len(names) != count:  # not a statement of one IN list
            return _expanded(conn, stmt, ids)
        hit = _FULL_IN[key] = (state.statement, None if compiled.positional else names)
    sql, names_or_none = hit
    if names_or_none is None:
        return run(conn, sql, tuple(ids))
    return run(conn, sql, dict(zip(names_or_none, ids, strict=True)))


@cache
def _in_as_any(stmt: Select[Any] | Update | Delete) -> Select[Any] | Update | Delete:
    """`stmt` with its `IN (:ids)` (an expanding parameter) as `= ANY(:ids)`, one array."""

    def swap(element: Any, **kw: Any) -> Any:
        if (
            isinstance(element, BinaryExpression)
            and element.operator is operators.in_op
            and isinstance(element.right, BindParameter)
            and element.right.key == "ids"
        ):
            return element.left == any_(bindparam("ids", type_=ARRAY(element.left.type)))
        return None

    traversed: Any = stmt  # a statement is traversible; its stubs do not say so
    swapped: Select[Any] | Update | Delete = replacement_traverse(traversed, {}, swap)
    return swapped


def _expanded(conn: Connection, stmt: Select[Any] | Update | Delete, ids: Sequence[Any]) -> Ran:
    """`stmt` with its IN list rendered for `ids` by SQLAlchemy (any length)."""
    result = conn.execute(stmt, {"ids": list(ids)})
    return Ran(counted(result.rowcount), result.all() if result.returns_rows else [])


def _copy_sql(conn: Connection, stmt: Insert, columns: Sequence[str]) -> str:
    """`COPY table (columns) FROM STDIN` for `stmt`'s table on `conn`: in the schema the
    connection translates to, every name quoted by the dialect's own identifier preparer.

    The preparer escapes `%` as `%%` for a format paramstyle (psycopg's is pyformat), which the
    driver undoes only in a statement run with parameters; COPY runs without any.
    """
    prep = conn.dialect.identifier_preparer
    table = stmt.table
    translate = conn.get_execution_options().get("schema_translate_map") or {}
    schema = translate.get(table.schema, table.schema)
    target = prep.quote(table.name)
    if schema is not None:
        target = f"{prep.quote_schema(schema)}.{target}"
    names = ", ".join(prep.quote(c) for c in columns)
    sql = f"COPY {target} ({names}) FROM STDIN"
    if conn.dialect.paramstyle == "pyformat":
        sql = sql.replace("%%", "%")
    return sql


_COPY: dict[tuple[Any, ...], tuple[str, Callable[[Mapping[str, Any]], Any]]] = {}
"""COPY statements of a bulk insert, and each one's row getter (`_copy_form`)."""


def _copy_form(
    conn: Connection, stmt: Insert, keys: tuple[str, ...]
) -> tuple[str, Callable[[Mapping[str, Any]], Any]]:
    """The COPY statement for rows with `keys`, and how to turn a row into its values in
    column order: built once per statement, key set, dialect and schema."""
    cache_key = compile_key(conn, stmt, keys)
    hit = _COPY.get(cache_key)
    if hit is None:
        wanted = set(keys)
        columns = [c.name for c in stmt.table.c if c.name in wanted]
        hit = _COPY[cache_key] = (_copy_sql(conn, stmt, columns), positional(columns))
    return hit


def insert_many(conn: Connection, stmt: Insert, rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert `rows`: COPY on psycopg, the driver's executemany elsewhere.

    psycopg's executemany still sends one INSERT per row (pipelined); COPY streams them in one
    statement: as cheap from two rows, two to three times faster for a batch of 1000. COPY
    reaches no statement listener, so an observed connection (`observed`) inserts
    with executemany, which they see.
    """
    impl = dialect_of(conn)
    if len(rows) < 2 or not impl.copies or observed(conn):
        run_many(conn, stmt, rows)
        return
    copy_sql, getter = _copy_form(conn, stmt, tuple(rows[0]))
    cursor: Any = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    try:
        impl.copy_rows(cursor, copy_sql, rows, getter)
    except conn.dialect.loaded_dbapi.Error as exc:
        raise compat.driver_error(conn, exc, copy_sql, cursor=cursor) from exc
    finally:
        cursor.close()


VALUES_ROWS: Final = 1000
"""Rows per statement of `insert_returning` (SQLAlchemy's "insertmanyvalues" page size)."""
_PLACEHOLDER: Final = re.compile(r"%\((\w+)\)s")
_VALUES: dict[tuple[Any, ...], tuple[str, str, str, Params] | None] = {}
"""Multi-row forms of INSERT ... RETURNING statements (`_values_form`); None where there is
none."""


@cache
def _returning(stmt: Insert, column: ColumnElement[Any]) -> Insert:
    """`stmt` returning `column`, one statement object each (compiled forms are cached by it)."""
    return stmt.returning(column)


def _values_form(
    conn: Connection, stmt: Insert, column: ColumnElement[Any], keys: tuple[str, ...]
) -> tuple[str, str, str, Params] | None:
    """`stmt` (an INSERT of one row) returning `column`, in three parts for rows with `keys`:
    the head up to VALUES, one row's VALUES group in `%s` placeholders, the RETURNING tail;
    and a row's values in the group's order. None unless the group holds exactly the rows'
    own parameters, as pyformat's `%(name)s` (PyMySQL's paramstyle).

    Taken from SQLAlchemy's compiled SQL: the INSERT must end with its group, and the same
    INSERT with RETURNING extend it (a quoted name holding " VALUES (" stays in the head).
    """
    cache_key = compile_key(conn, stmt, ("values", column, keys))
    if cache_key in _VALUES:
        return _VALUES[cache_key]
    form = None
    if conn.dialect.paramstyle == "pyformat":
        plain_sql, _ = driver_sql(conn, stmt, keys)
        full_sql, _ = driver_sql(conn, _returning(stmt, column), keys)
        head, found, group = plain_sql.rpartition(" VALUES (")
        names = _PLACEHOLDER.findall(group)
        if found and full_sql.startswith(plain_sql) and sorted(names) == sorted(keys):
            group = _PLACEHOLDER.sub("%s", f"({group}")
            form = (head + " VALUES ", group, full_sql[len(plain_sql) :], positional(names))
    _VALUES[cache_key] = form
    return form


def insert_returning(
    conn: Connection, stmt: Insert, column: ColumnElement[Any], rows: Sequence[Mapping[str, Any]]
) -> list[Any] | None:
    """`column` of each of `rows` (sharing one key set) inserted by `stmt`, an INSERT of one
    row, in the order the server returns them: one statement of a VALUES group per row, up to
    `VALUES_ROWS`, with RETURNING. None where it cannot be written so (nothing ran then).

    What the MySQL drivers' executemany does without RETURNING (and not with it), and
    SQLAlchemy's "insertmanyvalues" does at twice the CPU of a 100-row enqueue (its per-row
    parameter processing).
    """
    form = _values_form(conn, stmt, column, tuple(rows[0]))
    if form is None:
        return None
    head, group, tail, values = form
    returned: list[Any] = []
    for chunk in chunks(rows, VALUES_ROWS):
        sql = f"{head}{', '.join([group] * len(chunk))}{tail}"
        params = tuple(value for row in chunk for value in values(row))  # one set, not many
        returned.extend(row[0] for row in run(conn, sql, params).rows)
    return returned
