"""Drill: a leader of the previous build commits while another process migrates to head.

The scenario of issue #37: a leader of the build just before revision 0005 (commit 128166a,
head 0004) leads on a database holding `--rows` finished tasks and commits batch-1
transitions (submit, running, succeeded: one commit each, its lease renewed by its keeper)
while a second process, of the build under test, runs `migrate.upgrade` to head. Printed (and
written with `--json`): the history size, how long the upgrade took, the leader's worst commit
latency while it ran, its commit count, any error, and whether it still held its lease after.

    git -C /work/main worktree add --detach /tmp/old128 128166a
    python benchmarks/drill_online_migration.py --dialect postgresql --rows 1500000 \\
        --old /tmp/old128 --new .                  # the build under test: this tree
    python benchmarks/drill_online_migration.py --dialect sqlite --rows 500000 --old ... --new ...

Each build runs in its own process with `PYTHONPATH` set to its tree (same dependencies). The
populated database at revision 0004 is built once (the old build's schema, one finished task
committed by its store and copied `--rows` times in SQL) and kept as a template (PostgreSQL:
a template database; SQLite: a file; MariaDB: a database copied table by table), so runs for
two builds start from the same history. `--drop-template` removes it at the end.

Targets (issue #37): worst commit <= 1 s (SQLite 2 s), no error, lease kept.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, make_url, text

SERVERS = {
    "postgresql": os.environ.get(
        "CRONOQ_BENCH_POSTGRESQL_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    ),
    "mysql": os.environ.get("CRONOQ_BENCH_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/"),
}
PREFIX = "cq_online_"

SEED = """
import sys, time
from cronoq_store import (SqlStore, StoreConfig, StatusChanged, Submitted, TaskId, TaskSpec,
                          TaskStatus, TimeBase)
with SqlStore.open(sys.argv[1], StoreConfig()) as store:
    epoch = store.acquire_leadership()
    base = TimeBase(unix_ns=time.time_ns())
    spec = TaskSpec(payload=b"x" * 100, tags=frozenset({"drill"}), labels={"a": "b"})
    store.commit(epoch, base, [Submitted(id=TaskId(0), seq=0, arrival=0, spec=spec)])
    store.commit(epoch, base, [StatusChanged(id=TaskId(0), status=TaskStatus.RUNNING,
                                             attempt=1, at=1)])
    store.commit(epoch, base, [StatusChanged(id=TaskId(0), status=TaskStatus.SUCCEEDED,
                                             attempt=1, at=2)])
    store.release_leadership()
"""

LEADER = """
import json, os, sys, time
from datetime import timedelta
from cronoq_store import (SqlStore, StoreConfig, StatusChanged, Submitted, TaskId, TaskSpec,
                          TaskStatus, TimeBase)
url, first_id, stop_file = sys.argv[1], int(sys.argv[2]), sys.argv[3]
lost = []
config = StoreConfig(migrate=False, lease_ttl=timedelta(seconds=10),
                     lease_renew=timedelta(seconds=2))
store = SqlStore.open(url, config)
epoch = store.acquire_leadership()
base = TimeBase(unix_ns=time.time_ns())
print("leading", flush=True)
worst, worst_at, commits, errors, lat = 0.0, None, 0, [], []
i = first_id
began = time.monotonic()
while not os.path.exists(stop_file):
    for change in (
        Submitted(id=TaskId(i), seq=i, arrival=0, spec=TaskSpec(payload=b"y" * 100)),
        StatusChanged(id=TaskId(i), status=TaskStatus.RUNNING, attempt=1, at=1),
        StatusChanged(id=TaskId(i), status=TaskStatus.SUCCEEDED, attempt=1, at=2),
    ):
        t = time.monotonic()
        try:
            store.commit(epoch, base, [change])
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}"[:200])
            time.sleep(0.05)
        d = time.monotonic() - t
        lat.append(d)
        commits += 1
        if d > worst:
            worst, worst_at = d, t - began
    i += 1
kept = True  # the lease: a commit after the upgrade is not fenced
try:
    store.commit(epoch, base, [Submitted(id=TaskId(i), seq=i, arrival=0,
                                         spec=TaskSpec(payload=b"z"))])
