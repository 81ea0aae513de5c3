"""Recovery's finished tasks: those updated within the retention, and older ones a live task
depends on (by id or by key), each once, in update order, whichever way `recovery` finds the
older ones: all of them read when they are fewer than the live tasks' targets, else the
targets looked up by id and by key. On every dialect.

The oracle is the one statement recovery ran before (a UNION over the dependency rows, which
on PostgreSQL aggregated every dependency row): the same rows, in the same order, with the
corner cases it answered: a finished task sharing its key with a live one, two finished tasks
with the key a live task needs, a task needed by id and by key, finished tasks without a
finish time (recent, needed, neither), and the targets of a live row quarantined in the same
recovery (they come back this once).
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

import pytest
from builders import BASE, status, submit
from sqlalchemy import BindParameter, Select, and_, bindparam, event, or_, select, union, update

import cronoq_store as cq
from cronoq_store import codec, execution
from cronoq_store.repository import prune, recovery
from cronoq_store.schema import task_deps, tasks

RETENTION = timedelta(hours=1)


def _oracle_stmt() -> Select[Any]:
    """Recovery's finished query before the dependency targets were read off the live tasks."""
    raw_terminal = recovery._RAW_TERMINAL
    columns = (tasks.c.id, tasks.c.key, tasks.c.status, raw_terminal, tasks.c.updated_unix_ns)
    target_ids = select(task_deps.c.target_id).where(task_deps.c.target_id.is_not(None))
    target_keys = select(task_deps.c.target_key).where(task_deps.c.target_key.is_not(None))
    needed = or_(tasks.c.id.in_(target_ids), tasks.c.key.in_(target_keys))
    finished = prune.finished_flag()
    unstamped = and_(tasks.c.finished_unix_ns.is_(None), finished)
    cutoff: BindParameter[Any] = bindparam("cutoff")
    old = (finished, tasks.c.finished_unix_ns < cutoff)
    both = union(
        select(*columns).where(finished, tasks.c.finished_unix_ns >= cutoff),
        select(*columns).where(tasks.c.id.in_(target_ids), *old),
        select(*columns).where(tasks.c.key.in_(target_keys), *old),
        select(*columns).where(unstamped, or_(tasks.c.updated_unix_ns >= cutoff, needed)),
    ).subquery()
    return select(both).order_by(both.c.updated_unix_ns, both.c.id)


def by_id(i: int) -> cq.Dep:
    return cq.Dep(target=cq.ById(id=cq.TaskId(i)))


def by_key(key: str) -> cq.Dep:
    return cq.Dep(target=cq.ByKey(key=key))


DAMAGED = 106
"""A live task whose row is damaged: quarantined by the recovery under test."""


def _fill(store: cq.SqlStore, unneeded_old: int) -> None:
    """Old finished tasks 1-8 (7 and 5, 6 not needed), 9-11 without a finish time, 12 recent;
    live tasks 101-108; `unneeded_old` more old finished tasks from 1000 on."""
    epoch = store.acquire_leadership()
    keys = {1: "a", 2: "b", 3: "c", 4: "shared", 5: "d", 7: "b", 8: "q", 9: "e", 10: "f"}
    old = [*range(1, 7), *range(8, 13), *range(1000, 1000 + unneeded_old)]
    store.commit(epoch, BASE, [submit(i, key=keys.get(i)) for i in old])
    store.commit(epoch, BASE, [status(i) for i in old])
    store.commit(epoch, BASE, [submit(7, key=keys[7]), status(7)])  # once 2 has freed "b"
    live = [
        submit(101, deps=(by_id(1), by_id(9))),
        submit(102, deps=(by_key("b"),)),
        submit(103, deps=(by_id(3), by_key("c"))),
        submit(104, key="shared"),  # the key of finished task 4
        submit(105, deps=(by_key("shared"),)),
        submit(DAMAGED, deps=(by_key("q"),)),  # what only it needs comes back this once
        submit(107, deps=(by_id(104),)),  # a live target
        submit(108, deps=(by_id(998), by_id(999))),  # targets never stored
    ]
    store.commit(epoch, BASE, live)
    store.release_leadership()
    now = time.time_ns()
    with store.engine.begin() as conn:
        # Finished without a finish time: old and needed (9), old (10), recent (11).
        conn.execute(update(tasks).where(tasks.c.id.in_([9, 10, 11])).values(finished_unix_ns=None))
        conn.execute(update(tasks).where(tasks.c.id == 11).values(updated_unix_ns=now))
        conn.execute(
            update(tasks).where(tasks.c.id == 12).values(updated_unix_ns=now, finished_unix_ns=now)
        )
        conn.execute(update(tasks).where(tasks.c.id == DAMAGED).values(status="bogus"))


