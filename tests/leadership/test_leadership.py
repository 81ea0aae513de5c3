"""Leadership: lease transitions, fencing against a racing takeover, clock skew, a connection cut
inside a commit, and a keeper that steps down on time.

Every test runs on both faces (`face`: `SqlStore` with `store.Keeper`, and `AsyncSqlStore` with
`aio.AsyncKeeper` behind `faces.Blocking`), which drive the same core (`leadership`; its
decisions alone: test_leadership_core.py).

Every wait is for a condition, bounded by `WAIT` (or by the deadline under test), never a sleep
tuned to pass. Leases are short (about a second) so the whole file stays quick.
"""

from __future__ import annotations

import itertools
import logging
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final

import pytest
from builders import BASE, status, submit, wait_until
from faces import (
    FACES,
    Store,
    count_attempts,
    keeper,
    open_face,
    statement_thread,
    store_engine,
    transactions,
    wrap_engine,
)
from sqlalchemy import (
    URL,
    Connection,
    Engine,
    Select,
    bindparam,
    create_engine,
    event,
    select,
    text,
    update,
)

import cronoq_store as cq
from cronoq_store import dialects, execution, lease, migrate
from cronoq_store.dialects import db_now_ns
from cronoq_store.schema import leader, tasks
from cronoq_store.testing.statements import after_statements

SECOND = 1_000_000_000
WAIT = 10.0
"""Upper bound, in seconds, on waiting for something that must happen (a loaded CI machine)."""
SLACK = 1.5
"""What a deadline may be overshot by on a loaded machine (thread wake-up, a slow round trip)."""
SERVERS = [
    pytest.param("postgresql", marks=pytest.mark.postgresql),
    pytest.param("mysql", marks=pytest.mark.mysql),
]
"""Dialects whose row locks serialize a commit against a takeover (SQLite has one writer)."""

SHORT = cq.StoreConfig(
    lease_ttl=timedelta(seconds=1),
    lease_renew=timedelta(milliseconds=200),
    lock_poll=timedelta(milliseconds=50),
)
"""A lease that runs out within a second, renewed five times per TTL."""


def lease_row(engine: Engine) -> Any:
    with engine.connect() as conn:
        return conn.execute(select(leader, db_now_ns().label("now")).where(leader.c.id == 1)).one()


def set_lease(engine: Engine, **values: object) -> None:
    with engine.begin() as conn:
        conn.execute(update(leader).where(leader.c.id == 1).values(**values))


def stored_ids(engine: Engine) -> set[int]:
    with engine.connect() as conn:
        return set(conn.execute(select(tasks.c.id)).scalars())


@pytest.fixture
def migrated(engine: Engine) -> Engine:
    migrate.upgrade(engine)
    return engine


@pytest.fixture(params=FACES)
def face(request: pytest.FixtureRequest) -> str:
    """The store's face under test: "sync" (`SqlStore`) or "async" (`AsyncSqlStore`)."""
    return str(request.param)


@pytest.fixture
def open_store(
    db_url: URL, face: str, cleanup: list[Callable[[], None]]
) -> Callable[[cq.StoreConfig], Store]:
    """Open stores of `face` on the test database (each its own engine and holder)."""
    return lambda config: open_face(face, db_url, config, cleanup)


@pytest.fixture
def tx(migrated: Engine, db_url: URL, face: str) -> Iterator[Callable[..., Any]]:
    """One transaction per call on the test database, through `face`'s engine."""
    yield from transactions(face, db_url)


# 1. Lease transitions, on an injectable clock.


