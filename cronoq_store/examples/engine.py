"""A complete scheduler engine loop on cronoq-store's public API: the code docs/engine.md shows.

cronoq-store keeps a scheduler's durable state; the engine that decides what runs when is
yours to write. This one is small on purpose, and complete: it leads, recovers, drains the
inbox, runs tasks on a thread pool, retries failures with backoff, fires recurring schedules,
prunes, and steps down when it loses the lease. It leaves out dependencies, resources,
priorities, deadlines and fixed starts (a real engine adds them to `_ready`).

Run it: `Engine(store, handlers).run(stop)` in a thread, or `python -m cronoq_store.examples.engine
[DATABASE]`. The tests run it on SQLite, PostgreSQL and MariaDB; `cronoq-store demo` runs it
once its failover drill is done.
"""

from __future__ import annotations

import heapq
import logging
import random
import sys
import threading
import time
import zoneinfo
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from cronoq_store import (
    Fenced,
    InboxItem,
    InboxTaken,
    Mutation,
    Recovered,
    RecurringNext,
    RecurringSpec,
    RecurringUpsert,
    RetryPolicy,
    SqlStore,
    StatusChanged,
    StoreUnavailable,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    TimeBase,
)

log = logging.getLogger(__name__)

Handler = Callable[[bytes], bytes | None]
"""Runs one attempt of a task of its kind: the payload in, the output (or None) out; an
exception fails the attempt."""

SECOND_NS = 1_000_000_000
NO_RETRY = RetryPolicy(max_attempts=1)
INBOX_BATCH = 500
"""Inbox items one step drains at most."""


@dataclass(slots=True)
class Task:
    """What the engine keeps in memory of a live task (the store keeps the durable copy)."""

    id: TaskId
    spec: TaskSpec
    attempt: int = 0
    due: int = 0
    """Engine time at which it may run next (a retry's backoff pushes it out)."""
    running: bool = False


@dataclass(slots=True)
class Stats:
    """What one term of leadership did, for the demo's report and the tests."""

    epoch: int = 0
    recovered: int = 0
    drained: int = 0
    duplicates_dropped: int = 0
    fired: int = 0
    succeeded: int = 0
    retried: int = 0
    failed: int = 0
    commits: int = 0
    pruned: int = 0
    lost: str | None = None
    """Why this term ended, when it did not end by `stop`."""
    finished_ids: list[int] = field(default_factory=list)


