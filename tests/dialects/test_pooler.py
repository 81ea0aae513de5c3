"""The store behind pgbouncer in transaction mode.

A pooler in transaction mode hands each transaction whichever server connection is free, so
nothing may outlive a transaction: no server-side prepared statement (psycopg prepares a
statement after 5 executions), no session setting, no LISTEN. `StoreConfig(transaction_pooler=
True)` makes the store so; an app's engine needs `connect_args={"prepare_threshold": None}`.

Every test here goes through a real pgbouncer of the module's own (`scripts/pg-pooler`: its own
ini, pidfile, logfile and socket directory, a free port, `pool_mode = transaction`, small
server pools reused round-robin) in front of the tests' PostgreSQL, on a database of the test's
own. Without pgbouncer the tests skip, or fail where every dialect is required (CI).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from builders import BASE, found_empty, status, submit, wait_until
from drills import TAKEOVER_BOUND, Spawn, enqueuer, first_to_lead, roles
from faces import FACES, open_face
from servers import SERVER_URLS, free_port, new_database, required
from sqlalchemy import URL, Engine, create_engine, make_url

import cronoq_store as cq
from cronoq_store.testing import HangPoint, check

pytestmark = [pytest.mark.postgresql, pytest.mark.pooler]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "pg-pooler"
POOLED = cq.StoreConfig(lease_ttl=timedelta(seconds=5), transaction_pooler=True)
APP_ARGS: dict[str, Any] = {"prepare_threshold": None}
"""What an app's engine needs behind a transaction pooler (docs/deploying.md, "Poolers")."""
WAKE_BOUND = 5.0
"""`wait_inbox` must wake within this long of the enqueue's commit (it polls every 100 ms)."""


@pytest.fixture(scope="module")
def pooler_port() -> Iterator[int]:
    """The port of a pgbouncer in transaction mode started for this module, stopped after."""
    pgbouncer = shutil.which("pgbouncer") or (
        "/usr/sbin/pgbouncer" if os.access("/usr/sbin/pgbouncer", os.X_OK) else None
    )
    if pgbouncer is None:
        why = "pgbouncer is not installed (scripts/pg-pooler install)"
        if required():
            pytest.fail(f"{why} (all dialects are required here)", pytrace=False)
        pytest.skip(why)
    upstream = make_url(SERVER_URLS["postgresql"])
    env = {
        **os.environ,
        "CRONOQ_POOLER_UPSTREAM_HOST": upstream.host or "127.0.0.1",
        "CRONOQ_POOLER_UPSTREAM_PORT": str(upstream.port or 5432),
    }
    directory = tempfile.mkdtemp(prefix="cronoq-pgbouncer-")
    port = free_port()
    try:
        subprocess.run([SCRIPT, "start", directory, str(port)], env=env, check=True, timeout=60)
        yield port
    finally:
        subprocess.run([SCRIPT, "stop", directory], check=False, timeout=60)


@pytest.fixture
def direct_url(tmp_path: Path) -> Iterator[URL]:
    """A new database on the PostgreSQL server, reached directly."""
    yield from new_database("postgresql", tmp_path)


@pytest.fixture
def pooled_url(direct_url: URL, pooler_port: int) -> URL:
    """The same database, reached through the pooler."""
    return direct_url.set(host="127.0.0.1", port=pooler_port)


@pytest.fixture
def app_engine(pooled_url: URL) -> Iterator[Engine]:
    """An app's own engine through the pooler, made as docs/deploying.md says."""
    engine = create_engine(pooled_url, connect_args=APP_ARGS)
    yield engine
    engine.dispose()


def _conninfo(url: URL) -> str:
    return f"host={url.host} port={url.port} dbname={url.database} user={url.username}"


