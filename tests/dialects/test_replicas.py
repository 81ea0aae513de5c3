"""The store beside PostgreSQL replication, on a primary and a streaming replica of our own
(tests/pgpair.py), and beside a MariaDB server in read-only mode (one of our own).

A server that refuses writes (a hot standby, a primary being demoted, a
MariaDB `--read-only`) is `StoreUnavailable`, never a permanent `StoreError`; the connection
that met it is dropped, so the next one can reach the new primary; `acquire_leadership` waits
out its timeout. Point 3: a lost synchronous standby blocks no commit and no acquire past its
timeout (plus a second or two), and a commit whose outcome the store cannot know says so.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pymysql
import pytest
from builders import BASE, keyed
from pgpair import PgPair
from servers import free_port
from sqlalchemy import Engine, create_engine, event, select, text

import cronoq_store as cq
from cronoq_store import execution
from cronoq_store.schema import tasks

SLACK = 2.0
"""What a bounded wait may take past its bound here (a loaded 2-core machine)."""
# No renewal during a test unless it asks for one: every connection is one the test sees.
QUIET = cq.StoreConfig(lease_ttl=timedelta(seconds=60), lease_renew=timedelta(seconds=20))


def _db() -> str:
    return f"cronoq_repl_{uuid.uuid4().hex[:10]}"


def connects(engine: Engine) -> list[float]:
    """The times at which `engine`'s pool opens a new DB-API connection, from now on."""
    opened: list[float] = []

    @event.listens_for(engine, "connect")
    def _connect(_dbapi: Any, _record: Any) -> None:
        opened.append(time.monotonic())

    return opened


def observe(engine: Engine) -> None:
    """The store to run its statements through SQLAlchemy's execution (`execution.OBSERVED`)
    instead of the DB-API cursor: both paths must keep the rules."""
    engine.update_execution_options(**{execution.OBSERVED: True})


def server_port(store: cq.SqlStore) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(text("SELECT inet_server_port()")).scalar_one())


def bounded(
    call: Callable[[], Any], limit: float, unblock: Callable[[], None]
) -> tuple[float, BaseException | None]:
    """Run `call` in a thread: the seconds it took and what it raised. Fails the test if it is
    still blocked after `limit` seconds (then `unblock()` lets it end: no thread is left)."""
    outcome: list[BaseException | None] = []

    def target() -> None:
        try:
            call()
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    started = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(limit)
    took = time.monotonic() - started
    if thread.is_alive():
        unblock()
        thread.join(60)
        pytest.fail(f"still blocked after {limit:.1f} s (it ended once unblocked: {outcome})")
    return took, outcome[0]


@pytest.fixture
def pair(pg_pair: PgPair) -> PgPair:
    return pg_pair.fresh(sync=True)


@pytest.fixture
def migrated(pair: PgPair) -> str:
    """A database migrated on the primary and replayed by the replica; its name."""
    db = pair.create_database(_db())
    cq.SqlStore.open(pair.primary_url(db)).close()
    pair.wait_replayed()
    return db


# Point 3: a lost synchronous standby blocks nothing past its timeout.

COMMIT_TIMEOUT = timedelta(seconds=2)


def present(pair: PgPair, db: str, task: int) -> bool:
    """Whether the primary holds task `task` (read outside the store)."""
    engine = create_engine(pair.primary_url(db))
    try:
        with engine.connect() as conn:
            found = conn.execute(select(tasks.c.id).where(tasks.c.id == task)).first()
        return found is not None
    finally:
        engine.dispose()


def assert_unknown_outcome(error: BaseException | None) -> None:
    assert isinstance(error, cq.StoreUnavailable), repr(error)
    assert "outcome unknown" in str(error), error
    assert "commit it again" in str(error), error


