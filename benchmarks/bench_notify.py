"""PostgreSQL: what `enqueue`'s NOTIFY costs apps when commits are slow.

A transaction that issued NOTIFY takes a database-wide lock at commit (to queue its
notifications in commit order) and holds it until its commit record is flushed: such commits
run one at a time, while other commits share WAL flushes (group commit). On a fast local disk
that costs little; where a commit waits for a networked disk or a synchronous standby it caps
every notifying app at one commit per flush.

This runs `--apps` app processes, each enqueueing one item per transaction for `--seconds`,
with and without the notify (alternating, `--runs` times each), for each commit latency in
`--delays` (microseconds), and prints transactions per second. The latency is PostgreSQL's
own `commit_delay` (with `commit_siblings = 0`): every commit sleeps that long before its WAL
flush, inside the lock NOTIFY holds, as a slow flush would. Figures only: nothing is asserted.

    python benchmarks/bench_notify.py [--apps 8] [--seconds 4] [--runs 3] [--delays 0,2000,10000]

The server is a PostgreSQL cluster of the script's own (initdb in a temp directory, a free
port, run as the postgres user when started as root), removed afterwards; `--url` names an
existing server instead (its superuser is needed for `commit_delay`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import URL, create_engine, make_url, text

from cronoq_store import SqlStore, TaskSpec, enqueue
from cronoq_store import inbox as inbox_module

VARIANTS = ("notify", "separate", "no-notify")
"""`enqueue` as it is (the notify rides on the INSERT), with the notify as a statement of its
own (as before), and `enqueue(..., notify=False)`."""


def _pg_bin() -> Path:
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin"))
    if not versions:
        raise SystemExit("no PostgreSQL binaries (initdb, pg_ctl) found")
    return versions[-1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def own_cluster() -> Iterator[URL]:
    """A PostgreSQL cluster in a temp directory on a free port, stopped and removed after."""
    bin_dir = _pg_bin()
    root = Path(tempfile.mkdtemp(prefix="cronoq-bench-notify-"))
    data, port = root / "data", _free_port()
    as_root = os.geteuid() == 0
    prefix = ["runuser", "-u", "postgres", "--"] if as_root else []
    if as_root:
        shutil.chown(root, "postgres")
    try:
        subprocess.run(
            [
                *prefix,
                bin_dir / "initdb",
                "-D",
                data,
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        options = (
            f"-c port={port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={root}"
            " -c max_connections=100"
        )
        subprocess.run(
            [
                *prefix,
                bin_dir / "pg_ctl",
                "-D",
                data,
                "-o",
                options,
                "-l",
                root / "log",
                "-w",
                "start",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        try:
            yield make_url(f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres")
        finally:
            subprocess.run(
                [*prefix, bin_dir / "pg_ctl", "-D", data, "-m", "immediate", "-w", "stop"],
                check=False,
                stdout=subprocess.DEVNULL,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _app(url: str, variant: str, delay_us: int, seconds: float, start: Any, out: Any) -> None:
    """One app process: one item per transaction until `seconds` after `start` is set."""
    engine = create_engine(
        url,
        connect_args={"options": f"-c commit_delay={delay_us} -c commit_siblings=0"},
        pool_size=1,
    )
    spec = TaskSpec(payload=b"x" * 100, kind="bench")
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))
        conn.commit()
        start.wait()
        deadline = time.monotonic() + seconds
        n = 0
        while time.monotonic() < deadline:
            with conn.begin():
                if variant == "notify":
                    enqueue(conn, spec)
                else:
                    enqueue(conn, spec, notify=False)
                    if variant == "separate":
                        conn.execute(inbox_module.notify_stmt())
            n += 1
    engine.dispose()
    out.put(n)


def run_once(url: URL, variant: str, delay_us: int, apps: int, seconds: float) -> float:
    """Transactions per second of `apps` processes enqueueing `variant`-wise."""
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    text_url = url.render_as_string(hide_password=False)
    procs = [
        ctx.Process(target=_app, args=(text_url, variant, delay_us, seconds, start, out))
        for _ in range(apps)
    ]
    for p in procs:
        p.start()
    time.sleep(1.0)  # connected (a bound, not a condition: the apps count from `start`)
    start.set()
    total = sum(out.get(timeout=seconds + 60) for _ in procs)
    for p in procs:
        p.join(30)
    return total / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="an existing server (default: own cluster)")
    parser.add_argument("--apps", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--delays", default="0,2000,10000", help="commit_delay values, µs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    delays = [int(d) for d in args.delays.split(",")]
    with contextlib.ExitStack() as stack:
        server = make_url(args.url) if args.url else stack.enter_context(own_cluster())
        db = f"cronoq_bench_notify_{os.getpid()}"
        admin = create_engine(server, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f"CREATE DATABASE {db}"))
        url = server.set(database=db)
        SqlStore.open(url).close()  # migrated
        results: dict[str, dict[str, list[float]]] = {}
        try:
            for delay in delays:
                per = results.setdefault(str(delay), {v: [] for v in VARIANTS})
                for r in range(args.runs):
                    order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]  # each in each place
                    for variant in order:
                        rate = run_once(url, variant, delay, args.apps, args.seconds)
                        per[variant].append(round(rate, 1))
                        if not args.json:
                            print(f"commit_delay {delay:>6} µs  {variant:<9} {rate:8.1f} tx/s")
        finally:
            with admin.connect() as conn:
                conn.execute(text(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
            admin.dispose()
    summary = {
        delay: {v: statistics.median(rates) for v, rates in per.items()}
        for delay, per in results.items()
    }
    if args.json:
        print(json.dumps({"apps": args.apps, "runs": results, "medians": summary}))
        return
    print(f"medians, {args.apps} apps, one item per transaction (tx/s; ratio to no-notify):")
    for delay, med in summary.items():
        cells = ", ".join(f"{v} {med[v]:.1f} ({med[v] / med['no-notify']:.2f})" for v in VARIANTS)
        print(f"  commit_delay {delay:>6} µs: {cells}")


if __name__ == "__main__":
    main()
