"""A commit that cannot finish within `commit_timeout` rolls back with `StoreUnavailable`."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from builders import BASE
from sqlalchemy import URL, create_engine, select

from cronoq_store import (
    ById,
    SqlStore,
    StatusChanged,
    StoreConfig,
    StoreUnavailable,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
)
from cronoq_store.schema import tasks

TIMEOUT = timedelta(seconds=1)


def test_blocked_commit_times_out_and_writes_nothing(db_url: URL, dialect: str) -> None:
    config = StoreConfig(commit_timeout=TIMEOUT, lease_ttl=timedelta(seconds=30))
    with SqlStore.open(db_url, config) as store:
        epoch = store.acquire_leadership()
        spec = TaskSpec(payload=b"p")
        store.commit(epoch, BASE, [Submitted(id=TaskId(1), seq=1, arrival=1, spec=spec)])
        blocker = create_engine(db_url)
        try:
            with blocker.connect() as other:
                # Another writer holds what the commit needs, and keeps holding it.
                if dialect == "sqlite":
                    other.exec_driver_sql("BEGIN IMMEDIATE")
                else:
                    other.execute(select(tasks.c.id).where(tasks.c.id == 1).with_for_update())
                started = time.monotonic()
                with pytest.raises(StoreUnavailable):
                    store.commit(
                        epoch,
                        BASE,
                        [
                            StatusChanged(id=TaskId(1), status=TaskStatus.RUNNING, attempt=1, at=5),
                            Submitted(id=TaskId(2), seq=2, arrival=2, spec=spec),
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
        assert [(r.id, r.status) for r in rows] == [(1, "queued")]
        # The store carries on once the blocker is gone.
        store.commit(epoch, BASE, [Submitted(id=TaskId(2), seq=2, arrival=2, spec=spec)])
        task = store.get_task(ById(id=TaskId(2)))
        assert task is not None