class EngineCore:
    """What an engine decides, without I/O: the state a term rebuilds from `recover`, and
    the batch each step commits. `Engine` (threads) and `AsyncEngine` (asyncio) are the thin
    shells that read, commit, run attempts and wait around it."""

    def __init__(
        self,
        handlers: Mapping[str, Callable[[bytes], Any]],
        *,
        workers: int = 4,
        idle_wait: float = 0.2,
        prune_every: timedelta = timedelta(minutes=5),
        retention: timedelta = timedelta(hours=1),
        schedules: Sequence[RecurringSpec] = (),
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self.wanted = {spec.name: spec for spec in schedules}
        self.handlers = dict(handlers)
        self.workers = workers
        self.idle_wait = idle_wait
        self.prune_every = prune_every
        self.retention = retention
        self.clock = clock
        self.stats = Stats()
        self.base = TimeBase(unix_ns=clock())  # each term sets its own (`_begin`)
        self.done: list[tuple[Task, bytes | None, BaseException | None, int]] = []
        self.finished = threading.Condition()

    def _begin(self, epoch: int) -> None:
        """A new term: its stats, and engine time 0 at now."""
        self.stats = Stats(epoch=epoch)
        self.base = TimeBase(unix_ns=self.clock())

    def _recover(self, state: Recovered) -> None:
        """Rebuild the in-memory state from what `recover` returned: live tasks, keys,
        schedules, ids."""
        self.next_id = int(state.next_id)
        self.seq = 0
        self.live: dict[int, Task] = {}
        self.keys: dict[str, int] = {}
        for rec in state.tasks:
            # Its attempt may have been running when the last leader died: run it again.
            self.live[rec.id] = Task(id=rec.id, spec=rec.spec, attempt=rec.attempt)
            if rec.spec.key is not None:
                self.keys[rec.spec.key] = rec.id
        self.pending: list[Mutation] = []
        self.schedules: dict[str, tuple[RecurringSpec, int | None, TaskId | None]] = {}
        for r in state.recurring:
            due = r.next
            if due is None or (due < 0 and r.spec.misfire == "skip"):
                # Never fired, or it missed fire times while no engine ran and skips them.
                due = next_fire(r.spec, self.base, 0)
                self.pending.append(RecurringNext(name=r.spec.name, next=due, last=r.last))
            self.schedules[r.spec.name] = (r.spec, due, r.last)
        for spec in self.wanted.values():  # the schedules this engine was given
            if spec.name not in self.schedules or self.schedules[spec.name][0] != spec:
                self.pending.append(RecurringUpsert(spec=spec))
                due = next_fire(spec, self.base, 0)
                self.pending.append(RecurringNext(name=spec.name, next=due, last=None))
                self.schedules[spec.name] = (spec, due, None)
        self.stats.recovered = len(state.tasks)
        self.outputs: list[tuple[TaskId, bytes]] = []
        self.to_dispatch: list[Task] = []

    def _gather(self, now: int, items: Sequence[InboxItem]) -> None:
        """One step's batch, into `pending`: the inbox items read, the schedules due, the
        attempts that finished, the tasks that start now."""
        self._drain_inbox(now, items)
        self._fire_schedules(now)
        self._collect_results()
        self._start_ready(now)

    def _drain_inbox(self, now: int, items: Sequence[InboxItem]) -> None:
        """Inbox items become tasks; an item whose key is live is dropped (its InboxTaken
        alone), which is also how two items with one key in one drain are told apart."""
        for item in items:
            self.pending.append(InboxTaken(inbox_id=item.inbox_id))
            key = item.spec.key
            if key is not None and key in self.keys:
                self.stats.duplicates_dropped += 1
                continue
            self._submit(item.spec, now)
            self.stats.drained += 1

    def _submit(self, spec: TaskSpec, now: int) -> Task:
        task = Task(id=TaskId(self.next_id), spec=spec, due=now)
        self.next_id += 1
        self.seq += 1
        self.pending.append(Submitted(id=task.id, seq=self.seq, arrival=now, spec=spec))
        self.live[task.id] = task
        if spec.key is not None:
            self.keys[spec.key] = task.id
        return task

    def _fire_schedules(self, now: int) -> None:
        """Each schedule due fires its template, and its next fire time is committed with
        the task it submitted (`RecurringNext`), so a new leader neither skips nor repeats."""
        for name, (spec, due, last) in list(self.schedules.items()):
            if due is None or due > now:
                continue
            while due is not None and due <= now:
                if not (spec.overlap == "skip" and last is not None and last in self.live):
                    last = self._submit(spec.template, now).id
                    self.stats.fired += 1
                # run_all fires every time it missed; the others go on from now
                due = next_fire(spec, self.base, due if spec.misfire == "run_all" else now)
            self.pending.append(RecurringNext(name=name, next=due, last=last))
            self.schedules[name] = (spec, due, last)

    def _collect_results(self) -> None:
        """Finished attempts become transitions: success, a retry after backoff, or failure."""
        with self.finished:
            results, self.done[:] = list(self.done), []
        for task, output, error, at in results:
            task.running = False
            if error is None:
                self._finish(task, TaskStatus.SUCCEEDED, at, None)
                if output is not None:
                    self.outputs.append((task.id, output))
                self.stats.succeeded += 1
                continue
            policy = task.spec.retry or NO_RETRY
            message = f"{type(error).__name__}: {error}"
            if task.attempt < policy.max_attempts:
                task.due = at + backoff_ns(policy, task.attempt)
                self.pending.append(
                    StatusChanged(
                        id=task.id,
                        status=TaskStatus.RETRYING,
                        attempt=task.attempt,
                        at=at,
                        message=message,
                    )
                )
                self.stats.retried += 1
            else:
                self._finish(task, TaskStatus.FAILED, at, message)
                self.stats.failed += 1

    def _finish(self, task: Task, status: TaskStatus, at: int, message: str | None) -> None:
        self.pending.append(
            StatusChanged(id=task.id, status=status, attempt=task.attempt, at=at, message=message)
        )
        del self.live[task.id]
        if task.spec.key is not None and self.keys.get(task.spec.key) == task.id:
            del self.keys[task.spec.key]  # a terminal task frees its key
        self.stats.finished_ids.append(task.id)

    def _start_ready(self, now: int) -> None:
        """Tasks due now start their next attempt: RUNNING commits before they are handed
        to a worker (a task no handler knows fails at once)."""
        for task in self._ready(now):
            task.attempt += 1
            if task.spec.kind not in self.handlers:
                self._finish(
                    task, TaskStatus.FAILED, now, f"no handler for kind {task.spec.kind!r}"
                )
                self.stats.failed += 1
                continue
            task.running = True
            self.pending.append(
                StatusChanged(id=task.id, status=TaskStatus.RUNNING, attempt=task.attempt, at=now)
            )
            self.to_dispatch.append(task)

    def _ready(self, now: int) -> list[Task]:
        """What may start now, oldest first, no more than the idle workers take. Here a real
        engine applies dependencies, resources, priorities, deadlines and fixed starts."""
        due = (t for t in self.live.values() if not t.running and t.due <= now)
        return heapq.nsmallest(self._free(), due, key=lambda t: (t.due, t.id))

    def _free(self) -> int:
        """Attempts that may start: the workers, and as many again queued behind them."""
        busy = sum(t.running for t in self.live.values())  # to_dispatch: running too
        return max(0, self.workers * 2 - busy)

    def _next_wait(self) -> float:
        """Seconds until something comes due (a retry, a firing), at most `idle_wait`."""
        wait = self.idle_wait
        upcoming = [due for _, due, _ in self.schedules.values() if due is not None]
        if self._free() > 0:  # else only a finished attempt lets a due task start
            upcoming += [t.due for t in self.live.values() if not t.running]
        if upcoming:
            wait = min(wait, max(0.0, (min(upcoming) - self.now()) / SECOND_NS))
        return wait

    def _record(self, task: Task, output: bytes | None, error: BaseException | None) -> None:
        """An attempt's outcome, from whichever thread or task ran it, for the next step."""
        with self.finished:
            self.done.append((task, output, error, self.now()))
            self.finished.notify_all()

    def now(self) -> int:
        """Engine time: nanoseconds since this term's `TimeBase`."""
        return self.clock() - self.base.unix_ns


class Engine(EngineCore):
    """One scheduler engine on threads: leads, recovers, and runs the loop until stopped or
    fenced; attempts run on a thread pool."""

    def __init__(self, store: SqlStore, handlers: Mapping[str, Handler], **options: Any) -> None:
        super().__init__(handlers, **options)
        self.store = store

    # The term of leadership: lead, recover, loop, step down.

    def run(self, stop: threading.Event, *, lead_timeout: float | None = None) -> Stats:
        """Lead (blocking until this instance does), then run the loop until `stop` is set or
        leadership is lost; releases the lease when stopped. Returns what the term did."""
        lost = threading.Event()
        self.store.on_leadership_lost(lost.set)  # called from the keeper thread: just a flag
        epoch = self.store.acquire_leadership(timeout=lead_timeout)
        self._begin(epoch)  # engine time 0 is now, for this term
        self._recover(self.store.recover(self.base))
        with ThreadPoolExecutor(self.workers, thread_name_prefix="engine-worker") as pool:
            self.pool = pool
            last_prune = time.monotonic()
            while not stop.is_set() and not lost.is_set():
                try:
                    self._step(epoch)
                    if time.monotonic() - last_prune > self.prune_every.total_seconds():
                        self.stats.pruned += self.store.prune(self.retention)
                        last_prune = time.monotonic()
                except Fenced as exc:  # another instance leads: stop at once, write nothing
                    self.stats.lost = f"fenced: {exc}"
                    break
                except StoreUnavailable as exc:  # the batch is idempotent: the next step
                    log.warning("commit not known to have landed, retrying: %s", exc)
                    time.sleep(0.1)  # recommits it, with whatever came meanwhile
                    continue
                self._wait(stop, lost)
            if lost.is_set() and self.stats.lost is None:
                self.stats.lost = "leadership lost"
            # Stepping down: running attempts finish (their results are not committed: the
            # next leader recovers these tasks as live and runs them again).
            pool.shutdown(wait=True, cancel_futures=True)
        if self.store.is_leader:
            self.store.release_leadership()  # a standby takes over at once
        return self.stats

    # One step: gather a batch, commit it, then act on it.

    def _step(self, epoch: int) -> None:
        """Gather what changed into one batch, commit it, and only then dispatch: a task
        runs only once its RUNNING transition is durable, and an inbox item becomes a task
        exactly once (its `InboxTaken` commits with its `Submitted`)."""
        now = self.now()
        if not self.pending:  # after StoreUnavailable the same batch is committed again
            self._gather(now, self.store.read_inbox(limit=INBOX_BATCH, base=self.base))
        if self.pending or self.outputs:
            self.store.commit(epoch, self.base, self.pending, self.outputs)
            self.stats.commits += 1
            self.pending, self.outputs = [], []
        for task in self.to_dispatch:
            self.pool.submit(self._attempt, task).add_done_callback(self._wake)
        self.to_dispatch = []

    # The workers and the wake-ups.

    def _attempt(self, task: Task) -> None:
        """One attempt, on a worker thread: its outcome goes back to the loop."""
        output: bytes | None = None
        error: BaseException | None = None
        try:
            output = self.handlers[task.spec.kind](task.spec.payload)
        except Exception as exc:
            error = exc
        self._record(task, output, error)

    def _wake(self, _: Future[None]) -> None:
        with self.finished:
            self.finished.notify_all()

    def _wait(self, stop: threading.Event, lost: threading.Event) -> None:
        """Sleep until there is something to do: a finished attempt, an inbox item (the
        store's `wait_inbox`: a notification on PostgreSQL, a cheap probe elsewhere), a retry
        or schedule coming due, or a stop."""
        with self.finished:
            if self.done:
                return
        wait = self._next_wait()
        if wait <= 0 or stop.is_set() or lost.is_set():
            return
        if not self.store.wait_inbox(timeout=wait / 2):
            with self.finished:
                if not self.done:
                    self.finished.wait(timeout=wait / 2)


def backoff_ns(policy: RetryPolicy, attempt: int) -> int:
    """The wait before attempt `attempt + 1`: exponential from `initial_backoff_ns`, capped
    at `max_backoff_ns`, spread by `jitter`."""
    wait = min(
        policy.max_backoff_ns, policy.initial_backoff_ns * policy.multiplier ** (attempt - 1)
    )
    spread = wait * policy.jitter
    return int(wait + random.uniform(-spread, spread))


def next_fire(spec: RecurringSpec, base: TimeBase, after: int) -> int | None:
    """The schedule's first fire time after engine time `after` (None: past its `end`).

    Intervals count from `start` (engine time 0 without one). A cron expression is evaluated
    in the schedule's time zone, minute by minute (five fields: minute, hour, day of month,
    month, day of week; `*`, `*/n`, `a-b`, `a,b`); this example leaves six-field (seconds)
    expressions out.
    """
    start = spec.start if spec.start is not None else 0
    after = max(after, start - 1)
    if spec.interval_ns is not None:
        at = start + ((after - start) // spec.interval_ns + 1) * spec.interval_ns
    else:
        at = _next_cron(str(spec.cron), spec.timezone, base, after)
    return None if spec.end is not None and at > spec.end else at


def _field(text: str, lo: int, hi: int) -> set[int]:
    values: set[int] = set()
    for part in text.split(","):
        body, _, step = part.partition("/")
        if body == "*":
            first, last = lo, hi
        elif "-" in body:
            first, last = (int(x) for x in body.split("-"))
        else:
            first = last = int(body)
        values.update(range(first, last + 1, int(step) if step else 1))
    return values


def _next_cron(expr: str, tz: str, base: TimeBase, after: int) -> int:
    fields = expr.split()
    if len(fields) != 5:
        raise ValueError(f"this example evaluates five-field cron expressions, not {expr!r}")
    minute, hour, dom, month, dow = (
        _field(f, lo, hi)
        for f, lo, hi in zip(fields, (0, 0, 1, 1, 0), (59, 23, 31, 12, 7), strict=True)
    )
    dow = {d % 7 for d in dow}  # 0 and 7 are both Sunday
    zone = zoneinfo.ZoneInfo(tz)
    t = datetime.fromtimestamp(base.to_unix(after) // SECOND_NS, zone)
    t = t.replace(second=0, microsecond=0) + timedelta(minutes=1)
    for _ in range(366 * 24 * 60):  # a year of minutes at most
        if (
            t.minute in minute
            and t.hour in hour
            and t.day in dom
            and t.month in month
            and (t.isoweekday() % 7) in dow
        ):
            return base.from_unix(int(t.timestamp()) * SECOND_NS)
        t = (t + timedelta(minutes=1)).astimezone(zone)  # wall time, across DST changes
    raise ValueError(f"cron {expr!r} does not fire within a year")


def main(argv: list[str]) -> None:
    """Run the example engine on a database until Ctrl-C, with an `echo` handler."""
    logging.basicConfig(level=logging.INFO)
    stop = threading.Event()
    with SqlStore.open(argv[0] if argv else "engine.db") as store:
        engine = Engine(store, {"": lambda payload: payload, "echo": lambda payload: payload})
        try:
            engine.run(stop)
        except KeyboardInterrupt:
            stop.set()
    print(engine.stats)  # noqa: T201


if __name__ == "__main__":
    main(sys.argv[1:])
