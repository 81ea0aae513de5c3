"""cronoq's app side beside the job systems a user could pick instead, on one PostgreSQL server.

One client, about 100-byte jobs, durable commits, each system in a fresh database of its own;
jobs/s for one job per transaction and for 1,000 jobs per call (each shape run once untimed
first: what a running app pays, not a first call's compiling), 5 repeats in alternating order,
median; beside each rate the CPU per job (µs) of the client process and of the database's
server backends (their /proc/PID/stat before and after each timed part: the server runs on this
machine). The peers are installed outside the repository (see benchmarks/README.md, "Peers"):

    python benchmarks/bench_peers.py --peers /tmp/peers [--repeats 5] [--json] [--rtt MS]
        [--only WORD ...] [--batches N]

`--only WORD` runs the systems whose row name has WORD ("leader", "graphile", "pg-boss"):
a change to one system, measured beside the peers it is compared with. `--batches N`: calls
of 1,000 per sample (10), for steadier batch figures. Where both ran, the table is followed
by `enqueue_many` given the Engine over the raw COPY, per repeat (each pair run back to
back): the median and the range.

With `--rtt MS` every system reaches the server through a latency proxy of its own
(`cronoq_store.bench.proxy`, in a process of its own, so its CPU is no system's) that adds MS
milliseconds of round trip (MS / 2 each way).

- cronoq: `enqueue` / `enqueue_many` of 1,000 given the `Engine` (no transaction of the app's,
  as a peer's call: one autocommit statement), and the same in the app's own transaction
  (begin, enqueue, commit), both in this interpreter;
- cronoq's leader: `SqlStore.commit` of one new task / of 1,000 (no keys, no deps);
- procrastinate: `defer` / `batch_defer` (the peers' virtualenv, `PEERS/venv`);
- graphile-worker: `addJob` / `addJobs`; pg-boss: `send` / `insert` (node, `PEERS/node_modules`);
- raw psycopg: INSERT + COMMIT of a four-column row / COPY of the inbox's own rows (the rows
  `enqueue_many` writes, encoded in the loop as a hand-written client would), one
  transaction per 1,000 (this interpreter).

Figures only: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from peers_cpu import Figures, Part, figures
from sqlalchemy import create_engine, make_url, text

SERVER = os.environ.get(
    "CRONOQ_BENCH_POSTGRESQL_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
PAYLOAD = b"x" * 100
SINGLE = 500
"""Jobs per sample, one per transaction."""
BATCHES = 10
"""Calls of 1,000 jobs per sample."""

RTT_MS = 0.0
"""The round trip the proxy adds in front of every system's database (`--rtt`); 0: none."""

PROCRASTINATE = r"""
from peers_cpu import Part, figures
import json, sys, time, procrastinate
dsn, single, batches = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))
@app.task(name="job", queue="default")
def job(payload): pass
with app.open():
    app.schema_manager.apply_schema()
    data = "x" * 100
    job.defer(payload=data)
    job.batch_defer(*[{"payload": data}] * 1000)
    with Part(dsn, single) as one:
        for _ in range(single):
            job.defer(payload=data)
    with Part(dsn, batches * 1000) as many:
        for _ in range(batches):
            job.batch_defer(*[{"payload": data}] * 1000)
print(json.dumps(figures(one, many)))
"""

