"""`cronoq-store bench`: the store beside the raw driver, on the same rows, in the same run.

Every figure is measured twice on the same database, in turns: once through `SqlStore` and once
through the bare DB-API driver (sqlite3, psycopg, PyMySQL) writing the same row values into
same-shaped tables (`bench_raw_tasks`, `bench_raw_task_deps`). Absolute numbers depend on the
machine; the ratio of the two, measured side by side, is what says what the store costs.

The raw side does what a careful hand-written store would do and no more: it encodes the same
JSON columns, executemany's plain statements (compiled once from Core, so both sides send the
same SQL shapes), and commits. It does not fence, fold, validate, or check idempotency.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import random
import signal
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Final, Literal, cast

import click
from sqlalchemy import (
    URL,
    Delete,
    Engine,
    Index,
    MetaData,
    Table,
    bindparam,
    create_engine,
    delete,
    false,
    func,
    insert,
    make_url,
    null,
    select,
    text,
    true,
    update,
)
from sqlalchemy.engine.interfaces import Dialect
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.expression import ClauseElement

from . import codec, dialects
from .model import (
    ById,
    ByKey,
    Dep,
    Mutation,
    StatusChanged,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    TimeBase,
)
from .schema import MYSQL_TABLE_ARGS, NAMING_CONVENTION, task_deps, tasks
from .store import SqlStore, StoreConfig

DEFAULT_TASKS: Final = 100_000
DEFAULT_BATCH_SIZES: Final = (1, 10, 100, 1000)
PAYLOAD_BYTES: Final = 100
MIN_COMMITS: Final = 20
"""Commits per throughput sample at least (large batches)."""
MIN_ROWS: Final = 500
"""Rows per throughput sample at least (small batches: this many commits)."""
POPULATE_BATCH: Final = 1000
SERVER_URLS: Final = {
    "postgresql": os.environ.get(
        "CRONOQ_BENCH_POSTGRESQL_URL",
        os.environ.get(
            "CRONOQ_TEST_POSTGRESQL_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
        ),
    ),
    "mysql": os.environ.get(
        "CRONOQ_BENCH_MYSQL_URL",
        os.environ.get("CRONOQ_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/"),
    ),
}
"""Servers on which `--dialect` creates (and afterwards drops) a scratch database."""

Metric = Literal["submit", "transition", "recover", "recover_memory", "prune"]
METRICS: Final[tuple[Metric, ...]] = ("submit", "transition", "recover", "recover_memory", "prune")
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), sort_keys=True).encode


# Results.


@dataclass(frozen=True, slots=True, kw_only=True)
class Figure:
    """One measurement of the store beside the raw driver (medians over the runs)."""

    metric: Metric
    batch_size: int | None
    """Rows per commit (submit, transition) or per delete (prune); None for recovery."""
    unit: str
    store: float
    """The store's figure: rows/s for throughput, seconds for recovery, peak bytes for memory."""
    raw: float
    """The raw driver's figure, or for memory the size of what recovery returned."""
    ratio: float
    """Median over the runs of store/raw, each pair measured side by side."""
    goal: float | None
    higher_is_better: bool
    samples: int

    @property
    def met(self) -> bool | None:
        """Whether the ratio reaches the goal (None without a goal)."""
        if self.goal is None:
            return None
        return self.ratio >= self.goal if self.higher_is_better else self.ratio <= self.goal

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["met"] = self.met
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class DatabaseResult:
    """Every figure of one database."""

    label: str
    """e.g. "sqlite full_sync=on", "postgresql 16.4", "mariadb 11.4"."""
    dialect: str
    url: str
    """The URL, password hidden."""
    figures: tuple[Figure, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchResult:
    tasks: int
    runs: int
    batch_sizes: tuple[int, ...]
    databases: tuple[DatabaseResult, ...]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchResult:
        """A result read back from `as_dict` (`--json`), e.g. to print or plot it later."""
        return cls(
            tasks=data["tasks"],
            runs=data["runs"],
            batch_sizes=tuple(data["batch_sizes"]),
            databases=tuple(
                DatabaseResult(
                    label=d["label"],
                    dialect=d["dialect"],
                    url=d["url"],
                    figures=tuple(
                        Figure(**{k: v for k, v in f.items() if k != "met"}) for f in d["figures"]
                    ),
                )
                for d in data["databases"]
            ),
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "tasks": self.tasks,
            "runs": self.runs,
            "batch_sizes": list(self.batch_sizes),
            "databases": [
                {
                    "label": d.label,
                    "dialect": d.dialect,
                    "url": d.url,
                    "figures": [f.as_dict() for f in d.figures],
                }
                for d in self.databases
            ],
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """A database to benchmark."""

    url: URL
    full_sync: bool = True
    """SQLite only: synchronous=FULL (on) or NORMAL (off)."""

    @property
    def dialect(self) -> str:
        name = self.url.get_backend_name()
        return "mysql" if name in ("mysql", "mariadb") else name


def _goal(target: Target, metric: Metric, batch: int | None) -> tuple[float | None, bool]:
    """The issue's targets: (goal ratio, whether higher is better)."""
    if metric in ("recover", "recover_memory"):
        return 2.0, False
    if metric == "prune":
        return 0.8, True
    if target.dialect == "sqlite":
        if not target.full_sync:
            return None, True
        return {1: 0.9, 1000: 0.8}.get(batch or 0), True
    if metric == "submit" and batch == 1000:
        return 1.0, True
    return None, True


# The workload: realistic specs, the same for the store and the raw driver.


class Workload:
    """Task ids, specs and times, handed out identically to both sides."""

    def __init__(self, base: TimeBase) -> None:
        self.base = base
        rng = random.Random(42)
        self._payloads = [rng.randbytes(PAYLOAD_BYTES) for _ in range(64)]
        self.output = rng.randbytes(PAYLOAD_BYTES)
        self.next_id = 1

    def now(self) -> int:
        """Engine time now."""
        return time.time_ns() - self.base.unix_ns

    def spec(self, i: int) -> TaskSpec:
        deps: tuple[Dep, ...] = ()
        if i > 2:
            deps = (Dep(target=ById(id=TaskId(i - 1))), Dep(target=ByKey(key=f"bench-{i - 2}")))
        return TaskSpec(
            payload=self._payloads[i % 64],
            kind="bench.job",
            key=f"bench-{i}",
            deps=deps,
            tags=frozenset({"bench", f"t{i % 8}"}),
            labels={"team": "core", "shard": str(i % 16)},
        )

    def submissions(self, count: int) -> list[Submitted]:
        start = self.next_id
        self.next_id += count
        arrival = self.now()
        return [
            Submitted(id=TaskId(i), seq=i, arrival=arrival, spec=self.spec(i))
            for i in range(start, start + count)
        ]


def _batches(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


# The raw driver: the same tables, the same rows, plain executemany.


def raw_tables(dialect: Dialect) -> tuple[Table, Table]:
    """`bench_raw_tasks` and `bench_raw_task_deps`: copies of the store's tables."""
    meta = MetaData(naming_convention=NAMING_CONVENTION)
    args = dict(MYSQL_TABLE_ARGS)
    if dialects.name(dialect) == "mysql":
        args["mysql_collate"] = dialects.mysql_collation(dialect)

    def copy(table: Table, name: str) -> Table:
        # Indexes anew, so the naming convention names them after the copy.
        out = Table(name, meta, *(c._copy() for c in table.columns), **args)
        for index in table.indexes:
            Index(None, *(out.c[c.name] for c in index.columns), unique=index.unique)
        return out

    return copy(tasks, "bench_raw_tasks"), copy(task_deps, "bench_raw_task_deps")


class RawDriver:
    """A bare DB-API connection running statements compiled once from Core."""

    def __init__(self, url: URL, dialect: Dialect, *, full_sync: bool) -> None:
        self.which = dialects.name(dialect)
        # The driver's own positional style, as a hand-written caller would bind rows.
        dialect_class: Any = type(dialect)
        self._compile_dialect: Dialect = dialect_class(
            paramstyle="qmark" if self.which == "sqlite" else "format"
        )
        self.conn: Any
        if self.which == "sqlite":
            self.conn = sqlite3.connect(url.database or "", isolation_level=None)
            for pragma in (
                "PRAGMA busy_timeout = 5000",
                "PRAGMA journal_mode = WAL",
                f"PRAGMA synchronous = {'FULL' if full_sync else 'NORMAL'}",
            ):
                self.conn.execute(pragma)
        elif self.which == "postgresql":
            psycopg: Any = importlib.import_module("psycopg")
            kw = {
                "host": url.host,
                "port": url.port,
                "user": url.username,
                "password": url.password,
                "dbname": url.database,
            }
            self.conn = psycopg.connect(**{k: v for k, v in kw.items() if v is not None})
        else:
            pymysql: Any = importlib.import_module("pymysql")
            self.conn = pymysql.connect(
                host=url.host or "localhost",
                port=url.port or 3306,
                user=url.username or "root",
                password=url.password or "",
                database=url.database,
                charset="utf8mb4",
                autocommit=False,
            )
        self.tasks, self.deps = raw_tables(dialect)
        self.insert_tasks, columns = self.sql(insert(self.tasks))
        if columns != tuple(c.name for c in self.tasks.columns):
            raise RuntimeError(f"unexpected insert column order {columns}")
        self.insert_deps, _ = self.sql(insert(self.deps))
        t = self.tasks
        self.running, _ = self.sql(
            update(t)
            .where(t.c.id == bindparam("b_id"))
            .values(
                status=bindparam("b_status"),
                terminal=bindparam("b_terminal"),
                attempt=bindparam("b_attempt"),
                updated_unix_ns=bindparam("b_at"),
            )
        )
        self.finished, _ = self.sql(
            update(t)
            .where(t.c.id == bindparam("b_id"))
            .values(
                status=bindparam("b_status"),
                terminal=bindparam("b_terminal"),
                attempt=bindparam("b_attempt"),
                updated_unix_ns=bindparam("b_at"),
                live_key=null(),
                output=bindparam("b_output"),
            )
        )
        self.live, _ = self.sql(
            select(
                t.c.id,
                t.c.seq,
                t.c.arrival_unix_ns,
                t.c.attempt,
                *(t.c[name] for name in codec.SPEC_COLUMNS),
            )
            .where(t.c.terminal == false())
            .order_by(t.c.id)
        )
        self._prunable = (
            select(t.c.id)
            .where(t.c.terminal == true(), t.c.updated_unix_ns < bindparam("cutoff"))
            .order_by(t.c.updated_unix_ns)
            .limit(bindparam("limit"))
            .compile(dialect=self._compile_dialect)
        )
        self.prunable = str(self._prunable)
        self._prunable_keys = tuple(self._prunable.positiontup or ())
        self._in_lists: dict[tuple[str, int], str] = {}

    def sql(self, stmt: ClauseElement) -> tuple[str, tuple[str, ...]]:
        """The driver SQL of a Core statement and the order of its parameters."""
        compiled = cast(SQLCompiler, stmt.compile(dialect=self._compile_dialect))
        return str(compiled), tuple(compiled.positiontup or ())

    def delete_in(self, table: Literal["tasks", "deps"], count: int) -> str:
        """DELETE ... WHERE id IN (count placeholders), compiled once per count."""
        sql = self._in_lists.get((table, count))
        if sql is None:
            stmt: Delete
            if table == "tasks":
                column = self.tasks.c.id
                stmt = delete(self.tasks)
            else:
                column = self.deps.c.task_id
                stmt = delete(self.deps)
            stmt = stmt.where(column.in_([bindparam(f"i{n}") for n in range(count)]))
            sql = self.sql(stmt)[0]
            self._in_lists[(table, count)] = sql
        return sql

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Any]:
        """A cursor in a transaction (BEGIN IMMEDIATE on SQLite, as the store does)."""
        if self.which == "sqlite":
            self.conn.execute("BEGIN IMMEDIATE")
        cursor = self.conn.cursor()
        try:
            yield cursor
        except BaseException:
            self.conn.rollback()
            raise
        finally:
            cursor.close()
        if self.which == "sqlite":
            self.conn.execute("COMMIT")
        else:
            self.conn.commit()

    def close(self) -> None:
        self.conn.close()

    # What the raw side does for each figure.

    def submit(self, base: TimeBase, batch: Sequence[Submitted]) -> None:
        """Encode and insert new tasks and their dependency rows, in one transaction."""
        now = time.time_ns()
        rows: list[tuple[Any, ...]] = []
        dep_rows: list[tuple[Any, ...]] = []
        for m in batch:
            s = m.spec
            deps = "[]"
            if s.deps:
                items: list[dict[str, Any]] = []
                for ordinal, d in enumerate(s.deps):
                    if isinstance(d.target, ById):
                        items.append({"id": d.target.id, "on": d.on})
                        dep_rows.append((m.id, ordinal, d.target.id, None))
                    else:
                        items.append({"key": d.target.key, "on": d.on})
                        dep_rows.append((m.id, ordinal, None, d.target.key))
                deps = _dumps(items)
            rows.append(
                (
                    m.id,
                    m.seq,
                    base.unix_ns + m.arrival,
                    s.pool,
                    s.kind,
                    int(s.priority),
                    s.key,
                    s.key,
                    s.payload,
                    None,
                    None,
                    None,
                    None,
                    None,
                    None,
                    None,
                    deps,
                    _dumps(s.resources) if s.resources else "{}",
                    _dumps(sorted(s.tags)) if s.tags else "[]",
                    _dumps(s.labels) if s.labels else "{}",
                    s.tenant,
                    TaskStatus.QUEUED.value,
                    False,
                    0,
                    now,
                    None,
                    None,
                )
            )
        with self.transaction() as cur:
            cur.executemany(self.insert_tasks, rows)
            if dep_rows:
                cur.executemany(self.insert_deps, dep_rows)

    def transition(
        self, base: TimeBase, batch: Sequence[StatusChanged], outputs: dict[int, bytes | None]
    ) -> None:
        """Status updates (with outputs; finished tasks lose their dependency rows)."""
        with self.transaction() as cur:
            if outputs:
                cur.executemany(
                    self.finished,
                    [
                        (m.status.value, True, m.attempt, base.unix_ns + m.at, outputs[m.id], m.id)
                        for m in batch
                    ],
                )
                cur.execute(self.delete_in("deps", len(batch)), [m.id for m in batch])
            else:
                cur.executemany(
                    self.running,
                    [(m.status.value, False, m.attempt, base.unix_ns + m.at, m.id) for m in batch],
                )

    def recover(self) -> list[tuple[Any, ...]]:
        """Fetch the live tasks in id order, decoding their JSON columns."""
        cur = self.conn.cursor()
        cur.execute(self.live)
        loads = json.loads
        out = []
        while chunk := cur.fetchmany(1000):
            for r in chunk:
                out.append(
                    (
                        *r[:8],
                        bytes(r[8]),
                        *r[9:15],
                        None if r[15] is None else loads(r[15]),
                        loads(r[16]),
                        loads(r[17]),
                        loads(r[18]),
                        loads(r[19]),
                        r[20],
                    )
                )
        cur.close()
        if self.which != "sqlite":
            self.conn.commit()
        return out

    def _prunable_params(self, cutoff: int, limit: int) -> list[Any]:
        params = self._prunable.construct_params({"cutoff": cutoff, "limit": limit})
        return [params[k] for k in self._prunable_keys]

    def prune(self, cutoff: int, limit: int) -> int:
        """Delete finished tasks updated before `cutoff`, `limit` per transaction."""
        total = 0
        while True:
            with self.transaction() as cur:
                cur.execute(self.prunable, self._prunable_params(cutoff, limit))
                ids = [r[0] for r in cur.fetchall()]
                if ids:
                    cur.execute(self.delete_in("tasks", len(ids)), ids)
            total += len(ids)
            if len(ids) < limit:
                return total


# One database.


def _progress(message: str) -> None:
    click.echo(f"  {message}", err=True)


def _median_ratio(pairs: Sequence[tuple[float, float]]) -> tuple[float, float, float]:
    store = statistics.median(p[0] for p in pairs)
    raw = statistics.median(p[1] for p in pairs)
    ratio = statistics.median(p[0] / p[1] if p[1] else float("inf") for p in pairs)
    return store, raw, ratio


def _timed(fn: Callable[[], Any]) -> float:
    gc.collect()
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


class _Bench:
    """The measurements on one database, both sides sharing it."""

    def __init__(
        self, target: Target, *, tasks: int, batch_sizes: Sequence[int], runs: int
    ) -> None:
        self.target = target
        self.n = tasks
        self.batch_sizes = batch_sizes
        self.runs = runs
        self.base = TimeBase(unix_ns=time.time_ns())
        self.work = Workload(self.base)
        # A long lease: on SQLite a 100k-task recovery holds the write lock for seconds (longer
        # under tracemalloc), and the keeper must not lose the lease mid-benchmark.
        config = StoreConfig(
            full_sync=target.full_sync,
            retention=timedelta(hours=1),
            lease_ttl=timedelta(minutes=10),
            lease_renew=timedelta(seconds=5),
        )
        self.store = SqlStore.open(target.url, config)
        self.engine: Engine = self.store.engine
        self.figures: list[Figure] = []
        try:
            with self.engine.connect():  # initializes the dialect (server version)
                self.label = _label(target, self.engine.dialect)
            self.raw_tasks, self.raw_deps = raw_tables(self.engine.dialect)
            self.raw_tasks.metadata.create_all(self.engine)
            self.raw = RawDriver(target.url, self.engine.dialect, full_sync=target.full_sync)
            self.epoch = self.store.acquire_leadership()
        except BaseException:
            self.store.close()
            raise

    def close(self) -> None:
        self.raw.close()
        try:
            self.reset()
            self.raw_tasks.metadata.drop_all(self.engine)
        finally:
            self.store.close()

    def reset(self) -> None:
        """Empty both sides' tables."""
        with self.engine.begin() as conn:
            for table in (task_deps, tasks, self.raw_deps, self.raw_tasks):
                conn.execute(delete(table))

    def check_same_rows(self, ignore: Sequence[str] = ()) -> None:
        """Refuse to report ratios unless both sides hold the same rows."""
        with self.engine.connect() as conn:
            for mine, theirs in ((tasks, self.raw_tasks), (task_deps, self.raw_deps)):
                names = [c.name for c in mine.columns if c.name not in ignore]
                order = [mine.c[c.name] for c in mine.primary_key]
                a = conn.execute(select(*(mine.c[n] for n in names)).order_by(*order)).all()
                order = [theirs.c[c.name] for c in theirs.primary_key]
                b = conn.execute(select(*(theirs.c[n] for n in names)).order_by(*order)).all()
                if a != b:
                    raise RuntimeError(f"the raw driver's {theirs.name} differs from {mine.name}")

    def add(
        self, metric: Metric, batch: int | None, unit: str, pairs: list[tuple[float, float]]
    ) -> None:
        store, raw, ratio = _median_ratio(pairs)
        goal, higher = _goal(self.target, metric, batch)
        self.figures.append(
            Figure(
                metric=metric,
                batch_size=batch,
                unit=unit,
                store=store,
                raw=raw,
                ratio=ratio,
                goal=goal,
                higher_is_better=higher,
                samples=len(pairs),
            )
        )

    def commit(
        self, batch: Sequence[Mutation], outputs: Sequence[tuple[TaskId, bytes]] = ()
    ) -> None:
        if not self.store.is_leader:  # lost between phases: lead again, the timing is not ours
            self.epoch = self.store.acquire_leadership()
        self.store.commit(self.epoch, self.base, batch, outputs)

    def _store_submit(self, batches: Sequence[Sequence[Submitted]]) -> None:
        for b in batches:
            self.commit(b)

    def _raw_submit(self, batches: Sequence[Sequence[Submitted]]) -> None:
        for b in batches:
            self.raw.submit(self.base, b)

    def _store_trans(
        self, running: Sequence[Sequence[StatusChanged]], done: Sequence[Sequence[StatusChanged]]
    ) -> None:
        for b in running:
            self.commit(b)
        out = self.work.output
        for b in done:
            self.commit(b, [(m.id, out) for m in b])

    def _raw_trans(
        self, running: Sequence[Sequence[StatusChanged]], done: Sequence[Sequence[StatusChanged]]
    ) -> None:
        for b in running:
            self.raw.transition(self.base, b, {})
        out = self.work.output
        for b in done:
            self.raw.transition(self.base, b, {m.id: out for m in b})

    def throughput(self) -> None:
        """Submissions, then transitions (running, then succeeded with an output)."""
        for size in self.batch_sizes:
            rows = max(size, min(self.n, max(size * MIN_COMMITS, MIN_ROWS)))
            rows -= rows % size
            submit: list[tuple[float, float]] = []
            trans: list[tuple[float, float]] = []
            for run in range(self.runs):
                self.reset()
                subs = _batches(self.work.submissions(rows), size)
                ids = [m.id for b in subs for m in b]
                t = self.work.now()
                running = _batches(
                    [StatusChanged(id=i, status=TaskStatus.RUNNING, attempt=1, at=t) for i in ids],
                    size,
                )
                done = _batches(
                    [
                        StatusChanged(id=i, status=TaskStatus.SUCCEEDED, attempt=1, at=t + 1)
                        for i in ids
                    ],
                    size,
                )
                store_submit = partial(self._store_submit, subs)
                raw_submit = partial(self._raw_submit, subs)
                store_trans = partial(self._store_trans, running, done)
                raw_trans = partial(self._raw_trans, running, done)
                # Alternate who goes first, so drift (caches, checkpoints) favours neither.
                if run % 2 == 0:
                    s, r = _timed(store_submit), _timed(raw_submit)
                else:
                    r, s = _timed(raw_submit), _timed(store_submit)
                if run == 0:
                    self.check_same_rows(ignore=("updated_unix_ns",))
                if run % 2 == 0:
                    st, rt = _timed(store_trans), _timed(raw_trans)
                else:
                    rt, st = _timed(raw_trans), _timed(store_trans)
                if run == 0:
                    self.check_same_rows()
                submit.append((rows / s, rows / r))
                trans.append((2 * rows / st, 2 * rows / rt))
            self.add("submit", size, "rows/s", submit)
            self.add("transition", size, "rows/s", trans)
            _progress(
                f"batch {size}: submit x{self.figures[-2].ratio:.2f}, "
                f"transition x{self.figures[-1].ratio:.2f}"
            )

    def populate(self, count: int, *, finished_at: int | None = None) -> None:
        """`count` tasks on both sides (live, or succeeded at engine time `finished_at`)."""
        for b in _batches(self.work.submissions(count), POPULATE_BATCH):
            batch: list[Mutation] = list(b)
            if finished_at is not None:
                batch += [
                    StatusChanged(id=m.id, status=TaskStatus.SUCCEEDED, attempt=1, at=finished_at)
                    for m in b
                ]
            self.commit(batch)
            self.raw.submit(self.base, b)
            if finished_at is not None:
                self.raw.transition(
                    self.base,
                    [m for m in batch if isinstance(m, StatusChanged)],
                    {m.id: None for m in b},
                )

    def recovery(self) -> None:
        """Recovery of `n` live tasks: time, and peak memory against what it returns."""
        self.reset()
        self.populate(self.n)
        _progress(f"{self.n} live tasks stored")
        pairs = []
        for run in range(self.runs):
            store = raw = 0.0
            if run % 2 == 0:
                store = _timed(lambda: self.store.recover(self.base))
                raw = _timed(self.raw.recover)
            else:
                raw = _timed(self.raw.recover)
                store = _timed(lambda: self.store.recover(self.base))
            pairs.append((store, raw))
        self.add("recover", None, "s", pairs)
        peak, size = _memory(lambda: self.store.recover(self.base))
        self.add("recover_memory", None, "bytes", [(peak, size)])
        _progress(
            f"recover x{self.figures[-2].ratio:.2f} of raw; "
            f"peak memory x{self.figures[-1].ratio:.2f} of the result"
        )

    def _store_prune(self, counts: list[int]) -> None:
        counts.append(self.store.prune(timedelta(hours=1)))

    def _raw_prune(self, counts: list[int], cutoff: int, limit: int) -> None:
        counts.append(self.raw.prune(cutoff, limit))

    def prune(self) -> None:
        """Prune of `n` finished tasks (beside the live ones), in the store's batch size."""
        from .repository import PRUNE_BATCH

        pairs = []
        for run in range(self.runs):
            self.populate(self.n, finished_at=self.work.now() - 2 * 3600 * 10**9)
            cutoff = time.time_ns() - 3600 * 10**9
            counts: list[int] = []
            store_prune = partial(self._store_prune, counts)
            raw_prune = partial(self._raw_prune, counts, cutoff, PRUNE_BATCH)
            if run % 2 == 0:
                s, r = _timed(store_prune), _timed(raw_prune)
            else:
                r, s = _timed(raw_prune), _timed(store_prune)
            if counts != [self.n, self.n]:
                raise RuntimeError(f"pruned {counts}, expected {self.n} on each side")
            pairs.append((self.n / s, self.n / r))
        self.add("prune", PRUNE_BATCH, "rows/s", pairs)
        _progress(f"prune x{self.figures[-1].ratio:.2f}")


def _memory(fn: Callable[[], Any]) -> tuple[float, float]:
    """Peak traced bytes while `fn` runs, and the bytes its result keeps."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        result = fn()
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del result
    return float(peak - before), float(current - before)


def _label(target: Target, dialect: Dialect) -> str:
    if target.dialect == "sqlite":
        return f"sqlite {sqlite3.sqlite_version} full_sync={'on' if target.full_sync else 'off'}"
    version = ".".join(str(v) for v in (dialect.server_version_info or ())[:3])
    name = "mariadb" if getattr(dialect, "is_mariadb", False) else dialect.name
    return f"{name} {version}"


def bench_database(
    target: Target,
    *,
    tasks: int = DEFAULT_TASKS,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    runs: int = 3,
) -> DatabaseResult:
    """Every figure on one database (which must not hold a store in use)."""
    b = _Bench(target, tasks=tasks, batch_sizes=batch_sizes, runs=runs)
    click.echo(f"{b.label}:", err=True)
    try:
        b.throughput()
        b.recovery()
        b.prune()
    finally:
        b.close()
    return DatabaseResult(
        label=b.label,
        dialect=target.dialect,
        url=target.url.render_as_string(hide_password=True),
        figures=tuple(b.figures),
    )


def run_bench(
    targets: Sequence[Target],
    *,
    tasks: int = DEFAULT_TASKS,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    runs: int = 3,
) -> BenchResult:
    """Benchmark every target, one after the other."""
    return BenchResult(
        tasks=tasks,
        runs=runs,
        batch_sizes=tuple(batch_sizes),
        databases=tuple(
            bench_database(t, tasks=tasks, batch_sizes=batch_sizes, runs=runs) for t in targets
        ),
    )


# Databases to run on: SQLite temp files, scratch server databases, or given URLs.


@contextlib.contextmanager
def scratch_database(server_url: str | URL) -> Iterator[URL]:
    """A new, uniquely named database on a server, dropped afterwards."""
    url = make_url(server_url)
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    name = f"cronoq_bench_{uuid.uuid4().hex[:12]}"
    mysql = dialects.name(admin.dialect) == "mysql"
    try:
        with admin.connect() as conn:
            conn.execute(text(f"CREATE DATABASE {name}" + (" CHARACTER SET utf8mb4" * mysql)))
        yield url.set(database=name)
    finally:
        with admin.connect() as conn:
            force = "" if mysql else " WITH (FORCE)"
            conn.execute(text(f"DROP DATABASE IF EXISTS {name}{force}"))
        admin.dispose()


def _sqlite_targets(path: str) -> list[Target]:
    url = make_url("sqlite://").set(database=path)
    return [Target(url=url, full_sync=True), Target(url=url, full_sync=False)]


def _check_empty(url: URL) -> None:
    """Refuse a database whose store holds tasks: the benchmark empties its tables."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            if engine.dialect.has_table(conn, tasks.name):
                count = conn.execute(select(func.count()).select_from(tasks)).scalar()
                if count:
                    raise click.ClickException(
                        f"{url.render_as_string(hide_password=True)} holds {count} tasks; "
                        "the benchmark needs a database without a store in use"
                    )
    finally:
        engine.dispose()


@contextlib.contextmanager
def resolve_targets(urls: Sequence[str], dialect_names: Sequence[str]) -> Iterator[list[Target]]:
    """The targets for the command line options (SQLite temp files by default)."""
    with contextlib.ExitStack() as stack:
        targets: list[Target] = []
        names = list(dialect_names)
        if "all" in names:
            names = ["sqlite", "postgresql", "mysql"]
        if not urls and not names:
            names = ["sqlite"]
        for name in dict.fromkeys(names):
            if name == "sqlite":
                tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="cronoq-bench-"))
                targets += _sqlite_targets(str(Path(tmp) / "bench.db"))
            else:
                targets.append(Target(url=stack.enter_context(scratch_database(SERVER_URLS[name]))))
        for raw in urls:
            if "://" not in raw:
                targets += _sqlite_targets(raw)
                continue
            url = make_url(raw)
            _check_empty(url)
            if url.get_backend_name() == "sqlite":
                targets += _sqlite_targets(url.database or "")
            else:
                targets.append(Target(url=url))
        yield targets


