"""What becomes of an acknowledged commit: whether the server's settings let a crash take it
back (`Durability`, `Unsafe`), and the commits a leader found lost (`LostCommits`).

Plain records that import nothing of the package, so that the error tree, whose errors carry
them (`errors.NotDurable`, `errors.DatabaseBehind`), imports neither the dialect classes
(`durability` reads and classifies through them) nor the model (which validates with the
errors). Their public homes re-export them: `cronoq_store.durability` and `cronoq_store.model`.
"""

from __future__ import annotations

__all__ = ["Durability", "LostCommits", "Unsafe"]

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


@dataclass(frozen=True, slots=True, kw_only=True)
class LostCommits:
    """Commits a leader had acknowledged that the database no longer held when it looked.

    Recorded by that leader as it stepped down (`DatabaseBehind`): the database had gone back
    in time, as after an asynchronous failover that promoted a replica behind the primary.
    What the lost commits held (tasks submitted, finished, their ids) is gone with them; an
    engine should say so to its operators and re-submit what its callers still expect.
    """

    epoch: int
    """The epoch the leader committed under."""
    commits: int | None
    """At most this many of its commits are missing; None when the database had lost the
    leader's lease itself (the take), so the count cannot be told."""
    noticed_unix_ns: int
    """When the leader noticed, on the database's clock (the host's for SQLite)."""
