"""The benchmark in reduced form: it completes on every dialect and reports every figure.

Nothing here asserts a time or a ratio (CI machines are noisy); only that each figure is
measured, printed and in the JSON, beside the raw driver on the same rows in its own database.
"""

from __future__ import annotations

import io
import json
import math
import socket
import threading
from dataclasses import replace
from inspect import signature as inspect_signature
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import URL, create_engine, func, inspect, select

from cronoq_store.bench import (
    METRIC_NAMES,
    METRICS,
    BenchResult,
    Figure,
    Target,
    baselines,
    bench,
    markdown_table,
    plot,
    print_table,
    run_bench,
)
from cronoq_store.schema import tasks

SIZES = (1, 10)
TASKS = 30


def _expected(dialect: str) -> set[tuple[str, int | None, str]]:
    """Submissions against every raw baseline of the dialect; the rest against the main one."""
    names = baselines(dialect)
    figures: set[tuple[str, int | None, str]] = {
        ("submit", b, name) for b in SIZES for name in names
    }
    figures |= {("transition", b, names[0]) for b in SIZES}
    figures |= {("submit_cpu", 1, names[0]), ("transition_cpu", 1, names[0])}
    figures |= {
        (m, 1, names[0]) for m in ("leader_commit", "leader_cpu", "leader_p50", "leader_p99")
    }
    figures |= {("recover", None, ""), ("recover_memory", None, ""), ("prune", 1000, "")}
    # The inbox's (bench.inbox): enqueue 1 / 100 in the app's transaction, the drain of 1000.
    bulk = "copy" if dialect == "postgresql" else "executemany"
    return figures | {("enqueue", 1, "insert"), ("enqueue", 100, bulk), ("drain", 1000, bulk)}


def test_raw_baselines_per_dialect() -> None:
    """SQLite: json in the loop and pre-encoded rows; PostgreSQL: executemany and COPY."""
    assert baselines("sqlite") == ("json", "pre-encoded")
    assert baselines("postgresql") == ("executemany", "copy")
    assert baselines("mysql") == ("executemany",)


def test_one_raw_class_per_database() -> None:
    """Each database the store speaks has its raw class, found by the store's class of it."""
    from cronoq_store import dialects
    from cronoq_store.bench.raw import RawDatabase

    for impl in (dialects.SQLiteImpl, dialects.PostgresqlImpl, dialects.MySQLImpl):
        assert RawDatabase.of(impl).impl is impl
    assert RawDatabase.of(dialects.DefaultImpl) is RawDatabase


def test_proxy_protocol_by_database_class() -> None:
    """The latency proxy counts each server's protocol, chosen by its database class."""
    from cronoq_store.bench.proxy import protocol_of

    assert protocol_of("postgresql") == "postgresql"
    assert protocol_of("mysql") == protocol_of("mariadb") == "mysql"
    assert protocol_of("sqlite") == "none"


def test_bench_reports_every_figure(db_url: URL, dialect: str, tmp_path: Path) -> None:
    result = run_bench([Target(url=db_url)], tasks=TASKS, batch_sizes=SIZES, runs=2)
    (db,) = result.databases
    got = {(f.metric, f.batch_size, f.baseline) for f in db.figures}
    assert got == _expected(dialect)
    for f in db.figures:
        assert math.isfinite(f.store) and f.store > 0, f
        assert math.isfinite(f.raw) and f.raw > 0, f
        assert math.isfinite(f.ratio) and f.ratio > 0, f
        if f.metric != "recover_memory":
            assert f.samples == 2, f
            assert f.ratio_min is not None and f.ratio_max is not None
            assert f.ratio_min <= f.ratio <= f.ratio_max, f
        assert (f.excess is not None) == f.metric.endswith("_cpu"), f

    out = io.StringIO()
    print_table(result, file=out)
    table = out.getvalue()
    for name in METRIC_NAMES.values():
        assert name in table
    assert table.count(db.label) == len(db.figures)

    data = json.loads(json.dumps(result.as_dict()))
    figures = data["databases"][0]["figures"]
    assert {(f["metric"], f["batch_size"], f["baseline"]) for f in figures} == got
    assert BenchResult.from_dict(data) == result

    markdown = markdown_table(result)
    assert markdown.splitlines()[0] == f"| figure | {db.label} |"
    assert "submissions, batch 1 |" in markdown
    assert "CPU per submit commit" in markdown
    assert "inbox: enqueue 1 in the app's transaction |" in markdown
    assert "inbox: drain (read_inbox + commit) of 1000 |" in markdown

    png = tmp_path / "bench.png"
    plot(result, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The raw side wrote to its own database, gone now; the store's is empty again.
    engine = create_engine(db_url)
    try:
        names = set(inspect(engine).get_table_names())
        with engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(tasks)).scalar() == 0
    finally:
        engine.dispose()
    assert not {n for n in names if n.startswith("bench_raw")}
    if dialect == "sqlite":
        assert db_url.database is not None
        assert not list(Path(db_url.database).parent.glob("*-raw-*"))


