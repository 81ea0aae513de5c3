"""End-to-end store behaviour on every dialect: lead, commit, recover, query, prune, fence."""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from builders import BASE, status, submit
from sqlalchemy import URL, Engine, create_engine, inspect
from sqlalchemy.schema import CreateSchema, DropSchema

import cronoq_store as cq
from cronoq_store import migrate


def test_commit_recover_query(store: cq.SqlStore) -> None:
    epoch = store.acquire_leadership()
    assert epoch == 1
    sched = cq.RecurringSpec(name="nightly", template=cq.TaskSpec(payload=b"t"), cron="0 3 * * *")
    store.commit(
        epoch,
        BASE,
        [
            submit(1, key="a"),
            submit(2, deps=(cq.Dep(target=cq.ById(id=cq.TaskId(1))),)),
            status(1, cq.TaskStatus.RUNNING, "started"),
            status(1, cq.TaskStatus.SUCCEEDED),
            submit(3, key="a"),
            cq.RecurringUpsert(spec=sched),
            cq.RecurringNext(name="nightly", next=500, last=cq.TaskId(3)),
        ],
        outputs=[(cq.TaskId(1), b"out")],
    )
    rec = store.recover(BASE)
    assert rec.next_id == 4
    assert [t.id for t in rec.tasks] == [2, 3]
    assert [(t.id, t.status) for t in rec.terminal] == [(1, cq.TaskStatus.SUCCEEDED)]
    assert rec.recurring[0].spec == sched
    assert (rec.recurring[0].next, rec.recurring[0].last) == (500, 3)
    one = store.get_task(cq.ById(id=cq.TaskId(1)))
    assert one is not None and one.message == "started" and one.output == b"out"
    newest = store.get_task(cq.ByKey(key="a"))
    assert newest is not None and newest.id == 3
    assert store.load_output(cq.TaskId(1)) == b"out"
    assert [r.id for r in store.list_finished()] == [1]


def test_duplicate_live_key_writes_nothing(store: cq.SqlStore) -> None:
    epoch = store.acquire_leadership()
    store.commit(epoch, BASE, [submit(1, key="k")])
    with pytest.raises(cq.StoreError):
        store.commit(epoch, BASE, [submit(2), submit(3, key="k")])
    assert store.get_task(cq.ById(id=cq.TaskId(2))) is None


def test_over_long_key_refused(store: cq.SqlStore) -> None:
    epoch = store.acquire_leadership()
    with pytest.raises(cq.InvalidValue, match=r"TaskSpec\.key"):
        store.commit(epoch, BASE, [submit(1), submit(2, key="x" * 513)])
    assert store.get_task(cq.ById(id=cq.TaskId(1))) is None


def test_fenced_after_takeover(db_url: URL, store: cq.SqlStore) -> None:
    epoch = store.acquire_leadership()
    store.release_leadership()
    with cq.SqlStore.open(db_url) as other:
        assert other.acquire_leadership() == epoch + 1
        with pytest.raises(cq.Fenced):
            store.commit(epoch, BASE, [submit(1)])
        other.release_leadership()
    assert store.get_task(cq.ById(id=cq.TaskId(1))) is None


def test_prune(store: cq.SqlStore) -> None:
    epoch = store.acquire_leadership()
    store.commit(epoch, BASE, [submit(1), submit(2, key="k")])
    store.commit(
        epoch,
        BASE,
        [
            status(1, cq.TaskStatus.SUCCEEDED),
            status(2, cq.TaskStatus.FAILED),
            submit(3, deps=(cq.Dep(target=cq.ByKey(key="k"), on="finish"),)),
        ],
    )
    # StatusChanged.at is in BASE time, far in the past: both are old enough.
    assert store.prune(timedelta(seconds=1)) == 1
    assert store.get_task(cq.ById(id=cq.TaskId(1))) is None
    assert store.get_task(cq.ById(id=cq.TaskId(2))) is not None


