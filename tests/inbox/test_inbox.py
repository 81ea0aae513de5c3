"""The inbox on every dialect: transactional enqueue, the fenced drain, set-aside rows, wake-ups."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from builders import BASE, found_empty
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import (
    URL,
    BigInteger,
    Engine,
    String,
    Table,
    create_engine,
    delete,
    event,
    func,
    select,
    text,
    update,
)
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column
from test_store_properties import PROPERTIES, task_specs

from cronoq_store import (
    ById,
    Dep,
    Fenced,
    FixedStart,
    InboxItem,
    InboxTaken,
    InvalidValue,
    Priority,
    RetryPolicy,
    SqlStore,
    StoreConfig,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    TimeBase,
    codec,
    enqueue,
    enqueue_async,
    enqueue_many,
    enqueue_many_async,
    execution,
)
from cronoq_store import inbox as inbox_module
from cronoq_store.aio import AsyncSqlStore, async_url
from cronoq_store.schema import inbox, inbox_rejects, leader, tasks
from cronoq_store.testing import AckLog, check, digest
from cronoq_store.testing.statements import after_statements

CONFIG = StoreConfig(lease_ttl=timedelta(seconds=5), inbox_poll=timedelta(milliseconds=20))


@pytest.fixture
def store_config() -> StoreConfig:
    return CONFIG


def rich_spec(i: int) -> TaskSpec:
    return TaskSpec(
        payload=b"\x00payload %d" % i,
        kind="email",
        pool="mail",
        priority=Priority.HIGH,
        key=f"order-{i}",
        deadline=BASE.unix_ns + 10**12,
        fixed_start=FixedStart(at=BASE.unix_ns + 10**9, on_miss="run"),
        duration_hint_ns=5,
        timeout_ns=7,
        retry=RetryPolicy(max_attempts=3),
        deps=(Dep(target=ById(TaskId(1))),),
        resources={"smtp": 1},
        tags=frozenset({"a", "b"}),
        labels={"k": "v"},
        tenant="acme",
    )


def unkeyed(i: int) -> TaskSpec:
    """`rich_spec(i)` without a key, so that it may be submitted as more than one task."""
    return dataclasses.replace(rich_spec(i), key=None)


def count(engine: Engine, table: Table) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())


def test_enqueue_commits_with_the_callers_transaction(store: SqlStore, engine: Engine) -> None:
    with engine.begin() as conn:
        first = enqueue(conn, rich_spec(1))
        more = enqueue_many(conn, [TaskSpec(payload=b"x%d" % i) for i in range(3)])
        assert store.read_inbox() == []  # not committed yet: nobody sees it
    with engine.connect() as conn, conn.begin() as txn:
        enqueue(conn, TaskSpec(payload=b"rolled back"))
        txn.rollback()
    assert more == sorted(more) and first < more[0]
    items = store.read_inbox()
    assert [i.inbox_id for i in items] == [first, *more]
    assert items[0].spec == rich_spec(1)  # times are Unix ns under the default base
    assert [i.spec.payload for i in items[1:]] == [b"x0", b"x1", b"x2"]
    assert all(isinstance(i, InboxItem) and i.enqueued_unix_ns > BASE.unix_ns for i in items)
    # Read under an engine's base, times become that engine's.
    under = store.read_inbox(base=BASE)[0].spec
    assert under.deadline == 10**12 and under.fixed_start is not None
    assert under.fixed_start.at == 10**9
    # Reading leaves items in place; limit and after page through them.
    assert [i.inbox_id for i in store.read_inbox(limit=2)] == [first, more[0]]
    assert [i.inbox_id for i in store.read_inbox(after=more[0])] == more[1:]


def test_an_enqueue_on_an_engine_commits_before_it_returns(store: SqlStore, engine: Engine) -> None:
    """Given an `Engine` (no transaction of the app's to join), enqueue writes in one of its
    own, committed when it returns; its connection goes back to the pool as it came, so the
    app's next transaction on it still rolls back."""
    first = enqueue(engine, rich_spec(1))
    more = enqueue_many(engine, [TaskSpec(payload=b"x%d" % i) for i in range(3)])
    quiet = enqueue(engine, TaskSpec(payload=b"q"), notify=False)
    assert enqueue_many(engine, []) == []
    with pytest.raises(InvalidValue):
        enqueue_many(engine, [TaskSpec(payload=b"never"), "not a spec"])  # type: ignore[list-item]
    with engine.connect() as conn:
        enqueue(conn, TaskSpec(payload=b"rolled back"))
        conn.rollback()
    items = store.read_inbox()
    assert [i.inbox_id for i in items] == [first, *more, quiet]
    assert items[0].spec == rich_spec(1)
    assert [i.spec.payload for i in items[1:]] == [b"x0", b"x1", b"x2", b"q"]


def test_async_enqueue_on_an_engine(db_url: URL) -> None:
    """`enqueue_async` / `enqueue_many_async` on an `AsyncEngine`: committed on return."""

    async def main() -> list[int]:
        app = create_async_engine(async_url(db_url))
        try:
            first = await enqueue_async(app, TaskSpec(payload=b"a"))
            return [first, *await enqueue_many_async(app, [TaskSpec(payload=b"b")] * 2)]
        finally:
            await app.dispose()

    SqlStore.open(db_url).close()
    ids = asyncio.run(main())
    with SqlStore.open(db_url) as store:
        items = store.read_inbox()
    assert [i.inbox_id for i in items] == ids
    assert [i.spec.payload for i in items] == [b"a", b"b", b"b"]


def test_invalid_specs_write_nothing(store: SqlStore, engine: Engine) -> None:
    with engine.begin() as conn:
        with pytest.raises(InvalidValue, match="pool"):
            enqueue_many(conn, [TaskSpec(payload=b"ok"), TaskSpec(payload=b"x", pool="p" * 999)])
        with pytest.raises(InvalidValue, match="TaskSpec"):
            enqueue(conn, b"not a spec")  # type: ignore[arg-type]
        with pytest.raises(InvalidValue):
            enqueue(conn, TaskSpec(payload=b"x"), schema="bad.name")
    assert count(engine, inbox) == 0
    with pytest.raises(InvalidValue):
        store.read_inbox(limit=0)


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "app_orders"
    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    email: Mapped[str] = mapped_column(String(100))


def test_orm_session_enqueues_with_the_apps_rows(store: SqlStore, engine: Engine) -> None:
    Base.metadata.create_all(engine)
    with Session(engine) as session, session.begin():
        session.add(Order(id=1, email="a@example.com"))
        session.flush()
        enqueue(session, TaskSpec(payload=b"receipt 1", kind="email"))
    with Session(engine) as session, session.begin():
        session.add(Order(id=2, email="b@example.com"))
        enqueue(session, TaskSpec(payload=b"receipt 2", kind="email"))
        session.rollback()
    with Session(engine) as session:
        assert [o.id for o in session.scalars(select(Order))] == [1]
    assert [i.spec.payload for i in store.read_inbox()] == [b"receipt 1"]
    Base.metadata.drop_all(engine)


def drain(store: SqlStore, epoch: int, next_id: int) -> list[InboxTaken | Submitted]:
    """What an engine commits for the inbox: a task and its InboxTaken per item."""
    batch: list[InboxTaken | Submitted] = []
    for n, item in enumerate(store.read_inbox(base=BASE)):
        batch.append(Submitted(id=TaskId(next_id + n), seq=n, arrival=0, spec=item.spec))
        batch.append(InboxTaken(inbox_id=item.inbox_id))
    return batch


def test_inbox_taken_drains_under_the_fence(db_url: URL, engine: Engine) -> None:
    with SqlStore.open(db_url, CONFIG) as old, SqlStore.open(db_url, CONFIG) as new:
        with engine.begin() as conn:
            ids = enqueue_many(conn, [TaskSpec(payload=b"t%d" % i) for i in range(5)])
        epoch = old.acquire_leadership()
        batch = drain(old, epoch, 100)
        old.commit(epoch, BASE, batch)
        old.commit(epoch, BASE, batch)  # a replay changes nothing
        assert old.read_inbox() == [] and count(engine, tasks) == 5
        # A fenced leader consumes nothing: its batch rolls back, the item stays for the next.
        with engine.begin() as conn:
            late = enqueue(conn, TaskSpec(payload=b"late"))
        stale = drain(old, epoch, 200)
        with engine.begin() as conn:  # another instance takes the lease, then lets it lapse
            conn.execute(update(leader).values(epoch=epoch + 1, holder="other", expires_unix_ns=0))
        with pytest.raises(Fenced):
            old.commit(epoch, BASE, stale)
        new_epoch = new.acquire_leadership(timeout=10)
        assert [i.inbox_id for i in new.read_inbox()] == [late]
        # An item the engine refuses is dropped alone.
        new.commit(new_epoch, BASE, [InboxTaken(inbox_id=late)])
        assert new.read_inbox() == [] and count(engine, tasks) == 5
    assert late > max(ids)
    with engine.connect() as conn:
        payloads = conn.execute(select(tasks.c.payload).order_by(tasks.c.id)).scalars().all()
    assert [bytes(p) for p in payloads] == [b"t%d" % i for i in range(5)]


def test_ids_are_never_reused(store: SqlStore, engine: Engine) -> None:
    epoch = store.acquire_leadership()
    seen: list[int] = []
    for round_ in range(3):
        with engine.begin() as conn:
            seen.append(enqueue(conn, TaskSpec(payload=b"r%d" % round_)))
        store.commit(epoch, BASE, drain(store, epoch, 10 * round_))
    assert seen == sorted(set(seen))  # taking the newest row does not hand its id out again


def test_undecodable_rows_are_set_aside(store: SqlStore, engine: Engine) -> None:
    with engine.begin() as conn:
        ids = enqueue_many(conn, [TaskSpec(payload=b"p%d" % i) for i in range(4)])
        conn.execute(update(inbox).where(inbox.c.id == ids[1]).values(deps="{not json"))
        conn.execute(update(inbox).where(inbox.c.id == ids[2]).values(tags="[1]"))
    items = store.read_inbox(limit=2)
    assert [i.inbox_id for i in items] == [ids[0], ids[3]]  # the rows behind still come
    assert store.inbox_rejected == 2
    with engine.connect() as conn:
        rejects = conn.execute(select(inbox_rejects).order_by(inbox_rejects.c.inbox_id)).all()
    assert [r.inbox_id for r in rejects] == ids[1:3]
    assert "deps" in rejects[0].reason and bytes(rejects[0].payload) == b"p1"
    assert "{not json" in rejects[0].fields
    assert count(engine, inbox) == 2


def woken_by_an_enqueue(store: SqlStore, engine: Engine, payload: bytes) -> list[bool]:
    """What `wait_inbox` returned to a thread that waited while an app enqueued `payload`."""
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(store.wait_inbox(30)))
    waiter.start()
    with engine.begin() as conn:
        enqueue(conn, TaskSpec(payload=payload))
    waiter.join(60)
    return woke


