"""The dashboard's charts: SVG drawn on the server from numbers, no script and no CDN.

Everything drawn is a number or one of the fixed status names, and the markup is built here
from them alone (task data never reaches a chart), so the SVG is safe to embed as it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from markupsafe import Markup

FINISHED_STATUSES: Final = ("succeeded", "failed", "cancelled", "expired", "skipped")
"""Stacked bottom to top; the colours are the stylesheet's (`.bar-succeeded`, ...)."""

WIDTH: Final = 720
HEIGHT: Final = 150
LEFT: Final = 44
BOTTOM: Final = 18


def _nice(top: int) -> int:
    """A round axis maximum at or above `top` (1, 2, 5 times a power of ten)."""
    step = 1
    while True:
        for m in (1, 2, 5):
            if m * step >= top:
                return m * step
        step *= 10


def activity_svg(
    *,
    chart_id: str,
    title: str,
    minutes: int,
    submitted: Sequence[int],
    finished: Mapping[str, Sequence[int]],
    span_label: str,
) -> Markup:
    """Finishes per minute as bars stacked by status, submissions per minute as a line, over
    the last `minutes` minutes (the last bar is the current minute)."""
    totals = [sum(finished[s][i] for s in FINISHED_STATUSES) for i in range(minutes)]
    top = _nice(max([1, *totals, *submitted]))
    plot_w, plot_h = WIDTH - LEFT - 4, HEIGHT - BOTTOM - 6
    bar = plot_w / minutes

    def y(value: float) -> float:
        return 6 + plot_h - plot_h * value / top

    parts = [
        f'<svg id="{chart_id}" class="chart" role="img" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'width="{WIDTH}" height="{HEIGHT}" xmlns="http://www.w3.org/2000/svg">',
        f"<title>{title}</title>",
        f'<line class="axis" x1="{LEFT}" y1="{y(0):.1f}" x2="{WIDTH - 4}" y2="{y(0):.1f}"/>',
        f'<line class="grid" x1="{LEFT}" y1="{y(top):.1f}" x2="{WIDTH - 4}" y2="{y(top):.1f}"/>',
        f'<text class="tick" x="{LEFT - 4}" y="{y(top) + 4:.1f}" text-anchor="end">{top}</text>',
        f'<text class="tick" x="{LEFT - 4}" y="{y(0) + 4:.1f}" text-anchor="end">0</text>',
        f'<text class="tick" x="{LEFT}" y="{HEIGHT - 4}">{span_label}</text>',
        f'<text class="tick" x="{WIDTH - 4}" y="{HEIGHT - 4}" text-anchor="end">now</text>',
    ]
    for i in range(minutes):
        base = 0
        for status in FINISHED_STATUSES:
            n = finished[status][i]
            if not n:
                continue
            x = LEFT + i * bar
            parts.append(
                f'<rect class="bar-{status}" x="{x:.2f}" y="{y(base + n):.2f}" '
                f'width="{max(bar - 0.3, 0.4):.2f}" height="{y(base) - y(base + n):.2f}">'
                f"<title>{n} {status}</title></rect>"
            )
            base += n
    points = " ".join(f"{LEFT + (i + 0.5) * bar:.1f},{y(n):.1f}" for i, n in enumerate(submitted))
    parts.append(f'<polyline class="submitted" points="{points}"/>')
    parts.append("</svg>")
    return Markup("".join(parts))  # numbers and fixed names only: nothing to escape
