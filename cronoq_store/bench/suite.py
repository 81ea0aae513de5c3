"""The whole bench: every figure on one database, every database in turn.

Above the rooms that measure (`runner`'s `Bench`, `leader`, `inbox`), which know nothing of
each other's order or of the run as a whole.
"""

from __future__ import annotations

from collections.abc import Sequence

import click

from .inbox import inbox_figures
from .leader import leader_commit
from .results import BenchResult, DatabaseResult, Target
from .runner import Bench
from .targets import raw_database
from .workload import DEFAULT_BATCH_SIZES, DEFAULT_RUNS, DEFAULT_TASKS

__all__ = ["bench_database", "run_bench"]


def bench_database(
    target: Target,
    *,
    tasks: int = DEFAULT_TASKS,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    runs: int = DEFAULT_RUNS,
) -> DatabaseResult:
    """Every figure on one target (whose store must not be in use)."""
    with raw_database(target) as raw_url:
        b = Bench(target, raw_url, tasks=tasks, batch_sizes=batch_sizes, runs=runs)
        click.echo(f"{b.label}:", err=True)
        try:
            b.throughput()
            leader_commit(b)
            b.recovery()
            b.prune()
            inbox_figures(b)
        finally:
            b.close()
    return DatabaseResult(
        label=b.label,
        dialect=target.dialect,
        url=target.url.render_as_string(hide_password=True),
        figures=tuple(b.figures),
    )


def run_bench(
    targets: Sequence[Target],
    *,
    tasks: int = DEFAULT_TASKS,
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    runs: int = DEFAULT_RUNS,
) -> BenchResult:
    """Benchmark every target, one after the other."""
    return BenchResult(
        tasks=tasks,
        runs=runs,
        batch_sizes=tuple(batch_sizes),
        databases=tuple(
            bench_database(t, tasks=tasks, batch_sizes=batch_sizes, runs=runs) for t in targets
        ),
    )
