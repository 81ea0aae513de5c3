"""The batch fold: a batch of mutations becomes the rows a commit writes. No SQL here.

Pure functions of their arguments (codec encodes each value), so a fold is tested without a
database; `commit.write` writes what it returns. Everything that cannot be stored is refused
here (`InvalidValue`), before any write.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from .. import codec
from ..errors import InvalidValue
from ..model import (
    INT64_MAX,
    INT64_MIN,
    ById,
    Dep,
    InboxTaken,
    Mutation,
    RecurringNext,
    RecurringRemove,
    RecurringUpsert,
    StatusChanged,
    Submitted,
    TaskId,
    TaskStatus,
    TimeBase,
)

# Folding: a batch becomes one insert per new task and one update per existing task.

STATUS_NAME: Final = {s: s.value for s in TaskStatus}
"""Stored name of each status (a dict lookup is cheaper than the enum's `value` per row)."""
IS_TERMINAL: Final = {s: s.is_terminal for s in TaskStatus}
_QUEUED: Final = TaskStatus.QUEUED.value
"""A new task's stored status (an enum's `.value` is a property: a call per task)."""


@dataclass(slots=True)
class FoldedStatus:
    """The latest transition of a task within a batch."""

    status: TaskStatus
    attempt: int
    at: int
    message: str | None

    def fold(self, later: FoldedStatus) -> None:
        """Apply a later transition, keeping the message unless the later one has its own."""
        self.status, self.attempt, self.at = later.status, later.attempt, later.at
        if later.message is not None:
            self.message = later.message


@dataclass(slots=True)
class Folded:
    """A batch folded so that splitting a batch changes no row.

    Mutations apply in batch order: a transition of a task submitted earlier in the batch is
    folded into its insert; any other transition (the task's `Submitted` has not come yet) is an
    update of the stored row, applied before the inserts, and changes nothing when the task is
    not stored yet. An insert of a task already stored is ignored with everything folded into it
    (a replayed batch changes nothing).
    """

    inserts: dict[int, dict[str, Any]] = field(default_factory=dict)
    """New task rows by id, each with the status it reached within the batch."""
    deps: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    """Dependency rows of the new tasks."""
    updates: dict[int, FoldedStatus] = field(default_factory=dict)
    """The latest transition of each stored task (those not submitted earlier in the batch)."""
    recurring: list[RecurringUpsert | RecurringRemove | RecurringNext] = field(default_factory=list)
    inbox_taken: dict[int, None] = field(default_factory=dict)
    """Inbox rows the batch removes (ordered, without repeats)."""


def dep_rows(task_id: int, deps: Sequence[Dep]) -> list[dict[str, Any]]:
    """The `cronoq_task_deps` rows of a live task's dependencies."""
    rows: list[dict[str, Any]] = []
    for i, d in enumerate(deps):
        target = d.target  # narrowed by type, not getattr with a default: no AttributeError
        if isinstance(target, ById):
            target_id, target_key = target.id, None
        else:
            target_id, target_key = None, target.key
            if not (target_key.isascii() and "\x00" not in target_key):
                target_key = codec.clean(target_key)
        rows.append(
            {"task_id": task_id, "ordinal": i, "target_id": target_id, "target_key": target_key}
        )
    return rows


def check_payload(payload: bytes, max_bytes: int | None, setting: str) -> None:
    """Refuse (`InvalidValue`, naming `setting`) a payload longer than `max_bytes`."""
    if max_bytes is not None and len(payload) > max_bytes:
        raise InvalidValue(
            f"TaskSpec.payload is {len(payload)} bytes; at most {max_bytes} are accepted "
            f"({setting}): keep large data in the app's own storage and pass a reference"
        )


MAX_PAYLOAD_SETTING: Final = "StoreConfig.max_payload_bytes"


def fold(
    base: TimeBase,
    now_unix_ns: int,
    batch: Iterable[Mutation],
    stored: codec.StoredSpecs | None = None,
    *,
    max_payload: int | None = None,
) -> Folded:
    """Fold `batch`; refuses (`InvalidValue`) anything that cannot be stored, before any write,
    a payload longer than `max_payload` included (`StoreConfig.max_payload_bytes`). A spec of
    `stored` (read from the inbox) keeps the columns it was read from.

    Every commit folds its batch, so the usual case makes few calls: a mutation's kind by its
    exact type (`_kind_of` for a subclass), a time converted inline (`codec.to_unix` refuses
    one out of range), a row's live key kept as its status changes (`_apply`)."""
    columns = codec.spec_columns if stored is None else stored.columns
    out = Folded()
    inserts, updates = out.inserts, out.updates
    offset = base.unix_ns
    for m in batch:
        kind = type(m)
        if kind not in _KINDS:
            kind = _kind_of(m)
        if kind is StatusChanged:
            change: StatusChanged = m  # type: ignore[assignment]  # its kind, told above
            at = offset + change.at
            if not INT64_MIN <= at <= INT64_MAX:
                codec.to_unix(base, change.at, "StatusChanged.at")  # raises, naming the field
            message = change.message
            st = FoldedStatus(
                change.status, change.attempt, at, None if message is None else codec.clean(message)
            )
            task_id = change.id
            if task_id in inserts:
                _apply(inserts[task_id], st)
            elif task_id in updates:
                updates[task_id].fold(st)
            else:
                updates[task_id] = st
        elif kind is Submitted:
            new: Submitted = m  # type: ignore[assignment]
            task_id = new.id
            if task_id in inserts:
                continue
            spec = new.spec
            if max_payload is not None and len(spec.payload) > max_payload:
                check_payload(spec.payload, max_payload, MAX_PAYLOAD_SETTING)  # raises
            row = columns(base, spec)
            arrival = offset + new.arrival
            if not INT64_MIN <= arrival <= INT64_MAX:
                codec.to_unix(base, new.arrival, "Submitted.arrival")  # raises, naming the field
            row["id"] = task_id
            row["seq"] = new.seq
            row["arrival_unix_ns"] = arrival
            row["updated_unix_ns"] = now_unix_ns
            row["finished_unix_ns"] = None
            row["status"] = _QUEUED
            row["terminal"] = False
            row["attempt"] = 0
            row["message"] = None
            row["live_key"] = row["key"]  # a live task holds its key (`_apply` keeps it so)
            inserts[task_id] = row
            if spec.deps:
                out.deps[task_id] = dep_rows(task_id, spec.deps)
        elif kind is InboxTaken:
            taken: InboxTaken = m  # type: ignore[assignment]
            out.inbox_taken[taken.inbox_id] = None
        else:
            if isinstance(m, RecurringUpsert):
                check_payload(m.spec.template.payload, max_payload, MAX_PAYLOAD_SETTING)
            out.recurring.append(m)  # type: ignore[arg-type]  # the rest are schedules'
    return out


_KINDS: Final = frozenset({Submitted, StatusChanged, InboxTaken})
"""The mutations `fold` tells apart by their exact type."""


def _kind_of(m: Mutation) -> type:
    """Which of `_KINDS` `m` is an instance of (a subclass's), else its own type."""
    for kind in (Submitted, StatusChanged, InboxTaken):
        if isinstance(m, kind):
            return kind
    return type(m)


def same_live_key(folded: Folded) -> InvalidValue | None:
    """Why a commit the live-key index refused was refused, when the batch itself holds the
    conflict: two of its new tasks live under one key (two inbox items with one key, drained
    together). None when its keys are distinct (the conflict is then with a stored task).

    Asked only after the database refused the batch, so a commit pays nothing for it.
    """
    live: dict[str, int] = {}
    for task_id, row in folded.inserts.items():
        key = row["live_key"]
        if key is None:
            continue
        if key in live:
            return InvalidValue(
                f"two tasks within the batch hold live key {key!r} (tasks {live[key]} and "
                f"{task_id}): a key is unique among live tasks; submit the second once the "
                "first has finished, or drop it (an inbox item: commit its InboxTaken alone)"
            )
        live[key] = task_id
    return None


def checked_outputs(outputs: Iterable[tuple[TaskId, bytes]]) -> list[tuple[TaskId, bytes]]:
    """`outputs` as (id, bytes) pairs; refuses (`InvalidValue`) what no task could hold."""
    checked: list[tuple[TaskId, bytes]] = []
    for pair in outputs:
        try:
            task_id, output = pair
        except (TypeError, ValueError) as exc:
            raise InvalidValue("outputs must hold (task id, bytes) pairs") from exc
        if not isinstance(task_id, int) or isinstance(task_id, bool):
            raise InvalidValue(f"outputs: a task id must be an int, not {type(task_id).__name__}")
        if not INT64_MIN <= task_id <= INT64_MAX:
            raise InvalidValue(f"outputs: task id {task_id} is outside the 64-bit range")
        if not isinstance(output, bytes | bytearray | memoryview):
            raise InvalidValue(f"outputs: the output of task {task_id} must be bytes")
        checked.append((task_id, bytes(output)))
    return checked


def _apply(row: dict[str, Any], st: FoldedStatus) -> None:
    row["status"] = STATUS_NAME[st.status]
    row["terminal"] = IS_TERMINAL[st.status]
    row["attempt"] = st.attempt
    row["updated_unix_ns"] = st.at
    row["finished_unix_ns"] = st.at if row["terminal"] else None
    row["message"] = st.message if st.message is not None else row.get("message")
    row["live_key"] = None if row["terminal"] else row["key"]
