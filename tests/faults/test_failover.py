"""Leadership under real process faults, on every dialect.

Every leader and standby here is a real process (`python -m cronoq_store.testing drive`) that
commits a logged workload; the test pauses (SIGSTOP), kills (SIGKILL, also inside a commit) and
stops them, and afterwards `cronoq_store.testing.check` compares the database with the log of
acknowledged batches: nothing acknowledged is lost, no batch is partial, no fenced write landed.

Figures (failovers by fault kind, fenced commits, acknowledged mutations lost, worst takeover
time against the TTL) are printed in the terminal summary and written to
`$CRONOQ_FAILOVER_SUMMARY` (default /tmp/cronoq_failover_summary.json).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from drills import (
    EVENT_TIMEOUT,
    POLL,
    TAKEOVER_BOUND,
    TTL,
    Driver,
    Event,
    Spawn,
    first_to_lead,
    roles,
)
from figures import figures, rounds
from sqlalchemy import URL, select

from cronoq_store import ById, SqlStore, StoreConfig, TaskId
from cronoq_store.demo import format_report
from cronoq_store.demo import run as run_demo
from cronoq_store.schema import leader as leader_table
from cronoq_store.testing import CheckReport, HangPoint, check

SUMMARY_PATH = Path(os.environ.get("CRONOQ_FAILOVER_SUMMARY", "/tmp/cronoq_failover_summary.json"))
ROOT = Path(__file__).resolve().parents[2]


# Per-dialect figures, printed at the end of the session.

_FIGURES: dict[str, dict[str, Any]] = figures("cronoq failover figures", SUMMARY_PATH)


def _figures(dialect: str) -> dict[str, Any]:
    return _FIGURES.setdefault(
        dialect,
        {
            "ttl_s": TTL,
            "lock_poll_s": POLL,
            "failovers": {},
            "fenced_commits_rejected": 0,
            "fenced_by_database": 0,
            "fenced_after_loss_noticed": 0,
            "acked_mutations_checked": 0,
            "acked_mutations_lost": 0,
            "partial_batches": 0,
            "worst_takeover_s": {},
            "worst_takeover_over_ttl": {},
            "sqlite_integrity": None,
            "seconds": {},
        },
    )


def _count(dialect: str, kind: str, n: int = 1) -> None:
    failovers = _figures(dialect)["failovers"]
    failovers[kind] = failovers.get(kind, 0) + n


def _takeover(dialect: str, kind: str, seconds: float) -> None:
    fig = _figures(dialect)
    worst = fig["worst_takeover_s"]
    worst[kind] = round(max(worst.get(kind, 0.0), seconds), 3)
    fig["worst_takeover_over_ttl"][kind] = round(worst[kind] / TTL, 2)


def _worst(dialect: str, name: str, seconds: float) -> None:
    fig = _figures(dialect)
    fig[name] = round(max(fig.get(name, 0.0), seconds), 3)


def _checked(dialect: str, report: CheckReport) -> None:
    fig = _figures(dialect)
    fig["acked_mutations_checked"] += report.acked_mutations
    fig["acked_mutations_lost"] += len(report.lost)
    fig["partial_batches"] += len(report.partial)


# Driver processes: `drills`.


def _spontaneous(dialect: str, procs: list[Driver], caused: int) -> None:
    """Record leaderships lost beyond the `caused` ones the test brought about."""
    lost = sum(len(p.since(0, "leadership_lost")) for p in procs)
    fig = _figures(dialect)
    fig["spontaneous_leadership_losses"] = fig.get("spontaneous_leadership_losses", 0) + max(
        0, lost - caused
    )


@pytest.fixture
def reader(db_url: URL) -> Iterator[Any]:
    """A store on the test database for reading (it never leads); opened after migration."""
    stores: list[SqlStore] = []
    yield _LazyStore(db_url, stores)
    for s in stores:
        s.close()


class _LazyStore:
    """Opens the store on first use, once a driver has migrated the database."""

    def __init__(self, url: URL, stores: list[SqlStore]) -> None:
        self._url = url
        self._stores = stores

    def opened(self) -> SqlStore:
        """The store itself, opened now if it is not yet."""
        if not self._stores:
            self._stores.append(SqlStore.open(self._url, StoreConfig(migrate=False)))
        return self._stores[0]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.opened(), name)


def _check(dialect: str, store: Any, log: Path) -> CheckReport:
    # The checker reads every stored spec from a `SqlStore` itself; through a stand-in it can
    # only match tasks by id, and a fenced batch whose new ids the next leader handed out again
    # (it recovered after that leader wrote) then looks visible.
    report = check(store.opened() if isinstance(store, _LazyStore) else store, log)
    _checked(dialect, report)
    assert report.ok, json.dumps(report.as_dict(), indent=1)
    assert report.acked_batches > 0
    return report


def _integrity(dialect: str, url: URL | str) -> None:
    if dialect != "sqlite":
        return
    path = str(url).split("sqlite:///", 1)[1]
    conn = sqlite3.connect(path)
    try:
        result = conn.execute("PRAGMA integrity_check").fetchall()
    finally:
        conn.close()
    _figures(dialect)["sqlite_integrity"] = result[0][0]
    assert result == [("ok",)]


def _seconds(dialect: str, test: str, began: float) -> None:
    _figures(dialect)["seconds"][test] = round(time.monotonic() - began, 1)


def _drill_end(
    dialect: str,
    drivers: Iterable[Driver],
    reader: Any,
    log: Path,
    db_url: URL,
    test: str,
    began: float,
) -> None:
    """Stop `drivers` (none may have met an error), check the database against the log and
    its integrity, and note the drill's seconds."""
    for d in drivers:
        assert d.stop()["errors"] == []
    _check(dialect, reader, log)
    _integrity(dialect, db_url)
    _seconds(dialect, test, began)


