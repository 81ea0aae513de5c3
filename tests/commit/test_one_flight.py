"""A PostgreSQL commit in one flight (issue 41) writes what the step-by-step commit wrote: a
revival restores its dependency rows and live key (the guard fails the optimistic flight and
the commit runs again), a replayed batch of arrays changes no stored row and adds no
dependency row twice, and a fenced commit writes nothing. The same tests on every dialect."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from builders import BASE, dep_rows, keyed, status, task_rows
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import URL, create_engine, text, update

from cronoq_store import (
    ById,
    ByKey,
    Dep,
    Fenced,
    InboxTaken,
    RecurringNext,
    RecurringRemove,
    RecurringSpec,
    RecurringUpsert,
    SqlStore,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
)
from cronoq_store.bench.proxy import proxied_url
from cronoq_store.errors import StoreError
from cronoq_store.inbox import enqueue
from cronoq_store.repository.arrays import ARRAY_ROWS, array_text
from cronoq_store.schema import leader


def _submit(i: int, deps: tuple[Dep, ...] = ()) -> Submitted:
    return keyed(i, payload=b"p", deps=deps)


def test_a_revival_restores_dependency_rows_and_live_key(
    db_url: URL, dialect: str, revivals: list[int]
) -> None:
    """A live transition of a finished task, beside a live task's and a new task's: the
    guarded flight fails on it (PostgreSQL, MariaDB), and the commit run again restores its
    dependency rows and its live key, and writes the rest once."""
    again = revivals
    deps = (Dep(target=ById(id=TaskId(50))), Dep(target=ByKey(key="other")))
    with SqlStore.open(db_url) as store:
        epoch = store.acquire_leadership()
        store.commit(epoch, BASE, [_submit(1, deps), _submit(2)])
        before = dep_rows(store.engine)
        assert [d[0] for d in before] == [1, 1]
        store.commit(epoch, BASE, [status(1, TaskStatus.SUCCEEDED)], [(TaskId(1), b"out")])
        assert dep_rows(store.engine) == []
        assert task_rows(store.engine)[1] == ("succeeded", None)
        store.commit(
            epoch,
            BASE,
            [status(1, TaskStatus.RUNNING), status(2, TaskStatus.RUNNING), _submit(3)],
        )
        assert task_rows(store.engine) == {
            1: ("running", "k1"),
            2: ("running", "k2"),
            3: ("queued", "k3"),
        }
        assert dep_rows(store.engine) == before
        assert again == ([] if dialect == "sqlite" else [1])
        store.release_leadership()


@pytest.mark.parametrize(
    ("size", "stored_every"), [(100, 1), (100, 3), (100, 7), (ARRAY_ROWS * 2 + 100, 3)]
)
def test_a_replayed_batch_changes_no_stored_row(db_url: URL, size: int, stored_every: int) -> None:
    """Submissions with dependencies, some stored already (and moved on since): the replay
    inserts the others with their dependency rows, and leaves the stored ones and their
    dependency rows as they were, none twice. Above `ARRAY_ROWS` too (PostgreSQL: several
    array statements in the one flight, no lookup)."""
    deps = (Dep(target=ById(id=TaskId(10_000))), Dep(target=ByKey(key="x")))
    batch = [_submit(i, deps) for i in range(size)]
    with SqlStore.open(db_url) as store:
        epoch = store.acquire_leadership()
        first = [m for m in batch if m.id % stored_every == 0]
        store.commit(epoch, BASE, first)
        store.commit(epoch, BASE, [status(m.id, TaskStatus.RUNNING) for m in first])
        stored = task_rows(store.engine)
        store.commit(epoch, BASE, batch)
        after = task_rows(store.engine)
        assert {i: after[i] for i in stored} == stored
        assert {i: v for i, v in after.items() if i not in stored} == {
            i: ("queued", f"k{i}") for i in range(size) if i not in stored
        }
        assert len(after) == size
        rows = dep_rows(store.engine)
        assert len(rows) == len({(r[0], r[1]) for r in rows}) == 2 * size
        store.commit(epoch, BASE, batch)  # once more: nothing changes
        assert task_rows(store.engine) == after
        assert dep_rows(store.engine) == rows
        store.release_leadership()


@pytest.mark.parametrize("with_deps", [False, True])
def test_a_batch_one_past_an_array_statement_lands(db_url: URL, with_deps: bool) -> None:
    """`ARRAY_ROWS` + 1 new tasks of one spec (PostgreSQL: a last array statement of one
    row, every column of it one value, none an array): all of them land with their
    dependency rows, and a replay changes nothing."""
    deps = (Dep(target=ById(id=TaskId(1))),) if with_deps else ()
    spec = TaskSpec(payload=b"p", deps=deps)
    batch = [Submitted(id=TaskId(i), seq=i, arrival=0, spec=spec) for i in range(ARRAY_ROWS + 1)]
    with SqlStore.open(db_url) as store:
        epoch = store.acquire_leadership()
        store.commit(epoch, BASE, batch)
        after, rows = task_rows(store.engine), dep_rows(store.engine)
        assert sorted(after) == list(range(ARRAY_ROWS + 1))
        assert len(rows) == (ARRAY_ROWS + 1 if with_deps else 0)
        store.commit(epoch, BASE, batch)
        assert (task_rows(store.engine), dep_rows(store.engine)) == (after, rows)
        store.release_leadership()


def test_a_live_key_clash_in_a_big_batch_is_refused(db_url: URL) -> None:
    """A batch of more new tasks than one array statement carries (PostgreSQL: several), the
    last with the live key of a stored live task: the commit is refused (the store's
    `StoreError` for a conflict), and nothing of it is written."""
    with SqlStore.open(db_url) as store:
        epoch = store.acquire_leadership()
        store.commit(epoch, BASE, [_submit(1)])
        before, deps_before = task_rows(store.engine), dep_rows(store.engine)
        size = ARRAY_ROWS * 2 + 10
        deps = (Dep(target=ById(id=TaskId(1))),)
        batch = [_submit(i, deps) for i in range(10, 10 + size - 1)]
        clash = Submitted(
            id=TaskId(10 + size), seq=10 + size, arrival=0, spec=TaskSpec(payload=b"p", key="k1")
        )
        with pytest.raises(StoreError, match="live key in use"):
            store.commit(epoch, BASE, [*batch, clash])
        assert task_rows(store.engine) == before
        assert dep_rows(store.engine) == deps_before
        store.commit(epoch, BASE, batch)  # the rest lands on its own
        assert len(task_rows(store.engine)) == size
        store.release_leadership()


def test_a_fenced_commit_writes_nothing(db_url: URL) -> None:
    """Another instance took the lease: a commit of transitions, a revival and 100 new tasks
    raises `Fenced`, and nothing of it is written."""
    with SqlStore.open(db_url) as store:
        epoch = store.acquire_leadership()
        store.commit(epoch, BASE, [_submit(1), _submit(2)])
        store.commit(epoch, BASE, [status(1, TaskStatus.SUCCEEDED)])
        before, deps_before = task_rows(store.engine), dep_rows(store.engine)
        with store.engine.begin() as conn:
            conn.execute(update(leader).values(epoch=leader.c.epoch + 1, holder="someone else"))
        batch = [status(1, TaskStatus.RUNNING), status(2, TaskStatus.RUNNING)]
        batch += [_submit(i, (Dep(target=ById(id=TaskId(1))),)) for i in range(10, 110)]
        with pytest.raises(Fenced):
            store.commit(epoch, BASE, batch)
        assert task_rows(store.engine) == before
        assert dep_rows(store.engine) == deps_before
        with store.engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM cronoq_tasks")).scalar_one() == 2


def test_a_commit_of_every_kind_is_one_round_trip(db_url: URL, dialect: str) -> None:
    """New tasks with dependency rows, live and finishing transitions, an output, inbox rows
    taken and schedules added, replaced, moved on and removed: all written, and on
    PostgreSQL (counted by the proxy) in one round trip, COMMIT included; a batch of more new
    tasks than one array statement carries too."""
    first = RecurringSpec(name="a", template=TaskSpec(payload=b"t"), cron="0 3 * * *")
    second = RecurringSpec(name="a", template=TaskSpec(payload=b"u"), interval_ns=10**9)
    gone = RecurringSpec(name="gone", template=TaskSpec(payload=b"g"), cron="0 4 * * *")
    with contextlib.ExitStack() as stack:
        url, proxy = db_url, None
        if dialect == "postgresql":
            url, proxy = stack.enter_context(proxied_url(db_url, delay=0))
        store = stack.enter_context(SqlStore.open(url))
        with store.engine.begin() as conn:
            taken = [enqueue(conn, TaskSpec(payload=b"i")) for _ in range(3)]
        epoch = store.acquire_leadership()
        store.commit(epoch, BASE, [_submit(1), _submit(2), RecurringUpsert(spec=gone)])
        store.commit(epoch, BASE, [status(1, TaskStatus.RUNNING)])  # statements prepared
        batch: list[Any] = [
            status(1, TaskStatus.SUCCEEDED),
            status(2, TaskStatus.RUNNING),
            *(_submit(i, (Dep(target=ById(id=TaskId(2))),)) for i in (3, 4, 5)),
            *(InboxTaken(inbox_id=i) for i in taken),
            RecurringUpsert(spec=first),
            RecurringUpsert(spec=second),
            RecurringNext(name="a", next=500, last=TaskId(3)),
            RecurringRemove(name="gone"),
        ]
        before = proxy.count if proxy is not None else 0
        store.commit(epoch, BASE, batch, [(TaskId(1), b"out")])
        if proxy is not None:
            assert proxy.count - before == 1
        big = [_submit(i, (Dep(target=ById(id=TaskId(2))),)) for i in range(100, 700)]
        before = proxy.count if proxy is not None else 0
        store.commit(epoch, BASE, big)
        if proxy is not None:
            assert proxy.count - before == 1
        big_ids = {m.id for m in big}
        assert {i for i in task_rows(store.engine) if i in big_ids} == big_ids
        assert sum(1 for d in dep_rows(store.engine) if d[0] in big_ids) == len(big)
        store.commit(epoch, BASE, [status(i, TaskStatus.CANCELLED) for i in range(100, 700)])
        rec = store.recover(BASE)
        assert [t.id for t in rec.tasks] == [2, 3, 4, 5]
        assert task_rows(store.engine)[1] == ("succeeded", None)
        assert [(r.spec, r.next, r.last) for r in rec.recurring] == [(second, 500, 3)]
        assert store.load_output(TaskId(1)) == b"out"
        assert [d[:2] for d in dep_rows(store.engine)] == [(3, 0), (4, 0), (5, 0)]
        with store.engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM cronoq_inbox")).scalar_one() == 0
        store.release_leadership()


def test_arrays_in_their_text_form_read_back_as_sent(db_url: URL, dialect: str) -> None:
    """`array_text` (the arrays of a flight's new tasks): any text (quotes, backslashes,
    braces, commas, "NULL"), bytes, integers, booleans and NULLs come back from the server's
    cast as they were."""
    if dialect != "postgresql":
        pytest.skip("PostgreSQL's array text form")
    text_values = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=["Cs"]))
    engine = create_engine(db_url)

    @settings(max_examples=60, deadline=None)
    @given(
        st.lists(st.none() | text_values),
        st.lists(st.none() | st.binary()),
        st.lists(st.none() | st.integers(-(2**63), 2**63 - 1)),
        st.lists(st.none() | st.booleans()),
    )
    def read_back(texts: list[Any], blobs: list[Any], ints: list[Any], bools: list[Any]) -> None:
        sent = [array_text(v) for v in (texts, blobs, ints, bools)]
        stmt = "SELECT %s::text[], %s::bytea[], %s::bigint[], %s::boolean[]"
        row = conn.exec_driver_sql(stmt, tuple(sent)).one()
        assert [list(v) for v in row] == [texts, blobs, ints, bools]

    try:
        with engine.connect() as conn:
            read_back()
    finally:
        engine.dispose()