class LeaseClock:
    """Moves time for the lease, whatever clock the dialect judges it by.

    SQLite judges on the host's clock, which is shifted here; a server judges on its own clock,
    which cannot be moved, so the lease's expiry is moved back by the same amount instead: the
    same transition, relative to the database's now.
    """

    def __init__(self, engine: Engine, dialect: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.engine = engine
        self.dialect = dialect
        self.offset = 0
        if dialect == "sqlite":
            real = time.time_ns
            monkeypatch.setattr(time, "time_ns", lambda: real() + self.offset)

    def advance(self, ns: int) -> None:
        if self.dialect == "sqlite":
            self.offset += ns
        else:
            with self.engine.begin() as conn:
                conn.execute(
                    update(leader)
                    .where(leader.c.id == 1)
                    .values(expires_unix_ns=leader.c.expires_unix_ns - ns)
                )


def test_lease_transitions(
    migrated: Engine, tx: Callable[..., Any], dialect: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = LeaseClock(migrated, dialect, monkeypatch)
    ttl = 10 * SECOND

    def take(holder: str) -> int | None:
        return tx(lambda conn: lease.try_take(conn, holder=holder, ttl_ns=ttl))

    def renew(holder: str, epoch: int) -> bool:
        return tx(lambda conn: lease.renew(conn, epoch=epoch, holder=holder, ttl_ns=ttl, acked=0))

    def fence(holder: str, epoch: int) -> bool:
        return tx(
            lambda conn: lease.fence(
                conn, epoch=epoch, holder=holder, next_id=0, ttl_ns=ttl, seq=0, acked=0
            )
        )

    # Free (as migrated): the first leader gets epoch 1, its lease runs `ttl` on the db clock.
    assert take("a") == 1
    row = lease_row(migrated)
    assert (row.epoch, row.holder) == (1, "a")
    assert 0 < row.expires_unix_ns - row.now <= ttl

    # Held and live, even a second before it runs out: refused, the row untouched.
    clock.advance(ttl - SECOND)
    before = lease_row(migrated)
    assert take("b") is None
    after = lease_row(migrated)
    assert (after.epoch, after.holder, after.expires_unix_ns) == (
        before.epoch,
        before.holder,
        before.expires_unix_ns,
    )

    # Renewed by its holder: a full TTL again, the epoch unchanged; nobody else can renew.
    assert renew("a", 1)
    assert not renew("b", 0)
    # Identities no takeover produces (our epoch under another holder, an epoch above the
    # row's) mean the database lost our own take: refused loudly, the row untouched.
    with pytest.raises(cq.DatabaseBehind, match="lost this leader's own take"):
        renew("b", 1)
    with pytest.raises(cq.DatabaseBehind, match="lost this leader's own take"):
        renew("a", 2)
    row = lease_row(migrated)
    assert (row.epoch, row.holder) == (1, "a")
    assert ttl - SECOND < row.expires_unix_ns - row.now <= ttl
    clock.advance(ttl - SECOND)
    assert take("b") is None  # would have run out without the renewal

    # Expired: taken over under the next epoch, exactly one higher.
    clock.advance(2 * SECOND)
    assert take("b") == 2
    assert (lease_row(migrated).epoch, lease_row(migrated).holder) == (2, "b")

    # Stolen from "a": its renewals and fence checks match nothing from now on.
    assert not renew("a", 1)
    assert not fence("a", 1)
    assert fence("b", 2)
    assert lease_row(migrated).epoch == 2

    # The holder taking its own live lease again starts a new epoch (it leads anew).
    assert take("b") == 3
    # Released: free at once for anyone, under the next epoch.
    tx(lambda conn: lease.release(conn, holder="b"))
    assert lease_row(migrated).holder is None
    assert take("c") == 4

    # 32767 wraps to 1, then counts on.
    set_lease(migrated, epoch=32767, holder=None, expires_unix_ns=0)
    assert take("d") == 1
    clock.advance(ttl + SECOND)
    assert take("e") == 2


def test_database_clock_is_one_compiled_expression(tx: Callable[..., Any], dialect: str) -> None:
    """The clock compiles to the server's own function; only SQLite binds the host's time."""
    sql = tx(lambda conn: str(select(db_now_ns()).compile(dialect=conn.dialect)))
    expected = {"sqlite": "?", "postgresql": "clock_timestamp()", "mysql": "utc_timestamp(6)"}
    assert expected[dialect] in sql
    now = tx(lambda conn: conn.execute(select(db_now_ns())).scalar_one())
    assert abs(now - time.time_ns()) < 60 * SECOND  # Unix nanoseconds, not seconds or micros


# 2. The check-then-write race, forced with barriers.


@dataclass
class Outcome:
    """What happened when a paused commit raced a takeover."""

    commit_error: BaseException | None
    landed: bool
    """The commit's task is in the database afterwards."""
    took: int | None
    """The epoch the takeover got, if it got the lease."""
    seen_by_taker: bool
    """The takeover's transaction, after taking the lease, saw the commit's task."""

    @property
    def violation(self) -> str | None:
        if self.landed != (self.commit_error is None):
            return f"the commit's result ({self.commit_error!r}) disagrees with the database"
        if self.took is not None and self.landed and not self.seen_by_taker:
            return "an old-epoch commit landed after the takeover"
        return None


def after_each(engine: Engine, hook: Callable[[Any, str], None]) -> None:
    """`hook(driver_connection, statement)` after each statement `engine` runs, from now on: at
    the driver for a sync driver (`testing.statements`), so on the path production runs; for
    an async one, whose statements all run through SQLAlchemy, after its execution."""
    if not engine.dialect.is_async:
        after_statements(engine, lambda cursor, statement: hook(cursor.connection, statement))
        return

    @event.listens_for(engine, "after_cursor_execute")
    def _after(conn: Connection, _cursor: Any, statement: str, *_args: Any) -> None:
        hook(conn.connection.driver_connection, statement)


class Pause:
    """Holds the thread named `thread` right after its first statement on the leader row that
    starts with `statement` (any, if empty), until `go` is set: seen at the driver (`after_each`)
    on a store's engine, after SQLAlchemy's execution on the test's own (`store=False`)."""

    def __init__(
        self, engine: Engine, thread: str, statement: str = "", store: bool = True
    ) -> None:
        self.engine = engine
        self.store = store
        self.thread = thread
        self.statement = statement
        self.reached = threading.Event()
        self.go = threading.Event()

    def __enter__(self) -> Pause:
        if self.store:
            after_each(self.engine, self._after)
        else:
            event.listen(self.engine, "after_cursor_execute", self._listener)
        return self

    def __exit__(self, *exc: object) -> None:
        self.go.set()  # (the caller has joined the paused thread by now; reached stays set)
        if not self.store:
            event.remove(self.engine, "after_cursor_execute", self._listener)

    def _listener(self, _conn: Connection, _cursor: Any, statement: str, *_args: Any) -> None:
        self._after(None, statement)

    def _after(self, _driver_connection: Any, statement: str) -> None:
        if (
            threading.current_thread().name == self.thread
            and statement.lstrip().upper().startswith(self.statement)
            and "cronoq_leader" in statement
            and not self.reached.is_set()
        ):
            self.reached.set()
            self.go.wait(WAIT)


class Worker(threading.Thread):
    """Runs `fn` in a named thread, keeping its result or exception."""

    def __init__(self, name: str, fn: Callable[[], Any]) -> None:
        super().__init__(name=name, daemon=True)
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()

    def outcome(self) -> Any:
        self.join(WAIT)
        assert not self.is_alive(), f"{self.name} did not finish"
        return self.result


LOCK_POLL = 0.15
"""How often a test asks `lock_waiters`: MariaDB refreshes `information_schema.innodb_trx`
from a cache only once it has not been read for 0.1 s, so a poll every 10 ms never saw a
commit that began waiting after the first poll."""


def lock_waiters(admin: Engine, dialect: str) -> int:
    """Sessions of the test database waiting for a row lock."""
    with admin.connect() as conn:
        if dialect == "postgresql":
            sql = (
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
        else:
            sql = (
                "SELECT count(*) FROM information_schema.innodb_trx t"
                " JOIN information_schema.processlist p ON p.id = t.trx_mysql_thread_id"
                " WHERE t.trx_state = 'LOCK WAIT' AND p.db = DATABASE()"
            )
        return int(conn.execute(text(sql)).scalar_one())


def take_over(engine: Engine, task_id: int, *, expired: bool = False) -> tuple[int | None, bool]:
    """Another instance's takeover; whether its transaction then sees the task `task_id`.
    `expired`: the lease has run out by then, whatever expiry the commit in flight wrote (its
    holder was paused past it): the same transaction moves the expiry back first."""
    with engine.begin() as conn:
        if expired:
            conn.execute(update(leader).where(leader.c.id == 1).values(expires_unix_ns=0))
        epoch = lease.try_take(conn, holder="taker", ttl_ns=60 * SECOND)
        seen = conn.execute(select(tasks.c.id).where(tasks.c.id == task_id)).first() is not None
    return epoch, seen


def paused_first(
    pause: Pause, first: Worker, never: str, second: Worker, admin: Engine, dialect: str
) -> None:
    """Start `first` and hold it where `pause` waits (failing with `never` if it does not get
    there), then start `second` and wait until it finished or waits for `first`'s row lock;
    then let both finish."""
    with pause:
        first.start()
        assert pause.reached.wait(WAIT), never
        second.start()
        wait_until(
            lambda: second.done.is_set() or lock_waiters(admin, dialect) > 0,
            f"{second.name} to finish or to wait for {first.name}'s row lock",
            WAIT,
            LOCK_POLL,
        )
        pause.go.set()
        first.outcome()
        second.outcome()


def race_commit_paused(
    old: Store, epoch: int, admin: Engine, dialect: str, task_id: int
) -> Outcome:
    """Pause `old`'s commit right after its first statement on the leader row (the fence),
    while another instance tries to take over a lease that has run out; then let both finish."""
    set_lease(admin, expires_unix_ns=0)  # `old` was paused past its lease
    commit = Worker("old-commit", lambda: old.commit(epoch, BASE, [submit(task_id)]))
    taker = Worker("taker", lambda: take_over(admin, task_id))
    pause = Pause(store_engine(old), statement_thread(old, "old-commit"))
    paused_first(pause, commit, "the commit never reached its fence check", taker, admin, dialect)
    assert taker.error is None, taker.error
    took, seen = taker.result
    return Outcome(commit.error, task_id in stored_ids(admin), took, seen)


def race_takeover_paused(
    old: Store, epoch: int, admin: Engine, dialect: str, task_id: int
) -> Outcome:
    """Pause a takeover right after it wrote the new epoch (not yet committed), while `old`
    commits; then let both finish."""
    set_lease(admin, expires_unix_ns=0)
    result: dict[str, Any] = {}

    def take() -> None:
        result["took"], result["seen"] = take_over(admin, task_id)

    taker = Worker("taker", take)
    commit = Worker("old-commit", lambda: old.commit(epoch, BASE, [submit(task_id)]))
    pause = Pause(admin, "taker", "UPDATE", store=False)
    paused_first(pause, taker, "the takeover never wrote the lease", commit, admin, dialect)
    assert taker.error is None, taker.error
    return Outcome(commit.error, task_id in stored_ids(admin), result["took"], result["seen"])


RACE = cq.StoreConfig(
    lease_ttl=timedelta(seconds=60),
    lease_renew=timedelta(seconds=20),
    lock_poll=timedelta(milliseconds=50),
)
"""The keeper stays out of the race: no renewal while the test runs."""


@pytest.mark.parametrize("dialect", SERVERS)
def test_fence_serializes_commit_against_takeover(
    open_store: Callable[[cq.StoreConfig], Store], engine: Engine, dialect: str
) -> None:
    old = open_store(RACE)
    epoch = old.acquire_leadership(timeout=WAIT)

    # The commit's fence holds the leader row: the takeover waits for it, then finds the lease
    # renewed by it. The commit lands first.
    first = race_commit_paused(old, epoch, engine, dialect, task_id=1)
    assert first.violation is None, first
    assert first.landed and first.commit_error is None
    assert first.took is None or first.seen_by_taker

    # The takeover holds the row: the commit's fence waits for it, then matches nothing.
    second = race_takeover_paused(old, epoch, engine, dialect, task_id=2)
    assert second.violation is None, second
    assert second.took == epoch + 1
    assert isinstance(second.commit_error, cq.Fenced) and not second.landed
    assert not old.is_leader
    with pytest.raises(cq.Fenced):
        old.commit(epoch, BASE, [submit(3)])


@pytest.mark.parametrize("dialect", SERVERS)
def test_race_harness_catches_a_plain_select_check(
    open_store: Callable[[cq.StoreConfig], Store],
    engine: Engine,
    dialect: str,
    monkeypatch: pytest.MonkeyPatch,
    face: str,
) -> None:
    """Proof that the race test can fail: a fence that only reads the epoch is caught."""
    if face == "async" and dialect == "postgresql":
        pytest.skip(
            "the stand-in fence is a SELECT, counted by its row count: SQLAlchemy's execution "
            "on asyncio psycopg does not give it as 1"
        )

    def plain_select_fence() -> Select[Any]:
        """The row when it names our epoch and holder, read (one row: "matched")."""
        return select(leader.c.id).where(
            leader.c.id == 1,
            leader.c.epoch == bindparam("b_epoch"),
            leader.c.holder == bindparam("b_holder"),
        )

    monkeypatch.setattr(lease, "fence_stmt", plain_select_fence)
    # The fence runs as `lease.fence_stmt` (and can be replaced), its rows counted, where a
    # commit is not pipelined nor batched.
    monkeypatch.setattr(dialects.cursor, "pipelines", lambda _conn: False)
    monkeypatch.setattr(dialects.cursor, "batches", lambda _conn: False)  # nor batched (MariaDB)
    old = open_store(RACE)
    epoch = old.acquire_leadership(timeout=WAIT)
    outcome = race_commit_paused(old, epoch, engine, dialect, task_id=1)
    assert outcome.violation == "an old-epoch commit landed after the takeover", outcome
    assert outcome.took == epoch + 1


def race_takeover_after_fence(
    old: Store, epoch: int, admin: Engine, url: URL, dialect: str, task_ids: tuple[int, int]
) -> Outcome:
    """Pause `old`'s commit after its fence check was answered and before its writes (at
    the lookup of its two new ids), while another instance tries to take over, finding the
    lease run out (`old` stays paused past it, the expiry its fence wrote included); then
    let both finish."""
    thread = statement_thread(old, "old-commit")
    after_fence = AfterFence()
    reached, go = threading.Event(), threading.Event()

    def hold(_driver_connection: Any, statement: str) -> None:
        if threading.current_thread().name != thread or reached.is_set():
            return
        if after_fence(statement):
            reached.set()
            go.wait(WAIT)

    after_each(store_engine(old), hold)
    batch = looked_up(old, epoch, *task_ids)  # hooked: on the connection commits keep
    # SQLite's taker waits on the write lock for as long as the paused commit holds it; a
    # server's takes the test's engine (its connections are open already).
    sqlite = dialect == "sqlite"
    taker_engine = create_engine(url, connect_args={"timeout": 3 * WAIT}) if sqlite else admin
    commit = Worker("old-commit", lambda: old.commit(epoch, BASE, batch))
    taker = Worker("taker", lambda: take_over(taker_engine, task_ids[0], expired=True))
    try:
        commit.start()
        assert reached.wait(WAIT), "the commit never got past its fence check"
        taker.start()
        if sqlite:
            # No server shows a lock waiter: give the takeover a bounded chance to finish
            # (it cannot while the commit holds the write lock; it would at once if not).
            taker.done.wait(2.0)
        else:
            wait_until(
                lambda: taker.done.is_set() or lock_waiters(admin, dialect) > 0,
                "the takeover to finish or to wait for the commit's row lock",
                WAIT,
                0.1,  # every 10 ms, MariaDB's processlist queries held the takeover off
            )
        go.set()
        commit.outcome()
        taker.outcome()
    finally:
        go.set()
        if sqlite:
            taker_engine.dispose()
    assert taker.error is None, taker.error
    took, seen = taker.result
    return Outcome(commit.error, task_ids[0] in stored_ids(admin), took, seen)


def test_takeover_between_the_fence_and_the_writes(
    open_store: Callable[[cq.StoreConfig], Store], engine: Engine, db_url: URL, dialect: str
) -> None:
    """A deposed leader cannot write: a takeover that comes after the commit's fence check
    and before its writes waits for the commit (the fence and the writes are one
    transaction, holding the leader row or SQLite's write lock), so the commit lands before
    the new epoch exists; and the old leader's next commit is fenced off."""
    old = open_store(RACE)
    epoch = old.acquire_leadership(timeout=WAIT)
    outcome = race_takeover_after_fence(old, epoch, engine, db_url, dialect, (1, 2))
    assert outcome.violation is None, outcome
    # The fence was answered: the commit lands, then the takeover (which waited) runs.
    assert outcome.landed and outcome.commit_error is None, outcome
    assert outcome.took == epoch + 1 and outcome.seen_by_taker, outcome
    assert stored_ids(engine) == {1, 2} | PAD
    with pytest.raises(cq.Fenced):
        old.commit(epoch, BASE, [submit(3)])
    assert stored_ids(engine) == {1, 2} | PAD


# 3. Clock skew.


@pytest.mark.parametrize("dialect", SERVERS)
def test_standby_clock_ahead_cannot_take_a_live_lease(
    open_store: Callable[[cq.StoreConfig], Store], monkeypatch: pytest.MonkeyPatch
) -> None:
    leader_store = open_store(SHORT)
    epoch = leader_store.acquire_leadership(timeout=WAIT)
    standby = open_store(SHORT)
    # The standby's wall clock runs 30 s (30 TTLs) ahead; so does everything in this process,
    # which is the point: no host clock has a say in expiry on a server.
    real_ns, real_s = time.time_ns, time.time
    monkeypatch.setattr(time, "time_ns", lambda: real_ns() + 30 * SECOND)
    monkeypatch.setattr(time, "time", lambda: real_s() + 30.0)
    with pytest.raises(cq.StoreUnavailable, match="another instance holds the lease"):
        standby.acquire_leadership(timeout=1.5 * SHORT.lease_ttl.total_seconds())
    assert leader_store.epoch == epoch
    # Not a standby that can never lead: once the leader lets go, it takes over at once.
    leader_store.release_leadership()
    assert standby.acquire_leadership(timeout=WAIT) == epoch + 1


# 4. A connection cut inside a commit.


REVIVED: Final = 1000
"""A task `looked_up` stores finished, so that its batch revives it."""
PAD: frozenset[int] = frozenset({REVIVED})
"""The tasks stored besides a `looked_up` batch's own new ones."""


def looked_up(store: Store, epoch: int, *ids: int) -> list[cq.Submitted | cq.StatusChanged]:
    """New tasks `ids` and a live transition of `REVIVED` (stored finished here first): a
    batch that waits for an answer after its fence check was answered, on every dialect.
    SQLite and MariaDB look the new ids up. A PostgreSQL flight carries any batch of new
    tasks fence to COMMIT in one round trip, with no window to pause in; but a revival
    fails its optimistic flight (`RevivalGuard`), and the commit run again waits for its
    live update's row count, then reads which tasks revive (`AfterFence`'s SELECT)."""
    store.commit(epoch, BASE, [submit(REVIVED)])
    store.commit(epoch, BASE, [status(REVIVED)])
    return [*(submit(i) for i in ids), status(REVIVED, cq.TaskStatus.RUNNING)]


class AfterFence:
    """True for the first statement a commit runs after its fence was answered: the fence
    check (a plain UPDATE, or in a pipelined flight a statement around it) is sent with the
    statements queued behind it, and a `looked_up` batch then looks its new ids or its
    revived task up on its own (a SELECT of task ids: not the revival guard queued in the
    optimistic flight), so that lookup comes after the fence holds the leader row locked."""

    def __init__(self) -> None:
        self.fenced = False

    def __call__(self, statement: str) -> bool:
        if "cronoq_leader" in statement and "next_id" in statement:
            self.fenced = True
            return False
        return self.fenced and TASK_IDS.match(statement) is not None


TASK_IDS: Final = re.compile(r"\s*SELECT\s+(\S+\.)?cronoq_tasks\.id\b", re.IGNORECASE)
"""A lookup of task ids (new ones stored already, or finished ones a batch revives)."""


@pytest.mark.parametrize("dialect", [pytest.param("postgresql", marks=pytest.mark.postgresql)])
def test_connection_cut_inside_a_commit(
    open_store: Callable[[cq.StoreConfig], Store], engine: Engine
) -> None:
    store = open_store(
        cq.StoreConfig(lease_ttl=timedelta(seconds=60), lease_renew=timedelta(seconds=20))
    )
    epoch = store.acquire_leadership(timeout=WAIT)
    cut = threading.Event()
    after_fence = AfterFence()

    def kill_after_fence(driver_connection: Any, statement: str) -> None:
        if after_fence(statement) and not cut.is_set():
            cut.set()
            pid = driver_connection.info.backend_pid
            with engine.connect() as admin:
                # Waits (up to 5 s) until the backend is gone.
                admin.execute(text("SELECT pg_terminate_backend(:pid, 5000)"), {"pid": pid})

    after_each(store_engine(store), kill_after_fence)
    batch = looked_up(store, epoch, 1, 2)  # hooked: on the connection commits keep
    next_id = lease_row(engine).next_id
    with pytest.raises(cq.StoreUnavailable):
        store.commit(epoch, BASE, batch)
    assert cut.is_set()
    assert stored_ids(engine) == PAD
    assert lease_row(engine).next_id == next_id  # the fence update rolled back with the batch
    assert store.is_leader  # a lost connection is not a lost lease

    store.commit(epoch, BASE, batch)  # the pool recovered
    assert stored_ids(engine) == {1, 2} | PAD
    assert lease_row(engine).next_id == max(PAD) + 1


# 5. The keeper.


class LossWatcher:
    """Counts leadership-lost callbacks."""

    def __init__(self, store: Store) -> None:
        self.calls = 0
        self.called = threading.Event()
        store.on_leadership_lost(self)

    def __call__(self) -> None:
        self.calls += 1
        self.called.set()


def transitions(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name in {"cronoq_store.store", "cronoq_store.aio"}
        and r.getMessage().startswith("cronoq leadership")
    ]


def test_keeper_steps_down_when_the_lease_is_stolen(
    open_store: Callable[[cq.StoreConfig], Store],
    engine: Engine,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="cronoq_store")
    store = open_store(SHORT)
    watcher = LossWatcher(store)
    epoch = store.acquire_leadership(timeout=WAIT)
    store.commit(epoch, BASE, [submit(1)])
    assert not store.wait_leadership_lost(0)

    set_lease(engine, epoch=epoch + 1, holder="thief")
    stolen = time.monotonic()
    renew = SHORT.lease_renew.total_seconds()
    assert store.wait_leadership_lost(renew + SLACK), "the keeper did not notice the takeover"
    assert time.monotonic() - stolen <= renew + SLACK
    assert watcher.called.wait(WAIT)
    assert (store.epoch, store.is_leader) == (None, False)
    with pytest.raises(cq.Fenced):
        store.commit(epoch, BASE, [submit(2)])
    store.release_leadership()  # already lost: no second callback, the thief keeps its lease
    assert lease_row(engine).holder == "thief"
    assert watcher.calls == 1
    assert stored_ids(engine) == {1}

    # Leading anew, once the thief's lease is gone: the epoch after the thief's.
    set_lease(engine, expires_unix_ns=0)
    assert store.acquire_leadership(timeout=WAIT) == epoch + 2
    store.commit(epoch + 2, BASE, [submit(2)])
    assert stored_ids(engine) == {1, 2}
    assert watcher.calls == 1
    assert transitions(caplog) == [
        f"cronoq leadership acquired (epoch {epoch})",
        f"cronoq leadership lost (epoch {epoch}): the lease was taken over",
        f"cronoq leadership acquired (epoch {epoch + 2})",
    ]


class RowLock:
    """Holds the leader row (SQLite: the whole database) from another connection, so that
    renewals block on it."""

    def __init__(self, engine: Engine, dialect: str) -> None:
        self.engine = engine
        self.dialect = dialect
        self._holder: sqlite3.Connection | Connection | None = None

    def lock(self) -> None:
        if self.dialect == "sqlite":
            self._holder = sqlite3.connect(self.engine.url.database or "", isolation_level=None)
            self._holder.execute("BEGIN IMMEDIATE")
        else:
            self._holder = self.engine.connect()
            self._holder.execute(select(leader.c.epoch).where(leader.c.id == 1).with_for_update())

    def unlock(self) -> None:
        if self._holder is not None:
            self._holder.rollback()
            self._holder.close()
            self._holder = None


@pytest.fixture
def row_lock(engine: Engine, dialect: str) -> Iterator[RowLock]:
    held = RowLock(engine, dialect)
    try:
        yield held
    finally:
        held.unlock()


def test_keeper_steps_down_when_renewal_blocks_past_the_ttl(
    open_store: Callable[[cq.StoreConfig], Store],
    engine: Engine,
    row_lock: RowLock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every wait here is for a condition: how soon after the lock the keeper steps down is the
    deadline's business (test_keeper_deadline_runs_from_the_start_of_the_last_renewal); here it
    must step down at all while its renewal hangs, and not merely because a renewal failed."""
    caplog.set_level(logging.INFO, logger="cronoq_store")
    # A blocked renewal waits far longer than WAIT: SQLite for busy_timeout, PostgreSQL for ever
    # (renewals set no statement timeout), MariaDB for its lock wait timeout (50 s, or the
    # commit timeout's 60 s once a commit has set it on the connection).
    # Ten renewals per TTL: a loaded machine must stall one for 1.8 s to end the healthy part.
    store = open_store(
        cq.StoreConfig(
            lease_ttl=timedelta(seconds=2),
            lease_renew=SHORT.lease_renew,
            lock_poll=SHORT.lock_poll,
            busy_timeout=timedelta(seconds=60),
            commit_timeout=timedelta(seconds=60),
        )
    )
    watcher = LossWatcher(store)
    epoch = store.acquire_leadership(timeout=WAIT)
    # Healthy, it renews: the lease's expiry moves on twice, and it still leads.
    taken = lease_row(engine).expires_unix_ns
    wait_until(lambda: lease_row(engine).expires_unix_ns > taken, "a first renewal", WAIT)
    first = lease_row(engine).expires_unix_ns
    wait_until(lambda: lease_row(engine).expires_unix_ns > first, "a second renewal", WAIT)
    assert store.epoch == epoch

    row_lock.lock()
    # Every renewal from here hangs on the lock until it is released below.
    assert store.wait_leadership_lost(WAIT), "the keeper did not step down while renewals hung"
    assert watcher.called.wait(WAIT)
    assert not [r for r in caplog.records if "renewing the cronoq lease failed" in r.getMessage()]
    with pytest.raises(cq.Fenced):
        store.commit(epoch, BASE, [submit(1)])
    assert watcher.calls == 1
    assert transitions(caplog)[-1] == (
        f"cronoq leadership lost (epoch {epoch}): "
        "the lease was not renewed within its TTL (2 s): a renewal hung"
    )

    row_lock.unlock()
    assert store.acquire_leadership(timeout=WAIT) == epoch + 1
    store.commit(epoch + 1, BASE, [submit(1)])
    assert stored_ids(engine) == {1}
    assert watcher.calls == 1


@pytest.mark.parametrize("face", FACES)
def test_keeper_deadline_runs_from_the_start_of_the_last_renewal(face: str) -> None:
    """A keeper alone, on fake renewals: its own renewal hangs, renewals reported from elsewhere
    (a landed commit's fence) keep it alive, and it steps down one TTL after the last."""
    hang = threading.Event()
    reasons: list[str] = []
    gone = threading.Event()

    def hanging_renew() -> bool:
        hang.wait(WAIT)
        return True

    def lost(why: str) -> None:
        reasons.append(why)
        gone.set()

    ttl = 0.8
    kept = keeper(
        face, renew=hanging_renew, lost=lost, every=0.05, ttl=ttl, renewed_at=time.monotonic()
    )
    kept.start()
    try:
        until = time.monotonic() + 2 * ttl
        while time.monotonic() < until:
            last = time.monotonic()
            kept.renewed(last)
            assert not gone.wait(0.05), reasons
        assert gone.wait(ttl + SLACK), "the keeper did not step down with its renewal hung"
        assert time.monotonic() - last >= ttl  # and not before the TTL ran out
        assert reasons == [f"the lease was not renewed within its TTL ({ttl:g} s): a renewal hung"]
    finally:
        hang.set()
        kept.stop()
        kept.join(WAIT)


@pytest.mark.parametrize("face", FACES)
def test_keeper_reports_a_takeover_once(face: str) -> None:
    reasons: list[str] = []
    gone = threading.Event()
    renewals = iter([True, True])

    def renew() -> bool:
        return next(renewals, False)  # renewed twice, then taken over

    def lost(why: str) -> None:
        reasons.append(why)
        gone.set()

    kept = keeper(face, renew=renew, lost=lost, every=0.02, ttl=5.0, renewed_at=time.monotonic())
    kept.start()
    assert gone.wait(WAIT)
    kept.join(WAIT)
    assert reasons == ["the lease was taken over"]


@pytest.mark.parametrize("face", FACES)
def test_keeper_retries_a_failure_and_steps_down_after_a_streak(face: str) -> None:
    """A failed renewal is retried; failures until the TTL runs out step down, with the last
    failure as the reason, and not before the TTL (on the monotonic clock)."""
    ttl = 0.6

    def run(outcomes: list[str]) -> tuple[list[str], float | None]:
        reasons: list[str] = []
        gone = threading.Event()
        calls = 0

        def renew() -> bool:
            nonlocal calls
            calls += 1
            outcome = outcomes.pop(0) if outcomes else "ok"
            if outcome == "fail":
                raise cq.StoreUnavailable("down")
            return True

        def lost(why: str) -> None:
            reasons.append(why)
            gone.set()

        started = time.monotonic()
        kept = keeper(face, renew=renew, lost=lost, every=0.05, ttl=ttl, renewed_at=started)
        kept.start()
        try:
            if gone.wait(4 * ttl):
                return reasons, time.monotonic() - started
            assert calls >= 3, "the keeper did not keep renewing"
            return reasons, None
        finally:
            kept.stop()
            kept.join(WAIT)

    # One failure among successes: still leading.
    assert run(["ok", "fail", "ok"]) == ([], None)
    # Nothing but failures: steps down once the TTL ran out, saying why.
    reasons, after = run(["fail"] * 1000)
    assert reasons == [f"the lease was not renewed within its TTL ({ttl:g} s): down"]
    assert after is not None and after >= ttl


def test_release_hands_over_at_once(open_store: Callable[[cq.StoreConfig], Store]) -> None:
    config = cq.StoreConfig(
        lease_ttl=timedelta(seconds=30),
        lease_renew=timedelta(seconds=5),
        lock_poll=timedelta(milliseconds=50),
    )
    first, second = open_store(config), open_store(config)
    epoch = first.acquire_leadership(timeout=WAIT)
    with pytest.raises(cq.StoreUnavailable, match="another instance holds the lease"):
        second.acquire_leadership(timeout=0.2)
    standby = Worker("standby", lambda: second.acquire_leadership(timeout=WAIT))
    standby.start()
    first.release_leadership()
    released = time.monotonic()
    assert standby.outcome() == epoch + 1
    assert standby.error is None
    # Far sooner than the 30 s lease would have run out.
    assert time.monotonic() - released < WAIT
    assert not first.is_leader
    with pytest.raises(cq.Fenced):
        first.commit(epoch, BASE, [submit(1)])


@pytest.mark.parametrize("face", FACES)
def test_acquire_backs_off_while_the_database_is_unreachable(
    face: str,
    cleanup: list[Callable[[], None]],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    refused = "postgresql+psycopg://postgres@127.0.0.1:1/nowhere"
    store = wrap_engine(
        face, refused, cq.StoreConfig(lock_poll=timedelta(milliseconds=50)), cleanup
    )
    attempts = count_attempts(store, monkeypatch)
    with pytest.raises(cq.StoreUnavailable, match="unreachable"):
        store.acquire_leadership(timeout=1.0)
    # 50, 100, 200, 400 ms between tries, then a last one at the timeout: 6 tries in the
    # second, not the 20 that polling every 50 ms would make. Each wait doubles the one
    # before (a loaded machine only lengthens them), but the last, cut at the timeout.
    assert 2 <= len(attempts) <= 7, attempts
    gaps = [b - a for a, b in itertools.pairwise(attempts)]
    assert all(gap >= 0.05 * 2**i for i, gap in enumerate(gaps[:-1])), gaps
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # one line for the transition, not one per try


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        (
            {"lease_ttl": timedelta(seconds=3), "lease_renew": timedelta(seconds=2)},
            "lease_renew must be at most half of lease_ttl",
        ),
        (
            {
                "lease_ttl": timedelta(seconds=1),
                "lease_renew": timedelta(milliseconds=200),
                "lock_poll": timedelta(seconds=1),
            },
            "lock_poll must be below lease_ttl",
        ),
        ({"lease_renew": timedelta(0)}, "lease_renew must be positive"),
        ({"lease_ttl": 10}, "lease_ttl must be a timedelta"),
        ({"pool_size": 0}, "pool_size must be at least 1"),
    ],
)
def test_config_refuses_settings_that_cannot_work(settings: dict[str, Any], why: str) -> None:
    with pytest.raises(cq.InvalidValue, match=why):
        cq.StoreConfig(**settings)


def test_config_accepts_the_defaults() -> None:
    assert cq.StoreConfig().lease_renew * 5 == cq.StoreConfig().lease_ttl


@pytest.mark.parametrize("dialect", [pytest.param("postgresql", marks=pytest.mark.postgresql)])
def test_a_leader_paused_inside_a_commit_does_not_hold_off_standbys(
    engine: Engine, open_store: Callable[[cq.StoreConfig], Store]
) -> None:
    """The server ends the session of a client idle in its commit past the lease TTL."""
    old, standby = open_store(SHORT), open_store(SHORT)
    epoch = old.acquire_leadership(timeout=WAIT)
    paused, resume = threading.Event(), threading.Event()

    after_fence = AfterFence()

    def pause_after_fence(_driver_connection: Any, statement: str) -> None:
        if after_fence(statement) and not paused.is_set():
            paused.set()
            resume.wait(WAIT)  # the leader row stays locked: a process stopped mid-commit

    after_each(store_engine(old), pause_after_fence)
    batch = looked_up(old, epoch, 1, 3)  # hooked: on the connection commits keep

    failure: list[BaseException] = []

    def commit() -> None:
        try:
            old.commit(epoch, BASE, batch)
        except BaseException as exc:
            failure.append(exc)

    committer = threading.Thread(target=commit)
    committer.start()
    try:
        assert paused.wait(WAIT)
        started = time.monotonic()
        new_epoch = standby.acquire_leadership(timeout=WAIT)
        took = time.monotonic() - started
    finally:
        resume.set()
        committer.join(WAIT)
    assert new_epoch == epoch + 1
    # Without the idle timeout the takeover waits until the paused commit resumes (WAIT s).
    assert took < SHORT.lease_ttl.total_seconds() * 2 + SLACK
    assert failure and isinstance(failure[0], cq.StoreUnavailable | cq.Fenced)
    assert stored_ids(engine) == PAD
    standby.commit(new_epoch, BASE, [submit(2)])
    assert stored_ids(engine) == {2} | PAD


def _idle_setting(conn: Connection) -> int | None:
    """The server's idle-in-transaction bound for this session, in ms (None: SQLite)."""
    name = conn.dialect.name
    if name == "postgresql":
        value = conn.execute(text("SELECT current_setting('idle_in_transaction_session_timeout')"))
        text_ = str(value.scalar_one())
        return int(text_.removesuffix("ms")) if text_.endswith("ms") else int(text_) * 1000
    if name in ("mysql", "mariadb"):
        seconds = conn.execute(text("SELECT @@SESSION.idle_transaction_timeout")).scalar_one()
        return int(seconds) * 1000
    return None


def _driver_idle_setting(driver_connection: Any, dialect: str) -> int | None:
    """`_idle_setting` on a DB-API connection (a statement hook's)."""
    if dialect == "sqlite":
        return None
    cursor = driver_connection.cursor()
    try:
        if dialect == "postgresql":
            cursor.execute("SELECT current_setting('idle_in_transaction_session_timeout')")
            text_ = str(cursor.fetchone()[0])
            return int(text_.removesuffix("ms")) if text_.endswith("ms") else int(text_) * 1000
        cursor.execute("SELECT @@SESSION.idle_transaction_timeout")
        return int(cursor.fetchone()[0]) * 1000
    finally:
        cursor.close()


def test_leader_row_transactions_bound_idle_time_and_no_other_does(
    dialect: str, db_url: URL, cleanup: list[Callable[[], None]]
) -> None:
    """Every take, renewal, commit and release runs with the server's idle-in-transaction bound
    at the lease TTL; the store's other transactions (recover, queries) run without it, so a
    long read is never cut, even on a pooled MariaDB connection a renewal used just before."""
    config = cq.StoreConfig(
        lease_ttl=timedelta(milliseconds=2500),
        lease_renew=timedelta(milliseconds=500),
        lock_poll=timedelta(milliseconds=100),
        pool_size=1,  # one connection: the read reuses the session the renewal changed
    )
    # The sync face's own transactions (`_renew`, `_transact`); the async face runs the same
    # `face.plan` and `face.transaction`.
    store = cq.SqlStore.open(db_url, config)
    cleanup.append(store.close)
    # A pipelined flight (psycopg's) cannot be asked for a setting in its middle, and a lease
    # flight commits before its end: the statements go one by one here, with the same bounds.
    store.engine.update_execution_options(**{execution.OBSERVED: True})
    seen: list[tuple[str, int | None]] = []

    watching = True

    def record(driver_connection: Any, statement: str) -> None:
        locks = "FOR UPDATE" in statement or statement.lstrip().startswith("UPDATE")
        if watching and "cronoq_leader" in statement and locks:
            seen.append(("leader-row", _driver_idle_setting(driver_connection, dialect)))

    after_each(store.engine, record)
    epoch = store.acquire_leadership(timeout=WAIT)
    store.commit(epoch, BASE, [submit(1)])
    assert store._renew(epoch)
    store.release_leadership()
    watching = False
    leader_rows = list(seen)
    outside = store._transact("get_task", _idle_setting)
    recovered_under = store._transact("recover_writing", _idle_setting)
    if dialect == "sqlite":
        assert {v for _, v in leader_rows} == {None}
        return
    # MariaDB rounds the TTL up to whole seconds.
    bound = 2500 if dialect == "postgresql" else 3000
    assert len(leader_rows) >= 4 and {v for _, v in leader_rows} == {bound}, leader_rows
    assert outside == 0 and recovered_under == 0
