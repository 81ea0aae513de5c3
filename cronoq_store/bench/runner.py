"""The runner: both sides measured in turns on one database, and every database in turn."""

from __future__ import annotations

import gc
import sqlite3
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from typing import Any

import click
from sqlalchemy import (
    Engine,
    delete,
    select,
)
from sqlalchemy.engine.interfaces import Dialect

from ..model import (
    Mutation,
    StatusChanged,
    Submitted,
    TaskId,
    TaskStatus,
    TimeBase,
)
from ..schema import task_deps, tasks
from ..store import SqlStore, StoreConfig
from .raw import RawDriver, raw_tables
from .results import BenchResult, DatabaseResult, Figure, Metric, Target, _goal
from .workload import (
    DEFAULT_BATCH_SIZES,
    DEFAULT_TASKS,
    MIN_COMMITS,
    MIN_ROWS,
    POPULATE_BATCH,
    Workload,
    _batches,
)

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
        from ..repository import PRUNE_BATCH

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
