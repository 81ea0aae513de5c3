"""The Python examples of README.md and docs/*.md run as written, each in an empty temp dir.

Every README block stands alone. A page of docs/ is one story: its blocks run in order in one
namespace, so a later block may use what an earlier one made (as a reader would type them).
Only blocks fenced ```python run; shell and ini examples are fenced as such.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from inspect import signature
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
_BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)


def python_blocks(page: Path) -> list[str]:
    """The ```python blocks of `page`, in order."""
    return _BLOCK.findall(page.read_text(encoding="utf-8"))


BLOCKS = python_blocks(README)


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(README), "exec"), {})


def test_docs_have_examples() -> None:
    assert DOCS, "docs/ has no pages"
    assert sum(len(python_blocks(page)) for page in DOCS) >= 5


@pytest.mark.parametrize("page", DOCS, ids=[page.stem for page in DOCS])
def test_docs_examples_run(page: Path, empty_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CRONOQ_SCHEMA", raising=False)
    blocks = python_blocks(page)
    if any("set_meter_provider" in code for code in blocks):
        # OpenTelemetry takes one global provider per process: a page that sets one runs in
        # a process of its own, so it neither fails nor spoils the telemetry tests.
        script = empty_dir / f"{page.stem}.py"
        script.write_text("\n".join(blocks), encoding="utf-8")
        ran = subprocess.run(
            [sys.executable, str(script)],
            cwd=empty_dir,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert ran.returncode == 0, ran.stderr
        return
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"{page}:block{i}", "exec"), namespace)


# The CLI transcripts: every ```console block runs, and its output must match.
#
# A block is a sequence of `$ cronoq-store ARGS` lines, each followed by the output expected.
# The blocks of a page run in order in one empty directory, as a reader would type them; a
# `<!-- setup ... -->` comment right before a block holds Python that makes the data the block
# shows (it runs in the page's namespace). Only what varies from run to run is normalised:
# times, lease holders, seconds left on a lease, an inbox item's age, database sizes, and the
# spaces and rules of tables; `...` in an expected line matches anything. Revisions are
# compared as they are, so a new migration that the docs do not show fails here.

_CONSOLE = re.compile(
    r"(?:^<!-- setup\n(?P<setup>.*?)^-->\n)?^```console\n(?P<body>.*?)^```",
    flags=re.DOTALL | re.MULTILINE,
)
_VARIABLE = [
    (re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z"), "<time>"),
    (re.compile(r"[\w.-]+:\d+:[0-9a-f]{16}"), "<holder>"),
    (re.compile(r"expires in -?\d+\.\d s"), "expires in <s> s"),
    (re.compile(r"oldest [\d.e+-]+ s old"), "oldest <s> s old"),
    (re.compile(r"^size(\s+).*$", flags=re.MULTILINE), "size <size>"),
    (re.compile(r"─+"), "─"),
    (re.compile(r"[ \t]+"), " "),
]


def console_blocks(page: Path) -> list[tuple[str, str]]:
    """The (setup, body) of each ```console block of `page`, in order."""
    text = page.read_text(encoding="utf-8")
    return [(m["setup"] or "", m["body"]) for m in _CONSOLE.finditer(text)]


def normalised(text: str) -> list[str]:
    for pattern, replacement in _VARIABLE:
        text = pattern.sub(replacement, text)
    return [line.strip() for line in text.strip().splitlines()]


def transcript(body: str) -> list[tuple[str, str]]:
    """The (command line, expected output) pairs of one console block."""
    steps: list[tuple[str, str]] = []
    for line in body.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], ""))
        else:
            assert steps, f"output before any command: {line!r}"
            steps[-1] = (steps[-1][0], steps[-1][1] + line + "\n")
    return steps


def matches(expected: list[str], actual: list[str]) -> bool:
    if len(expected) != len(actual):
        return False
    for want, got in zip(expected, actual, strict=True):
        pattern = ".*".join(re.escape(part) for part in want.split("..."))
        if not re.fullmatch(pattern, got):
            return False
    return True


CONSOLE_PAGES = [page for page in [README, *DOCS] if console_blocks(page)]


def test_docs_have_cli_transcripts() -> None:
    assert sum(len(console_blocks(page)) for page in CONSOLE_PAGES) >= 8


@pytest.mark.parametrize("page", CONSOLE_PAGES, ids=[page.stem for page in CONSOLE_PAGES])
def test_cli_transcripts_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from cronoq_store.cli import main

    # stdout and stderr apart: click 8.2 always, 8.1 (the floor) when asked
    apart = {"mix_stderr": False} if "mix_stderr" in signature(CliRunner).parameters else {}
    monkeypatch.chdir(tmp_path)
    for name in ("CRONOQ_DATABASE_URL", "CRONOQ_SCHEMA", "COLUMNS"):
        monkeypatch.delenv(name, raising=False)
    namespace: dict[str, object] = {"__name__": f"console_{page.stem}"}
    for i, (setup, body) in enumerate(console_blocks(page)):
        if setup:
            exec(compile(setup, f"{page}:console{i}:setup", "exec"), namespace)
        for command, expected in transcript(body):
            argv = shlex.split(command)
            assert argv[0] == "cronoq-store", command
            answers = "".join(
                line.rsplit("]: ", 1)[1] + "\n"
                for line in expected.splitlines()
                if re.search(r"\[y/N\]: \S+$", line)
            )
            result = CliRunner(**apart).invoke(main, argv[1:], input=answers or None)
            assert result.exception is None or isinstance(result.exception, SystemExit), (
                command,
                result.exc_info,
            )
            failed = re.search(r"^(Error|Usage):", expected, flags=re.MULTILINE) is not None
            assert (result.exit_code != 0) == failed, (
                command,
                result.output,
            )
            # What a reader sees of a command that worked is its stdout (a progress bar on
            # stderr is not shown); of one that failed, its stdout and then the error.
            shown = result.stdout + (result.stderr if failed else "")
            assert matches(normalised(expected), normalised(shown)), (
                f"{page.name}: `{command}` printed\n{shown}\nbut the page shows\n{expected}"
            )


def test_every_cli_transcript_is_run() -> None:
    """A `$ cronoq-store` line outside a ```console block would not be checked: none exists."""
    other = re.compile(r"^```(?!console)\w*\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)
    for page in [README, *DOCS]:
        for block in other.findall(page.read_text(encoding="utf-8")):
            assert not re.search(r"^\$ cronoq-store", block, flags=re.MULTILINE), (page, block)
