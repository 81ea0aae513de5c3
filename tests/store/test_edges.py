"""Semantics at the edges, on every dialect: the same folding and bound rules hold everywhere.

Ids and times at the ends of the 64-bit range, saturating bounds, time bases that move,
revivals, replays, batch order, prune beside a leader's commits, SQLite URLs, and refs.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
import subprocess
import sys
import threading
from datetime import timedelta
from importlib.metadata import requires
from pathlib import Path
from typing import Any

import builders
import pytest
from builders import BASE
from sqlalchemy import URL, event, make_url

import cronoq_store as cq
from cronoq_store.model import INT64_MAX, INT64_MIN
from cronoq_store.model import SECOND_NS as SECOND


@pytest.fixture
def store(store: cq.SqlStore, dialect: str) -> cq.SqlStore:
    """conftest's store, leading. (`dialect` named again: pytest does not parametrize a test
    by what only the fixture this one overrides takes.)"""
    store.acquire_leadership()
    return store


def lead(store: cq.SqlStore) -> int:
    epoch = store.epoch
    assert epoch is not None
    return epoch


def submit(i: int, key: str | None = None, **spec: Any) -> cq.Submitted:
    """At seq and arrival 0: a task at an end of the id range is not at an end of time."""
    return builders.submit(i, b"p", seq=0, arrival=0, key=key, **spec)


def status(i: int, st: cq.TaskStatus, at: int = 100) -> cq.StatusChanged:
    return builders.status(i, st, at=at)


def state(store: cq.SqlStore, i: int) -> cq.TaskStatus | None:
    record = store.get_task(cq.ById(i))
    return None if record is None else record.status


# 1. Ids at the top (and bottom) of the 64-bit range.


def test_ids_at_the_ends_of_the_range_commit_and_recover(store: cq.SqlStore) -> None:
    store.commit(lead(store), BASE, [submit(INT64_MAX, key="top"), submit(INT64_MIN)])
    rec = store.recover(BASE)
    assert [t.id for t in rec.tasks] == [INT64_MIN, INT64_MAX]
    assert rec.next_id == 2**63  # one above the top id: the id high-water mark is unsigned
    top = store.get_task(cq.ById(INT64_MAX))
    assert top is not None and top.key == "top"
    # Finished and pruned, the top id is still never handed out again.
    store.commit(lead(store), BASE, [status(INT64_MAX, cq.TaskStatus.CANCELLED, at=-BASE.unix_ns)])
    assert store.prune(timedelta(0)) == 1
    assert store.recover(BASE).next_id == 2**63


# 2. Durations and query bounds saturate.


def test_unbounded_retention_recovers(db_url: URL) -> None:
    with cq.SqlStore.open(db_url, cq.StoreConfig(retention=timedelta.max)) as store:
        epoch = store.acquire_leadership()
        store.commit(epoch, BASE, [submit(1), status(1, cq.TaskStatus.FAILED, at=-BASE.unix_ns)])
        rec = store.recover(BASE)  # every finished task is within an unbounded retention
        assert [t.id for t in rec.terminal] == [1]


def test_query_bounds_saturate(store: cq.SqlStore) -> None:
    store.commit(
        lead(store),
        BASE,
        [submit(1), status(1, cq.TaskStatus.SUCCEEDED), submit(INT64_MIN), submit(INT64_MAX)],
        [(cq.TaskId(1), b"out")],
    )
    store.commit(lead(store), BASE, [status(INT64_MIN, cq.TaskStatus.FAILED)])
    assert store.prune(timedelta(days=200_000)) == 0
    assert store.prune(timedelta.max) == 0
    everything = [INT64_MIN, 1]
    assert [t.id for t in store.list_finished(limit=2**64)] == everything
    assert [t.id for t in store.list_finished(after=cq.TaskId(-(2**64)))] == everything
    assert [t.id for t in store.list_finished(after=cq.TaskId(INT64_MIN))] == [1]
    assert store.list_finished(after=cq.TaskId(2**63)) == []
    assert store.list_finished(after=cq.TaskId(INT64_MAX)) == []
    assert store.load_output(cq.TaskId(2**63)) is None
    assert store.load_output(cq.TaskId(-(2**63) - 1)) is None
    assert store.get_task(cq.ById(id=cq.TaskId(2**63))) is None
    assert store.get_task(cq.ById(cq.TaskId(-(2**70)))) is None
    with pytest.raises(cq.InvalidValue):
        store.load_output("1")  # type: ignore[arg-type]
    with pytest.raises(cq.InvalidValue):
        store.list_finished(limit=1.5)  # type: ignore[arg-type]


def test_waits_beyond_what_a_dialect_enforces_are_refused() -> None:
    for name in ("lease_ttl", "lease_renew", "lock_poll", "busy_timeout", "commit_timeout"):
        with pytest.raises(cq.InvalidValue, match=name):
            cq.StoreConfig(**{name: timedelta.max})
    cq.StoreConfig(retention=timedelta.max)  # retention saturates instead


def test_a_dependency_on_an_id_outside_the_range_is_refused(store: cq.SqlStore) -> None:
    with pytest.raises(cq.InvalidValue, match="outside the 64-bit range"):
        store.commit(lead(store), BASE, [submit(1, deps=(cq.Dep(target=cq.ById(2**63)),))])


def test_bad_outputs_are_refused_before_any_write(store: cq.SqlStore) -> None:
    for outputs in ([(cq.TaskId(2**63), b"x")], [(cq.TaskId(1), "text")], [(cq.TaskId(1),)]):
        with pytest.raises(cq.InvalidValue, match="outputs"):
            store.commit(lead(store), BASE, [submit(1)], outputs)  # type: ignore[arg-type]
    assert store.get_task(cq.ById(1)) is None


# 3. A new time base never breaks a task that was valid when committed.


def test_times_at_the_ends_of_the_range_survive_a_new_base(store: cq.SqlStore) -> None:
    low = cq.TaskSpec(payload=b"", deadline=INT64_MIN, fixed_start=cq.FixedStart(at=INT64_MIN))
    sched = cq.RecurringSpec(
        name="s", template=low, interval_ns=SECOND, start=INT64_MIN, end=INT64_MIN + 1
    )
    store.commit(
        lead(store),
        BASE,
        [
            submit(1, deadline=INT64_MIN, fixed_start=cq.FixedStart(at=INT64_MIN)),
            cq.RecurringUpsert(spec=sched),
        ],
    )
    later = cq.TimeBase(BASE.unix_ns + 5 * SECOND)
    rec = store.recover(later)
    assert rec.terminal == []  # nothing quarantined
    (task,) = rec.tasks
    assert task.spec.deadline == INT64_MIN  # saturated, not corrupt
    assert task.spec.fixed_start == cq.FixedStart(at=INT64_MIN)
    (recovered,) = rec.recurring
    assert (recovered.spec.start, recovered.spec.end) == (INT64_MIN, INT64_MIN)
    assert recovered.spec.template.deadline == INT64_MIN
    # The top of the range, under a base that moves back.
    zero = cq.TimeBase(0)
    store.commit(lead(store), zero, [submit(2, deadline=INT64_MAX)])
    tasks = {t.id: t for t in store.recover(cq.TimeBase(-5 * SECOND)).tasks}
    assert tasks[2].spec.deadline == INT64_MAX
    assert store.get_task(cq.ById(1)) is not None
    assert state(store, 1) is cq.TaskStatus.QUEUED


# 4. A finished task moved back to a live status is fully live again.


def test_a_revived_task_holds_its_key_and_dependencies(db_url: URL) -> None:
    with cq.SqlStore.open(db_url, cq.StoreConfig(retention=timedelta(0))) as store:
        epoch = store.acquire_leadership()
        old = -BASE.unix_ns  # Unix time 0: long outside retention
        store.commit(
            epoch,
            BASE,
            [
                submit(0, key="dep"),
                status(0, cq.TaskStatus.SUCCEEDED, at=old),
                submit(
                    1, key="k", deps=(cq.Dep(target=cq.ById(0)), cq.Dep(target=cq.ByKey("dep")))
                ),
                status(1, cq.TaskStatus.FAILED, at=old),
            ],
        )
        assert [t.id for t in store.recover(BASE).terminal] == []  # nothing needs task 0
        store.commit(epoch, BASE, [status(1, cq.TaskStatus.RETRYING)])  # revived
        rec = store.recover(BASE)
        assert [t.id for t in rec.tasks] == [1]
        assert [t.id for t in rec.terminal] == [0]  # depended on again
        assert store.prune(timedelta(0)) == 0  # so prune keeps it
        with pytest.raises(cq.StoreError, match="conflicts"):
            store.commit(epoch, BASE, [submit(2, key="k")])  # the key is live again
        assert store.get_task(cq.ById(2)) is None


def test_a_revival_clashing_with_a_live_key_writes_nothing(store: cq.SqlStore) -> None:
    epoch = lead(store)
    store.commit(
        epoch, BASE, [submit(1, key="k"), status(1, cq.TaskStatus.CANCELLED), submit(2, "k")]
    )
    with pytest.raises(cq.StoreError, match="conflicts"):
        store.commit(epoch, BASE, [submit(3), status(1, cq.TaskStatus.RUNNING)])
    assert state(store, 1) is cq.TaskStatus.CANCELLED
    assert store.get_task(cq.ById(3)) is None


def test_live_transitions_of_live_finished_and_missing_tasks_in_one_batch(
    store: cq.SqlStore,
) -> None:
    """Live transitions are one statement for tasks still live; a finished one among them is
    revived (its key and dependency rows back) and a missing one has no effect, in one batch or
    one commit each, and a key a batch releases can be taken back by a revival after it."""
    epoch = lead(store)
    on_0 = (cq.Dep(target=cq.ById(0)),)
    store.commit(epoch, BASE, [submit(0), submit(1, deps=on_0), submit(2, key="k", deps=on_0)])
    store.commit(epoch, BASE, [status(2, cq.TaskStatus.FAILED), submit(3, key="k")])
    for batches in (
        [[status(1, cq.TaskStatus.RUNNING), status(2, cq.TaskStatus.RETRYING)]],
        [[status(9, cq.TaskStatus.RUNNING)], [status(1, cq.TaskStatus.RUNNING)]],
    ):
        store.commit(epoch, BASE, [status(2, cq.TaskStatus.FAILED)])  # (already: no change)
        store.commit(epoch, BASE, [status(3, cq.TaskStatus.CANCELLED)])  # releases "k"
        for b in batches:
            store.commit(epoch, BASE, [*b, status(9, cq.TaskStatus.RUNNING)])
        store.commit(epoch, BASE, [status(2, cq.TaskStatus.RETRYING)])
        assert state(store, 1) is cq.TaskStatus.RUNNING
        assert state(store, 2) is cq.TaskStatus.RETRYING
        assert store.get_task(cq.ById(9)) is None
        rec = store.recover(BASE)
        assert [t.id for t in rec.tasks] == [0, 1, 2]
        assert rec.tasks[2].spec.deps == on_0
        with pytest.raises(cq.StoreError, match="conflicts"):
            store.commit(epoch, BASE, [submit(4, key="k")])  # task 2 holds the key again
        # Within one batch: task 2 finishes, releasing "k", then task 3 is revived with it.
        store.commit(
            epoch, BASE, [status(2, cq.TaskStatus.FAILED), status(3, cq.TaskStatus.RUNNING)]
        )
        assert [t.id for t in store.recover(BASE).tasks] == [0, 1, 3]
        store.commit(epoch, BASE, [status(3, cq.TaskStatus.CANCELLED)])
        store.commit(epoch, BASE, [status(2, cq.TaskStatus.RETRYING)])
        store.commit(epoch, BASE, [status(2, cq.TaskStatus.FAILED)])


# 5. Replaying an older batch changes nothing.


def test_replayed_batch_changes_nothing(store: cq.SqlStore) -> None:
    epoch = lead(store)
    a = [submit(1), status(1, cq.TaskStatus.RUNNING)]
    store.commit(epoch, BASE, a)
    store.commit(epoch, BASE, [status(1, cq.TaskStatus.SUCCEEDED, at=200)])
    store.commit(epoch, BASE, a)
    assert state(store, 1) is cq.TaskStatus.SUCCEEDED
    # The rule: a transition that comes before the repeated insert still applies.
    store.commit(epoch, BASE, [status(1, cq.TaskStatus.RUNNING, at=300), *a])
    assert state(store, 1) is cq.TaskStatus.RUNNING


@pytest.mark.parametrize(
    "ids",
    [
        pytest.param((10, 11, 13, 14), id="dense: one range"),
        pytest.param((10, 11, 500, 10**12), id="sparse: a lookup each"),
    ],
)
def test_a_partly_replayed_batch_inserts_only_the_new_tasks(
    store: cq.SqlStore, ids: tuple[int, ...]
) -> None:
    """The tasks of a batch stored already (here its lowest and highest ids) keep their rows
    and ignore what was folded into them; the others are inserted, however the ids are
    spread. A task stored between the batch's ids, and not in it, is untouched."""
    epoch = lead(store)
    low, *new, high = ids
    store.commit(epoch, BASE, [submit(low), submit(high), submit(12, key="between")])
    store.commit(epoch, BASE, [status(high, cq.TaskStatus.SUCCEEDED, at=200)])
    batch = [submit(i) for i in ids] + [status(i, cq.TaskStatus.RUNNING) for i in ids]
    store.commit(epoch, BASE, batch)
    # A stored task's RUNNING, folded into its insert, is ignored with it.
    assert [state(store, i) for i in ids] == [
        cq.TaskStatus.QUEUED,
        *[cq.TaskStatus.RUNNING for _ in new],
        cq.TaskStatus.SUCCEEDED,
    ]
    assert state(store, 12) is cq.TaskStatus.QUEUED