@pytest.mark.postgresql
def test_commit_with_a_lost_sync_standby_gives_up_within_its_timeout(
    pair: PgPair, migrated: str
) -> None:
    config = replace(QUIET, migrate=False, commit_timeout=COMMIT_TIMEOUT)
    with cq.SqlStore.open(pair.primary_url(migrated), config) as store:
        epoch = store.acquire_leadership(timeout=10)
        store.commit(epoch, BASE, [keyed(1)])
        pair.stop_replica()
        try:
            limit = COMMIT_TIMEOUT.total_seconds() + SLACK
            took, error = bounded(
                lambda: store.commit(epoch, BASE, [keyed(2)]), limit + 5, pair.start_replica
            )
            print(f"commit with the sync standby lost: {took:.2f} s, {error}")
            assert took < limit, took
            assert_unknown_outcome(error)
        finally:
            pair.start_replica()
        pair.wait_replayed()
        # Why unknown: the COMMIT had been sent, and PostgreSQL committed it locally, holding
        # it for the standby; it lands once the standby is back (a failover before that could
        # have lost it). The store shut its socket; the server ends the wait on its own.
        end = time.monotonic() + 30
        while not present(pair, migrated, 2) and time.monotonic() < end:
            time.sleep(0.1)
        assert present(pair, migrated, 2)
        # The batch is idempotent: committing it again lands, once the standby is back.
        store.commit(epoch, BASE, [keyed(2)])
        assert store.get_task(cq.ById(id=cq.TaskId(2))) is not None


@pytest.mark.postgresql
def test_async_commit_with_a_lost_sync_standby_gives_up_within_its_timeout(
    pair: PgPair, migrated: str
) -> None:
    config = replace(QUIET, migrate=False, commit_timeout=COMMIT_TIMEOUT)
    limit = COMMIT_TIMEOUT.total_seconds() + SLACK
    timing: list[float] = []

    async def scenario() -> None:
        async with await cq.AsyncSqlStore.open(pair.primary_url(migrated), config) as store:
            epoch = await store.acquire_leadership(timeout=10)
            await store.commit(epoch, BASE, [keyed(1)])
            pair.stop_replica()
            started = time.monotonic()
            try:
                await store.commit(epoch, BASE, [keyed(2)])
            finally:
                timing.append(time.monotonic() - started)
                pair.start_replica()

    _took, error = bounded(lambda: asyncio.run(scenario()), limit + 10, pair.start_replica)
    print(f"async commit with the sync standby lost: {timing} s, {error}")
    assert timing and timing[0] < limit, timing
    assert_unknown_outcome(error)


@pytest.mark.postgresql
def test_acquire_beside_a_leader_stuck_on_a_lost_standby_keeps_its_timeout(
    pair: PgPair, migrated: str
) -> None:
    """The leader's renewal waits for the lost standby holding the leader row's lock; a second
    instance's take, once the lease ran out, waited behind that lock past every timeout."""
    ttl = cq.StoreConfig(
        migrate=False, lease_ttl=timedelta(seconds=2), lease_renew=timedelta(milliseconds=500),
        lock_poll=timedelta(milliseconds=100), commit_timeout=COMMIT_TIMEOUT,
    )  # fmt: skip
    with (
        cq.SqlStore.open(pair.primary_url(migrated), ttl) as leader,
        cq.SqlStore.open(pair.primary_url(migrated), ttl) as standby,
    ):
        epoch = leader.acquire_leadership(timeout=10)
        leader.commit(epoch, BASE, [keyed(1)])
        pair.stop_replica()
        try:
            took, error = bounded(
                lambda: standby.acquire_leadership(timeout=3), 3 + SLACK + 10, pair.start_replica
            )
            print(f"acquire(timeout=3) beside a leader stuck on the lost standby: {took:.2f} s")
            assert isinstance(error, cq.StoreUnavailable), repr(error)
            assert "not leader after 3 s" in str(error)
            assert 3 <= took < 3 + SLACK, took
            # The leader stepped down on its own clock meanwhile (its renewals never land).
            assert leader.wait_leadership_lost(timeout=1)
        finally:
            pair.start_replica()


# Point 2: a read-only server is StoreUnavailable, and its connection is dropped.


