"""A MariaDB batch-1 commit in one multi-statement packet (issue 41 item 3): a submission with
its dependency rows, a live transition (a guard behind its UPDATE fails the packet on a
revival, which then commits again the old way) and a finishing one with its dependency rows'
DELETE, each with its COMMIT. Counted by the proxy (the client's command packets). What the
packet must not lose is checked on every dialect: a replayed submission adds no dependency
row, a revival restores its rows and live key, a fenced commit writes nothing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from builders import BASE, dep_rows, keyed, status, task_rows
from sqlalchemy import URL, update

from cronoq_store import ById, ByKey, Dep, Fenced, SqlStore, Submitted, TaskId, TaskStatus
from cronoq_store.bench.proxy import Proxy, proxied_url
from cronoq_store.schema import leader

DEPS = (Dep(target=ById(id=TaskId(50))), Dep(target=ByKey(key="other")))


def _submit(i: int, deps: tuple[Dep, ...] = DEPS) -> Submitted:
    return keyed(i, payload=b"p", deps=deps)


@contextlib.contextmanager
def _store(db_url: URL, dialect: str) -> Iterator[tuple[SqlStore, Proxy | None]]:
    """A store; on a server, behind the counting proxy."""
    with contextlib.ExitStack() as stack:
        url, proxy = db_url, None
        if dialect != "sqlite":
            url, proxy = stack.enter_context(proxied_url(db_url, delay=0))
        yield stack.enter_context(SqlStore.open(url)), proxy


def test_a_batch1_commit_is_one_packet(db_url: URL, dialect: str) -> None:
    """A submission with dependency rows, a live transition, a finishing one with an output
    (its dependency rows deleted): one command packet each on MariaDB, COMMIT included."""
    if dialect not in ("mysql", "postgresql"):
        pytest.skip("counted on the servers")
    with _store(db_url, dialect) as (store, proxy):
        assert proxy is not None
        epoch = store.acquire_leadership()
        store.commit(epoch, BASE, [_submit(1)])  # the statements' first use
        store.commit(epoch, BASE, [status(1, TaskStatus.RUNNING)])
        store.commit(epoch, BASE, [status(1, TaskStatus.SUCCEEDED)], [(TaskId(1), b"o")])
        counts = []
        for i in range(2, 5):
            row = []
            for batch, outputs in (
                ([_submit(i)], []),
                ([status(i, TaskStatus.RUNNING)], []),
                ([status(i, TaskStatus.SUCCEEDED)], [(TaskId(i), b"out")]),
            ):
                before = proxy.count
                store.commit(epoch, BASE, batch, outputs)
                row.append(proxy.count - before)
            counts.append(row)
        assert counts == [[1, 1, 1]] * 3
        assert dep_rows(store.engine) == []
        assert task_rows(store.engine) == {i: ("succeeded", None) for i in range(1, 5)}
        assert store.load_output(TaskId(3)) == b"out"
        store.release_leadership()


def test_a_replayed_batch1_submission_adds_no_dependency_row(db_url: URL) -> None:
    """A submission stored already (and moved on since): replayed alone, it changes nothing,
    adds none of its dependency rows again, and brings back none of a finished task's."""
    with SqlStore.open(db_url) as store:
        epoch = store.acquire_leadership()
        store.commit(epoch, BASE, [_submit(1), _submit(2)])
        store.commit(epoch, BASE, [status(1, TaskStatus.RUNNING)])
        store.commit(epoch, BASE, [status(2, TaskStatus.SUCCEEDED)])
        before, deps_before = task_rows(store.engine), dep_rows(store.engine)
        assert [d[:2] for d in deps_before] == [(1, 0), (1, 1)]
        for i in (1, 2):
            store.commit(epoch, BASE, [_submit(i)])
        assert task_rows(store.engine) == before
        assert dep_rows(store.engine) == deps_before
        store.commit(epoch, BASE, [_submit(3)])
        assert [d[:2] for d in dep_rows(store.engine)] == [(1, 0), (1, 1), (3, 0), (3, 1)]
        store.release_leadership()


