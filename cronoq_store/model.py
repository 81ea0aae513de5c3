"""The domain model: what a scheduler engine hands the store and gets back. No SQL here.

Every time is an integer. Engine time (`Time`) counts nanoseconds from an engine-chosen origin;
a `TimeBase` maps it to Unix nanoseconds, which is what the store keeps. Durations are integer
nanoseconds (`*_ns`). Records are frozen and keyword-only; invalid values are refused when the
object is built, with a message naming the field, so nothing invalid ever reaches a commit.
"""

from __future__ import annotations

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "SECOND_NS",
    "ById",
    "ByKey",
    "Dep",
    "DepOn",
    "FixedStart",
    "InboxItem",
    "InboxTaken",
    "LostCommits",
    "Misfire",
    "Mutation",
    "OnMiss",
    "Overlap",
    "Priority",
    "Recovered",
    "RecoveredRecurring",
    "RecoveredTask",
    "RecoveredTerminal",
    "RecurringNext",
    "RecurringRemove",
    "RecurringSpec",
    "RecurringUpsert",
    "RetryPolicy",
    "StatusChanged",
    "Submitted",
    "TaskId",
    "TaskRecord",
    "TaskRef",
    "TaskSpec",
    "TaskStatus",
    "Time",
    "TimeBase",
]

import enum
import math
import zoneinfo
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal, NewType, TypeAlias, get_args

from .errors import InvalidValue
from .verdict import LostCommits as LostCommits

INT64_MIN = -(2**63)
"""Smallest value of a stored 64-bit integer (times, ids, durations)."""
INT64_MAX = 2**63 - 1
"""Largest value of a stored 64-bit integer (times, ids, durations)."""

Time: TypeAlias = int
"""Engine time in nanoseconds; `TimeBase` maps it to Unix time."""

TaskId = NewType("TaskId", int)
"""A task's id, assigned by the engine; any signed 64-bit value (ids may be epoch-prefixed)."""

DepOn: TypeAlias = Literal["success", "finish"]
"""What a dependency waits for: the target's success, or only its finishing."""
OnMiss: TypeAlias = Literal["skip", "run", "fail"]
"""What happens to a task whose fixed start was missed."""
Misfire: TypeAlias = Literal["skip", "run_once", "run_all"]
"""What a schedule does about fire times it missed (the engine applies it)."""
Overlap: TypeAlias = Literal["allow", "skip"]
"""Whether a schedule fires while its previous task is still live."""

SECOND_NS = 1_000_000_000
"""One second in nanoseconds."""


def _int(name: str, value: object, *, lo: int = INT64_MIN, hi: int = INT64_MAX) -> None:
    """Refuse anything but an int within [lo, hi] (bool is not an int here)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidValue(f"{name} must be an int, not {type(value).__name__}")
    if not lo <= value <= hi:
        raise InvalidValue(f"{name} must be within [{lo}, {hi}], got {value}")


def _opt_int(name: str, value: object, *, lo: int = INT64_MIN, hi: int = INT64_MAX) -> None:
    if value is not None:
        _int(name, value, lo=lo, hi=hi)


def _str(name: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise InvalidValue(f"{name} must be a str, not {type(value).__name__}")


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise InvalidValue(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


@dataclass(frozen=True, slots=True)
class TimeBase:
    """Maps engine time to wall-clock Unix nanoseconds: `unix = unix_ns + t`.

    Its one field may be given by position: `TimeBase(ns)`.
    """

    unix_ns: int
    """Unix time in nanoseconds of engine time 0."""

    def __post_init__(self) -> None:
        _int("TimeBase.unix_ns", self.unix_ns)

    def to_unix(self, t: Time) -> int:
        """Unix nanoseconds of engine time `t`.

        Args:
            t: An engine time (nanoseconds since this base).

        Returns:
            The same instant in Unix nanoseconds.
        """
        return self.unix_ns + t

    def from_unix(self, unix_ns: int) -> Time:
        """Engine time of Unix nanoseconds `unix_ns`.

        Args:
            unix_ns: An instant in Unix nanoseconds.

        Returns:
            The same instant as an engine time under this base.
        """
        return unix_ns - self.unix_ns


@dataclass(frozen=True, slots=True)
class ById:
    """A task named by its id: `ById(5)` or `ById(id=5)`.

    Any int is accepted, so a lookup of an id outside the 64-bit range simply finds nothing; a
    dependency on one is refused when committed (no task can have it).
    """

    id: TaskId
    """The task's id."""

    def __post_init__(self) -> None:
        if not isinstance(self.id, int) or isinstance(self.id, bool):
            raise InvalidValue(f"ById.id must be an int, not {type(self.id).__name__}")


