"""What the tests build batches from, and how they wait: one of each, so that no file carries
its own near-copy with other defaults.

`BASE` is the test kit's time base (November 2023, so that anything committed under it is old
enough to prune); a test that is about time bases makes its own.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from sqlalchemy import URL, Engine, create_engine, select, text

from cronoq_store import StatusChanged, Submitted, TaskId, TaskSpec, TaskStatus
from cronoq_store.schema import task_deps, tasks
from cronoq_store.testing import BASE

__all__ = [
    "BASE",
    "captured",
    "dep_rows",
    "execute",
    "found_empty",
    "keyed",
    "mysql_accesses",
    "no_connection_left",
    "status",
    "submit",
    "task_rows",
    "wait_until",
]


def submit(
    i: int,
    payload: bytes | None = None,
    *,
    seq: int | None = None,
    arrival: int | None = None,
    **spec: Any,
) -> Submitted:
    """Task `i` submitted with payload `b"p<i>"`, seq and arrival `i`, unless given; `spec`
    holds any further `TaskSpec` field (key, deps, pool, ...)."""
    return Submitted(
        id=TaskId(i),
        seq=i if seq is None else seq,
        arrival=i if arrival is None else arrival,
        spec=TaskSpec(payload=b"p%d" % i if payload is None else payload, **spec),
    )


def keyed(i: int, **spec: Any) -> Submitted:
    """Task `i` submitted with key `k<i>`: every commit of it also claims a live key."""
    return submit(i, key=f"k{i}", **spec)


def task_rows(engine: Engine) -> dict[int, tuple[Any, ...]]:
    """Every stored task's status and live key, by id."""
    with engine.connect() as conn:
        rows = conn.execute(select(tasks.c.id, tasks.c.status, tasks.c.live_key)).all()
    return {r.id: (r.status, r.live_key) for r in rows}


def dep_rows(engine: Engine) -> list[tuple[Any, ...]]:
    """Every stored dependency row, by task and ordinal."""
    with engine.connect() as conn:
        rows = conn.execute(select(task_deps).order_by(task_deps.c.task_id, task_deps.c.ordinal))
        return [tuple(r) for r in rows]


def mysql_accesses(node: Any) -> Iterator[dict[str, Any]]:
    """Every access to the task table in a MariaDB `ANALYZE FORMAT=JSON` document."""
    if isinstance(node, dict):
        if node.get("table_name") == tasks.name:
            yield node
        for value in node.values():
            yield from mysql_accesses(value)
    elif isinstance(node, list):
        for value in node:
            yield from mysql_accesses(value)


def status(
    i: int,
    st: TaskStatus = TaskStatus.SUCCEEDED,
    message: str | None = None,
    *,
    attempt: int = 1,
    at: int | None = None,
) -> StatusChanged:
    """Task `i` moved to `st` at engine time `at` (100 + i unless given)."""
    return StatusChanged(
        id=TaskId(i), status=st, attempt=attempt, at=100 + i if at is None else at, message=message
    )


def wait_until(
    condition: Callable[[], object], what: str, timeout: float, pause: float = 0.01
) -> None:
    """Return once `condition()` is true; fail naming `what` when it is not within `timeout` s.

    A bound, not a tuned sleep: a test waits for what it needs, and a wait that never ends is a
    failure that says what never happened.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(pause)


def found_empty(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set once a store's check of the inbox (`wait_inbox`'s, on either face) found it empty:
    from then on an enqueue lands while the store waits, not before its first look."""
    from cronoq_store import inbox

    empty = threading.Event()
    has_items = inbox.has_items

    def checked(conn: Any) -> bool:
        found = has_items(conn)
        if not found:
            empty.set()
        return found

    monkeypatch.setattr(inbox, "has_items", checked)
    return empty


def no_connection_left(store: Any, engine: Engine) -> None:
    """Fail when a connection stays checked out of `store`'s pool (`engine`'s) once it stopped
    leading (a leader keeps one for its commits): one its keeper holds for a renewal is back
    within moments; one a test or the store leaked never is."""
    store.release_leadership()
    pool: Any = engine.pool
    wait_until(lambda: pool.checkedout() == 0, "every connection back in the pool", 10)


def execute(url: URL, *statements: str) -> None:
    """Run `statements` in one transaction on an engine of their own, disposed of afterwards:
    what a test changes by hand before it looks at what the store or the CLI makes of it."""
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            for statement in statements:
                conn.execute(text(statement))
    finally:
        engine.dispose()


def captured(
    args: Sequence[str], *, timeout: float, check: bool = False, **options: Any
) -> subprocess.CompletedProcess[str]:
    """`args` run to their end within `timeout` seconds, their output captured as text (a test
    reads it, and shows it when an assertion fails); `options` go to `subprocess.run`."""
    return subprocess.run(
        list(args), capture_output=True, text=True, timeout=timeout, check=check, **options
    )
