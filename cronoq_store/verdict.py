"""What the settings read mean for an acknowledged commit: `Durability` and its `Unsafe` parts.

Plain records, apart from `durability` (which reads and classifies, through the dialect
classes) so that the error tree (`errors.NotDurable` carries a `Durability`) imports no dialect.
Their public home is `cronoq_store.durability`, which re-exports them.
"""

from __future__ import annotations

__all__ = ["Durability", "Unsafe"]

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class Unsafe:
    """One setting that lets a crash take back an acknowledged commit."""

    setting: str
    """Its name, as the server spells it."""
    value: str
    """Its value, as read."""
    why: str
    """What it risks, in a sentence."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Durability:
    """Whether an acknowledged commit survives a crash of the server (or of its machine)."""

    dialect: str
    """sqlite, postgresql or mysql (MariaDB too)."""
    settings: Mapping[str, str | None]
    """Every setting read, by name (None: not known from here)."""
    unsafe: tuple[Unsafe, ...]
    """The settings that make it unsafe; empty when safe."""
    acknowledged: str
    """What "acknowledged" means on this backend."""

    @property
    def safe(self) -> bool:
        """No setting read lets a crash lose an acknowledged commit."""
        return not self.unsafe

    def summary(self) -> str:
        """The unsafe settings in a line.

        Returns:
            "synchronous_commit=off (why); ...", empty when safe.
        """
        return "; ".join(f"{u.setting}={u.value} ({u.why})" for u in self.unsafe)

    def as_dict(self) -> dict[str, Any]:
        """This as JSON-ready data.

        Returns:
            The `durability` object of `status --json`: safe, settings, unsafe (setting,
            value, why), acknowledged.
        """
        return {
            "safe": self.safe,
            "settings": dict(self.settings),
            "unsafe": [{"setting": u.setting, "value": u.value, "why": u.why} for u in self.unsafe],
            "acknowledged": self.acknowledged,
        }
