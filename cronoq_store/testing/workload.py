"""The workload: batches of realistic mutations generated from what the current leader
knows (tasks with keys and dependencies, transitions with outputs, recurring schedules), each
with the log records the checker replays.
"""

from __future__ import annotations

import enum
import random
import time
from dataclasses import dataclass
from typing import Any, Final

from ..model import (
    ById,
    ByKey,
    Dep,
    FixedStart,
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
    TaskSpec,
    TaskStatus,
)
from .base import BASE, EPOCH_SHIFT, SECOND_NS, digest
from .config import DriverConfig


def output_for(task_id: int, attempt: int) -> bytes:
    """The output the workload stores for a task that succeeded.

    Args:
        task_id: The task's id.
        attempt: The attempt that succeeded.

    Returns:
        The output bytes (derived from both, so the checker can verify them).
    """
    return b"out:%d:%d" % (task_id, attempt)


class Phase(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    RETRYING = "retrying"
    STARTED = "started"
    """Recovered with an attempt: running or retrying, which recovery does not tell."""


@dataclass(slots=True)
class Live:
    phase: Phase
    attempt: int
    key: str | None


@dataclass(slots=True)
class Planned:
    """A batch and the workload state it leads to once committed."""

    batch: list[Mutation]
    outputs: list[tuple[TaskId, bytes]]
    records: list[dict[str, Any]]
    live: dict[int, Live]
    known_ids: list[int]
    schedules: set[str]
    next_id: int
    submitted: list[int]


class Workload:
    """Generates batches from what the current leader knows, and learns from recovery."""

    def __init__(self, rng: random.Random, config: DriverConfig) -> None:
        self.rng = rng
        self.config = config
        self.live: dict[int, Live] = {}
        self.known_ids: list[int] = []
        self.schedules: set[str] = set()
        self.next_id = 0
        self.seq = 0

    def reset(self, recovered: Recovered, epoch: int) -> None:
        """Start a term from what recovery returned."""
        self.next_id = max(int(recovered.next_id), epoch << EPOCH_SHIFT)
        self.live = {
            int(t.id): Live(
                phase=Phase.QUEUED if t.attempt == 0 else Phase.STARTED,
                attempt=t.attempt,
                key=t.spec.key,
            )
            for t in recovered.tasks
        }
        self.known_ids = [int(t.id) for t in recovered.terminal[-200:]] + list(self.live)[-200:]
        self.schedules = {r.spec.name for r in recovered.recurring}

    def now(self) -> int:
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
        now = self.now()
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
        self, task_id: int, st: Live, at: int
    ) -> tuple[StatusChanged, Live | None, bytes | None]:
        """The next transition of a live task; None as new state once it finished."""
        r = self.rng
        if st.phase is Phase.QUEUED or st.phase is Phase.RETRYING:
            attempt = st.attempt + 1
            m = StatusChanged(
                id=TaskId(task_id),
                status=TaskStatus.RUNNING,
                attempt=attempt,
                at=at,
                message=f"attempt {attempt}" if r.random() < 0.5 else None,
            )
            return m, Live(phase=Phase.RUNNING, attempt=attempt, key=st.key), None
        roll = r.random()
        if st.phase is Phase.RUNNING and roll < 0.1:
            m = StatusChanged(
                id=TaskId(task_id),
                status=TaskStatus.RETRYING,
                attempt=st.attempt,
                at=at,
                message="backing off",
            )
            return m, Live(phase=Phase.RETRYING, attempt=st.attempt, key=st.key), None
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

    def plan(self) -> Planned:
        """The next batch; the workload changes only when `accept` is called with it."""
        r = self.rng
        n = self.config.batch
        at = self.now()
        live = {i: Live(s.phase, s.attempt, s.key) for i, s in self.live.items()}
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
            st = Live(phase=Phase.QUEUED, attempt=0, key=spec.key)
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
        return Planned(
            batch=batch,
            outputs=outputs,
            records=records,
            live=live,
            known_ids=known,
            schedules=schedules,
            next_id=next_id,
            submitted=submitted,
        )

    def accept(self, planned: Planned) -> None:
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
