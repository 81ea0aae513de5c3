"""How the store's work runs, as opposed to what it runs: mechanics with no SQL of their own.

Statements are Core expressions, compiled by SQLAlchemy once per dialect, schema and key set
(`driver_sql`). How they then run is this package's business: on the DB-API cursor (`run`),
past SQLAlchemy's per-statement execution, a third of a small commit's CPU.

Which path runs is decided, never inferred from who listens (`observed`): the cursor, unless
the engine or connection asks for SQLAlchemy's execution with the `OBSERVED` execution option,
or SQLAlchemy's statement log is on (`echo`, or the `sqlalchemy.engine` logger at INFO), or the
driver is async. So a `before_cursor_execute` listener (OpenTelemetry's SQLAlchemy
instrumentation, a test's) costs the store nothing and sees only what SQLAlchemy executes;
to see every statement, set the option (docs/observability.md). What SQLAlchemy's execution
would add to a statement run on the cursor (its error wrapping) is `compat`'s.

Its rooms, by role (this module re-exports their public names, as `execution.X`):
- `dialects.compiled`, `dialects.cursor`: the compile cache and the cursor runner (`run`),
  the connector's floor, below the database classes (`dialects.dialect_of`);
- `memory`: the garbage collector paused while kept objects are built;
- `deadlines`: the watchdog that interrupts an operation past its bound;
- `pooling`: the pool's idle connections pinged before use;
- `streaming`: large results read a chunk at a time;
- `bulk`: IN lists, COPY, multi-row RETURNING;
- here: `Flight`, a transaction's statements sent together (pipelined where the database
  class says so) and `pipelines`, which decides it (tests replace it as `execution.pipelines`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from sqlalchemy import Connection, Delete, Insert, Select, Update
from sqlalchemy import exc as sa_exc

from .. import compat
from ..dialects.base import dialect_of
from ..dialects.compiled import COMPILED, schema_key
from ..dialects.compiled import Statement as Statement
from ..dialects.compiled import compile_key as compile_key
from ..dialects.compiled import driver_sql as driver_sql
from ..dialects.compiled import positional as positional
from ..dialects.cursor import OBSERVED as OBSERVED
from ..dialects.cursor import Ran as Ran
from ..dialects.cursor import counted as counted
from ..dialects.cursor import inserted_id as inserted_id
from ..dialects.cursor import observed as observed
from ..dialects.cursor import run as run
from ..dialects.cursor import run_many as run_many
from ..dialects.cursor import run_on as run_on
from ..dialects.cursor import run_stmt as run_stmt
from ..dialects.sessions import CONNECT_TIMEOUT as CONNECT_TIMEOUT
from ..dialects.sessions import Line
from .bulk import IN_CHUNK as IN_CHUNK
from .bulk import SMALL_IN as SMALL_IN
from .bulk import chunks as chunks
from .bulk import in_as_any
from .bulk import insert_many as insert_many
from .bulk import insert_returning as insert_returning
from .bulk import run_in as run_in
from .deadlines import WATCHDOG as WATCHDOG
from .deadlines import Deadline as Deadline
from .deadlines import Watchdog as Watchdog
from .deadlines import bound_connects as bound_connects
from .deadlines import bounded as bounded
from .deadlines import current_bound as current_bound
from .memory import collection_paused as collection_paused
from .pooling import PING_IDLE as PING_IDLE
from .pooling import ping_when_idle as ping_when_idle
from .pooling import still_there as still_there
from .streaming import stream as stream

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
    "batches",
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
    "run_on",
    "run_stmt",
    "still_there",
    "stream",
]


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
        "failed",
        "pipelined",
        "watched",
    )

    def __init__(self, conn: Connection, line: Line | None = None) -> None:
        """A flight on `conn`; `line`: `conn`'s `dialects.Line`, when the caller has it (a
        commit's), which spares working its facts out again."""
        self.conn = conn
        # Worked out once for all of its statements: whether they are observed, and the
        # dialect and schema their compiled forms are kept under (`driver_sql`).
        options = conn.get_execution_options()
        translate = options.get("schema_translate_map")
        self._where = (conn.dialect, None if translate is None else schema_key(translate))
        self.watched = watched = observed(conn, options)
        """Whether its statements run through SQLAlchemy's execution (`observed`)."""
        if line is None:
            self.pipelined = not watched and pipelines(conn)
            self._dbapi: Any = None if watched else conn.connection.dbapi_connection
            may_batch = True
        else:
            self.pipelined = line.impl.pipelined and not watched and pipelines(conn)
            self._dbapi = None if watched else line.dbapi
            may_batch = line.impl.may_batch
        """The DB-API connection the statements run on (`run_on`); None: through `run`."""
        self.batched = may_batch and not self.pipelined and not watched and batches(conn)
        """MariaDB: `send` sends what is queued as one multi-statement packet (the dialect's
        `send_batch`), and `commit` the COMMIT in the last."""
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

    def add_in(self, stmt: Select[Any] | Update | Delete, ids: Sequence[Any]) -> int:
        """Queue (or run) `stmt` with its IN list bound to `ids` (`run_in`); its index."""
        if self.pipelined:  # psycopg: the list is one array parameter, as `run_in` binds it
            return self.add(in_as_any(stmt), {"ids": list(ids)})
        self.send()  # batched: what is queued runs first
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
        if self._dbapi is not None and not self.pipelined and not dialect_of(self.conn).copies:
            self.add_many(stmt, rows)  # the driver's executemany, as `insert_many` runs it
            return
        insert_many(self.conn, stmt, rows)

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

    @property
    def defers(self) -> bool:
        """Whether added statements wait for `send` (pipelined or batched): a check that
        must stop the statements behind it fails the flight instead of being read."""
        return self.pipelined or self.batched

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
