"""A model-based check of `SqlStore` on every dialect.

A Hypothesis `RuleBasedStateMachine` drives a real store with random batches and checks it
against a plain-Python model of the store's documented rules after every step:

- a batch folds in order: a transition of a task submitted earlier in the batch goes into its
  insert; any other transition updates the stored row first, and has no effect (a warning) when
  the task is not stored yet; an insert of a task already stored is ignored with everything
  folded into it;
- a terminal transition releases the task's key and dependency rows, a live one (a revival)
  takes them back; a key live on two tasks at once refuses the whole batch;
- a value that cannot be stored (a time outside the 64-bit range under the commit's base)
  refuses the whole batch; a deposed leader's batch is fenced off;
- recovery converts stored times to its base saturating; `next_id` is one above every id used;
- prune deletes finished tasks older than its cutoff (saturated) that no live task depends on.

Rules: new batches (submissions with keys and dependencies by id and by key, transitions of any
kind, outputs, schedules), replays of earlier batches, prune, a moving clock, recovery under a
moved base, and a takeover by a second store that fences the first. Ids and times include the
ends of the 64-bit range. The default run is small; `--soak` runs many more examples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import URL, delete, update

import cronoq_store as cq
from cronoq_store.inbox import enqueue
from cronoq_store.model import INT64_MAX, INT64_MIN
from cronoq_store.model import SECOND_NS as SECOND
from cronoq_store.schema import inbox, leader, recurring, task_deps, tasks

HOUR = 3600 * SECOND
START_UNIX = 1_700_000_000 * SECOND
RETENTION = timedelta(hours=1)
KEYS = ("a", "b")
NAMES = ("s1", "s2")
EDGE_TIMES = (INT64_MIN, INT64_MIN + 1, INT64_MAX - 1, INT64_MAX)
EDGE_IDS = (INT64_MIN, INT64_MAX - 1, INT64_MAX)
BASES = (START_UNIX, 0, -START_UNIX)
"""Commit bases (Unix ns of engine time 0): with engine time 0 at "now", at the epoch, before."""


def saturate(value: int) -> int:
    return max(INT64_MIN, min(INT64_MAX, value))


def ns(d: timedelta) -> int:
    return d // timedelta(microseconds=1) * 1000


# The model.


@dataclass
class MTask:
    """A stored task, its times in Unix ns."""

    id: int
    seq: int
    arrival: int
    spec: cq.TaskSpec
    deadline: int | None
    fixed_at: int | None
    status: cq.TaskStatus = cq.TaskStatus.QUEUED
    attempt: int = 0
    updated: int = 0
    message: str | None = None
    output: bytes | None = None

    @property
    def live(self) -> bool:
        return not self.status.is_terminal


@dataclass
class MSchedule:
    """A stored schedule: the spec as committed, its base, and where it stands (Unix ns)."""

    spec: cq.RecurringSpec
    base: int
    next: int | None = None
    last: int | None = None


@dataclass
class Model:
    tasks: dict[int, MTask] = field(default_factory=dict)
    schedules: dict[str, MSchedule] = field(default_factory=dict)
    high_water: int = 0
    """The first id never used, saturated at INT64_MAX (as the leader row keeps it)."""
    inbox: dict[int, bytes] = field(default_factory=dict)
    """Items waiting in the inbox: their payloads by inbox id."""

    def copy(self) -> Model:
        return Model(
            tasks={i: dataclasses.replace(t) for i, t in self.tasks.items()},
            schedules={n: dataclasses.replace(s) for n, s in self.schedules.items()},
            high_water=self.high_water,
            inbox=dict(self.inbox),
        )

    def needed(self, task: MTask) -> bool:
        """Whether a live task depends on `task`, by id or by key."""
        for other in self.tasks.values():
            if not other.live:
                continue
            for d in other.spec.deps:
                if isinstance(d.target, cq.ById) and d.target.id == task.id:
                    return True
                if isinstance(d.target, cq.ByKey) and d.target.key == task.spec.key:
                    return True
        return False

    def next_id(self) -> int:
        high = 2**63 if self.high_water == INT64_MAX else self.high_water
        return max(high, max(self.tasks, default=-1) + 1)


class Refused(Exception):
    """The model refuses the batch: nothing is written."""

    def __init__(self, error: type[Exception]) -> None:
        self.error = error


def unix(base: int, t: int) -> int:
    u = base + t
    if not INT64_MIN <= u <= INT64_MAX:
        raise Refused(cq.InvalidValue)
    return u


def unix_opt(base: int, t: int | None) -> int | None:
    return None if t is None else unix(base, t)


def check_schedule(base: int, spec: cq.RecurringSpec) -> None:
    """Refuse a schedule whose times cannot be stored under `base`."""
    unix_opt(base, spec.start)
    unix_opt(base, spec.end)
    unix_opt(base, spec.template.deadline)
    if spec.template.fixed_start is not None:
        unix(base, spec.template.fixed_start.at)


def commit(
    model: Model,
    base: int,
    now: int,
    batch: Sequence[cq.Mutation],
    outputs: Sequence[tuple[int, bytes]],
) -> Model:
    """The state after committing `batch`, by the documented rules (docs/guarantees.md,
    "Independent of batching"), read one mutation at a time; `Refused` if refused.

    Written from the rule, not from the fold: a transition of a task whose `Submitted` came
    earlier in the batch applies to that new task (to nothing, when the task was stored
    already: its insert is ignored with everything folded into it); any other transition
    applies to the task as stored before the batch, or to nothing (not stored, even if its
    `Submitted` comes later in the batch); `InboxTaken` removes its item.
    """
    after = model.copy()
    submitted: dict[int, bool] = {}
    """Ids submitted so far in the batch: whether the submission made a new task."""
    for m in batch:
        if isinstance(m, cq.Submitted):
            if m.id in submitted:
                continue  # the first submission stands: nothing of this one is looked at
            arrival = unix(base, m.arrival)
            deadline = unix_opt(base, m.spec.deadline)
            fixed = None if m.spec.fixed_start is None else unix(base, m.spec.fixed_start.at)
            new = m.id not in model.tasks
            submitted[m.id] = new
            if new:
                after.tasks[m.id] = MTask(
                    id=m.id,
                    seq=m.seq,
                    arrival=arrival,
                    spec=m.spec,
                    deadline=deadline,
                    fixed_at=fixed,
                    updated=now,
                )
        elif isinstance(m, cq.StatusChanged):
            at = unix(base, m.at)
            if submitted.get(m.id, m.id in model.tasks):
                task = after.tasks[m.id]
                task.status, task.attempt, task.updated = m.status, m.attempt, at
                if m.message is not None:
                    task.message = m.message
        elif isinstance(m, cq.InboxTaken):
            after.inbox.pop(m.inbox_id, None)
        elif isinstance(m, cq.RecurringUpsert):
            check_schedule(base, m.spec)
        elif isinstance(m, cq.RecurringNext):
            unix_opt(base, m.next)
    if submitted:
        after.high_water = max(after.high_water, min(max(submitted) + 1, INT64_MAX))
    holders: dict[str, list[int]] = {}
    for t in after.tasks.values():
        if t.live and t.spec.key is not None:
            holders.setdefault(t.spec.key, []).append(t.id)
    clashes = [ids for ids in holders.values() if len(ids) > 1]
    if clashes:
        # Two tasks the batch submits under one key (a stored one submitted again included):
        # the store names the batch (`InvalidValue`); a clash between a task of the batch and
        # one it does not mention is the database's refusal, never `InvalidValue`.
        if any(sum(i in submitted for i in ids) > 1 for ids in clashes):
            raise Refused(cq.InvalidValue)
        raise Refused(cq.StoreError)
    for task_id, output in outputs:
        task = after.tasks.get(task_id)
        if task is not None and task.status is cq.TaskStatus.SUCCEEDED:
            task.output = output
    for m in batch:
        if isinstance(m, cq.RecurringUpsert):
            old = after.schedules.get(m.spec.name)
            after.schedules[m.spec.name] = MSchedule(
                spec=m.spec,
                base=base,
                next=None if old is None else old.next,
                last=None if old is None else old.last,
            )
        elif isinstance(m, cq.RecurringRemove):
            after.schedules.pop(m.name, None)
        elif isinstance(m, cq.RecurringNext) and m.name in after.schedules:
            s = after.schedules[m.name]
            s.next, s.last = unix_opt(base, m.next), m.last
    return after


# What the store should answer.


def at_base(base: int, u: int | None) -> int | None:
    return None if u is None else saturate(u - base)


def respec(spec: cq.TaskSpec, from_base: int, to_base: int) -> cq.TaskSpec:
    """`spec` committed under `from_base`, as recovered under `to_base` (saturating)."""
    fixed = spec.fixed_start
    return dataclasses.replace(
        spec,
        deadline=at_base(to_base, unix_opt(from_base, spec.deadline)),
        fixed_start=None
        if fixed is None
        else dataclasses.replace(fixed, at=at_base(to_base, unix(from_base, fixed.at))),
    )


def expected_recovery(
    model: Model, base: int, now: int
) -> tuple[int, list[cq.RecoveredTask], list[cq.RecoveredTerminal], list[cq.RecoveredRecurring]]:
    cutoff = saturate(now - ns(RETENTION))
    live = [
        cq.RecoveredTask(
            id=cq.TaskId(t.id),
            seq=t.seq,
            arrival=saturate(t.arrival - base),
            spec=dataclasses.replace(
                t.spec,
                deadline=at_base(base, t.deadline),
                fixed_start=None
                if t.spec.fixed_start is None
                else dataclasses.replace(t.spec.fixed_start, at=at_base(base, t.fixed_at)),
            ),
            attempt=t.attempt,
        )
        for _, t in sorted(model.tasks.items())
        if t.live
    ]
    finished = sorted(
        (t.updated, t.id, t)
        for t in model.tasks.values()
        if not t.live and (t.updated >= cutoff or model.needed(t))
    )
    terminal = [
        cq.RecoveredTerminal(
            id=cq.TaskId(t.id), key=t.spec.key, status=t.status, at=saturate(t.updated - base)
        )
        for _, _, t in finished
    ]
    schedules = [
        cq.RecoveredRecurring(
            spec=dataclasses.replace(
                s.spec,
                start=at_base(base, unix_opt(s.base, s.spec.start)),
                end=at_base(base, unix_opt(s.base, s.spec.end)),
                template=respec(s.spec.template, s.base, base),
            ),
            next=at_base(base, s.next),
            last=None if s.last is None else cq.TaskId(s.last),
        )
        for _, s in sorted(model.schedules.items())
    ]
    return model.next_id(), live, terminal, schedules


def record(t: MTask) -> cq.TaskRecord:
    return cq.TaskRecord(
        id=cq.TaskId(t.id),
        key=t.spec.key,
        pool=t.spec.pool,
        kind=t.spec.kind,
        priority=t.spec.priority,
        tenant=t.spec.tenant,
        status=t.status,
        attempt=t.attempt,
        message=t.message,
        output=t.output,
        updated=datetime(1970, 1, 1, tzinfo=UTC)
        + timedelta(microseconds=max(0, t.updated) // 1000),
    )


# The harness: stores on one database, a clock the test sets.


@dataclass
class Harness:
    stores: list[cq.SqlStore]
    leader: int = 0
    clock: list[int] = field(default_factory=lambda: [START_UNIX])
    examples: int = 0
    steps: int = 0

    @property
    def store(self) -> cq.SqlStore:
        return self.stores[self.leader]

    def epoch(self) -> int:
        epoch = self.store.epoch
        assert epoch is not None
        return epoch

    def reset(self) -> None:
        """Empty the tables between examples; the lease stays with the current leader."""
        self.clock[0] = START_UNIX
        with self.store.engine.begin() as conn:
            conn.execute(delete(task_deps))
            conn.execute(delete(tasks))
            conn.execute(delete(recurring))
            conn.execute(delete(inbox))
            conn.execute(update(leader).values(next_id=0))

    def take_over(self) -> cq.SqlStore:
        """The standby leads (the leader's lease made to run out); returns the deposed one."""
        old = self.store
        self.leader = 1 - self.leader
        for _ in range(5):
            with old.engine.begin() as conn:
                conn.execute(update(leader).values(expires_unix_ns=0))
            try:
                self.store.acquire_leadership(timeout=2)
                return old
            except cq.StoreError:  # the old keeper renewed in between: expire it again
                continue
        raise AssertionError("the standby could not take over")


# Strategies.


times_near = st.sampled_from([-2 * HOUR, -HOUR - 1, -HOUR, -30 * 60 * SECOND, 0, SECOND])


@st.composite
def engine_times(draw: st.DrawFn, now_t: int) -> int:
    """Mostly around the engine's "now" (retention boundaries), sometimes the range's ends."""
    if draw(st.integers(0, 3)) == 0:
        return draw(st.sampled_from(EDGE_TIMES))
    return saturate(now_t + draw(times_near))


class StoreMachine(RuleBasedStateMachine):
    harness: Harness

    def __init__(self) -> None:
        super().__init__()
        self.h = type(self).harness
        self.h.reset()
        self.h.examples += 1
        self.model = Model()
        self.base = START_UNIX
        self.next_new = 0
        self.next_inbox = 0
        self.history: list[tuple[int, list[cq.Mutation], list[tuple[int, bytes]]]] = []

    @property
    def now(self) -> int:
        return self.h.clock[0]

    def _apply(
        self,
        batch: list[cq.Mutation],
        outputs: list[tuple[int, bytes]],
        base: int | None = None,
        store: cq.SqlStore | None = None,
    ) -> None:
        """Commit `batch` on the store and the model; both must agree on the outcome."""
        base = self.base if base is None else base
        self.h.steps += 1
        try:
            want: Model | Refused = commit(self.model, base, self.now, batch, outputs)
        except Refused as refused:
            want = refused
        store = store or self.h.store
        epoch = self.h.epoch() if store is self.h.store else (store.epoch or 1)
        error: cq.StoreError | None = None
        try:
            store.commit(epoch, cq.TimeBase(base), batch, [(cq.TaskId(i), o) for i, o in outputs])
        except cq.StoreError as exc:
            error = exc
        if store is not self.h.store:
            assert isinstance(error, cq.Fenced | cq.InvalidValue), f"a deposed leader: {error!r}"
            return  # fenced off (or refused before it even tried)
        if error is not None:
            assert isinstance(want, Refused), f"the store refused what the model took: {error!r}"
            # An invalid value found while writing schedules (the last step) may come after a
            # key conflict: either refusal writes nothing. A conflict is never InvalidValue.
            if want.error is cq.StoreError:
                assert not isinstance(error, cq.InvalidValue), error
            return
        assert isinstance(want, Model), f"the store took a batch the model refuses: {want.error}"
        self.model = want
        self.history.append((base, batch, outputs))

    # Batches.

    def draw_batch(self, data: st.DataObject) -> tuple[list[cq.Mutation], list[tuple[int, bytes]]]:
        """A batch an engine could send (and some it should not: edge times, clashing keys)."""
        draw = data.draw
        now_t = saturate(self.now - self.base)
        known = sorted(self.model.tasks)
        batch: list[cq.Mutation] = []
        outputs: list[tuple[int, bytes]] = []
        seen = list(known)
        live_keys = {t.spec.key for t in self.model.tasks.values() if t.live and t.spec.key}
        for _ in range(draw(st.integers(1, 6))):
            kind = draw(
                st.sampled_from(
                    ["submit", "submit", "status", "status", "status", "sched", "inbox"]
                )
            )
            if kind == "inbox":
                # An item made into a task (with its InboxTaken), or dropped alone; now and
                # then one already taken, or never enqueued (its InboxTaken changes nothing).
                waiting = sorted(self.model.inbox)
                inbox_id = draw(st.sampled_from([*waiting, self.next_inbox + 7]))
                payload = self.model.inbox.get(inbox_id)
                if payload is not None and draw(st.booleans()):
                    task_id = self.next_new
                    self.next_new += 1
                    batch.append(
                        cq.Submitted(
                            id=cq.TaskId(task_id),
                            seq=0,
                            arrival=now_t,
                            spec=cq.TaskSpec(payload=payload),
                        )
                    )
                    seen.append(task_id)
                batch.append(cq.InboxTaken(inbox_id=inbox_id))
            elif kind == "submit" or not seen:
                if draw(st.integers(0, 6)) == 0:
                    task_id = draw(st.sampled_from(EDGE_IDS))
                elif seen and draw(st.integers(0, 5)) == 0:
                    task_id = draw(st.sampled_from(seen))  # submitted again
                else:
                    task_id = self.next_new
                    self.next_new += draw(st.integers(1, 2))
                targets: list[cq.ById | cq.ByKey] = [cq.ById(cq.TaskId(i)) for i in seen[-4:]]
                targets += [cq.ByKey(k) for k in KEYS]
                deps = tuple(
                    cq.Dep(
                        target=draw(st.sampled_from(targets)),
                        on=draw(st.sampled_from(["success", "finish"])),
                    )
                    for _ in range(draw(st.integers(0, 2)))
                )
                deadline = draw(st.none() | engine_times(now_t))
                fixed = draw(st.none() | engine_times(now_t).map(lambda at: cq.FixedStart(at=at)))
                spec = cq.TaskSpec(
                    payload=draw(st.binary(max_size=3)),
                    pool=draw(st.sampled_from(["default", "gpu"])),
                    priority=draw(st.sampled_from(cq.Priority)),
                    key=draw(st.none() | st.sampled_from(KEYS)),
                    deadline=deadline,
                    fixed_start=fixed,
                    deps=deps,
                )
                batch.append(
                    cq.Submitted(
                        id=cq.TaskId(task_id),
                        seq=draw(st.integers(0, 3)),
                        arrival=draw(engine_times(now_t)),
                        spec=spec,
                    )
                )
                seen.append(task_id)
            elif kind == "status":
                task_id = draw(st.sampled_from(seen) | st.just(self.next_new + 5))
                stored = self.model.tasks.get(task_id)
                status = draw(st.sampled_from(cq.TaskStatus))
                if (
                    stored is not None
                    and not stored.live
                    and not status.is_terminal
                    and stored.spec.key in live_keys
                ):
                    # A revival whose key is live elsewhere: refused (tested in test_edges) but
                    # where the clash is caught depends on statement order; keep it terminal.
                    status = cq.TaskStatus.CANCELLED
                batch.append(
                    cq.StatusChanged(
                        id=cq.TaskId(task_id),
                        status=status,
                        attempt=draw(st.integers(0, 3)),
                        at=draw(engine_times(now_t)),
                        message=draw(st.none() | st.sampled_from(["m1", "m2"])),
                    )
                )
                if status is cq.TaskStatus.SUCCEEDED and draw(st.booleans()):
                    outputs.append((task_id, draw(st.binary(max_size=3))))
            else:
                name = draw(st.sampled_from(NAMES))
                choice = draw(st.integers(0, 3))
                if choice <= 1:
                    start = draw(st.none() | engine_times(now_t))
                    template = cq.TaskSpec(
                        payload=draw(st.binary(max_size=2)),
                        deadline=draw(st.none() | engine_times(now_t)),
                    )
                    batch.append(
                        cq.RecurringUpsert(
                            spec=cq.RecurringSpec(
                                name=name,
                                template=template,
                                interval_ns=HOUR,
                                start=start,
                                end=None if start is None else saturate(start + HOUR),
                            )
                        )
                    )
                elif choice == 2:
                    last = draw(st.none() | st.sampled_from(seen)) if seen else None
                    batch.append(
                        cq.RecurringNext(
                            name=name,
                            next=draw(st.none() | engine_times(now_t)),
                            last=None if last is None else cq.TaskId(last),
                        )
                    )
                else:
                    batch.append(cq.RecurringRemove(name=name))
        return batch, outputs

    @rule(data=st.data())
    def commit_batch(self, data: st.DataObject) -> None:
        batch, outputs = self.draw_batch(data)
        self._apply(batch, outputs)

    @rule(data=st.data())
    def replay(self, data: st.DataObject) -> None:
        """An earlier batch committed again (a retry after a timeout, much later)."""
        if self.history:
            base, batch, outputs = data.draw(st.sampled_from(self.history))
            self._apply(batch, outputs, base=base)

    @rule(
        older_than=st.sampled_from(
            [timedelta(0), RETENTION, timedelta(days=200_000), timedelta.max]
        )
    )
    def prune(self, older_than: timedelta) -> None:
        cutoff = saturate(self.now - ns(older_than))
        doomed = [
            i
            for i, t in self.model.tasks.items()
            if not t.live and t.updated < cutoff and not self.model.needed(t)
        ]
        assert self.h.store.prune(older_than) == len(doomed)
        for i in doomed:
            del self.model.tasks[i]

    @rule(payload=st.binary(max_size=3))
    def enqueue(self, payload: bytes) -> None:
        """An app enqueues an item in its own transaction."""
        with self.h.store.engine.begin() as conn:
            inbox_id = enqueue(conn, cq.TaskSpec(payload=payload))
        self.model.inbox[inbox_id] = payload
        self.next_inbox = max(self.next_inbox, inbox_id + 1)

    @rule(data=st.data())
    def damage(self, data: st.DataObject) -> None:
        """A live task's row damaged by hand: the next recovery quarantines it (marked failed,
        now, its key released) and returns everything else as before."""
        live = sorted(i for i, t in self.model.tasks.items() if t.live)
        if not live:
            return
        task_id = data.draw(st.sampled_from(live))
        with self.h.store.engine.begin() as conn:
            conn.execute(update(tasks).where(tasks.c.id == task_id).values(status="bogus"))
        got = self.h.store.recover(cq.TimeBase(self.base))
        # The finished tasks were read while the damaged one still counted as live (those it
        # depends on come back this once), then it was marked failed.
        next_id, live_tasks, terminal, schedules = expected_recovery(
            self.model, self.base, self.now
        )
        task = self.model.tasks[task_id]
        task.status, task.updated = cq.TaskStatus.FAILED, self.now
        quarantined = cq.RecoveredTerminal(
            id=cq.TaskId(task_id),
            key=task.spec.key,
            status=cq.TaskStatus.FAILED,
            at=saturate(self.now - self.base),
        )
        assert got.tasks == [t for t in live_tasks if t.id != task_id]
        # What was set aside comes last (it was marked failed after the finished were read).
        assert got.terminal == [*terminal, quarantined]
        assert (got.next_id, got.recurring) == (next_id, schedules)
        stored = self.h.store.get_task(cq.ById(cq.TaskId(task_id)))
        assert stored is not None and stored.message is not None
        assert stored.message.startswith("corrupt task row: ")
        task.message = stored.message

    @rule(step=st.sampled_from([SECOND, 30 * 60 * SECOND, HOUR, 2 * HOUR]))
    def advance_clock(self, step: int) -> None:
        self.h.clock[0] += step

    @rule(data=st.data())
    def take_over(self, data: st.DataObject) -> None:
        """A second store takes over under a moved base; the deposed one is fenced off."""
        old = self.h.take_over()
        self.base = data.draw(
            st.sampled_from([*BASES, self.base + 5 * SECOND, self.base - 5 * SECOND])
        )
        batch, outputs = self.draw_batch(data)
        self._apply(batch, outputs, store=old)

    @rule(shift=st.sampled_from([5 * SECOND, -5 * SECOND, HOUR, INT64_MAX // 2, INT64_MIN // 2]))
    def recover_under_a_moved_base(self, shift: int) -> None:
        self.check_recovery(saturate(self.base + shift))

    # Checks after every step.

    def check_recovery(self, base: int) -> None:
        got = self.h.store.recover(cq.TimeBase(base))
        next_id, live, terminal, schedules = expected_recovery(self.model, base, self.now)
        assert got.next_id == next_id
        assert got.tasks == live
        assert got.terminal == terminal
        assert got.recurring == schedules

    @invariant()
    def recovery_matches(self) -> None:
        self.check_recovery(self.base)

    @invariant()
    def inbox_matches(self) -> None:
        items = self.h.store.read_inbox(limit=1000)
        assert {i.inbox_id: i.spec.payload for i in items} == self.model.inbox

    @invariant()
    def queries_match(self) -> None:
        store = self.h.store
        for task_id, task in self.model.tasks.items():
            assert store.get_task(cq.ById(cq.TaskId(task_id))) == record(task)
            want_output = task.output if task.status is cq.TaskStatus.SUCCEEDED else None
            assert store.load_output(cq.TaskId(task_id)) == want_output
        for key in KEYS:
            newest = max(
                (i for i, t in self.model.tasks.items() if t.spec.key == key), default=None
            )
            want = None if newest is None else record(self.model.tasks[newest])
            assert store.get_task(cq.ByKey(key)) == want
        assert store.get_task(cq.ById(cq.TaskId(self.next_new + 5))) is None
        finished = [record(t) for _, t in sorted(self.model.tasks.items()) if not t.live]
        assert store.list_finished(limit=2**64) == finished
        if finished:
            after = finished[len(finished) // 2].id
            assert (
                store.list_finished(after=after, limit=2)
                == [r for r in finished if r.id > after][:2]
            )


@pytest.fixture
def harness(db_url: URL, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    clock = [START_UNIX]
    monkeypatch.setattr(cq.SqlStore, "_now", staticmethod(lambda: clock[0]))
    config = cq.StoreConfig(
        retention=RETENTION,
        lease_ttl=timedelta(seconds=60),
        lease_renew=timedelta(seconds=30),
        lock_poll=timedelta(milliseconds=50),
        full_sync=False,
    )
    first = cq.SqlStore.open(db_url, config)
    second = cq.SqlStore(first.engine, config)
    try:
        first.acquire_leadership()
        yield Harness(stores=[first, second], clock=clock)
    finally:
        second.close()
        first.close()


@pytest.mark.timeout(3600)  # a --soak run; the default run takes seconds
def test_the_store_follows_the_model(
    harness: Harness, request: pytest.FixtureRequest, dialect: str
) -> None:
    soak = bool(request.config.getoption("--soak"))
    StoreMachine.harness = harness
    run_state_machine_as_test(
        StoreMachine,
        settings=settings(
            max_examples=300 if soak else 40,
            stateful_step_count=30 if soak else 15,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    print(f"model-based [{dialect}]: {harness.examples} examples, {harness.steps} commits")
