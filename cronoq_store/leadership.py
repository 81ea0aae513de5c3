"""Leadership decisions, as plain code: no I/O, no threads, no event loop.

Both faces drive the same three state machines and only block (`SqlStore`, `store.Keeper`) or
await (`AsyncSqlStore`, `aio.AsyncKeeper`) around them, in the manner of h11:

- `Acquiring`: the acquire loop. Events: an attempt took the lease, found it held, or could not
  reach the database. Decisions: `Taken`, `Retry` at a time (polling, or backing off while the
  database is unreachable), `GiveUp` at the deadline.
- `Keeping`: one lease's keeper. Events: a renewal started, ended (renewed, taken over, failed),
  a renewal reported from elsewhere (a landed commit's fence check), stop. Decisions, asked for
  at a monotonic time: `Renew` at a time, `Wait` until a time (a renewal is running, or the
  next one would start past the deadline), `StepDown` with the reason, or None once finished.
  The deadline is the start of the last successful renewal plus the TTL, which is never later
  than the lease's expiry on the database's clock: the holder steps down before any standby
  may take over, even while its renewal hangs.
- `KeeperShell`: what both keepers share around `Keeping`: their arguments, and acting on its
  decisions; a face adds only how it waits and how it runs a renewal.
- `Leadership`: who leads. Events: acquired (epoch and keeper), lost (from a keeper, a fenced
  commit, or the store itself), released. It tells which keeper or epoch is stale.

Log lines are returned as `Note`s, so that each face writes them under its own logger.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Final, Generic, TypedDict, TypeVar

from .errors import StoreError, StoreUnavailable

if TYPE_CHECKING:
    from .config import StoreConfig

K = TypeVar("K")
R = TypeVar("R")
L = TypeVar("L")

Note = tuple[int, str]
"""A line for the log: its level and its message."""


@dataclass(frozen=True, slots=True)
class Taken:
    """The attempt took the lease."""

    note: Note | None = None


@dataclass(frozen=True, slots=True)
class Retry:
    """Try again at monotonic time `at` (a poll, or a back-off while unreachable)."""

    at: float
    note: Note | None = None


@dataclass(frozen=True, slots=True)
class GiveUp:
    """The deadline passed: raise `error`."""

    error: StoreUnavailable
    note: Note | None = None


class Acquiring:
    """The acquire loop's decisions: poll every `poll` seconds while another instance holds the
    lease, back off (doubling, up to `max_delay`) while the database cannot be reached, and give
    up once `timeout` seconds have passed since `now` (never, if None)."""

    def __init__(self, *, poll: float, max_delay: float, timeout: float | None, now: float):
        self._poll = poll
        self._max_delay = max(max_delay, poll)
        self._timeout = timeout
        self._deadline = None if timeout is None else now + timeout
        self._delay = poll
        self._unreachable: StoreUnavailable | None = None

    def attempted(self, now: float, outcome: object) -> Taken | Retry | GiveUp:
        """What to do after an attempt that ended at `now` with `outcome`: a `StoreUnavailable`
        (unreachable), None (held by another instance), anything else (taken)."""
        note: Note | None = None
        if isinstance(outcome, StoreUnavailable):
            if self._unreachable is None:
                note = (
                    logging.WARNING,
                    f"cannot reach the database to acquire leadership: {outcome}",
                )
            self._unreachable, wait = outcome, self._delay
            self._delay = min(self._delay * 2, self._max_delay)
        else:
            if self._unreachable is not None:
                note = (logging.INFO, "the database is reachable again")
            self._unreachable, wait, self._delay = None, self._poll, self._poll
            if outcome is not None:
                return Taken(note)
        if self._deadline is None:
            return Retry(now + wait, note)
        if now >= self._deadline:
            why = "another instance holds the lease"
            if self._unreachable is not None:
                why = f"the database is unreachable: {self._unreachable}"
            return GiveUp(StoreUnavailable(f"not leader after {self._timeout} s: {why}"), note)
        return Retry(min(now + wait, self._deadline), note)


@dataclass(frozen=True, slots=True)
class Renew:
    """Start a renewal at monotonic time `at` (at once, if that has passed)."""

    at: float


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to start before monotonic time `until`; ask again then, or on any event."""

    until: float


@dataclass(frozen=True, slots=True)
class StepDown:
    """The lease is lost (or may be, past its deadline): stop acting as leader."""

    reason: str