# Output.


def _fmt(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value:.3f} s"
    if unit == "bytes":
        return f"{value / 2**20:.1f} MiB"
    return f"{value:,.0f} /s"


METRIC_NAMES: Final = {
    "submit": "submit",
    "transition": "transition",
    "recover": "recover time",
    "recover_memory": "recover peak mem",
    "prune": "prune",
}


def print_table(result: BenchResult, file: Any = None) -> None:
    """The figures as a table on the terminal."""
    from rich.console import Console
    from rich.table import Table as RichTable

    console = Console(file=file or sys.stdout, width=120)
    table = RichTable(
        title=f"cronoq-store bench: {result.tasks} tasks, median of {result.runs}",
        caption="ratio = store / raw (memory: peak / size of the result)",
    )
    for name in ("database", "figure", "batch", "store", "raw", "ratio", "goal", "met"):
        table.add_column(name, justify="left" if name in ("database", "figure") else "right")
    for db in result.databases:
        for f in db.figures:
            raw = "result " + _fmt(f.raw, f.unit) if f.metric == "recover_memory" else None
            goal = "" if f.goal is None else ("≥ " if f.higher_is_better else "≤ ") + f"{f.goal}"
            met = {None: "", True: "[green]yes[/]", False: "[red]no[/]"}[f.met]
            table.add_row(
                db.label,
                METRIC_NAMES[f.metric],
                "" if f.batch_size is None else str(f.batch_size),
                _fmt(f.store, f.unit),
                raw or _fmt(f.raw, f.unit),
                f"{f.ratio:.2f}x",
                goal,
                met,
            )
        table.add_section()
    console.print(table)