# Paused leader: SIGSTOP for 1.5 x TTL, a standby takes over, the old leader is fenced.


def _paused_rounds(
    dialect: str, db_url: URL, tmp_path: Path, spawn: Spawn, reader: Any, rounds: int
) -> None:
    began = time.monotonic()
    log = tmp_path / "acks.jsonl"
    a, b = spawn("a", db_url, log), spawn("b", db_url, log)
    for _ in range(rounds):
        leader, [standby] = roles([a, b])  # it has committed in this term
        lm, sm = leader.mark(), standby.mark()
        # SIGUSR1: the leader SIGSTOPs itself once none of its threads holds a connection, so
        # no database lock is held while it is stopped (a process stopped inside a transaction
        # blocks every other writer until it resumes: see the report).
        leader.signal(signal.SIGUSR1)
        ip, pausing = leader.wait("pausing", start=lm)
        leader.wait_stopped()
        _, lead = standby.wait("leading", start=sm, timeout=TAKEOVER_BOUND + 5)
        takeover = lead["t"] - pausing["t"]
        assert takeover <= TAKEOVER_BOUND, f"takeover took {takeover:.3f} s"
        standby.wait("ack", start=sm, where=lambda e, n=lead["epoch"]: e["epoch"] == n)
        pause_left = pausing["t"] + 1.5 * TTL - time.time()
        if pause_left > 0:
            time.sleep(pause_left)  # the designed pause: 1.5 x TTL
        leader.signal(signal.SIGCONT)
        i_fenced, fenced = leader.wait("fenced", start=ip)
        leader.wait("leadership_lost", start=ip)
        assert fenced["epoch"] < lead["epoch"]
        # Nothing the old leader committed after it was stopped, nothing of the fenced batch.
        assert leader.since(ip, "ack") == [], "the paused leader acknowledged a commit"
        for task_id in fenced["ids"]:
            assert reader.get_task(ById(id=TaskId(task_id))) is None
        leader.wait("standby", start=i_fenced)
        fig = _figures(dialect)
        fig["fenced_commits_rejected"] += 1
        fig["fenced_after_loss_noticed" if fenced["known_lost"] else "fenced_by_database"] += 1
        _count(dialect, "paused_leader")
        _takeover(dialect, "paused_leader", takeover)
    _spontaneous(dialect, [a, b], caused=rounds)
    _drill_end(dialect, (a, b), reader, log, db_url, f"paused_leader x{rounds}", began)