NODE = r"""
const [dsn, single, batches] = [process.argv[2], +process.argv[3], +process.argv[4]];
const which = process.argv[5];
const data = { payload: "x".repeat(100) };
const payload = data;
const fs = require("fs");
const { Client } = require("pg");
async function serverCpu() {  // as CPU's server_cpu: the database's backends but this one
  const c = new Client({ connectionString: dsn });
  await c.connect();
  const { rows } = await c.query("SELECT pid FROM pg_stat_activity"
    + " WHERE datname = current_database() AND pid <> pg_backend_pid()");
  await c.end();
  let used = 0;
  for (const { pid } of rows) {
    try {
      const stat = fs.readFileSync(`/proc/${pid}/stat`, "utf8");
      const fields = stat.slice(stat.lastIndexOf(")") + 1).trim().split(/ +/);
      used += (+fields[11] + +fields[12]) / 100;  // CLK_TCK
    } catch (e) {}
  }
  return used;
}
async function part(jobs, fn) {
  const server = await serverCpu();
  const client = process.cpuUsage();
  const t = process.hrtime.bigint();
  await fn();
  const wall = Number(process.hrtime.bigint() - t) / 1e9;
  const used = process.cpuUsage(client);
  const serverUs = ((await serverCpu()) - server) / jobs * 1e6;
  return { rate: jobs / wall, client_us: (used.user + used.system) / jobs, server_us: serverUs };
}
async function graphile() {
  const { makeWorkerUtils } = require("graphile-worker");
  const utils = await makeWorkerUtils({ connectionString: dsn });
  await utils.migrate();
  await utils.addJob("job", data);
  await utils.addJobs(Array.from({ length: 1000 }, () => ({ identifier: "job", payload })));
  const one = await part(single, async () => {
    for (let i = 0; i < single; i++) await utils.addJob("job", data);
  });
  const many = await part(batches * 1000, async () => {
    for (let b = 0; b < batches; b++)
      await utils.addJobs(Array.from({ length: 1000 }, () => ({ identifier: "job", payload })));
  });
  await utils.release();
  return { single: one, batch: many };
}
async function pgboss() {
  const PgBoss = require("pg-boss");
  const boss = new PgBoss({ connectionString: dsn, max: 1, supervise: false, schedule: false });
  boss.on("error", (e) => console.error(e));
  await boss.start();
  await boss.createQueue("job");
  await boss.send("job", data);
  await boss.insert(Array.from({ length: 1000 }, () => ({ name: "job", data })));
  const one = await part(single, async () => {
    for (let i = 0; i < single; i++) await boss.send("job", data);
  });
  const many = await part(batches * 1000, async () => {
    for (let b = 0; b < batches; b++)
      await boss.insert(Array.from({ length: 1000 }, () => ({ name: "job", data })));
  });
  await boss.stop({ graceful: false, wait: true });
  return { single: one, batch: many };
}
(which === "graphile" ? graphile() : pgboss()).then(
  (r) => { console.log(JSON.stringify(r)); process.exit(0); },
  (e) => { console.error(e); process.exit(1); });
"""


@contextmanager
def database() -> Iterator[str]:
    """A fresh database on the server (its SQLAlchemy URL), dropped afterwards."""
    admin = create_engine(SERVER, isolation_level="AUTOCOMMIT")
    name = f"cronoq_peers_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {name}"))
    try:
        url = make_url(SERVER).set(database=name)
        if not RTT_MS:
            yield url.render_as_string(hide_password=False)
            return
        with proxy(f"{url.host or '127.0.0.1'}:{url.port or 5432}") as port:
            routed = url.set(host="127.0.0.1", port=port)
            yield routed.render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()


@contextmanager
def proxy(target: str) -> Iterator[int]:
    """A latency proxy (`cronoq_store.bench.proxy`) adding `RTT_MS` in front of `target`,
    in a process of its own: in this one its CPU would count as the client's for the
    systems measured here (cronoq, raw psycopg) and for no other. Yields its port."""
    command = [sys.executable, "-W", "ignore::RuntimeWarning", "-m", "cronoq_store.bench.proxy"]
    command += ["--target", target]
    command += ["--delay-ms", str(RTT_MS / 2)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        yield int(process.stdout.readline().rsplit(":", 1)[1])
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)