@pytest.mark.parametrize(
    ("unneeded_old", "looked_up"),
    [pytest.param(0, False, id="old-ones-read"), pytest.param(50, True, id="targets-looked-up")],
)
def test_recovery_returns_what_the_dependency_rows_named(
    store: cq.SqlStore, monkeypatch: pytest.MonkeyPatch, unneeded_old: int, looked_up: bool
) -> None:
    _fill(store, unneeded_old)
    now = time.time_ns()
    cutoff = now - RETENTION // timedelta(microseconds=1) * 1000
    with store.engine.connect() as conn:
        oracle = conn.execute(_oracle_stmt(), {"cutoff": cutoff}).mappings().all()
    expected = [codec.finished_task_from_row(BASE, row) for row in oracle]
    assert sorted(int(t.id) for t in expected) == [1, 2, 3, 4, 7, 8, 9, 11, 12]

    lookups: list[int] = []
    lookup = recovery._Targets.lookup

    def spied(self: Any, conn: Any) -> list[Any]:
        lookups.append(len(self))
        return lookup(self, conn)

    monkeypatch.setattr(recovery._Targets, "lookup", spied)
    with store.engine.begin() as conn:
        got, quarantined = recovery.recover(conn, BASE, now_unix_ns=now, retention=RETENTION)
    assert quarantined == 1
    assert got.terminal[:-1] == expected
    assert got.terminal[-1].id == DAMAGED and got.terminal[-1].status is cq.TaskStatus.FAILED
    assert bool(lookups) is looked_up, lookups
    assert [int(t.id) for t in got.tasks] == [101, 102, 103, 104, 105, 107, 108]


def test_no_old_finished_task_reads_no_target(
    store: cq.SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no task finished before the retention (a recovery after a prune, or the bench's),
    the count ends it: no target is gathered, none looked up."""
    epoch = store.acquire_leadership()
    store.commit(
        epoch, BASE, [submit(i, deps=(by_id(i - 1), by_key(f"k{i}"))) for i in range(1, 20)]
    )
    store.release_leadership()

    def refused(*args: Any) -> Any:
        raise AssertionError("targets gathered with no old finished task")

    monkeypatch.setattr(recovery._Targets, "of", refused)
    with store.engine.begin() as conn:
        got, _ = recovery.recover(conn, BASE, now_unix_ns=time.time_ns(), retention=RETENTION)
    assert got.terminal == [] and len(got.tasks) == 19


def _pg_probes(plan: dict[str, Any]) -> int:
    """The most times one scan of the task table ran in a PostgreSQL plan (a nested loop's
    inner side runs once per outer row)."""
    loops = plan.get("Actual Loops", 1) if plan.get("Relation Name") == tasks.name else 0
    return max([loops, *(_pg_probes(child) for child in plan.get("Plans", ()))])


@pytest.mark.parametrize("dialect", [pytest.param("postgresql", marks=pytest.mark.postgresql)])
def test_live_tasks_needing_each_other_cost_no_probe_per_dependency(store: cq.SqlStore) -> None:
    """The bench's shape: live tasks depending on live ones (by id and by key), no history,
    no statistics yet. No statement of recovery scans the task table once per dependency: the
    finished query aggregated every dependency row and probed the primary key for each (with
    the JIT compiler its estimate started, 1 s at 100,000 live tasks)."""
    live = 100_000  # smaller, PostgreSQL's planner seldom chose the probes
    epoch = store.acquire_leadership()
    for start in range(1, live, 5000):
        batch = range(start, min(start + 5000, live))
        deps = {i: (by_id(i - 1), by_key(f"k{i - 1}")) for i in batch}
        store.commit(epoch, BASE, [submit(i, key=f"k{i}", deps=deps[i]) for i in batch])
    store.release_leadership()
    sent: list[tuple[str, Any]] = []

    def record(_c: Any, _cursor: Any, sql: str, params: Any, _ctx: Any, _many: bool) -> None:
        if tasks.name in sql:
            sent.append((sql, params))

    live_sql = str(recovery.live_tasks_stmt().compile(dialect=store.engine.dialect))
    event.listen(store.engine, "before_cursor_execute", record)
    try:
        with store.engine.connect() as conn:
            observed = conn.execution_options(**{execution.OBSERVED: True})
            got, _ = recovery.recover(
                observed, BASE, now_unix_ns=time.time_ns(), retention=RETENTION
            )
    finally:
        event.remove(store.engine, "before_cursor_execute", record)
    assert len(got.tasks) == live - 1 and got.terminal == []
    with store.engine.connect() as conn:
        for sql, params in sent:
            if sql == live_sql:
                continue
            doc = conn.exec_driver_sql(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", params).scalar()
            plan = (doc if isinstance(doc, list) else json.loads(doc))[0]["Plan"]
            probes = _pg_probes(plan)
            assert probes == 1, f"{probes} scans of the task table:\n{sql}\n{json.dumps(plan)}"
