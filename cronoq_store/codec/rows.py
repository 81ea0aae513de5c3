"""Whole rows as what recovery and queries return.

Every value a recovery reads passes through one of these decoders, so a stored value of any
shape (text in an integer column on SQLite, an out-of-range flag, a status name this build does
not know) is one `CorruptValue` for recovery to quarantine, never a crash.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from functools import wraps
from typing import Any, Final, TypeVar

from ..errors import CorruptValue
from ..model import (
    RecoveredRecurring,
    RecoveredTask,
    RecoveredTerminal,
    TaskId,
    TaskRecord,
    TaskStatus,
    TimeBase,
)
from .building import builder
from .columns import spec_from_values, stored_blob
from .jsonparts import priority_from
from .recurring import decode_recurring
from .values import from_unix

_recovered_task = builder(RecoveredTask)
_Row = TypeVar("_Row")
_R = TypeVar("_R")


def _row_decoder(
    what: str,
) -> Callable[[Callable[[TimeBase, _Row], _R]], Callable[[TimeBase, _Row], _R]]:
    """Turn any failure to decode a row into `CorruptValue` naming `what` was read. The
    wrapper takes the decoders' two arguments as they are: a recovery calls one per row."""

    def decorate(fn: Callable[[TimeBase, _Row], _R]) -> Callable[[TimeBase, _Row], _R]:
        @wraps(fn)
        def decode(base: TimeBase, row: _Row) -> _R:
            try:
                return fn(base, row)
            except CorruptValue:
                raise
            except (TypeError, ValueError, KeyError, OverflowError, RecursionError) as exc:
                raise CorruptValue(f"{what}: {type(exc).__name__}: {exc}") from exc

        return decode

    return decorate


def _int(column: str, value: object) -> int:
    """A stored integer column: exactly an int (SQLite stores any type in any column)."""
    if type(value) is not int:
        raise CorruptValue(f"{column}: expected an integer, got {type(value).__name__}")
    return value


_VALID_PAIRS: Final[dict[tuple[str, int], TaskStatus]] = {
    (s.value, int(s.is_terminal)): s for s in TaskStatus
}
"""Every valid (stored name, flag) pair: one dict lookup decides what a row as written holds
(True and 1 are the same key: PostgreSQL reads the flag as a bool)."""


_LIVE_PAIRS: Final = frozenset(pair for pair, s in _VALID_PAIRS.items() if not s.is_terminal)
"""The valid (stored name, flag) pairs of a live task."""


def status_pair(status: object, terminal: object) -> TaskStatus:
    """The status of a row whose `status` name and `terminal` flag (read as an integer) agree.

    The flag must be exactly 0 or 1 and say what the name says; anything else (a flag of 2,
    an unknown or empty name, a finished status on a live row or the reverse) is damage.
    """
    if isinstance(status, str) and isinstance(terminal, int):  # a bool is an int
        known_pair = _VALID_PAIRS.get((status, terminal))
        if known_pair is not None:
            return known_pair
    if type(terminal) not in (int, bool) or terminal not in (0, 1):
        raise CorruptValue(f"terminal: {terminal!r} is neither 0 nor 1")
    if not isinstance(status, str):
        raise CorruptValue(f"status: expected a name, got {type(status).__name__}")
    known = TaskStatus.from_name(status)
    if known is None:
        raise CorruptValue(f"status: unknown status {status!r}")
    if known.is_terminal != bool(terminal):
        state = "finished" if terminal else "live"
        raise CorruptValue(f"status: {known.value!r} on a {state} row (terminal = {terminal})")
    return known


@_row_decoder("live task row")
def live_task_from_row(base: TimeBase, row: Sequence[Any]) -> RecoveredTask:
    """A live task row: the values of `LIVE_COLUMNS`, in that order (a tuple is read faster
    than a mapping, and a recovery reads every live task); `CorruptValue` for any value that
    does not decode, or a row that is not a live task."""
    task_id, seq, arrival, attempt, status_name, terminal = row[:6]
    # The flag's type first: 0.0 equals 0 (and hashes alike), and is damage.
    if type(terminal) not in (int, bool) or (status_name, terminal) not in _LIVE_PAIRS:
        status = status_pair(status_name, terminal)
        raise CorruptValue(f"status: {status.value!r} is not live")
    return _recovered_task(  # every field is checked here: no __init__ to run
        id=_int("id", task_id),
        seq=_int("seq", seq),
        arrival=from_unix(base, _int("arrival_unix_ns", arrival)),
        spec=spec_from_values(base, *row[6:]),
        attempt=max(0, _int("attempt", attempt)),
    )


@_row_decoder("finished task row")
def finished_task_from_row(base: TimeBase, row: Mapping[Any, Any]) -> RecoveredTerminal:
    """A finished task row (id, key, status, terminal, updated_unix_ns); `CorruptValue` for any
    value that does not decode, or a row that is not a finished task."""
    status = status_pair(row["status"], row["terminal"])
    if not status.is_terminal:
        raise CorruptValue(f"status: {status.value!r} has not finished")
    key = row["key"]
    if key is not None and not isinstance(key, str):
        raise CorruptValue(f"key: expected text, got {type(key).__name__}")
    return RecoveredTerminal(
        id=TaskId(_int("id", row["id"])),
        key=key,
        status=status,
        at=from_unix(base, _int("updated_unix_ns", row["updated_unix_ns"])),
    )


@_row_decoder("recurring schedule row")
def recurring_from_row(base: TimeBase, row: Mapping[Any, Any]) -> RecoveredRecurring:
    """A schedule row (name, spec, template_payload, next_unix_ns, last_task_id);
    `CorruptValue` for any value that does not decode."""
    name = row["name"]
    if not isinstance(name, str):
        raise CorruptValue(f"name: expected text, got {type(name).__name__}")
    payload = row["template_payload"]
    if payload is not None and not isinstance(payload, bytes | bytearray | memoryview):
        raise CorruptValue(f"template_payload: expected bytes, got {type(payload).__name__}")
    next_unix, last = row["next_unix_ns"], row["last_task_id"]
    return RecoveredRecurring(
        spec=decode_recurring(base, name, row["spec"], None if payload is None else bytes(payload)),
        next=None if next_unix is None else from_unix(base, _int("next_unix_ns", next_unix)),
        last=None if last is None else TaskId(_int("last_task_id", last)),
    )


# A query's row as the record a caller gets (`repository.queries`).


def record_from(row: Mapping[Any, Any]) -> TaskRecord:
    """A query row as a `TaskRecord`."""
    updated = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(
        microseconds=max(0, row["updated_unix_ns"]) // 1000
    )
    return TaskRecord(
        id=TaskId(row["id"]),
        key=row["key"],
        pool=row["pool"],
        kind=row["kind"],
        priority=priority_from(row["priority"]),
        tenant=row["tenant"],
        status=TaskStatus.from_name(row["status"]),
        attempt=row["attempt"],
        message=row["message"],
        output=None if row["output"] is None else stored_blob("output", row["output"]),
        updated=updated,
    )
