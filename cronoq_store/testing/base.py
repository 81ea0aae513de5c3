"""What every part of the kit shares: the store it needs (`Store`), the time base and the
task-id layout, the events a driver reports, and the digests that let specs compare across
processes and database round trips.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, Protocol

from ..model import (
    Mutation,
    Recovered,
    RecurringSpec,
    TaskId,
    TaskRecord,
    TaskRef,
    TaskSpec,
    TimeBase,
)

BASE: Final = TimeBase(unix_ns=1_700_000_000_000_000_000)
"""The time base every driver and the checker use, so engine times compare across leaders."""
EPOCH_SHIFT: Final = 48
"""Task ids of a term start at `epoch << EPOCH_SHIFT` (32767 << 48 still fits in 63 bits)."""
SECOND_NS: Final = 1_000_000_000
"""One second in nanoseconds."""


Event = Mapping[str, Any]
"""One JSON event a driver reports (`standby`, `leading`, `ack`, `fenced`, ...)."""
Emit = Callable[[Event], None]
"""Where a driver sends its events."""


class Store(Protocol):
    """What the kit needs of a store; `SqlStore` is one, and any other store may be."""

    @property
    def is_leader(self) -> bool:
        """As `SqlStore.is_leader`."""

    def acquire_leadership(self, timeout: float | None = None) -> int:
        """As `SqlStore.acquire_leadership`: the new epoch.

        Args:
            timeout: Seconds to try at most; None tries until it leads.

        Returns:
            The new fencing epoch.
        """

    def release_leadership(self) -> None:
        """As `SqlStore.release_leadership`."""

    def on_leadership_lost(self, callback: Callable[[], None]) -> None:
        """As `SqlStore.on_leadership_lost`.

        Args:
            callback: Called once each time leadership ends.
        """

    def commit(
        self,
        epoch: int,
        base: TimeBase,
        batch: Sequence[Mutation],
        outputs: Sequence[tuple[TaskId, bytes]] = (),
    ) -> None:
        """As `SqlStore.commit`.

        Args:
            epoch: The epoch of this term.
            base: The engine's time base of every time in `batch`.
            batch: The mutations, in order.
            outputs: `(task id, bytes)` pairs of tasks that succeeded.
        """

    def recover(self, base: TimeBase) -> Recovered:
        """As `SqlStore.recover`.

        Args:
            base: The engine's time base.

        Returns:
            Everything a new leader needs to resume.
        """

    def get_task(self, ref: TaskRef) -> TaskRecord | None:
        """As `SqlStore.get_task`.

        Args:
            ref: `ById(id)` or `ByKey(key)`.

        Returns:
            The task, or None.
        """


# Canonical forms, so specs compare across processes and database round trips.


def _canon(value: object) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            "type": type(value).__name__,
            **{f.name: _canon(getattr(value, f.name)) for f in dataclasses.fields(value)},
        }
    if isinstance(value, frozenset | set):
        return sorted(_canon(v) for v in value)
    if isinstance(value, Mapping):
        return {str(k): _canon(v) for k, v in sorted(value.items())}
    if isinstance(value, list | tuple):
        return [_canon(v) for v in value]
    return value


def digest(value: TaskSpec | RecurringSpec) -> str:
    """A short stable digest of a spec (equal specs, equal digests).

    Args:
        value: A task spec or a recurring schedule spec.

    Returns:
        A hex digest, equal for equal specs.
    """
    text = json.dumps(_canon(value), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:20]
