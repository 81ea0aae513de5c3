"""What the fault drills share: the figures they gather, shown at the end of the run (conftest.py's
summary), and how many rounds they run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

FIGURES: dict[str, tuple[dict[str, Any], Path | None]] = {}
"""Figures the fault tests gather, by section title: shown at the end of the run, and written
as JSON to the path beside them (when there is one)."""


def figures(title: str, path: Path | None = None) -> dict[str, Any]:
    """The figures of section `title`, one line a key in the run's summary; a test module adds
    to them as it goes, and they are written to `path` (as JSON) at the end of the run."""
    return FIGURES.setdefault(title, ({}, path))[0]


def rounds(quick: int, soak: int, *quick_marks: pytest.MarkDecorator) -> list[Any]:
    """A drill's round counts, to parametrize `rounds` with: `quick` in every run (with
    `quick_marks`), `soak` only under `--soak` (for half an hour at most)."""
    return [
        pytest.param(quick, marks=quick_marks, id=f"x{quick}"),
        pytest.param(soak, marks=(pytest.mark.soak, pytest.mark.timeout(1800)), id=f"soak-x{soak}"),
    ]