@pytest.mark.parametrize("rounds", rounds(20, 200, pytest.mark.slow))
def test_paused_leader_is_fenced(
    dialect: str, db_url: URL, tmp_path: Path, spawn: Spawn, reader: Any, rounds: int
) -> None:
    _paused_rounds(dialect, db_url, tmp_path, spawn, reader, rounds)


# Killed leader: SIGKILL at random points, inside a commit among them.

KILL_MODES = ("random", "in-commit", "after-commit", "random", "in-commit", "after-ack")


def _killed_rounds(
    dialect: str, db_url: URL, tmp_path: Path, spawn: Spawn, reader: Any, rounds: int
) -> None:
    began = time.monotonic()
    rng = random.Random(rounds)
    log = tmp_path / "acks.jsonl"
    # Two standbys wait at any time (the winner leads next, a new one refills), so that a
    # standby's start-up never delays a round.
    procs = [spawn(f"k{i}", db_url, log) for i in range(3)]
    everyone = list(procs)
    acked_ids: list[int] = []
    for r in range(rounds):
        mode = KILL_MODES[r % len(KILL_MODES)]
        # One leads and has committed, one stands by (the other may still be starting).
        leader, standbys = roles(procs)
        leader.wait("ack", start=leader.mark())  # batches are in flight
        if mode == "random":
            time.sleep(rng.uniform(0.0, 0.3))  # a random point of the commit loop
        else:
            mark = leader.mark()
            leader.arm(HangPoint(mode))  # hang at `mode`, to be killed there
            leader.wait("hang", start=mark, where=lambda e, m=mode: e["point"] == m)
        marks = [s.mark() for s in standbys]
        t_kill = leader.kill()
        new, lead = first_to_lead(standbys, marks, TAKEOVER_BOUND + 5)
        takeover = lead["t"] - t_kill
        assert takeover <= TAKEOVER_BOUND, f"takeover took {takeover:.3f} s after {mode}"
        acked_ids += [i for e in leader.since(0, "ack") for i in e["ids"]]
        assert lead["next_id"] > max(acked_ids), "recovered next_id below an acknowledged id"
        _, first = new.wait("ack", where=lambda e, n=lead["epoch"]: e["epoch"] == n)
        _worst(dialect, "first_commit_after_takeover_s", first["t"] - lead["t"])
        _count(dialect, f"killed_leader:{mode}")
        _takeover(dialect, "killed_leader", takeover)
        leader.close()
        procs = [p for p in procs if p is not leader] + [spawn(f"k{len(everyone)}", db_url, log)]
        everyone.append(procs[-1])
    _spontaneous(dialect, everyone, caused=0)
    _drill_end(dialect, procs, reader, log, db_url, f"killed_leader x{rounds}", began)


@pytest.mark.parametrize("rounds", rounds(8, 60, pytest.mark.slow))
def test_killed_leader_loses_nothing(
    dialect: str, db_url: URL, tmp_path: Path, spawn: Spawn, reader: Any, rounds: int
) -> None:
    _killed_rounds(dialect, db_url, tmp_path, spawn, reader, rounds)


# Release: a waiting standby takes a released lease within one poll.