def test_cpu_goal_is_milliseconds_added() -> None:
    """The batch-1 CPU goal bounds what the store adds to raw, not their ratio."""
    f = Figure(
        metric="submit_cpu",
        batch_size=1,
        unit="ms/commit",
        store=0.30,
        raw=0.25,
        ratio=1.2,
        goal=0.1,
        higher_is_better=False,
        samples=5,
        excess=0.05,
    )
    assert f.met is True
    assert replace(f, excess=0.2).met is False


def test_older_json_reads_back() -> None:
    """A result written before baselines and spreads existed still loads (and prints)."""
    old = {
        "tasks": 10,
        "runs": 1,
        "batch_sizes": [1],
        "databases": [
            {
                "label": "sqlite 3 full_sync=on",
                "dialect": "sqlite",
                "url": "sqlite:///x.db",
                "figures": [
                    {
                        "metric": "submit",
                        "batch_size": 1,
                        "unit": "rows/s",
                        "store": 1.0,
                        "raw": 2.0,
                        "ratio": 0.5,
                        "goal": None,
                        "higher_is_better": True,
                        "samples": 1,
                        "met": None,
                    }
                ],
            }
        ],
    }
    result = BenchResult.from_dict(old)
    (f,) = result.databases[0].figures
    assert (f.baseline, f.ratio_min, f.excess) == ("", None, None)
    out = io.StringIO()
    print_table(result, file=out)
    assert "0.50x" in out.getvalue()


def small_run(runner: CliRunner, db: Path, output: str, *, sizes: str, runs: int) -> Result:
    """`cronoq-store bench` of 20 tasks on the SQLite file `db`, printing `output` (--json,
    --markdown); it must succeed."""
    args = ["-n", "20", "--batch-sizes", sizes, "--runs", str(runs), output, "--url", str(db)]
    result = runner.invoke(bench, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


def test_cli_json_covers_both_sqlite_modes(tmp_path: Path) -> None:
    """The command's default: SQLite with full_sync on and off, JSON on stdout."""
    # stdout alone: click 8.2 always captures stderr apart, 8.1 (the floor) when asked.
    separate = "mix_stderr" in inspect_signature(CliRunner).parameters
    runner = CliRunner(**({"mix_stderr": False} if separate else {}))
    result = small_run(runner, tmp_path / "b.db", "--json", sizes="1,10", runs=2)
    data = json.loads(result.stdout)
    labels = [d["label"] for d in data["databases"]]
    assert [label.endswith(("full_sync=on", "full_sync=off")) for label in labels] == [True, True]
    for db in data["databases"]:
        assert {f["metric"] for f in db["figures"]} == set(METRICS)
        assert all(f["met"] in (True, False, None) for f in db["figures"])


def test_cli_markdown(tmp_path: Path) -> None:
    """`--markdown` prints the README's table: one column per database."""
    result = small_run(CliRunner(), tmp_path / "m.db", "--markdown", sizes="1", runs=1)
    header = next(line for line in result.output.splitlines() if line.startswith("| figure"))
    assert header.count("| sqlite ") == 2
    assert "full_sync=on |" in header and header.endswith("full_sync=off |")


_GOODBYES = {
    # A COM_QUERY of "SELECT 1" (sequence 0), then COM_QUIT: no answer comes to it.
    "mysql": b"\x09\x00\x00\x00\x03SELECT 1" + b"\x01\x00\x00\x00\x01",
    # A startup message (protocol 3.0, no parameters), a simple Query, then Terminate.
    "postgresql": (
        b"\x00\x00\x00\x09\x00\x03\x00\x00\x00"
        + b"Q\x00\x00\x00\x0dSELECT 1\x00"
        + b"X\x00\x00\x00\x04"
    ),
}


@pytest.mark.parametrize("wire", sorted(_GOODBYES))
def test_a_client_saying_goodbye_is_no_round_trip(wire: str) -> None:
    """The proxy counts what a client waits on: one query, not the goodbye that closes the
    connection (MySQL's COM_QUIT, PostgreSQL's Terminate), which nothing answers. Counted, a
    closed store's goodbye read late on a loaded machine landed in the next operation's count
    (`tests/commit/test_rtt_counts.py`: an open of 14 round trips against 13)."""
    from cronoq_store.bench.proxy import Proxy

    sent = _GOODBYES[wire]
    received = bytearray()
    with socket.create_server(("127.0.0.1", 0)) as server:

        def sink() -> None:
            conn, _ = server.accept()
            with conn:
                while data := conn.recv(4096):
                    received.extend(data)

        reader = threading.Thread(target=sink, daemon=True)
        reader.start()
        with Proxy(server.getsockname()[:2], protocol=wire) as proxy:
            with socket.create_connection(("127.0.0.1", proxy.port)) as client:
                client.sendall(sent)
            reader.join(timeout=10)
            assert bytes(received) == sent  # forwarded whole: every byte was read and counted
            assert proxy.count == 1
