"""The two faces cannot drift: `SqlStore` and `AsyncSqlStore` do the same.

Every public operation runs on both faces, on each dialect, each face on a fresh database of
its own, and gives the same results, raises the same errors and issues the same statements (SQL
text, in order, seen by a `before_cursor_execute` listener: both faces take the same path to
the driver). The tests after it pin what used to differ: reads and recovery in read-only
transactions (SQLite's write lock stays free), the read-only peek before a take, SQLite's busy
timeout bounded by the commit timeout, pings only for idle connections, `open(check_schema=)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sqlite3
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from faces import FACES, Blocking, open_face, store_engine
from servers import new_database
from sqlalchemy import URL, Connection, create_engine, event, inspect

import cronoq_store as cq
from cronoq_store import execution
from cronoq_store.aio import AsyncSqlStore

BASE = cq.TimeBase(unix_ns=1_700_000_000_000_000_000)
# No renewal while a scenario runs: its statements would interleave with the operations'.
QUIET = cq.StoreConfig(lease_ttl=timedelta(seconds=120), lease_renew=timedelta(seconds=60))
SERVERS = [
    pytest.param("postgresql", marks=pytest.mark.postgresql),
    pytest.param("mysql", marks=pytest.mark.mysql),
]
SQLITE = [pytest.param("sqlite", marks=pytest.mark.sqlite)]

Outcome = tuple[str, object, list[str]]
"""An operation's name, its result (or error type and text), and the statements it issued."""


def submit(i: int, key: str | None = None) -> cq.Submitted:
    return cq.Submitted(id=cq.TaskId(i), seq=i, arrival=i, spec=cq.TaskSpec(payload=b"p", key=key))


def done(i: int, status: cq.TaskStatus = cq.TaskStatus.SUCCEEDED) -> cq.StatusChanged:
    return cq.StatusChanged(id=cq.TaskId(i), status=status, attempt=1, at=10 + i)


def _plain(value: object) -> object:
    """`value` without what depends on the wall clock (a record's `updated`)."""
    if isinstance(value, cq.TaskRecord):
        return dataclasses.replace(value, updated=datetime(2000, 1, 1, tzinfo=UTC))
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


class Recorder:
    """The SQL text of every statement the store's engine issues while `on`: the name of the
    database (each face has its own) as `<db>`, placeholders as `%s` (pymysql's pyformat and
    asyncmy's format are the drivers' difference, not the faces')."""

    def __init__(self, store: Any, database: str | None = None) -> None:
        self.on = False
        self.seen: list[str] = []

        def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            if self.on:
                text = re.sub(r"%\(\w+\)s", "%s", " ".join(statement.split()))
                self.seen.append(text.replace(database, "<db>") if database else text)

        engine = store_engine(store)
        # Statements on SQLAlchemy's execution on both faces (the async face always is), so
        # that the listener sees every one (`execution.OBSERVED`).
        engine.update_execution_options(**{execution.OBSERVED: True})
        event.listen(engine, "before_cursor_execute", record)

    def take(self) -> list[str]:
        seen, self.seen = self.seen, []
        return seen


