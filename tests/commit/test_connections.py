"""The store's connections: lost while pooled and found out, and who may watch a commit.

A store made by `SqlStore.open` pings a pooled connection only when it sat unused past
`execution.PING_IDLE`; a connection lost sooner fails one commit with `StoreUnavailable` and
the next one succeeds. A commit's statements skip SQLAlchemy's execution machinery unless the
engine asks for it or logs statements (`execution.observed`), whoever listens.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from builders import BASE, keyed, submit
from sqlalchemy import URL, Engine, create_engine, event, select, text
from sqlalchemy import exc as sa_exc

import cronoq_store as cq
from cronoq_store import execution
from cronoq_store.face import HOLD_MIN_POOL
from cronoq_store.repository.arrays import ARRAY_ROWS
from cronoq_store.repository.commit import FLIGHT_ROWS, insert_deps_stmt
from cronoq_store.schema import tasks
from cronoq_store.store import StoreConfig
from cronoq_store.testing.statements import after_statements

SERVERS = [
    pytest.param("postgresql", marks=pytest.mark.postgresql),
    pytest.param("mysql", marks=pytest.mark.mysql),
]
# No renewal during a test: every connection the test kills is one a commit would use.
QUIET = StoreConfig(lease_ttl=timedelta(seconds=120), lease_renew=timedelta(seconds=60))


def stored(engine: Engine) -> set[int]:
    with engine.connect() as conn:
        return set(conn.execute(select(tasks.c.id)).scalars())


@pytest.fixture
def admin(db_url: URL) -> Iterator[Engine]:
    engine = create_engine(db_url, isolation_level="AUTOCOMMIT")
    yield engine
    engine.dispose()


def kill_other_sessions(admin: Engine, dialect: str) -> int:
    """End every other session on this test's database, as a server restart would; how many."""
    with admin.connect() as conn:
        if dialect == "postgresql":
            return len(
                conn.execute(
                    text(
                        "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    )
                ).all()
            )
        ids = conn.execute(
            text(
                "SELECT id FROM information_schema.processlist "
                "WHERE db = DATABASE() AND id <> CONNECTION_ID()"
            )
        ).scalars()
        killed = 0
        for session in list(ids):
            conn.execute(text(f"KILL {int(session)}"))
            killed += 1
        return killed


@pytest.mark.parametrize("dialect", SERVERS, indirect=True)
def test_a_connection_lost_while_idle_is_replaced_unseen(
    db_url: URL, admin: Engine, dialect: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(execution, "PING_IDLE", 0.0)  # every checkout is past the idle bound
    with cq.SqlStore.open(db_url, QUIET) as store:
        epoch = store.acquire_leadership()
        store.commit(epoch, BASE, [keyed(1)])
        assert kill_other_sessions(admin, dialect) >= 1
        store.commit(epoch, BASE, [keyed(2)])  # the ping finds it dead; the pool reconnects
        assert stored(admin) == {1, 2}
        assert store.is_leader


@pytest.mark.parametrize("dialect", SERVERS, indirect=True)
def test_a_connection_lost_within_the_idle_bound_fails_one_commit(
    db_url: URL, admin: Engine, dialect: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(execution, "PING_IDLE", 3600.0)  # no checkout here is pinged
    with cq.SqlStore.open(db_url, QUIET) as store:
        epoch = store.acquire_leadership()
        store.commit(epoch, BASE, [keyed(1)])
        assert kill_other_sessions(admin, dialect) >= 1
        failed = 0
        for _ in range(store.config.pool_size + 1):  # each dead pooled connection fails once
            try:
                store.commit(epoch, BASE, [keyed(2), keyed(3)])
                break
            except cq.StoreUnavailable:
                failed += 1
                assert stored(admin) == {1}  # nothing half-written
        else:
            pytest.fail("commits kept failing after the pool dropped its dead connections")
        assert failed >= 1
        assert stored(admin) == {1, 2, 3}
        assert store.is_leader


@pytest.mark.parametrize(
    "dialect", [pytest.param("sqlite", marks=pytest.mark.sqlite)], indirect=True
)
def test_statements_take_sqlalchemys_path_only_when_asked(db_url: URL) -> None:
    """Listeners (tracing, metrics) leave the store on the DB-API cursor; the `OBSERVED`
    execution option, on the engine or a connection, and SQLAlchemy's statement log
    (`echo`, or its logger at INFO) take it through SQLAlchemy's execution."""

    def listener(*_args: Any) -> None:
        pass

    with cq.SqlStore.open(db_url) as store, store.engine.connect() as conn:
        assert not execution.observed(conn)
        for name in ("before_cursor_execute", "after_cursor_execute", "handle_error"):
            event.listen(store.engine, name, listener)
            with store.engine.connect() as watched:
                assert not execution.observed(watched), name
            event.remove(store.engine, name, listener)
        conn.execution_options(**{execution.OBSERVED: True})
        assert execution.observed(conn)
        conn.execution_options(**{execution.OBSERVED: False})
        assert not execution.observed(conn)
        store.engine.update_execution_options(**{execution.OBSERVED: True})
        with store.engine.connect() as asked:
            assert execution.observed(asked)
        store.engine.update_execution_options(**{execution.OBSERVED: False})
        logger = logging.getLogger("sqlalchemy.engine.Engine")
        level = logger.level
        logger.setLevel(logging.INFO)
        try:
            assert execution.observed(conn)
        finally:
            logger.setLevel(level)
        assert not execution.observed(conn)
        store.engine.echo = True
        try:
            assert execution.observed(conn)
        finally:
            store.engine.echo = False
        assert not execution.observed(conn)


def test_a_listener_sees_every_write_of_a_commit_when_asked(db_url: URL) -> None:
    """With the `OBSERVED` option, a commit runs through SQLAlchemy's execution, and
    PostgreSQL's inserts leave COPY (which no listener sees) for executemany: the fence, both
    inserts and the update."""
    seen: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        seen.append(" ".join(statement.split()[:3]).upper())

    with cq.SqlStore.open(db_url) as store:
        store.engine.update_execution_options(**{execution.OBSERVED: True})
        epoch = store.acquire_leadership()
        dep = (cq.Dep(target=cq.ById(id=cq.TaskId(1))),)
        batch = [
            cq.Submitted(
                id=cq.TaskId(i), seq=i, arrival=i, spec=cq.TaskSpec(payload=b"p", deps=dep)
            )
            for i in range(1, 11)
        ]
        event.listen(store.engine, "before_cursor_execute", record)
        try:
            store.commit(epoch, BASE, batch)
            store.commit(
                epoch,
                BASE,
                [cq.StatusChanged(id=cq.TaskId(1), status=cq.TaskStatus.RUNNING, attempt=1, at=1)],
            )
        finally:
            event.remove(store.engine, "before_cursor_execute", record)
        assert "UPDATE CRONOQ_LEADER SET" in seen
        assert "INSERT INTO CRONOQ_TASKS" in seen
        assert "INSERT INTO CRONOQ_TASK_DEPS" in seen
        assert "UPDATE CRONOQ_TASKS SET" in seen
        assert stored(store.engine) == set(range(1, 11))


@pytest.mark.parametrize(
    "dialect", [pytest.param("postgresql", marks=pytest.mark.postgresql)], indirect=True
)
def test_a_connection_lost_before_copy_is_invalidated(db_url: URL, admin: Engine) -> None:
    """PostgreSQL's COPY runs past SQLAlchemy's execution, and wraps a driver error as it would
    (`compat.driver_error`): a lost connection is invalidated and says so. A commit's new
    tasks of any number now go as arrays in its one flight; COPY is left to the dependency
    rows of revived tasks (more than `FLIGHT_ROWS`), always behind queued statements that
    meet a lost connection first: so the bulk insert itself is called, on a session ended
    before it, as a commit calls it (`execution.insert_many`)."""
    rows = [
        {"task_id": 1, "ordinal": i, "target_id": 100 + i, "target_key": None}
        for i in range(FLIGHT_ROWS + 1)
    ]
    with cq.SqlStore.open(db_url, QUIET) as store, store.engine.connect() as conn:
        pid = conn.connection.driver_connection.info.backend_pid  # type: ignore[union-attr]
        with admin.connect() as killer:
            killer.execute(text("SELECT pg_terminate_backend(:pid, 5000)"), {"pid": pid})
        with pytest.raises(sa_exc.DBAPIError) as caught:
            execution.insert_many(conn, insert_deps_stmt(), rows)
        assert str(caught.value.statement).startswith("COPY"), caught.value.statement
        assert caught.value.connection_invalidated
        conn.rollback()
        assert conn.execute(text("SELECT 1")).scalar_one() == 1  # on a new connection


def test_a_leader_commits_on_the_connection_its_last_commit_kept(db_url: URL) -> None:
    """Back-to-back commits run on one connection, checked out once: a checkout and a
    SQLAlchemy `Connection` per commit were a sixth of a batch-1 commit's CPU. It goes back
    to the pool when a commit on it fails and when leadership ends."""
    me = threading.get_ident()
    checkouts: list[int] = []

    def checkout(*_args: Any) -> None:
        if threading.get_ident() == me:  # not the keeper's renewals (none under QUIET)
            checkouts.append(1)

    with cq.SqlStore.open(db_url, QUIET) as store:
        pool: Any = store.engine.pool
        epoch = store.acquire_leadership()
        event.listen(store.engine, "checkout", checkout)
        for i in range(1, 6):
            store.commit(epoch, BASE, [keyed(i)])
        assert (len(checkouts), pool.checkedout()) == (1, 1)
        with pytest.raises(cq.StoreError):  # a live-key clash, refused by the database
            store.commit(epoch, BASE, [submit(6), submit(7, key="k1")])
        assert pool.checkedout() == 0
        store.commit(epoch, BASE, [keyed(8)])
        assert (len(checkouts), pool.checkedout()) == (2, 1)
        store.release_leadership()
        assert pool.checkedout() == 0
        assert stored(store.engine) == {1, 2, 3, 4, 5, 8}


def test_a_small_pool_or_an_apps_engine_keeps_no_connection(db_url: URL) -> None:
    """Below `HOLD_MIN_POOL` connections the pool has none to spare, and an app's engine keeps
    the budget its app gave its pool: every commit checks out and returns its connection."""
    small = StoreConfig(pool_size=HOLD_MIN_POOL - 1, lease_ttl=QUIET.lease_ttl)
    with cq.SqlStore.open(db_url, small) as store:
        epoch = store.acquire_leadership()
        store.commit(epoch, BASE, [keyed(1)])
        assert store.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    engine = create_engine(db_url, pool_size=10)
    try:
        apps = cq.SqlStore(engine, QUIET)
        epoch = apps.acquire_leadership()
        apps.commit(epoch, BASE, [keyed(2)])
        assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
        apps.close()
    finally:
        engine.dispose()


def test_the_async_face_keeps_its_commit_connection_too(db_url: URL) -> None:
    """`AsyncSqlStore` runs its commits on one kept connection as `SqlStore` does, and gives
    it back when leadership ends."""

    async def run() -> tuple[int, int]:
        async with await cq.AsyncSqlStore.open(db_url, QUIET) as store:
            pool: Any = store.engine.pool
            epoch = await store.acquire_leadership()
            checkouts: list[int] = []
            listen = lambda *_a: checkouts.append(1)  # noqa: E731
            event.listen(store.engine.sync_engine, "checkout", listen)
            for i in range(1, 4):
                await store.commit(epoch, BASE, [keyed(i)])
            during = len(checkouts)
            await store.release_leadership()
            return during, pool.checkedout()

    assert asyncio.run(run()) == (1, 0)


@pytest.mark.parametrize("dialect", SERVERS, indirect=True)
def test_a_commit_whose_session_ends_inside_it_fails_and_the_next_lands(
    db_url: URL, admin: Engine, dialect: str
) -> None:
    """The server ends a commit's session between its statements (an idle bound that fired
    while the leader was paused, a restart): that commit fails, writing nothing, and the
    connection its commits kept goes, so the next commit runs on a new one and lands.

    PostgreSQL sends the commit in one flight and answers it whole, after its COMMIT: no
    answer comes between its statements to end the session on. There a lock on the task
    table holds the flight at its first INSERT, and the session ends while it waits."""
    thread = threading.get_ident()
    armed: list[int] = []
    killed: list[int] = []

    def kill_after_fence(cursor: Any, statement: str) -> None:
        mine = thread == threading.get_ident() and armed and not killed
        if not mine or "cronoq_leader" not in statement or "UPDATE" not in statement:
            return
        killed.append(1)
        kill_other_sessions(admin, dialect)

    def kill_when_held(blocker: int) -> None:
        with admin.connect() as conn:
            for _ in range(1000):  # 10 s at most
                held = conn.execute(
                    text(
                        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                        "AND wait_event_type = 'Lock' AND pid <> :blocker"
                    ),
                    {"blocker": blocker},
                ).scalars()
                for pid in held:
                    conn.execute(text("SELECT pg_terminate_backend(:pid, 5000)"), {"pid": pid})
                    killed.append(pid)
                if killed:
                    return
                time.sleep(0.01)

    with cq.SqlStore.open(db_url, QUIET) as store, admin.connect() as lock:
        epoch = store.acquire_leadership()
        store.commit(epoch, BASE, [keyed(1)])
        store.release_leadership()  # which returns the connection its commits kept
        if dialect != "postgresql":
            after_statements(store.engine, kill_after_fence)  # from the next connection on
        epoch = store.acquire_leadership()
        store.commit(epoch, BASE, [keyed(5)])  # the connection kept
        armed.append(1)
        killer = None
        if dialect == "postgresql":
            lock.exec_driver_sql("BEGIN")
            lock.exec_driver_sql(f"LOCK TABLE {tasks.name} IN SHARE MODE")
            blocker = lock.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
            killer = threading.Thread(target=kill_when_held, args=(blocker,))
            killer.start()
        # More tasks than one array statement carries (PostgreSQL: several, in one flight).
        batch = [keyed(i) for i in range(10, 11 + ARRAY_ROWS)]
        try:
            with pytest.raises(cq.StoreUnavailable):
                store.commit(epoch, BASE, batch)
        finally:
            if killer is not None:
                killer.join()
                lock.exec_driver_sql("ROLLBACK")
        assert killed
        assert store.engine.pool.checkedout() == 0  # type: ignore[attr-defined]
        store.commit(epoch, BASE, [keyed(4)])
        assert stored(admin) == {1, 4, 5}


@pytest.mark.parametrize("observed", [False, True], ids=["cursor", "observed"])
def test_a_stream_reads_every_row_a_chunk_at_a_time(
    dialect: str, db_url: URL, observed: bool
) -> None:
    """`execution.stream`, a recovery's read, gives the rows SQLAlchemy's execution gives, a
    chunk at a time, on the DB-API cursor or (observed) through SQLAlchemy. PostgreSQL reads
    them from a server-side cursor, never the whole result; a stream closed early leaves the
    connection ready for its next statement (PyMySQL's unbuffered cursor must be drained)."""
    from contextlib import closing

    from cronoq_store.repository.recovery import live_tasks_stmt

    with cq.SqlStore.open(db_url, QUIET) as store:
        epoch = store.acquire_leadership()
        store.commit(epoch, BASE, [submit(i, key=f"k{i}") for i in range(25)])
        stmt = live_tasks_stmt()
        with store.engine.connect() as conn, conn.begin():
            conn.execution_options(**{execution.OBSERVED: observed})
            expected = [tuple(r) for r in conn.execute(stmt)]
            assert len(expected) == 25
            with closing(execution.stream(conn, stmt, 10)) as chunks:
                got = [[tuple(r) for r in chunk] for chunk in chunks]
            assert [len(c) for c in got] == [10, 10, 5]
            assert [r for c in got for r in c] == expected
            with closing(execution.stream(conn, stmt, 10)) as chunks:
                assert len(next(chunks)) == 10
                if dialect == "postgresql":
                    declared = conn.exec_driver_sql("SELECT count(*) FROM pg_cursors").scalar()
                    assert declared == 1
            assert conn.exec_driver_sql("SELECT 1").scalar() == 1


@pytest.mark.parametrize("dialect", SERVERS, indirect=True)
def test_a_stream_whose_session_ends_midway_fails_as_a_lost_connection(
    dialect: str, db_url: URL, admin: Engine
) -> None:
    """A session ended while a stream reads (a server restart mid-recovery) fails the stream
    as SQLAlchemy would, the connection invalidated, and leaves nothing that fails later:
    PyMySQL's unbuffered result would read what is left when closed and when collected, and
    fail on the closed socket ("Exception ignored", which pytest reports). It also proves the
    stream never holds the whole result: a buffered cursor (client-side on PostgreSQL, PyMySQL's
    default) would have read all 8 MB at once, and the kill would fail nothing."""
    from contextlib import closing

    from cronoq_store.repository.recovery import live_tasks_stmt

    big = b"x" * 2000  # a result far past the socket's buffers: the server is still sending
    with cq.SqlStore.open(db_url, QUIET) as store:
        epoch = store.acquire_leadership()
        store.commit(epoch, BASE, [submit(i, big) for i in range(4000)])
        with store.engine.connect() as conn:
            conn.begin()
            with closing(execution.stream(conn, live_tasks_stmt(), 10)) as chunks:
                assert len(next(chunks)) == 10
                assert kill_other_sessions(admin, dialect) >= 1
                with pytest.raises(sa_exc.DBAPIError) as caught:
                    for _ in chunks:
                        pass
            assert caught.value.connection_invalidated
            assert conn.invalidated
    gc.collect()  # a result left reading would fail here
