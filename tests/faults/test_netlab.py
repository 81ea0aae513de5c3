"""Every bound holds whatever the network and the disk do (issue 38), tried with real parts.

`scripts/netlab` builds the lab once for this module (and removes it afterwards): a network
namespace whose veth pair is the leader's only way to a PostgreSQL cluster and a MariaDB
server of the tests' own, listening on the host end. The leader (tests/netlab_leader.py) runs
inside the namespace as a process of its own; a standby runs here, outside, on 127.0.0.1.
A cut is `ip link set cqv0h down` on the host end, with permanent neighbour entries: packets
vanish, with no RST, no ICMP and no ARP failure to give it away.

Per round (lease_ttl 3 s, lease_renew 1 s, commit_timeout 2 s), the bounds the issue promises,
asserted with the slack it states:
- every commit returns within commit_timeout + 1.5 s, and one cut off says what is known;
- leadership lost is reported within lease_ttl + lease_renew + 1.5 s of the cut;
- no thread of the leader's process stalls for more than 1.5 s (a 20 ms ticker's longest gap);
- the standby outside the cut leads within 2 x lease_ttl (+ 1 s for a loaded machine);
- acquire_leadership(timeout=1) returns within 2.5 s, cut off or behind 100 ms of latency;
- no acknowledged commit is lost, and nothing the old leader wrote lands after the takeover.
Then full disks on small loop filesystems: SQLite's file, and a PostgreSQL tablespace.

Needs root (CI runs as root): elsewhere the module skips, and fails where every dialect is
required. Figures go to the run's summary (docs/guarantees.md has a table of them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from builders import BASE
from figures import figures
from servers import created, required
from sqlalchemy import URL, create_engine, make_url, select

import cronoq_store as cq
from cronoq_store.schema import tasks

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "netlab"
LEADER = Path(__file__).resolve().parents[1] / "netlab_leader.py"
NS, HOST_DEV, HOST_IP = "cqnet0", "cqv0h", "10.231.7.1"
PORTS = {"postgresql": 5451, "mariadb": 3351}
TTL, RENEW, COMMIT_TIMEOUT = 3.0, 1.0, 2.0
SLACK = 1.5
FIG = "network and disk drills (issue 38)"
STANDBY = cq.StoreConfig(
    lease_ttl=timedelta(seconds=TTL),
    lease_renew=timedelta(seconds=RENEW),
    commit_timeout=timedelta(seconds=COMMIT_TIMEOUT),
    lock_poll=timedelta(milliseconds=200),
)

pytestmark = pytest.mark.netlab


def _unavailable(why: str) -> None:
    message = f"network lab unavailable: {why}"
    if required():
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def lab() -> Iterator[None]:
    """The namespace, the servers and the loop filesystems, removed afterwards."""
    if os.geteuid() != 0:
        _unavailable("it needs root (network namespaces, loop mounts, own servers)")
    if shutil.which("ip") is None or shutil.which("pg_createcluster") is None:
        _unavailable("ip (iproute2) and PostgreSQL's server tools are needed")
    try:
        up = subprocess.run(
            [str(SCRIPT), "setup"], capture_output=True, text=True, timeout=180, check=False
        )
        if up.returncode != 0:
            _unavailable(f"scripts/netlab setup failed:\n{up.stderr[-3000:]}")
        yield
    finally:
        _link(up=True)
        subprocess.run([str(SCRIPT), "clean"], timeout=120, check=False)


def _link(*, up: bool) -> None:
    subprocess.run(["ip", "link", "set", HOST_DEV, "up" if up else "down"], check=False, timeout=10)


def _url(dialect: str, host: str, database: str = "") -> URL:
    if dialect == "postgresql":
        return make_url(f"postgresql+psycopg://postgres@{host}:{PORTS[dialect]}/{database}")
    return make_url(f"mysql+pymysql://cq@{host}:{PORTS[dialect]}/{database}")


@contextlib.contextmanager
def _database(dialect: str, tablespace: str | None = None) -> Iterator[str]:
    """A fresh database on the lab's own server, dropped afterwards."""
    admin_db = "postgres" if dialect == "postgresql" else ""
    admin = create_engine(_url(dialect, "127.0.0.1", admin_db), isolation_level="AUTOCOMMIT")
    where = f" TABLESPACE {tablespace}" if tablespace else ""
    try:
        with created(admin, dialect, "cqnet", where) as name:
            yield name
    finally:
        admin.dispose()