def test_quarantine_damaged_rows(store: cq.SqlStore) -> None:
    from sqlalchemy import update

    from cronoq_store.schema import recurring, tasks

    epoch = store.acquire_leadership()
    sched = cq.RecurringSpec(name="every", template=cq.TaskSpec(payload=b"t"), interval_ns=10**9)
    store.commit(
        epoch, BASE, [submit(1), submit(2, key="bad"), submit(3), cq.RecurringUpsert(spec=sched)]
    )
    with store.engine.begin() as conn:
        conn.execute(update(tasks).where(tasks.c.id == 2).values(deps='[{"id": "x"'))
        conn.execute(update(recurring).values(spec="{not json"))
    rec = store.recover(BASE)
    assert [t.id for t in rec.tasks] == [1, 3]
    assert [t.spec.payload for t in rec.tasks] == [b"p1", b"p3"]
    assert [(t.id, t.key, t.status) for t in rec.terminal] == [(2, "bad", cq.TaskStatus.FAILED)]
    assert rec.recurring == []
    damaged = store.get_task(cq.ById(id=cq.TaskId(2)))
    assert damaged is not None and damaged.status is cq.TaskStatus.FAILED
    assert damaged.message is not None and damaged.message.startswith("corrupt task row")
    with store.engine.connect() as conn:
        assert conn.execute(recurring.select()).one().spec == "{not json"
    # The key of the quarantined task is free again.
    store.commit(epoch, BASE, [submit(4, key="bad")])


def test_list_finished_pages_each_once(store: cq.SqlStore) -> None:
    epoch = store.acquire_leadership()
    ids = range(1, 26)
    store.commit(
        epoch,
        BASE,
        [
            cq.Submitted(
                id=cq.TaskId(i),
                seq=i,
                arrival=i,
                spec=cq.TaskSpec(payload=b"", pool="a" if i % 2 else "b"),
            )
            for i in ids
        ],
    )
    store.commit(
        epoch,
        BASE,
        [
            status(i, cq.TaskStatus.SUCCEEDED if i % 3 else cq.TaskStatus.FAILED)
            for i in ids
            if i != 25
        ],
    )
    seen: list[int] = []
    after = None
    while page := store.list_finished(after=after, limit=7):
        seen += [r.id for r in page]
        after = page[-1].id
    assert seen == list(range(1, 25))
    only = store.list_finished(pools=["a"], statuses=[cq.TaskStatus.FAILED], limit=100)
    assert [r.id for r in only] == [i for i in ids if i % 2 and not i % 3 and i != 25]
    assert store.load_output(cq.TaskId(3)) is None  # failed: no output
    assert store.load_output(cq.TaskId(25)) is None  # live


def test_strings_are_cleaned(store: cq.SqlStore) -> None:
    epoch = store.acquire_leadership()
    store.commit(
        epoch,
        BASE,
        [
            cq.Submitted(
                id=cq.TaskId(1),
                seq=1,
                arrival=1,
                spec=cq.TaskSpec(
                    payload=b"\x00", kind="a\x00b", key="k\ud800", labels={"x": "\x00"}
                ),
            ),
            status(1, cq.TaskStatus.RUNNING, "m\x00"),
        ],
    )
    got = store.get_task(cq.ByKey(key="k\ud800"))
    assert got is not None
    assert (got.kind, got.key, got.message) == ("a\ufffdb", "k\ufffd", "m\ufffd")
    [task] = store.recover(BASE).tasks
    assert task.spec.labels == {"x": "\ufffd"} and task.spec.payload == b"\x00"


