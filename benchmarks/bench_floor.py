"""What bounds the targets a SQLite store still misses: its costs taken apart, layer by layer.

`cronoq-store bench` compares the store with hand-written clients; this says where the
difference goes, in one process, each figure the median of several rounds in alternating
order (CPU is process time, so the disk's flushes count little).

- **The leader's commit at batch 1** (`bench/leader.py`'s client and workload): the store;
  the store without its telemetry; without telemetry and without the commit's deadline
  (`StoreConfig.commit_timeout`'s watchdog); the hand-written client's own statements and
  tuples run through SQLAlchemy's transaction and the store's execution layer (`sqlalchemy`:
  what the store pays for being a SQLAlchemy Core library, before any logic of its own); the
  client itself; and the fold of a batch (its spec encoded), on its own in a loop and then
  between the client's commits (wall time of the fold alone): the same code costs two to
  three times as much where a commit's driver calls and flush have just run, so a
  microbenchmark of one layer understates what it adds to a commit.
- **The drain, per item** (`bench/inbox.py`'s workload): the hand-written drain; decoding
  the stored spec columns into a `TaskSpec` (what `read_inbox` must hand the engine); the
  engine's `Submitted` and `InboxTaken` for it (what a commit must be given). With nothing else
  on top of the client, those two alone bound the drain's ratio: the `floor` line.

Ablations reach into the store's internals; they measure, they are not a way to run it.

    python benchmarks/bench_floor.py [--commits 2000] [--items 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from sqlalchemy import make_url

from cronoq_store import execution
from cronoq_store.bench.inbox import InboxBench, _specs
from cronoq_store.bench.leader import RawLeader, _latencies
from cronoq_store.bench.results import Target
from cronoq_store.bench.runner import _Bench
from cronoq_store.codec import SPEC_COLUMNS, spec_columns, spec_from_values
from cronoq_store.model import InboxTaken, Submitted, TaskId, TimeBase
from cronoq_store.repository import folding
from cronoq_store.store import engine_for


def leader(tmp: Path, commits: int, rounds: int) -> dict[str, list[float]]:
    """CPU microseconds per batch-1 leader commit, per mode and round."""
    url = make_url("sqlite://").set(database=str(tmp / "store.db"))
    raw_url = make_url("sqlite://").set(database=str(tmp / "raw.db"))
    b = _Bench(Target(url=url, full_sync=True), raw_url, tasks=commits, batch_sizes=[1], runs=1)
    client = RawLeader(b.raw, ttl_ns=10**12)
    framed = engine_for(raw_url, b.store.config)  # the store's engine, on the client's file
    conn = framed.connect()

    def sqlalchemy(batch: Sequence[Submitted]) -> None:
        rows, dep_rows = b.raw.encode(b.base, batch)
        fence_params = client.fence_params(batch)
        with conn.begin():
            execution.run(conn, client.fence_sql, fence_params)
            execution.run(conn, b.raw.insert_tasks, rows[0])
            if dep_rows:
                execution.run(conn, b.raw.insert_deps, dep_rows, many=True)

    def fold(batch: Sequence[Submitted]) -> None:
        folding.fold(b.base, time.time_ns(), batch, None)

    def cold_fold(batches: Sequence[Sequence[Submitted]]) -> tuple[None, float, None]:
        """The fold's time where the store runs it: right after a commit (the client's, so
        that only the fold is timed), with whatever the commit left in the CPU's caches."""
        spent = 0
        for batch in batches:
            client.commit(b.base, batch)
            started = time.perf_counter_ns()
            folding.fold(b.base, time.time_ns(), batch, None)
            spent += time.perf_counter_ns() - started
        return None, spent / 1e9, None

    def store(telemetry: bool, deadline: bool) -> Callable[[Any], Any]:
        def commit(batch: Sequence[Submitted]) -> None:
            b.commit(batch)

        def run(batches: Sequence[Sequence[Submitted]]) -> Any:
            store = b.store
            tx, bound = store._commit_tx, store._commit_bound  # how every commit runs
            store._telemetry.enabled = telemetry
            if not deadline:
                store._commit_tx, store._commit_bound = tx._replace(deadline=None), None
            try:
                return _latencies(commit, batches)
            finally:
                store._telemetry.enabled = True
                store._commit_tx, store._commit_bound = tx, bound

        return run

    modes: dict[str, Callable[[Any], Any]] = {
        "store": store(True, True),
        "no telemetry": store(False, True),
        "no telemetry, no deadline": store(False, False),
        "sqlalchemy + execution": lambda s: _latencies(sqlalchemy, s),
        "client": lambda s: _latencies(lambda x: client.commit(b.base, x), s),
        "fold alone": lambda s: _latencies(fold, s),
        "fold between the client's commits": cold_fold,
    }
    got: dict[str, list[float]] = {m: [] for m in modes}
    try:
        for r in range(rounds + 1):  # the first round warms up, and is left out
            batches = [[m] for m in b.work.submissions(commits)]
            for mode in modes if r % 2 == 0 else reversed(modes):
                b.reset()
                _, cpu, _ = modes[mode](batches)
                if r:
                    got[mode].append(cpu * 1e6 / commits)
    finally:
        conn.close()
        framed.dispose()
        b.close()
    return got