def test_a_batch1_revival_restores_dependency_rows_and_live_key(
    db_url: URL, dialect: str, revivals: list[int]
) -> None:
    """A live transition of a finished task, alone: the guarded packet fails on it (MariaDB,
    PostgreSQL) and the commit run again restores its dependency rows and its live key. A
    live transition of a live task, or of a task not stored, runs once."""
    with SqlStore.open(db_url) as store:
        epoch = store.acquire_leadership()
        store.commit(epoch, BASE, [_submit(1), _submit(2)])
        before = dep_rows(store.engine)
        store.commit(epoch, BASE, [status(1, TaskStatus.SUCCEEDED)], [(TaskId(1), b"out")])
        assert [d[0] for d in dep_rows(store.engine)] == [2, 2]
        store.commit(epoch, BASE, [status(2, TaskStatus.RUNNING)])
        store.commit(epoch, BASE, [status(99, TaskStatus.RUNNING)])  # not stored: logged
        assert revivals == []
        store.commit(epoch, BASE, [status(1, TaskStatus.RUNNING)])
        assert task_rows(store.engine) == {1: ("running", "k1"), 2: ("running", "k2")}
        assert dep_rows(store.engine) == before
        assert revivals == ([] if dialect == "sqlite" else [1])
        store.release_leadership()


@pytest.mark.parametrize("kind", ["submission", "running", "succeeded", "revival"])
def test_a_fenced_batch1_commit_writes_nothing(db_url: URL, kind: str) -> None:
    """Another instance took the lease: a batch-1 commit of each kind raises `Fenced` and
    writes nothing (the fence fails the packet before anything behind it runs)."""
    with SqlStore.open(db_url) as store:
        epoch = store.acquire_leadership()
        store.commit(epoch, BASE, [_submit(1), _submit(2)])
        store.commit(epoch, BASE, [status(2, TaskStatus.SUCCEEDED)])
        before, deps_before = task_rows(store.engine), dep_rows(store.engine)
        with store.engine.begin() as conn:
            conn.execute(update(leader).values(epoch=leader.c.epoch + 1, holder="someone else"))
        batch, outputs = {
            "submission": ([_submit(3)], []),
            "running": ([status(1, TaskStatus.RUNNING)], []),
            "succeeded": ([status(1, TaskStatus.SUCCEEDED)], [(TaskId(1), b"out")]),
            "revival": ([status(2, TaskStatus.RUNNING)], []),
        }[kind]
        with pytest.raises(Fenced):
            store.commit(epoch, BASE, batch, outputs)
        assert task_rows(store.engine) == before
        assert dep_rows(store.engine) == deps_before


def test_a_revival_among_live_transitions_is_found(
    db_url: URL, dialect: str, revivals: list[int]
) -> None:
    """Three live transitions, the last a finished task's (MariaDB's guard binds its ids
    padded to four): the commit runs again and restores that task; the others move once."""
    with SqlStore.open(db_url) as store:
        epoch = store.acquire_leadership()
        store.commit(epoch, BASE, [_submit(1), _submit(2), _submit(3)])
        before = dep_rows(store.engine)
        store.commit(epoch, BASE, [status(3, TaskStatus.CANCELLED)])
        store.commit(epoch, BASE, [status(i, TaskStatus.RUNNING) for i in (1, 2)])
        assert revivals == []
        store.commit(epoch, BASE, [status(i, TaskStatus.RUNNING) for i in (1, 2, 3)])
        assert task_rows(store.engine) == {i: ("running", f"k{i}") for i in (1, 2, 3)}
        assert dep_rows(store.engine) == before
        assert revivals == ([] if dialect == "sqlite" else [1])
        store.release_leadership()
