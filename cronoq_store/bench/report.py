"""Output: the figures as a terminal table and as a plot."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Final

import click

from .results import BenchResult

# Output.


def _fmt(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value:.3f} s"
    if unit == "bytes":
        return f"{value / 2**20:.1f} MiB"
    return f"{value:,.0f} /s"


METRIC_NAMES: Final = {
    "submit": "submit",
    "transition": "transition",
    "recover": "recover time",
    "recover_memory": "recover peak mem",
    "prune": "prune",
}


def print_table(result: BenchResult, file: Any = None) -> None:
    """The figures as a table on the terminal."""
    from rich.console import Console
    from rich.table import Table as RichTable

    console = Console(file=file or sys.stdout, width=120)
    table = RichTable(
        title=f"cronoq-store bench: {result.tasks} tasks, median of {result.runs}",
        caption="ratio = store / raw (memory: peak / size of the result)",
    )
    for name in ("database", "figure", "batch", "store", "raw", "ratio", "goal", "met"):
        table.add_column(name, justify="left" if name in ("database", "figure") else "right")
    for db in result.databases:
        for f in db.figures:
            raw = "result " + _fmt(f.raw, f.unit) if f.metric == "recover_memory" else None
            goal = "" if f.goal is None else ("≥ " if f.higher_is_better else "≤ ") + f"{f.goal}"
            met = {None: "", True: "[green]yes[/]", False: "[red]no[/]"}[f.met]
            table.add_row(
                db.label,
                METRIC_NAMES[f.metric],
                "" if f.batch_size is None else str(f.batch_size),
                _fmt(f.store, f.unit),
                raw or _fmt(f.raw, f.unit),
                f"{f.ratio:.2f}x",
                goal,
                met,
            )
        table.add_section()
    console.print(table)


def plot(result: BenchResult, path: Path) -> None:
    """Throughput against batch size, one panel per database (needs the `plot` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise click.ClickException(
            "--plot needs matplotlib: pip install 'cronoq-store[plot]'"
        ) from exc
    count = len(result.databases)
    fig, axes = plt.subplots(1, count, figsize=(5 * count, 4), squeeze=False)
    for ax, db in zip(axes[0], result.databases, strict=True):
        for metric, color in (("submit", "tab:blue"), ("transition", "tab:orange")):
            figs = [f for f in db.figures if f.metric == metric]
            sizes = [f.batch_size for f in figs]
            ax.plot(sizes, [f.store for f in figs], "o-", color=color, label=f"{metric} store")
            ax.plot(sizes, [f.raw for f in figs], "s--", color=color, label=f"{metric} raw")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(db.label)
        ax.set_xlabel("batch size (rows per commit)")
        ax.set_ylabel("rows/s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