def drain(tmp: Path, items: int, rounds: int) -> dict[str, list[float]]:
    """CPU microseconds per drained item: the hand-written drain, and what the API needs."""
    url = make_url("sqlite://").set(database=str(tmp / "drain.db"))
    raw_url = make_url("sqlite://").set(database=str(tmp / "drain-raw.db"))
    b = _Bench(Target(url=url, full_sync=True), raw_url, tasks=items, batch_sizes=[1], runs=1)
    bench = InboxBench(b)
    base = TimeBase(unix_ns=time.time_ns())
    specs = _specs(items)
    stored = [tuple(spec_columns(base, s)[c] for c in SPEC_COLUMNS) for s in specs]
    decoded = [spec_from_values(base, *r) for r in stored]

    def build() -> None:
        for i, spec in enumerate(decoded):
            Submitted(id=TaskId(i), seq=i, arrival=0, spec=spec)
            InboxTaken(inbox_id=i)

    got: dict[str, list[float]] = {"client": [], "decode": [], "mutations": []}
    try:
        with b.engine.connect() as conn:
            for _ in range(rounds):
                b.reset()
                bench._fill(conn, items)
                started = time.process_time()
                bench._raw_drain(b.work.next_id)
                got["client"].append((time.process_time() - started) * 1e6 / items)
                started = time.process_time()
                for r in stored:
                    spec_from_values(base, *r)
                got["decode"].append((time.process_time() - started) * 1e6 / items)
                started = time.process_time()
                build()
                got["mutations"].append((time.process_time() - started) * 1e6 / items)
    finally:
        bench.close()
        b.close()
    return got


def _table(title: str, got: dict[str, list[float]], unit: str) -> None:
    print(f"\n| {title} | CPU {unit}, median (min-max) |\n|---|---|")
    for mode, values in got.items():
        spread = f"{min(values):.1f}-{max(values):.1f}"
        print(f"| {mode} | {statistics.median(values):.1f} ({spread}) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=2000)
    parser.add_argument("--items", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        commit = leader(tmp, args.commits, args.rounds)
        per_item = drain(tmp, args.items, args.rounds)
    _table("leader commit, batch 1, SQLite full_sync", commit, "us a commit")
    _table("drain, SQLite full_sync", per_item, "us an item")
    client = statistics.median(per_item["client"])
    needed = statistics.median(per_item["decode"]) + statistics.median(per_item["mutations"])
    print(
        f"\nfloor: the client plus the decode and the mutations alone, "
        f"{client / (client + needed):.2f}x the client's rate"
    )


if __name__ == "__main__":
    main()