def plot(result: BenchResult, path: Path) -> None:
    """Throughput against batch size, one panel per database (needs the `plot` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise click.ClickException(
            "--plot needs matplotlib: pip install 'cronoq-store[plot]'"
        ) from exc
    count = len(result.databases)
    fig, axes = plt.subplots(1, count, figsize=(5 * count, 4), squeeze=False)
    for ax, db in zip(axes[0], result.databases, strict=True):
        for metric, color in (("submit", "tab:blue"), ("transition", "tab:orange")):
            figs = [f for f in db.figures if f.metric == metric]
            sizes = [f.batch_size for f in figs]
            ax.plot(sizes, [f.store for f in figs], "o-", color=color, label=f"{metric} store")
            ax.plot(sizes, [f.raw for f in figs], "s--", color=color, label=f"{metric} raw")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(db.label)
        ax.set_xlabel("batch size (rows per commit)")
        ax.set_ylabel("rows/s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _sizes(_ctx: click.Context, _param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError as exc:
        raise click.BadParameter("a comma-separated list of integers") from exc
    if not sizes or min(sizes) < 1:
        raise click.BadParameter("batch sizes must be positive")
    return sizes


@click.command("bench")
@click.option(
    "--url",
    "urls",
    multiple=True,
    help="database URL or SQLite path (repeatable); its store must hold no tasks",
)
@click.option(
    "--dialect",
    "dialect_names",
    multiple=True,
    type=click.Choice(["sqlite", "postgresql", "mysql", "all"]),
    help="a SQLite temp file, or a scratch database on the server of "
    "CRONOQ_BENCH_POSTGRESQL_URL / CRONOQ_BENCH_MYSQL_URL (repeatable)",
)
@click.option("-n", "--tasks", default=DEFAULT_TASKS, show_default=True, help="tasks recovered")
@click.option(
    "--batch-sizes",
    default=",".join(map(str, DEFAULT_BATCH_SIZES)),
    show_default=True,
    callback=_sizes,
    help="rows per commit",
)
@click.option("--runs", default=3, show_default=True, help="runs; figures are medians")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="write a PNG of throughput against batch size (needs the plot extra)",
)
def bench(
    urls: tuple[str, ...],
    dialect_names: tuple[str, ...],
    tasks: int,
    batch_sizes: tuple[int, ...],
    runs: int,
    as_json: bool,
    plot_path: Path | None,
) -> None:
    """Measure the store beside the raw driver: commits, recovery, prune."""
    if tasks < 1 or runs < 1:
        raise click.BadParameter("--tasks and --runs must be positive")
    if threading.current_thread() is threading.main_thread():
        # Terminated: unwind, so scratch databases and raw tables are dropped.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with resolve_targets(urls, dialect_names) as targets:
        result = run_bench(targets, tasks=tasks, batch_sizes=batch_sizes, runs=runs)
    if as_json:
        click.echo(json.dumps(result.as_dict(), indent=2))
    else:
        print_table(result)
    if plot_path is not None:
        plot(result, plot_path)
        click.echo(f"plot written to {plot_path}", err=True)


if __name__ == "__main__":
    bench()
