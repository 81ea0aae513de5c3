"""How commands print: rich tables for people, JSON for scripts; durations and schemas read
from the command line."""

from __future__ import annotations

import json
import os
import re
import sys
from datetime import timedelta
from typing import Final

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..errors import InvalidValue
from ..schema import check_schema_name


def console(*, stderr: bool = False) -> Console:
    """A console on the current stdout (or stderr), without guessed highlighting.

    Piped into a file or another program, tables get 160 columns rather than rich's 80, so
    they are not squeezed (COLUMNS still wins).
    """
    stream = sys.stderr if stderr else sys.stdout
    wide = stream.isatty() or "COLUMNS" in os.environ
    return Console(stderr=stderr, highlight=False, width=None if wide else 160)


def print_table(out: Console, grid: Table) -> None:
    """`grid` without the spaces rich pads its last column with (lines end in text)."""
    with out.capture() as captured:
        out.print(grid)
    click.echo("\n".join(line.rstrip() for line in captured.get().splitlines()))


def echo_json(data: object) -> None:
    """`data` as indented JSON on stdout."""
    click.echo(json.dumps(data, indent=2, ensure_ascii=False))


def cells(*values: object) -> list[Text]:
    """Table cells as plain text: a pool named "[red]x" is shown, not taken for markup."""
    return [Text("" if v is None else str(v)) for v in values]


MESSAGE_WIDTH: Final = 40
"""A message in a table of many tasks: its start, enough to tell failures apart (`show` has
the whole)."""


def short(text: str | None, width: int = MESSAGE_WIDTH) -> str | None:
    """`text` cut to one line of at most `width` characters, ending in "…" where it was cut."""
    if text is None:
        return None
    first, newline, _ = text.strip().partition("\n")
    first = first.rstrip()
    if len(first) > width:
        return first[: width - 1] + "…"
    return f"{first} …" if newline else first


# Durations on the command line: 30s, 15m, 2h, 7d, 1w, or sums like 1h30m.

_DURATION: Final = re.compile(r"(\d+)([smhdw])")
_UNIT_S: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> timedelta:
    """A duration such as 30s, 15m, 2h, 7d, 1w or 1h30m; ValueError otherwise.

    Saturates at `timedelta.max` (about 2.7 million years): "older than 99999999999999999999d"
    means "older than anything", as the store's own bounds do.
    """
    compact = text.strip().lower().replace(" ", "")
    if not compact or _DURATION.sub("", compact):
        raise ValueError(f"{text!r} is not a duration like 30s, 15m, 2h or 7d")
    seconds = sum(int(n) * _UNIT_S[u] for n, u in _DURATION.findall(compact))
    return timedelta(seconds=seconds) if seconds < _MAX_S else timedelta.max


_MAX_S: Final = int(timedelta.max.total_seconds())


def schema_option(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Click callback: a schema name the store can use (StoreConfig's rule), or a usage error."""
    if not value:
        return None
    try:
        check_schema_name(value, "the schema")
    except InvalidValue as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc
    return value


def duration_option(ctx: click.Context, param: click.Parameter, value: str) -> timedelta:
    """Click callback: a duration option's text as a `timedelta`."""
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc), ctx, param) from exc
