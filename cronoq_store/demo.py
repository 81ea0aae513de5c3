"""A failover demonstration on a SQLite file, with real processes and a check at the end.

`run` starts a workload leader (`python -m cronoq_store.testing drive`) and two standbys,
kills the leader with SIGKILL in the middle of its commits, lets a standby take over and
recover, then shows fencing: the new leader is stopped (SIGSTOP) past its lease, the other
standby takes over, and when the stopped one resumes its next commit is rejected with
`Fenced`. Meanwhile an app process enqueues tasks into the inbox in its own transactions
(a quarter rolled back), which the leaders drain. Finally the database is checked against the
log of acknowledged batches (`cronoq_store.testing.check`) and SQLite's
`PRAGMA integrity_check`. `format_report` renders the `DemoReport`.

It takes a few seconds with the default one-second lease (bounded by `timeout`).
"""

from __future__ import annotations

__all__ = [
    "DemoReport",
    "format_report",
    "run",
]

import os
import signal
import sqlite3
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from .store import SqlStore, StoreConfig
from .testing import DriverProcess, DriverProcessError, check, enqueuer_argv


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoReport:
    """What the demonstration did and found."""

    path: str
    """The SQLite file."""
    ttl_s: float
    """The lease TTL the processes used."""
    lock_poll_s: float
    """How often a standby checked the lease."""
    tasks_committed: int
    """Tasks in acknowledged batches, over all leaders."""
    batches_committed: int
    """Acknowledged batches, over all leaders."""
    acked_mutations: int
    """Mutations in acknowledged batches, over all leaders."""
    epochs: list[int]
    """Fencing epochs of the leaders, in order."""
    takeover_s: float
    """From the SIGKILL of the leader to a standby leading."""
    tasks_recovered: int
    """Live tasks the new leader recovered when it took over."""
    finished_recovered: int
    """Finished tasks (within retention) the new leader recovered."""
    paused_s: float
    """How long the second leader was stopped (SIGSTOP)."""
    fenced_commits: int
    """Commits of the resumed old leader rejected with `Fenced`."""
    old_leader_saw_loss: bool
    """Whether the resumed old leader reported its leadership lost."""
    acked_mutations_lost: int
    """Acknowledged mutations the check found missing (must be 0)."""
    partial_batches: int
    """Batches the check found partly visible (must be 0)."""
    integrity: str
    """SQLite's `PRAGMA integrity_check` result ("ok")."""
    elapsed_s: float
    """How long the whole demonstration took, in seconds."""
    check: dict[str, Any] = field(default_factory=dict)
    """The checker's full summary."""
    enqueues_committed: int = 0
    """Inbox items the app process committed (the checker counts the rest below from it)."""
    enqueues_rolled_back: int = 0
    """Inbox items the app process enqueued and then rolled back (none may become a task)."""
    inbox_tasks: int = 0
    """Tasks the leaders made from inbox items."""
    engine: dict[str, Any] = field(default_factory=dict)
    """What the example engine loop (docs/engine.md) did in its term at the end: `epoch`,
    `drained`, `succeeded`, `retried`, `fired`, `failed`, `lost`."""

    @property
    def inbox_exactly_once(self) -> bool:
        """Every committed enqueue became exactly one task; none from a rollback."""
        c = self.check
        return (
            self.inbox_tasks == self.enqueues_committed
            and c.get("inbox_drops") == c.get("inbox_waiting") == c.get("enqueued_unknown") == 0
            and c.get("inbox_duplicates") == c.get("inbox_lost") == 0
            and c.get("inbox_from_rolled_back") == 0
        )

    @property
    def ok(self) -> bool:
        """Nothing lost or partial, at least one commit fenced, and both checks passed."""
        return (
            self.inbox_exactly_once
            and self.enqueues_committed > 0
            and self.acked_mutations_lost == 0
            and self.partial_batches == 0
            and self.fenced_commits >= 1
            and self.integrity == "ok"
            and bool(self.check.get("ok"))
            and self.engine_ran
        )

    @property
    def engine_ran(self) -> bool:
        """The engine loop drained, retried, succeeded and fired its schedule, and stopped
        by itself (not fenced)."""
        e = self.engine
        return (
            e.get("drained", 0) >= len(ENGINE_TASKS)
            and e.get("retried", 0) >= 1
            and e.get("succeeded", 0) >= len(ENGINE_TASKS)
            and e.get("fired", 0) >= 2
            and e.get("lost") is None
        )


