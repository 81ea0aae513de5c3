"""The Python examples of README.md and docs/*.md run as written, each in an empty temp dir.

Every README block stands alone. A page of docs/ is one story: its blocks run in order in one
namespace, so a later block may use what an earlier one made (as a reader would type them).
Only blocks fenced ```python run; shell and ini examples are fenced as such.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
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
def test_docs_examples_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CRONOQ_DATABASE_URL", raising=False)
    monkeypatch.delenv("CRONOQ_SCHEMA", raising=False)
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    for i, code in enumerate(python_blocks(page)):
        exec(compile(code, f"{page}:block{i}", "exec"), namespace)