class Leader:
    """The leader process inside the namespace, and the events it prints."""

    def __init__(self, url: URL, face: str = "sync") -> None:
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", NS, sys.executable, str(LEADER),
             url.render_as_string(hide_password=False), *(["async"] if face == "async" else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )  # fmt: skip
        self.events: list[dict[str, Any]] = []
        self._new: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                self._new.put(json.loads(line))

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def wait(self, pred: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any]:
        """The first event (seen or to come) for which `pred` holds, waiting up to `timeout`."""
        for event in self.events:
            if pred(event):
                return event
        end = time.monotonic() + timeout
        while True:
            try:
                event = self._new.get(timeout=min(0.5, max(0.0, end - time.monotonic())))
            except queue.Empty:
                if self.proc.poll() is not None and self._new.empty():
                    raise AssertionError(f"the leader exited: {self.events}") from None
                if time.monotonic() >= end:
                    raise AssertionError(
                        f"no such event within {timeout} s: {self.events}"
                    ) from None
                continue
            self.events.append(event)
            if pred(event):
                return event

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.kill()
        self.proc.wait(timeout=10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


def _ev(name: str) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e.get("ev") == name


def _stored_ids(url: URL) -> set[int]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return {int(r[0]) for r in conn.execute(select(tasks.c.id))}
    finally:
        engine.dispose()


ROUNDS = [
    *(("sync", phase) for phase in ("idle", "commit", "renew")),
    ("async", "commit"),
    ("async", "renew"),
    pytest.param("async", "idle", marks=pytest.mark.soak),
    *(pytest.param("sync", phase, marks=pytest.mark.soak) for phase in ("idle", "commit") * 5),
]
"""Every phase on the sync face, the asyncio face's mid-commit and between-renewals cuts; its
idle cut and five more rounds of the sync face's idle and mid-commit cuts behind `--soak`
(the default run stays under two minutes)."""


@pytest.mark.parametrize(("face", "phase"), ROUNDS)
@pytest.mark.parametrize("dialect", ["postgresql", "mariadb"])
def test_silent_cut(lab: None, dialect: str, face: str, phase: str) -> None:
    """A silent cut while the leader is idle (its next commit must first find out), in the
    middle of back-to-back commits, or between renewals only."""
    with _database(dialect) as name:
        outside = _url(dialect, "127.0.0.1", name)
        with cq.SqlStore.open(outside, STANDBY) as standby:  # migrates
            leader = Leader(_url(dialect, HOST_IP, name), face)
            try:
                _round(leader, standby, outside, f"{dialect} {face}", phase)
            finally:
                _link(up=True)
                leader.stop()


def _round(leader: Leader, standby: cq.SqlStore, outside: URL, dialect: str, phase: str) -> None:
    leader.wait(_ev("acquired"), 60)
    for _ in range(3):
        leader.send("commit")
    leader.wait(lambda e: e.get("ev") == "ack" and e["id"] == 3, 20)
    if phase == "idle":
        time.sleep(1.5)  # idle past PING_IDLE: the next commit pings its connection first
    elif phase == "commit":
        leader.send("loop")
        leader.wait(lambda e: e.get("ev") == "ack" and e["id"] == 10, 20)
    else:
        time.sleep(1.3)  # between renewals: the keeper meets the cut on its own
    cut = time.monotonic()
    _link(up=False)
    if phase == "idle":
        leader.send("commit")
    led: dict[str, Any] = {}

    def take_over() -> None:
        led["epoch"] = standby.acquire_leadership(timeout=30)
        led["t"] = time.monotonic()
        led["live"] = {t.id for t in standby.recover(BASE).tasks}

    taker = threading.Thread(target=take_over)
    taker.start()
    lost = leader.wait(_ev("lost"), 30)
    acquire = None
    if phase == "renew":
        leader.send("acquire")  # still cut off
        acquire = leader.wait(_ev("acquire"), 30)
    taker.join(30)
    assert "t" in led, "the standby did not take over"
    _link(up=True)
    leader.send("report")
    report = leader.wait(_ev("report"), 30)

    errors = [e for e in leader.events if e.get("ev") == "err"]
    commits = [e for e in leader.events if e.get("ev") in ("ack", "err")]
    worst_commit = max(e["end"] - e["start"] for e in commits)
    after_cut = [e for e in errors if e["end"] > cut]
    fig = figures(FIG)
    key = f"{dialect} cut {phase}"
    fig.setdefault(key, []).append(
        {
            "commit_worst_s": round(worst_commit, 2),
            "lost_after_s": round(lost["t"] - cut, 2),
            "standby_led_after_s": round(led["t"] - cut, 2),
            "stall_s": round(report["stall"], 2),
            "acquire_cut_s": None if acquire is None else round(acquire["took"], 2),
            "acked": len(report["acked"]),
        }
    )
    # Every commit returned within its bound, and one cut off says what is known.
    assert worst_commit <= COMMIT_TIMEOUT + SLACK, commits
    if phase != "renew":
        assert after_cut, f"no commit met the cut: {leader.events}"
    for e in after_cut:
        assert "synchronous standby" not in e["msg"], e
        assert e["type"] in ("StoreUnavailable", "Fenced"), e
    # The keeper stepped down on its own clock.
    assert lost["t"] - cut <= TTL + RENEW + SLACK, (lost, cut)
    assert report["stall"] <= SLACK, report
    assert led["t"] - cut <= 2 * TTL + 1.0, (led, cut)
    if acquire is not None:
        assert not acquire["ok"]
        assert acquire["took"] <= 2.5, acquire
    # 0 acknowledged lost, 0 stale writes: what the old leader has in the database is what
    # the standby found when it took over.
    stored = _stored_ids(outside)
    assert set(report["acked"]) <= stored
    assert stored <= led["live"], stored - led["live"]


@pytest.mark.soak
@pytest.mark.parametrize("dialect", ["postgresql", "mariadb"])
def test_open_while_cut_off_keeps_its_connect_bound(lab: None, dialect: str) -> None:
    """`SqlStore.open` of a server cut off silently gives up within the connect timeout
    (`execution.CONNECT_TIMEOUT`, 10 s) and says the server cannot be reached."""
    with _database(dialect) as name:
        url = _url(dialect, HOST_IP, name).render_as_string(hide_password=False)
        code = (
            "import time, json; from cronoq_store import SqlStore, StoreUnavailable\n"
            "t = time.monotonic()\n"
            "try:\n"
            f"    SqlStore.open({url!r}); ok = True\n"
            "except StoreUnavailable as e:\n"
            "    ok = str(e)\n"
            "print(json.dumps([time.monotonic() - t, ok]))\n"
        )
        _link(up=False)
        try:
            ran = subprocess.run(
                ["ip", "netns", "exec", NS, sys.executable, "-c", code],
                capture_output=True, text=True, timeout=60, check=True,
            )  # fmt: skip
        finally:
            _link(up=True)
    took, outcome = json.loads(ran.stdout)
    figures(FIG)[f"{dialect} open while cut off"] = {"took_s": round(took, 2), "error": outcome}
    assert outcome is not True
    assert took <= 10 + SLACK, took


# Latency: an order-preserving TCP proxy adding a delay each way.


class LatencyProxy:
    """Forwards 127.0.0.1:<port> to `target`, each chunk delayed by `delay` seconds one way,
    in order (no netem on this kernel). `close` ends every connection and the loop."""

    def __init__(self, target: tuple[str, int], delay: float) -> None:
        self.target, self.delay = target, delay
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self._server = self.loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0)
        )
        self.port = self._server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self._writers.add(up_writer)
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        chunks: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while True:
                due, data = await chunks.get()
                await asyncio.sleep(max(0.0, due - self.loop.time()))
                if not data:
                    writer.close()
                    return
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(send())
        self._tasks.add(sender)
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                chunks.put_nowait((self.loop.time() + self.delay, data))
        chunks.put_nowait((self.loop.time() + self.delay, b""))
        with contextlib.suppress(ConnectionError):
            await sender

    async def _shutdown(self) -> None:
        self._server.close()
        for task in self._tasks:
            task.cancel()
        for writer in self._writers:
            writer.close()
        for writer in self._writers:
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@pytest.mark.parametrize("dialect", ["postgresql", "mariadb"])
def test_acquire_at_latency_keeps_its_timeout(lab: None, dialect: str) -> None:
    """At 100 ms of round trip, acquire_leadership(timeout=1) returns within 2.5 s, led or
    not (connecting and each round trip count against its timeout)."""
    with _database(dialect) as name:
        cq.SqlStore.open(_url(dialect, "127.0.0.1", name), STANDBY).close()  # migrated
        proxy = LatencyProxy(("127.0.0.1", PORTS[dialect]), 0.05)
        try:
            slow = _url(dialect, "127.0.0.1", name).set(port=proxy.port)
            config = cq.StoreConfig(
                lease_ttl=timedelta(seconds=TTL),
                lease_renew=timedelta(seconds=RENEW),
                migrate=False,
            )
            store = cq.SqlStore.open(slow, config)
            try:
                tries = []
                for _ in range(3):
                    started = time.monotonic()
                    ok = True
                    try:
                        store.acquire_leadership(timeout=1)
                    except cq.StoreUnavailable:
                        ok = False
                    tries.append((round(time.monotonic() - started, 2), ok))
                    store.release_leadership()
            finally:
                store.close()
        finally:
            proxy.close()
    figures(FIG)[f"{dialect} acquire(timeout=1) at 100 ms RTT"] = tries
    assert all(took <= 2.5 for took, _ in tries), tries