def test_wait_inbox_wakes_on_commit_only(
    dialect: str, store: SqlStore, engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    assert store.wait_inbox(0.05) is False
    with engine.connect() as conn, conn.begin() as txn:
        enqueue(conn, TaskSpec(payload=b"never"))
        txn.rollback()
    assert store.wait_inbox(0.2) is False  # a rolled-back enqueue wakes nobody for good
    assert woken_by_an_enqueue(store, engine, b"now") == [True]
    assert store.wait_inbox(0) is True  # it holds an item: no waiting at all
    assert "listen" not in caplog.text
    assert (store._listener is not None) == (dialect == "postgresql")  # LISTEN, not a poll


def test_sqlite_enqueue_waits_for_the_write_lock(
    dialect: str, store: SqlStore, db_url: URL
) -> None:
    if dialect != "sqlite":
        pytest.skip("SQLite's single writer")
    app = create_engine(db_url, connect_args={"timeout": 10})
    holder = create_engine(db_url, connect_args={"isolation_level": None})
    try:
        locked = threading.Event()
        release = threading.Event()

        def hold() -> None:
            with holder.connect() as conn:
                conn.exec_driver_sql("BEGIN IMMEDIATE")
                locked.set()
                release.wait(30)
                conn.exec_driver_sql("COMMIT")

        t = threading.Thread(target=hold)
        t.start()
        assert locked.wait(30)
        threading.Timer(0.3, release.set).start()
        with app.begin() as conn:
            inbox_id = enqueue(conn, TaskSpec(payload=b"waited"))
        t.join(30)
        assert release.is_set()  # it got in only after the holder let go
        assert [i.inbox_id for i in store.read_inbox()] == [inbox_id]
    finally:
        app.dispose()
        holder.dispose()


def test_schema_option(dialect: str, db_url: URL, engine: Engine) -> None:
    if dialect == "sqlite":
        pytest.skip("SQLite has no schemas")
    name = "cronoq inbox %"
    with engine.begin() as conn:
        q = conn.dialect.identifier_preparer.quote(name)
        conn.exec_driver_sql(f"CREATE SCHEMA {q}" if dialect != "mysql" else f"CREATE DATABASE {q}")
    try:
        with SqlStore.open(db_url, StoreConfig(schema=name)) as s:
            with engine.begin() as conn:
                first = enqueue(conn, TaskSpec(payload=b"s"), schema=name)
                more = enqueue_many(conn, [TaskSpec(payload=b"m")] * 2, schema=name)
            # An app engine that maps the schema itself needs no schema argument.
            mapped = engine.execution_options(schema_translate_map={None: name})
            with mapped.begin() as conn:
                last = enqueue_many(conn, [TaskSpec(payload=b"t")] * 2)
            assert s.wait_inbox(10)
            assert [i.inbox_id for i in s.read_inbox()] == [first, *more, *last]
    finally:
        with engine.begin() as conn:
            drop = "DROP SCHEMA {} CASCADE" if dialect != "mysql" else "DROP DATABASE {}"
            conn.exec_driver_sql(drop.format(q))


def test_async_enqueue_and_drain(db_url: URL) -> None:
    async def main() -> None:
        app = create_async_engine(async_url(db_url))
        store = await AsyncSqlStore.open(db_url, CONFIG)
        try:
            assert await store.wait_inbox(0.05) is False
            async with app.begin() as conn:
                first = await enqueue_async(conn, TaskSpec(payload=b"a"))
            async with AsyncSession(app) as session, session.begin():
                more = await enqueue_many_async(session, [TaskSpec(payload=b"b")] * 2)
            async with app.connect() as conn:
                await enqueue_async(conn, TaskSpec(payload=b"rolled back"))
                await conn.rollback()
            assert await store.wait_inbox(10)
            items = await store.read_inbox(base=BASE)
            assert [i.inbox_id for i in items] == [first, *more]
            epoch = await store.acquire_leadership()
            batch: list[InboxTaken | Submitted] = []
            for n, item in enumerate(items):
                batch += [
                    Submitted(id=TaskId(n), seq=n, arrival=0, spec=item.spec),
                    InboxTaken(inbox_id=item.inbox_id),
                ]
            await store.commit(epoch, BASE, batch)
            assert await store.read_inbox() == []
            record = await store.get_task(ById(TaskId(2)))
            assert record is not None and record.status is TaskStatus.QUEUED
        finally:
            await store.close()
            await app.dispose()

    asyncio.run(main())


def test_async_wait_wakes_on_commit(
    dialect: str, db_url: URL, engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> bool:
        store = await AsyncSqlStore.open(db_url, CONFIG)
        try:
            assert (store._listener is not None) == (dialect == "postgresql")
            waiting = asyncio.create_task(store.wait_inbox(30))
            await asyncio.sleep(0)
            await asyncio.to_thread(lambda: _enqueue_one(engine))
            return await waiting
        finally:
            await store.close()

    assert asyncio.run(main()) is True
    assert "listen" not in caplog.text  # PostgreSQL listened; it did not fall back to a poll


def _enqueue_one(engine: Engine) -> None:
    with engine.begin() as conn:
        enqueue(conn, TaskSpec(payload=b"one"))


@PROPERTIES
@given(data=st.data())
def test_specs_round_trip_and_drain_once_in_any_split(
    store: SqlStore, engine: Engine, data: st.DataObject
) -> None:
    """Any storable spec comes back as enqueued; however the drain is split into batches, and
    with a batch replayed, every item becomes exactly one task with its spec."""
    n = data.draw(st.integers(1, 6), label="n")
    specs = [task_specs(data.draw, None, ()) for _ in range(n)]
    with engine.begin() as conn:
        conn.execute(delete(inbox))
        conn.execute(delete(tasks))
        ids = enqueue_many(conn, specs)
    items = store.read_inbox()
    assert [(i.inbox_id, i.spec) for i in items] == list(zip(ids, specs, strict=True))
    epoch = store.epoch or store.acquire_leadership()
    batch: list[Submitted | InboxTaken] = []
    for n, item in enumerate(items):
        batch += [
            Submitted(id=TaskId(n), seq=n, arrival=0, spec=item.spec),
            InboxTaken(inbox_id=item.inbox_id),
        ]
    cuts = sorted(data.draw(st.sets(st.integers(0, len(batch)), max_size=3), label="cuts"))
    parts = [batch[a:b] for a, b in zip([0, *cuts], [*cuts, len(batch)], strict=True)]
    for part in parts:
        store.commit(epoch, TimeBase(0), part)
    store.commit(epoch, TimeBase(0), data.draw(st.sampled_from(parts), label="replayed"))
    assert store.read_inbox() == []
    recovered = store.recover(TimeBase(0))
    assert [t.spec for t in recovered.tasks] == specs


def test_postgresql_listener_is_made_anew_when_its_connection_dies(
    dialect: str, store: SqlStore, engine: Engine
) -> None:
    if dialect != "postgresql":
        pytest.skip("LISTEN/NOTIFY is PostgreSQL's")
    assert store.wait_inbox(0.01) is False  # listening now
    with engine.begin() as conn:  # the server ends the listener's session
        killed = conn.execute(
            text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE query LIKE 'LISTEN%' AND datname = current_database()"
            )
        ).scalar_one()
    assert killed == 1
    # The next wait finds the connection gone and listens anew. (A wait that finds an item
    # at once returns before it looks at its connection: then the next one does.)
    assert store.wait_inbox(0.05) is False
    with engine.begin() as conn:  # it listens again, on a new connection
        assert (
            conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity "
                    "WHERE query LIKE 'LISTEN%' AND datname = current_database()"
                )
            ).scalar_one()
            == 1
        )
    assert woken_by_an_enqueue(store, engine, b"after the loss") == [True]