class _Background:
    """A thread that calls `fn` until stopped (a second client of the pooler meanwhile, so
    that the store's transactions really move between server connections); its errors."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.errors: list[BaseException] = []
        self.calls = 0
        self._stop = threading.Event()

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    fn()
                    self.calls += 1
                except BaseException as exc:  # reported by stop()
                    self.errors.append(exc)
                    return

        self._thread = threading.Thread(target=loop, name="pooler-background")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive()
        assert self.errors == [], self.errors[0]


# The test rig: the pooler really moves one client's transactions between server connections,
# so a prepared statement of one is unknown to the next (the failure, reproduced).


def test_the_pooler_moves_transactions_between_server_connections(pooled_url: URL) -> None:
    info = _conninfo(pooled_url)
    with (
        psycopg.connect(info, autocommit=True, prepare_threshold=None) as a,
        psycopg.connect(info, prepare_threshold=None) as b,
    ):
        b.execute("SELECT 1")  # b holds a server connection in its transaction: a needs another
        pids = {a.execute("SELECT pg_backend_pid()").fetchone() for _ in range(2)}
        b.commit()
        pids |= {a.execute("SELECT pg_backend_pid()").fetchone() for _ in range(10)}
    assert len(pids) >= 2, pids
    failed: list[psycopg.Error] = []
    with psycopg.connect(info, autocommit=True, prepare_threshold=0) as prepares:
        for _ in range(20):
            try:
                prepares.execute("SELECT %s::int", (1,))
            except psycopg.Error as exc:
                failed.append(exc)
    # 26000 (does not exist here) or 42P05 (exists here already, from an earlier turn)
    assert {e.sqlstate for e in failed} & {"26000", "42P05"}, failed


# Every operation of both faces through the pooler, with transaction_pooler=True.


@pytest.mark.parametrize("face", FACES)
def test_every_operation_through_the_pooler(
    face: str, pooled_url: URL, app_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    cleanup: list[Callable[[], None]] = []
    try:
        store = open_face(face, pooled_url, POOLED, cleanup)  # migrates
        if face == "sync":
            assert store._listener is None  # nothing to LISTEN with behind this pooler
        epoch = store.acquire_leadership(timeout=30)

        def app_reads() -> None:
            store.get_task(cq.ById(id=cq.TaskId(1)))
            with app_engine.begin() as conn:
                cq.enqueue(conn, cq.TaskSpec(payload=b"background"))

        background = _Background(app_reads)
        try:
            n = 60
            for i in range(1, n + 1):
                batch: list[Any] = [submit(i, key=f"k{i}")]
                outputs: list[tuple[cq.TaskId, bytes]] = []
                if i % 2 == 0:
                    batch.append(status(i - 1))
                    outputs.append((cq.TaskId(i - 1), b"out%d" % (i - 1)))
                store.commit(epoch, BASE, batch, outputs)
        finally:
            background.stop()
        assert background.calls > 0
        rec = store.recover(BASE)
        assert rec.next_id == n + 1
        assert [t.id for t in rec.tasks] == list(range(2, n + 1, 2))  # the rest finished
        one = store.get_task(cq.ById(id=cq.TaskId(1)))
        assert one is not None and one.status is cq.TaskStatus.SUCCEEDED
        keyed = store.get_task(cq.ByKey(key="k2"))
        assert keyed is not None and keyed.id == 2
        assert [t.id for t in store.list_finished(limit=5)] == [1, 3, 5, 7, 9]
        assert store.load_output(cq.TaskId(3)) == b"out3"

        # The inbox: what the background enqueued, then a wake-up by an enqueue.
        items = store.read_inbox(limit=10_000)
        assert len(items) == background.calls
        store.commit(epoch, BASE, [cq.InboxTaken(inbox_id=item.inbox_id) for item in items])
        assert store.read_inbox() == []
        assert store.wait_inbox(0.2) is False
        committed = threading.Event()
        committed_at: list[float] = []

        empty = found_empty(monkeypatch)

        def enqueue_later() -> None:
            assert empty.wait(30), "the store never looked at the inbox"
            with app_engine.begin() as conn:
                cq.enqueue(conn, cq.TaskSpec(payload=b"wake"))
            committed_at.append(time.monotonic())
            committed.set()

        thread = threading.Thread(target=enqueue_later)
        thread.start()
        try:
            assert store.wait_inbox(WAKE_BOUND + 0.3) is True
            woke = time.monotonic()
        finally:
            thread.join(30)
        assert committed.wait(10)
        latency_ms = max(0.0, woke - committed_at[0]) * 1000
        print(f"{face}: wait_inbox woke {latency_ms:.0f} ms after the commit")
        [item] = store.read_inbox()
        assert item.spec.payload == b"wake"

        store.commit(epoch, BASE, [submit(n + 1), status(n + 1)])
        time.sleep(0.01)
        assert store.prune(timedelta(0)) == n // 2 + 1
        assert store.get_task(cq.ById(id=cq.TaskId(1))) is None
        store.release_leadership()
        assert not store.is_leader
    finally:
        for close in reversed(cleanup):
            close()


# An app's engine with connect_args={"prepare_threshold": None}: many enqueues through the pooler.


def test_enqueue_from_an_app_engine_through_the_pooler(pooled_url: URL, app_engine: Engine) -> None:
    with cq.SqlStore.open(pooled_url, POOLED) as store:
        per_thread, threads = 50, 4
        errors: list[BaseException] = []

        def app(t: int) -> None:
            try:
                for i in range(per_thread):
                    with app_engine.begin() as conn:
                        cq.enqueue(conn, cq.TaskSpec(payload=b"%d/%d" % (t, i)))
            except BaseException as exc:
                errors.append(exc)

        workers = [threading.Thread(target=app, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
        assert errors == [], errors[0]
        items = store.read_inbox(limit=10_000)
        assert len(items) == per_thread * threads
        assert len({item.spec.payload for item in items}) == per_thread * threads


# The URL form of psycopg's option, which SQLAlchemy hands over as text.


def test_prepare_threshold_in_the_url(direct_url: URL, pooled_url: URL) -> None:
    text = pooled_url.render_as_string(hide_password=False)
    # Empty: never prepare. Enough commits behind the pooler to have prepared (and failed).
    with cq.SqlStore.open(f"{text}?prepare_threshold=", cq.StoreConfig()) as store:
        epoch = store.acquire_leadership(timeout=30)
        background = _Background(lambda: store.get_task(cq.ById(id=cq.TaskId(1))))
        try:
            for i in range(1, 31):
                store.commit(epoch, BASE, [submit(i)])
        finally:
            background.stop()
        with store.engine.connect() as conn:
            assert conn.connection.driver_connection.prepare_threshold is None  # type: ignore[union-attr]
    # A number is a number (it was a str, and the first statement raised TypeError).
    direct = direct_url.render_as_string(hide_password=False)
    for value, want in (("0", 0), ("12", 12), ("none", None)):
        with cq.SqlStore.open(f"{direct}?prepare_threshold={value}") as store:
            assert store.get_task(cq.ById(id=cq.TaskId(999))) is None
            with store.engine.connect() as conn:
                assert conn.connection.driver_connection.prepare_threshold == want  # type: ignore[union-attr]
    with pytest.raises(cq.InvalidValue, match="prepare_threshold='soon'"):
        cq.SqlStore.open(f"{direct}?prepare_threshold=soon")
    with pytest.raises(cq.InvalidValue, match="contradicts"):
        cq.SqlStore.open(f"{direct}?prepare_threshold=5", cq.StoreConfig(transaction_pooler=True))


def test_transaction_pooler_is_validated() -> None:
    assert cq.StoreConfig().transaction_pooler is False
    with pytest.raises(cq.InvalidValue, match="transaction_pooler must be a bool"):
        cq.StoreConfig(transaction_pooler=1)  # type: ignore[arg-type]
    with pytest.raises(cq.InvalidValue, match="inbox_listen must be a bool"):
        cq.StoreConfig(inbox_listen="no")  # type: ignore[arg-type]


# LISTEN behind a transaction pooler hears nothing: the store says so, once.

WARNING = "StoreConfig(transaction_pooler=True)"


def _wake(store: Any, app_engine: Engine, payload: bytes, empty: threading.Event) -> float:
    """Enqueue once `store` waits (its look found the inbox `empty`); seconds from the commit
    to its wake-up."""
    committed: list[float] = []
    empty.clear()

    def later() -> None:
        empty.wait(10)
        with app_engine.begin() as conn:
            cq.enqueue(conn, cq.TaskSpec(payload=payload))
        committed.append(time.monotonic())

    thread = threading.Thread(target=later)
    thread.start()
    try:
        assert store.wait_inbox(10) is True
        woke = time.monotonic()
    finally:
        thread.join(30)
    items = store.read_inbox()
    store.commit(store.epoch, BASE, [cq.InboxTaken(inbox_id=i.inbox_id) for i in items])
    return woke - committed[0]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and WARNING in r.getMessage()
    ]


@pytest.mark.parametrize("face", FACES)
def test_listening_behind_the_pooler_is_reported_once(
    face: str,
    pooled_url: URL,
    app_engine: Engine,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.WARNING, logger="cronoq_store")
    cleanup: list[Callable[[], None]] = []
    # Without transaction_pooler, but preparing nothing (the URL form), so that only LISTEN
    # is wrong here.
    url = pooled_url.update_query_dict({"prepare_threshold": ""})  # kept blank: None
    try:
        store = open_face(face, url, cq.StoreConfig(lease_ttl=timedelta(seconds=5)), cleanup)
        store.acquire_leadership(timeout=30)
        empty = found_empty(monkeypatch)
        late = [_wake(store, app_engine, b"%d" % i, empty) for i in range(3)]
        print(f"{face}: listening behind the pooler, woke after {[round(x, 3) for x in late]} s")
        assert len(_warnings(caplog)) == 1, caplog.text
    finally:
        for close in reversed(cleanup):
            close()


@pytest.mark.parametrize("face", FACES)
def test_listening_directly_is_not_reported(
    face: str,
    direct_url: URL,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.WARNING, logger="cronoq_store")
    cleanup: list[Callable[[], None]] = []
    app_engine = create_engine(direct_url)
    try:
        store = open_face(face, direct_url, cq.StoreConfig(lease_ttl=timedelta(seconds=5)), cleanup)
        store.acquire_leadership(timeout=30)
        empty = found_empty(monkeypatch)
        quick = [_wake(store, app_engine, b"%d" % i, empty) for i in range(3)]
        print(f"{face}: listening directly, woke after {[round(x, 3) for x in quick]} s")
        assert _warnings(caplog) == []
    finally:
        for close in reversed(cleanup):
            close()
        app_engine.dispose()


# A leader killed through the pooler: a standby through it takes over, nothing acknowledged
# is lost, and every enqueue (by an app process, through it too) becomes one task.

KILLS = 3


@pytest.mark.slow
def test_killed_leader_through_the_pooler(
    direct_url: URL, pooled_url: URL, tmp_path: Path, spawn: Spawn
) -> None:
    log = tmp_path / "acks.jsonl"
    # Migrated on a direct connection first, as docs/deploying.md says: the migration's lock is
    # a session's, which a transaction pooler does not keep. The opens through the pooler then
    # find the schema at head and take no lock.
    cq.SqlStore.open(direct_url).close()
    url = pooled_url.render_as_string(hide_password=False)
    procs = [spawn(f"p{i}", pooled_url, log, "--transaction-pooler") for i in range(2)]
    everyone = list(procs)
    roles(procs)  # migrated, one leads
    app_url = f"{url}?prepare_threshold="  # the enqueuer's app_engine: the URL form
    app = enqueuer(app_url, log, tmp_path / "app.stderr", name="app", seed=21)
    takeovers: list[float] = []
    try:
        app.wait("started")
        for r in range(KILLS):
            leader, standbys = roles(procs)
            leader.wait("ack", start=leader.mark(), where=lambda e: e.get("inbox", 0) > 0)
            if r % 2:  # killed inside its commit: the pooler must free that server connection
                mark = leader.mark()
                leader.arm(HangPoint.IN_COMMIT)
                leader.wait("hang", start=mark)
            marks = [s.mark() for s in standbys]
            t_kill = leader.kill()
            _, lead = first_to_lead(standbys, marks, TAKEOVER_BOUND + 10)
            takeovers.append(lead["t"] - t_kill)
            leader.close()
            procs = [p for p in procs if p is not leader]
            procs.append(spawn(f"p{len(everyone)}", pooled_url, log, "--transaction-pooler"))
            everyone.append(procs[-1])
        summary = app.stop()
        assert summary["errors"] == []
        with cq.SqlStore.open(
            pooled_url, cq.StoreConfig(migrate=False, transaction_pooler=True)
        ) as r:
            wait_until(lambda: not r.read_inbox(limit=1), "the inbox drained", 60, 0.05)
            leader, _ = roles(procs)
            leader.wait("ack", start=leader.mark())
            for d in procs:
                assert d.stop()["errors"] == []
            report = check(r, log)
    finally:
        app.close()
    assert report.ok, json.dumps(report.as_dict(), indent=1)
    assert report.acked_batches > 0 and report.lost == []
    assert report.enqueued_committed > 0
    assert report.inbox_tasks + report.inbox_drops >= report.enqueued_committed
    print(
        f"killed leader through the pooler: {KILLS} takeovers, worst "
        f"{max(takeovers):.3f} s, {report.acked_mutations} acknowledged mutations checked, "
        f"{report.enqueued_committed} enqueues committed, 0 lost"
    )
