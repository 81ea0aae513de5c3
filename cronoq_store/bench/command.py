"""The `cronoq-store bench` command line."""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path

import click

from .. import dialects
from .bloat import as_rows, run_bloat
from .history import history_command
from .report import markdown_table, plot, print_table
from .rtt import markdown, measure
from .suite import run_bench
from .targets import raw_database, resolve_targets
from .workload import DEFAULT_BATCH_SIZES, DEFAULT_RUNS, DEFAULT_TASKS


def _sizes(_ctx: click.Context, _param: click.Parameter, value: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError as exc:
        raise click.BadParameter("a comma-separated list of integers") from exc
    if not sizes or min(sizes) < 1:
        raise click.BadParameter("batch sizes must be positive")
    return sizes


@click.command("bench")
@click.option(
    "--url",
    "urls",
    multiple=True,
    help="database URL or SQLite path (repeatable); its store must hold no tasks",
)
@click.option(
    "--dialect",
    "dialect_names",
    multiple=True,
    type=click.Choice(["sqlite", "postgresql", "mysql", "all"]),
    help="a SQLite temp file, or a scratch database on the server of "
    "CRONOQ_BENCH_POSTGRESQL_URL / CRONOQ_BENCH_MYSQL_URL (repeatable)",
)
@click.option("-n", "--tasks", default=DEFAULT_TASKS, show_default=True, help="tasks recovered")
@click.option(
    "--batch-sizes",
    default=",".join(map(str, DEFAULT_BATCH_SIZES)),
    show_default=True,
    callback=_sizes,
    help="rows per commit",
)
@click.option(
    "--runs",
    default=DEFAULT_RUNS,
    show_default=True,
    help="pairs (store, raw) per figure; figures are medians of the per-pair ratios",
)
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
@click.option(
    "--markdown",
    "as_markdown",
    is_flag=True,
    help="print the README's Markdown table instead of a table",
)
@click.option(
    "--bloat",
    "bloat_cycles",
    type=click.IntRange(1, 1000),
    help="instead: CYCLES cycles of -n tasks through running and succeeded, each pruned; "
    "table sizes, commit rate and PostgreSQL's HOT share per cycle",
)
@click.option(
    "--history",
    "history_sizes",
    callback=lambda ctx, param, v: None if v is None else _sizes(ctx, param, v),
    help="instead: recovery of 10,000 live tasks, batch-1000 commits and prune with N "
    "(comma-separated: each N in turn) old finished tasks in the table, against 10,000",
)
@click.option(
    "--rtt",
    "rtt_ms",
    type=click.FloatRange(0, 10_000),
    help="instead: round trips per operation (counted, and timed in RTTs) through a proxy "
    "that adds MS milliseconds of round trip, in front of both the store and the raw driver",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="write a PNG of throughput against batch size (needs the plot extra)",
)
def bench(
    urls: tuple[str, ...],
    dialect_names: tuple[str, ...],
    tasks: int,
    batch_sizes: tuple[int, ...],
    runs: int,
    as_json: bool,
    as_markdown: bool,
    bloat_cycles: int | None,
    history_sizes: tuple[int, ...] | None,
    rtt_ms: float | None,
    plot_path: Path | None,
) -> None:
    """Measure the store beside the raw driver: commits, recovery, prune."""
    if tasks < 1 or runs < 1:
        raise click.BadParameter("--tasks and --runs must be positive")
    if threading.current_thread() is threading.main_thread():
        # Terminated: unwind, so scratch databases and raw tables are dropped.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if bloat_cycles is not None:
        _bloat(urls, dialect_names, bloat_cycles, tasks, as_json)
        return
    if history_sizes is not None:
        history_command(urls, dialect_names, history_sizes, runs, as_json)
        return
    if rtt_ms is not None:
        _rtt(urls, dialect_names, rtt_ms, runs, as_json)
        return
    with resolve_targets(urls, dialect_names) as targets:
        result = run_bench(targets, tasks=tasks, batch_sizes=batch_sizes, runs=runs)
    if as_json:
        click.echo(json.dumps(result.as_dict(), indent=2))
    elif as_markdown:
        click.echo(markdown_table(result), nl=False)
    else:
        print_table(result)
    if plot_path is not None:
        plot(result, plot_path)
        click.echo(f"plot written to {plot_path}", err=True)


def _bloat(
    urls: tuple[str, ...], dialect_names: tuple[str, ...], cycles: int, tasks: int, as_json: bool
) -> None:
    """`--bloat`: the cycles on each target, one line (or JSON object) per cycle."""
    results: dict[str, list[dict[str, object]]] = {}
    with resolve_targets(urls, dialect_names) as targets:
        for target in targets:
            if not target.full_sync:
                continue  # SQLite's two sync settings make the same file sizes
            name = target.url.get_backend_name()
            rows = results.setdefault(name, [])
            for cycle in run_bloat(target.url, cycles=cycles, tasks=tasks):
                rows.append(as_rows([cycle])[0])
                if not as_json:
                    hot = (
                        ""
                        if cycle.live_hot is None
                        else f", live transitions HOT {cycle.live_hot:.0%}"
                    )
                    click.echo(
                        f"{name} cycle {cycle.cycle}: {cycle.size_mib} MiB, "
                        f"{cycle.commits_per_s} commits/s{hot}"
                    )
    if as_json:
        click.echo(json.dumps(results, indent=2))


def _rtt(
    urls: tuple[str, ...], dialect_names: tuple[str, ...], rtt_ms: float, runs: int, as_json: bool
) -> None:
    """`--rtt`: `rtt.measure` on each server target (SQLite has no wire: skipped)."""
    results = []
    names = dialect_names if dialect_names or urls else ("postgresql",)
    with resolve_targets(urls, names) as targets:
        for target in targets:
            if not dialects.class_of(target.dialect).server:
                if target.full_sync:
                    click.echo("sqlite: no wire, no round trips; skipped", err=True)
                continue
            with raw_database(target) as raw_url:
                result = measure(target.url, raw_url, rtt_ms=rtt_ms, repeats=max(runs, 3))
            results.append(result)
            if not as_json:
                click.echo(markdown(result))
    if as_json:
        click.echo(json.dumps([r.as_dict() for r in results], indent=2))