class Keeping:
    """One lease's keeper: renew every `every` seconds, step down once it was taken over or
    `ttl` seconds have passed since the start of the last successful renewal.

    `renewed_at` is the monotonic time the lease was taken. A renewal ends `every` seconds
    before the next starts; one still running keeps no other from being decided, and one that
    ends after the keeper finished changes nothing.
    """

    def __init__(self, *, every: float, ttl: float, renewed_at: float) -> None:
        self.every = every
        self.ttl = ttl
        self.deadline = renewed_at + ttl
        self._due = renewed_at + every
        self._running: float | None = None
        self._failure = ""
        self._taken_over = False
        self.finished = False

    @property
    def running(self) -> bool:
        """Whether a renewal has started and not ended."""
        return self._running is not None

    def next(self, now: float) -> Renew | Wait | StepDown | None:
        """What to do at `now`; a `StepDown` is returned once, then None (as after `stop`)."""
        if self.finished:
            return None
        if self._taken_over:
            self.finished = True
            return StepDown("the lease was taken over")
        if now >= self.deadline:
            self.finished = True
            failure = "a renewal hung" if self._running is not None else self._failure
            reason = f"the lease was not renewed within its TTL ({self.ttl:g} s)"
            return StepDown(f"{reason}: {failure}" if failure else reason)
        if self._running is not None or self._due >= self.deadline:
            return Wait(self.deadline)
        return Renew(self._due)

    def started(self, now: float) -> None:
        """A renewal started at `now` (after `next` said `Renew`)."""
        self._running = now

    def ended(self, now: float, result: bool | BaseException) -> Note | None:
        """The renewal ended at `now`: True renewed, False taken over, an exception failed (and
        is retried after `every`)."""
        started, self._running = self._running, None
        if self.finished or started is None:
            return None
        self._due = now + self.every
        if isinstance(result, StoreError):
            self._failure = str(result)
            return (logging.WARNING, f"renewing the cronoq lease failed, retrying: {result}")
        if isinstance(result, BaseException):
            self._failure = repr(result)
            return (
                logging.ERROR,
                f"renewing the cronoq lease failed unexpectedly, retrying: {result!r}",
            )
        if not result:
            self._taken_over = True
            return None
        self._failure = ""
        self.renewed(started)
        return None

    def renewed(self, started: float) -> None:
        """A renewal that started at monotonic time `started` succeeded (a landed commit's fence
        check counts: it extends the lease too); the deadline moves to `started` plus the TTL."""
        self.deadline = max(self.deadline, started + self.ttl)

    def stop(self) -> None:
        """Finish without stepping down: `next` says None from now on."""
        self.finished = True


class KeeperShell(Generic[R, L]):
    """The part of a keeper that is the same on both faces; `renew` and `lost` are the face's
    callables, `renewed_at` the monotonic time at which the lease was taken (or last renewed).

    A face sets `_guard` (what serializes access to the core: a lock, or nothing on one event
    loop) in `_setup`, and implements `_wake` (re-evaluate: an event changed the core's answer)
    and `_start` (run one renewal, then report it with `_ended`).
    """

    _guard: AbstractContextManager[object]

    def __init__(
        self,
        *,
        renew: R,
        lost: L,
        every: float,
        ttl: float,
        renewed_at: float,
        name: str = "cronoq-lease-keeper",
    ) -> None:
        """`renewed_at`: the monotonic time at which the lease was taken (or last renewed)."""
        self._renew = renew
        self._lost = lost
        self._name = name
        self._core = Keeping(every=every, ttl=ttl, renewed_at=renewed_at)
        self._setup()

    @property
    def deadline(self) -> float:
        """The monotonic time at which the holder steps down unless renewed before."""
        return self._core.deadline

    def stop(self) -> None:
        """Stop renewing and watching, without reporting a loss; returns at once."""
        with self._guard:
            self._core.stop()
            self._wake()

    def renewed(self, started: float) -> None:
        """Count a successful renewal that started at monotonic time `started` (a committed
        fence check extends the lease too): the deadline moves to `started` plus the TTL.

        Wakes no one: it only moves what the keeper waits for later, never sooner, so a thread
        asleep until the old time wakes then and waits again. (Waking both threads after every
        commit cost two thread switches a commit.)"""
        core = self._core
        with self._guard:  # `Keeping.renewed`, inline: every landed commit comes here
            if started + core.ttl > core.deadline:
                core.deadline = started + core.ttl

    def _due(self, now: float) -> Wait | StepDown | None:
        """Act on the core's decision at `now` (call under `_guard`): start a renewal that is
        due; then wait (for an event, or until a time), step down, or end (None)."""
        decision = self._core.next(now)
        if isinstance(decision, Renew) and decision.at <= now:
            self._core.started(now)
            self._start()
            decision = self._core.next(now)
        return Wait(decision.at) if isinstance(decision, Renew) else decision

    def _ended(self, now: float, result: bool | BaseException) -> Note | None:
        """A renewal ended at `now` with `result` (see `Keeping.ended`)."""
        with self._guard:
            note = self._core.ended(now, result)
            self._wake()
        return note

    def _setup(self) -> None:
        raise NotImplementedError

    def _wake(self) -> None:
        raise NotImplementedError

    def _start(self) -> None:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class Lost(Generic[K]):
    """Leadership under `epoch` ended: stop `keeper` (if any) and tell the callbacks."""

    epoch: int | None
    keeper: K | None