DEMO_APPLICATION_ID: Final = 0x63716D6F  # "cqmo"
"""SQLite's `PRAGMA application_id` of a demo's database: only such a file is overwritten."""


def is_demo_database(path: Path) -> bool:
    """Whether `path` is a SQLite database that a demo made (it carries the demo's mark)."""
    try:
        with path.open("rb") as f:
            header = f.read(100)
    except OSError:
        return False
    # The header: "SQLite format 3\0", and the application id at offset 68 (big-endian).
    return header[:16] == b"SQLite format 3\x00" and header[68:72] == DEMO_APPLICATION_ID.to_bytes(
        4, "big"
    )


def _fresh(path: Path, overwrite: bool) -> Path:
    """Clear the way for a new demo at `path` and mark its database as a demo's; its log."""
    log = path.with_name(path.name + ".acks.jsonl")
    files = [path, Path(f"{path}-wal"), Path(f"{path}-shm"), log]
    existing = [f for f in files if f.exists()]
    if existing and not overwrite:
        raise FileExistsError(
            f"{existing[0]} exists: the demo writes a workload of its own; "
            "pass a new path (or overwrite=True)"
        )
    if path.exists() and not is_demo_database(path):
        raise FileExistsError(
            f"{path} is not a database the demo made: it is never overwritten; pass a new path"
        )
    for f in existing:
        f.unlink()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # private, as its files are
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    conn = sqlite3.connect(path)
    try:
        conn.execute(f"PRAGMA application_id = {DEMO_APPLICATION_ID}")
        conn.commit()
    finally:
        conn.close()
    return log


def _first_leading(
    procs: list[DriverProcess], marks: list[int], timeout: float
) -> tuple[DriverProcess, dict[str, Any]]:
    """The process that reported `leading` first after its mark, and that event."""
    deadline = time.monotonic() + timeout
    while True:
        found = [
            (e["t"], i, e)
            for i, (p, m) in enumerate(zip(procs, marks, strict=True))
            for e in p.since(m, "leading")[:1]
        ]
        if found:
            _, i, event = min(found, key=lambda x: (x[0], x[1]))
            return procs[i], event
        if time.monotonic() > deadline:
            raise DriverProcessError(f"no standby took over within {timeout} s")
        time.sleep(0.01)