def scenario(store: Any, url: URL) -> list[Outcome]:
    """Every public operation of `store` (a `SqlStore`, or an `AsyncSqlStore` behind `Blocking`)
    in one fixed order; errors are outcomes too."""
    outcomes: list[Outcome] = []
    recorder = Recorder(store, url.database if url.get_backend_name() != "sqlite" else None)
    app = create_engine(url)
    try:
        with app.begin() as conn:
            for i in range(3):
                cq.enqueue(conn, cq.TaskSpec(payload=b"i%d" % i, key=f"inbox-{i}"), notify=False)
    finally:
        app.dispose()
    lost: list[str] = []
    store.on_leadership_lost(lambda: lost.append("lost"))
    epoch: int | None = None

    def op(name: str, call: Callable[[], object]) -> None:
        recorder.on = True
        try:
            result: object = _plain(call())
        except Exception as exc:  # the faces must raise alike
            result = (type(exc).__name__, str(exc))
        finally:
            recorder.on = False
        outcomes.append((name, result, recorder.take()))

    op("is_leader", lambda: store.is_leader)
    op("wait_leadership_lost", lambda: store.wait_leadership_lost(0))
    op("check_schema", store.check_schema)
    op("read_durability", lambda: store.read_durability().as_dict())
    op("migrate", store.migrate)
    op("commit_unled", lambda: store.commit(1, BASE, [submit(1)]))
    op("acquire_leadership", lambda: store.acquire_leadership(timeout=30))
    epoch = store.epoch
    assert epoch is not None
    op("epoch", lambda: store.epoch - epoch)
    op("wait_inbox", lambda: store.wait_inbox(0))
    op("read_inbox", lambda: [(i.spec, i.inbox_id > 0) for i in store.read_inbox(2)])
    op("read_inbox_bad_limit", lambda: store.read_inbox(0))
    batch = [submit(1, "a"), submit(2, "b"), submit(3), done(2), cq.InboxTaken(inbox_id=1)]
    op("commit", lambda: store.commit(epoch, BASE, batch, [(cq.TaskId(2), b"out")]))
    op("commit_again", lambda: store.commit(epoch, BASE, batch, [(cq.TaskId(2), b"out")]))
    op("close_held_connection", store.close_held_connection)
    op("commit_bad_value", lambda: store.commit(epoch, BASE, [submit(-5)]))
    op("commit_live_key_conflict", lambda: store.commit(epoch, BASE, [submit(9, "a")]))
    op("commit_stale_epoch", lambda: store.commit(epoch - 1, BASE, [submit(4)]))
    op("get_task_by_id", lambda: store.get_task(cq.ById(cq.TaskId(2))))
    op("get_task_by_key", lambda: store.get_task(cq.ByKey("a")))
    op("get_task_missing", lambda: store.get_task(cq.ById(cq.TaskId(77))))
    op("get_task_bad_ref", lambda: store.get_task("2"))
    op("list_finished", lambda: store.list_finished())
    op("list_finished_page", lambda: store.list_finished(statuses=[cq.TaskStatus.FAILED], limit=1))
    op("load_output", lambda: store.load_output(cq.TaskId(2)))
    op("load_output_missing", lambda: store.load_output(cq.TaskId(3)))
    op("recover", lambda: store.recover(BASE))
    op("prune", lambda: store.prune(timedelta(0)))
    op("inbox_rejected", lambda: store.inbox_rejected)
    op("release_lease_of_another", lambda: store.release_lease_of("nobody"))
    op("release_leadership", store.release_leadership)
    op("is_leader_after", lambda: store.is_leader)
    op("commit_released", lambda: store.commit(epoch, BASE, [submit(5)]))
    op("callbacks", lambda: list(lost))
    return outcomes


OPERATIONS = {
    "acquire_leadership",
    "check_schema",
    "close_held_connection",
    "commit",
    "epoch",
    "get_task",
    "is_leader",
    "list_finished",
    "load_output",
    "migrate",
    "on_leadership_lost",
    "prune",
    "read_durability",
    "read_inbox",
    "recover",
    "release_leadership",
    "release_lease_of",
    "wait_inbox",
    "wait_leadership_lost",
}
"""The methods and properties `scenario` runs (and `inbox_rejected`); `open` and `close` run
around it; `AsyncSqlStore.leadership_lost` is `wait_leadership_lost` untimed."""


def test_the_scenario_runs_every_public_operation() -> None:
    def public(cls: type) -> set[str]:
        return {name for name in dir(cls) if not name.startswith("_")}

    around = {"open", "close"}
    assert public(cq.SqlStore) - around == OPERATIONS
    assert public(AsyncSqlStore) - around == OPERATIONS | {"leadership_lost"}


def test_both_faces_agree(db_url: URL, dialect: str, tmp_path: Path) -> None:
    results: dict[str, list[Outcome]] = {}
    for face in FACES:
        where = tmp_path / face
        where.mkdir()
        with contextlib.contextmanager(new_database)(dialect, where) as url:
            cleanup: list[Callable[[], None]] = []
            try:
                store = open_face(face, url, QUIET, cleanup)
                results[face] = scenario(store, url)
            finally:
                for close in reversed(cleanup):
                    close()
    sync, asyncio_ = results["sync"], results["async"]
    assert [name for name, _, _ in sync] == [name for name, _, _ in asyncio_]
    for (name, result, statements), (_, result_a, statements_a) in zip(sync, asyncio_, strict=True):
        assert result == result_a, name
        assert statements == statements_a, name
    assert any(statements for _, _, statements in sync)


# What differed, one test each, on both faces.


@contextlib.contextmanager
def opened(face: str, url: URL, config: cq.StoreConfig = QUIET) -> Iterator[Any]:
    cleanup: list[Callable[[], None]] = []
    try:
        yield open_face(face, url, config, cleanup)
    finally:
        for close in reversed(cleanup):
            close()


def on_connection(store: Any, fn: Callable[[Connection], Any]) -> Any:
    """`fn` on one of the store's own pooled connections."""
    if isinstance(store, Blocking):

        async def run() -> Any:
            async with store._store.engine.connect() as conn:
                return await conn.run_sync(fn)

        return store._loop.run(run())
    with store.engine.connect() as conn:
        return fn(conn)


