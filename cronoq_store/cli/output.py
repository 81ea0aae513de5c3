r"""How commands print: rich tables for people, JSON for scripts; durations and schemas read
from the command line.

Task fields are written by whoever can enqueue, and printed on an operator's terminal, where
an escape sequence is an instruction: it can forge or hide lines, draw a fake hyperlink (OSC
8), set the title, or write the clipboard (OSC 52). So nothing the CLI prints reaches the
terminal raw: every command runs with `visible_streams`, which shows each control character
(C0 but the line feed, DEL, C1, the bidirectional overrides) as an escape such as `\x1b`,
whoever wrote it (a table, a line, an error message). Inside a value a line feed is data, not
layout: `visible` shows it as `\n` too, where values become text (`cells`, `field_lines`).
Rich never reads markup in a value (`[red]` prints as it is), and prints no styles of its own.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Final, TextIO

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..errors import InvalidValue
from ..schema import check_schema_name

_CONTROLS: Final = (*range(0x20), 0x7F, *range(0x80, 0xA0))
_BIDI: Final = (0x200E, 0x200F, 0x2028, 0x2029, *range(0x202A, 0x202F), *range(0x2066, 0x206A))
ESCAPES: Final[dict[int, str]] = {
    **{c: f"\\x{c:02x}" for c in _CONTROLS},
    **{c: f"\\u{c:04x}" for c in _BIDI},
    0x09: "\\t",
    0x0A: "\\n",
    0x0D: "\\r",
}
"""What `visible` writes for each character a terminal would act on instead of showing."""
LINE_ESCAPES: Final = {c: e for c, e in ESCAPES.items() if c != 0x0A}
"""`ESCAPES` but the line feed: what `visible_streams` leaves of the CLI's own layout."""
JSON_ESCAPES: Final = {c: f"\\u{c:04x}" for c in (0x7F, *range(0x80, 0xA0), *_BIDI)}
"""What `json.dumps` leaves raw that a terminal acts on, as JSON's own escapes."""


def visible(text: str) -> str:
    r"""`text` with every control character shown as an escape (`\x1b`, `\n`, `\u202e`)."""
    return text.translate(ESCAPES)


class VisibleWriter(io.TextIOBase):
    """A text stream that shows control characters (`LINE_ESCAPES`) and writes the rest to
    `inner`: what `visible_streams` puts in place of stdout and stderr."""

    def __init__(self, inner: TextIO) -> None:
        super().__init__()
        self.inner = inner

    def write(self, text: str) -> int:
        if not isinstance(text, str):  # click tells text from binary streams this way
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        self.inner.write(text.translate(LINE_ESCAPES))
        return len(text)

    def flush(self) -> None:
        self.inner.flush()

    def isatty(self) -> bool:
        return self.inner.isatty()

    def fileno(self) -> int:
        return self.inner.fileno()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.inner, "encoding", None) or "utf-8"

    @property
    def errors(self) -> str:  # type: ignore[override]
        return getattr(self.inner, "errors", None) or "strict"


@contextlib.contextmanager
def visible_streams() -> Iterator[None]:
    """Within the block, stdout and stderr show control characters instead of sending them
    (`VisibleWriter`): the one gate every command's output passes (`CronoqGroup.main`)."""
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = VisibleWriter(out), VisibleWriter(err)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        sys.stdout, sys.stderr = out, err


def console(*, stderr: bool = False) -> Console:
    """A console on the current stdout (or stderr), without guessed highlighting, and without
    styles (escape sequences `visible_streams` would show as text).

    Piped into a file or another program, tables get 160 columns rather than rich's 80, so
    they are not squeezed (COLUMNS still wins).
    """
    stream = sys.stderr if stderr else sys.stdout
    wide = stream.isatty() or "COLUMNS" in os.environ
    return Console(stderr=stderr, highlight=False, color_system=None, width=None if wide else 160)


def progress_console() -> Console:
    """A console on stderr past `visible_streams`' gate, for a progress bar: it redraws with
    control codes, and shows only the CLI's own text (counts, never a task's field)."""
    stream = sys.stderr
    inner: TextIO = stream.inner if isinstance(stream, VisibleWriter) else stream
    return Console(file=inner, highlight=False)


def print_table(out: Console, grid: Table) -> None:
    """`grid` without the spaces rich pads its last column with (lines end in text)."""
    with out.capture() as captured:
        out.print(grid)
    click.echo("\n".join(line.rstrip() for line in captured.get().splitlines()))


def echo_json(data: object) -> None:
    """`data` as indented JSON on stdout: exact, and nothing in it a terminal acts on (JSON
    escapes C0 itself; DEL, C1 and the bidirectional overrides get `\\u` escapes here)."""
    click.echo(json.dumps(data, indent=2, ensure_ascii=False).translate(JSON_ESCAPES))


def cells(*values: object) -> list[Text]:
    """Table cells as plain text: a pool named "[red]x" is shown, not taken for markup, and
    control characters, line feeds included, are shown as escapes (`visible`)."""
    return [Text("" if v is None else visible(str(v))) for v in values]


def field_lines(fields: Iterable[tuple[str, object]]) -> list[str]:
    """`name  value` lines, names aligned, None as "-", each value one line (`visible`)."""
    pairs = list(fields)
    width = max((len(name) for name, _ in pairs), default=0)
    return [
        f"{name:<{width}}  {'-' if value is None else visible(str(value))}" for name, value in pairs
    ]


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