# 6. Mutations apply in batch order.


@pytest.mark.parametrize("split", [False, True])
def test_a_status_before_its_submission_has_no_effect(
    store: cq.SqlStore, split: bool, caplog: pytest.LogCaptureFixture
) -> None:
    epoch = lead(store)
    early, new = status(1, cq.TaskStatus.RUNNING), submit(1)
    with caplog.at_level(logging.WARNING, logger="cronoq_store.repository.commit"):
        for batch in [[early], [new]] if split else [[early, new]]:
            store.commit(epoch, BASE, batch)
    assert state(store, 1) is cq.TaskStatus.QUEUED
    assert "missing from the store" in caplog.text


def test_a_finished_task_not_stored_is_told_beside_one_that_is(
    store: cq.SqlStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A finished transition's count is read after its flight (on PostgreSQL, with the
    COMMIT): the warning still counts exactly the tasks that were not there."""
    epoch = lead(store)
    store.commit(epoch, BASE, [submit(1)])
    batch = [status(i, cq.TaskStatus.SUCCEEDED) for i in (1, 2, 3)]
    with caplog.at_level(logging.WARNING, logger="cronoq_store.repository.commit"):
        store.commit(epoch, BASE, batch, [(cq.TaskId(1), b"out")])
    assert state(store, 1) is cq.TaskStatus.SUCCEEDED
    assert "status updates for 2 tasks missing from the store" in caplog.text


# 7. Prune's delete re-checks, beside a leader's commits.


@pytest.mark.parametrize("by", ["id", "key"])
def test_prune_spares_a_dependency_committed_before_its_delete(
    db_url: URL, dialect: str, by: str
) -> None:
    """A live task committed (from another connection) just before prune's DELETE runs keeps
    its target. On SQLite no commit can land there at all: prune holds the write lock."""
    config = cq.StoreConfig(busy_timeout=timedelta(milliseconds=200))
    with cq.SqlStore.open(db_url, config) as store:
        epoch = store.acquire_leadership()
        store.commit(
            epoch, BASE, [submit(0, key="t"), status(0, cq.TaskStatus.SUCCEEDED, at=-BASE.unix_ns)]
        )
        target = cq.ById(0) if by == "id" else cq.ByKey("t")
        outcome: list[str] = []

        def before(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
            if outcome or not statement.lstrip().upper().startswith("DELETE FROM CRONOQ_TASKS"):
                return
            try:
                store.commit(epoch, BASE, [submit(5, deps=(cq.Dep(target=target),))])
                outcome.append("committed")
            except cq.StoreUnavailable:
                outcome.append("busy")

        event.listen(store.engine, "before_cursor_execute", before)
        try:
            pruned = store.prune(timedelta(0))
        finally:
            event.remove(store.engine, "before_cursor_execute", before)
        if dialect == "sqlite":
            assert outcome == ["busy"]  # writers are serialized: nothing lands in between
            assert pruned == 1
        else:
            assert outcome == ["committed"]
            assert pruned == 0
            assert state(store, 0) is cq.TaskStatus.SUCCEEDED
            assert [t.id for t in store.recover(BASE).terminal] == [0]


# 8. No hidden environment needs.


def test_zone_names_resolve_without_a_system_zone_database(tmp_path: Path) -> None:
    assert any(r.startswith("tzdata") for r in requires("cronoq-store") or [])
    code = (
        "from cronoq_store import RecurringSpec, TaskSpec\n"
        "RecurringSpec(name='n', template=TaskSpec(payload=b''), interval_ns=1)\n"
        "RecurringSpec(name='n', template=TaskSpec(payload=b''), cron='0 3 * * *',"
        " timezone='Europe/Berlin')\n"
    )
    env = {**os.environ, "PYTHONTZPATH": str(tmp_path)}  # an empty zone database
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)


# 9. The SQLite file checked is the file opened.


@pytest.mark.parametrize(
    "query", ["?nolock=1&uri=true", "?mode=memory&uri=true", "?uri=true", "?immutable=1"]
)
def test_sqlite_url_options_are_refused(tmp_path: Path, query: str) -> None:
    url = f"sqlite:///{tmp_path / 'x.db'}{query}"
    with pytest.raises(cq.InvalidValue, match="SQLite URL options"):
        cq.SqlStore.open(url)
    assert list(tmp_path.iterdir()) == []


def test_every_sqlite_file_is_private(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        with cq.SqlStore.open(make_url(f"sqlite:///{tmp_path / 'x.db'}")) as store:
            epoch = store.acquire_leadership()
            store.commit(epoch, BASE, [submit(1)])
            files = sorted(p.name for p in tmp_path.iterdir())
            assert files == ["x.db", "x.db-shm", "x.db-wal"]
            for p in tmp_path.iterdir():
                assert stat.S_IMODE(p.stat().st_mode) == 0o600, p.name
    finally:
        os.umask(old)


# 10. Refs are easy to write.


def test_refs_take_their_field_by_position() -> None:
    assert cq.ById(5) == cq.ById(id=cq.TaskId(5))
    assert cq.ByKey("k") == cq.ByKey(key="k")
    assert cq.TimeBase(7) == cq.TimeBase(unix_ns=7)
    with pytest.raises(cq.InvalidValue):
        cq.ByKey("")
    with pytest.raises(cq.InvalidValue):
        cq.ById("5")  # type: ignore[arg-type]


def test_sqlite_opens_while_another_connection_writes_in_rollback_mode(tmp_path: Path) -> None:
    """SQLite answers the switch to WAL with SQLITE_BUSY at once, without its busy handler,
    while another connection holds a write lock in rollback-journal mode (as one process
    creating the file does while others open it: seen as "database is locked" when three
    processes opened a fresh file together). The store waits for that lock as for any other,
    up to its busy timeout, instead of failing the open."""
    path = tmp_path / "x.db"
    writer = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    writer.execute("CREATE TABLE other (x INTEGER)")
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("INSERT INTO other VALUES (1)")
    release = threading.Timer(0.3, lambda: writer.execute("COMMIT"))  # well inside 5 s
    release.start()
    try:
        with cq.SqlStore.open(path) as store:
            assert store.recover(BASE).tasks == []
    finally:
        release.join()
        writer.close()
