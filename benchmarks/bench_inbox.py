"""The inbox, measured per dialect: wake-up latency, enqueue rate beside the raw driver, drain rate.

- **wake-up latency**: from an app calling COMMIT on an enqueue to the leader's `wait_inbox`
  returning (PostgreSQL: LISTEN/NOTIFY; elsewhere a poll every `inbox_poll`), p50/p99;
- **enqueue rate**: 1 and 4 app processes, 1 and 100 tasks per transaction, `enqueue_many` on
  an app's engine beside the raw DB-API driver doing the same INSERT + COMMIT (ratio: goal
  >= 0.8);
- **drain rate**: the leader's `read_inbox(1000)` + commit of `Submitted` + `InboxTaken`,
  beside committing the same 1000 `Submitted` without the inbox (ratio: goal >= 0.8).

    python benchmarks/bench_inbox.py --dialect all [--json]

Each dialect runs on a scratch database (PostgreSQL/MariaDB on the test servers, or
`CRONOQ_BENCH_POSTGRESQL_URL` / `CRONOQ_BENCH_MYSQL_URL`), dropped afterwards. Figures only:
nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import URL, Engine, create_engine, delete, make_url, text

from cronoq_store import (
    InboxTaken,
    SqlStore,
    StoreConfig,
    Submitted,
    TaskId,
    TaskSpec,
    TimeBase,
    codec,
    dialects,
    enqueue_many,
    inbox,
)
from cronoq_store.schema import inbox as inbox_table

SERVERS = {
    "postgresql": os.environ.get(
        "CRONOQ_BENCH_POSTGRESQL_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    ),
    "mysql": os.environ.get("CRONOQ_BENCH_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/"),
}
BASE = TimeBase(1_700_000_000_000_000_000)
SPEC = TaskSpec(payload=b"x" * 100, kind="email", labels={"shop": "eu"}, tags=frozenset({"a"}))


@contextmanager
def scratch(dialect: str) -> Iterator[URL]:
    """A new empty database of `dialect`, dropped afterwards."""
    if dialect == "sqlite":
        with tempfile.TemporaryDirectory() as tmp:
            yield make_url(f"sqlite:///{Path(tmp) / 'bench.db'}")
        return
    admin = create_engine(SERVERS[dialect], isolation_level="AUTOCOMMIT")
    name = f"cronoq_bench_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.execute(
            text(f"CREATE DATABASE {name}" + " CHARACTER SET utf8mb4" * (dialect == "mysql"))
        )
    try:
        yield make_url(SERVERS[dialect]).set(database=name)
    finally:
        with admin.connect() as conn:
            force = " WITH (FORCE)" if dialect == "postgresql" else ""
            conn.execute(text(f"DROP DATABASE IF EXISTS {name}{force}"))
        admin.dispose()


def app_engine(url: URL) -> Engine:
    """An app's engine as docs/embedding.md sets it up."""
    engine = create_engine(url, hide_parameters=True)
    if url.get_backend_name() == "sqlite":
        dialects.configure_sqlite(engine, full_sync=True, busy_timeout=timedelta(seconds=30))
    return engine


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# Wake-up latency.


