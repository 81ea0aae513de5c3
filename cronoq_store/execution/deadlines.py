"""Deadlines of operations: one watchdog thread interrupts a transaction that outlives its
bound (`Watchdog`, `bounded`), and a connect made within one is given what is left of it
(`bound_connects`)."""

from __future__ import annotations

import heapq
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, Final

from sqlalchemy import Engine, event

from ..dialects.sessions import CONNECT_TIMEOUT
from ..errors import StoreUnavailable

log = logging.getLogger(__name__)

__all__ = [
    "WATCHDOG",
    "Deadline",
    "Watchdog",
    "bound_connects",
    "bounded",
    "current_bound",
]


class Deadline:
    """One operation's deadline with the `Watchdog`: when it passes, `interrupt` is called.

    Armed before the operation connects (`bounded`), so that connecting, the pool's ping and
    the transaction all count against it; `interrupt` is bound once there is a connection to
    interrupt (`Watchdog.bind`), and bound anew when the pool replaces it."""

    __slots__ = ("at", "fired", "interrupt", "interrupting", "settled")

    def __init__(self, at: float, interrupt: Callable[[], None] | None) -> None:
        self.at = at
        """Monotonic time at which the operation is interrupted."""
        self.interrupt = interrupt
        self.settled = False
        """The operation ended first: nothing to interrupt."""
        self.fired = False
        """The deadline passed first: the operation was (or is being) interrupted."""
        self.interrupting = False
        """The watchdog is calling `interrupt` now (`settle` waits for it to return)."""

    def left(self) -> float:
        """Seconds until the deadline (negative once it passed)."""
        return self.at - time.monotonic()


class Watchdog:
    """Interrupts transactions that outlive their deadline, from one daemon thread.

    A transaction can wait past every server-side bound: PostgreSQL applies no
    `statement_timeout` to a COMMIT waiting for a synchronous standby, and a server cut off
    silently (packets dropped, no RST) answers nothing, so a read waits for TCP to give up.
    The thread that waits cannot stop itself, so this one calls the operation's `interrupt`
    (a socket shutdown, SQLite's interrupt: `dialects.interrupter_of`) when its deadline
    passes. The call never blocks: one that did (a cancel request, which connects to the
    server anew) stalled this thread and, holding the GIL, every other.

    Arming and settling cost a lock and a heap push, never a thread switch: the thread sleeps
    until the earliest deadline and is woken only when a new one is earlier still. Settled
    entries leave the heap lazily (or in a sweep once they are most of it).
    """

    _SWEEP: Final = 1024

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        """Waits and wakes on `_lock`; a plain `with self._lock` costs a commit no calls."""
        self._heap: list[tuple[float, int, Deadline]] = []
        self._order = 0
        """Ties between equal times broken by arming order (a Deadline has no order)."""
        self._settled = 0
        self._thread: threading.Thread | None = None
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        # A forked child has none of the parent's threads: start afresh on first use.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._heap = []
        self._settled = 0
        self._thread = None

    def arm(self, seconds: float, interrupt: Callable[[], None] | None) -> Deadline:
        """A deadline `seconds` from now; `interrupt` (None: nothing to call) when it passes."""
        deadline = Deadline(time.monotonic() + seconds, interrupt)
        with self._lock:
            heap = self._heap
            earlier = not heap or deadline.at < heap[0][0]
            self._order = order = self._order + 1  # a count, not `next(count)`: no call
            heapq.heappush(heap, (deadline.at, order, deadline))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="cronoq-deadline-watchdog", daemon=True
                )
                self._thread.start()
            elif earlier:
                self._cond.notify()
        return deadline

    def bind(self, deadline: Deadline, interrupt: Callable[[], None] | None) -> None:
        """From now on `interrupt` stops `deadline`'s operation (its connection changed);
        called at once if the deadline passed already."""
        with self._lock:
            if not deadline.fired:
                deadline.interrupt = interrupt
                return
        if interrupt is not None:
            _interrupt(interrupt)

    def settle(self, deadline: Deadline) -> bool:
        """The operation ended: True if its deadline had passed first (it was interrupted,
        or is being: its connection must not be used again). Once an interrupt under way
        has returned, so that it never reaches a socket the caller closes after this. Idempotent."""
        with self._lock:
            if deadline.fired:
                while deadline.interrupting:
                    self._cond.wait()
                return True
            if deadline.settled:
                return False
            deadline.settled = True
            self._settled += 1
            if self._settled > self._SWEEP and self._settled * 2 > len(self._heap):
                self._heap = [e for e in self._heap if not e[2].settled]
                heapq.heapify(self._heap)
                self._settled = 0
        return False

    def _due(self) -> Deadline:
        """Wait for the next deadline that passes unsettled (holding the lock). The heap is
        read anew after every wait: a sweep (`settle`) replaces it meanwhile."""
        while True:
            heap = self._heap
            while heap and heap[0][2].settled:
                heapq.heappop(heap)
                self._settled -= 1
            now = time.monotonic()
            if heap and heap[0][0] <= now:
                deadline = heapq.heappop(heap)[2]
                deadline.fired = True
                return deadline
            self._cond.wait(heap[0][0] - now if heap else None)

    def _watch(self) -> None:
        while True:
            with self._cond:
                deadline = self._due()
                interrupt = deadline.interrupt
                if interrupt is None:
                    continue
                deadline.interrupting = True
            try:
                _interrupt(interrupt)
            finally:
                with self._cond:
                    deadline.interrupting = False
                    self._cond.notify_all()


