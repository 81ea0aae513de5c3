"""`cronoq-store bench --rtt MS`: round trips per operation, through a latency proxy.

The store and the raw driver each reach their own database through a `proxy.Proxy` that adds
`MS / 2` milliseconds each way. For each operation the figure is the median, over a few
repeats, of the round trips the proxy counted (`Proxy.count`: PostgreSQL's Sync and Query
messages, MySQL's command packets) and of the wall time in RTTs (which also covers what a
count misses: a new connection's handshake).

The raw side is what a careful hand-written client sends for the same work: on PostgreSQL a
transaction in psycopg's pipeline mode (one flight, the driver's floor), on MySQL its statements
and COMMIT. The app's enqueue is the exception: its raw side is the app's own BEGIN, INSERT
and COMMIT, not pipelined (the store's enqueue should add nothing to it).

SQLite has no wire: a commit there is no round trip, and it is skipped.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from functools import partial
from typing import Any, Final, Protocol

from sqlalchemy import URL, create_engine, insert

from .. import dialects
from .. import inbox as inbox_module
from ..lease import new_holder, release_stmt, renew_stmt, take_stmt
from ..model import StatusChanged, Submitted, TaskId, TaskSpec, TaskStatus, TimeBase
from ..schema import inbox, leader
from ..store import SqlStore, StoreConfig
from .inbox import INBOX_COLUMNS, raw_inbox_row
from .proxy import proxied_url
from .raw import RawDriver
from .targets import server_label

OPERATIONS: Final = (
    "commit b1, a transition",
    "commit b1, a submission",
    "commit b100, submissions",
    "acquire_leadership, free lease",
    "release_leadership",
    "open, database already at head",
    "enqueue in the app's own transaction",
    "a lease renewal",
)
"""What `measure` reports, in this order (issue 41's table)."""

REPEATS: Final = 5
"""Measurements per operation and side; figures are medians."""

CONFIG: Final = StoreConfig(lease_ttl=timedelta(minutes=2), lease_renew=timedelta(minutes=1))
"""No renewal of the keeper's runs while a figure is measured (its own is measured apart)."""


@dataclass(frozen=True)
class RttFigure:
    """One operation's round trips: counted by the proxy, and timed (in RTTs)."""

    operation: str
    store: float
    """Round trips the store's operation asked for (median count)."""
    raw: float | None
    """The raw driver's, for the same work (None: nothing to compare)."""
    store_rtts: float
    """The store's wall time in RTTs (median)."""
    raw_rtts: float | None


@dataclass(frozen=True)
class RttResult:
    """Every operation's figures on one database, at one RTT."""

    label: str
    rtt_ms: float
    figures: tuple[RttFigure, ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "rtt_ms": self.rtt_ms,
            "figures": [asdict(f) for f in self.figures],
        }


class Counting(Protocol):
    """What counts round trips: a `Proxy`, or a server's own counter (the tests' MariaDB
    `Questions`)."""

    @property
    def count(self) -> int: ...


class Tally:
    """Counts (by `counter`) and times calls, per operation."""

    def __init__(self, counter: Counting, rtt: float) -> None:
        self.proxy = counter
        self.rtt = rtt
        self.counts: dict[str, list[int]] = {}
        self.times: dict[str, list[float]] = {}

    def run(self, op: str, fn: Callable[[], Any]) -> Any:
        before = self.proxy.count
        start = time.perf_counter()
        result = fn()
        elapsed = time.perf_counter() - start
        self.counts.setdefault(op, []).append(self.proxy.count - before)
        self.times.setdefault(op, []).append(elapsed / self.rtt if self.rtt else 0.0)
        return result

    def count(self, op: str) -> float | None:
        return statistics.median(self.counts[op]) if op in self.counts else None

    def rtts(self, op: str) -> float | None:
        return statistics.median(self.times[op]) if op in self.times else None


def _submission(i: int) -> Submitted:
    return Submitted(id=TaskId(i), seq=i, arrival=i, spec=TaskSpec(payload=b"x" * 100))


def store_round_trips(url: URL, side: Tally, *, repeats: int = REPEATS) -> None:
    """Every operation of `OPERATIONS` through the store at `url` (its database migrated, its
    connections counted by `side`'s counter), measured into `side`."""
    base = TimeBase(unix_ns=time.time_ns())
    for _ in range(repeats):
        store = side.run(OPERATIONS[5], lambda: SqlStore.open(url, CONFIG))
        store.close()
    with SqlStore.open(url, CONFIG) as store:
        for _ in range(repeats):
            side.run(OPERATIONS[3], store.acquire_leadership)
            side.run(OPERATIONS[4], store.release_leadership)
        epoch = store.acquire_leadership()
        store.commit(epoch, base, [_submission(0)])  # the statements prepared, the pool warm
        next_id = 1
        for _ in range(repeats):
            side.run(OPERATIONS[1], partial(store.commit, epoch, base, [_submission(next_id)]))
            next_id += 1
        for _ in range(repeats):
            batch = [_submission(next_id + i) for i in range(100)]
            side.run(OPERATIONS[2], partial(store.commit, epoch, base, batch))
            next_id += 100
        for i in range(1, repeats + 1):
            change = StatusChanged(id=TaskId(i), status=TaskStatus.RUNNING, attempt=1, at=i)
            side.run(OPERATIONS[0], partial(store.commit, epoch, base, [change]))
        renew: Callable[[], bool] = lambda: store._renew(epoch)  # noqa: E731 (the keeper's)
        renew()
        for _ in range(repeats):
            side.run(OPERATIONS[7], renew)
        store.release_leadership()
    app = create_engine(url, pool_size=1)
    try:
        with app.connect() as conn:
            spec = TaskSpec(payload=b"x" * 100, kind="bench.job")
            for _ in range(repeats + 1):

                def enqueue() -> None:
                    conn.begin()
                    inbox_module.enqueue(conn, spec)
                    conn.commit()

                side.run(OPERATIONS[6], enqueue)
            side.counts[OPERATIONS[6]].pop(0)  # the first prepares its statement
            side.times[OPERATIONS[6]].pop(0)
    finally:
        app.dispose()


class _FlightDriver(RawDriver):
    """`RawDriver` whose transactions are one flight on PostgreSQL: its BEGIN, statements and
    COMMIT sent in psycopg's pipeline mode on an autocommit connection, one Sync at the end
    (psycopg's own `commit()` in a pipeline syncs on its own: three round trips)."""

    def __init__(self, url: URL, dialect: Any) -> None:
        super().__init__(url, dialect, full_sync=True)
        self.pipelined = dialects.dialect_of(dialect).pipelined
        if self.pipelined:
            self.conn.autocommit = True

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Any]:
        with self._sent(pipelined=True) as cur:
            yield cur

    @contextlib.contextmanager
    def unpipelined(self) -> Iterator[Any]:
        """A transaction as an app writes it: BEGIN, each statement, COMMIT, one by one."""
        with self._sent(pipelined=False) as cur:
            yield cur

    @contextlib.contextmanager
    def _sent(self, *, pipelined: bool) -> Iterator[Any]:
        """BEGIN, the statements and COMMIT on the autocommit connection, in one pipeline or
        one by one; where the driver has no pipeline, `RawDriver`'s transaction."""
        if not self.pipelined:
            with RawDriver.transaction(self) as cur:
                yield cur
            return
        flight = self.conn.pipeline() if pipelined else contextlib.nullcontext()
        with flight, self.conn.cursor() as cur:
            cur.execute("BEGIN")
            yield cur
            cur.execute("COMMIT")


