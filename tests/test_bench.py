"""The benchmark in reduced form: it completes on every dialect and reports every figure.

Nothing here asserts a time or a ratio (CI machines are noisy); only that each figure is
measured, printed and in the JSON, beside the raw driver on the same rows.
"""

from __future__ import annotations

import io
import json
import math
from inspect import signature as inspect_signature
from pathlib import Path

from click.testing import CliRunner
from sqlalchemy import URL, create_engine, inspect

from cronoq_store.bench import (
    METRIC_NAMES,
    METRICS,
    BenchResult,
    Target,
    bench,
    plot,
    print_table,
    run_bench,
)

SIZES = (1, 10)
TASKS = 30


def _expected() -> set[tuple[str, int | None]]:
    figures: set[tuple[str, int | None]] = {(m, b) for m in ("submit", "transition") for b in SIZES}
    return figures | {("recover", None), ("recover_memory", None), ("prune", 1000)}


def test_bench_reports_every_figure(db_url: URL, tmp_path: Path) -> None:
    result = run_bench([Target(url=db_url)], tasks=TASKS, batch_sizes=SIZES, runs=1)
    (db,) = result.databases
    got = {(f.metric, f.batch_size) for f in db.figures}
    assert got == _expected()
    for f in db.figures:
        assert math.isfinite(f.store) and f.store > 0, f
        assert math.isfinite(f.raw) and f.raw > 0, f
        assert math.isfinite(f.ratio) and f.ratio > 0, f

    out = io.StringIO()
    print_table(result, file=out)
    table = out.getvalue()
    for name in METRIC_NAMES.values():
        assert name in table
    assert table.count(db.label) == len(db.figures)

    data = json.loads(json.dumps(result.as_dict()))
    assert {(f["metric"], f["batch_size"]) for f in data["databases"][0]["figures"]} == got
    assert BenchResult.from_dict(data) == result

    png = tmp_path / "bench.png"
    plot(result, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The raw tables are gone and the store is empty again.
    engine = create_engine(db_url)
    try:
        names = set(inspect(engine).get_table_names())
    finally:
        engine.dispose()
    assert not {n for n in names if n.startswith("bench_raw")}


def test_cli_json_covers_both_sqlite_modes(tmp_path: Path) -> None:
    """The command's default: SQLite with full_sync on and off, JSON on stdout."""
    # stdout alone: click 8.2 always captures stderr apart, 8.1 (the floor) when asked.
    separate = "mix_stderr" in inspect_signature(CliRunner).parameters
    runner = CliRunner(**({"mix_stderr": False} if separate else {}))
    result = runner.invoke(
        bench,
        [
            "-n",
            "20",
            "--batch-sizes",
            "1,10",
            "--runs",
            "1",
            "--json",
            "--url",
            str(tmp_path / "b.db"),
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    labels = [d["label"] for d in data["databases"]]
    assert [label.endswith(("full_sync=on", "full_sync=off")) for label in labels] == [True, True]
    for db in data["databases"]:
        assert {f["metric"] for f in db["figures"]} == set(METRICS)
        assert all(f["met"] in (True, False, None) for f in db["figures"])