def run(
    path: str | os.PathLike[str],
    *,
    ttl: float = 1.0,
    poll: float = 0.1,
    warmup: float = 1.5,
    timeout: float = 30.0,
    overwrite: bool = False,
    python: str = sys.executable,
) -> DemoReport:
    """Run the demonstration on a new SQLite file at `path`.

    Args:
        path: The SQLite file to create (with its acknowledgement log beside it).
        ttl: The lease TTL of the demo's processes, in seconds.
        poll: How often the standbys look at the lease, in seconds.
        warmup: How long the first leader commits before it is killed, in seconds.
        timeout: The bound on each step that waits for a process (start-up included).
        overwrite: Replace an earlier demo's files at `path` (never another database).
        python: The interpreter that runs the demo's processes.

    Returns:
        What happened, and whether the conformance check passed (`DemoReport.ok`).

    Raises:
        FileExistsError: `path` exists and is not an earlier demo's (or `overwrite` is off).
        DriverProcessError: A process did not report a step within `timeout`, or exited
            first (`cronoq_store.testing`).
    """
    began = time.monotonic()
    db = Path(path).absolute()
    log = _fresh(db, overwrite)
    procs: list[DriverProcess] = []

    def start(name: str) -> DriverProcess:
        proc = DriverProcess(
            db,
            log,
            name=name,
            ttl=ttl,
            renew=ttl / 4,
            poll=poll,
            gap=0.02,
            duration=4 * timeout,
            stderr_path=db.with_name(f"{db.name}.{name}.log"),
            python=python,
        )
        procs.append(proc)
        return proc

    try:
        # 1. A leader commits; a standby waits.
        first = start("leader")
        _, lead1 = first.wait("leading", timeout=timeout)
        app = DriverProcess(  # enqueues throughout, in transactions, some rolled back
            db,
            log,
            name="app",
            argv=enqueuer_argv(db, log, rollback=0.25, keyed=0.0, python=python),
            stderr_path=db.with_name(f"{db.name}.app.log"),
        )
        procs.append(app)
        standby = start("standby")
        standby.wait("standby", timeout=timeout)
        left = lead1["t"] + warmup - time.time()
        if left > 0:
            time.sleep(left)  # the designed run time of the first leader
        first.wait("ack", timeout=timeout)

        # 2. SIGKILL it mid-run: a standby takes over once the lease runs out, and recovers.
        #    (A third process starts meanwhile; whichever standby polls first leads.)
        waiting = [standby, start("third")]
        marks = [p.mark() for p in waiting]
        killed_at = first.kill()
        second, lead2 = _first_leading(waiting, marks, timeout)
        takeover = lead2["t"] - killed_at
        second.wait("ack", timeout=timeout, where=lambda e: e["epoch"] == lead2["epoch"])

        # 3. Fencing: stop the new leader past its lease; the other process takes over; when
        #    the stopped one resumes, its next commit is fenced.
        other = waiting[1] if second is waiting[0] else waiting[0]
        other.wait("standby", timeout=timeout)
        mark = second.mark()
        second.signal(signal.SIGUSR1)  # it SIGSTOPs itself, holding no connection
        i_pause, pausing = second.wait("pausing", start=mark, timeout=timeout)
        second.wait_stopped()
        _, lead3 = _first_leading([other], [0], timeout)
        other.wait("ack", timeout=timeout, where=lambda e: e["epoch"] == lead3["epoch"])
        left = pausing["t"] + 1.5 * ttl - time.time()
        if left > 0:
            time.sleep(left)  # the designed pause: 1.5 x TTL
        second.signal(signal.SIGCONT)
        resumed = time.time()
        second.wait("fenced", start=i_pause, timeout=timeout)
        try:
            second.wait("leadership_lost", start=i_pause, timeout=5)
            saw_loss = True
        except AssertionError:
            saw_loss = False

        app.stop(timeout=timeout)
        with SqlStore.open(db, StoreConfig(migrate=False)) as store:
            deadline = time.monotonic() + timeout
            while store.read_inbox(limit=1) and time.monotonic() < deadline:
                time.sleep(0.05)  # the leader drains what the app left
        # The standby first: stopped after the leader, it would take the lease released at
        # the leader's stop, and `status` would then show an epoch the report never did.
        summaries = [p.stop(timeout=timeout) for p in (second, other)]
        fenced = summaries[0]["fenced"]
    finally:
        for p in procs:
            p.close()

    with SqlStore.open(db, StoreConfig(migrate=False)) as store:
        report = check(store, log)
    conn = sqlite3.connect(db)
    try:
        integrity = str(conn.execute("PRAGMA integrity_check").fetchone()[0])
    finally:
        conn.close()
    acked_tasks = sum(len(e["ids"]) for p in procs for e in p.since(0, "ack"))
    engine = _engine_term(db, timeout)
    return DemoReport(
        path=str(db),
        ttl_s=ttl,
        lock_poll_s=poll,
        tasks_committed=acked_tasks,
        batches_committed=report.acked_batches,
        acked_mutations=report.acked_mutations,
        epochs=[int(lead1["epoch"]), int(lead2["epoch"]), int(lead3["epoch"]), engine["epoch"]],
        takeover_s=round(takeover, 3),
        tasks_recovered=int(lead2["recovered_tasks"]),
        finished_recovered=int(lead2["recovered_terminal"]),
        paused_s=round(resumed - pausing["t"], 3),
        fenced_commits=int(fenced),
        old_leader_saw_loss=saw_loss,
        acked_mutations_lost=len(report.lost),
        partial_batches=len(report.partial),
        integrity=integrity,
        elapsed_s=round(time.monotonic() - began, 1),
        check=report.as_dict(),
        enqueues_committed=report.enqueued_committed,
        enqueues_rolled_back=report.enqueued_rolled_back,
        inbox_tasks=report.inbox_tasks,
        engine=engine,
    )


ENGINE_TASKS: Final = (b"resize 1.png", b"resize 2.png", b"flaky upload")
"""What an app enqueues for the engine loop's term; the upload fails once, then succeeds."""