@dataclass(frozen=True, slots=True)
class ByKey:
    """A task named by its key (the newest task with that key): `ByKey("k")` or `ByKey(key=...)`."""

    key: str
    """The task's key; not empty."""

    def __post_init__(self) -> None:
        _str("ByKey.key", self.key)
        if not self.key:
            raise InvalidValue("ByKey.key must not be empty")


TaskRef: TypeAlias = ById | ByKey
"""A task named by its id or by its key."""


class Priority(enum.IntEnum):
    """Scheduling priority, stored as its index 0..3."""

    LOW = 0
    """Stored as 0."""
    NORMAL = 1
    """The default; stored as 1, and what an unknown stored index reads as."""
    HIGH = 2
    """Stored as 2."""
    CRITICAL = 3
    """Stored as 3."""

    @classmethod
    def from_index(cls, index: int) -> Priority:
        """The priority stored as `index`.

        Args:
            index: The stored integer.

        Returns:
            Its priority; NORMAL for an index no priority has (a newer build's).
        """
        try:
            return cls(index)
        except ValueError:
            return cls.NORMAL


class TaskStatus(enum.StrEnum):
    """Where a task stands. The value is the name stored in the database."""

    QUEUED = "queued"
    """Submitted, not started."""
    WAITING = "waiting"
    """Blocked on dependencies or resources."""
    RUNNING = "running"
    """An attempt is under way."""
    RETRYING = "retrying"
    """Backing off before the next attempt."""
    SUCCEEDED = "succeeded"
    """Finished well; its output, if any, is kept (`load_output`)."""
    FAILED = "failed"
    """Finished badly, with no attempt left."""
    CANCELLED = "cancelled"
    """Cancelled before it finished."""
    EXPIRED = "expired"
    """Deadline or fixed start missed."""
    SKIPPED = "skipped"
    """A dependency did not succeed."""

    @property
    def is_terminal(self) -> bool:
        """Whether the task has finished for good."""
        return self in _TERMINAL

    @classmethod
    def from_name(cls, name: str) -> TaskStatus | None:
        """The status stored as `name`.

        Args:
            name: The stored name, in any case.

        Returns:
            Its status; None for a name no status has.
        """
        try:
            return cls(name.lower())
        except (ValueError, AttributeError):
            return None