def raw_round_trips(url: URL, side: Tally, *, repeats: int = REPEATS) -> None:
    """What a hand-written client sends for the same operations (the module's doc)."""
    engine = create_engine(url)
    dialect = engine.dialect
    engine.dispose()
    raw = _FlightDriver(url, dialect)
    base = TimeBase(unix_ns=time.time_ns())
    holder = new_holder()
    ttl = 60 * 10**9

    def flight(fn: Callable[[Any], Any]) -> Callable[[], None]:
        """`fn(cursor)` in one transaction: a pipeline on PostgreSQL."""

        def run() -> None:
            with raw.transaction() as cur:
                fn(cur)

        return run

    def compiled(stmt: Any) -> tuple[str, Callable[[], list[Any]]]:
        """The driver's SQL of `stmt`, and its parameters (the statement's own constants
        beside `params`) in order."""
        sql, order = raw.sql(stmt)
        own = stmt.compile(dialect=raw.compile_dialect).params
        return sql, lambda: [params[k] if k in params else own[k] for k in order]

    take_sql, take_args = compiled(take_stmt())
    renew_sql, renew_args = compiled(renew_stmt())
    release_sql, release_args = compiled(release_stmt())
    epoch_sql, _ = raw.sql(leader.select().with_only_columns(leader.c.epoch))
    inbox_sql, order = raw.sql(insert(inbox).values({c: None for c in INBOX_COLUMNS}))
    if order != INBOX_COLUMNS:
        raise RuntimeError(f"unexpected inbox column order {order}")
    params: dict[str, Any] = {"b_holder": holder, "b_ttl": ttl, "b_acked": 0}

    def take(cur: Any) -> None:
        cur.execute(take_sql, take_args())
        cur.execute(epoch_sql)

    try:
        for _ in range(repeats):
            side.run(OPERATIONS[5], lambda: _raw_open(url, dialect))
        for _ in range(repeats):
            side.run(OPERATIONS[3], flight(take))
            side.run(OPERATIONS[4], flight(lambda c: c.execute(release_sql, release_args())))
        flight(take)()
        with raw.transaction() as cur:
            cur.execute(epoch_sql)
            params["b_epoch"] = int(cur.fetchone()[0])
        raw.submit(base, [_submission(0)])
        next_id = 1
        for _ in range(repeats):
            sub = [_submission(next_id)]
            side.run(OPERATIONS[1], partial(raw.submit, base, sub))
            next_id += 1
        for _ in range(repeats):
            batch = [_submission(next_id + i) for i in range(100)]
            side.run(OPERATIONS[2], partial(raw.submit, base, batch))
            next_id += 100
        for i in range(1, repeats + 1):
            change = [StatusChanged(id=TaskId(i), status=TaskStatus.RUNNING, attempt=1, at=i)]
            side.run(OPERATIONS[0], partial(raw.transition, base, change, {}))
        for _ in range(repeats):
            side.run(OPERATIONS[7], flight(lambda c: c.execute(renew_sql, renew_args())))
        row = raw_inbox_row(TaskSpec(payload=b"x" * 100, kind="bench.job"))
        for _ in range(repeats):

            def enqueue() -> None:
                with raw.unpipelined() as cur:
                    cur.execute(inbox_sql, row)

            side.run(OPERATIONS[6], enqueue)
    finally:
        raw.close()