def _engine_term(db: Path, timeout: float) -> dict[str, Any]:
    """One term of the example engine loop (`cronoq_store.examples.engine`, the code of
    docs/engine.md) on the demo's database, once the failover drill is checked: an app
    enqueues three tasks, the engine drains them, retries the one that fails once, fires a
    schedule every 100 ms, and releases the lease when stopped."""
    from .examples.engine import Engine
    from .inbox import enqueue_many
    from .model import RecurringSpec, RetryPolicy, TaskSpec

    failed_once: set[bytes] = set()

    def upload(payload: bytes) -> bytes:
        if payload not in failed_once:
            failed_once.add(payload)
            raise ConnectionError("upload refused; retried after a backoff")
        return b"stored " + payload

    retry = RetryPolicy(max_attempts=3, initial_backoff_ns=50_000_000)
    tick = RecurringSpec(
        name="demo-tick", template=TaskSpec(payload=b"tick", kind="echo"), interval_ns=10**8
    )
    with SqlStore.open(db, StoreConfig(migrate=False)) as store:
        with store.engine.begin() as conn:  # the app's own transaction
            enqueue_many(
                conn,
                [
                    TaskSpec(payload=p, kind="upload" if b"upload" in p else "echo", retry=retry)
                    for p in ENGINE_TASKS
                ],
            )
        engine = Engine(
            store, {"echo": lambda p: p, "upload": upload}, schedules=[tick], idle_wait=0.05
        )
        stop = threading.Event()
        stats: list[Any] = []
        thread = threading.Thread(target=lambda: stats.append(engine.run(stop)), daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and thread.is_alive():
            s = engine.stats
            if s.succeeded >= len(ENGINE_TASKS) and s.fired >= 2 and s.retried >= 1:
                break
            time.sleep(0.02)
        stop.set()
        thread.join(timeout)
    done = stats[0] if stats else engine.stats
    keys = ("epoch", "drained", "succeeded", "retried", "fired", "failed", "lost")
    return {k: getattr(done, k) for k in keys}


def format_report(report: DemoReport) -> str:
    """The report as a few lines of text.

    Args:
        report: What `run` returned.

    Returns:
        The lines `cronoq-store demo` prints, joined by newlines.
    """
    epochs = " -> ".join(str(e) for e in report.epochs)
    lines = [
        f"cronoq-store failover demo on {report.path}",
        f"  lease            TTL {report.ttl_s:g} s, standbys poll every {report.lock_poll_s:g} s",
        f"  committed        {report.tasks_committed} tasks in {report.batches_committed} "
        f"batches ({report.acked_mutations} mutations), each acknowledged after an fsynced log",
        f"  leader killed    SIGKILL mid-run; a standby led {report.takeover_s:.2f} s later "
        f"({report.takeover_s / report.ttl_s:.2f} x TTL)",
        f"  recovered        {report.tasks_recovered} live tasks, "
        f"{report.finished_recovered} finished ones",
        f"  fencing          new leader stopped {report.paused_s:.2f} s, the other standby "
        f"took over; on resuming, {report.fenced_commits} commit(s) rejected with Fenced, "
        f"leadership loss {'reported' if report.old_leader_saw_loss else 'NOT reported'}",
        f"  epochs           {epochs}",
        f"  inbox            an app enqueued throughout: {report.enqueues_committed} committed, "
        f"{report.enqueues_rolled_back} rolled back; {report.inbox_tasks} tasks made",
        "                   "
        + (
            "every committed enqueue became exactly one task; "
            f"{report.check.get('inbox_from_rolled_back', '?')} from rolled-back transactions"
            if report.inbox_exactly_once
            else f"NOT exactly once: {report.check}"
        ),
        f"  engine loop      the example engine (docs/engine.md) led epoch "
        f"{report.engine.get('epoch')}: drained {report.engine.get('drained')} inbox items, "
        f"{report.engine.get('succeeded')} tasks succeeded ({report.engine.get('retried')} "
        f"retried after a backoff), schedule fired {report.engine.get('fired')} times",
        f"  checked          {report.acked_mutations_lost} acknowledged mutations lost, "
        f"{report.partial_batches} partial batches, integrity {report.integrity}",
        f"  result           {'OK' if report.ok else 'FAILED'} in {report.elapsed_s:g} s",
    ]
    return "\n".join(lines)