def _handover_delays(a: Driver, b: Driver) -> list[float]:
    """Seconds from each release to the other process leading (a release followed by the
    releaser leading again, or by nothing yet, is no handover)."""
    events = sorted(
        [(e["t"], name, e) for name, d in (("a", a), ("b", b)) for e in list(d.events) if "t" in e],
        key=lambda x: x[0],
    )
    delays = []
    for i, (t, who, e) in enumerate(events):
        if e["event"] != "released":
            continue
        nxt = next((x for x in events[i + 1 :] if x[2]["event"] == "leading"), None)
        if nxt is None or nxt[1] == who:
            continue
        delays.append(nxt[0] - t)
    return delays


def test_released_lease_taken_within_one_poll(
    dialect: str, db_url: URL, tmp_path: Path, spawn: Spawn, reader: Any
) -> None:
    began = time.monotonic()
    log = tmp_path / "acks.jsonl"
    # A term (5 batches) outlasts the rest after a release, so the other one is polling.
    turn = ["--turn-batches", "5", "--rest", "0.08"]
    a, b = spawn("a", db_url, log, *turn), spawn("b", db_url, log, *turn)
    handovers = 8
    a.wait("leading")
    b.wait("leading")
    # Waits for what it asserts: handovers to the other process. (A releaser may take its own
    # lease back after its rest when the other was slow to poll on a loaded machine; those are
    # not handovers, and waiting on leading events alone once counted them as such.)
    deadline = time.monotonic() + 2 * EVENT_TIMEOUT
    while len(_handover_delays(a, b)) < handovers:
        assert time.monotonic() < deadline, "handovers stalled"
        time.sleep(0.05)
    # What one poll costs on this database: the lease row read under its lock.
    costs = []
    for _ in range(5):
        t0 = time.monotonic()
        with reader.engine.begin() as conn:
            conn.execute(select(leader_table).with_for_update()).one()
        costs.append(time.monotonic() - t0)
    slack = 0.15 + 3 * max(costs)
    for d in (a, b):
        assert d.stop()["errors"] == []
    delays = _handover_delays(a, b)
    assert len(delays) >= handovers
    worst = max(delays)
    _figures(dialect)["release_poll_cost_s"] = round(max(costs), 4)
    _count(dialect, "released", len(delays))
    _takeover(dialect, "released", worst)
    assert worst <= POLL + slack, f"released lease taken after {worst:.3f} s ({delays})"
    _check(dialect, reader, log)
    _seconds(dialect, "released", began)


# SQLite: eight processes contending for the write lock.


@pytest.mark.sqlite
@pytest.mark.slow
def test_sqlite_eight_processes_contend(tmp_path: Path, spawn: Spawn) -> None:
    began = time.monotonic()
    db = tmp_path / "contended.db"
    url = f"sqlite:///{db}"
    log = tmp_path / "acks.jsonl"
    turn = ["--turn-batches", "4", "--rest", "0.1", "--gap", "0", "--duration", "3"]
    procs = [spawn(f"c{i}", url, log, *turn) for i in range(8)]  # all on a fresh file
    for p in procs:
        p.wait("started")
    procs[0].wait("standby")
    modes = {}
    for suffix in ("", "-wal", "-shm"):
        path = Path(f"{db}{suffix}")
        modes[suffix or "db"] = oct(path.stat().st_mode & 0o777)
    assert modes == {"db": "0o600", "-wal": "0o600", "-shm": "0o600"}, modes
    summaries = [p.wait("exit", timeout=30)[1] for p in procs]
    for p, s in zip(procs, summaries, strict=True):
        assert s["errors"] == [], p.tail()
        assert s["unavailable"] == 0, p.tail()
        assert s["busy_warnings"] == 0, p.tail()
        assert p.stderr_path is not None
        assert "locked" not in p.stderr_path.read_text(), p.tail()
    terms = sum(s["terms"] for s in summaries)
    # A leader that could not renew in time under this contention steps down (and is fenced):
    # allowed, but counted (see the report).
    fig = _figures("sqlite")
    fig["eight_process_leases_lost"] = sum(s["leadership_lost"] for s in summaries)
    fig["fenced_commits_rejected"] += sum(s["fenced"] for s in summaries)
    assert terms >= 8 and all(s["acked_batches"] > 0 for s in summaries)
    with SqlStore.open(url, StoreConfig(migrate=False)) as store:
        _check("sqlite", store, log)
    _integrity("sqlite", url)
    fig["eight_process_terms"] = terms
    fig["file_modes"] = modes
    _count("sqlite", "contended_handover", terms)
    _seconds("sqlite", "eight_processes", began)


