"""Output: the figures as a terminal table, a Markdown table (the README's) and a plot."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Final

import click

from .results import BenchResult, Figure


def _fmt(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value:.3f} s"
    if unit == "bytes":
        return f"{value / 2**20:.1f} MiB"
    if unit in ("ms/commit", "ms"):
        return f"{value:.3f} ms"
    return f"{value:,.0f} /s"


METRIC_NAMES: Final = {
    "submit": "submit",
    "transition": "transition",
    "submit_cpu": "submit CPU/commit",
    "transition_cpu": "transition CPU/commit",
    "recover": "recover time",
    "recover_memory": "recover peak mem",
    "prune": "prune",
    "leader_commit": "leader commit",
    "leader_cpu": "leader CPU/commit",
    "leader_p50": "leader latency p50",
    "leader_p99": "leader latency p99",
    "enqueue": "inbox enqueue",
    "drain": "inbox drain",
}


def _goal_text(f: Figure) -> str:
    if f.goal is None:
        return ""
    if f.excess is not None:
        return f"≤ raw + {f.goal} ms"
    return ("≥ " if f.higher_is_better else "≤ ") + f"{f.goal}x"


def _ratio_text(f: Figure) -> str:
    if f.excess is not None:
        return f"{f.excess:+.3f} ms"
    if f.ratio_min is None or f.ratio_max is None or f.samples < 2:
        return f"{f.ratio:.2f}x"
    return f"{f.ratio:.2f}x ({f.ratio_min:.2f}-{f.ratio_max:.2f})"


def print_table(result: BenchResult, file: Any = None) -> None:
    """The figures as a table on the terminal."""
    from rich.console import Console
    from rich.table import Table as RichTable

    # No styles: `cronoq-store` shows escape sequences as text (cli.output.visible_streams).
    console = Console(file=file or sys.stdout, width=150, color_system=None)
    table = RichTable(
        title=f"cronoq-store bench: {result.tasks} tasks, median of {result.runs} pairs",
        caption="ratio = store / raw, median of the per-pair ratios (min-max); "
        "memory: peak / size of the result; CPU: store minus raw",
    )
    columns = ("database", "figure", "batch", "store", "raw", "ratio (min-max)", "goal", "met")
    for name in columns:
        table.add_column(name, justify="left" if name in ("database", "figure") else "right")
    for db in result.databases:
        for f in db.figures:
            raw = "result " + _fmt(f.raw, f.unit) if f.metric == "recover_memory" else None
            met = {None: "", True: "[green]yes[/]", False: "[red]no[/]"}[f.met]
            table.add_row(
                db.label,
                METRIC_NAMES[f.metric],
                "" if f.batch_size is None else str(f.batch_size),
                _fmt(f.store, f.unit),
                (raw or _fmt(f.raw, f.unit)) + (f" {f.baseline}" if f.baseline else ""),
                _ratio_text(f),
                _goal_text(f),
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
            # The main raw baseline (the first measured) against the store.
            main = next((f.baseline for f in db.figures if f.metric == metric), "")
            figs = [f for f in db.figures if f.metric == metric and f.baseline == main]
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


_MARKDOWN_ROWS: Final = (
    ("submit", 1000, "submissions, batch 1000"),
    ("transition", 1000, "transitions, batch 1000"),
    ("submit", 1, "submissions, batch 1"),
    ("submit_cpu", 1, "batch 1, CPU per submit commit"),
    ("transition_cpu", 1, "batch 1, CPU per transition commit"),
    ("recover", None, "recovery of the live tasks"),
    ("recover_memory", None, "recovery peak memory / result"),
    ("prune", None, "prune, batch 1000"),
    ("leader_commit", 1, "leader commit, batch 1, vs a fenced hand-written client"),
    ("leader_cpu", 1, "batch 1, CPU per leader commit"),
    ("leader_p50", 1, "batch 1, leader commit latency p50"),
    ("leader_p99", 1, "batch 1, leader commit latency p99"),
    ("enqueue", 1, "inbox: enqueue 1 in the app's transaction"),
    ("enqueue", 100, "inbox: enqueue_many 100 in the app's transaction"),
    ("drain", None, "inbox: drain (read_inbox + commit) of 1000"),
)


def _markdown_cell(f: Figure) -> str:
    mark = {None: "", True: " ✓", False: " ✗"}[f.met]
    spread = ""
    if f.ratio_min is not None and f.ratio_max is not None and f.samples > 1:
        spread = f" {f.ratio_min:.2f}-{f.ratio_max:.2f}"
    if f.excess is not None:
        return f"{f.store:.3f} ms vs {f.raw:.3f} ms ({f.excess:+.3f} ms){mark}"
    if f.metric == "recover_memory":
        return f"{f.ratio:.2f}x of {_fmt(f.raw, f.unit)}{mark}"
    base = f" {f.baseline}" if f.baseline else ""
    if f.unit == "ms":  # a latency: both sides', the ratio beside them
        return f"{f.store:.3f} ms vs {f.raw:.3f} ms (**{f.ratio:.2f}x**{spread})"
    unit = "s" if f.unit == "s" else f.unit
    value = f"{f.store:.2f} s" if f.unit == "s" else f"{f.store:,.0f} {unit}"
    return f"{value} (**{f.ratio:.2f}x**{base}{spread}){mark}"


def markdown_table(result: BenchResult) -> str:
    """The headline figures as the README's Markdown table: one column per database, each
    cell the store's figure, the median ratio to the raw baseline named, its spread
    (min-max over the pairs) and whether the project's goal is met."""
    labels = [db.label for db in result.databases]
    lines = [
        "| figure | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    for metric, batch, title in _MARKDOWN_ROWS:
        cells = []
        for db in result.databases:
            figs = [
                f
                for f in db.figures
                if f.metric == metric and (batch is None or f.batch_size == batch)
            ]
            cells.append("<br>".join(_markdown_cell(f) for f in figs))
        if any(cells):
            lines.append(f"| {title} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
