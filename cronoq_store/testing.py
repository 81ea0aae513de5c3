"""Conformance kit: a workload driver that leads, and a checker of what it was promised.

`WorkloadDriver` acts as a scheduler engine would: it takes leadership, recovers, and commits
batches of realistic mutations (tasks with keys, dependencies by id and by key, recurring
schedules, tasks moving through running to succeeded or failed with outputs). After every
successful commit it appends the batch to an fsynced JSON-lines log, and only then counts its
mutations as acknowledged. Before every commit it appends an (unsynced) *intent* record, so the
checker knows every batch that may have reached the database.

`check` compares a database with such a log, after any number of failovers:

- no acknowledged mutation is lost: every acknowledged task exists, at least as far along as its
  last acknowledged transition;
- no batch is partial: each commit is visible entirely or not at all;
- replaying the visible batches in commit order (fencing epoch, then sequence) gives exactly the
  stored tasks and schedules, and nothing else is stored;
- no batch that was rejected as fenced is visible;
- the inbox: every enqueue an enqueuer saw commit became exactly one task or one drop (or
  still waits), none from a rolled-back transaction, none twice, each with its spec.

The driver drains the inbox as an engine would (`read_inbox`, then each item's `Submitted`
and `InboxTaken` in the same commit). Enqueuers (`run_enqueuer`, or a process running
`python -m cronoq_store.testing enqueue`) write into it in transactions of their own, rolling
some back on purpose, and log each outcome to the same log.

Several drivers (a leader and its standbys, in several processes) share one log: records are
appended with single `O_APPEND` writes. Task ids are epoch-prefixed (`epoch << 48`, or above
the recovered `next_id` when that is higher), so two leaders never use the same id.

Run as a process:

    python -m cronoq_store.testing drive --url URL --log PATH [--ttl S] [--batch N] [--duration S]
    python -m cronoq_store.testing check --url URL --log PATH
    python -m cronoq_store.testing enqueue --url URL --log PATH [--rollback P] [--duration S]

`drive` prints one JSON event per line on stdout (`standby`, `leading`, `ack`, `fenced`,
`leadership_lost`, `released`, ...) and a final `exit` summary; `check` prints a JSON report
and exits 1 when an invariant does not hold. Signals steer a driving process: SIGTERM or SIGINT
stops it gracefully (releasing the lease), SIGUSR1 makes it stop itself (SIGSTOP) at a point
where it holds no database connection, and SIGUSR2 arms the fault chosen with `--hang-at`.
"""

from __future__ import annotations

__all__ = [
    "BASE",
    "EPOCH_SHIFT",
    "AckLog",
    "CheckReport",
    "DriverConfig",
    "DriverProcess",
    "DriverProcessError",
    "DriverSummary",
    "Emit",
    "Event",
    "HangPoint",
    "Store",
    "StoredTask",
    "WorkloadDriver",
    "check",
    "digest",
    "main",
    "output_for",
    "read_log",
]

import argparse
import dataclasses
import enum
import hashlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any, Final, Protocol

from sqlalchemy import Engine, create_engine, event, make_url, select
from sqlalchemy import exc as sa_exc

from .errors import Fenced, StoreError, StoreUnavailable
from .inbox import enqueue_many
from .model import (
    ById,
    ByKey,
    Dep,
    FixedStart,
    InboxItem,
    InboxTaken,
    Mutation,
    Priority,
    Recovered,
    RecurringNext,
    RecurringRemove,
    RecurringSpec,
    RecurringUpsert,
    RetryPolicy,
    StatusChanged,
    Submitted,
    TaskId,
    TaskRecord,
    TaskRef,
    TaskSpec,
    TaskStatus,
    TimeBase,
)
from .schema import tasks as tasks_table
from .store import SqlStore, StoreConfig

log = logging.getLogger(__name__)

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
        """As `SqlStore.acquire_leadership`: the new epoch."""

    def release_leadership(self) -> None:
        """As `SqlStore.release_leadership`."""

    def on_leadership_lost(self, callback: Callable[[], None]) -> None:
        """As `SqlStore.on_leadership_lost`."""

    def commit(
        self,
        epoch: int,
        base: TimeBase,
        batch: Sequence[Mutation],
        outputs: Sequence[tuple[TaskId, bytes]] = (),
    ) -> None:
        """As `SqlStore.commit`."""

    def recover(self, base: TimeBase) -> Recovered:
        """As `SqlStore.recover`."""

    def get_task(self, ref: TaskRef) -> TaskRecord | None:
        """As `SqlStore.get_task`."""


class HangPoint(enum.StrEnum):
    """Where an armed driver stops and waits to be killed (fault injection)."""

    IN_COMMIT = "in-commit"
    """Inside the commit's transaction, after its writes, before COMMIT (SqlStore only)."""
    AFTER_COMMIT = "after-commit"
    """After the commit returned, before the batch is logged as acknowledged."""
    AFTER_ACK = "after-ack"
    """Right after the batch was logged as acknowledged."""
    STOP_IN_RENEWAL = "stop-in-renewal"
    """SIGSTOP the whole process inside a lease renewal's transaction, right after its UPDATE
    of the leader row, before COMMIT (SqlStore only): it holds the row lock while stopped."""
    STOP_IN_COMMIT = "stop-in-commit"
    """SIGSTOP the whole process inside a commit, right after its fence UPDATE (SqlStore only)."""
    STOP_IN_TAKE = "stop-in-take"
    """SIGSTOP the whole process inside the transaction that takes the lease, right after its
    UPDATE of the leader row (SqlStore only)."""


_SQL_ONLY: Final = frozenset(
    {
        HangPoint.IN_COMMIT,
        HangPoint.STOP_IN_RENEWAL,
        HangPoint.STOP_IN_COMMIT,
        HangPoint.STOP_IN_TAKE,
    }
)


@dataclass(frozen=True, slots=True, kw_only=True)
class DriverConfig:
    """How a `WorkloadDriver` behaves."""

    batch: int = 20
    """Mutations per commit (at least one of them a new task)."""
    gap: float = 0.0
    """Seconds to rest between commits."""
    duration: float | None = None
    """Stop (releasing leadership) after so many seconds; None runs until stopped."""
    max_batches: int | None = None
    """Stop after so many acknowledged batches."""
    turn_batches: int | None = None
    """Release leadership after so many batches per term, rest, then contend again."""
    rest: float = 0.2
    """Seconds to wait after releasing in turn mode before contending again."""
    seed: int | None = None
    """Seed of the workload's randomness (random when None)."""
    hang_at: HangPoint | None = None
    """The fault that `arm_hang()` (SIGUSR2 for a process) arms when it names none."""
    acquire_slice: float = 0.25
    """Seconds per `acquire_leadership` call, so a standby notices a stop request."""
    key_pool: int = 16
    """Keys shared by tasks over time (a finished task's key is reused)."""
    schedules: int = 6
    """Recurring schedule names the workload upserts, advances and removes."""
    inbox: bool = True
    """Drain the inbox as an engine would: each batch makes up to `batch` waiting items into
    tasks (`Submitted` + `InboxTaken` in the same commit), dropping those whose key is live."""

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ValueError("DriverConfig.batch must be at least 1")
        if self.gap < 0 or self.rest < 0 or self.acquire_slice <= 0:
            raise ValueError("DriverConfig: gap and rest >= 0, acquire_slice > 0")