_TERMINAL = frozenset(
    {
        TaskStatus.SUCCEEDED,
        TaskStatus.FAILED,
        TaskStatus.CANCELLED,
        TaskStatus.EXPIRED,
        TaskStatus.SKIPPED,
    }
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Dep:
    """A dependency on another task: wait for its success, or only for it to finish."""

    target: TaskRef
    """The task depended on, by id or by key."""
    on: DepOn = "success"
    """`success`: the target must succeed; `finish`: any terminal status will do."""

    def __post_init__(self) -> None:
        if not isinstance(self.target, ById | ByKey):
            raise InvalidValue(
                f"Dep.target must be ById or ByKey, not {type(self.target).__name__}"
            )
        _choice("Dep.on", self.on, get_args(DepOn))


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """How failed attempts are retried: exponential backoff with jitter."""

    max_attempts: int = 3
    """Attempts in all, the first included (1 = never retry)."""
    initial_backoff_ns: int = SECOND_NS
    """Wait before the first retry, in nanoseconds."""
    max_backoff_ns: int = 60 * SECOND_NS
    """Longest wait between attempts, in nanoseconds; not below `initial_backoff_ns`."""
    multiplier: float = 2.0
    """Backoff growth per attempt, at least 1."""
    jitter: float = 0.0
    """Random spread of each backoff, as a fraction in [0, 1]."""

    def __post_init__(self) -> None:
        _int("RetryPolicy.max_attempts", self.max_attempts, lo=1, hi=2**31 - 1)
        _int("RetryPolicy.initial_backoff_ns", self.initial_backoff_ns, lo=0)
        _int("RetryPolicy.max_backoff_ns", self.max_backoff_ns, lo=0)
        if self.max_backoff_ns < self.initial_backoff_ns:
            raise InvalidValue("RetryPolicy.max_backoff_ns must not be below initial_backoff_ns")
        for name, value, lo, hi in (
            ("multiplier", self.multiplier, 1.0, math.inf),
            ("jitter", self.jitter, 0.0, 1.0),
        ):
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise InvalidValue(f"RetryPolicy.{name} must be a number")
            if not (math.isfinite(value) and lo <= value <= hi):
                raise InvalidValue(f"RetryPolicy.{name} must be finite and within [{lo}, {hi}]")


@dataclass(frozen=True, slots=True, kw_only=True)
class FixedStart:
    """The task must start at `at`, within `tolerance_ns`; `on_miss` says what happens if not."""

    at: Time
    """When the task must start."""
    tolerance_ns: int = SECOND_NS
    """How late a start still counts, in nanoseconds."""
    on_miss: OnMiss = "skip"
    """What happens when the start is missed: skip the task, run it anyway, or fail it."""

    def __post_init__(self) -> None:
        _int("FixedStart.at", self.at)
        _int("FixedStart.tolerance_ns", self.tolerance_ns, lo=0)
        _choice("FixedStart.on_miss", self.on_miss, get_args(OnMiss))


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskSpec:
    """What to run and under which constraints."""

    payload: bytes
    """The engine's opaque description of the work; stored as is."""
    kind: str = ""
    """What sort of task this is, for the engine and for listings."""
    pool: str = "default"
    """The worker pool that runs it; not empty."""
    priority: Priority = Priority.NORMAL
    """Scheduling priority."""
    key: str | None = None
    """Unique among live tasks; a finished task's key may be reused."""
    deadline: Time | None = None
    """When the task expires if it has not finished (the engine enforces it)."""
    fixed_start: FixedStart | None = None
    """A start time the task must keep, if any."""
    duration_hint_ns: int | None = None
    """How long an attempt is expected to take, in nanoseconds."""
    timeout_ns: int | None = None
    """Longest an attempt may run, in nanoseconds (the engine enforces it)."""
    retry: RetryPolicy | None = None
    """How failed attempts are retried; None: never."""
    deps: tuple[Dep, ...] = ()
    """Tasks this one waits for."""
    resources: Mapping[str, int] = field(default_factory=dict)
    """Units of each named resource an attempt holds."""
    tags: frozenset[str] = frozenset()
    """Free-form tags (any iterable of str but a str; kept as a frozenset)."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Free-form name/value labels."""
    tenant: str | None = None
    """The tenant the task belongs to, if any."""

    def __post_init__(self) -> None:
        if not isinstance(self.payload, bytes):
            raise InvalidValue(f"TaskSpec.payload must be bytes, not {type(self.payload).__name__}")
        _str("TaskSpec.kind", self.kind)
        _str("TaskSpec.pool", self.pool)
        if not self.pool:
            raise InvalidValue("TaskSpec.pool must not be empty")
        if not isinstance(self.priority, Priority):
            raise InvalidValue(f"TaskSpec.priority must be a Priority, got {self.priority!r}")
        _str("TaskSpec.key", self.key, optional=True)
        if self.key == "":
            raise InvalidValue("TaskSpec.key must not be empty (use None for no key)")
        _opt_int("TaskSpec.deadline", self.deadline)
        if self.fixed_start is not None and not isinstance(self.fixed_start, FixedStart):
            raise InvalidValue("TaskSpec.fixed_start must be a FixedStart")
        _opt_int("TaskSpec.duration_hint_ns", self.duration_hint_ns, lo=0)
        _opt_int("TaskSpec.timeout_ns", self.timeout_ns, lo=0)
        if self.retry is not None and not isinstance(self.retry, RetryPolicy):
            raise InvalidValue("TaskSpec.retry must be a RetryPolicy")
        deps = tuple(self.deps)
        for dep in deps:
            if not isinstance(dep, Dep):
                raise InvalidValue(f"TaskSpec.deps must hold Dep values, not {type(dep).__name__}")
        resources = dict(self.resources)
        for name, units in resources.items():
            _str("TaskSpec.resources key", name)
            _int(f"TaskSpec.resources[{name!r}]", units, lo=0)
        tags = frozenset(self.tags) if not isinstance(self.tags, str) else None
        if tags is None:
            raise InvalidValue("TaskSpec.tags must be a set of str, not a str")
        for tag in tags:
            _str("TaskSpec.tags item", tag)
        labels = dict(self.labels)
        for name, value in labels.items():
            _str("TaskSpec.labels key", name)
            _str(f"TaskSpec.labels[{name!r}]", value)
        _str("TaskSpec.tenant", self.tenant, optional=True)
        # Normalise containers so equal specs compare equal whatever the caller passed in.
        object.__setattr__(self, "deps", deps)
        object.__setattr__(self, "resources", resources)
        object.__setattr__(self, "tags", tags)
        object.__setattr__(self, "labels", labels)


@dataclass(frozen=True, slots=True, kw_only=True)
class RecurringSpec:
    """A schedule that submits `template` on a cron expression or a fixed interval.

    The store keeps it; the engine evaluates it.
    """

    name: str
    """Names the schedule; unique, not empty."""
    template: TaskSpec
    """The task each firing submits."""
    cron: str | None = None
    """Five or six whitespace-separated fields."""
    interval_ns: int | None = None
    """A fixed interval in nanoseconds (at least 1), instead of `cron`."""
    timezone: str = "UTC"
    """An IANA time zone name, for cron."""
    start: Time | None = None
    """No firing before this time."""
    end: Time | None = None
    """No firing after this time; not before `start`."""
    misfire: Misfire = "skip"
    """What to do about fire times missed while no engine ran."""
    overlap: Overlap = "allow"
    """Whether to fire while the previous task is still live."""

    def __post_init__(self) -> None:
        _str("RecurringSpec.name", self.name)
        if not self.name:
            raise InvalidValue("RecurringSpec.name must not be empty")
        if not isinstance(self.template, TaskSpec):
            raise InvalidValue("RecurringSpec.template must be a TaskSpec")
        if (self.cron is None) == (self.interval_ns is None):
            raise InvalidValue("RecurringSpec needs exactly one of cron and interval_ns")
        if self.cron is not None:
            _str("RecurringSpec.cron", self.cron)
            if len(self.cron.split()) not in (5, 6):
                raise InvalidValue(f"RecurringSpec.cron must have 5 or 6 fields, got {self.cron!r}")
        _opt_int("RecurringSpec.interval_ns", self.interval_ns, lo=1)
        _str("RecurringSpec.timezone", self.timezone)
        try:
            zoneinfo.ZoneInfo(self.timezone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError) as exc:
            raise InvalidValue(
                f"RecurringSpec.timezone is not an IANA time zone: {self.timezone!r}"
            ) from exc
        _opt_int("RecurringSpec.start", self.start)
        _opt_int("RecurringSpec.end", self.end)
        if self.start is not None and self.end is not None and self.end < self.start:
            raise InvalidValue("RecurringSpec.end must not be before start")
        _choice("RecurringSpec.misfire", self.misfire, get_args(Misfire))
        _choice("RecurringSpec.overlap", self.overlap, get_args(Overlap))


# Mutations: what `commit` receives, in order.


@dataclass(frozen=True, slots=True, kw_only=True)
class Submitted:
    """A new task."""

    id: TaskId
    """The new task's id, chosen by the engine."""
    seq: int
    """Submission order, for FIFO among equal priorities."""
    arrival: Time
    """When the task was submitted."""
    spec: TaskSpec
    """The task itself."""

    def __post_init__(self) -> None:
        _int("Submitted.id", self.id)
        _int("Submitted.seq", self.seq)
        _int("Submitted.arrival", self.arrival)
        if not isinstance(self.spec, TaskSpec):
            raise InvalidValue("Submitted.spec must be a TaskSpec")


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusChanged:
    """A task moved to `status`; `message` (if any) replaces the stored one."""

    id: TaskId
    """The task that moved."""
    status: TaskStatus
    """Where it stands now."""
    attempt: int
    """The attempt this change belongs to."""
    at: Time
    """When it moved."""
    message: str | None = None
    """Why (an error, say); None keeps the stored message."""

    def __post_init__(self) -> None:
        _int("StatusChanged.id", self.id)
        if not isinstance(self.status, TaskStatus):
            raise InvalidValue(f"StatusChanged.status must be a TaskStatus, got {self.status!r}")
        _int("StatusChanged.attempt", self.attempt, lo=0, hi=2**31 - 1)
        _int("StatusChanged.at", self.at)
        _str("StatusChanged.message", self.message, optional=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class RecurringUpsert:
    """Create or replace a schedule (its next/last stay as they were)."""

    spec: RecurringSpec
    """The schedule, replacing any of the same name."""

    def __post_init__(self) -> None:
        if not isinstance(self.spec, RecurringSpec):
            raise InvalidValue("RecurringUpsert.spec must be a RecurringSpec")


@dataclass(frozen=True, slots=True, kw_only=True)
class RecurringRemove:
    """Delete a schedule."""

    name: str
    """The schedule to delete; an unknown name is no error."""

    def __post_init__(self) -> None:
        _str("RecurringRemove.name", self.name)


@dataclass(frozen=True, slots=True, kw_only=True)
class RecurringNext:
    """A schedule's next fire time and the last task it submitted."""

    name: str
    """The schedule."""
    next: Time | None
    """When it fires next; None: never again."""
    last: TaskId | None
    """The task it submitted last, if any."""

    def __post_init__(self) -> None:
        _str("RecurringNext.name", self.name)
        _opt_int("RecurringNext.next", self.next)
        _opt_int("RecurringNext.last", self.last)


@dataclass(frozen=True, slots=True, kw_only=True)
class InboxTaken:
    """The engine has dealt with inbox item `inbox_id`: the commit removes it from the inbox.

    Committed with the `Submitted` made from the item (or alone, to drop an item the engine
    refuses), so that under the fence an item becomes at most one task.
    """

    inbox_id: int
    """The `InboxItem.inbox_id` that `read_inbox` gave."""

    def __post_init__(self) -> None:
        _int("InboxTaken.inbox_id", self.inbox_id)


Mutation: TypeAlias = (
    Submitted | StatusChanged | RecurringUpsert | RecurringRemove | RecurringNext | InboxTaken
)
"""One change in a commit's batch."""


# Recovery: what a new leader gets back.


@dataclass(frozen=True, slots=True, kw_only=True)
class RecoveredTask:
    """A live task, with the attempt it had reached."""

    id: TaskId
    """The task's id."""
    seq: int
    """Its submission order."""
    arrival: Time
    """When it was submitted."""
    spec: TaskSpec
    """The task as submitted."""
    attempt: int
    """The attempt it had reached."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RecoveredTerminal:
    """A finished task the engine must know of (for key deduplication and dependencies)."""

    id: TaskId
    """The task's id."""
    key: str | None
    """Its key, if it had one."""
    status: TaskStatus
    """How it finished."""
    at: Time
    """When it finished."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RecoveredRecurring:
    """A schedule with where it stood."""

    spec: RecurringSpec
    """The schedule."""
    next: Time | None
    """When it fires next, as last committed."""
    last: TaskId | None
    """The task it submitted last, if any."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Recovered:
    """Everything a new leader needs to resume; `next_id` is above every id ever used."""

    next_id: TaskId
    """Above every task id ever stored: the next term may start its ids here."""
    tasks: list[RecoveredTask] = field(default_factory=list)
    """The live tasks, in id order (a row that does not decode is quarantined instead)."""
    terminal: list[RecoveredTerminal] = field(default_factory=list)
    """Tasks finished within `StoreConfig.retention`, and older ones a live task depends on."""
    recurring: list[RecoveredRecurring] = field(default_factory=list)
    """Every schedule, by name."""
    lost: LostCommits | None = None
    """Commits an earlier leader found missing, until a leader of another epoch commits."""


@dataclass(frozen=True, slots=True, kw_only=True)
class InboxItem:
    """A task spec an app enqueued, waiting in the inbox for the leader."""

    inbox_id: int
    """Assigned by the database, increasing in insertion order."""
    spec: TaskSpec
    """Its times are engine times under the `TimeBase` it was read with (Unix ns by default)."""
    enqueued_unix_ns: int
    """When it was enqueued, on the database's clock (the host's for SQLite)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskRecord:
    """A stored task as queries show it."""

    id: TaskId
    """The task's id."""
    key: str | None
    """Its key, if it has one."""
    pool: str
    """Its pool."""
    kind: str
    """Its kind."""
    priority: Priority
    """Its priority."""
    tenant: str | None
    """Its tenant, if any."""
    status: TaskStatus | None
    """None for a status name this build does not know."""
    attempt: int
    """The attempt it has reached."""
    message: str | None
    """The last message committed with a status change."""
    output: bytes | None
    """The output committed for the task, if any."""
    updated: datetime
    """When the task last changed, in UTC."""
