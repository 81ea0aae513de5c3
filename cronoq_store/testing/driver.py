"""`WorkloadDriver`: takes leadership, recovers, commits the workload's batches (draining the
inbox as an engine would) and logs each batch before and after its commit; fault injection and
the pause gate on a `SqlStore`'s engine.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sqlalchemy import event

from ..errors import Fenced, StoreError, StoreUnavailable
from ..model import (
    InboxItem,
    InboxTaken,
    Submitted,
    TaskId,
)
from ..store import SqlStore
from .acklog import AckLog
from .base import BASE, Emit, Event, Store, digest
from .config import SQL_ONLY, WATCHED, DriverConfig, HangPoint
from .statements import after_commits, after_statements
from .workload import Live, Phase, Planned, Workload

T = TypeVar("T")


@dataclass(slots=True, kw_only=True)
class DriverSummary:
    """What a driver did, printed as the `exit` event of a process."""

    run: str
    """The driver's run id, in every record it logs."""
    terms: int = 0
    """Times it became leader."""
    epochs: list[int] = field(default_factory=list)
    """The fencing epoch of each term."""
    acked_batches: int = 0
    """Batches committed and logged as acknowledged."""
    acked_mutations: int = 0
    """Mutations in those batches."""
    acked_tasks: int = 0
    """New tasks in those batches."""
    fenced: int = 0
    """Commits rejected with `Fenced`."""
    leadership_lost: int = 0
    """Terms that ended by losing the lease."""
    released: int = 0
    """Terms that ended by releasing the lease."""
    unavailable: int = 0
    """Calls (commits, recoveries, inbox reads) that raised `StoreUnavailable` and were
    retried."""
    store_warnings: int = 0
    """Records the store logged at WARNING or above (a leadership loss among them)."""
    busy_warnings: int = 0
    """Of those, the ones about a locked or busy database."""
    inbox_taken: int = 0
    """Inbox items acknowledged as tasks."""
    inbox_dropped: int = 0
    """Inbox items acknowledged as dropped (their key was live)."""
    errors: list[str] = field(default_factory=list)
    """Unexpected errors, one line each."""


class _StoreWarnings(logging.Handler):
    """Counts (and reports) what the store logs at WARNING and above, busy databases apart."""

    def __init__(self, emit: Emit, summary: DriverSummary) -> None:
        super().__init__(logging.WARNING)
        self._emit = emit
        self._summary = summary

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self._summary.store_warnings += 1
        if "locked" in message or "busy" in message:
            self._summary.busy_warnings += 1
        self._emit(
            {
                "event": "store_log",
                "level": record.levelname,
                "logger": record.name,
                "message": message,
            }
        )