@dataclass(slots=True, kw_only=True)
class DriverSummary:
    """What a driver did, printed as the `exit` event of a process."""

    run: str
    """The driver's run id, in every record it logs."""
    terms: int = 0
    """Times it became leader."""
    epochs: list[int] = field(default_factory=list)
    """The fencing epoch of each term."""
    acked_batches: int = 0
    """Batches committed and logged as acknowledged."""
    acked_mutations: int = 0
    """Mutations in those batches."""
    acked_tasks: int = 0
    """New tasks in those batches."""
    fenced: int = 0
    """Commits rejected with `Fenced`."""
    leadership_lost: int = 0
    """Terms that ended by losing the lease."""
    released: int = 0
    """Terms that ended by releasing the lease."""
    unavailable: int = 0
    """Commits that raised `StoreUnavailable` and were retried."""
    store_warnings: int = 0
    """Records the store logged at WARNING or above (a leadership loss among them)."""
    busy_warnings: int = 0
    """Of those, the ones about a locked or busy database."""
    inbox_taken: int = 0
    """Inbox items acknowledged as tasks."""
    inbox_dropped: int = 0
    """Inbox items acknowledged as dropped (their key was live)."""
    errors: list[str] = field(default_factory=list)
    """Unexpected errors, one line each."""


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
    """A short stable digest of a spec (equal specs, equal digests)."""
    text = json.dumps(_canon(value), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def output_for(task_id: int, attempt: int) -> bytes:
    """The output the workload stores for a task that succeeded."""
    return b"out:%d:%d" % (task_id, attempt)


def _private_file(path: Path) -> int:
    """`path` opened for writing, emptied and 0600 whatever the umask, also if it existed: a
    driver's stderr may quote task data."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    return fd


# The log.


class AckLog:
    """An append-only JSON-lines log shared by several processes.

    Each record is one `O_APPEND` write, so records of different processes never interleave;
    acknowledgements are fsynced before `append` returns.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        """The log file, created 0600 if new."""
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._lock = threading.Lock()

    def append(self, record: Mapping[str, Any], *, sync: bool) -> None:
        """Append `record` as one line in one write; with `sync`, fsync before returning."""
        data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        with self._lock:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view) :]
            if sync:
                os.fsync(self._fd)

    def close(self) -> None:
        """Close the file; appending afterwards fails."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> AckLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_log(path: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], int]:
    """The records of a log, and how many lines could not be parsed (torn by a kill)."""
    records: list[dict[str, Any]] = []
    torn = 0
    with open(path, "rb") as f:
        for line in f:
            try:
                obj = json.loads(line)
            except ValueError:
                torn += 1
                continue
            if isinstance(obj, dict):
                records.append(obj)
            else:
                torn += 1
    return records, torn


# The workload.


class _Phase(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    RETRYING = "retrying"
    STARTED = "started"
    """Recovered with an attempt: running or retrying, which recovery does not tell."""


@dataclass(slots=True)
class _Live:
    phase: _Phase
    attempt: int
    key: str | None


@dataclass(slots=True)
class _Planned:
    """A batch and the workload state it leads to once committed."""

    batch: list[Mutation]
    outputs: list[tuple[TaskId, bytes]]
    records: list[dict[str, Any]]
    live: dict[int, _Live]
    known_ids: list[int]
    schedules: set[str]
    next_id: int
    submitted: list[int]


class Workload:
    """Generates batches from what the current leader knows, and learns from recovery."""

    def __init__(self, rng: random.Random, config: DriverConfig) -> None:
        self.rng = rng
        self.config = config
        self.live: dict[int, _Live] = {}
        self.known_ids: list[int] = []
        self.schedules: set[str] = set()
        self.next_id = 0
        self.seq = 0

    def reset(self, recovered: Recovered, epoch: int) -> None:
        """Start a term from what recovery returned."""
        self.next_id = max(int(recovered.next_id), epoch << EPOCH_SHIFT)
        self.live = {
            int(t.id): _Live(
                phase=_Phase.QUEUED if t.attempt == 0 else _Phase.STARTED,
                attempt=t.attempt,
                key=t.spec.key,
            )
            for t in recovered.tasks
        }
        self.known_ids = [int(t.id) for t in recovered.terminal[-200:]] + list(self.live)[-200:]
        self.schedules = {r.spec.name for r in recovered.recurring}

    def _now(self) -> int:
        return time.time_ns() - BASE.unix_ns

    def _spec(self, task_id: int, keys_free: list[str], known_keys: list[str]) -> TaskSpec:
        r = self.rng
        roll = r.random()
        key: str | None = None
        if roll < 0.35:
            key = f"t{task_id}"
        elif roll < 0.5 and keys_free:
            key = keys_free.pop(r.randrange(len(keys_free)))
        deps: list[Dep] = []
        if self.known_ids and r.random() < 0.3:
            deps.append(Dep(target=ById(id=TaskId(r.choice(self.known_ids))), on=r.choice(_DEP_ON)))
        if known_keys and r.random() < 0.2:
            deps.append(Dep(target=ByKey(key=r.choice(known_keys)), on=r.choice(_DEP_ON)))
        now = self._now()
        size = 4096 if r.random() < 0.02 else r.randrange(0, 64)
        return TaskSpec(
            payload=r.randbytes(size),
            kind=r.choice(("work", "report", "")),
            pool=r.choice(("default", "io", "cpu")),
            priority=r.choice(list(Priority)),
            key=key,
            deadline=now + 3600 * SECOND_NS if r.random() < 0.1 else None,
            fixed_start=(
                FixedStart(at=now + SECOND_NS, on_miss=r.choice(("skip", "run", "fail")))
                if r.random() < 0.1
                else None
            ),
            duration_hint_ns=r.randrange(1, 10**9) if r.random() < 0.1 else None,
            timeout_ns=r.randrange(1, 10**10) if r.random() < 0.1 else None,
            retry=(
                RetryPolicy(max_attempts=3, multiplier=1.5, jitter=0.25)
                if r.random() < 0.2
                else None
            ),
            deps=tuple(deps),
            resources={"cpu": r.randrange(1, 4)} if r.random() < 0.2 else {},
            tags=frozenset(r.sample(("a", "b", "c", "é"), r.randrange(0, 3))),
            labels={"team": r.choice(("x", "y"))} if r.random() < 0.3 else {},
            tenant=r.choice(("acme", None, None)),
        )

    def _advance(
        self, task_id: int, st: _Live, at: int
    ) -> tuple[StatusChanged, _Live | None, bytes | None]:
        """The next transition of a live task; None as new state once it finished."""
        r = self.rng
        if st.phase is _Phase.QUEUED or st.phase is _Phase.RETRYING:
            attempt = st.attempt + 1
            m = StatusChanged(
                id=TaskId(task_id),
                status=TaskStatus.RUNNING,
                attempt=attempt,
                at=at,
                message=f"attempt {attempt}" if r.random() < 0.5 else None,
            )
            return m, _Live(phase=_Phase.RUNNING, attempt=attempt, key=st.key), None
        roll = r.random()
        if st.phase is _Phase.RUNNING and roll < 0.1:
            m = StatusChanged(
                id=TaskId(task_id),
                status=TaskStatus.RETRYING,
                attempt=st.attempt,
                at=at,
                message="backing off",
            )
            return m, _Live(phase=_Phase.RETRYING, attempt=st.attempt, key=st.key), None
        if roll < 0.25:
            m = StatusChanged(
                id=TaskId(task_id),
                status=TaskStatus.FAILED,
                attempt=st.attempt,
                at=at,
                message=f"boom {task_id}",
            )
            return m, None, None
        m = StatusChanged(
            id=TaskId(task_id), status=TaskStatus.SUCCEEDED, attempt=st.attempt, at=at
        )
        return m, None, output_for(task_id, st.attempt)

    def plan(self) -> _Planned:
        """The next batch; the workload changes only when `accept` is called with it."""
        r = self.rng
        n = self.config.batch
        at = self._now()
        live = {i: _Live(s.phase, s.attempt, s.key) for i, s in self.live.items()}
        batch: list[Mutation] = []
        outputs: list[tuple[TaskId, bytes]] = []
        records: list[dict[str, Any]] = []
        n_submit = max(1, n // 4)
        # Transitions of live tasks first: keys they release may be reused by new tasks below.
        movable = list(live)
        r.shuffle(movable)
        for task_id in movable[: max(0, n - n_submit - 1)]:
            m, new, out = self._advance(task_id, live[task_id], at)
            batch.append(m)
            records.append(_status_record(m))
            if new is None:
                del live[task_id]
            else:
                live[task_id] = new
            if out is not None:
                outputs.append((TaskId(task_id), out))
                records.append({"op": "output", "id": task_id, "hex": out.hex()})
        live_keys = {s.key for s in live.values() if s.key is not None}
        keys_free = [
            k for k in (f"k{i}" for i in range(self.config.key_pool)) if k not in live_keys
        ]
        known_keys = sorted(live_keys)[:50] + [f"k{i}" for i in range(3)]
        next_id = self.next_id
        submitted: list[int] = []
        for _ in range(n_submit):
            task_id = next_id
            next_id += 1
            spec = self._spec(task_id, keys_free, known_keys)
            sub = Submitted(id=TaskId(task_id), seq=task_id, arrival=at, spec=spec)
            batch.append(sub)
            submitted.append(task_id)
            records.append({"op": "submit", "id": task_id, "key": spec.key, "digest": digest(spec)})
            st = _Live(phase=_Phase.QUEUED, attempt=0, key=spec.key)
            if r.random() < 0.15:  # inserted and moved on within one batch (folding)
                m, new, out = self._advance(task_id, st, at)
                batch.append(m)
                records.append(_status_record(m))
                if new is not None:
                    live[task_id] = new
                elif out is not None:
                    outputs.append((TaskId(task_id), out))
                    records.append({"op": "output", "id": task_id, "hex": out.hex()})
            elif r.random() < 0.03:
                m = StatusChanged(id=TaskId(task_id), status=TaskStatus.CANCELLED, attempt=0, at=at)
                batch.append(m)
                records.append(_status_record(m))
            else:
                live[task_id] = st
        schedules = set(self.schedules)
        roll = r.random()
        name = f"s{r.randrange(self.config.schedules)}"
        if roll < 0.3:
            template = TaskSpec(payload=r.randbytes(8), key=f"from-{name}")
            spec_r = (
                RecurringSpec(
                    name=name, template=template, interval_ns=r.randrange(1, 60) * SECOND_NS
                )
                if r.random() < 0.5
                else RecurringSpec(
                    name=name,
                    template=template,
                    cron=f"{r.randrange(60)} * * * *",
                    timezone="Europe/Paris",
                    misfire="run_once",
                    overlap="skip",
                )
            )
            batch.append(RecurringUpsert(spec=spec_r))
            records.append({"op": "rec_upsert", "name": name, "digest": digest(spec_r)})
            schedules.add(name)
        elif roll < 0.8 and schedules:
            name = r.choice(sorted(schedules))
            nxt = at + SECOND_NS if r.random() < 0.9 else None
            last = submitted[0] if r.random() < 0.8 else None
            batch.append(
                RecurringNext(name=name, next=nxt, last=None if last is None else TaskId(last))
            )
            records.append({"op": "rec_next", "name": name, "next": nxt, "last": last})
        elif roll < 0.85 and schedules:
            name = r.choice(sorted(schedules))
            batch.append(RecurringRemove(name=name))
            records.append({"op": "rec_remove", "name": name})
            schedules.discard(name)
        known = (self.known_ids + submitted)[-400:]
        return _Planned(
            batch=batch,
            outputs=outputs,
            records=records,
            live=live,
            known_ids=known,
            schedules=schedules,
            next_id=next_id,
            submitted=submitted,
        )

    def accept(self, planned: _Planned) -> None:
        """The planned batch was committed."""
        self.live = planned.live
        self.known_ids = planned.known_ids
        self.schedules = planned.schedules
        self.next_id = planned.next_id


_DEP_ON: Final = ("success", "finish")


def _status_record(m: StatusChanged) -> dict[str, Any]:
    return {
        "op": "status",
        "id": int(m.id),
        "status": m.status.value,
        "attempt": m.attempt,
        "message": m.message,
    }


# The driver.


class _StoreWarnings(logging.Handler):
    """Counts (and reports) what the store logs at WARNING and above, busy databases apart."""

    def __init__(self, emit: Emit, summary: DriverSummary) -> None:
        super().__init__(logging.WARNING)
        self._emit = emit
        self._summary = summary

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self._summary.store_warnings += 1
        if "locked" in message or "busy" in message:
            self._summary.busy_warnings += 1
        self._emit(
            {
                "event": "store_log",
                "level": record.levelname,
                "logger": record.name,
                "message": message,
            }
        )


class WorkloadDriver:
    """A leader (or a standby, until it leads) committing a workload and logging its acks."""

    def __init__(
        self,
        store: Store,
        log_path: str | os.PathLike[str],
        config: DriverConfig | None = None,
        *,
        emit: Emit | None = None,
        stop_event: threading.Event | None = None,
    ) -> None:
        """`emit` receives every event; setting `stop_event` stops `run` gracefully."""
        self.store = store
        """The store it drives."""
        self.config = config or DriverConfig()
        """How it behaves."""
        self.run_id = uuid.uuid4().hex[:12]
        """Names this driver in the log and in its events."""
        self.summary = DriverSummary(run=self.run_id)
        """What it did so far."""
        self._emit_fn = emit
        self._emit_lock = threading.Lock()
        self._log = AckLog(log_path)
        seed = self.config.seed if self.config.seed is not None else random.randrange(2**32)
        self.workload = Workload(random.Random(seed), self.config)
        """The generator of its batches (not part of the kit's API)."""
        self.stop_event = stop_event or threading.Event()
        """Set it to stop `run` gracefully."""
        self._pause_requested = threading.Event()
        self._hang_point: HangPoint | None = None
        self._in_commit = threading.local()
        self._gate = threading.Condition()
        self._checked_out = 0
        self._epoch: int | None = None
        self._releasing = False
        self._deadline = (
            None if self.config.duration is None else time.monotonic() + self.config.duration
        )
        store.on_leadership_lost(self._on_lost)
        if isinstance(store, SqlStore):
            self._hook(store)
        self._sql = isinstance(store, SqlStore)
        if self.config.hang_at in _SQL_ONLY and not self._sql:
            raise ValueError(f"hanging {self.config.hang_at} needs a SqlStore")

    # Events.

    def emit(self, event: Event) -> None:
        """Report `event` (with the run id and a wall-clock time) to the emit callback."""
        event = {"t": time.time(), **event, "run": self.run_id, "pid": os.getpid()}
        if self._emit_fn is not None:
            with self._emit_lock:
                self._emit_fn(event)

    def _on_lost(self) -> None:
        if self._releasing:
            return
        self.summary.leadership_lost += 1
        self.emit({"event": "leadership_lost", "epoch": self._epoch})

    # Fault injection and the pause gate, on the SqlStore's engine.

    def _hook(self, store: SqlStore) -> None:
        pool = store.engine.pool

        def checkout(*_args: object) -> None:
            with self._gate:
                self._checked_out += 1

        def checkin(*_args: object) -> None:
            with self._gate:
                self._checked_out = max(0, self._checked_out - 1)
                self._gate.notify_all()

        event.listen(pool, "checkout", checkout)
        event.listen(pool, "checkin", checkin)

        def before_commit(_conn: object) -> None:
            if getattr(self._in_commit, "on", False) and self._armed(HangPoint.IN_COMMIT):
                self._hang(HangPoint.IN_COMMIT)

        event.listen(store.engine, "commit", before_commit)

        def after_execute(_conn: object, cursor: Any, statement: str, *_args: object) -> None:
            """The STOP_IN_* points: right after an UPDATE of the leader row that matched."""
            if "cronoq_leader" not in statement or not statement.lstrip().startswith("UPDATE"):
                return
            if getattr(cursor, "rowcount", 0) != 1:
                return
            in_commit = getattr(self._in_commit, "on", False)
            renewing = threading.current_thread().name.endswith("-renew")
            if in_commit and self._armed(HangPoint.STOP_IN_COMMIT):
                self._stop_here(HangPoint.STOP_IN_COMMIT)
            elif renewing and self._armed(HangPoint.STOP_IN_RENEWAL):
                self._stop_here(HangPoint.STOP_IN_RENEWAL)
            elif not in_commit and not renewing and self._armed(HangPoint.STOP_IN_TAKE):
                self._stop_here(HangPoint.STOP_IN_TAKE)

        event.listen(store.engine, "after_cursor_execute", after_execute)

    def request_pause(self) -> None:
        """Stop this process (SIGSTOP) at the next point where it holds no connection."""
        self._pause_requested.set()

    def arm_hang(self, point: HangPoint | None = None) -> None:
        """Hang at `point` (default: the configured `hang_at`) the next time it is reached."""
        point = point or self.config.hang_at
        if point in _SQL_ONLY and not self._sql:
            raise ValueError(f"hanging {point} needs a SqlStore")
        self._hang_point = point

    def _armed(self, point: HangPoint) -> bool:
        return self._hang_point is point

    def _hang(self, point: HangPoint) -> None:
        self.emit({"event": "hang", "point": point.value, "epoch": self._epoch})
        time.sleep(60)  # waiting to be killed; a test that forgot us must not leave us behind
        os._exit(3)

    def _stop_here(self, point: HangPoint) -> None:
        """SIGSTOP this process where it stands: inside a transaction holding the leader row."""
        self._hang_point = None
        self.emit({"event": "stopping", "point": point.value, "epoch": self._epoch})
        # Sent to this very thread, so it stops here, before its next statement; a signal sent
        # to the process may be taken by another thread while this one runs on to COMMIT.
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        self.emit({"event": "resumed", "point": point.value, "epoch": self._epoch})

    def _pause(self) -> None:
        """SIGSTOP ourselves while no thread holds a connection (so no lock is held)."""
        self._pause_requested.clear()
        with self._gate:
            while self._checked_out:
                self._gate.wait(0.05)
            self.emit({"event": "pausing", "epoch": self._epoch})
            os.kill(os.getpid(), signal.SIGSTOP)
        self.emit({"event": "resumed", "epoch": self._epoch})

    # The loop.

    def _expired(self) -> bool:
        if self.stop_event.is_set():
            return True
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _wait(self, seconds: float) -> None:
        if seconds > 0:
            self.stop_event.wait(seconds)

    def lead(self) -> bool:
        """Become leader and recover; False when stopped first."""
        self.emit({"event": "standby"})
        slice_s = self.config.acquire_slice
        while True:
            if self._expired():
                return False
            if self._pause_requested.is_set():
                self._pause()
            started = time.monotonic()
            try:
                epoch = self.store.acquire_leadership(timeout=slice_s)
            except StoreUnavailable:
                continue
            t_lead = time.time()
            acquire_s = time.monotonic() - started
            break
        self._epoch = epoch
        self.summary.terms += 1
        self.summary.epochs.append(epoch)
        began = time.monotonic()
        recovered = self.store.recover(BASE)
        self.workload.reset(recovered, epoch)
        self.workload.seq = 0
        self.emit(
            {
                "event": "leading",
                "epoch": epoch,
                "t": t_lead,
                "acquire_s": acquire_s,
                "recover_s": time.monotonic() - began,
                "next_id": int(recovered.next_id),
                "start_id": self.workload.next_id,
                "recovered_tasks": len(recovered.tasks),
                "recovered_terminal": len(recovered.terminal),
                "recovered_recurring": len(recovered.recurring),
            }
        )
        return True

    def commit_one(self) -> bool:
        """Commit, log and acknowledge one batch; False when fenced (leadership lost)."""
        epoch = self._epoch
        assert epoch is not None
        planned = self.workload.plan()
        taken, dropped = self._take_inbox(planned)
        self.workload.seq += 1
        seq = self.workload.seq
        batch_id = f"{self.run_id}:{epoch}:{seq}"
        head = {"batch": batch_id, "run": self.run_id, "epoch": epoch, "seq": seq}
        self._log.append({"type": "intent", **head, "muts": planned.records}, sync=False)
        retried = False
        while True:
            was_leader = self.store.is_leader
            self._in_commit.on = True
            try:
                self.store.commit(epoch, BASE, planned.batch, planned.outputs)
            except Fenced as exc:
                self.summary.fenced += 1
                self._log.append({"type": "fenced", **head, "retried": retried}, sync=True)
                self.emit(
                    {
                        "event": "fenced",
                        **head,
                        "ids": planned.submitted,
                        "known_lost": not was_leader,
                        "retried": retried,
                        "message": str(exc),
                    }
                )
                self._epoch = None
                return False
            except StoreUnavailable as exc:
                self.summary.unavailable += 1
                self.emit({"event": "unavailable", **head, "message": str(exc)})
                retried = True
                self._wait(0.05)
                continue
            finally:
                self._in_commit.on = False
            break
        if self._armed(HangPoint.AFTER_COMMIT):
            self._hang(HangPoint.AFTER_COMMIT)
        self._log.append({"type": "ack", **head, "muts": planned.records}, sync=True)
        self.workload.accept(planned)
        self.summary.acked_batches += 1
        self.summary.acked_mutations += len(planned.records)
        self.summary.acked_tasks += len(planned.submitted)
        self.summary.inbox_taken += taken
        self.summary.inbox_dropped += dropped
        self.emit(
            {
                "event": "ack",
                **head,
                "n": len(planned.records),
                "ids": planned.submitted,
                "inbox": taken + dropped,
            }
        )
        if self._armed(HangPoint.AFTER_ACK):
            self._hang(HangPoint.AFTER_ACK)
        return True

    def _take_inbox(self, planned: _Planned) -> tuple[int, int]:
        """Add up to `batch` inbox items to `planned`, as an engine would: each becomes a task
        committed with its `InboxTaken`, or is dropped (alone) when its key is live."""
        read: Callable[..., list[InboxItem]] | None = getattr(self.store, "read_inbox", None)
        if not self.config.inbox or read is None:
            return 0, 0
        items = read(limit=self.config.batch, base=BASE)
        live_keys = {s.key for s in planned.live.values() if s.key is not None}
        at = self.workload._now()
        taken = dropped = 0
        for item in items:
            key = item.spec.key
            if key is not None and key in live_keys:
                planned.batch.append(InboxTaken(inbox_id=item.inbox_id))
                planned.records.append(
                    {"op": "inbox_drop", "inbox_id": item.inbox_id, "digest": digest(item.spec)}
                )
                dropped += 1
                continue
            task_id = planned.next_id
            planned.next_id += 1
            planned.batch.append(
                Submitted(id=TaskId(task_id), seq=task_id, arrival=at, spec=item.spec)
            )
            planned.batch.append(InboxTaken(inbox_id=item.inbox_id))
            spec_digest = digest(item.spec)
            planned.records.append(
                {"op": "submit", "id": task_id, "key": key, "digest": spec_digest}
            )
            planned.records.append(
                {
                    "op": "inbox_taken",
                    "inbox_id": item.inbox_id,
                    "id": task_id,
                    "digest": spec_digest,
                }
            )
            planned.submitted.append(task_id)
            planned.live[task_id] = _Live(phase=_Phase.QUEUED, attempt=0, key=key)
            if key is not None:
                live_keys.add(key)
            taken += 1
        return taken, dropped

    def release(self) -> None:
        """Give leadership up (a standby may take over at once)."""
        epoch = self._epoch
        self._releasing = True
        try:
            self.store.release_leadership()
        finally:
            self._releasing = False
        self._epoch = None
        self.summary.released += 1
        self.emit({"event": "released", "epoch": epoch})

    def run(self) -> DriverSummary:
        """Lead and commit until stopped, the duration ran out or max_batches were acked."""
        handler = _StoreWarnings(self.emit, self.summary)
        store_log = logging.getLogger("cronoq_store")
        store_log.addHandler(handler)
        try:
            self._run()
        except StoreError as exc:
            self.summary.errors.append(f"{type(exc).__name__}: {exc}")
            self.emit({"event": "error", "kind": type(exc).__name__, "message": str(exc)})
            raise
        finally:
            store_log.removeHandler(handler)
            self._log.close()
        return self.summary

    def _done(self) -> bool:
        limit = self.config.max_batches
        return self._expired() or (limit is not None and self.summary.acked_batches >= limit)

    def _run(self) -> None:
        while not self._done():
            if not self.lead():
                break
            term = 0
            while not self._done():
                if self._pause_requested.is_set():
                    self._pause()
                if not self.commit_one():
                    break
                term += 1
                if self.config.turn_batches is not None and term >= self.config.turn_batches:
                    self.release()
                    self._wait(self.config.rest)
                    break
                self._wait(self.config.gap)
        if self._epoch is not None:
            self.release()


# The checker.


def _progress(status: str, attempt: int) -> tuple[int, int, int]:
    """How far a task got: terminal last, then by attempt, retrying after running."""
    st = TaskStatus.from_name(status)
    if st is None:
        return (-1, 0, 0)
    if st.is_terminal:
        return (2, 0, 0)
    sub = {TaskStatus.QUEUED: 0, TaskStatus.WAITING: 0, TaskStatus.RUNNING: 1}.get(st, 2)
    return (1 if attempt or sub else 0, attempt, sub)


@dataclass(slots=True)
class _TaskState:
    key: str | None
    digest: str
    status: str = TaskStatus.QUEUED.value
    attempt: int = 0
    message: str | None = None
    output: bytes | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredTask:
    """A task as the checker reads it from the store."""

    id: int
    """The task's id."""
    key: str | None
    """Its key, if any."""
    status: str
    """Its stored status name."""
    attempt: int
    """The attempt it reached."""
    message: str | None
    """Its stored message."""
    output: bytes | None
    """Its stored output."""


@dataclass(slots=True, kw_only=True)
class CheckReport:
    """What the checker found; `ok` when every invariant holds."""

    records: int = 0
    """Records read from the log."""
    torn_lines: int = 0
    """Log lines that did not parse (torn by a kill)."""
    batches: int = 0
    """Batches the log says may have been committed."""
    acked_batches: int = 0
    """Of those, the acknowledged ones."""
    acked_mutations: int = 0
    """Mutations in acknowledged batches."""
    visible_unacked_batches: int = 0
    """Committed but not acknowledged (killed between commit and log): allowed."""
    invisible_batches: int = 0
    """Never committed (killed before or during the commit, or fenced): allowed unless acked."""
    fenced_batches: int = 0
    """Batches the log records as rejected with `Fenced`."""
    tasks_expected: int = 0
    """Tasks that replaying the visible batches creates."""
    tasks_stored: int = 0
    """Tasks found in the store."""
    live_recovered: int = 0
    """Live tasks that recovery returned."""
    epochs: list[int] = field(default_factory=list)
    """The fencing epochs seen in the log, in order."""
    lost: list[str] = field(default_factory=list)
    """Acknowledged mutations missing, or tasks behind their last acknowledged transition."""
    partial: list[str] = field(default_factory=list)
    """Batches only partly visible."""
    fenced_visible: list[str] = field(default_factory=list)
    """Batches rejected as fenced that are visible anyway."""
    mismatches: list[str] = field(default_factory=list)
    """Differences between the replayed log and the store (tasks, schedules, recovery)."""
    unexplained: list[str] = field(default_factory=list)
    """Stored tasks that no visible batch created."""
    enqueued_committed: int = 0
    """Inbox items whose enqueuing transaction an enqueuer saw commit."""
    enqueued_rolled_back: int = 0
    """Inbox items whose enqueuing transaction an enqueuer rolled back."""
    enqueued_unknown: int = 0
    """Enqueues whose commit raised: they may or may not have landed (both are fine)."""
    inbox_tasks: int = 0
    """Inbox items made into tasks by visible batches."""
    inbox_drops: int = 0
    """Inbox items dropped (alone) by visible batches."""
    inbox_waiting: int = 0
    """Items still in the inbox."""
    inbox_duplicates: list[str] = field(default_factory=list)
    """Inbox items consumed twice (or consumed and still waiting)."""
    inbox_lost: list[str] = field(default_factory=list)
    """Committed enqueues neither consumed nor waiting."""
    inbox_from_rolled_back: list[str] = field(default_factory=list)
    """Rolled-back enqueues that were consumed or are waiting."""

    @property
    def ok(self) -> bool:
        """Whether every invariant holds: all five lists of findings are empty."""
        return not (
            self.lost
            or self.partial
            or self.fenced_visible
            or self.mismatches
            or self.unexplained
            or self.inbox_duplicates
            or self.inbox_lost
            or self.inbox_from_rolled_back
        )

    def as_dict(self, limit: int = 20) -> dict[str, Any]:
        """A JSON-ready summary (lists cut to `limit` items, with their full counts)."""
        out: dict[str, Any] = {"ok": self.ok}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list) and f.name != "epochs":
                out[f.name] = len(value)
                if value:
                    out[f"{f.name}_examples"] = value[:limit]
            else:
                out[f.name] = value
        return out