class Leadership(Generic[K]):
    """Who leads: the epoch, the keeper that keeps its lease, and whether it was lost.

    `K` is the face's keeper type; keepers are compared by identity.
    """

    def __init__(self) -> None:
        self.epoch: int | None = None
        self.keeper: K | None = None
        self.lost = True
        self.sent = 0
        """The last commit sequence number handed to a commit under this lease."""
        self.acked = 0
        """The highest commit sequence number known to have landed, kept across terms: a
        database whose lease row holds less has lost commits this instance acknowledged."""
        self.acked_epoch = 0
        """The epoch `acked` was reached under."""

    @property
    def leading(self) -> int | None:
        """The epoch while leading, else None."""
        return None if self.lost else self.epoch

    def may_commit(self, epoch: int) -> bool:
        """Whether a commit under `epoch` may be tried (the database's fence has the last say)."""
        return not self.lost and epoch == self.epoch

    def acquired(self, epoch: int, keeper: K, commit_seq: int = 0) -> None:
        """Lead under `epoch`, the lease row's commit sequence standing at `commit_seq` (never
        below `acked`: the take checks)."""
        self.epoch, self.keeper, self.lost = epoch, keeper, False
        self.sent = self.acked = commit_seq
        self.acked_epoch = epoch

    def next_commit(self) -> tuple[int, int]:
        """A commit's sequence number and the fence's floor (the last one acknowledged).

        A commit whose outcome stays unknown never raises the floor, so the next one passes
        whether it landed or not.
        """
        self.sent += 1
        return self.sent, self.acked

    def begin_commit(self, epoch: int) -> tuple[int, int] | None:
        """`next_commit` when a commit under `epoch` may be tried (`may_commit`), else None."""
        if self.lost or epoch != self.epoch:
            return None
        self.sent += 1
        return self.sent, self.acked

    def lose(self, *, keeper: K | None = None, epoch: int | None = None) -> Lost[K] | None:
        """Step down, once: a `Lost`, or None when already lost or when the news is stale (from
        a `keeper` that no longer keeps the current lease, still finishing a hung renewal, or a
        commit fenced under an `epoch` that is no longer ours)."""
        stale = (keeper is not None and keeper is not self.keeper) or (
            epoch is not None and epoch != self.epoch
        )
        if self.lost or stale:
            return None
        self.lost = True
        return Lost(self.epoch, self.keeper)

    def fence_renewed(self, epoch: int, seq: int) -> K | None:
        """The keeper to tell that commit `seq` under `epoch` landed (None if it no longer
        leads)."""
        if self.lost or epoch != self.epoch:  # `may_commit`, on every commit's path
            return None
        if seq > self.acked:
            self.acked = seq
        return self.keeper

    def detach(self) -> K | None:
        """The keeper, to be stopped and joined; none keeps the lease from here on."""
        keeper, self.keeper = self.keeper, None
        return keeper

    def gap_recorded(self) -> None:
        """A database behind this instance was noticed and the gap recorded: its history is
        the one to build on now (the next take reads the row's sequence)."""
        self.acked = 0

    def released(self) -> None:
        self.epoch = None


# The faces' settings of the acquire loop and of a keeper, from a store's configuration.

MAX_RETRY_DELAY: Final = 5.0
"""Longest wait, in seconds, between attempts to reach the database while acquiring."""


def take_bound(give_up_at: float | None, now: float) -> timedelta | None:
    """How long one attempt at the lease may take: what is left of an acquire's timeout
    (None: no timeout; `lease_bound` bounds it then), so that a take waiting on a row lock
    cannot carry `acquire_leadership` past its timeout."""
    if give_up_at is None:
        return None
    return timedelta(seconds=max(0.1, give_up_at - now))


def acquiring_for(config: StoreConfig, timeout: float | None, now: float) -> Acquiring:
    """The acquire loop's decisions under `config`, from monotonic time `now` (both faces)."""
    poll = config.lock_poll.total_seconds()
    return Acquiring(poll=poll, max_delay=MAX_RETRY_DELAY, timeout=timeout, now=now)


class KeeperTiming(TypedDict):
    every: float
    ttl: float
    renewed_at: float
    name: str


def keeper_timing(config: StoreConfig, epoch: int, started: float) -> KeeperTiming:
    """A keeper's timing under `config`, for the lease taken under `epoch` at `started`."""
    return KeeperTiming(
        every=config.lease_renew.total_seconds(),
        ttl=config.lease_ttl.total_seconds(),
        renewed_at=started,
        name=f"cronoq-lease-keeper-{epoch}",
    )
