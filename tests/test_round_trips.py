"""A commit costs the same number of statements whatever its batch size (no statement per row)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import URL, event, text

from cronoq_store import (
    ById,
    Dep,
    SqlStore,
    StatusChanged,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    TimeBase,
)
from cronoq_store.store import StoreConfig

BASE = TimeBase(unix_ns=1_700_000_000_000_000_000)


def _statements(store: SqlStore, *commit_args: Any) -> int:
    """How many statements `store.commit(*commit_args)` sends.

    MySQL's per-connection lock-wait setting is sent once for each pooled connection, not per
    commit, so it does not count.
    """
    count = 0

    def before(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        nonlocal count
        if not statement.startswith("SET SESSION"):
            count += 1

    event.listen(store.engine, "before_cursor_execute", before)
    try:
        store.commit(*commit_args)
    finally:
        event.remove(store.engine, "before_cursor_execute", before)
    return count


def test_statements_do_not_grow_with_batch_size(db_url: URL) -> None:
    with SqlStore.open(db_url) as store:
        epoch = store.acquire_leadership()
        counts = {}
        start = 0
        for size in (10, 200):
            ids = range(start, start + size)
            submits = [
                Submitted(
                    id=TaskId(i),
                    seq=i,
                    arrival=i,
                    spec=TaskSpec(
                        payload=b"x", key=f"k{i}", deps=(Dep(target=ById(id=TaskId(start))),)
                    ),
                )
                for i in ids
            ]
            done = [
                StatusChanged(id=TaskId(i), status=TaskStatus.SUCCEEDED, attempt=1, at=i)
                for i in ids
            ]
            outputs = [(TaskId(i), b"out") for i in ids]
            counts[size] = (
                _statements(store, epoch, BASE, submits),
                _statements(store, epoch, BASE, done, outputs),
            )
            start += size
        assert counts[10] == counts[200]
        store.release_leadership()


def test_a_connection_returned_inside_a_transaction_is_rolled_back(
    dialect: str, db_url: URL
) -> None:
    """A connection handed back to the store's pool in the middle of a transaction (a raw
    DB-API use) is rolled back: nothing it left open reaches the next user of the session."""
    with SqlStore.open(db_url, StoreConfig(pool_size=1)) as store:
        raw = store.engine.raw_connection()
        cursor = raw.cursor()
        if dialect == "sqlite":  # its driver runs in autocommit mode under the store
            cursor.execute("BEGIN")
        cursor.execute("UPDATE cronoq_leader SET holder = 'left-open' WHERE id = 1")
        cursor.close()
        raw.close()  # back to the pool, uncommitted
        with store.engine.connect() as conn:  # the same session (pool_size=1)
            holder = conn.execute(text("SELECT holder FROM cronoq_leader WHERE id = 1")).scalar()
        assert holder is None
