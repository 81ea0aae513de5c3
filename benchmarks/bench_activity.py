"""The dashboard's activity reads (charts and finished counts) at 1,000,000 tasks, with plans.

Fills the database at `--url` (empty, migrated here) with `-n` tasks in ONE bulk SQL statement
(`generate_series` on PostgreSQL, a recursive CTE on SQLite and MariaDB), their arrivals spread
evenly over the last `--days` days (ids in arrival order, as engines number them), every
100th task live and the rest finished 30 s after arrival (80% succeeded, 10% failed, 10%
cancelled). Then it prints each activity statement's plan (EXPLAIN) and times, `--runs`
times each, in the dashboard's read-only transaction:

- `activity_charts`: the overview's two charts (the last day per minute, the hour cut from it);
- `finished_recently`: the Finished card's last-hour counts by status;
- `first_id_since`: the binary search for the day's first id alone.

Figures only: nothing here asserts a time.

    python benchmarks/bench_activity.py --url sqlite:////tmp/a.db [-n 1000000] [--runs 10]
    python benchmarks/bench_activity.py --url postgresql+psycopg://postgres@127.0.0.1/DB
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, select, text

from cronoq_store import SqlStore, StoreConfig, Submitted, TaskId, TaskSpec, TimeBase, cli
from cronoq_store.repository import operators
from cronoq_store.schema import tasks
from cronoq_store.web import app as web_app
from cronoq_store.web import views

S = 1_000_000_000


def fill(store: SqlStore, n: int, days: float) -> float:
    """`n` tasks in one INSERT ... SELECT; returns the seconds it took."""
    epoch = store.acquire_leadership()
    store.commit(
        epoch, TimeBase(0), [Submitted(id=TaskId(0), seq=0, arrival=0, spec=TaskSpec(payload=b"x"))]
    )
    store.release_leadership()
    with store.engine.connect() as conn:
        row = conn.execute(select(tasks).where(tasks.c.id == 0)).one()._mapping
        conn.execute(tasks.delete())
        conn.commit()
    now = time.time_ns()
    span = int(days * 86400 * S)
    step = span // n
    start = now - span
    dialect = store.engine.dialect.name
    source = "generate_series(CAST(1 AS BIGINT), :n) AS g(i)" if dialect == "postgresql" else "seq"
    prefix = (
        ""
        if dialect == "postgresql"
        else "WITH RECURSIVE seq(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM seq WHERE i < :n) "
    )
    status = (
        "CASE WHEN i % 100 = 0 THEN 'queued' WHEN i % 10 = 1 THEN 'failed' "
        "WHEN i % 10 = 2 THEN 'cancelled' ELSE 'succeeded' END"
    )
    finished = f"CASE WHEN i % 100 = 0 THEN NULL ELSE :start + i * :step + {30 * S} END"
    sql = (
        "INSERT INTO cronoq_tasks "
        "(id, seq, arrival_unix_ns, pool, kind, priority, payload, deps, resources, tags, labels,"
        " status, terminal, attempt, updated_unix_ns, finished_unix_ns) "
        f"{prefix}SELECT i, i, :start + i * :step, 'default', '', 1, :payload, :deps, "
        f":resources, :tags, :labels, {status}, i % 100 <> 0, 1, "
        f"CASE WHEN i % 100 = 0 THEN :start + i * :step ELSE :start + i * :step + {30 * S} END, "
        f"{finished} FROM {source}"
    )
    params = {
        "n": n, "start": start, "step": step, "payload": b"x", "deps": row["deps"],
        "resources": row["resources"], "tags": row["tags"], "labels": row["labels"],
    }  # fmt: skip
    began = time.perf_counter()
    with store.engine.connect() as conn:
        if dialect == "mysql":
            limit = (
                "max_recursive_iterations" if conn.dialect.is_mariadb else "cte_max_recursion_depth"
            )
            conn.exec_driver_sql(f"SET SESSION {limit} = 100000000")
        conn.execute(text(sql), params)
        conn.commit()
    if dialect == "postgresql":
        with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM ANALYZE cronoq_tasks")
    elif dialect == "sqlite":
        with store.engine.connect() as conn:
            conn.exec_driver_sql("ANALYZE")
            conn.commit()
    else:
        with store.engine.connect() as conn:
            conn.exec_driver_sql("ANALYZE TABLE cronoq_tasks")
    return time.perf_counter() - began


def plans(conn: Connection) -> dict[str, list[str]]:
    """EXPLAIN of each activity statement, as the dialect prints it."""
    day = time.time_ns() - 86400 * S
    dialect = conn.dialect.name
    explain = {"sqlite": "EXPLAIN QUERY PLAN ", "postgresql": "EXPLAIN ", "mysql": "EXPLAIN "}
    statements = {
        "finished_per_minute": (operators.finished_per_minute_stmt(), {"since": day}),
        "finished_by_status": (operators.finished_by_status_stmt(), {"since": day}),
        "first_at_or_above": (operators.first_at_or_above_stmt(), {"id": 500_000}),
        "submitted_per_minute": (
            operators.submitted_per_minute_stmt(),
            {"from_id": 800_000, "since": day},
        ),
        "id_bounds": (operators.id_bounds_stmt(), {}),
    }
    out = {}
    for name, (stmt, params) in statements.items():
        compiled = stmt.compile(dialect=conn.dialect, compile_kwargs={"literal_binds": False})
        sql = explain[dialect] + str(compiled)
        rows = conn.exec_driver_sql(
            sql,
            tuple(compiled.construct_params(params)[k] for k in compiled.positiontup or ())
            if compiled.positional
            else compiled.construct_params(params),
        ).all()
        out[name] = [" | ".join(str(c) for c in r) for r in rows]
    return out


def timed(fn: Callable[[], object], runs: int) -> dict[str, float]:
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        fn()
        times.append((time.perf_counter() - began) * 1000)
    return {"median_ms": round(statistics.median(times), 2), "min_ms": round(min(times), 2),
            "max_ms": round(max(times), 2)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", required=True, help="an EMPTY database (migrated here)")
    parser.add_argument("-n", type=int, default=1_000_000, help="tasks in the store")
    parser.add_argument("--days", type=float, default=7.0, help="days the arrivals span")
    parser.add_argument("--runs", type=int, default=10, help="timed runs per figure")
    args = parser.parse_args()
    with SqlStore.open(args.url, StoreConfig()) as store:
        filled_s = fill(store, args.n, args.days)
    target = cli.Target(url=args.url, schema=None)
    out: dict[str, Any] = {"n": args.n, "days": args.days, "fill_s": round(filled_s, 1)}
    with cli.open_database(target) as reader:
        read = web_app.Reader(reader.engine).read
        day = time.time_ns() - 86400 * S
        out["rows_last_day"] = read(
            lambda c: c.execute(operators.finished_by_status_stmt(), {"since": day}).all()
        )
        out["rows_last_day"] = sum(int(r.n) for r in out["rows_last_day"])
        out["activity_charts"] = timed(lambda: read(views.activity_charts), args.runs)
        out["finished_recently"] = timed(lambda: read(views.finished_recently), args.runs)
        out["first_id_since"] = timed(
            lambda: read(lambda c: views.first_id_since(c, day)), args.runs
        )
        out["overview"] = timed(
            lambda: read(
                lambda c: views.overview(c, schema=None, retention=StoreConfig().retention)
            ),
            args.runs,
        )
        with reader.engine.connect() as conn:
            out["plans"] = plans(conn)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