def _stored_tasks(store: Store, ids: Sequence[int]) -> Iterator[StoredTask]:
    """Every stored task (SqlStore: one scan), or the given ids one by one (any store)."""
    if isinstance(store, SqlStore):
        t = tasks_table.c
        stmt = select(t.id, t.key, t.status, t.attempt, t.message, t.output).order_by(t.id)
        with store.engine.connect() as conn:
            for row in conn.execute(stmt):
                yield StoredTask(
                    id=row.id,
                    key=row.key,
                    status=row.status,
                    attempt=row.attempt,
                    message=row.message,
                    output=None if row.output is None else bytes(row.output),
                )
        return
    for task_id in ids:
        rec = store.get_task(ById(id=TaskId(task_id)))
        if rec is not None:
            yield StoredTask(
                id=int(rec.id),
                key=rec.key,
                status=rec.status.value if rec.status is not None else "?",
                attempt=rec.attempt,
                message=rec.message,
                output=rec.output,
            )


def check(store: Store, log_path: str | os.PathLike[str]) -> CheckReport:
    """Compare `store` with the log its drivers wrote (see the module docs for what holds).

    A `SqlStore` is read with one scan of its tasks table; any other store task by task with
    `get_task`, so that stored tasks no log record names are not looked for there.
    """
    records, torn = read_log(log_path)
    report = CheckReport(records=len(records), torn_lines=torn)
    intents: dict[str, dict[str, Any]] = {}
    acked: set[str] = set()
    fenced: dict[str, bool] = {}
    for rec in records:
        kind, batch = rec.get("type"), str(rec.get("batch"))
        if kind == "intent" or (kind == "ack" and batch not in intents):
            intents[batch] = rec
        if kind == "ack":
            acked.add(batch)
        elif kind == "fenced":
            fenced[batch] = bool(rec.get("retried"))
    report.batches = len(intents)
    report.acked_batches = len(acked)
    report.fenced_batches = len(fenced)

    all_ids = sorted(
        {int(m["id"]) for r in intents.values() for m in r["muts"] if m["op"] == "submit"}
    )
    stored = {t.id: t for t in _stored_tasks(store, all_ids)}
    report.tasks_stored = len(stored)

    # Which batches committed: all their new tasks are stored, or none is.
    visible: list[dict[str, Any]] = []
    for batch, rec in intents.items():
        ids = [int(m["id"]) for m in rec["muts"] if m["op"] == "submit"]
        seen = sum(1 for i in ids if i in stored)
        if ids and 0 < seen < len(ids):
            report.partial.append(f"{batch}: {seen} of {len(ids)} new tasks stored")
        if (ids and seen == len(ids)) or (not ids and batch in acked):
            visible.append(rec)
            if batch not in acked:
                report.visible_unacked_batches += 1
            if batch in fenced and not fenced[batch]:
                report.fenced_visible.append(batch)
        else:
            report.invisible_batches += 1
            if batch in acked:
                report.lost.append(f"{batch}: acknowledged batch not stored")

    # Replay the committed batches in commit order: epoch, then sequence within the term.
    visible.sort(key=lambda r: (int(r["epoch"]), int(r["seq"])))
    report.epochs = sorted({int(r["epoch"]) for r in visible})
    expected: dict[int, _TaskState] = {}
    schedules: dict[str, list[Any]] = {}  # name -> [digest, next, last]
    best: dict[int, tuple[tuple[int, int, int], dict[str, Any]]] = {}
    for rec in visible:
        is_acked = str(rec["batch"]) in acked
        muts: list[dict[str, Any]] = rec["muts"]
        for m in muts:
            op = m["op"]
            if op == "submit":
                expected.setdefault(int(m["id"]), _TaskState(key=m["key"], digest=m["digest"]))
            elif op == "status":
                task = expected.get(int(m["id"]))
                if task is None:
                    report.mismatches.append(f"{rec['batch']}: status of unknown task {m['id']}")
                    continue
                task.status, task.attempt = m["status"], int(m["attempt"])
                if m["message"] is not None:
                    task.message = m["message"]
                if is_acked:
                    prog = _progress(m["status"], int(m["attempt"]))
                    prev = best.get(int(m["id"]))
                    if prev is None or prog >= prev[0]:
                        best[int(m["id"])] = (prog, m)
            elif op == "rec_upsert":
                if m["name"] in schedules:
                    schedules[m["name"]][0] = m["digest"]
                else:
                    schedules[m["name"]] = [m["digest"], None, None]
            elif op == "rec_remove":
                schedules.pop(m["name"], None)
            elif op == "rec_next" and m["name"] in schedules:
                schedules[m["name"]][1:] = [m["next"], m["last"]]
        for m in muts:  # outputs land after the batch's transitions, on succeeded tasks only
            if m["op"] == "output":
                task = expected.get(int(m["id"]))
                if task is not None and task.status == TaskStatus.SUCCEEDED.value:
                    task.output = bytes.fromhex(m["hex"])
        if is_acked:
            report.acked_mutations += len(muts)
    report.tasks_expected = len(expected)

    # Acknowledged mutations lost: missing, or behind the last acknowledged transition.
    for rec in visible:
        if str(rec["batch"]) not in acked:
            continue
        for m in rec["muts"]:
            if m["op"] == "submit" and int(m["id"]) not in stored:
                report.lost.append(f"{rec['batch']}: task {m['id']} not stored")
    for task_id, (prog, m) in best.items():
        got = stored.get(task_id)
        if got is None:
            continue  # reported above
        have = _progress(got.status, got.attempt)
        if have < prog or (prog[0] == 2 and got.status != m["status"]):
            report.lost.append(
                f"task {task_id}: acknowledged {m['status']}/{m['attempt']}, "
                f"stored {got.status}/{got.attempt}"
            )

    # Exact replay: tasks.
    for task_id, want in expected.items():
        got = stored.get(task_id)
        if got is None:
            continue  # a visible batch's tasks are all stored, by construction
        row = (got.key, got.status, got.attempt, got.message, got.output)
        wanted = (want.key, want.status, want.attempt, want.message, want.output)
        if row != wanted:
            report.mismatches.append(f"task {task_id}: stored {row!r}, replayed {wanted!r}")
    for task_id in stored:
        if task_id not in expected:
            report.unexplained.append(f"task {task_id} ({stored[task_id].status})")

    # Recovery: live tasks (their specs round-trip), schedules, and the next id.
    recovered = store.recover(BASE)
    report.live_recovered = len(recovered.tasks)
    live_expected = {i for i, s in expected.items() if not TaskStatus(s.status).is_terminal}
    live_got = {int(t.id) for t in recovered.tasks}
    for task_id in sorted(live_expected ^ live_got)[:100]:
        where = "in the log only" if task_id in live_expected else "in recovery only"
        report.mismatches.append(f"task {task_id}: live {where}")
    for t in recovered.tasks:
        want_state = expected.get(int(t.id))
        if want_state is None:
            continue
        if digest(t.spec) != want_state.digest:
            report.mismatches.append(f"task {t.id}: recovered spec differs from the submitted one")
        if t.attempt != want_state.attempt:
            report.mismatches.append(
                f"task {t.id}: recovered attempt {t.attempt}, replayed {want_state.attempt}"
            )
    _check_inbox(store, records, visible, report)
    top = max(stored, default=-1)
    if stored and recovered.next_id <= top:
        report.mismatches.append(f"recovered next_id {recovered.next_id} <= stored id {top}")
    got_sched = {r.spec.name: [digest(r.spec), r.next, r.last] for r in recovered.recurring}
    for name in sorted(set(schedules) | set(got_sched)):
        if schedules.get(name) != got_sched.get(name):
            report.mismatches.append(
                f"schedule {name}: stored {got_sched.get(name)!r}, replayed {schedules.get(name)!r}"
            )
    return report