def _dsn(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def cronoq(url: str) -> Figures:
    """`enqueue` / `enqueue_many` given the app's `Engine`: each call its own transaction, as
    a peer's `addJob` / `send` is (on PostgreSQL one autocommit statement)."""
    from cronoq_store import SqlStore, TaskSpec, enqueue, enqueue_many

    SqlStore.open(url).close()  # migrate
    engine = create_engine(url)
    spec = TaskSpec(payload=PAYLOAD, kind="job")
    specs = [spec] * 1000
    enqueue(engine, spec)
    enqueue_many(engine, specs)
    with Part(_dsn(url), SINGLE) as one:
        for _ in range(SINGLE):
            enqueue(engine, spec)
    with Part(_dsn(url), BATCHES * 1000) as many:
        for _ in range(BATCHES):
            enqueue_many(engine, specs)
    engine.dispose()
    return figures(one, many)


def cronoq_in_transaction(url: str) -> Figures:
    """`enqueue` / `enqueue_many` in the app's own transaction on an open `Connection`:
    begin, enqueue, commit (the app's BEGIN rides with the enqueue's INSERT)."""
    from cronoq_store import SqlStore, TaskSpec, enqueue, enqueue_many

    SqlStore.open(url).close()  # migrate
    engine = create_engine(url)
    spec = TaskSpec(payload=PAYLOAD, kind="job")
    specs = [spec] * 1000
    with engine.connect() as conn:
        conn.begin()
        enqueue(conn, spec)
        enqueue_many(conn, specs)
        conn.commit()
        with Part(_dsn(url), SINGLE) as one:
            for _ in range(SINGLE):
                conn.begin()
                enqueue(conn, spec)
                conn.commit()
        with Part(_dsn(url), BATCHES * 1000) as many:
            for _ in range(BATCHES):
                conn.begin()
                enqueue_many(conn, specs)
                conn.commit()
    engine.dispose()
    return figures(one, many)


def leader(url: str) -> Figures:
    """The engine's side: the leader's commit of new tasks (no keys, no deps), one per commit
    and 1,000 per commit: what a job lands by when the engine, not an app, creates it."""
    from cronoq_store import SqlStore, Submitted, TaskId, TaskSpec, TimeBase

    base = TimeBase(unix_ns=time.time_ns())
    spec = TaskSpec(payload=PAYLOAD, kind="job")
    ids = iter(range(1, 1002 + SINGLE + BATCHES * 1000))

    def submitted(count: int) -> list[Submitted]:
        return [
            Submitted(id=TaskId(i), seq=i, arrival=0, spec=spec)
            for i in (next(ids) for _ in range(count))
        ]

    with SqlStore.open(url) as store:
        epoch = store.acquire_leadership()
        store.commit(epoch, base, submitted(1))
        store.commit(epoch, base, submitted(1000))
        singles = [submitted(1) for _ in range(SINGLE)]
        with Part(_dsn(url), SINGLE) as one:
            for batch in singles:
                store.commit(epoch, base, batch)
        batches = [submitted(1000) for _ in range(BATCHES)]
        with Part(_dsn(url), BATCHES * 1000) as many:
            for batch in batches:
                store.commit(epoch, base, batch)
        store.release_leadership()
    return figures(one, many)


def raw(url: str) -> Figures:
    """A hand-written psycopg client: INSERT + COMMIT of a small row; COPY of the rows
    `enqueue_many` writes into the inbox (its columns, each row encoded in the loop), one
    transaction per 1,000: the driver's floor for the same work."""
    import psycopg

    from cronoq_store import SqlStore, TaskSpec
    from cronoq_store.bench.inbox import INBOX_COLUMNS, raw_inbox_row

    SqlStore.open(url).close()  # the inbox table
    spec = TaskSpec(payload=PAYLOAD, kind="job")
    copy_sql = f"COPY cronoq_inbox ({', '.join(INBOX_COLUMNS)}) FROM STDIN"
    with psycopg.connect(_dsn(url)) as conn:
        conn.execute(
            "CREATE TABLE jobs (id bigserial PRIMARY KEY, enqueued_unix_ns bigint NOT NULL, "
            "kind text NOT NULL, payload bytea NOT NULL, tags text NOT NULL)"
        )
        with conn.cursor() as cur, cur.copy(copy_sql) as copy:
            for _ in range(1000):
                copy.write_row(raw_inbox_row(spec))
        conn.commit()
        sql = "INSERT INTO jobs (enqueued_unix_ns, kind, payload, tags) VALUES (%s, %s, %s, %s)"
        with Part(_dsn(url), SINGLE) as one:
            for _ in range(SINGLE):
                conn.execute(sql, (time.time_ns(), "job", PAYLOAD, "[]"))
                conn.commit()
        with Part(_dsn(url), BATCHES * 1000) as many:
            for _ in range(BATCHES):
                with conn.cursor() as cur, cur.copy(copy_sql) as copy:
                    for _ in range(1000):
                        copy.write_row(raw_inbox_row(spec))
                conn.commit()
    return figures(one, many)


def external(command: list[str], cwd: Path, env: dict[str, str]) -> Figures:
    done = subprocess.run(
        command, cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"{command[0]} failed: {done.stderr[-2000:]}")
    result: Figures = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def systems(peers: Path) -> dict[str, Callable[[str], Figures]]:
    scratch = Path(tempfile.mkdtemp(prefix="cronoq-peers-"))
    (scratch / "procrastinate_bench.py").write_text(PROCRASTINATE)
    (scratch / "node_bench.js").write_text(NODE)
    (scratch / "peers_cpu.py").write_text((Path(__file__).parent / "peers_cpu.py").read_text())
    python = str(peers / "venv" / "bin" / "python")
    node_env = {"NODE_PATH": str(peers / "node_modules")}
    counts = [str(SINGLE), str(BATCHES)]

    def node(which: str) -> Callable[[str], Figures]:
        return lambda url: external(
            ["node", "node_bench.js", _dsn(url), *counts, which], scratch, node_env
        )

    return {
        ENGINE_ROW: cronoq,
        "cronoq enqueue / enqueue_many in the app's transaction": cronoq_in_transaction,
        "cronoq leader commit, batch 1 / batch 1000": leader,
        "procrastinate defer / batch_defer": lambda url: external(
            [python, "procrastinate_bench.py", _dsn(url), *counts], scratch, {}
        ),
        "graphile-worker addJob / addJobs": node("graphile"),
        "pg-boss send / insert": node("pgboss"),
        COPY_ROW: raw,
    }


def main(argv: list[str] | None = None) -> int:
    global RTT_MS, BATCHES
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=Path, default=Path("/tmp/peers"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--rtt", type=float, default=0.0, help="round trip to add, ms")
    parser.add_argument(
        "--only", action="append", default=[], help="run the systems whose name has this word"
    )
    parser.add_argument("--batches", type=int, default=BATCHES, help="calls of 1,000 a sample")
    args = parser.parse_args(argv)
    RTT_MS = args.rtt
    BATCHES = args.batches
    runs = {
        name: fn
        for name, fn in systems(args.peers).items()
        if not args.only or any(word in name for word in args.only)
    }
    samples: dict[str, list[Figures]] = {name: [] for name in runs}
    for repeat in range(args.repeats):
        order = list(runs.items())
        if repeat % 2:
            order.reverse()
        for name, fn in order:
            with database() as url:
                samples[name].append(fn(url))
            print(f"  {name}: {samples[name][-1]}", file=sys.stderr)
    table: dict[str, Any] = {
        name: {
            part: {
                figure: round(statistics.median(s[part][figure] for s in got), 1)
                for figure in ("rate", "client_us", "server_us")
            }
            for part in ("single", "batch")
        }
        for name, got in samples.items()
    }
    ratio = _copy_ratio(samples)
    if args.json:
        print(json.dumps(table if ratio is None else {**table, COPY_RATIO: ratio}, indent=2))
        return 0
    at = f", {args.rtt:g} ms RTT" if args.rtt else ""
    print(
        f"| one client, median of {args.repeats}{at} | one job per transaction: jobs/s, "
        "client / server CPU µs per job | 1,000 jobs per call: jobs/s, client / server µs |"
    )
    print("|---|---|---|")
    for name, row in table.items():
        cells = [
            f"{p['rate']:,.0f} ({p['client_us']:.0f} / {p['server_us']:.0f})"
            for p in (row["single"], row["batch"])
        ]
        print(f"| {name} | {cells[0]} | {cells[1]} |")
    if ratio is not None:
        print(
            f"\n{COPY_RATIO}: {ratio['median']:.2f}x (range {ratio['min']:.2f}-"
            f"{ratio['max']:.2f}, {len(ratio['repeats'])} repeats)"
        )
    return 0


ENGINE_ROW = "cronoq enqueue / enqueue_many, given the Engine"
COPY_ROW = "raw psycopg INSERT + COMMIT / COPY of the inbox's rows"
COPY_RATIO = "enqueue_many of 1,000 / raw COPY"


def _copy_ratio(samples: dict[str, list[Figures]]) -> dict[str, Any] | None:
    """`enqueue_many` given the Engine over the raw COPY, batch rates, repeat by repeat (the
    pair ran back to back, in alternating order): issue 41's ">= 0.6x"."""
    if ENGINE_ROW not in samples or COPY_ROW not in samples:
        return None
    repeats = [
        round(ours["batch"]["rate"] / raw["batch"]["rate"], 3)
        for ours, raw in zip(samples[ENGINE_ROW], samples[COPY_ROW], strict=True)
    ]
    return {
        "median": statistics.median(repeats),
        "min": min(repeats),
        "max": max(repeats),
        "repeats": repeats,
    }


if __name__ == "__main__":
    sys.exit(main())