def _interrupt(interrupt: Callable[[], None]) -> None:
    try:
        interrupt()
    except Exception:
        log.warning("could not interrupt an overdue transaction", exc_info=True)


WATCHDOG: Final = Watchdog()
"""The process's one watchdog, shared by every store and both faces."""

_BOUND: ContextVar[Deadline | None] = ContextVar("cronoq_bound", default=None)
"""The deadline of the operation this thread (or task) runs, while it connects and runs."""


class bounded:  # lower case: used as a function, `with bounded(seconds) as deadline:`
    """Arm a deadline `seconds` from now (None: no bound) for one operation, connecting
    included: a connect made meanwhile is given what is left of it (`bound_connects`), the
    pool's ping of an idle connection and the transaction are interrupted at it. Settled on
    leaving. A class, not a generator: every commit enters one."""

    __slots__ = ("_token", "deadline")

    def __init__(self, seconds: float | None) -> None:
        self.deadline = None if seconds is None else WATCHDOG.arm(seconds, None)

    def __enter__(self) -> Deadline | None:
        self._token = _BOUND.set(self.deadline)
        return self.deadline

    def __exit__(self, *exc: object) -> None:
        _BOUND.reset(self._token)
        deadline = self.deadline
        if deadline is not None and not deadline.settled:  # a commit settles its own
            WATCHDOG.settle(deadline)


def current_bound() -> Deadline | None:
    """The deadline of the operation under way in this context (`bounded`), if any."""
    return _BOUND.get()


def bound_connects(engine: Engine, key: str, *, whole: bool) -> None:
    """Give a connect of `engine`'s made within an operation's deadline (`bounded`) what is
    left of it as the driver's `key` (`connect_timeout`; in whole seconds if `whole`, as
    libpq counts them, which waits at least 2), and refuse to start one once nothing is left:
    connecting counts against the bound of the operation that connects."""

    @event.listens_for(engine, "do_connect")
    def _do_connect(_dialect: Any, _record: Any, _cargs: Any, cparams: dict[str, Any]) -> None:
        deadline = current_bound()
        if deadline is None:
            return
        left = deadline.left()
        if left <= 0.05:
            raise StoreUnavailable(
                "no time left to connect within the operation's bound; not connected"
            )
        given = cparams.get(key)
        try:
            mine = float(given) if given is not None else CONNECT_TIMEOUT
        except (TypeError, ValueError):
            mine = CONNECT_TIMEOUT
        if mine <= 0:
            mine = CONNECT_TIMEOUT
        wait = min(mine, left)
        cparams[key] = max(1, math.ceil(wait)) if whole else wait