def _raw_open(url: URL, dialect: Any) -> None:
    """A hand-written client's open: connect, and check the schema's revision in one query."""
    raw = _FlightDriver(url, dialect)
    try:
        cur = raw.conn.cursor()  # PostgreSQL: autocommit, so no BEGIN of its own
        cur.execute("SELECT version_num FROM cronoq_alembic_version")
        cur.fetchall()
    finally:
        raw.close()


def measure(url: URL, raw_url: URL, *, rtt_ms: float, repeats: int = REPEATS) -> RttResult:
    """`OPERATIONS` through the store at `url` and the raw driver at `raw_url` (both
    migrated by `SqlStore.open` first), each behind its own proxy at `rtt_ms`."""
    for u in (url, raw_url):
        SqlStore.open(u, CONFIG).close()
    rtt = rtt_ms / 1000
    with _routed(url, rtt) as (store_url, store_side), _routed(raw_url, rtt) as (raw_u, raw_side):
        store_round_trips(store_url, store_side, repeats=repeats)
        raw_round_trips(raw_u, raw_side, repeats=repeats)
    engine = create_engine(url)
    try:
        with engine.connect():
            label = server_label(engine.dialect)
    finally:
        engine.dispose()
    figures = tuple(
        RttFigure(
            operation=op,
            store=store_side.count(op) or 0.0,
            raw=raw_side.count(op),
            store_rtts=store_side.rtts(op) or 0.0,
            raw_rtts=raw_side.rtts(op),
        )
        for op in OPERATIONS
    )
    return RttResult(label=label, rtt_ms=rtt_ms, figures=figures)


@contextlib.contextmanager
def _routed(url: URL, rtt: float) -> Iterator[tuple[URL, Tally]]:
    with proxied_url(url, delay=rtt / 2) as (routed, proxy):
        yield routed, Tally(proxy, rtt)


def markdown(result: RttResult) -> str:
    """`result` as a Markdown table: counted round trips, and time in RTTs."""
    lines = [
        f"{result.label}, {result.rtt_ms:g} ms RTT:",
        "",
        "| operation | store round trips | raw | store time, RTTs | raw time, RTTs |",
        "|---|---:|---:|---:|---:|",
    ]
    for f in result.figures:
        raw = "-" if f.raw is None else f"{f.raw:g}"
        raw_t = "-" if f.raw_rtts is None else f"{f.raw_rtts:.1f}"
        lines.append(f"| {f.operation} | {f.store:g} | {raw} | {f.store_rtts:.1f} | {raw_t} |")
    return "\n".join(lines) + "\n"