@pytest.mark.postgresql
@pytest.mark.parametrize("observed", [False, True], ids=["cursor", "observed"])
def test_acquire_on_a_hot_standby_waits_out_its_timeout(
    pair: PgPair, migrated: str, observed: bool
) -> None:
    config = cq.StoreConfig(migrate=False, lock_poll=timedelta(milliseconds=200))
    with cq.SqlStore.open(pair.replica_url(migrated), config) as store:
        if observed:
            observe(store.engine)
        opened = connects(store.engine)
        started = time.monotonic()
        with pytest.raises(cq.StoreUnavailable, match="read-only transaction") as caught:
            store.acquire_leadership(timeout=3)
        took = time.monotonic() - started
        print(f"acquire(timeout=3) on a hot standby: {took:.2f} s")
        # Waited out its timeout (it used to raise StoreError at once), and no longer.
        assert 3.0 <= took < 3.0 + SLACK, took
        assert "not leader after 3 s" in str(caught.value)
        # Each attempt met the standby on a connection of its own: the one that refused the
        # write was dropped, so a multi-host or DNS URL could reach another server.
        assert len(opened) >= 3
        assert store.engine.pool.checkedout() == 0


@pytest.mark.postgresql
@pytest.mark.parametrize("observed", [False, True], ids=["cursor", "observed"])
def test_commit_on_a_demoted_primary_is_unavailable_then_reaches_the_new_one(
    pair: PgPair, migrated: str, observed: bool
) -> None:
    with cq.SqlStore.open(pair.multi_url(migrated), QUIET) as store:
        if observed:
            observe(store.engine)
        epoch = store.acquire_leadership(timeout=10)
        store.commit(epoch, BASE, [keyed(1)])
        assert server_port(store) == pair.primary_port
        pair.wait_replayed()
        # The primary turns read-only under the store's pooled connections (as one being
        # demoted does), and the replica is promoted.
        pair.set_read_only()
        pair.promote()
        opened = connects(store.engine)
        with pytest.raises(cq.StoreUnavailable, match="read-only transaction"):
            store.commit(epoch, BASE, [keyed(2)])
        # The connection that met the read-only server was dropped: the retry opens a new
        # one, which the multi-host URL's target_session_attrs=read-write takes to the new
        # primary (a pooled connection to the old one may fail the same way first).
        errors: list[str] = []
        for _attempt in range(QUIET.pool_size):
            try:
                store.commit(epoch, BASE, [keyed(2)])
                break
            except cq.StoreUnavailable as exc:
                errors.append(str(exc))
        else:
            pytest.fail(f"the commit never reached the new primary: {errors}")
        assert all("read-only transaction" in e for e in errors), errors
        assert opened, "no new connection was opened after the read-only error"
        assert server_port(store) == pair.replica_port
        task = store.get_task(cq.ById(id=cq.TaskId(2)))
        assert task is not None