def test_16_mib_payload_round_trips(store: cq.SqlStore) -> None:
    epoch = store.acquire_leadership()
    payload = bytes(range(256)) * (16 * 1024 * 1024 // 256)
    store.commit(
        epoch,
        BASE,
        [cq.Submitted(id=cq.TaskId(1), seq=1, arrival=1, spec=cq.TaskSpec(payload=payload))],
    )
    [task] = store.recover(BASE).tasks
    assert task.spec.payload == payload


def test_invalid_sqlite_paths_refused() -> None:
    for path in ("", ":memory:", ":x", "file:x.db", "FILE:x.db"):
        with pytest.raises(cq.InvalidValue):
            cq.SqlStore.open(path)


def test_dependency_rows_live_only_while_their_task_does(store: cq.SqlStore) -> None:
    from sqlalchemy import func, select

    from cronoq_store.schema import task_deps

    def dep_rows() -> int:
        with store.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(task_deps)).scalar_one())

    epoch = store.acquire_leadership()
    on_1 = (cq.Dep(target=cq.ById(id=cq.TaskId(1))), cq.Dep(target=cq.ByKey(key="k"), on="finish"))
    store.commit(epoch, BASE, [submit(1, key="k"), submit(2, deps=on_1), submit(3, deps=on_1)])
    assert dep_rows() == 4
    store.commit(epoch, BASE, [status(2, cq.TaskStatus.CANCELLED)])
    assert dep_rows() == 2
    # Inserted and finished within one batch: no rows at all.
    store.commit(epoch, BASE, [submit(4, deps=on_1), status(4, cq.TaskStatus.SKIPPED)])
    assert dep_rows() == 2


def test_key_released_earlier_in_the_batch_is_reusable(store: cq.SqlStore) -> None:
    epoch = store.acquire_leadership()
    store.commit(epoch, BASE, [submit(1, key="k")])
    store.commit(epoch, BASE, [status(1, cq.TaskStatus.SUCCEEDED), submit(2, key="k")])
    # Within one batch too: inserted, finished and its key reused.
    store.commit(epoch, BASE, [status(2, cq.TaskStatus.FAILED), submit(3, key="k")])
    newest = store.get_task(cq.ByKey(key="k"))
    assert newest is not None and newest.id == 3
    # Still exactly one live holder of the key.
    with pytest.raises(cq.StoreError):
        store.commit(epoch, BASE, [submit(4, key="k")])
    assert [t.id for t in store.recover(BASE).tasks] == [3]


def test_key_released_in_the_batch_is_reusable_by_a_bulk_insert(store: cq.SqlStore) -> None:
    """More than one new task go in one bulk statement (COPY on PostgreSQL), after the
    batch's transitions of stored tasks, whose released keys they may take."""
    epoch = store.acquire_leadership()
    store.commit(epoch, BASE, [submit(1, key="k"), submit(2, key="j")])
    finished = [status(1, cq.TaskStatus.SUCCEEDED), status(2, cq.TaskStatus.FAILED)]
    store.commit(epoch, BASE, [*finished, submit(3, key="k"), submit(4, key="j"), submit(5)])
    assert [t.id for t in store.recover(BASE).tasks] == [3, 4, 5]
    newest = store.get_task(cq.ByKey(key="k"))
    assert newest is not None and newest.id == 3


def test_over_long_pool_refused(store: cq.SqlStore) -> None:
    epoch = store.acquire_leadership()
    long_pool = cq.Submitted(
        id=cq.TaskId(2), seq=2, arrival=2, spec=cq.TaskSpec(payload=b"", pool="p" * 129)
    )
    with pytest.raises(cq.InvalidValue, match=r"pool"):
        store.commit(epoch, BASE, [submit(1), long_pool])
    assert store.get_task(cq.ById(id=cq.TaskId(1))) is None


