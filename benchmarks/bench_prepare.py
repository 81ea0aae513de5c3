"""PostgreSQL: what psycopg's server-side prepared statements buy a leader's small commits.

`StoreConfig(transaction_pooler=True)` makes the store's engine prepare nothing
(`prepare_threshold=None`); the default lets psycopg prepare a statement after 5 executions.
This measures batch-1 commits per second (one `Submitted`, then its `StatusChanged` to
succeeded with an output, each its own commit) both ways on the same scratch database, in
alternating runs, and prints each run, the medians and their ratio.

    python benchmarks/bench_prepare.py [--runs 6] [--commits 2000] [--url URL]

The URL names a server (default `CRONOQ_BENCH_POSTGRESQL_URL` or postgres@127.0.0.1:5432); a
scratch database is created on it and dropped afterwards. Figures only: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from datetime import timedelta

from sqlalchemy import URL, create_engine, make_url, text

from cronoq_store import (
    SqlStore,
    StatusChanged,
    StoreConfig,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    TimeBase,
)

BASE = TimeBase(unix_ns=1_700_000_000_000_000_000)
DEFAULT_URL = os.environ.get(
    "CRONOQ_BENCH_POSTGRESQL_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


def commits_per_second(url: URL, *, prepare: bool, commits: int, first_id: int) -> float:
    """Batch-1 commits per second of a fresh store (its own engine) on `url`."""
    config = StoreConfig(lease_ttl=timedelta(seconds=30), transaction_pooler=not prepare)
    with SqlStore.open(url, config) as store:
        epoch = store.acquire_leadership(timeout=30)
        spec = TaskSpec(payload=b"x" * 100, kind="bench")
        started = time.perf_counter()
        for n in range(commits // 2):
            i = TaskId(first_id + n)
            store.commit(epoch, BASE, [Submitted(id=i, seq=i, arrival=i, spec=spec)])
            store.commit(
                epoch,
                BASE,
                [StatusChanged(id=i, status=TaskStatus.SUCCEEDED, attempt=1, at=i)],
                outputs=[(i, b"y" * 100)],
            )
        elapsed = time.perf_counter() - started
        store.release_leadership()
    return (commits // 2 * 2) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=DEFAULT_URL)
    parser.add_argument("--runs", type=int, default=6, help="runs each way, alternating")
    parser.add_argument("--commits", type=int, default=2000, help="commits per run")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    server = make_url(args.url)
    name = f"cronoq_bench_{uuid.uuid4().hex[:12]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {name}"))
    url = server.set(database=name)
    figures: dict[str, list[float]] = {"prepared": [], "unprepared": []}
    try:
        next_id = 1
        for run in range(args.runs * 2):
            # Alternate, starting with each way in turn: drift favours neither.
            prepare = (run % 2 == 0) != (run // 2 % 2 == 1)
            rate = commits_per_second(url, prepare=prepare, commits=args.commits, first_id=next_id)
            next_id += args.commits
            figures["prepared" if prepare else "unprepared"].append(round(rate, 1))
            if not args.json:
                print(f"run {run + 1}: {'prepared  ' if prepare else 'unprepared'} {rate:8.1f}/s")
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()
    medians = {k: statistics.median(v) for k, v in figures.items()}
    # Each pair of consecutive runs has one of each: its ratio cancels slow drift in load.
    pairs = [u / p for p, u in zip(figures["prepared"], figures["unprepared"], strict=True)]
    ratio = statistics.median(pairs)
    if args.json:
        print(json.dumps({"runs": figures, "medians": medians, "pair_ratio": round(ratio, 3)}))
        return
    print(
        f"median commits/s: prepared {medians['prepared']:.1f}, unprepared "
        f"{medians['unprepared']:.1f}; unprepared/prepared per pair: median {ratio:.3f}, "
        f"{min(pairs):.3f}-{max(pairs):.3f}"
    )


if __name__ == "__main__":
    main()