# Full disks: small loop filesystems.


def _fill(directory: Path, leave: int) -> Path:
    """Fill `directory`'s filesystem but for `leave` bytes; the file that holds the space."""
    ballast = directory / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        stat = os.statvfs(directory)
        size = max(0, stat.f_bavail * stat.f_frsize - leave)
        while size > 0:
            size -= os.write(fd, b"\0" * min(size, 1 << 20))
        os.fsync(fd)
    finally:
        os.close(fd)
    return ballast


def test_full_disk_sqlite(lab: None) -> None:
    """SQLite on a full filesystem: a commit fails with StoreUnavailable naming the full
    disk, no take succeeds meanwhile (so no epoch is burnt), and once space is freed the same
    batch lands."""
    directory = Path("/var/tmp/cqnet-sqlite") / uuid.uuid4().hex[:8]
    directory.mkdir()
    try:
        _full_disk_round(str(directory / "cq.db"), directory, "sqlite")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_full_disk_postgresql(lab: None) -> None:
    """PostgreSQL whose database lives in a tablespace on a full filesystem: the same."""
    with _database("postgresql", tablespace="cqnet_full") as name:
        url = _url("postgresql", "127.0.0.1", name)
        _full_disk_round(url, Path("/var/tmp/cqnet-pgfull"), "postgresql")