def test_prune_goes_in_bounded_batches_and_keeps_dependencies(
    store: cq.SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sqlalchemy import event

    from cronoq_store.repository import prune

    epoch = store.acquire_leadership()
    n = 250
    store.commit(epoch, BASE, [submit(i, key=f"k{i}") for i in range(1, n + 1)])
    store.commit(
        epoch,
        BASE,
        [status(i, cq.TaskStatus.SUCCEEDED) for i in range(1, n + 1)]
        + [
            submit(n + 1, deps=(cq.Dep(target=cq.ById(id=cq.TaskId(7))),)),
            submit(n + 2, deps=(cq.Dep(target=cq.ByKey(key="k9"), on="finish"),)),
        ],
    )
    monkeypatch.setattr(prune, "PRUNE_BATCH", 100)
    deletes: list[int] = []

    def count(conn: object, cursor: object, statement: str, params: object, *a: object) -> None:
        if statement.lstrip().upper().startswith("DELETE FROM CRONOQ_TASKS"):
            deletes.append(1)

    event.listen(store.engine, "before_cursor_execute", count)
    try:
        assert store.prune(timedelta(seconds=1)) == n - 2
    finally:
        event.remove(store.engine, "before_cursor_execute", count)
    assert len(deletes) == 3  # 100 + 100 + 48: bounded batches, not one huge statement
    rec = store.recover(BASE)
    assert sorted(t.id for t in rec.terminal) == [7, 9]
    assert [t.id for t in rec.tasks] == [n + 1, n + 2]
    assert store.prune(timedelta(seconds=1)) == 0


def test_a_pruned_task_zero_is_never_handed_out_again(store: cq.SqlStore) -> None:
    epoch = store.acquire_leadership()
    assert store.recover(BASE).next_id == 0  # a fresh store starts at 0
    store.commit(
        epoch,
        BASE,
        [
            cq.Submitted(id=cq.TaskId(0), seq=0, arrival=0, spec=cq.TaskSpec(payload=b"")),
            status(0, cq.TaskStatus.SUCCEEDED),
        ],
    )
    assert store.recover(BASE).next_id == 1
    assert store.prune(timedelta(seconds=1)) == 1
    assert store.recover(BASE).next_id == 1


def test_recovery_does_not_hold_the_sqlite_write_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The keeper must be able to renew while a large recovery streams."""
    import sqlite3

    from cronoq_store import codec

    path = tmp_path / "state.db"
    decode = codec.live_task_from_row
    writes: list[bool] = []

    def decode_while_another_writes(*args: object, **kwargs: object) -> object:
        if not writes:
            other = sqlite3.connect(path, timeout=0, isolation_level=None)
            try:
                other.execute("BEGIN IMMEDIATE")  # fails at once if recovery held the lock
                other.execute("ROLLBACK")
                writes.append(True)
            finally:
                other.close()
        return decode(*args, **kwargs)  # type: ignore[arg-type]

    with cq.SqlStore.open(path) as store:
        epoch = store.acquire_leadership()
        store.commit(epoch, BASE, [submit(i) for i in range(1, 4)])
        monkeypatch.setattr(codec, "live_task_from_row", decode_while_another_writes)
        assert [t.id for t in store.recover(BASE).tasks] == [1, 2, 3]
    assert writes == [True]


UNUSUAL_SCHEMAS = ["p%x", 'a "quoted" name', "x VALUES (y", "it's 100%s", "`b`"]
"""Schema names the store must quote, never cut or splice: %, quotes, spaces, " VALUES "."""


@pytest.mark.parametrize(
    "dialect",
    [
        pytest.param("postgresql", marks=pytest.mark.postgresql),
        pytest.param("mysql", marks=pytest.mark.mysql),
    ],
)
def test_unusual_schema_names(db_url: URL, dialect: str) -> None:
    """One new task (an INSERT) and several (PostgreSQL: COPY) land in the schema, as do
    inbox items enqueued there."""
    admin = create_engine(db_url)
    # A MySQL "schema" is a database on the server, which must exist: unique names, dropped.
    names = [
        n + (f" {uuid.uuid4().hex[:8]}" if dialect == "mysql" else "") for n in UNUSUAL_SCHEMAS
    ]
    try:
        for name in names:
            if dialect == "mysql":
                with admin.begin() as conn:
                    conn.execute(CreateSchema(name))
            with cq.SqlStore.open(db_url, cq.StoreConfig(schema=name)) as store:
                epoch = store.acquire_leadership()
                store.commit(epoch, BASE, [submit(1, key="one")])
                store.commit(epoch, BASE, [submit(i) for i in (2, 3, 4)])
                assert [t.id for t in store.recover(BASE).tasks] == [1, 2, 3, 4], name
                with admin.begin() as conn:  # several rows: one multi-row statement
                    ids = cq.enqueue_many(conn, [cq.TaskSpec(payload=b"a")] * 3, schema=name)
                assert [i.inbox_id for i in store.read_inbox()] == ids, name
            assert "cronoq_tasks" in inspect(admin).get_table_names(schema=name)
        assert "cronoq_tasks" not in inspect(admin).get_table_names()
    finally:
        if dialect == "mysql":
            with admin.begin() as conn:
                for name in names:
                    conn.execute(DropSchema(name, if_exists=True))
        admin.dispose()


@pytest.mark.parametrize(
    "name",
    ["a.b", "cronoq.", "", " lead", "trail ", "nul\x00", "tab\tin", "[b]", "x" * 64, "é" * 32],
)
def test_unusable_schema_names_are_refused(name: str) -> None:
    with pytest.raises(cq.InvalidValue, match=r"StoreConfig\.schema"):
        cq.StoreConfig(schema=name)


def test_unusable_schema_name_touches_nothing(engine: Engine, dialect: str) -> None:
    """Refused before any DDL, also when `migrate.upgrade` is called directly."""
    with pytest.raises(cq.InvalidValue, match="schema"):
        migrate.upgrade(engine, schema="cronoq.tasks")
    assert inspect(engine).get_table_names() == []
    if dialect == "postgresql":
        assert not {"cronoq", "cronoq.tasks"} & set(inspect(engine).get_schema_names())


def test_a_replayed_single_submission_is_ignored_whole(store: cq.SqlStore) -> None:
    """A commit of one task already stored changes nothing and raises nothing: not when its
    key is now held by another live task, not its dependency rows after it finished, not the
    transitions folded into it. (One new task takes the dialect's insert-or-ignore path, more
    the lookup-first path: both are checked here.)"""
    from sqlalchemy import func, select

    from cronoq_store.schema import task_deps

    def dep_rows() -> int:
        with store.engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(task_deps)).scalar_one())

    epoch = store.acquire_leadership()
    on_9 = (cq.Dep(target=cq.ById(id=cq.TaskId(9))),)
    store.commit(epoch, BASE, [submit(1, key="k", deps=on_9)])
    assert dep_rows() == 1
    store.commit(epoch, BASE, [status(1, cq.TaskStatus.SUCCEEDED)])
    store.commit(epoch, BASE, [submit(2, key="k")])  # the key, released, is now task 2's
    assert dep_rows() == 0
    for replay in (
        [submit(1, key="k", deps=on_9)],
        [submit(1, key="k", deps=on_9), status(1, cq.TaskStatus.RUNNING)],
        [submit(1, key="k", deps=on_9), submit(2, key="k")],
    ):
        store.commit(epoch, BASE, replay)
        one = store.get_task(cq.ById(id=cq.TaskId(1)))
        assert one is not None and one.status is cq.TaskStatus.SUCCEEDED
        assert dep_rows() == 0
    newest = store.get_task(cq.ByKey(key="k"))
    assert newest is not None and newest.id == 2
    assert [t.id for t in store.recover(BASE).tasks] == [2]
    # A new task whose key is held is still refused on the single-row path.
    with pytest.raises(cq.StoreError):
        store.commit(epoch, BASE, [submit(3, key="k")])
    assert store.get_task(cq.ById(id=cq.TaskId(3))) is None