except Exception as exc:
    kept = False
    errors.append(f"after the upgrade {type(exc).__name__}: {exc}"[:200])
lat.sort()
print(json.dumps({"commits": commits, "worst_s": round(worst, 4),
                  "worst_at_s": None if worst_at is None else round(worst_at, 2),
                  "p99_s": round(lat[int(len(lat) * 0.99)], 4) if lat else None,
                  "errors": errors[:5], "error_count": len(errors), "lease_kept": kept}),
      flush=True)
store.close()
"""

UPGRADE = """
import sys, time
from sqlalchemy import create_engine
from cronoq_store import migrate
engine = create_engine(sys.argv[1])
t = time.monotonic()
migrate.upgrade(engine)
print(round(time.monotonic() - t, 3), migrate.current_revision(engine), flush=True)
engine.dispose()
"""

COLUMNS_0004 = [
    *("seq", "arrival_unix_ns", "pool", "kind", "priority", "key", "live_key", "payload"),
    *("deadline_unix_ns", "fixed_at_unix_ns", "fixed_tolerance_ns", "fixed_on_miss"),
    *("duration_hint_ns", "timeout_ns", "retry", "deps", "resources", "tags", "labels"),
    *("tenant", "status", "terminal", "attempt", "updated_unix_ns", "message", "output"),
]
"""The columns of cronoq_tasks at revision 0004, besides `id`."""


def run_py(tree: Path, code: str, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=tempfile.gettempdir(),  # not a tree: '' on sys.path would shadow PYTHONPATH
        env=env,
        capture_output=True,
        text=True,
        check=True,
        **kw,
    )


def series(dialect: str, n: int) -> str:
    if dialect == "postgresql":
        return f"generate_series(1, {n}) AS g(n)"
    if dialect == "mysql":
        return f"(SELECT seq AS n FROM seq_1_to_{n}) AS g"
    recursive = f"WITH RECURSIVE c(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM c WHERE n < {n})"
    return f"({recursive} SELECT n FROM c) AS g"


def populate(dialect: str, url: str, rows: int, old: Path) -> None:
    """The old build's schema (0004), one finished task by its store, copied `rows` times."""
    run_py(old, SEED, url, timeout=600)
    cols = ", ".join(
        "g.n" if c == "seq" else "t.updated_unix_ns + g.n" if c == "updated_unix_ns" else f"t.{c}"
        for c in COLUMNS_0004
    )
    key = "`key`" if dialect == "mysql" else '"key"'
    names = ", ".join(key if c == "key" else c for c in COLUMNS_0004)
    cols = cols.replace("t.key", f"t.{key}")
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(
            text(
                f"INSERT INTO cronoq_tasks (id, {names}) SELECT g.n, {cols} "
                f"FROM cronoq_tasks t CROSS JOIN {series(dialect, rows)} WHERE t.id = 0"
            )
        )
        conn.execute(text(f"UPDATE cronoq_leader SET next_id = {rows + 1}"))
    if dialect == "postgresql":
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("VACUUM ANALYZE cronoq_tasks"))
    engine.dispose()


def server_admin(dialect: str) -> Any:
    return create_engine(SERVERS[dialect], isolation_level="AUTOCOMMIT")


