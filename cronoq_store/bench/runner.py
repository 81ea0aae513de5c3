"""The runner: the store and the raw driver measured in pairs, on databases of their own.

Each pair measures the store and every raw baseline once, one after the other, the order
reversed from one pair to the next so drift (caches, checkpoints, a neighbour's load) favours
neither; a figure is the median of the per-pair ratios, with their spread (min-max). Which
figures a run takes, on which databases, is `suite`'s.
"""

from __future__ import annotations

import contextlib
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
from sqlalchemy import URL, Engine, create_engine, delete, select
from sqlalchemy.engine.interfaces import Dialect

from .. import dialects
from ..model import Mutation, Recovered, StatusChanged, Submitted, TaskId, TaskStatus, TimeBase
from ..repository.prune import PRUNE_BATCH, vacuum
from ..schema import task_deps, tasks
from ..store import SqlStore, StoreConfig
from .raw import Baseline, RawDriver, baselines
from .results import Figure, Metric, Target, goal_of
from .targets import server_label
from .workload import (
    MIN_COMMITS,
    MIN_ROWS,
    POPULATE_BATCH,
    Workload,
    in_batches,
)


def progress(message: str) -> None:
    click.echo(f"  {message}", err=True)


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """Wall seconds and process (CPU) seconds of `fn`, after a full collection."""
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


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
    if not dialects.class_of(target.dialect).server:
        return f"sqlite {sqlite3.sqlite_version} full_sync={'on' if target.full_sync else 'off'}"
    return server_label(dialect)


