"""`cronoq-store bench`: the store beside the raw driver, on the same rows, in the same run.

Every figure is measured through `SqlStore` and through the bare DB-API driver (sqlite3,
psycopg, PyMySQL) writing the same row values into same-shaped tables (`bench_raw_tasks`,
`bench_raw_task_deps`). Absolute numbers depend on the machine; the ratio of the two, measured
side by side, is what says what the store costs.

The package, one room per role:

- `workload`: the realistic specs both sides are handed, and the run's sizes;
- `raw`: the raw-driver baselines (tables, compiled statements, what each figure runs);
- `runner`: both sides measured in turns, and the ratios;
- `suite`: every figure on one database, every database in turn;
- `inbox`: the inbox rows (the app's enqueue, the leader's drain) beside the raw driver;
- `targets`: which databases to run on (SQLite temp files, scratch server databases, URLs);
- `results`: the figures, their JSON form and the project's goals;
- `report`: the terminal table and the plot;
- `command`: the `cronoq-store bench` command line.
"""

from __future__ import annotations

from .command import bench
from .raw import Baseline, RawDriver, baselines, raw_tables
from .report import METRIC_NAMES, markdown_table, plot, print_table
from .results import METRICS, BenchResult, DatabaseResult, Figure, Metric, Target
from .suite import bench_database, run_bench
from .targets import SERVER_URLS, raw_database, resolve_targets, scratch_database
from .workload import (
    DEFAULT_BATCH_SIZES,
    DEFAULT_RUNS,
    DEFAULT_TASKS,
    MIN_COMMITS,
    MIN_ROWS,
    PAYLOAD_BYTES,
    POPULATE_BATCH,
    Workload,
)

__all__ = [
    "DEFAULT_BATCH_SIZES",
    "DEFAULT_RUNS",
    "DEFAULT_TASKS",
    "METRICS",
    "METRIC_NAMES",
    "MIN_COMMITS",
    "MIN_ROWS",
    "PAYLOAD_BYTES",
    "POPULATE_BATCH",
    "SERVER_URLS",
    "Baseline",
    "BenchResult",
    "DatabaseResult",
    "Figure",
    "Metric",
    "RawDriver",
    "Target",
    "Workload",
    "baselines",
    "bench",
    "bench_database",
    "markdown_table",
    "plot",
    "print_table",
    "raw_database",
    "raw_tables",
    "resolve_targets",
    "run_bench",
    "scratch_database",
]