def _full_disk_round(target: Any, directory: Path, dialect: str) -> None:
    config = cq.StoreConfig(lease_ttl=timedelta(seconds=TTL), lease_renew=timedelta(seconds=RENEW))
    spec = cq.TaskSpec(payload=os.urandom(4000))
    with cq.SqlStore.open(target, config) as store:
        epoch = store.acquire_leadership(timeout=10)
        ballast = _fill(directory, leave=2 << 20)
        try:
            failure: cq.StoreError | None = None
            for n in range(1, 200):  # 200 KB batches until one finds the disk full
                batch = [cq.Submitted(id=cq.TaskId(n * 100 + i), seq=n, arrival=n, spec=spec)
                         for i in range(50)]  # fmt: skip
                try:
                    store.commit(epoch, BASE, batch)
                except cq.StoreError as exc:
                    failure = exc
                    break
            assert failure is not None, "the disk never filled"
            assert isinstance(failure, cq.StoreUnavailable), failure
            assert "disk is full" in str(failure), failure
            # No take on a database that cannot commit: no epoch burnt.
            before = _epoch_now(store)
            for _ in range(3):
                with pytest.raises(cq.StoreUnavailable, match="disk is full"):
                    store.acquire_leadership(timeout=1)
            assert _epoch_now(store) == before
        finally:
            ballast.unlink()
        epoch = store.acquire_leadership(timeout=10)
        assert epoch == before + 1
        store.commit(epoch, BASE, batch)  # the same batch, once space is back
        assert store.get_task(cq.ById(id=batch[-1].id)) is not None
        figures(FIG)[f"{dialect} full disk"] = {"batches_before_full": n - 1, "error": str(failure)}


def _epoch_now(store: cq.SqlStore) -> int:
    from cronoq_store.schema import leader

    with store.engine.connect() as conn:
        return int(conn.execute(select(leader.c.epoch)).scalar_one())