# The demo the CLI runs.


@pytest.mark.sqlite
def test_demo(tmp_path: Path) -> None:
    # Under umask 000 (inherited by its processes) everything the demo creates is private.
    umask = os.umask(0)
    try:
        report = run_demo(tmp_path / "new" / "demo.db", ttl=TTL, poll=POLL, timeout=30)
    finally:
        os.umask(umask)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "new").iterdir()}
    assert {"demo.db", "demo.db.acks.jsonl", "demo.db.leader.log"} <= set(modes), modes
    assert set(modes.values()) == {"0o600"}, modes
    assert oct((tmp_path / "new").stat().st_mode & 0o777) == "0o700"
    text = format_report(report)
    assert report.ok, text
    assert report.acked_mutations_lost == 0 and report.partial_batches == 0
    assert report.fenced_commits >= 1 and report.old_leader_saw_loss
    # The new leader recovered what the killed one committed (live, or finished within
    # retention): a recovery that returned nothing fails here.
    assert report.tasks_committed > 0
    assert report.tasks_recovered + report.finished_recovered > 0
    assert report.epochs == sorted(set(report.epochs))
    assert report.takeover_s <= TAKEOVER_BOUND
    assert "0 acknowledged mutations lost" in text
    assert report.engine_ran and "the example engine (docs/engine.md) led epoch" in text
    assert report.enqueues_committed > 0 and report.enqueues_rolled_back > 0
    assert "every committed enqueue became exactly one task; 0 from rolled-back" in text
    with pytest.raises(FileExistsError):
        run_demo(tmp_path / "new" / "demo.db")


# A holder stopped inside a transaction that holds the leader row's lock.

WATCH = "--watch-statements"
"""The stop-in-* points watch statements at the driver (`testing.statements`); every driver
process runs on the fast path production takes (`execution.observed`)."""

IDLE_BOUND = TTL + 1.0
"""How long the server lets a stopped holder sit idle in its transaction: the lease TTL
(MariaDB: rounded up to whole seconds)."""
STOPPED_TAKEOVER_BOUND = IDLE_BOUND + TAKEOVER_BOUND + 3.0
"""A standby leads within this long of a holder stopping inside its transaction (the server
ends the session after the TTL; the lease it wrote rolls back). Without the bound it waits for
the whole stop, however long."""


def _stopped_in(
    dialect: str, point: HangPoint, holder: Driver, others: list[Driver]
) -> tuple[Driver, Event, Event]:
    """Arm `holder` to SIGSTOP itself at `point`; the other process that then leads."""
    mark = holder.mark()
    marks = [o.mark() for o in others]
    holder.arm(point)
    _, stopping = holder.wait("stopping", start=mark, where=lambda e: e["point"] == point.value)
    holder.wait_stopped()
    deadline = time.monotonic() + STOPPED_TAKEOVER_BOUND
    while True:
        led = [(o, e) for o, m in zip(others, marks, strict=True) for e in o.since(m, "leading")]
        if led:
            break
        if time.monotonic() > deadline:
            pytest.fail(
                f"{dialect}: no standby led within {STOPPED_TAKEOVER_BOUND} s of a holder "
                f"stopping at {point.value}"
            )
        time.sleep(0.01)
    new, lead = led[0]
    # The takeover happened while the old holder was still stopped, not after it resumed.
    assert holder.state() == "T", "the stopped holder was resumed before the takeover"
    assert holder.since(mark, "resumed") == [], holder.tail()
    takeover = lead["t"] - stopping["t"]
    _count(dialect, f"stopped:{point.value}")
    _takeover(dialect, f"stopped:{point.value}", takeover)
    return new, lead, stopping