def test_enqueue_notifies_in_its_own_round_trip_unless_told_not_to(
    dialect: str, store: SqlStore, engine: Engine
) -> None:
    """PostgreSQL: an enqueue's notification rides on its INSERT (one statement for one item
    or for several), a transaction's listeners hear it once however many enqueues it made, and
    `notify=False` leaves it out; elsewhere `notify` changes nothing."""
    specs = [TaskSpec(payload=b"%d" % i) for i in range(3)]
    statements: list[str] = []
    engine.update_execution_options(**{execution.OBSERVED: True})  # the listener sees all
    event.listen(engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
    with pytest.raises(InvalidValue, match="notify must be a bool"), engine.begin() as conn:
        enqueue(conn, specs[0], notify=1)  # type: ignore[arg-type]
    if dialect != "postgresql":
        with engine.begin() as conn:
            enqueue(conn, specs[0], notify=False)
            enqueue_many(conn, specs[1:], notify=False)
        assert len(store.read_inbox()) == 3
        return
    url = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as listener:
        listener.execute("LISTEN cronoq_inbox")
        statements.clear()
        with engine.begin() as conn:
            enqueue(conn, specs[0])
        assert len(statements) == 1, statements  # the INSERT, which notifies too
        statements.clear()
        with engine.begin() as conn:
            enqueue_many(conn, specs)
        assert len(statements) == 1, statements  # the INSERT, which notifies once
        with engine.begin() as conn:  # several enqueues: one notification on commit
            enqueue(conn, specs[0])
            enqueue_many(conn, specs)
            enqueue_many(conn, specs[1:])
            enqueue(conn, specs[2])
        with engine.begin() as conn:
            enqueue(conn, specs[0], notify=False)
            enqueue_many(conn, specs[1:], notify=False)
        with engine.begin() as conn:  # a marker, delivered after whatever those sent
            conn.execute(text("SELECT pg_notify('cronoq_inbox', 'marker')"))
        payloads = [n.payload for n in listener.notifies(timeout=30, stop_after=4)]
    # One per notifying transaction (a multi-row one too), none without notify.
    assert payloads == ["", "", "", "marker"]
    assert len(store.read_inbox()) == 14


def test_a_store_that_does_not_listen_polls(
    db_url: URL, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`inbox_listen=False`: no LISTEN connection; `wait_inbox` finds an item enqueued without
    a notification by its probe every `inbox_poll` (on every dialect)."""
    config = StoreConfig(inbox_listen=False, inbox_poll=timedelta(milliseconds=20))
    with SqlStore.open(db_url, config) as store:
        assert store._listener is None
        assert store.wait_inbox(0.05) is False
        empty = found_empty(monkeypatch)

        def later() -> None:
            assert empty.wait(30), "the store never looked at the inbox"
            with engine.begin() as conn:
                enqueue(conn, TaskSpec(payload=b"quiet"), notify=False)

        thread = threading.Thread(target=later)
        thread.start()
        try:
            # Enqueued after its first look found nothing: only a later probe can find it.
            assert store.wait_inbox(30) is True
        finally:
            thread.join(30)
        assert [item.spec.payload for item in store.read_inbox()] == [b"quiet"]


def test_checker_flags_lost_and_rolled_back_items(
    store: SqlStore, engine: Engine, tmp_path: Path
) -> None:
    """check() fails a store that lost a committed enqueue or kept a rolled-back one."""
    specs = [TaskSpec(payload=b"kept"), TaskSpec(payload=b"lost"), TaskSpec(payload=b"undone")]
    with engine.begin() as conn:
        ids = enqueue_many(conn, specs)
        conn.execute(delete(inbox).where(inbox.c.id == ids[1]))  # a bug lost it
    log_path = tmp_path / "log.jsonl"
    with AckLog(log_path) as log:
        for inbox_id, spec, kind in zip(
            ids, specs, ["enqueue_ack", "enqueue_ack", "enqueue_rollback"], strict=True
        ):
            record = {"inbox_ids": [inbox_id], "digests": [digest(spec)]}
            log.append({"type": "enqueue_intent", **record}, sync=False)
            log.append({"type": kind, **record}, sync=True)  # "undone" was in fact committed
    report = check(store, log_path)
    assert not report.ok
    assert report.enqueued_committed == 2 and report.enqueued_rolled_back == 1
    assert report.inbox_waiting == 2
    assert len(report.inbox_lost) == 1 and digest(specs[1]) in report.inbox_lost[0]
    assert len(report.inbox_from_rolled_back) == 1
    assert digest(specs[2]) in report.inbox_from_rolled_back[0]


def test_enqueue_many_numbers_items_in_order_in_one_statement(
    dialect: str, store: SqlStore, engine: Engine
) -> None:
    """An empty list writes nothing; a large one (rich and plain specs mixed, Nones in every
    optional column) gets ascending ids in its order, and drains as given. PostgreSQL does it
    in one statement, its columns bound as arrays."""
    statements: list[str] = []  # counted at the driver, where enqueue_many runs them
    after_statements(engine, lambda _cursor, sql: statements.append(sql))
    with engine.connect():  # a new connection's own settings (SQLite's PRAGMA) come first
        statements.clear()
    with engine.begin() as conn:
        assert enqueue_many(conn, []) == []
    assert statements == [] and count(engine, inbox) == 0
    statements.clear()
    specs = [rich_spec(i) if i % 3 else TaskSpec(payload=b"%d" % i) for i in range(2500)]
    with engine.begin() as conn:
        ids = enqueue_many(conn, specs)
    if dialect == "postgresql":
        assert len(statements) == 1, statements
    assert ids == sorted(set(ids)) and len(ids) == len(specs)
    got = [
        i for n in range(3) for i in store.read_inbox(1000, after=ids[n * 1000 - 1] if n else None)
    ]
    assert [i.inbox_id for i in got] == ids
    assert [i.spec for i in got] == specs


@pytest.mark.parametrize("rich_at", [None, 0, 2])
def test_a_column_unset_in_every_spec_is_sent_as_one_null(
    dialect: str, store: SqlStore, engine: Engine, rich_at: int | None
) -> None:
    """A column that no spec of the batch sets (NULL, or a JSON column's empty value) goes to
    PostgreSQL as one NULL for the statement to pad, not an array of them; a column that one
    spec sets goes whole. Either way every spec drains as given."""
    specs = [TaskSpec(payload=b"%d" % i) for i in range(3)]
    if rich_at is not None:
        specs[rich_at] = rich_spec(rich_at)
    sent: list[Any] = []
    event.listen(engine, "before_cursor_execute", lambda *a: sent.append(a[3]))
    with engine.begin() as conn:
        conn.execution_options(cronoq_observed=True)  # through SQLAlchemy: its listener sees it
        ids = enqueue_many(conn, specs)
    assert [(i.inbox_id, i.spec) for i in store.read_inbox()] == list(zip(ids, specs, strict=True))
    if dialect == "postgresql":
        [params] = [p for p in sent if isinstance(p, dict) and "a_deps" in p]
        always = ("pool", "kind", "priority", "payload")
        optional = [f"a_{c}" for c in codec.SPEC_COLUMNS if c not in always]
        unset = [name for name in optional if params[name] is None]
        assert unset == (optional if rich_at is None else [])
        assert params["a_payload"] == [s.payload for s in specs]


def test_enqueue_many_sends_the_arrays_it_built_where_nothing_observes(
    dialect: str, store: SqlStore, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On sync psycopg with nothing observing, the arrays go as `pgarrays` built them, not
    as lists for psycopg to dump: opening the app's transaction, in one already open, and
    given the Engine. Every spec drains as given (texts beyond ASCII, NULLs among values,
    int64's largest)."""
    if dialect != "postgresql":
        pytest.skip("PostgreSQL's arrays")
    from cronoq_store.dialects import pgarrays

    built: list[dict[str, Any]] = []
    real = pgarrays.binary

    def spy(driver: Any, params: Any, casts: Any) -> dict[str, Any]:
        built.append(real(driver, params, casts))
        return built[-1]

    monkeypatch.setattr(pgarrays, "binary", spy)
    specs = [
        rich_spec(1),
        TaskSpec(payload=b"", kind="é☃", key="ключ", tenant="té", duration_hint_ns=2**63 - 1),
        TaskSpec(payload=b"x" * 5000, priority=Priority.LOW),
    ]
    with engine.begin() as conn:
        ids = enqueue_many(conn, specs)  # opens the transaction: in a flight with its BEGIN
    with engine.begin() as conn:
        conn.execute(select(1))
        ids += enqueue_many(conn, specs)  # on the cursor, in the open transaction
    ids += enqueue_many(engine, specs)  # autocommit, in a flight of its own
    assert len(built) == 3
    for params in built:
        arrays = [v for k, v in params.items() if k.startswith("a_") and v is not None]
        assert len(arrays) == len(codec.SPEC_COLUMNS)  # every column set by some spec
        assert not [v for v in arrays if isinstance(v, list)]  # none left to psycopg
    items = store.read_inbox()
    assert [(i.inbox_id, i.spec) for i in items] == list(zip(ids, specs * 3, strict=True))


def test_postgresql_core_statement_for_other_drivers(
    dialect: str, store: SqlStore, engine: Engine
) -> None:
    """The multi-row statement as Core runs it (text arrays, for drivers other than psycopg):
    the same rows, ids in order, whether or not it notifies."""
    if dialect != "postgresql":
        pytest.skip("PostgreSQL's statement")
    mixed = [rich_spec(1), TaskSpec(payload=b"plain"), rich_spec(2)]
    plain = [TaskSpec(payload=b"%d" % i) for i in range(3)]  # unset columns sent as NULL
    with engine.begin() as conn:
        for specs in (mixed, plain):
            rows = [codec.spec_columns(inbox_module.UNIX, s) for s in specs]
            for notify in (True, False):
                stmt = inbox_module.insert_many_stmt(notify=notify)
                ids = conn.execute(stmt, inbox_module.arrays(rows)).scalars()
                assert len(sorted(ids)) == 3
        stored = conn.execute(select(inbox).order_by(inbox.c.id)).mappings().all()
    expected = mixed * 2 + plain * 2
    assert [codec.spec_from_columns(inbox_module.UNIX, r) for r in stored] == expected


def test_enqueue_many_on_an_autocommit_connection(store: SqlStore, engine: Engine) -> None:
    """A connection in autocommit commits each row by itself (SQLite: another writer may come
    between two): the ids still name the rows, in order."""
    specs = [TaskSpec(payload=b"%d" % i) for i in range(5)]
    with engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        ids = enqueue_many(conn, specs)
    items = store.read_inbox()
    assert [i.inbox_id for i in items] == ids
    assert [i.spec for i in items] == specs


def test_a_drained_spec_is_written_as_stored_not_encoded_again(
    store: SqlStore, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drain moves an item's stored columns into its task row: a spec `read_inbox`
    returned is encoded again only when committed under another base (its times then shift),
    and one spec submitted as two tasks makes two rows."""
    encoded: list[TaskSpec] = []
    spec_columns = codec.spec_columns

    def counting(base: TimeBase, spec: TaskSpec) -> dict[str, object]:
        encoded.append(spec)
        return spec_columns(base, spec)

    with engine.begin() as conn:
        enqueue_many(conn, [unkeyed(i) for i in range(3)])
    monkeypatch.setattr(codec, "spec_columns", counting)
    monkeypatch.setattr(codec.columns, "spec_columns", counting)  # what StoredSpecs calls
    epoch = store.acquire_leadership()
    a, b, c = store.read_inbox(base=BASE)
    fresh = TaskSpec(payload=b"fresh")
    batch = [
        Submitted(id=TaskId(1), seq=1, arrival=0, spec=a.spec),
        Submitted(id=TaskId(2), seq=2, arrival=0, spec=b.spec),
        Submitted(id=TaskId(3), seq=3, arrival=0, spec=a.spec),  # the same spec again
        Submitted(id=TaskId(4), seq=4, arrival=0, spec=fresh),
        *(InboxTaken(inbox_id=i.inbox_id) for i in (a, b)),
    ]
    store.commit(epoch, BASE, batch)
    assert encoded == [fresh]
    other = TimeBase(BASE.unix_ns + 10**9)
    store.commit(epoch, other, [Submitted(id=TaskId(5), seq=5, arrival=0, spec=c.spec)])
    assert encoded == [fresh, c.spec]
    recovered = {t.id: t.spec for t in store.recover(BASE).tasks}
    assert recovered[1] == recovered[3] == a.spec and recovered[2] == b.spec
    assert recovered[4] == fresh
    # Read under BASE, committed under a base a second later: the engine's times, kept as
    # engine times, land a second later in Unix time.
    assert c.spec.deadline is not None and recovered[5].deadline == c.spec.deadline + 10**9
