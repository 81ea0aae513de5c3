"""Property tests of `SqlStore` on every dialect: batching, idempotency, recovery.

Hypothesis generates valid mutation streams (a key is live on one task at a time, dependencies
name earlier tasks, transitions follow the task life cycle). Three properties follow from the
design: how a stream is split into commits does not change a single row; committing a batch twice
(as it was, or merged into the next one) is the same as once; and `recover` returns what a
plain-Python model of the rules in SPEC.md says.

One database per test function (the `db_url` fixture): examples reset the tables in between.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from builders import BASE
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import URL, Connection, Table, delete, select, update

import cronoq_store as cq
from cronoq_store.schema import TABLES, leader, recurring, task_deps, tasks

QUARTER = 15 * 60 * 1_000_000_000
"""Times lie on a grid of quarter hours (plus or minus 1 ns) so retention boundaries are hit."""
RETENTION = timedelta(hours=1)
COMMIT_AT = 12 * QUARTER
"""Engine time of the store's clock while committing."""

PROPERTIES = settings(
    max_examples=25,
    deadline=None,
    database=None,  # leaves no example database in the shared tree
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

WALL_CLOCK_COLUMNS = {leader.c.expires_unix_ns, leader.c.commit_seq}
"""Columns not compared: the database's own clock at commit time, and the count of commits
(which batching changes by design: it tells a leader whether the database lost some)."""


# A store on a clock the test sets.


@dataclass
class Clock:
    """The store's wall clock (Unix ns), set by the test."""

    unix_ns: int = BASE.to_unix(COMMIT_AT)

    def at(self, t: int) -> None:
        self.unix_ns = BASE.to_unix(t)


@dataclass
class Leading:
    """A store that leads under `epoch`, on `clock`."""

    store: cq.SqlStore
    epoch: int
    clock: Clock


@pytest.fixture
def leading(db_url: URL, monkeypatch: pytest.MonkeyPatch) -> Iterator[Leading]:
    """A leading store whose `_now` is the test's clock (queued tasks are stamped with it)."""
    clock = Clock()
    monkeypatch.setattr(cq.SqlStore, "_now", staticmethod(lambda: clock.unix_ns))
    config = cq.StoreConfig(retention=RETENTION, full_sync=False)
    with cq.SqlStore.open(db_url, config) as store:
        yield Leading(store=store, epoch=store.acquire_leadership(), clock=clock)
        store.release_leadership()  # which returns the connection its commits kept
        assert store.engine.pool.checkedout() == 0  # type: ignore[attr-defined]


def reset(lead: Leading) -> None:
    """Empty the tables between examples; the lease stays, the id high-water mark goes."""
    lead.clock.at(COMMIT_AT)
    with lead.store.engine.begin() as conn:
        conn.execute(delete(task_deps))
        conn.execute(delete(tasks))
        conn.execute(delete(recurring))
        conn.execute(update(leader).values(next_id=0))


Dump = dict[str, list[dict[str, Any]]]
"""Table name -> its rows (column name -> value) in primary-key order."""


def dump(lead: Leading) -> Dump:
    """Every row of every cronoq_ table, by primary key."""

    def rows(conn: Connection, table: Table) -> list[dict[str, Any]]:
        columns = [c for c in table.c if c not in WALL_CLOCK_COLUMNS]
        stmt = select(*columns).order_by(*table.primary_key.columns)
        return [dict(row) for row in conn.execute(stmt).mappings()]

    with lead.store.engine.connect() as conn:
        return {table.name: rows(conn, table) for table in TABLES}


def pinned(rows: Dump) -> dict[str, list[tuple[Any, ...]]]:
    """The columns of a dump that `Model.rows` pins down, in its shape."""

    def pick(table: Table, *names: str) -> list[tuple[Any, ...]]:
        return [tuple(row[n] for n in names) for row in rows[table.name]]

    return {
        "tasks": pick(
            tasks, "id", "status", "attempt", "updated_unix_ns", "message", "output", "live_key"
        ),
        "deps": pick(task_deps, "task_id", "ordinal", "target_id", "target_key"),
        "recurring": pick(recurring, "name", "next_unix_ns", "last_task_id"),
        "next_id": pick(leader, "next_id"),
    }


# Valid streams.


@dataclass(frozen=True)
class Step:
    """One mutation, and the output it carries (only a transition to succeeded has one)."""

    mutation: cq.Mutation
    output: bytes | None = None


def commit(lead: Leading, steps: Sequence[Step]) -> None:
    """Commit `steps` as one batch, with their outputs."""
    outputs = [
        (s.mutation.id, s.output)
        for s in steps
        if isinstance(s.mutation, cq.StatusChanged) and s.output is not None
    ]
    lead.store.commit(lead.epoch, BASE, [s.mutation for s in steps], outputs)


NEXT_STATUS: dict[cq.TaskStatus, tuple[cq.TaskStatus, ...]] = {
    cq.TaskStatus.QUEUED: (
        cq.TaskStatus.WAITING,
        cq.TaskStatus.RUNNING,
        cq.TaskStatus.CANCELLED,
        cq.TaskStatus.EXPIRED,
        cq.TaskStatus.SKIPPED,
    ),
    cq.TaskStatus.WAITING: (
        cq.TaskStatus.RUNNING,
        cq.TaskStatus.CANCELLED,
        cq.TaskStatus.EXPIRED,
        cq.TaskStatus.SKIPPED,
    ),
    cq.TaskStatus.RUNNING: (
        cq.TaskStatus.SUCCEEDED,
        cq.TaskStatus.SUCCEEDED,  # the common outcome, twice as likely
        cq.TaskStatus.FAILED,
        cq.TaskStatus.RETRYING,
        cq.TaskStatus.CANCELLED,
        cq.TaskStatus.RUNNING,  # a heartbeat with a progress message
    ),
    cq.TaskStatus.RETRYING: (cq.TaskStatus.RUNNING, cq.TaskStatus.FAILED, cq.TaskStatus.CANCELLED),
}
"""Where a live task may go next."""

KEYS = ("a", "b", "c")
"""Few keys, so keys are often taken and released and reused."""
SCHEDULES = ("hourly", "nightly")
MESSAGES = st.none() | st.sampled_from(["started", "exit 1: boom", "ünï ✓", "nul\x00byte"])
FIRST_IDS = (0, 1, 1000, 7 << 48)
"""Plain ids from a fresh store's next_id (0) on, and epoch-prefixed ones (epoch 7)."""

times = st.builds(
    lambda quarter, ns: quarter * QUARTER + ns,
    st.integers(6, 12),
    st.sampled_from([-1, 0, 1]),
)
"""Engine times from 1.5 h before the commit clock up to it: around the retention cutoffs."""


@dataclass
class StreamSoFar:
    """What the stream being drawn has done: the state its next mutation must respect."""

    next_id: int
    status: dict[int, cq.TaskStatus] = field(default_factory=dict)
    attempt: dict[int, int] = field(default_factory=dict)
    keys: dict[int, str | None] = field(default_factory=dict)
    schedules: set[str] = field(default_factory=set)

    def live(self) -> list[int]:
        return [i for i, s in self.status.items() if not s.is_terminal]

    def free_keys(self) -> list[str]:
        taken = {self.keys[i] for i in self.live()}
        return [k for k in KEYS if k not in taken]


def task_specs(draw: st.DrawFn, key: str | None, deps: tuple[cq.Dep, ...]) -> cq.TaskSpec:
    """A spec touching every column kind (JSON, blob, optional times), kept small."""
    return cq.TaskSpec(
        payload=draw(st.binary(max_size=8)),
        kind=draw(st.sampled_from(["", "email"])),
        pool=draw(st.sampled_from(["default", "gpu"])),
        priority=draw(st.sampled_from(cq.Priority)),
        key=key,
        deadline=draw(st.none() | times),
        retry=draw(st.none() | st.just(cq.RetryPolicy(max_attempts=5, jitter=0.25))),
        deps=deps,
        resources=draw(st.dictionaries(st.sampled_from(["cpu", "mem"]), st.integers(0, 4))),
        tags=draw(st.frozensets(st.sampled_from(["x", "y"]))),
        labels=draw(st.dictionaries(st.sampled_from(["team"]), st.sampled_from(["ops", "ø"]))),
        tenant=draw(st.none() | st.just("acme")),
    )


def submit(draw: st.DrawFn, s: StreamSoFar, seq: int) -> Step:
    """A new task: maybe a free key, maybe dependencies on earlier tasks by id or key."""
    task_id, s.next_id = s.next_id, s.next_id + draw(st.integers(1, 3))
    key = draw(st.none() | st.sampled_from(s.free_keys())) if s.free_keys() else None
    earlier_keys = sorted({k for k in s.keys.values() if k is not None})
    targets = (
        st.sampled_from([cq.ById(id=cq.TaskId(i)) for i in s.status]) if s.status else st.nothing()
    )
    if earlier_keys:
        targets = targets | st.sampled_from([cq.ByKey(key=k) for k in earlier_keys])
    on = st.sampled_from(["success", "finish"])
    deps = tuple(
        draw(st.lists(st.builds(cq.Dep, target=targets, on=on), max_size=3 if s.status else 0))
    )
    s.status[task_id], s.attempt[task_id], s.keys[task_id] = cq.TaskStatus.QUEUED, 0, key
    spec = task_specs(draw, key, deps)
    return Step(cq.Submitted(id=cq.TaskId(task_id), seq=seq, arrival=draw(times), spec=spec))


def transition(draw: st.DrawFn, s: StreamSoFar) -> Step:
    """A live task moves on; starting to run counts an attempt; success may carry an output."""
    task_id = draw(st.sampled_from(s.live()))
    status = draw(st.sampled_from(NEXT_STATUS[s.status[task_id]]))
    if status is cq.TaskStatus.RUNNING and s.status[task_id] is not cq.TaskStatus.RUNNING:
        s.attempt[task_id] += 1
    s.status[task_id] = status
    succeeded = status is cq.TaskStatus.SUCCEEDED
    output = draw(st.binary(max_size=8) | st.none()) if succeeded else None
    change = cq.StatusChanged(
        id=cq.TaskId(task_id),
        status=status,
        attempt=s.attempt[task_id],
        at=draw(times),
        message=draw(MESSAGES),
    )
    return Step(change, output)


def schedule_specs(name: str) -> st.SearchStrategy[cq.RecurringSpec]:
    """A cron or an interval schedule named `name`."""
    return st.builds(
        cq.RecurringSpec,
        name=st.just(name),
        template=st.builds(
            cq.TaskSpec,
            payload=st.binary(max_size=4),
            kind=st.just("report"),
            key=st.none() | st.just(f"{name}-run"),
        ),
        cron=st.just("0 3 * * *"),
        timezone=st.sampled_from(["UTC", "Europe/Berlin"]),
        start=st.none() | times,
        misfire=st.sampled_from(["skip", "run_once", "run_all"]),
        overlap=st.sampled_from(["allow", "skip"]),
    ) | st.builds(
        cq.RecurringSpec,
        name=st.just(name),
        template=st.builds(cq.TaskSpec, payload=st.binary(max_size=4)),
        interval_ns=st.sampled_from([QUARTER, 3 * QUARTER]),
    )


def schedule_change(draw: st.DrawFn, s: StreamSoFar) -> Step:
    """Create or replace a schedule; or, for an existing one, move it on or remove it."""
    name = draw(st.sampled_from(SCHEDULES))
    if name not in s.schedules or draw(st.booleans()):
        s.schedules.add(name)
        return Step(cq.RecurringUpsert(spec=draw(schedule_specs(name))))
    if draw(st.integers(0, 3)) == 0:
        s.schedules.discard(name)
        return Step(cq.RecurringRemove(name=name))
    last = draw(st.none() | st.sampled_from(sorted(s.status))) if s.status else None
    return Step(
        cq.RecurringNext(
            name=name, next=draw(st.none() | times), last=None if last is None else cq.TaskId(last)
        )
    )


@st.composite
def streams(draw: st.DrawFn, max_steps: int = 16, drain: bool = False) -> list[Step]:
    """A valid stream of mutations, as one scheduler engine would produce it.

    `drain` ends it by cancelling every live task, so that the newest ids can be pruned too.
    """
    s = StreamSoFar(next_id=draw(st.sampled_from(FIRST_IDS)))
    steps: list[Step] = []
    for _ in range(draw(st.integers(1, max_steps))):
        kinds = ["submit", "submit", "schedule"] + (["transition"] * 4 if s.live() else [])
        kind = draw(st.sampled_from(kinds))
        if kind == "submit":
            steps.append(submit(draw, s, seq=len(steps)))
        elif kind == "transition":
            steps.append(transition(draw, s))
        else:
            steps.append(schedule_change(draw, s))
    for i in s.live() if drain else []:
        cancel = cq.StatusChanged(
            id=cq.TaskId(i), status=cq.TaskStatus.CANCELLED, attempt=s.attempt[i], at=draw(times)
        )
        steps.append(Step(cancel))
    return steps


def splits(steps: list[Step]) -> st.SearchStrategy[list[list[Step]]]:
    """`steps` cut into consecutive batches at random places."""

    def cut(flags: list[bool]) -> list[list[Step]]:
        batches: list[list[Step]] = [[steps[0]]]
        for step, new_batch in zip(steps[1:], flags, strict=True):
            if new_batch:
                batches.append([])
            batches[-1].append(step)
        return batches

    n = len(steps) - 1
    return st.lists(st.booleans(), min_size=n, max_size=n).map(cut)


# The model: the rules of SPEC.md in plain Python.


def clean(text: str | None) -> str | None:
    """Strings are stored with NUL replaced by U+FFFD."""
    return None if text is None else text.replace("\x00", "\ufffd")


@dataclass
class ModelTask:
    """A task as the rules say it stands."""

    submitted: cq.Submitted
    status: cq.TaskStatus = cq.TaskStatus.QUEUED
    attempt: int = 0
    updated: int = 0
    """Unix ns: the time of the last transition, or the store's clock when submitted."""
    message: str | None = None
    output: bytes | None = None


@dataclass
class Model:
    """What the store should hold after a stream, and what recovery should return from it."""

    tasks: dict[int, ModelTask] = field(default_factory=dict)
    schedules: dict[str, cq.RecoveredRecurring] = field(default_factory=dict)

    def apply(self, step: Step, now_unix_ns: int) -> None:
        m = step.mutation
        if isinstance(m, cq.Submitted):
            self.tasks[m.id] = ModelTask(submitted=m, updated=now_unix_ns)
        elif isinstance(m, cq.StatusChanged):
            task = self.tasks[m.id]
            task.status, task.attempt, task.updated = m.status, m.attempt, BASE.to_unix(m.at)
            if m.message is not None:  # a message carries forward until a later one
                task.message = clean(m.message)
            if step.output is not None:
                task.output = step.output
        elif isinstance(m, cq.RecurringUpsert):  # next/last stay as they were
            old = self.schedules.get(m.spec.name)
            self.schedules[m.spec.name] = cq.RecoveredRecurring(
                spec=m.spec,
                next=None if old is None else old.next,
                last=None if old is None else old.last,
            )
        elif isinstance(m, cq.RecurringNext):
            self.schedules[m.name] = cq.RecoveredRecurring(
                spec=self.schedules[m.name].spec, next=m.next, last=m.last
            )
        else:
            del self.schedules[m.name]

    @classmethod
    def of(cls, steps: Sequence[Step], now_unix_ns: int) -> Model:
        model = cls()
        for step in steps:
            model.apply(step, now_unix_ns)
        return model

    def live(self) -> dict[int, ModelTask]:
        return {i: t for i, t in sorted(self.tasks.items()) if not t.status.is_terminal}

    def needed(self, task_id: int, task: ModelTask) -> bool:
        """Whether a live task depends on this one, by id or by key."""
        targets = [d.target for t in self.live().values() for d in t.submitted.spec.deps]
        return cq.ById(id=cq.TaskId(task_id)) in targets or (
            task.submitted.spec.key is not None and cq.ByKey(key=task.submitted.spec.key) in targets
        )

    def rows(self) -> dict[str, list[tuple[Any, ...]]]:
        """The rows the model pins down: task state, dependency rows, schedule positions."""
        return {
            "tasks": [
                (i, t.status.value, t.attempt, t.updated, t.message, t.output, live_key)
                for i, t in sorted(self.tasks.items())
                for live_key in [None if t.status.is_terminal else t.submitted.spec.key]
            ],
            "deps": [
                (i, n, getattr(d.target, "id", None), getattr(d.target, "key", None))
                for i, t in self.live().items()
                for n, d in enumerate(t.submitted.spec.deps)
            ],
            "recurring": [
                (name, None if r.next is None else BASE.to_unix(r.next), r.last)
                for name, r in sorted(self.schedules.items())
            ],
            "next_id": [(max([-1, *self.tasks]) + 1,)],
        }

    def recovered(self, now_unix_ns: int) -> cq.Recovered:
        """What `recover` returns at `now_unix_ns`, as SPEC.md states it."""
        cutoff = now_unix_ns - RETENTION // timedelta(microseconds=1) * 1000
        finished = sorted(
            (t.updated, i, t)
            for i, t in self.tasks.items()
            if t.status.is_terminal and (t.updated >= cutoff or self.needed(i, t))
        )
        return cq.Recovered(
            next_id=cq.TaskId(max([0, *self.tasks]) + 1 if self.tasks else 0),
            tasks=[
                cq.RecoveredTask(
                    id=cq.TaskId(i),
                    seq=t.submitted.seq,
                    arrival=t.submitted.arrival,
                    spec=t.submitted.spec,
                    attempt=t.attempt,
                )
                for i, t in self.live().items()
            ],
            terminal=[
                cq.RecoveredTerminal(
                    id=cq.TaskId(i),
                    key=t.submitted.spec.key,
                    status=t.status,
                    at=BASE.from_unix(updated),
                )
                for updated, i, t in finished
            ],
            recurring=[r for _, r in sorted(self.schedules.items())],
        )


# The properties.


@PROPERTIES
@given(data=st.data())
def test_batching_does_not_matter(leading: Leading, data: st.DataObject) -> None:
    """One batch, one commit per mutation and random splits leave the very same rows."""
    steps = data.draw(streams(), label="stream")
    batchings = {
        "one batch": [steps],
        "one per mutation": [[s] for s in steps],
        "random split": data.draw(splits(steps), label="split"),
    }
    dumps: dict[str, Dump] = {}
    for name, batches in batchings.items():
        reset(leading)
        for batch in batches:
            commit(leading, batch)
        dumps[name] = dump(leading)
    assert dumps["one per mutation"] == dumps["one batch"]
    assert dumps["random split"] == dumps["one batch"]
    assert pinned(dumps["one batch"]) == Model.of(steps, leading.clock.unix_ns).rows()


@PROPERTIES
@given(data=st.data())
def test_committing_twice_is_committing_once(leading: Leading, data: st.DataObject) -> None:
    """A batch retried after a timeout (committed twice in a row, as it was) changes nothing.

    A retried batch merged with the next one is not the same: a task stored
    already ignores its repeated insert and the transitions folded into it (see
    tests/store/test_edges.py::test_replayed_batch_changes_nothing).
    """
    steps = data.draw(streams(), label="stream")
    batches = data.draw(splits(steps), label="split")
    reset(leading)
    for batch in batches:
        commit(leading, batch)
    once = dump(leading)
    assert pinned(once) == Model.of(steps, leading.clock.unix_ns).rows()

    reset(leading)
    for batch in batches:
        commit(leading, batch)
        commit(leading, batch)
    assert dump(leading) == once


@PROPERTIES
@given(
    data=st.data(),
    later=st.integers(0, 6).map(lambda quarters: quarters * QUARTER),
    prune=st.booleans(),
    drain=st.booleans(),
)
def test_recovery_matches_the_model(
    leading: Leading, data: st.DataObject, later: int, prune: bool, drain: bool
) -> None:
    """`recover` returns what SPEC.md says, however long after the commits it runs.

    Pruning what retention no longer covers first changes nothing (next_id included: the id
    high-water mark outlives pruned tasks).
    """
    steps = data.draw(streams(drain=drain), label="stream")
    reset(leading)
    for batch in data.draw(splits(steps), label="split"):
        commit(leading, batch)
    model = Model.of(steps, leading.clock.unix_ns)
    leading.clock.at(COMMIT_AT + later)
    if prune:
        leading.store.prune(RETENTION)
    got = leading.store.recover(BASE)
    want = model.recovered(leading.clock.unix_ns)
    assert got.next_id == want.next_id
    assert got.tasks == want.tasks
    assert got.terminal == want.terminal
    assert got.recurring == want.recurring
