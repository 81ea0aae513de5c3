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
- `dialects.compiled`, `dialects.cursor`: the compile cache and the cursor runner (`run`, and
  `Flight`: a transaction's statements sent together, pipelined or batched where the
  database class says so: `pipelines`, `batches`), the connector's floor;
- `memory`: the garbage collector paused while kept objects are built;
- `deadlines`: the watchdog that interrupts an operation past its bound;
- `pooling`: the pool's idle connections pinged before use;
- `streaming`: large results read a chunk at a time;
- `bulk`: IN lists, COPY, multi-row RETURNING;
- here: `Flight`, the cursor's flight with what needs `bulk` (IN lists, bulk inserts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Delete, Insert, Select, Update
from sqlalchemy import exc as sa_exc

from ..dialects.base import dialect_of
from ..dialects.compiled import Statement as Statement
from ..dialects.compiled import compile_key as compile_key
from ..dialects.compiled import driver_sql as driver_sql
from ..dialects.compiled import positional as positional
from ..dialects.cursor import COMMIT_SENT as COMMIT_SENT
from ..dialects.cursor import OBSERVED as OBSERVED
from ..dialects.cursor import Flight as _Flight
from ..dialects.cursor import Ran as Ran
from ..dialects.cursor import batches as batches
from ..dialects.cursor import counted as counted
from ..dialects.cursor import ended as ended
from ..dialects.cursor import inserted_id as inserted_id
from ..dialects.cursor import observed as observed
from ..dialects.cursor import pipelines as pipelines
from ..dialects.cursor import run as run
from ..dialects.cursor import run_many as run_many
from ..dialects.cursor import run_on as run_on
from ..dialects.cursor import run_stmt as run_stmt
from ..dialects.sessions import CONNECT_TIMEOUT as CONNECT_TIMEOUT
from .bulk import IN_CHUNK as IN_CHUNK
from .bulk import SMALL_IN as SMALL_IN
from .bulk import chunks as chunks
from .bulk import in_as_any as in_as_any
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


class Flight(_Flight):
    """`dialects.cursor.Flight`, with what needs this floor's bulk statements: IN lists
    (`add_in`) and bulk inserts (`insert_many`, COPY where the database has it)."""

    __slots__ = ()

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