@pytest.mark.parametrize(
    "point", [HangPoint.STOP_IN_RENEWAL, HangPoint.STOP_IN_COMMIT], ids=lambda p: p.value
)
@pytest.mark.parametrize(
    "dialect",
    [
        pytest.param("postgresql", marks=pytest.mark.postgresql),
        pytest.param("mysql", marks=pytest.mark.mysql),
    ],
)
def test_leader_stopped_inside_its_transaction_lets_a_standby_through(
    dialect: str, point: HangPoint, db_url: URL, tmp_path: Path, spawn: Spawn, reader: Any
) -> None:
    """A leader SIGSTOPped inside a renewal (or a commit), holding the leader row's lock:
    the server ends its session after the lease TTL, so a standby leads while it is stopped;
    resumed, it steps down and writes nothing."""
    log = tmp_path / "acks.jsonl"
    a, b = spawn("a", db_url, log, WATCH), spawn("b", db_url, log, WATCH)
    leader, [standby] = roles([a, b])
    new, lead, _ = _stopped_in(dialect, point, leader, [standby])
    assert new is standby
    new.wait("ack", where=lambda e: e["epoch"] == lead["epoch"])
    i_stop = leader.mark()
    leader.signal(signal.SIGCONT)
    leader.wait("resumed", start=i_stop)
    leader.wait("standby", start=i_stop)
    # Resumed, it finds its lease gone. (A batch it committed before it stopped may be
    # acknowledged only now; `_check` proves that whatever it acknowledged landed, and that
    # nothing it was fenced on did.)
    assert leader.since(i_stop, "leadership_lost") or leader.since(i_stop, "fenced")
    for d in (a, b):
        assert d.stop()["errors"] == []
    _check(dialect, reader, log)


@pytest.mark.parametrize(
    "dialect",
    [
        pytest.param("postgresql", marks=pytest.mark.postgresql),
        pytest.param("mysql", marks=pytest.mark.mysql),
    ],
)
def test_standby_stopped_inside_its_take_lets_a_third_through(
    dialect: str, db_url: URL, tmp_path: Path, spawn: Spawn, reader: Any
) -> None:
    """A standby SIGSTOPped right after its take UPDATE (the lease row locked, its new epoch
    not committed) holds no one off past the TTL either."""
    log = tmp_path / "acks.jsonl"
    a, b = spawn("a", db_url, log, WATCH), spawn("b", db_url, log, WATCH)
    leader, [taker] = roles([a, b])
    # The taker stops inside its take; the leader pauses holding nothing, so its lease runs out.
    mark, lm = taker.mark(), leader.mark()
    taker.arm(HangPoint.STOP_IN_TAKE)
    leader.signal(signal.SIGUSR1)
    leader.wait("pausing", start=lm)
    leader.wait_stopped()
    _, stopping = taker.wait("stopping", start=mark, timeout=STOPPED_TAKEOVER_BOUND)
    taker.wait_stopped()
    third = spawn("c", db_url, log, WATCH)  # only now: it must not be the one that takes first
    _, ready = third.wait("standby")
    deadline = time.monotonic() + STOPPED_TAKEOVER_BOUND
    while not third.since(0, "leading"):
        assert time.monotonic() < deadline, "no standby led while the taker was stopped"
        time.sleep(0.01)
    assert taker.state() == "T" and leader.state() == "T"
    lead = third.since(0, "leading")[0]
    _count(dialect, "stopped:stop-in-take")
    _takeover(dialect, "stopped:stop-in-take", lead["t"] - max(stopping["t"], ready["t"]))
    third.wait("ack", where=lambda e: e["epoch"] == lead["epoch"])
    for d in (leader, taker):
        d.signal(signal.SIGCONT)
    for d in (a, b, third):
        assert d.stop()["errors"] == []
    _check(dialect, reader, log)


