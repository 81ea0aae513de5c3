"""The leader's commit at batch 1: the store's `commit` beside a plain hand-written client.

The client does what the store does per commit, one statement after another as a DB-API
program writes them: the fenced leader-row UPDATE (the store's own `lease.fence_stmt`, its
rowcount checked), the task row, its dependency rows, COMMIT. It does not fold, validate,
or check idempotency. Each side's per-commit latency is kept too: its p50 and p99 are figures
of their own (reported, no goal).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from sqlalchemy import update

from .. import lease
from ..model import Submitted, TimeBase
from ..schema import leader
from .raw import RawDriver
from .runner import Bench, progress

_HOLDER: Final = "cronoq-bench-raw"
_EPOCH: Final = 1


class RawLeader:
    """The hand-written leader: a lease taken once, then fence, insert, COMMIT per commit."""

    def __init__(self, raw: RawDriver, ttl_ns: int) -> None:
        self.raw = raw
        self.ttl_ns = ttl_ns
        self.fence_sql, self._order = raw.sql(lease.fence_stmt())
        # The statement's own constants (`id = 1`), as a hand-written client would inline them.
        compiled = lease.fence_stmt().compile(dialect=raw.compile_dialect)
        self._consts = compiled.construct_params(_check=False)
        self.seq = 0
        far = time.time_ns() + 10**15
        take = (
            update(leader)
            .where(leader.c.id == 1)
            .values(epoch=_EPOCH, holder=_HOLDER, expires_unix_ns=far, commit_seq=0)
        )
        sql, order = raw.sql(take)
        values = {"epoch": _EPOCH, "holder": _HOLDER, "expires_unix_ns": far, "commit_seq": 0}
        with raw.transaction() as cur:
            cur.execute(sql, tuple(values.get(k, 1) for k in order))  # id_1: the row's

    def fence_params(self, batch: Sequence[Submitted]) -> tuple[Any, ...]:
        """The next commit's fence parameters (its sequence number taken), for `fence_sql`."""
        self.seq += 1
        values = {
            **self._consts,
            "b_epoch": _EPOCH,
            "b_holder": _HOLDER,
            "b_acked": self.seq - 1,
            "b_next_id": batch[-1].id + 1,
            "b_ttl": self.ttl_ns,
            "b_seq": self.seq,
            "b_host_now": time.time_ns(),
        }
        return tuple(values[k] for k in self._order)

    def commit(self, base: TimeBase, batch: Sequence[Submitted]) -> None:
        """One fenced commit of new tasks."""
        rows, dep_rows = self.raw.encode(base, batch)
        fence_params = self.fence_params(batch)
        with self.raw.transaction() as cur:
            cur.execute(self.fence_sql, fence_params)
            if cur.rowcount != 1:
                raise RuntimeError("the raw leader was fenced off")
            if len(rows) == 1:
                cur.execute(self.raw.insert_tasks, rows[0])
            else:
                cur.executemany(self.raw.insert_tasks, rows)
            if dep_rows:
                cur.executemany(self.raw.insert_deps, dep_rows)


def _latencies(commit: Callable[[Sequence[Submitted]], None], batches: Sequence[Any]) -> Any:
    """Run one commit per batch; wall, CPU and each commit's latency in seconds."""
    gc.collect()
    laps: list[float] = []
    lap = laps.append
    clock = time.perf_counter
    wall, cpu = clock(), time.process_time()
    for b in batches:
        t = clock()
        commit(b)
        lap(clock() - t)
    return clock() - wall, time.process_time() - cpu, laps


def _quantile(laps: list[float], q: float) -> float:
    ordered = sorted(laps)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


COMMITS: Final = 500
"""Batch-1 commits per side per pair."""


def leader_commit(bench: Bench, commits: int = COMMITS) -> None:
    """Batch-1 leader commits: commits/s, CPU per commit and latency p50/p99, store vs raw
    (at most the bench's task count of commits per side and pair)."""
    commits = min(commits, bench.n)
    raw = RawLeader(bench.raw, ttl_ns=10 * 60 * 10**9)
    main = bench.baselines[0]
    rate: list[tuple[float, float]] = []
    cpu: list[tuple[float, float]] = []
    p50: list[tuple[float, float]] = []
    p99: list[tuple[float, float]] = []
    for run in range(bench.runs):
        bench.reset()
        subs = [[m] for m in bench.work.submissions(commits)]
        turns: list[tuple[str, Callable[[Sequence[Submitted]], None]]] = [
            ("store", bench.commit),
            ("raw", lambda b: raw.commit(bench.base, b)),
        ]
        if run % 2:
            turns.reverse()
        got = {name: _latencies(fn, subs) for name, fn in turns}
        if run == 0:
            bench.check_same_rows(ignore=("updated_unix_ns",))
        (sw, sc, sl), (rw, rc, rl) = got["store"], got["raw"]
        rate.append((commits / sw, commits / rw))
        cpu.append((sc * 1000 / commits, rc * 1000 / commits))
        p50.append((_quantile(sl, 0.5) * 1000, _quantile(rl, 0.5) * 1000))
        p99.append((_quantile(sl, 0.99) * 1000, _quantile(rl, 0.99) * 1000))
    f = bench.add("leader_commit", 1, "commits/s", rate, main)
    c = bench.add("leader_cpu", 1, "ms/commit", cpu, main)
    lo = bench.add("leader_p50", 1, "ms", p50, main)
    hi = bench.add("leader_p99", 1, "ms", p99, main)
    progress(
        f"leader commit b1: x{f.ratio:.2f} ({f.ratio_min:.2f}-{f.ratio_max:.2f}), "
        f"CPU {c.excess:+.3f} ms, p50 {lo.store:.3f}/{lo.raw:.3f} ms, "
        f"p99 {hi.store:.3f}/{hi.raw:.3f} ms (store/raw)"
    )