class ReadOnlyMaria:
    """A throwaway MariaDB server of our own (own data directory and port, run as the mysql
    user), whose `read_only` the test may switch: the shared server is never made read-only.
    The store connects as a user without privileges beyond its database."""

    def __init__(self, root: Path, port: int) -> None:
        self.root = root
        self.port = port
        self.socket = root / "mysqld.sock"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mysql+pymysql://cronoq@127.0.0.1:{self.port}/cronoq"

    def start(self) -> None:
        data = self.root / "data"
        shutil.chown(self.root, "mysql", "mysql")
        subprocess.run(
            ["mariadb-install-db", "--no-defaults", f"--datadir={data}", "--user=mysql",
             "--auth-root-authentication-method=normal", "--skip-test-db"],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        self.process = subprocess.Popen(
            ["mariadbd", "--no-defaults", f"--datadir={data}", f"--port={self.port}",
             "--bind-address=127.0.0.1", f"--socket={self.socket}", "--user=mysql",
             f"--pid-file={self.root / 'mysqld.pid'}", "--skip-log-bin", "--skip-name-resolve",
             "--innodb-buffer-pool-size=16M", f"--log-error={self.root / 'error.log'}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while not (self.socket.exists() and _port_open(self.port)):
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = (self.root / "error.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"mariadbd did not come up:\n{log}")
            time.sleep(0.05)
        self.admin("CREATE DATABASE cronoq CHARACTER SET utf8mb4")
        self.admin("CREATE USER 'cronoq'@'127.0.0.1'")
        self.admin("GRANT ALL ON cronoq.* TO 'cronoq'@'127.0.0.1'")

    def admin(self, sql: str) -> None:
        """Run `sql` as root over the server's own socket."""
        conn = pymysql.connect(unix_socket=str(self.socket), user="root", connect_timeout=2)
        try:
            with conn.cursor() as cursor:
                cursor.execute(sql)
        finally:
            conn.close()

    def read_only(self, on: bool) -> None:
        self.admin(f"SET GLOBAL read_only = {1 if on else 0}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def read_only_maria() -> Iterator[ReadOnlyMaria]:
    missing = [t for t in ("mariadb-install-db", "mariadbd") if shutil.which(t) is None]
    why = f"{', '.join(missing)} not found" if missing else None
    if why is None and os.geteuid() != 0:
        why = "a MariaDB server of our own runs as the mysql user: needs root"
    # Not under pytest's tmp_path: the mysql user cannot enter root's private directory.
    server = ReadOnlyMaria(Path(tempfile.mkdtemp(prefix="cronoq-maria-ro-")), free_port())
    try:
        if why is None:
            try:
                server.start()
            except subprocess.CalledProcessError as exc:
                why = f"could not start it: {exc}: {exc.stderr!r}"
            except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
                why = f"could not start it: {exc}"
        if why is not None:
            message = f"no MariaDB server of our own to make read-only: {why}"
            if os.environ.get("CRONOQ_REQUIRE_DIALECTS") or os.environ.get("CI"):
                pytest.fail(message, pytrace=False)
            pytest.skip(message)
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.root, ignore_errors=True)


@pytest.mark.mysql
def test_mariadb_read_only_server_is_unavailable(read_only_maria: ReadOnlyMaria) -> None:
    server = read_only_maria
    with cq.SqlStore.open(server.url, QUIET) as store:
        epoch = store.acquire_leadership(timeout=10)
        store.commit(epoch, BASE, [keyed(1)])
        server.read_only(True)
        try:
            opened = connects(store.engine)
            pool: Any = store.engine.pool
            pooled = pool.checkedin() + pool.checkedout()  # the one the commits kept too
            # Each commit meets error 1290 and drops its connection: once every pooled one has
            # gone, the next commit opens a new one (the pool reconnects a dropped one).
            for _attempt in range(pooled + 1):
                with pytest.raises(cq.StoreUnavailable, match="--read-only"):  # error 1290
                    store.commit(epoch, BASE, [keyed(2)])
            assert len(opened) == 1, "a connection that met the read-only server was kept"
            server.read_only(False)
            store.release_leadership()
            server.read_only(True)
            config = replace(QUIET, migrate=False, lock_poll=timedelta(milliseconds=200))
            with cq.SqlStore.open(server.url, config) as other:
                started = time.monotonic()
                with pytest.raises(cq.StoreUnavailable, match="--read-only"):
                    other.acquire_leadership(timeout=2)
                took = time.monotonic() - started
                assert 2.0 <= took < 2.0 + SLACK, took
        finally:
            server.read_only(False)


def test_watchdog_interrupts_only_what_outlives_its_deadline() -> None:
    """The mechanism under every bounded transaction, on plain callables (no server)."""
    dog = execution.Watchdog()
    calls: list[str] = []
    fired = threading.Event()
    early = dog.arm(5.0, lambda: calls.append("early"))
    assert dog.settle(early) is False  # ended in time: never interrupted

    def late_interrupt() -> None:
        calls.append("late")
        fired.set()

    late = dog.arm(0.05, late_interrupt)
    assert fired.wait(5)
    assert dog.settle(late) is True  # the caller learns it was interrupted
    assert calls == ["late"]
    # Deadlines settled long before they pass do not pile up (a busy leader commits often).
    for _ in range(5000):
        dog.settle(dog.arm(60.0, None))
    assert len(dog._heap) <= 1100


def test_watchdog_fires_deadlines_armed_after_a_sweep() -> None:
    """A sweep replaces the heap: the watchdog thread must watch the new one, or no deadline
    armed after the first thousand settled ones (a leader's first seconds) would ever fire."""
    dog = execution.Watchdog()
    first = dog.arm(60.0, None)  # the thread starts and waits on this one
    for _ in range(3000):  # settled long before they pass: sweeps replace the heap
        dog.settle(dog.arm(60.0, None))
    dog.settle(first)
    fired = threading.Event()
    dog.arm(0.05, fired.set)
    assert fired.wait(5), "a deadline armed after a sweep never fired"
