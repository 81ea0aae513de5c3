"""Tables that do not bloat: a live task's transitions change no indexed column, so PostgreSQL
updates its row in place (HOT) and leaves no dead index entries behind (revision
0005_finished_index). The long-run sizes are a benchmark (`cronoq-store bench --bloat`)."""

from __future__ import annotations

from datetime import timedelta

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


def _prune_plan(db_url: URL, engine: Engine) -> list[str]:
    """The plan of one prune batch, with its values bound as the store binds them."""
    from cronoq_store import dialects
    from cronoq_store.repository import prune

    with SqlStore.open(db_url):
        pass
    compiled = prune.prune_stmt(join=dialects.delete_joins(engine.dialect)).compile(
        dialect=engine.dialect
    )
    params = compiled.construct_params({"cutoff": 10**18, "limit": 1000})
    if compiled.positiontup is not None:
        params = tuple(params[name] for name in compiled.positiontup)  # type: ignore[assignment]
    explain = "EXPLAIN QUERY PLAN" if engine.dialect.name == "sqlite" else "EXPLAIN"
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(f"{explain} {compiled}", params).all()
    return [" ".join(str(column) for column in row) for row in rows]


@pytest.mark.parametrize("dialect", [pytest.param("sqlite", marks=pytest.mark.sqlite)])
def test_prune_walks_the_finished_index_in_order(db_url: URL, engine: Engine) -> None:
    """Each prune batch reads the oldest finished tasks off `finished_unix_ns`'s index. Left
    to itself SQLite took the `(terminal, id)` index and sorted every finished task again for
    each batch of 1000: a prune of 100,000 ran at a tenth of its speed."""
    steps = _prune_plan(db_url, engine)
    assert any("ix_cronoq_tasks_finished_unix_ns" in s for s in steps), steps
    assert not any("TEMP B-TREE" in s for s in steps), steps


@pytest.mark.parametrize(
    "dialect",
    [
        pytest.param("postgresql", marks=pytest.mark.postgresql),
        pytest.param("mysql", marks=pytest.mark.mysql),
    ],
)
def test_prune_checks_each_dependency_as_an_anti_join(
    db_url: URL, engine: Engine, dialect: str
) -> None:
    """A prunable task's two dependency checks stop at the first match (by id, by key). As a
    LEFT JOIN filtered on a column outside the join, PostgreSQL joined every dependency to
    every prunable task, hashed and sorted them for each batch of 1000: a prune of 100,000
    beside 100,000 live tasks took 15 s, with the values bound (its custom plan)."""
    plan = _prune_plan(db_url, engine)
    if dialect == "postgresql":
        assert sum("Anti Join" in step for step in plan) == 2, "\n".join(plan)
    else:
        checks = [step for step in plan if " by_id " in step or " by_key " in step]
        assert len(checks) == 2 and all("Not exists" in step for step in checks), plan


def _size(engine: Engine) -> int:
    with engine.connect() as conn:
        sizes = conn.execute(
            text(
                "SELECT pg_total_relation_size('cronoq_tasks') "
                "+ pg_total_relation_size('cronoq_task_deps')"
            )
        ).scalar_one()
    return int(sizes)


@pytest.mark.parametrize("dialect", [pytest.param("postgresql", marks=pytest.mark.postgresql)])
def test_a_prune_leaves_its_space_to_the_next_tasks(db_url: URL, engine: Engine) -> None:
    """On PostgreSQL a prune vacuums the task tables, so the next tasks reuse the pruned
    rows' space at once, whenever autovacuum comes (never, on a server with it off, as this
    one is): from the second cycle on the tables keep their size, where they grew by one
    cycle's rows each."""
    spec = TaskSpec(payload=b"x" * 200, key=None, deps=())
    sizes = []
    with SqlStore.open(db_url) as store:
        epoch = store.acquire_leadership(timeout=10)
        for cycle in range(4):
            ids = range(cycle * 2000, (cycle + 1) * 2000)
            for start in range(ids.start, ids.stop, 500):
                batch = range(start, start + 500)
                store.commit(
                    epoch,
                    BASE,
                    [Submitted(id=TaskId(i), seq=i, arrival=0, spec=spec) for i in batch],
                )
                done = TaskStatus.SUCCEEDED
                store.commit(
                    epoch,
                    BASE,
                    [StatusChanged(id=TaskId(i), status=done, attempt=1, at=1) for i in batch],
                )
            assert store.prune(timedelta(0)) == 2000
            sizes.append(_size(engine))
    assert sizes[-1] <= sizes[1] * 1.1, sizes