def _waiting(store: Store) -> list[InboxItem]:
    read = getattr(store, "read_inbox", None)
    return [] if read is None else list(read(limit=2**31 - 1, base=BASE))


def _check_inbox(
    store: Store,
    records: Sequence[Mapping[str, Any]],
    visible: Sequence[Mapping[str, Any]],
    report: CheckReport,
) -> None:
    """Every committed enqueue became exactly one task or one drop (or still waits), none
    from a rolled-back transaction, none twice, each task with the spec enqueued.

    Items are told apart by their spec's digest (an enqueuer makes every payload unique), not
    by inbox id: SQLite hands the id of a rolled-back insert out again.
    """
    outcome: dict[str, str] = {}
    for rec in records:
        kind = rec.get("type")
        if kind == "enqueue_intent":
            for d in rec["digests"]:
                outcome.setdefault(d, "unknown")
        elif kind in ("enqueue_ack", "enqueue_rollback"):
            for d in rec["digests"]:
                outcome[d] = "committed" if kind == "enqueue_ack" else "rolled_back"
    report.enqueued_committed = sum(1 for o in outcome.values() if o == "committed")
    report.enqueued_rolled_back = sum(1 for o in outcome.values() if o == "rolled_back")
    report.enqueued_unknown = sum(1 for o in outcome.values() if o == "unknown")
    consumed: dict[str, list[str]] = {}
    for rec in visible:
        submitted = {int(m["id"]): m for m in rec["muts"] if m["op"] == "submit"}
        for m in rec["muts"]:
            if m["op"] not in ("inbox_taken", "inbox_drop"):
                continue
            consumed.setdefault(m["digest"], []).append(f"{rec['batch']}#{m['inbox_id']}")
            if m["op"] == "inbox_drop":
                report.inbox_drops += 1
                continue
            report.inbox_tasks += 1
            made = submitted.get(int(m["id"]))
            if made is None or made["digest"] != m["digest"]:
                report.mismatches.append(f"inbox {m['inbox_id']}: task {m['id']} differs")
    waiting = {digest(i.spec): i.inbox_id for i in _waiting(store)}
    report.inbox_waiting = len(waiting)
    for d, where in sorted(consumed.items()):
        if len(where) > 1 or d in waiting:
            also = f" and still waiting as {waiting[d]}" if d in waiting else ""
            report.inbox_duplicates.append(f"item {d}: consumed by {', '.join(where)}{also}")
    for d in sorted(set(consumed) | set(waiting)):
        if outcome.get(d) == "rolled_back":
            report.inbox_from_rolled_back.append(f"item {d}: its enqueue was rolled back")
    for d, o in sorted(outcome.items()):
        if o == "committed" and d not in consumed and d not in waiting:
            report.inbox_lost.append(f"item {d}: committed, never consumed")


