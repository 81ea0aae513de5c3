"""The dashboard's pages on a large SQLite store: each page's reads, and the page over HTTP.

Fills a temporary SQLite file with `-n` tasks (default 1,000,000; 1% live in 8 pools, the rest
finished, most past the retention) through `SqlStore.commit`, then times, `--runs` times each:

- each page's reads in one read-only transaction (`Reader.read` of the `views` function), the
  figure the dashboard is built to (the overview under 100 ms at 1,000,000 tasks);
- the same page fetched over HTTP from `cronoq-store web` on a loopback port (reads,
  templates and HTTP: what an operator waits for);
- for comparison, the CLI's `status` count (`repository.operators.task_counts_stmt`, every
  task grouped by pool and status), which the overview does not run.

It prints the median and the spread (min-max) in milliseconds, and SQLite's plan of each of
the overview's counts. Figures only: nothing here asserts a time.

    python benchmarks/bench_web.py [-n 1000000] [--runs 20] [--json]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import Connection

from cronoq_store import (
    SqlStore,
    StatusChanged,
    StoreConfig,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    TimeBase,
    cli,
)
from cronoq_store.repository import operators
from cronoq_store.web import app as web_app
from cronoq_store.web import views

S = 1_000_000_000
BATCH = 20_000
POOLS = tuple(f"pool-{i}" for i in range(8))
LIVE = (TaskStatus.QUEUED, TaskStatus.RUNNING, TaskStatus.WAITING, TaskStatus.RETRYING)
DONE = (TaskStatus.SUCCEEDED,) * 8 + (TaskStatus.FAILED, TaskStatus.CANCELLED)


def fill(store: SqlStore, n: int) -> float:
    """`n` tasks, every 100th live; finished ones updated 2 days ago (past a 1 h retention),
    except the newest 10%. Returns the seconds it took."""
    started = time.perf_counter()
    epoch = store.acquire_leadership()
    now = time.time_ns()
    old = TimeBase(unix_ns=now - 2 * 86400 * S)
    recent = TimeBase(unix_ns=now - 60 * S)
    for first in range(1, n + 1, BATCH):
        base = recent if first > n * 0.9 else old
        batch: list[Any] = []
        for i in range(first, min(first + BATCH, n + 1)):
            spec = TaskSpec(payload=b"x" * 100, pool=POOLS[i % len(POOLS)], kind="job", key=f"k{i}")
            batch.append(Submitted(id=TaskId(i), seq=i, arrival=i, spec=spec))
            status = LIVE[i % len(LIVE)] if i % 100 == 0 else DONE[i % len(DONE)]
            if status is not TaskStatus.QUEUED:
                batch.append(StatusChanged(id=TaskId(i), status=status, attempt=1, at=i + 1))
        store.commit(epoch, base, batch)
        print(f"\rfilled {min(first + BATCH - 1, n):,} tasks", end="", file=sys.stderr)
    print(file=sys.stderr)
    store.release_leadership()
    return time.perf_counter() - started


def timed(fn: Callable[[], object], runs: int) -> dict[str, float]:
    fn()  # warm: the page cache and SQLAlchemy's statement cache
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1000)
    return {
        "median_ms": round(statistics.median(samples), 2),
        "min_ms": round(min(samples), 2),
        "max_ms": round(max(samples), 2),
    }


def plans(conn: Connection) -> dict[str, list[str]]:
    """SQLite's plan of each of the overview's counts."""
    out = {}
    for name, stmt, params in (
        ("live_counts", operators.live_counts_stmt(), {}),
        ("finished_count", operators.finished_count_stmt(), {}),
        ("finished_since_count", operators.finished_since_count_stmt(), {"cutoff": 0}),
    ):
        compiled = stmt.compile(conn, compile_kwargs={"render_postcompile": True})
        rows = conn.exec_driver_sql(
            f"EXPLAIN QUERY PLAN {compiled}", tuple({**compiled.params, **params}.values())
        ).all()
        out[name] = [r[-1] for r in rows]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=1_000_000, help="tasks in the store")
    parser.add_argument("--runs", type=int, default=20, help="timed runs per figure")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args()
    results: dict[str, Any] = {"tasks": args.n, "runs": args.runs}
    with tempfile.TemporaryDirectory(prefix="cronoq-bench-web-") as tmp:
        db = Path(tmp) / "web.db"
        with SqlStore.open(str(db), StoreConfig()) as store:
            results["fill_s"] = round(fill(store, args.n), 1)
        results["file_mb"] = round(db.stat().st_size / 2**20, 1)
        target = cli.Target(url=str(db), schema=None)
        with cli.open_database(target) as reader_store:
            engine = reader_store.engine
            reader = web_app.Reader(engine)
            retention = timedelta(hours=1)
            page_before = args.n // 2
            reads: dict[str, Callable[[Connection], object]] = {
                "overview": lambda c: views.overview(c, schema=None, retention=retention),
                "tasks (newest 50)": lambda c: views.tasks_page(c, views.TaskFilter()),
                "tasks (pool, page in the middle)": lambda c: views.tasks_page(
                    c, views.TaskFilter(pool="pool-3", before=page_before)
                ),
                "tasks (failed)": lambda c: views.tasks_page(c, views.TaskFilter(status="failed")),
                "tasks (key)": lambda c: views.tasks_page(
                    c, views.TaskFilter(key=f"k{page_before}")
                ),
                "task": lambda c: views.task_page(c, page_before),
                "schedules": views.schedules,
                "inbox": views.inbox_page,
                "cli status count (not on the dashboard)": lambda c: c.execute(
                    operators.task_counts_stmt()
                ).all(),
            }
            results["reads"] = {
                name: timed(lambda fn=fn: reader.read(fn), args.runs)  # type: ignore[misc]
                for name, fn in reads.items()
            }
            with engine.connect() as conn:
                results["plans"] = plans(conn)
        results["http"] = http_figures(db, args.runs, page_before)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(
        f"{args.n:,} tasks, SQLite file {results['file_mb']} MiB (filled in {results['fill_s']} s)"
    )
    for section in ("reads", "http"):
        print(f"\n{section}: median (min-max) ms over {args.runs} runs")
        for name, fig in results[section].items():
            print(f"  {name:<42} {fig['median_ms']:>8} ({fig['min_ms']}-{fig['max_ms']})")
    print("\nplans of the overview's counts:")
    for name, lines in results["plans"].items():
        print(f"  {name}: {'; '.join(lines)}")
    return 0


def http_figures(db: Path, runs: int, page_before: int) -> dict[str, dict[str, float]]:
    """Each page fetched over HTTP from the real `cronoq-store web` in a process of its own
    (in a thread of this process, the client and server would share one GIL)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    command = [sys.executable, "-m", "cronoq_store.cli", "--url", str(db), "web"]
    server = subprocess.Popen([*command, "--port", str(port)], stdout=subprocess.DEVNULL)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            deadline = time.monotonic() + 60
            while True:
                try:
                    client.get("/static/dashboard.css")
                    break
                except httpx.TransportError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit("cronoq-store web did not start") from None
                    time.sleep(0.05)

            def fetch(path: str) -> Callable[[], object]:
                return lambda: client.get(path).raise_for_status()

            return {
                path: timed(fetch(path), runs)
                for path in ("/", "/overview.part", "/tasks", f"/tasks/{page_before}", "/inbox")
            }
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    sys.exit(main())
