"""A commit that cannot finish within `commit_timeout` rolls back with `StoreUnavailable`."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from builders import BASE
from sqlalchemy import URL, create_engine, select

import cronoq_store as cq
from cronoq_store.schema import tasks

TIMEOUT = timedelta(seconds=1)


def test_blocked_commit_times_out_and_writes_nothing(db_url: URL, dialect: str) -> None:
    config = cq.StoreConfig(commit_timeout=TIMEOUT, lease_ttl=timedelta(seconds=30))
    with cq.SqlStore.open(db_url, config) as store:
        epoch = store.acquire_leadership()
        spec = cq.TaskSpec(payload=b"p")
        store.commit(epoch, BASE, [cq.Submitted(id=cq.TaskId(1), seq=1, arrival=1, spec=spec)])
        blocker = create_engine(db_url)
        try:
            with blocker.connect() as other:
                # Another writer holds what the commit needs, and keeps holding it.
                if dialect == "sqlite":
                    other.exec_driver_sql("BEGIN IMMEDIATE")
                else:
                    other.execute(select(tasks.c.id).where(tasks.c.id == 1).with_for_update())
                started = time.monotonic()
                with pytest.raises(cq.StoreUnavailable) as raised:
                    store.commit(
                        epoch,
                        BASE,
                        [
                            cq.StatusChanged(
                                id=cq.TaskId(1), status=cq.TaskStatus.RUNNING, attempt=1, at=5
                            ),
                            cq.Submitted(id=cq.TaskId(2), seq=2, arrival=2, spec=spec),
                        ],
                    )
                waited = time.monotonic() - started
                other.rollback()
        finally:
            blocker.dispose()
        # Bounded by the timeout (generous slack for a loaded machine), not the 5 s busy
        # timeout or the server's 50 s default lock wait.
        assert waited < 4.5
        with store.engine.connect() as conn:
            rows = conn.execute(select(tasks.c.id, tasks.c.status).order_by(tasks.c.id)).all()
        stored = [(r.id, r.status) for r in rows]
        if "outcome unknown" in str(raised.value):
            # Its COMMIT left in its one flight (PostgreSQL) and the server, still waiting
            # when the deadline cut the session off, may finish it once the lock is gone:
            # all of the batch or none of it.
            assert stored in ([(1, "queued")], [(1, "running"), (2, "queued")])
        else:
            assert stored == [(1, "queued")]
        # The store carries on once the blocker is gone.
        store.commit(epoch, BASE, [cq.Submitted(id=cq.TaskId(2), seq=2, arrival=2, spec=spec)])
        task = store.get_task(cq.ById(id=cq.TaskId(2)))
        assert task is not None


def test_commit_stalled_on_a_table_lock_leaves_the_lease(db_url: URL, dialect: str) -> None:
    """Issue 37, point 2: a commit waiting on a table lock (a migration's ALTER TABLE queued
    on the tasks table) holds the lease row, and the keeper's renewal queues behind it. Each
    such commit gives up by its own lock bound, well inside the lease, and the leader that
    keeps trying to commit through two TTLs keeps its lease all along."""
    if dialect == "sqlite":
        pytest.skip(
            "SQLite: a commit waits for the write lock before it holds anything, and a "
            "renewal needs the same lock: nothing of the lease row is held by a waiting commit"
        )
    ttl = timedelta(seconds=4)  # a lock bound of (4 - 1) / 3 = 1 s, MariaDB's least
    config = cq.StoreConfig(
        lease_ttl=ttl, lease_renew=timedelta(seconds=1), commit_timeout=timedelta(seconds=20)
    )
    lost = threading.Event()
    spec = cq.TaskSpec(payload=b"p")
    with cq.SqlStore.open(db_url, config) as store:
        epoch = store.acquire_leadership()
        store.on_leadership_lost(lost.set)
        store.commit(epoch, BASE, [cq.Submitted(id=cq.TaskId(1), seq=1, arrival=1, spec=spec)])
        blocker = create_engine(db_url)
        waits: list[float] = []
        try:
            with blocker.connect() as other:
                if dialect == "postgresql":  # what an ALTER TABLE takes (and a queued one asks)
                    other.exec_driver_sql("LOCK TABLE cronoq_tasks IN ACCESS EXCLUSIVE MODE")
                else:
                    other.exec_driver_sql("LOCK TABLES cronoq_tasks WRITE")
                until = time.monotonic() + 2 * ttl.total_seconds()
                n = 2
                while time.monotonic() < until and not lost.is_set():
                    started = time.monotonic()
                    with pytest.raises(cq.StoreUnavailable):
                        store.commit(
                            epoch,
                            BASE,
                            [cq.Submitted(id=cq.TaskId(n), seq=n, arrival=n, spec=spec)],
                        )
                    waits.append(time.monotonic() - started)
                    n += 1
                if dialect != "postgresql":
                    other.exec_driver_sql("UNLOCK TABLES")
                other.rollback()
        finally:
            blocker.dispose()
        # Each stalled commit ended by its lock bound (1 s here), not by the 20 s commit
        # timeout; generous slack for a loaded machine.
        assert waits and max(waits) < 1.0 + 2.0, waits
        assert not lost.is_set(), f"the leader lost its lease to its own waiting commits {waits}"
        assert store.epoch == epoch
        store.commit(epoch, BASE, [cq.Submitted(id=cq.TaskId(99), seq=99, arrival=99, spec=spec)])
        assert store.get_task(cq.ById(id=cq.TaskId(99))) is not None