class WorkloadDriver:
    """A leader (or a standby, until it leads) committing a workload and logging its acks."""

    def __init__(
        self,
        store: Store,
        log_path: str | os.PathLike[str],
        config: DriverConfig | None = None,
        *,
        emit: Emit | None = None,
        stop_event: threading.Event | None = None,
    ) -> None:
        """`emit` receives every event; setting `stop_event` stops `run` gracefully."""
        self.store = store
        """The store it drives."""
        self.config = config or DriverConfig()
        """How it behaves."""
        self.run_id = uuid.uuid4().hex[:12]
        """Names this driver in the log and in its events."""
        self.summary = DriverSummary(run=self.run_id)
        """What it did so far."""
        self._emit_fn = emit
        self._emit_lock = threading.Lock()
        self._log = AckLog(log_path)
        seed = self.config.seed if self.config.seed is not None else random.randrange(2**32)
        self.workload = Workload(random.Random(seed), self.config)
        """The generator of its batches (not part of the kit's API)."""
        self.stop_event = stop_event or threading.Event()
        """Set it to stop `run` gracefully."""
        self._pause_requested = threading.Event()
        self._hang_point: HangPoint | None = None
        self._in_commit = threading.local()
        self._gate = threading.Condition()
        self._checked_out = 0
        self._epoch: int | None = None
        self._releasing = False
        self._deadline = (
            None if self.config.duration is None else time.monotonic() + self.config.duration
        )
        store.on_leadership_lost(self._on_lost)
        if isinstance(store, SqlStore):
            self._hook(store)
        self._sql = isinstance(store, SqlStore)
        if self.config.hang_at in SQL_ONLY and not self._sql:
            raise ValueError(f"hanging {self.config.hang_at} needs a SqlStore")

    # Events.

    def emit(self, event: Event) -> None:
        """Report `event` (with the run id and a wall-clock time) to the emit callback.

        Args:
            event: The event's fields (its name under "event").
        """
        event = {"t": time.time(), **event, "run": self.run_id, "pid": os.getpid()}
        if self._emit_fn is not None:
            with self._emit_lock:
                self._emit_fn(event)

    def _on_lost(self) -> None:
        if self._releasing:
            return
        self.summary.leadership_lost += 1
        self.emit({"event": "leadership_lost", "epoch": self._epoch})

    # Fault injection and the pause gate, on the SqlStore's engine.

    def _hook(self, store: SqlStore) -> None:
        pool = store.engine.pool

        def checkout(*_args: object) -> None:
            with self._gate:
                self._checked_out += 1

        def checkin(*_args: object) -> None:
            with self._gate:
                self._checked_out = max(0, self._checked_out - 1)
                self._gate.notify_all()

        event.listen(pool, "checkout", checkout)
        event.listen(pool, "checkin", checkin)

        def before_commit(_conn: object) -> None:
            if getattr(self._in_commit, "on", False) and self._armed(HangPoint.IN_COMMIT):
                self._hang(HangPoint.IN_COMMIT)

        event.listen(store.engine, "commit", before_commit)

        def after_execute(cursor: Any, statement: str) -> None:
            """The STOP_IN_* points: right after an UPDATE of the leader row that matched (a
            commit's pipelined fence wraps it in a statement returning one row), seen at the
            driver (`testing.statements`), so on the path production runs."""
            if "cronoq_leader" not in statement or "UPDATE" not in statement:
                return
            if getattr(cursor, "rowcount", 0) != 1:
                return
            in_commit = getattr(self._in_commit, "on", False)
            renewing = threading.current_thread().name.endswith("-renew")
            if in_commit and self._armed(HangPoint.STOP_IN_COMMIT):
                self._stop_here(HangPoint.STOP_IN_COMMIT)
            elif renewing and self._armed(HangPoint.STOP_IN_RENEWAL):
                self._stop_here(HangPoint.STOP_IN_RENEWAL)
            elif not in_commit and not renewing and self._armed(HangPoint.STOP_IN_TAKE):
                self._stop_here(HangPoint.STOP_IN_TAKE)

        def after_commit(_driver_connection: Any) -> None:
            """AFTER_TX_COMMIT: a COMMIT of the commit's returned at the driver."""
            if getattr(self._in_commit, "on", False) and self._armed(HangPoint.AFTER_TX_COMMIT):
                self._hang(HangPoint.AFTER_TX_COMMIT)

        if self.config.watches_statements:
            after_statements(store.engine, after_execute)
            after_commits(store.engine, after_commit)

    def request_pause(self) -> None:
        """Stop this process (SIGSTOP) at the next point where it holds no connection."""
        self._pause_requested.set()

    def arm_hang(self, point: HangPoint | None = None) -> None:
        """Hang at `point` (default: the configured `hang_at`) the next time it is reached.

        Args:
            point: A hang point; None for the configured `hang_at`.
        """
        point = point or self.config.hang_at
        if point in SQL_ONLY and not self._sql:
            raise ValueError(f"hanging {point} needs a SqlStore")
        if point in WATCHED and not self.config.watches_statements:
            raise ValueError(f"hanging at {point} needs DriverConfig.watch_statements")
        self._hang_point = point

    def _armed(self, point: HangPoint) -> bool:
        return self._hang_point is point

    def _hang(self, point: HangPoint) -> None:
        self.emit({"event": "hang", "point": point.value, "epoch": self._epoch})
        time.sleep(60)  # waiting to be killed; a test that forgot us must not leave us behind
        os._exit(3)

    def _stop_here(self, point: HangPoint) -> None:
        """SIGSTOP this process where it stands: inside a transaction holding the leader row."""
        self._hang_point = None
        self.emit({"event": "stopping", "point": point.value, "epoch": self._epoch})
        # Sent to this very thread, so it stops here, before its next statement; a signal sent
        # to the process may be taken by another thread while this one runs on to COMMIT.
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        self.emit({"event": "resumed", "point": point.value, "epoch": self._epoch})

    def _pause(self) -> None:
        """SIGSTOP ourselves while no thread holds a connection (so no lock is held)."""
        self._pause_requested.clear()
        if isinstance(self.store, SqlStore):
            # The connection a leader keeps between its commits (this thread's, which is in
            # none now) holds nothing, but the gate counts connections: it goes back first.
            self.store.close_held_connection()
        with self._gate:
            while self._checked_out:
                self._gate.wait(0.05)
            self.emit({"event": "pausing", "epoch": self._epoch})
            os.kill(os.getpid(), signal.SIGSTOP)
        self.emit({"event": "resumed", "epoch": self._epoch})

    # The loop.

    def _expired(self) -> bool:
        if self.stop_event.is_set():
            return True
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _wait(self, seconds: float) -> None:
        if seconds > 0:
            self.stop_event.wait(seconds)

    def _retrying(self, what: str, call: Callable[[], T]) -> T:
        """`call()`, retried while it raises `StoreUnavailable`, as an engine retries a store
        that cannot be reached (a failover, a restart): every 50 ms, until it answers."""
        while True:
            try:
                return call()
            except StoreUnavailable as exc:
                self.summary.unavailable += 1
                self.emit({"event": "unavailable", "call": what, "message": str(exc)})
                self._wait(0.05)

    def lead(self) -> bool:
        """Become leader and recover; False when stopped first.

        Returns:
            True once leading with the state recovered; False when stopped first.
        """
        self.emit({"event": "standby"})
        slice_s = self.config.acquire_slice
        while True:
            if self._expired():
                return False
            if self._pause_requested.is_set():
                self._pause()
            started = time.monotonic()
            try:
                epoch = self.store.acquire_leadership(timeout=slice_s)
            except StoreUnavailable:
                continue
            t_lead = time.time()
            acquire_s = time.monotonic() - started
            break
        self._epoch = epoch
        self.summary.terms += 1
        self.summary.epochs.append(epoch)
        began = time.monotonic()
        recovered = self._retrying("recover", lambda: self.store.recover(BASE))
        self.workload.reset(recovered, epoch)
        self.workload.seq = 0
        self.emit(
            {
                "event": "leading",
                "epoch": epoch,
                "t": t_lead,
                "acquire_s": acquire_s,
                "recover_s": time.monotonic() - began,
                "next_id": int(recovered.next_id),
                "start_id": self.workload.next_id,
                "recovered_tasks": len(recovered.tasks),
                "recovered_terminal": len(recovered.terminal),
                "recovered_recurring": len(recovered.recurring),
                "lost": None
                if recovered.lost is None
                else {"epoch": recovered.lost.epoch, "commits": recovered.lost.commits},
            }
        )
        return True

    def commit_one(self) -> bool:
        """Commit, log and acknowledge one batch; False when fenced (leadership lost).

        Returns:
            True once the batch is committed and acknowledged; False when fenced.
        """
        epoch = self._epoch
        assert epoch is not None
        planned = self.workload.plan()
        taken, dropped = self._take_inbox(planned)
        self.workload.seq += 1
        seq = self.workload.seq
        # Unique even when a lossy failover grants an epoch twice: the term is this driver's.
        term = self.summary.terms
        batch_id = f"{self.run_id}:{term}:{epoch}:{seq}"
        head = {"batch": batch_id, "run": self.run_id, "epoch": epoch, "seq": seq, "term": term}
        self._log.append({"type": "intent", **head, "muts": planned.records}, sync=False)
        retried = False
        while True:
            was_leader = self.store.is_leader
            self._in_commit.on = True
            try:
                self.store.commit(epoch, BASE, planned.batch, planned.outputs)
            except Fenced as exc:
                self.summary.fenced += 1
                self._log.append({"type": "fenced", **head, "retried": retried}, sync=True)
                self.emit(
                    {
                        "event": "fenced",
                        **head,
                        "ids": planned.submitted,
                        "known_lost": not was_leader,
                        "retried": retried,
                        "message": str(exc),
                    }
                )
                self._epoch = None
                return False
            except StoreUnavailable as exc:
                self.summary.unavailable += 1
                self.emit({"event": "unavailable", **head, "message": str(exc)})
                retried = True
                self._wait(0.05)
                continue
            finally:
                self._in_commit.on = False
            break
        if self._armed(HangPoint.AFTER_COMMIT):
            self._hang(HangPoint.AFTER_COMMIT)
        self._log.append({"type": "ack", **head, "muts": planned.records}, sync=True)
        self.workload.accept(planned)
        self.summary.acked_batches += 1
        self.summary.acked_mutations += len(planned.records)
        self.summary.acked_tasks += len(planned.submitted)
        self.summary.inbox_taken += taken
        self.summary.inbox_dropped += dropped
        self.emit(
            {
                "event": "ack",
                **head,
                "n": len(planned.records),
                "ids": planned.submitted,
                "inbox": taken + dropped,
            }
        )
        if self._armed(HangPoint.AFTER_ACK):
            self._hang(HangPoint.AFTER_ACK)
        return True

    def _take_inbox(self, planned: Planned) -> tuple[int, int]:
        """Add up to `batch` inbox items to `planned`, as an engine would: each becomes a task
        committed with its `InboxTaken`, or is dropped (alone) when its key is live."""
        read: Callable[..., list[InboxItem]] | None = getattr(self.store, "read_inbox", None)
        if not self.config.inbox or read is None:
            return 0, 0
        items = self._retrying("read_inbox", lambda: read(limit=self.config.batch, base=BASE))
        live_keys = {s.key for s in planned.live.values() if s.key is not None}
        at = self.workload.now()
        taken = dropped = 0
        for item in items:
            key = item.spec.key
            if key is not None and key in live_keys:
                planned.batch.append(InboxTaken(inbox_id=item.inbox_id))
                planned.records.append(
                    {"op": "inbox_drop", "inbox_id": item.inbox_id, "digest": digest(item.spec)}
                )
                dropped += 1
                continue
            task_id = planned.next_id
            planned.next_id += 1
            planned.batch.append(
                Submitted(id=TaskId(task_id), seq=task_id, arrival=at, spec=item.spec)
            )
            planned.batch.append(InboxTaken(inbox_id=item.inbox_id))
            spec_digest = digest(item.spec)
            planned.records.append(
                {"op": "submit", "id": task_id, "key": key, "digest": spec_digest}
            )
            planned.records.append(
                {
                    "op": "inbox_taken",
                    "inbox_id": item.inbox_id,
                    "id": task_id,
                    "digest": spec_digest,
                }
            )
            planned.submitted.append(task_id)
            planned.live[task_id] = Live(phase=Phase.QUEUED, attempt=0, key=key)
            if key is not None:
                live_keys.add(key)
            taken += 1
        return taken, dropped

    def release(self) -> None:
        """Give leadership up (a standby may take over at once)."""
        epoch = self._epoch
        self._releasing = True
        try:
            self.store.release_leadership()
        finally:
            self._releasing = False
        self._epoch = None
        self.summary.released += 1
        self.emit({"event": "released", "epoch": epoch})

    def run(self) -> DriverSummary:
        """Lead and commit until stopped, the duration ran out or max_batches were acked.

        Returns:
            What this driver committed, acknowledged and saw.
        """
        handler = _StoreWarnings(self.emit, self.summary)
        store_log = logging.getLogger("cronoq_store")
        store_log.addHandler(handler)
        try:
            self._run()
        except StoreError as exc:
            self.summary.errors.append(f"{type(exc).__name__}: {exc}")
            self.emit({"event": "error", "kind": type(exc).__name__, "message": str(exc)})
            raise
        finally:
            store_log.removeHandler(handler)
            self._log.close()
        return self.summary

    def _done(self) -> bool:
        limit = self.config.max_batches
        return self._expired() or (limit is not None and self.summary.acked_batches >= limit)

    def _run(self) -> None:
        while not self._done():
            if not self.lead():
                break
            term = 0
            while not self._done():
                if self._pause_requested.is_set():
                    self._pause()
                if not self.commit_one():
                    break
                term += 1
                if self.config.turn_batches is not None and term >= self.config.turn_batches:
                    self.release()
                    self._wait(self.config.rest)
                    break
                self._wait(self.config.gap)
        if self._epoch is not None:
            self.release()
