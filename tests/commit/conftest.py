"""Fixtures of the commit's tests."""

from __future__ import annotations

from typing import Any

import pytest

from cronoq_store.face import transactions


@pytest.fixture
def revivals(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each time a commit ran again after its guard found a revival."""
    again: list[int] = []
    real = transactions._revived_again

    def counted(*args: Any) -> None:
        again.append(1)
        real(*args)

    monkeypatch.setattr(transactions, "_revived_again", counted)
    return again