# Enqueuers: apps writing into the inbox in their own transactions.


@dataclass(slots=True, kw_only=True)
class EnqueuerSummary:
    """What an enqueuer did, printed as the `exit` event of a process."""

    run: str
    transactions: int = 0
    committed: int = 0
    """Items whose transaction committed."""
    rolled_back: int = 0
    """Items whose transaction was rolled back on purpose."""
    failed: int = 0
    """Transactions whose commit raised (their items' fate is unknown)."""
    errors: list[str] = field(default_factory=list)


def app_engine(url: str | os.PathLike[str]) -> Engine:
    """An app's own engine, set up as docs/embedding.md tells apps to (SQLite: busy timeout)."""
    target = os.fspath(url)
    parsed = make_url(target if "://" in target else f"sqlite:///{target}")
    if parsed.get_backend_name() == "sqlite":
        return create_engine(parsed, connect_args={"timeout": 30})
    return create_engine(parsed)


def run_enqueuer(
    url: str | os.PathLike[str],
    log_path: str | os.PathLike[str],
    *,
    rollback: float = 0.25,
    most: int = 3,
    keyed: float = 0.1,
    gap: float = 0.005,
    seed: int | None = None,
    stop_event: threading.Event | None = None,
    duration: float | None = None,
    emit: Emit | None = None,
) -> EnqueuerSummary:
    """Enqueue 1..`most` tasks per transaction until stopped, rolling back a `rollback` share
    of the transactions on purpose, logging every outcome to the shared log for `check`."""
    rng = random.Random(seed)
    stop = stop_event or threading.Event()
    summary = EnqueuerSummary(run=uuid.uuid4().hex[:12])
    deadline = None if duration is None else time.monotonic() + duration
    engine = app_engine(url)
    try:
        with AckLog(log_path) as ack_log:
            while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
                specs = [
                    TaskSpec(
                        payload=f"{summary.run}:{summary.transactions}:{n}".encode(),
                        kind="inbox",
                        key=f"ek{rng.randrange(4)}" if rng.random() < keyed else None,
                    )
                    for n in range(rng.randint(1, most))
                ]
                undo = rng.random() < rollback
                head = {"run": summary.run, "digests": [digest(s) for s in specs]}
                summary.transactions += 1
                try:
                    with engine.connect() as conn:
                        txn = conn.begin()
                        ids = enqueue_many(conn, specs)
                        ack_log.append(
                            {"type": "enqueue_intent", "inbox_ids": ids, **head}, sync=False
                        )
                        kind = "enqueue_rollback" if undo else "enqueue_ack"
                        if undo:
                            txn.rollback()
                        else:
                            txn.commit()
                    ack_log.append({"type": kind, "inbox_ids": ids, **head}, sync=True)
                    if undo:
                        summary.rolled_back += len(ids)
                    else:
                        summary.committed += len(ids)
                except sa_exc.DBAPIError as exc:
                    summary.failed += 1
                    if emit is not None:
                        emit({"event": "enqueue_failed", "message": str(exc.orig)[:300]})
                    stop.wait(0.05)
                    continue
                stop.wait(gap)
    finally:
        engine.dispose()
    return summary