def latency(url: URL, samples: int) -> dict[str, Any]:
    config = StoreConfig(migrate=False)
    app = app_engine(url)
    with SqlStore.open(url, config) as store:
        epoch = store.acquire_leadership()
        woke: list[float] = []
        ready = threading.Event()
        done = threading.Event()

        def leader() -> None:
            while not done.is_set():
                ready.set()
                if store.wait_inbox(5):
                    woke.append(time.perf_counter())
                    items = store.read_inbox()
                    store.commit(epoch, BASE, [InboxTaken(inbox_id=i.inbox_id) for i in items])

        thread = threading.Thread(target=leader)
        thread.start()
        gaps: list[float] = []
        phase = random.Random(0)
        try:
            for _ in range(samples):
                ready.wait(10)
                ready.clear()
                time.sleep(phase.uniform(0.002, 0.102))  # at any phase of the poll
                count = len(woke)
                with app.connect() as conn:
                    conn.begin()
                    enqueue_many(conn, [SPEC])
                    started = time.perf_counter()
                    conn.commit()
                deadline = time.monotonic() + 10
                while len(woke) == count and time.monotonic() < deadline:
                    time.sleep(0.0005)
                gaps.append((woke[count] - started) * 1000)
        finally:
            done.set()
            with app.begin() as conn:
                enqueue_many(conn, [SPEC])  # wake it to stop
            thread.join(30)
            store.release_leadership()
    app.dispose()
    return {
        "samples": len(gaps),
        "p50_ms": round(_pct(gaps, 0.5), 2),
        "p99_ms": round(_pct(gaps, 0.99), 2),
        "max_ms": round(max(gaps), 2),
        "poll_s": config.inbox_poll.total_seconds(),
    }


# Enqueue rate: the store's enqueue beside the raw driver, from several processes.


def _raw_insert(url: URL) -> tuple[Any, str, list[str]]:
    """A raw DB-API connection and the INSERT of one inbox row in its paramstyle."""
    engine = create_engine(url)
    columns = ["enqueued_unix_ns", *codec.SPEC_COLUMNS]
    quote = engine.dialect.identifier_preparer.quote
    style = engine.dialect.paramstyle
    mark = "?" if style == "qmark" else "%s"
    sql = (
        f"INSERT INTO cronoq_inbox ({', '.join(quote(c) for c in columns)}) "
        f"VALUES ({', '.join(mark for _ in columns)})"
    )
    raw = engine.raw_connection()
    dbapi: Any = raw.driver_connection
    raw.detach()
    engine.dispose()
    if url.get_backend_name() == "sqlite":
        dbapi.isolation_level = None
        dbapi.execute("PRAGMA busy_timeout = 30000")
        dbapi.execute("PRAGMA synchronous = FULL")
    return dbapi, sql, columns


def _worker(
    url_text: str, mode: str, per_txn: int, txns: int, start_at: float
) -> tuple[float, float]:
    url = make_url(url_text)
    specs = [SPEC] * per_txn
    if mode == "store":
        engine = app_engine(url)
        with engine.connect() as conn:  # connected before the clock starts
            conn.rollback()
        time.sleep(max(0.0, start_at - time.time()))
        began = time.time()
        for _ in range(txns):
            with engine.begin() as conn:
                enqueue_many(conn, specs)
        ended = time.time()
        engine.dispose()
        return began, ended
    dbapi, sql, columns = _raw_insert(url)
    row_map = codec.spec_columns(inbox.UNIX, SPEC)
    sqlite = url.get_backend_name() == "sqlite"
    time.sleep(max(0.0, start_at - time.time()))
    began = time.time()
    for _ in range(txns):
        rows = [tuple([time.time_ns()] + [row_map[c] for c in columns[1:]]) for _ in specs]
        cur = dbapi.cursor()
        if sqlite:
            cur.execute("BEGIN IMMEDIATE")
        if len(rows) == 1:
            cur.execute(sql, rows[0])
        else:
            cur.executemany(sql, rows)
        cur.close()
        dbapi.commit() if not sqlite else dbapi.execute("COMMIT")
    ended = time.time()
    dbapi.close()
    return began, ended


def enqueue_rates(url: URL, quick: bool) -> list[dict[str, Any]]:
    out = []
    ctx = multiprocessing.get_context("spawn")
    for procs in (1, 4):
        for per_txn in (1, 100):
            txns = (100 if quick else 400) if per_txn == 1 else (10 if quick else 40)
            row: dict[str, Any] = {"processes": procs, "per_txn": per_txn}
            for mode in ("raw", "store"):
                with ProcessPoolExecutor(procs, mp_context=ctx) as pool:
                    start_at = time.time() + 2.0  # all started and connected by then
                    runs = [
                        pool.submit(
                            _worker,
                            url.render_as_string(hide_password=False),
                            mode,
                            per_txn,
                            txns,
                            start_at,
                        )
                        for _ in range(procs)
                    ]
                    spans = [r.result() for r in runs]
                seconds = max(e for _, e in spans) - min(b for b, _ in spans)
                row[f"{mode}_per_s"] = round(procs * per_txn * txns / seconds)
            row["ratio"] = round(row["store_per_s"] / row["raw_per_s"], 2)
            out.append(row)
    return out