def prepare(dialect: str, rows: int, old: Path, work: Path) -> str:
    """A fresh copy of the populated template; its URL."""
    tpl = f"{PREFIX}tpl_{rows}"
    run = f"{PREFIX}run"
    if dialect == "sqlite":
        template = work / f"{tpl}.db"
        if not template.exists():
            populate(dialect, f"sqlite:///{template}", rows, old)
        target = work / f"{run}.db"
        for suffix in ("", "-wal", "-shm", "-migrate.lock"):
            Path(f"{target}{suffix}").unlink(missing_ok=True)
        shutil.copy(template, target)
        return f"sqlite:///{target}"
    admin = server_admin(dialect)
    base = make_url(SERVERS[dialect])
    with admin.connect() as conn:
        if dialect == "postgresql":
            have = conn.execute(
                text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": tpl}
            ).first()
            if have is None:
                conn.execute(text(f"CREATE DATABASE {tpl}"))
                populate(dialect, base.set(database=tpl).render_as_string(False), rows, old)
            conn.execute(text(f"DROP DATABASE IF EXISTS {run} WITH (FORCE)"))
            conn.execute(text(f"CREATE DATABASE {run} TEMPLATE {tpl}"))
        else:
            have = conn.execute(text(f"SHOW DATABASES LIKE '{tpl}'")).first()
            if have is None:
                conn.execute(text(f"CREATE DATABASE {tpl} CHARACTER SET utf8mb4"))
                populate(dialect, base.set(database=tpl).render_as_string(False), rows, old)
            conn.execute(text(f"DROP DATABASE IF EXISTS {run}"))
            conn.execute(text(f"CREATE DATABASE {run} CHARACTER SET utf8mb4"))
            tables = conn.execute(
                text("SELECT table_name FROM information_schema.tables WHERE table_schema = :s"),
                {"s": tpl},
            ).scalars()
            for table in list(tables):
                conn.execute(text(f"CREATE TABLE {run}.{table} LIKE {tpl}.{table}"))
                conn.execute(text(f"INSERT INTO {run}.{table} SELECT * FROM {tpl}.{table}"))
    admin.dispose()
    return base.set(database=run).render_as_string(False)


def drill(dialect: str, url: str, rows: int, old: Path, new: Path, work: Path) -> dict[str, Any]:
    stop = work / "stop"
    stop.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(old.resolve())}
    leader = subprocess.Popen(
        [sys.executable, "-c", LEADER, url, str(rows + 10), str(stop)],
        cwd=tempfile.gettempdir(),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert leader.stdout is not None
    if leader.stdout.readline().strip() != "leading":
        raise SystemExit(f"the old build's leader failed: {leader.communicate()[1]}")
    time.sleep(3)  # the leader's commits settle
    began = time.monotonic()
    upgrade = subprocess.run(
        [sys.executable, "-c", UPGRADE, url],
        cwd=tempfile.gettempdir(),
        env={**os.environ, "PYTHONPATH": str(new.resolve())},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    wall = time.monotonic() - began
    time.sleep(3)  # and after it: a leader that lost its lease fails here
    stop.touch()
    out, err = leader.communicate(timeout=120)
    stop.unlink(missing_ok=True)
    result: dict[str, Any] = {
        "dialect": dialect,
        "finished_tasks": rows,
        "upgrade_ok": upgrade.returncode == 0,
        "upgrade_s": float(upgrade.stdout.split()[0]) if upgrade.returncode == 0 else None,
        "upgrade_wall_s": round(wall, 3),
        "upgrade_error": upgrade.stderr.strip().splitlines()[-1:] if upgrade.returncode else [],
        "new_build": str(new),
    }
    try:
        result["leader"] = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        result["leader"] = {"crashed": err.strip().splitlines()[-3:]}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dialect", choices=["sqlite", "postgresql", "mysql"], required=True)
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--old", type=Path, required=True, help="tree of the leader's build")
    parser.add_argument("--new", type=Path, required=True, help="tree of the migrating build")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "cq_online")
    parser.add_argument("--json", type=Path, help="append the result to this file (JSON lines)")
    parser.add_argument("--drop-template", action="store_true")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    url = prepare(args.dialect, args.rows, args.old, args.work)
    result = drill(args.dialect, url, args.rows, args.old, args.new, args.work)
    print(json.dumps(result, indent=2))
    if args.json:
        with args.json.open("a") as fh:
            fh.write(json.dumps(result) + "\n")
    cleanup(args.dialect, args.rows, drop_template=args.drop_template)


def cleanup(dialect: str, rows: int, *, drop_template: bool) -> None:
    """Drop the run's database (a server's), and its template if asked."""
    if dialect == "sqlite":
        return
    admin = server_admin(dialect)
    with admin.connect() as conn:
        force = " WITH (FORCE)" if dialect == "postgresql" else ""
        conn.execute(text(f"DROP DATABASE IF EXISTS {PREFIX}run{force}"))
        if drop_template:
            conn.execute(text(f"DROP DATABASE IF EXISTS {PREFIX}tpl_{rows}{force}"))
    admin.dispose()


if __name__ == "__main__":
    main()
