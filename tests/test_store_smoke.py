"""End-to-end store behaviour on every dialect: lead, commit, recover, query, prune, fence."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import URL

from cronoq_store import (
    ById,
    ByKey,
    Dep,
    Fenced,
    InvalidValue,
    RecurringNext,
    RecurringSpec,
    RecurringUpsert,
    SqlStore,
    StatusChanged,
    StoreConfig,
    StoreError,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    TimeBase,
)

BASE = TimeBase(unix_ns=1_700_000_000_000_000_000)


@pytest.fixture
def store(db_url: URL) -> Iterator[SqlStore]:
    with SqlStore.open(db_url, StoreConfig(lease_ttl=timedelta(seconds=5))) as s:
        yield s
        assert s.engine.pool.checkedout() == 0  # type: ignore[attr-defined]


def submit(i: int, key: str | None = None, deps: tuple[Dep, ...] = ()) -> Submitted:
    return Submitted(
        id=TaskId(i), seq=i, arrival=i, spec=TaskSpec(payload=b"p%d" % i, key=key, deps=deps)
    )


def status(i: int, st: TaskStatus, message: str | None = None) -> StatusChanged:
    return StatusChanged(id=TaskId(i), status=st, attempt=1, at=100 + i, message=message)


def test_commit_recover_query(store: SqlStore) -> None:
    epoch = store.acquire_leadership()
    assert epoch == 1
    sched = RecurringSpec(name="nightly", template=TaskSpec(payload=b"t"), cron="0 3 * * *")
    store.commit(
        epoch,
        BASE,
        [
            submit(1, key="a"),
            submit(2, deps=(Dep(target=ById(id=TaskId(1))),)),
            status(1, TaskStatus.RUNNING, "started"),
            status(1, TaskStatus.SUCCEEDED),
            submit(3, key="a"),
            RecurringUpsert(spec=sched),
            RecurringNext(name="nightly", next=500, last=TaskId(3)),
        ],
        outputs=[(TaskId(1), b"out")],
    )
    rec = store.recover(BASE)
    assert rec.next_id == 4
    assert [t.id for t in rec.tasks] == [2, 3]
    assert [(t.id, t.status) for t in rec.terminal] == [(1, TaskStatus.SUCCEEDED)]
    assert rec.recurring[0].spec == sched
    assert (rec.recurring[0].next, rec.recurring[0].last) == (500, 3)
    one = store.get_task(ById(id=TaskId(1)))
    assert one is not None and one.message == "started" and one.output == b"out"
    newest = store.get_task(ByKey(key="a"))
    assert newest is not None and newest.id == 3
    assert store.load_output(TaskId(1)) == b"out"
    assert [r.id for r in store.list_finished()] == [1]


def test_duplicate_live_key_writes_nothing(store: SqlStore) -> None:
    epoch = store.acquire_leadership()
    store.commit(epoch, BASE, [submit(1, key="k")])
    with pytest.raises(StoreError):
        store.commit(epoch, BASE, [submit(2), submit(3, key="k")])
    assert store.get_task(ById(id=TaskId(2))) is None


def test_over_long_key_refused(store: SqlStore) -> None:
    epoch = store.acquire_leadership()
    with pytest.raises(InvalidValue, match="TaskSpec.key"):
        store.commit(epoch, BASE, [submit(1), submit(2, key="x" * 513)])
    assert store.get_task(ById(id=TaskId(1))) is None


def test_fenced_after_takeover(db_url: URL, store: SqlStore) -> None:
    epoch = store.acquire_leadership()
    store.release_leadership()
    with SqlStore.open(db_url) as other:
        assert other.acquire_leadership() == epoch + 1
        with pytest.raises(Fenced):
            store.commit(epoch, BASE, [submit(1)])
        other.release_leadership()
    assert store.get_task(ById(id=TaskId(1))) is None


def test_prune(store: SqlStore) -> None:
    epoch = store.acquire_leadership()
    store.commit(epoch, BASE, [submit(1), submit(2, key="k")])
    store.commit(
        epoch,
        BASE,
        [
            status(1, TaskStatus.SUCCEEDED),
            status(2, TaskStatus.FAILED),
            submit(3, deps=(Dep(target=ByKey(key="k"), on="finish"),)),
        ],
    )
    # StatusChanged.at is in BASE time, far in the past: both are old enough.
    assert store.prune(timedelta(seconds=1)) == 1
    assert store.get_task(ById(id=TaskId(1))) is None
    assert store.get_task(ById(id=TaskId(2))) is not None
