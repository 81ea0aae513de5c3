"""Tables that do not bloat: a live task's transitions change no indexed column, so PostgreSQL
updates its row in place (HOT) and leaves no dead index entries behind (revision
0005_finished_index). The long-run sizes are a benchmark (`cronoq-store bench --bloat`)."""

from __future__ import annotations

import pytest
from builders import BASE, wait_until
from sqlalchemy import URL, Engine, text

from cronoq_store import SqlStore, StatusChanged, Submitted, TaskId, TaskSpec, TaskStatus

TASKS = 300
LIVE = (TaskStatus.RUNNING, TaskStatus.RETRYING, TaskStatus.RUNNING, TaskStatus.WAITING)


def _updates(engine: Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        conn.execute(text("SELECT pg_stat_clear_snapshot()"))
        row = conn.execute(
            text(
                "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
                "WHERE relname = 'cronoq_tasks'"
            )
        ).one()
    return int(row[0]), int(row[1])


@pytest.mark.parametrize("dialect", [pytest.param("postgresql", marks=pytest.mark.postgresql)])
def test_live_transitions_are_heap_only_updates(db_url: URL, engine: Engine) -> None:
    spec = TaskSpec(payload=b"x" * 200, key=None, labels={"team": "a"})
    with SqlStore.open(db_url) as store:
        epoch = store.acquire_leadership(timeout=10)
        for start in range(0, TASKS, 100):
            ids = range(start, start + 100)
            store.commit(
                epoch, BASE, [Submitted(id=TaskId(i), seq=i, arrival=0, spec=spec) for i in ids]
            )
        at = 1
        for status in LIVE:
            for start in range(0, TASKS, 100):
                batch = [
                    StatusChanged(id=TaskId(i), status=status, attempt=1, at=at)
                    for i in range(start, start + 100)
                ]
                store.commit(epoch, BASE, batch)
                at += 1
    # The store's backends report their counts as they end (closed above); bounded wait.
    want = TASKS * len(LIVE)
    wait_until(lambda: _updates(engine)[0] >= want, f"{want} updates counted", 30, 0.1)
    updated, hot = _updates(engine)
    assert updated >= want, (updated, hot)
    assert hot / updated >= 0.9, f"{hot} of {updated} live transitions were HOT"


@pytest.mark.parametrize("dialect", [pytest.param("sqlite", marks=pytest.mark.sqlite)])
def test_prune_walks_the_finished_index_in_order(db_url: URL, engine: Engine) -> None:
    """Each prune batch reads the oldest finished tasks off `finished_unix_ns`'s index. Left
    to itself SQLite took the `(terminal, id)` index and sorted every finished task again for
    each batch of 1000: a prune of 100,000 ran at a tenth of its speed."""
    from cronoq_store.repository import prune

    with SqlStore.open(db_url):
        pass
    sql = str(prune.prune_stmt().compile(dialect=engine.dialect))
    with engine.connect() as conn:
        plan = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {sql}", (0, 1000, 0)).all()
    steps = [row[-1] for row in plan]
    assert any("ix_cronoq_tasks_finished_unix_ns" in s for s in steps), steps
    assert not any("TEMP B-TREE" in s for s in steps), steps