# Drain rate at batch 1000, beside plain submission of the same batch.


def drain_rate(url: URL, batches: int) -> dict[str, Any]:
    app = app_engine(url)
    with SqlStore.open(url, StoreConfig(migrate=False)) as store:
        epoch = store.acquire_leadership()
        next_id = 10**12
        # Plain submission, batch 1000.
        began = time.perf_counter()
        for _ in range(batches):
            store.commit(
                epoch,
                BASE,
                [
                    Submitted(id=TaskId(next_id + i), seq=i, arrival=0, spec=SPEC)
                    for i in range(1000)
                ],
            )
            next_id += 1000
        submit_s = time.perf_counter() - began
        with app.begin() as conn:
            conn.execute(delete(inbox_table))
        for _ in range(batches):
            with app.begin() as conn:
                enqueue_many(conn, [SPEC] * 1000)
        began = time.perf_counter()
        drained = 0
        while True:
            items = store.read_inbox(1000, base=BASE)
            if not items:
                break
            batch: list[Submitted | InboxTaken] = []
            for item in items:
                batch.append(Submitted(id=TaskId(next_id), seq=0, arrival=0, spec=item.spec))
                batch.append(InboxTaken(inbox_id=item.inbox_id))
                next_id += 1
            store.commit(epoch, BASE, batch)
            drained += len(items)
        drain_s = time.perf_counter() - began
        store.release_leadership()
    app.dispose()
    submit_rate = batches * 1000 / submit_s
    drain = drained / drain_s
    return {
        "batch": 1000,
        "tasks": drained,
        "submit_per_s": round(submit_rate),
        "drain_per_s": round(drain),
        "ratio": round(drain / submit_rate, 2),
    }


def run(dialect: str, *, samples: int, quick: bool) -> dict[str, Any]:
    with scratch(dialect) as url:
        SqlStore.open(url).close()  # migrate
        result: dict[str, Any] = {"dialect": dialect}
        result["wake_latency"] = latency(url, samples)
        result["enqueue"] = enqueue_rates(url, quick)
        result["drain"] = drain_rate(url, 5 if quick else 20)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dialect", choices=["sqlite", "postgresql", "mysql", "all"], default="sqlite"
    )
    parser.add_argument("--samples", type=int, default=200, help="wake-up latency samples")
    parser.add_argument("--quick", action="store_true", help="fewer transactions")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    names = ["sqlite", "postgresql", "mysql"] if args.dialect == "all" else [args.dialect]
    results = [run(d, samples=args.samples, quick=args.quick) for d in names]
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    for r in results:
        lat = r["wake_latency"]
        print(
            f"{r['dialect']}: wake-up p50 {lat['p50_ms']} ms, p99 {lat['p99_ms']} ms "
            f"(max {lat['max_ms']} ms, {lat['samples']} samples, poll {lat['poll_s']} s)"
        )
        for e in r["enqueue"]:
            goal = "ok" if e["ratio"] >= 0.8 else "BELOW 0.8"
            print(
                f"  enqueue {e['processes']} proc x {e['per_txn']:>3}/txn: store "
                f"{e['store_per_s']:>7}/s, raw {e['raw_per_s']:>7}/s, ratio {e['ratio']} ({goal})"
            )
        d = r["drain"]
        goal = "ok" if d["ratio"] >= 0.8 else "BELOW 0.8"
        print(
            f"  drain batch 1000: {d['drain_per_s']}/s vs submit {d['submit_per_s']}/s, "
            f"ratio {d['ratio']} ({goal})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