@pytest.mark.slow
@pytest.mark.parametrize("dialect", [pytest.param("sqlite", marks=pytest.mark.sqlite)])
def test_sqlite_a_leader_stopped_inside_its_transaction_holds_everyone(
    db_url: URL, tmp_path: Path, spawn: Spawn, reader: Any
) -> None:
    """SQLite has no server to end a stopped writer's transaction: its write lock holds every
    standby until it resumes (docs/guarantees.md says so). Then leadership moves on."""
    log = tmp_path / "acks.jsonl"
    a, b = spawn("a", db_url, log, WATCH), spawn("b", db_url, log, WATCH)
    leader, [standby] = roles([a, b])
    mark = leader.mark()
    sm = standby.mark()
    leader.arm(HangPoint.STOP_IN_RENEWAL)
    leader.wait("stopping", start=mark)
    leader.wait_stopped()
    held = time.monotonic() + STOPPED_TAKEOVER_BOUND
    while time.monotonic() < held:  # the whole bound a server dialect meets, and more
        assert not standby.since(sm, "leading"), "a standby led past a stopped SQLite writer"
        time.sleep(0.05)
    assert leader.state() == "T"
    rm = leader.mark()
    leader.signal(signal.SIGCONT)
    # Resumed, its renewal commits and its keeper finds the TTL long gone: it steps down, and
    # one of the two leads anew (the standby may still be backing off from "locked").
    deadline = time.monotonic() + STOPPED_TAKEOVER_BOUND + 10
    while not [e for d, m in ((leader, rm), (standby, sm)) for e in d.since(m, "leading")]:
        assert time.monotonic() < deadline, "nobody led after the SQLite writer resumed"
        time.sleep(0.05)
    for d in (a, b):
        assert d.stop()["errors"] == []
    _check("sqlite", reader, log)


@pytest.mark.sqlite
def test_demo_from_the_cli_writes_its_own_file_and_status_agrees(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cronoq-store demo` without --url writes ./cronoq-demo.db (never the CLI's default
    ./cronoq.db), never overwrites a database it did not make, and `status` afterwards shows
    the last epoch the demo reported."""
    from click.testing import CliRunner

    from cronoq_store.cli import main
    from cronoq_store.demo import is_demo_database

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CRONOQ_DATABASE_URL", raising=False)
    runner = CliRunner()
    real = runner.invoke(main, ["upgrade"])  # a user's ./cronoq.db
    assert real.exit_code == 0, real.output
    before = (tmp_path / "cronoq.db").read_bytes()
    refused = runner.invoke(main, ["--url", "cronoq.db", "demo", "--overwrite"])
    assert refused.exit_code == 1 and "not a database the demo made" in refused.output
    assert (tmp_path / "cronoq.db").read_bytes() == before

    result = runner.invoke(main, ["demo", "--ttl", str(TTL)])
    assert result.exit_code == 0, result.output
    assert is_demo_database(tmp_path / "cronoq-demo.db")
    assert (tmp_path / "cronoq.db").read_bytes() == before
    epochs = [int(e) for e in result.output.split("epochs")[1].splitlines()[0].split("->")]
    assert epochs == sorted(set(epochs)) and len(epochs) == 4  # the last: the engine loop
    status = runner.invoke(main, ["--url", "cronoq-demo.db", "status", "--json"])
    assert status.exit_code == 0, status.output
    lease = json.loads(status.output)["lease"]
    assert lease["state"] == "free" and lease["epoch"] == epochs[-1], (epochs, lease)
    again = runner.invoke(main, ["demo"])  # no --overwrite: refused, nothing touched
    assert again.exit_code == 1 and "pass --overwrite" in again.output
