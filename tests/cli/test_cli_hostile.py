"""Task fields anyone who can enqueue controls, printed on an operator's terminal: every
control character shows as an escape, none is sent (`cli.output.visible_streams`), and rich
markup in a value prints as it is. On every dialect, through the real commands.
"""

from __future__ import annotations

import io
import json
import re
import sys

import builders
import pytest
from builders import BASE
from click.testing import CliRunner, Result
from sqlalchemy import URL

from cronoq_store import SqlStore, StatusChanged, TaskSpec, TaskStatus, enqueue
from cronoq_store.cli import main
from cronoq_store.cli.output import (
    VisibleWriter,
    console,
    progress_console,
    visible,
    visible_streams,
)

OSC8 = "\x1b]8;;https://evil.example/\x1b\\click me\x1b]8;;\x1b\\"
"""A hyperlink whose text hides where it goes."""
OSC52 = "\x1b]52;c;cm0gLXJmIH4=\x07"
"""Writes "rm -rf ~" to the clipboard."""
TITLE = "\x1b]0;pwned\x07"
FORGED = "\rstatus     succeeded\n"
"""A carriage return and a line feed: a forged line."""
HIDDEN = "\x1b[8mhidden\x1b[0m \x1b[2J \x07 \x9b31m \u202egnp.exe"
"""Concealed text, a screen clear, BEL, an 8-bit CSI, a right-to-left override."""
MARKUP = "[red]red[/red] [link=https://evil.example]x[/link]"
EVIL = f"k {OSC8} {OSC52} {TITLE} {FORGED} {HIDDEN} {MARKUP}"
SHORT = f"p {OSC8} {FORGED} \x07 [red]red[/red]"
"""For the fields of at most 128 characters (pool)."""

RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
"""What must never reach the terminal (a line feed only as the CLI's own layout)."""


@pytest.fixture
def hostile(db_url: URL) -> str:
    """A database whose one task, one inbox item and one message are all `EVIL`."""
    with SqlStore.open(db_url) as store:
        epoch = store.acquire_leadership()
        spec = {
            "key": EVIL,
            "kind": EVIL,
            "pool": SHORT,
            "tenant": EVIL,
            "tags": frozenset({EVIL}),
            "labels": {EVIL: EVIL},
        }
        store.commit(
            epoch,
            BASE,
            [
                builders.submit(1, **spec),
                StatusChanged(id=builders.TaskId(1), status=TaskStatus.FAILED, attempt=1,
                              at=BASE.unix_ns, message=EVIL),
            ],
        )  # fmt: skip
        with store.engine.begin() as conn:
            enqueue(conn, TaskSpec(payload=b"x", key=EVIL, pool=SHORT, kind=EVIL, tenant=EVIL))
    return db_url.render_as_string(hide_password=False)


def run(url: str, *args: str) -> Result:
    wide = {"COLUMNS": "4000"}  # no folding: each value on one line of the table
    result = CliRunner(env=wide).invoke(main, ["--url", url, *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result


@pytest.mark.parametrize(
    "args",
    [("tasks",), ("show", "1"), ("show", "--by-key", EVIL), ("inbox",), ("status",)],
    ids=["tasks", "show", "show-by-key", "inbox", "status"],
)
def test_text_output_shows_controls_escaped(hostile: str, args: tuple[str, ...]) -> None:
    out = run(hostile, *args).output
    assert not RAW.search(out), repr(RAW.search(out))
    if args[0] != "status":
        assert "\\x1b]8;;https://evil.example/" in out and "\\x1b]52;c;" in out
        assert "[red]red[/red]" in out  # markup printed as it is, not applied
    if args[0] == "show":
        # The forged line is part of the key's line, not a line of its own.
        assert not any(line.startswith("status     succeeded") for line in out.splitlines())
        assert "\\rstatus     succeeded\\n" in out and "\\u202egnp.exe" in out


@pytest.mark.parametrize(
    "args", [("tasks", "--json"), ("show", "1", "--json"), ("inbox", "--json")]
)
def test_json_output_is_exact_and_inert(hostile: str, args: tuple[str, ...]) -> None:
    out = run(hostile, *args).output
    assert not RAW.search(out), repr(RAW.search(out))
    data = json.loads(out)
    found = data["tasks"][0]["key"] if "tasks" in data else data.get("key")
    if args[0] == "inbox":
        found = data["inbox"][0]["key"]
    assert found == EVIL  # scripts still get the value exactly


def test_the_gate_escapes_whatever_is_written() -> None:
    """Error messages and any future output: everything written through the gate."""
    inner = io.StringIO()
    writer = VisibleWriter(inner)  # type: ignore[arg-type]
    writer.write(f"Error: no task {EVIL}\n")
    assert not RAW.search(inner.getvalue()) and inner.getvalue().endswith("\n")
    assert visible("a\nb\x1b") == "a\\nb\\x1b"
    with pytest.raises(TypeError):
        writer.write(b"x")  # type: ignore[arg-type]


def test_progress_bar_is_the_clis_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """`prune`'s progress bar writes past the gate (its redraws are control codes of the
    CLI's own, counts only), and nothing else does."""
    inner = io.StringIO()
    monkeypatch.setattr(sys, "stderr", inner)
    with visible_streams():
        assert isinstance(sys.stderr, VisibleWriter)
        assert progress_console().file is inner
        assert console(stderr=True).file is sys.stderr