class Bench:
    """The measurements on one target: the store in its database, the raw driver in its own."""

    def __init__(
        self,
        target: Target,
        raw_url: URL,
        *,
        tasks: int,
        batch_sizes: Sequence[int],
        runs: int,
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
        self.figures: list[Figure] = []
        with contextlib.ExitStack() as stack:
            # The raw side's schema: the store's migrations, in the raw side's own database.
            SqlStore.open(raw_url, config).close()
            self.raw_engine: Engine = create_engine(raw_url)
            stack.callback(self.raw_engine.dispose)
            self.store = SqlStore.open(target.url, config)
            stack.callback(self.store.close)
            self.engine: Engine = self.store.engine
            with self.engine.connect():  # initializes the dialect (server version)
                self.label = _label(target, self.engine.dialect)
            self.baselines: tuple[Baseline, ...] = baselines(target.dialect)
            self.raw = RawDriver(raw_url, self.engine.dialect, full_sync=target.full_sync)
            stack.callback(self.raw.close)
            self.epoch = self.store.acquire_leadership()
            stack.pop_all()

    def close(self) -> None:
        self.raw.close()
        try:
            self.reset()
        finally:
            self.store.close()
            self.raw_engine.dispose()

    def reset(self, *, store: bool = True, raw: bool = True) -> None:
        """Empty the task tables of the store, of the raw side, or both."""
        for wanted, engine in ((store, self.engine), (raw, self.raw_engine)):
            if wanted:
                with engine.begin() as conn:
                    for table in (task_deps, tasks):
                        conn.execute(delete(table))

    def check_same_rows(self, ignore: Sequence[str] = ()) -> None:
        """Refuse to report ratios unless both sides hold the same rows."""
        for table in (tasks, task_deps):
            names = [c.name for c in table.columns if c.name not in ignore]
            stmt = select(*(table.c[n] for n in names)).order_by(*table.primary_key)
            with self.engine.connect() as conn:
                mine = conn.execute(stmt).all()
            with self.raw_engine.connect() as conn:
                theirs = conn.execute(stmt).all()
            if mine != theirs:
                raise RuntimeError(f"the raw driver's {table.name} differs from the store's")

    def add(
        self,
        metric: Metric,
        batch: int | None,
        unit: str,
        pairs: Sequence[tuple[float, float]],
        baseline: str = "",
    ) -> Figure:
        """A figure from (store, raw) pairs: medians, the median per-pair ratio, its spread."""
        ratios = [s / r if r else float("inf") for s, r in pairs]
        goal, higher = goal_of(self.target, metric, batch, baseline)
        cpu = metric.endswith("_cpu")
        figure = Figure(
            metric=metric,
            batch_size=batch,
            unit=unit,
            store=statistics.median(s for s, _ in pairs),
            raw=statistics.median(r for _, r in pairs),
            ratio=statistics.median(ratios),
            goal=goal,
            higher_is_better=higher,
            samples=len(pairs),
            baseline=baseline,
            ratio_min=min(ratios),
            ratio_max=max(ratios),
            excess=statistics.median(s - r for s, r in pairs) if cpu else None,
        )
        self.figures.append(figure)
        return figure

    def commit(
        self, batch: Sequence[Mutation], outputs: Sequence[tuple[TaskId, bytes]] = ()
    ) -> None:
        if not self.store.is_leader:  # lost between phases: lead again, the timing is not ours
            self.epoch = self.store.acquire_leadership()
        self.store.commit(self.epoch, self.base, batch, outputs)

    # What each side runs in a timed turn.

    def _store_submit(self, batches: Sequence[Sequence[Submitted]]) -> None:
        for b in batches:
            self.commit(b)

    def _raw_submit(self, batches: Sequence[Sequence[Submitted]], copy: bool) -> None:
        for b in batches:
            self.raw.submit(self.base, b, copy=copy)

    def _raw_insert(self, encoded: Sequence[tuple[list[Any], list[Any]]]) -> None:
        for rows, dep_rows in encoded:
            self.raw.insert(rows, dep_rows)

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

    def _submit_turns(
        self, subs: Sequence[Sequence[Submitted]]
    ) -> list[tuple[str, Callable[[], Any]]]:
        """The store's turn and each raw baseline's; the raw side is emptied before each."""
        turns: list[tuple[str, Callable[[], Any]]] = [("store", partial(self._store_submit, subs))]
        for baseline in self.baselines:
            if baseline == "pre-encoded":
                encoded = [self.raw.encode(self.base, b) for b in subs]
                fn: Callable[[], Any] = partial(self._raw_insert, encoded)
            else:
                fn = partial(self._raw_submit, subs, baseline == "copy")
            turns.append((baseline, fn))
        return turns

    def throughput(self) -> None:
        """Submissions, then transitions (running, then succeeded with an output)."""
        main = self.baselines[0]
        for size in self.batch_sizes:
            rows = max(size, min(self.n, max(size * MIN_COMMITS, MIN_ROWS)))
            rows -= rows % size
            commits = rows // size
            submit: dict[str, list[tuple[float, float]]] = {b: [] for b in self.baselines}
            trans: list[tuple[float, float]] = []
            submit_cpu: list[tuple[float, float]] = []
            trans_cpu: list[tuple[float, float]] = []
            for run in range(self.runs):
                self.reset()
                subs = in_batches(self.work.submissions(rows), size)
                ids = [m.id for b in subs for m in b]
                t = self.work.now()
                running = in_batches(
                    [StatusChanged(id=i, status=TaskStatus.RUNNING, attempt=1, at=t) for i in ids],
                    size,
                )
                done = in_batches(
                    [
                        StatusChanged(id=i, status=TaskStatus.SUCCEEDED, attempt=1, at=t + 1)
                        for i in ids
                    ],
                    size,
                )
                # Alternate who goes first, so drift (caches, checkpoints) favours neither.
                turns = self._submit_turns(subs)
                if run % 2:
                    turns.reverse()
                wall: dict[str, float] = {}
                cpu: dict[str, float] = {}
                raw_filled = False
                for name, fn in turns:
                    if name != "store" and raw_filled:
                        self.reset(store=False)
                    wall[name], cpu[name] = _timed(fn)
                    raw_filled = raw_filled or name != "store"
                if run == 0:
                    self.check_same_rows(ignore=("updated_unix_ns",))
                trans_turns = [
                    ("store", partial(self._store_trans, running, done)),
                    (main, partial(self._raw_trans, running, done)),
                ]
                if run % 2:
                    trans_turns.reverse()
                for name, fn in trans_turns:
                    wall["t-" + name], cpu["t-" + name] = _timed(fn)
                if run == 0:
                    self.check_same_rows()
                for b in self.baselines:
                    submit[b].append((rows / wall["store"], rows / wall[b]))
                trans.append((2 * rows / wall["t-store"], 2 * rows / wall["t-" + main]))
                ms = 1000 / commits
                submit_cpu.append((cpu["store"] * ms, cpu[main] * ms))
                trans_cpu.append((cpu["t-store"] * ms / 2, cpu["t-" + main] * ms / 2))
            said = []
            for b in self.baselines:
                f = self.add("submit", size, "rows/s", submit[b], b)
                said.append(f"submit x{f.ratio:.2f} of {b}")
            f = self.add("transition", size, "rows/s", trans, main)
            said.append(f"transition x{f.ratio:.2f}")
            if size == 1:
                for metric, pairs in (("submit_cpu", submit_cpu), ("transition_cpu", trans_cpu)):
                    f = self.add(metric, size, "ms/commit", pairs, main)  # type: ignore[arg-type]
                    said.append(f"{metric} +{f.excess:.3f} ms")
            progress(f"batch {size}: " + ", ".join(said))

    def populate(self, count: int, *, finished_at: int | None = None) -> None:
        """`count` tasks on both sides (live, or succeeded at engine time `finished_at`)."""
        for b in in_batches(self.work.submissions(count), POPULATE_BATCH):
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

    def _store_recover(self) -> Recovered:
        return self.store.recover(self.base)

    def recovery(self) -> None:
        """Recovery of `n` live tasks: time, and peak memory against what it returns."""
        self.reset()
        self.populate(self.n)
        progress(f"{self.n} live tasks stored on each side")
        pairs = []
        for run in range(self.runs):
            turns = [("store", self._store_recover), ("raw", self.raw.recover)]
            if run % 2:
                turns.reverse()
            wall = {name: _timed(fn)[0] for name, fn in turns}
            pairs.append((wall["store"], wall["raw"]))
        f = self.add("recover", None, "s", pairs)
        m = self.add("recover_memory", None, "bytes", [_memory(self._store_recover)])
        progress(f"recover x{f.ratio:.2f} of raw; peak memory x{m.ratio:.2f} of the result")

    def _vacuum(self) -> None:
        """PostgreSQL: both sides' task tables vacuumed, untimed, before a prune pair. A store's
        prune vacuums after deleting (`dialects.vacuums`), and so does the raw side's; on a
        server without autovacuum (the shared development one) the first would otherwise clear
        every dead row the earlier figures left."""
        if not dialects.vacuums(self.engine.dialect):
            return
        for engine in (self.engine, self.raw_engine):
            with engine.connect() as conn:
                vacuum(conn.execution_options(isolation_level="AUTOCOMMIT"))

    def _store_prune(self, counts: list[int]) -> None:
        counts.append(self.store.prune(timedelta(hours=1)))

    def _raw_prune(self, counts: list[int], cutoff: int) -> None:
        counts.append(self.raw.prune(cutoff, PRUNE_BATCH))

    def prune(self) -> None:
        """Prune of `n` finished tasks (beside the live ones), in the store's batch size."""
        pairs = []
        for run in range(self.runs):
            self.populate(self.n, finished_at=self.work.now() - 2 * 3600 * 10**9)
            self._vacuum()
            cutoff = time.time_ns() - 3600 * 10**9
            counts: list[int] = []
            turns = [
                ("store", partial(self._store_prune, counts)),
                ("raw", partial(self._raw_prune, counts, cutoff)),
            ]
            if run % 2:
                turns.reverse()
            wall = {name: _timed(fn)[0] for name, fn in turns}
            if counts != [self.n, self.n]:
                raise RuntimeError(f"pruned {counts}, expected {self.n} on each side")
            pairs.append((self.n / wall["store"], self.n / wall["raw"]))
        f = self.add("prune", PRUNE_BATCH, "rows/s", pairs)
        progress(f"prune x{f.ratio:.2f}")