@contextlib.contextmanager
def write_locked(url: URL) -> Iterator[None]:
    """Another process's write transaction on the SQLite file, held open."""
    conn = sqlite3.connect(url.database or "", isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        yield
    finally:
        conn.rollback()
        conn.close()


@pytest.mark.parametrize("dialect", SQLITE, indirect=True)
@pytest.mark.parametrize("face", FACES)
def test_reads_and_recovery_leave_sqlite_write_lock_alone(db_url: URL, face: str) -> None:
    config = dataclasses.replace(QUIET, busy_timeout=timedelta(milliseconds=200))
    with opened(face, db_url, config) as store:
        epoch = store.acquire_leadership(timeout=30)
        store.commit(epoch, BASE, [submit(1, "a"), done(1)], [(cq.TaskId(1), b"o")])
        with write_locked(db_url):
            # Each would wait out busy_timeout and fail in a write transaction.
            assert store.recover(BASE).next_id == 2
            assert store.get_task(cq.ById(cq.TaskId(1))) is not None
            assert store.get_task(cq.ByKey("a")) is not None
            assert [t.id for t in store.list_finished()] == [1]
            assert store.load_output(cq.TaskId(1)) == b"o"
            assert store.read_inbox() == []
            assert store.wait_inbox(0) is False


@pytest.mark.parametrize("face", FACES)
def test_a_standby_only_reads_while_the_lease_is_held(db_url: URL, face: str) -> None:
    with opened("sync", db_url) as leader, opened(face, db_url) as standby:
        leader.acquire_leadership(timeout=30)
        recorder = Recorder(standby)
        recorder.on = True
        with pytest.raises(cq.StoreUnavailable):
            standby.acquire_leadership(timeout=0.2)
        seen = recorder.take()
        assert seen, "the standby did not look at the lease"
        writes = [
            s for s in seen if s.startswith(("UPDATE", "BEGIN IMMEDIATE")) or "FOR UPDATE" in s
        ]
        assert writes == []


@pytest.mark.parametrize("dialect", SQLITE, indirect=True)
@pytest.mark.parametrize("face", FACES)
def test_sqlite_waits_no_longer_than_a_commit_may_take(db_url: URL, face: str) -> None:
    config = dataclasses.replace(
        QUIET, busy_timeout=timedelta(seconds=20), commit_timeout=timedelta(seconds=3)
    )
    with opened(face, db_url, config) as store:
        busy = on_connection(store, lambda c: c.exec_driver_sql("PRAGMA busy_timeout").scalar())
        assert busy == 3000


@pytest.mark.parametrize("dialect", SERVERS, indirect=True)
@pytest.mark.parametrize("face", FACES)
def test_pooled_connections_are_pinged_only_when_idle(
    db_url: URL, face: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for idle, pinged in ((3600.0, False), (0.0, True)):
        monkeypatch.setattr(execution, "PING_IDLE", idle)
        with opened(face, db_url) as store:
            dialect = store_engine(store).dialect
            pings: list[object] = []

            def counted(
                dbapi_connection: object, ping: Any = dialect.do_ping, pings: list[object] = pings
            ) -> bool:
                pings.append(dbapi_connection)
                return bool(ping(dbapi_connection))

            monkeypatch.setattr(dialect, "do_ping", counted)
            for _ in range(3):
                assert store.get_task(cq.ById(cq.TaskId(1))) is None
            assert bool(pings) == pinged, (idle, len(pings))


@pytest.mark.parametrize("face", FACES)
def test_open_can_skip_the_schema_check(db_url: URL, face: str) -> None:
    """On a database never migrated, `migrate=False` refuses to open unless told to skip the
    check; skipping it opens, and writes nothing either way."""
    config = dataclasses.replace(QUIET, migrate=False)

    def opened(check_schema: bool) -> None:
        if face == "sync":
            cq.SqlStore.open(db_url, config, check_schema=check_schema).close()
            return
        from faces import LoopThread

        loop = LoopThread()
        try:

            async def open_close() -> None:
                store = await AsyncSqlStore.open(db_url, config, check_schema=check_schema)
                await store.close()

            loop.run(open_close())
        finally:
            loop.close()

    with pytest.raises(cq.SchemaError, match="upgrade"):
        opened(check_schema=True)
    opened(check_schema=False)
    engine = create_engine(db_url)
    try:
        assert inspect(engine).get_table_names() == []
    finally:
        engine.dispose()
