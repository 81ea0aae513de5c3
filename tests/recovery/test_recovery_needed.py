"""Recovery's finished tasks on PostgreSQL: the bench's live tasks, which depend on each other
and need no finished task, cost no probe per dependency."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

import pytest
from builders import BASE, submit
from sqlalchemy import event

import cronoq_store as cq
from cronoq_store import execution
from cronoq_store.repository import recovery
from cronoq_store.schema import tasks

RETENTION = timedelta(hours=1)


def by_id(i: int) -> cq.Dep:
    return cq.Dep(target=cq.ById(id=cq.TaskId(i)))


def by_key(key: str) -> cq.Dep:
    return cq.Dep(target=cq.ByKey(key=key))


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