def enqueuer_argv(
    url: str | os.PathLike[str],
    log_path: str | os.PathLike[str],
    *,
    rollback: float = 0.25,
    keyed: float = 0.1,
    seed: int | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The command of an enqueuer process (for `DriverProcess(argv=...)`)."""
    cmd = [python, "-m", "cronoq_store.testing", "enqueue", "--url", os.fspath(url)]
    cmd += ["--log", os.fspath(log_path), "--rollback", str(rollback), "--keyed", str(keyed)]
    cmd += ["--exit-with-parent"]
    return cmd + ([] if seed is None else ["--seed", str(seed)])


# Driver processes, for tests and demos.


class DriverProcessError(AssertionError):
    """A driver process did not report what was awaited in time, or exited first."""


class DriverProcess:
    """A `python -m cronoq_store.testing drive` process, its JSON events read by a thread.

    `wait` blocks (bounded) until an event arrives; `signal`, `kill`, `stop` and `close`
    control the process; `close` always reaps it.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        log_path: str | os.PathLike[str],
        *,
        name: str = "driver",
        ttl: float = 1.0,
        renew: float | None = None,
        poll: float | None = None,
        batch: int = 16,
        gap: float = 0.01,
        duration: float | None = 300.0,
        extra: Sequence[str] = (),
        stderr_path: str | os.PathLike[str] | None = None,
        control_path: str | os.PathLike[str] | None = None,
        python: str = sys.executable,
        umask: int = -1,
        argv: Sequence[str] | None = None,
    ) -> None:
        """`control_path`: a file through which `arm` names the hang point; `argv`: another
        command of this module to run instead of `drive` (an enqueuer: `enqueuer_argv`)."""
        self.name = name
        """Names the process in messages."""
        self.control_path = None if control_path is None else Path(control_path)
        """The file `arm` writes the hang point to, if any."""
        cmd = [python, "-m", "cronoq_store.testing", "drive", "--url", os.fspath(url)]
        cmd += ["--log", os.fspath(log_path), "--ttl", str(ttl), "--batch", str(batch)]
        cmd += ["--gap", str(gap), "--exit-with-parent"]
        if renew is not None:
            cmd += ["--renew", str(renew)]
        if poll is not None:
            cmd += ["--poll", str(poll)]
        if duration is not None:
            cmd += ["--duration", str(duration)]
        if self.control_path is not None:
            cmd += ["--control", str(self.control_path)]
        cmd += list(extra)
        if argv is not None:
            cmd = list(argv)
        self.events: list[dict[str, Any]] = []
        """Every event the process printed so far, in order."""
        self.stderr_path = None if stderr_path is None else Path(stderr_path)
        """Where the process's stderr goes (0600), if anywhere."""
        self._cond = threading.Condition()
        err = None if self.stderr_path is None else _private_file(self.stderr_path)
        try:
            self.proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=err if err is not None else subprocess.DEVNULL,
                umask=umask,
            )
            """The process itself."""
        finally:
            if err is not None:
                os.close(err)
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        """The process id."""
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                ev = {"event": "garbage", "line": line.decode(errors="replace")}
            if not isinstance(ev, dict):
                ev = {"event": "garbage", "line": repr(ev)}
            with self._cond:
                self.events.append(ev)
                self._cond.notify_all()
        with self._cond:
            self.events.append({"event": "eof", "t": time.time()})
            self._cond.notify_all()

    def mark(self) -> int:
        """The index the next event will have (to wait for events after now)."""
        with self._cond:
            return len(self.events)

    def wait(
        self,
        name: str,
        *,
        start: int = 0,
        timeout: float = 20.0,
        where: Callable[[dict[str, Any]], bool] | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """The first event `name` at or after index `start` (that satisfies `where`)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            i = start
            while True:
                while i < len(self.events):
                    ev = self.events[i]
                    if ev.get("event") == name and (where is None or where(ev)):
                        return i, ev
                    if ev.get("event") == "eof" and name != "eof":
                        raise DriverProcessError(
                            f"{self.name} exited while waiting for {name}: {self.tail()}"
                        )
                    i += 1
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DriverProcessError(
                        f"{self.name}: no {name} event within {timeout} s: {self.tail()}"
                    )
                self._cond.wait(left)

    def since(self, start: int, name: str) -> list[dict[str, Any]]:
        """Events `name` from index `start` on."""
        with self._cond:
            return [e for e in self.events[start:] if e.get("event") == name]

    def tail(self) -> str:
        """The last events and the end of stderr, for error messages."""
        with self._cond:
            events = [json.dumps(e)[:300] for e in self.events[-8:]]
        err = ""
        if self.stderr_path is not None and self.stderr_path.exists():
            err = self.stderr_path.read_text(errors="replace")[-2000:]
        return "\n  events: " + "\n    ".join(events) + "\n  stderr: " + err

    def state(self) -> str:
        """The process state letter from /proc ("T" while stopped; "?" if unknown)."""
        try:
            stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        except OSError:
            return "?"
        return stat.rsplit(")", 1)[1].split()[0]

    def wait_stopped(self, timeout: float = 5.0) -> None:
        """Wait until the process is stopped (after it reported `pausing`)."""
        deadline = time.monotonic() + timeout
        while self.state() != "T":
            if time.monotonic() > deadline:
                raise DriverProcessError(f"{self.name} did not stop within {timeout} s")
            time.sleep(0.005)

    def signal(self, sig: signal.Signals) -> None:
        """Send `sig` to the process."""
        self.proc.send_signal(sig)

    def arm(self, point: HangPoint) -> None:
        """Make it hang at `point` the next time it gets there (needs `control_path`)."""
        if self.control_path is None:
            raise ValueError("arm needs a DriverProcess started with control_path")
        self.control_path.write_text(point.value)
        self.proc.send_signal(signal.SIGUSR2)

    def kill(self) -> float:
        """SIGKILL it and reap it; the wall-clock time the signal was sent."""
        t = time.time()
        self.proc.kill()
        self.proc.wait(10)
        return t

    def stop(self, timeout: float = 20.0) -> dict[str, Any]:
        """Stop it gracefully (SIGTERM: it releases the lease) and return its exit summary.

        Waits for it to have started first: before that, SIGTERM would just end it.
        """
        self.wait("started", timeout=timeout)
        self.proc.send_signal(signal.SIGCONT)
        self.proc.send_signal(signal.SIGTERM)
        _, ev = self.wait("exit", timeout=timeout)
        self.proc.wait(timeout)
        return ev

    def close(self) -> None:
        """Kill it if it still runs, reap it, and close its pipe."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)
        self._reader.join(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> DriverProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# The command line.


def _emit_stdout(event: Event) -> None:
    sys.stdout.write(json.dumps(event, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def _store_config(args: argparse.Namespace) -> StoreConfig:
    ttl = timedelta(seconds=args.ttl)
    renew = timedelta(seconds=args.renew) if args.renew else ttl / 3
    poll = timedelta(seconds=args.poll) if args.poll else min(ttl / 10, timedelta(seconds=0.5))
    return StoreConfig(lease_ttl=ttl, lease_renew=renew, lock_poll=poll)


def _drive(args: argparse.Namespace) -> int:
    config = DriverConfig(
        batch=args.batch,
        gap=args.gap,
        duration=args.duration,
        max_batches=args.max_batches,
        turn_batches=args.turn_batches,
        rest=args.rest,
        seed=args.seed,
        hang_at=HangPoint(args.hang_at) if args.hang_at else None,
    )
    # Signals are handled from the start: a SIGTERM while the store opens stops cleanly too.
    stop_event = threading.Event()
    drivers: list[WorkloadDriver] = []

    def stop(_sig: int, _frame: FrameType | None) -> None:
        stop_event.set()

    def pause(_sig: int, _frame: FrameType | None) -> None:
        for driver in drivers:
            driver.request_pause()

    def arm(_sig: int, _frame: FrameType | None) -> None:
        point = None
        if args.control:
            try:
                point = HangPoint(Path(args.control).read_text().strip())
            except (OSError, ValueError):
                point = None
        for driver in drivers:
            driver.arm_hang(point)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGUSR1, pause)
    signal.signal(signal.SIGUSR2, arm)
    if args.exit_with_parent:
        parent = os.getppid()

        def watch() -> None:
            while not stop_event.wait(0.5):
                if os.getppid() != parent:
                    stop_event.set()

        threading.Thread(target=watch, daemon=True, name="parent-watch").start()
    with SqlStore.open(args.url, _store_config(args)) as store:
        driver = WorkloadDriver(store, args.log, config, emit=_emit_stdout, stop_event=stop_event)
        drivers.append(driver)
        driver.emit({"event": "started", "holder": store.holder})
        try:
            driver.run()
        except StoreError:
            _emit_stdout({"event": "exit", **dataclasses.asdict(driver.summary)})
            return 2
    _emit_stdout({"event": "exit", **dataclasses.asdict(driver.summary)})
    return 0


def _enqueue(args: argparse.Namespace) -> int:
    stop_event = threading.Event()
    signal.signal(signal.SIGTERM, lambda _s, _f: stop_event.set())
    signal.signal(signal.SIGINT, lambda _s, _f: stop_event.set())
    if args.exit_with_parent:
        parent = os.getppid()

        def watch() -> None:
            while not stop_event.wait(0.5):
                if os.getppid() != parent:
                    stop_event.set()

        threading.Thread(target=watch, daemon=True, name="parent-watch").start()
    _emit_stdout({"event": "started", "t": time.time()})
    summary = run_enqueuer(
        args.url,
        args.log,
        rollback=args.rollback,
        keyed=args.keyed,
        seed=args.seed,
        stop_event=stop_event,
        duration=args.duration,
        emit=_emit_stdout,
    )
    _emit_stdout({"event": "exit", **dataclasses.asdict(summary)})
    return 0


def _check(args: argparse.Namespace) -> int:
    with SqlStore.open(args.url, StoreConfig(migrate=False)) as store:
        report = check(store, args.log)
    _emit_stdout(report.as_dict())
    return 0 if report.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m cronoq_store.testing drive|check ...`."""
    parser = argparse.ArgumentParser(prog="python -m cronoq_store.testing", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    drive = sub.add_parser("drive", help="lead (or stand by) and commit a logged workload")
    check_p = sub.add_parser("check", help="compare a database with a workload log")
    enq = sub.add_parser("enqueue", help="enqueue into the inbox in transactions, logged")
    for p in (drive, check_p, enq):
        p.add_argument("--url", required=True, help="database URL or SQLite file path")
        p.add_argument("--log", required=True, help="the shared JSON-lines log")
    drive.add_argument("--ttl", type=float, default=10.0, help="lease TTL, seconds")
    drive.add_argument("--renew", type=float, default=None, help="lease renewal, seconds")
    drive.add_argument("--poll", type=float, default=None, help="standby poll, seconds")
    drive.add_argument("--batch", type=int, default=20, help="mutations per commit")
    drive.add_argument("--gap", type=float, default=0.0, help="seconds between commits")
    drive.add_argument("--duration", type=float, default=None, help="stop after, seconds")
    drive.add_argument("--max-batches", type=int, default=None)
    drive.add_argument("--turn-batches", type=int, default=None, help="release after N per term")
    drive.add_argument("--rest", type=float, default=0.2, help="rest after a release, seconds")
    drive.add_argument("--seed", type=int, default=None)
    drive.add_argument("--hang-at", choices=[p.value for p in HangPoint], default=None)
    drive.add_argument(
        "--control",
        default=None,
        help="file naming the hang point that SIGUSR2 arms (else --hang-at)",
    )
    drive.add_argument("--exit-with-parent", action="store_true")
    enq.add_argument("--rollback", type=float, default=0.25, help="share rolled back")
    enq.add_argument("--keyed", type=float, default=0.1, help="share with a key (may clash)")
    enq.add_argument("--seed", type=int, default=None)
    enq.add_argument("--duration", type=float, default=None, help="stop after, seconds")
    enq.add_argument("--exit-with-parent", action="store_true")
    drive.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    if args.command == "drive":
        logging.basicConfig(level=args.log_level, stream=sys.stderr)
        return _drive(args)
    if args.command == "enqueue":
        return _enqueue(args)
    return _check(args)


if __name__ == "__main__":
    sys.exit(main())
