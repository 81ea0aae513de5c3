"""Figures the fault tests gather, shown at the end of the run (conftest.py's summary)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

FIGURES: dict[str, tuple[dict[str, Any], Path | None]] = {}
"""Figures the fault tests gather, by section title: shown at the end of the run, and written
as JSON to the path beside them (when there is one)."""


def figures(title: str, path: Path | None = None) -> dict[str, Any]:
    """The figures of section `title`, one line a key in the run's summary; a test module adds
    to them as it goes, and they are written to `path` (as JSON) at the end of the run."""
    return FIGURES.setdefault(title, ({}, path))[0]
