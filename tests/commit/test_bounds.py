"""The pieces that keep every bound (issue 38), one at a time and without a network of their
own: the watchdog's late binding, the network options of the store's own connections, and a
connect that starts with nothing left of its operation's bound. tests/faults/test_netlab.py drills
them together under silent cuts."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from sqlalchemy import URL, create_engine, make_url

from cronoq_store import SqlStore, StoreConfig, StoreUnavailable, execution, face
from cronoq_store.dialects import sessions
from cronoq_store.testing.statements import after_statements


def test_an_interrupt_bound_after_the_deadline_runs_at_once() -> None:
    """The pool can hand over a connection (to ping it) after the operation's deadline
    passed: binding its interrupt then interrupts it at once, and settling says overdue."""
    called = threading.Event()
    deadline = execution.WATCHDOG.arm(0.01, None)
    end = time.monotonic() + 5
    while not deadline.fired and time.monotonic() < end:
        time.sleep(0.01)
    assert deadline.fired
    execution.WATCHDOG.bind(deadline, called.set)
    assert called.is_set()
    assert execution.WATCHDOG.settle(deadline)
    assert execution.WATCHDOG.settle(deadline)  # idempotent


def test_a_settled_deadline_interrupts_nothing() -> None:
    called = threading.Event()
    with execution.bounded(0.05) as deadline:
        assert deadline is not None
        execution.WATCHDOG.bind(deadline, called.set)
    assert not execution.WATCHDOG.settle(deadline)
    assert not called.wait(0.2)


def test_store_connections_get_tcp_bounds_unless_the_url_sets_them() -> None:
    url = make_url("postgresql+psycopg://u@h/db?keepalives_idle=30&connect_timeout=3")
    args = sessions.net_options(url, {})
    assert "keepalives_idle" not in args  # the URL's own stands
    assert "connect_timeout" not in args
    assert args["keepalives"] == "1"
    assert args["keepalives_count"] == str(sessions.KEEPALIVE_COUNT)
    assert args["tcp_user_timeout"] == str(sessions.TCP_USER_TIMEOUT_MS)
    mine = sessions.net_options(make_url("postgresql+psycopg://u@h/db"), {"keepalives": "0"})
    assert mine["keepalives"] == "0"  # connect_args given stand too
    assert sessions.net_options(make_url("mysql+pymysql://u@h/db"), {}) == {}


def test_commit_lock_bound_leaves_renewals_their_time() -> None:
    """Two waits of the bound and a renewal interval fit in the TTL, with a third to spare."""
    for ttl, renew in ((3, 1), (10, 2), (4, 2), (30, 5)):
        config = StoreConfig(lease_ttl=timedelta(seconds=ttl), lease_renew=timedelta(seconds=renew))
        wait = face.commit_lock_bound(config)
        assert wait > timedelta(0)
        assert 2 * wait + config.lease_renew < config.lease_ttl
    short = StoreConfig(commit_timeout=timedelta(milliseconds=300))
    # Under the timeout: the server gives a blocked statement up before the deadline does.
    assert face.commit_lock_bound(short) == timedelta(milliseconds=240)


def test_a_commits_lock_bound_does_not_outlive_it(db_url: URL, dialect: str) -> None:
    """MariaDB's lock waits are session settings: a commit's short bound (so the keeper's
    renewal queued behind a commit stalled on a migration's table lock gets the lease row in
    time) must not stay on the pooled connection for what runs there next. A renewal under
    it would give up on the row lock as soon as such a commit does, and lose the lease to a
    commit that holds it for its whole bound; a long read would fail on any row lock."""
    if dialect != "mysql":
        pytest.skip("lock waits are session settings on MariaDB only")
    engine = create_engine(db_url, pool_size=1)
    waits = "SELECT @@SESSION.innodb_lock_wait_timeout, @@SESSION.lock_wait_timeout"
    try:
        with engine.connect() as conn:
            server = tuple(conn.exec_driver_sql(waits.replace("SESSION", "GLOBAL")).one())
            conn.rollback()
            with conn.begin():  # a commit's bounds
                sessions.bound(
                    conn, idle=None, timeout=timedelta(seconds=20), lock=timedelta(seconds=1)
                )
                assert tuple(conn.exec_driver_sql(waits).one()) == (1, 1)
        with engine.connect() as conn, conn.begin():  # then a renewal's, or a read's
            sessions.bound(conn, idle=timedelta(seconds=4), timeout=None)
            assert tuple(conn.exec_driver_sql(waits).one()) == server
    finally:
        engine.dispose()


def test_no_connect_is_started_past_the_bound(db_url: URL, dialect: str) -> None:
    """A connect started within an operation whose bound is spent is refused at once,
    `StoreUnavailable`, instead of waiting out a connect timeout of its own."""
    if dialect == "sqlite":
        pytest.skip("SQLite opens a file: nothing to bound")
    with SqlStore.open(db_url) as store:
        store.engine.dispose()  # nothing pooled: the next operation connects
        started = time.monotonic()
        with execution.bounded(0.01):
            time.sleep(0.05)
            with pytest.raises(StoreUnavailable, match="no time left to connect"):
                store.engine.connect()
        assert time.monotonic() - started < 1.0


def test_a_standby_writes_no_probe_while_the_lease_is_held(db_url: URL) -> None:
    """The take's disk probe (1 MiB) is written only by a take that succeeds: a standby's
    attempts on a held lease, one per retry for as long as the leader lives, write nothing
    to the tasks' tables (a probe per attempt would be a steady stream of WAL and binlog)."""
    probes: list[str] = []

    def seen(_cursor: object, statement: str) -> None:
        if "cronoq_recurring" in statement and statement.lstrip().upper().startswith("INSERT"):
            probes.append(statement)

    with SqlStore.open(db_url) as leader, SqlStore.open(db_url) as standby:
        after_statements(standby.engine, seen)
        leader.acquire_leadership()
        with pytest.raises(StoreUnavailable):
            standby.acquire_leadership(timeout=0.5)
        assert probes == []
        leader.release_leadership()
        standby.acquire_leadership(timeout=10)
        assert len(probes) == 1  # the take that succeeded wrote its probe
        standby.release_leadership()
