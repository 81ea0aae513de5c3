"""Waiting for an enqueue: LISTEN on PostgreSQL, a poll elsewhere."""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
from collections.abc import Callable, Generator
from functools import partial
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast

from sqlalchemy.engine import Dialect, Engine

from .. import dialects
from .statements import CHANNEL

if TYPE_CHECKING:  # sync users never import the asyncio extension
    from sqlalchemy.ext.asyncio import AsyncEngine

log = logging.getLogger("cronoq_store.inbox")  # the package's, as before its split
T = TypeVar("T")


SLOW_CHECK_S: Final = 1.0
"""While listening, PostgreSQL still checks this often (seconds): a notify that never came
(an enqueue by hand, in SQL) delays an item by at most this long."""


def can_listen(dialect: Dialect, *, pooled: bool = False) -> bool:
    """Whether an engine of `dialect` can LISTEN: PostgreSQL through psycopg 3 (whose notifies
    wait), unless `pooled` by a transaction pooler (`StoreConfig.transaction_pooler`), which
    delivers no notification: a LISTEN holds for the server connection it ran on, which the
    pooler hands to other clients right after."""
    return dialects.dialect_of(dialect).listens and not pooled


UNHEARD_DRAIN_S: Final = 0.05
"""How long a listener that found an item no notification announced still waits for a late
one before it says that notifications do not reach it."""
UNHEARD_WARNING: Final = (
    "an inbox item arrived but no notification reached this store's LISTEN connection (it was "
    "found by the check every %.0f s): behind a pooler in transaction mode (pgbouncer's "
    "pool_mode = transaction) LISTEN cannot work; set StoreConfig(transaction_pooler=True), "
    "so that wait_inbox polls every inbox_poll instead. (Items enqueued with notify=False "
    "also cause this: then set StoreConfig(inbox_listen=False); or rows inserted in SQL "
    "without pg_notify.)"
)
"""Logged once per store (a WARNING) whose listener misses a notification."""


def _listen_sql(engine: Engine | AsyncEngine) -> str:
    return f"LISTEN {engine.dialect.identifier_preparer.quote(CHANNEL)}"


Calls = Generator[Callable[[], Any], Any, T]
"""Driver I/O written once for both faces: it yields each driver call as a thunk, is sent back
its result (awaited first on the asyncio face, where the driver's calls are coroutines) or
thrown its error, and returns what it returns (as `face.Steps` does with transactions)."""


def run_calls(calls: Calls[T]) -> T:
    """Drive `calls` blocking."""
    done, got = _resume(calls, None, None)
    while not done:
        result, error = _called(got)
        done, got = _resume(calls, result, error)
    return cast(T, got)


async def run_calls_async(calls: Calls[T]) -> T:
    """Drive `calls` on an asyncio loop, awaiting each call's result that is awaitable."""
    done, got = _resume(calls, None, None)
    while not done:
        result, error = _called(got)
        if error is None and inspect.isawaitable(result):
            try:
                result = await result
            except Exception as exc:
                error = exc
        done, got = _resume(calls, result, error)
    return cast(T, got)


def _called(call: Callable[[], Any]) -> tuple[Any, Exception | None]:
    """`call`'s result, or the error it raised (for `calls` to handle)."""
    try:
        return call(), None
    except Exception as exc:
        return None, exc


def _resume(calls: Calls[Any], result: Any, error: Exception | None) -> tuple[bool, Any]:
    """`calls` sent `result` (or thrown `error`): (False, its next call), or (True, what it
    returned)."""
    try:
        return False, (calls.send(result) if error is None else calls.throw(error))
    except StopIteration as stop:
        return True, stop.value


class Listening:
    """A dedicated PostgreSQL connection (outside the pool) listening on `CHANNEL`, its logic
    written once (`Calls`) for `Listener` and `AsyncListener`, which only drive it.

    A wait ends True when a notification arrived within its timeout. Notifications that
    arrive between waits queue on the connection, so none is lost between a check and the
    next wait. A broken connection is dropped and made anew on the next wait.
    """

    def __init__(self, engine: Engine | AsyncEngine) -> None:
        self._engine = engine
        self._conn: Any = None
        self._closed = False
        self.warned = False
        """Whether it said that notifications do not reach it (`unheard`)."""

    def _notified(self, timeout: float) -> Any:
        """Whether a notification arrives within `timeout` (or an awaitable of it)."""
        raise NotImplementedError

    def _unheard(self) -> Calls[None]:
        """An item arrived that no notification announced while this listened: unless its
        notification is just late, say once why (a transaction pooler, most likely)."""
        if self.warned or (yield from self._waiting(UNHEARD_DRAIN_S)):
            return
        self.warned = True
        log.warning(UNHEARD_WARNING, SLOW_CHECK_S)

    def _listening(self) -> Calls[bool]:
        """Start listening if not yet; False if the connection cannot be made (or closed)."""
        if self._conn is not None or self._closed:
            return self._conn is not None
        conn: Any = None
        try:
            raw = yield self._engine.raw_connection
            conn = raw.driver_connection
            raw.detach()  # ours for good: the pool makes another in its place
            yield conn.rollback
            yield partial(conn.set_autocommit, True)
            yield partial(conn.execute, _listen_sql(self._engine))
        except Exception as exc:
            log.warning("cannot listen for inbox notifications: %s", dialects.redact(str(exc)))
            if conn is not None:
                with contextlib.suppress(Exception):
                    yield conn.close
            return False
        self._conn = conn
        return True

    def _waiting(self, timeout: float) -> Calls[bool]:
        """Whether a notification arrived within `timeout` seconds; True as well when the
        connection was lost (the caller checks the inbox, then listens anew)."""
        try:
            return bool((yield partial(self._notified, max(0.0, timeout))))
        except Exception as exc:
            log.warning("inbox listener lost: %s", dialects.redact(str(exc)))
            yield from self._closing(final=False)
            return True

    def _closing(self, final: bool) -> Calls[None]:
        """Close the connection; for good unless not `final` (a broken one is made anew)."""
        self._closed = self._closed or final
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # already broken
                yield conn.close


class Listener(Listening):
    """`Listening` blocking, on psycopg's connection; `lock` is held by the one `wait`
    that listens (others poll)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.lock = threading.Lock()

    def _notified(self, timeout: float) -> bool:
        return next(self._conn.notifies(timeout=timeout, stop_after=1), None) is not None

    def unheard(self) -> None:
        """See `Listening._unheard`."""
        run_calls(self._unheard())

    def listening(self) -> bool:
        """See `Listening._listening`."""
        return run_calls(self._listening())

    def wait(self, timeout: float) -> bool:
        """See `Listening._waiting`."""
        return run_calls(self._waiting(timeout))

    def close(self, *, final: bool = True) -> None:
        """See `Listening._closing`."""
        run_calls(self._closing(final))


def waiting(
    check: Callable[[], Any],
    timeout: float,
    *,
    poll: float,
    listener: Listening | None,
    sleep: Callable[[float], Any],
) -> Calls[bool]:
    """Whether the inbox holds an item within `timeout` seconds (at once if it does now), as
    `Calls` for either face: `check` looks (one probe), `sleep` pauses.

    With a `listener` (PostgreSQL; the caller holds it alone) this waits on its
    notifications, checking again on each and every `SLOW_CHECK_S`; otherwise it checks every
    `poll` seconds.
    """
    deadline = time.monotonic() + max(0.0, timeout)
    # Whether the last wait ended by a notification. An item found after one that timed out
    # came without its notification, which the listener ought to have heard: it then says
    # (once) that notifications do not reach it (`Listening._unheard`).
    heard = True
    while True:
        # Listening (anew, if the connection was lost) before each check: a commit that
        # lands after the check notifies a connection that already listens.
        listening = listener is not None and (yield from listener._listening())
        if (yield check):
            if listening and not heard and listener is not None:
                yield from listener._unheard()
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if listening and listener is not None:
            heard = yield from listener._waiting(min(left, SLOW_CHECK_S))
        else:
            yield partial(sleep, min(left, poll))


def wait(
    check: Callable[[], bool],
    timeout: float,
    *,
    poll: float,
    listener: Listener | None,
) -> bool:
    """`waiting`, blocking: with `listener` where this thread can hold its lock (another
    thread that waits on it now leaves this one to poll)."""
    locked = listener is not None and listener.lock.acquire(blocking=False)
    try:
        calls = waiting(
            check, timeout, poll=poll, listener=listener if locked else None, sleep=time.sleep
        )
        return run_calls(calls)
    finally:
        if locked and listener is not None:
            listener.lock.release()


class AsyncListener(Listening):
    """`Listening` on an asyncio loop, with the async driver's connection (psycopg's)."""

    def __init__(self, engine: AsyncEngine) -> None:
        super().__init__(engine)

    async def _notified(self, timeout: float) -> bool:
        async for _ in self._conn.notifies(timeout=timeout, stop_after=1):
            return True
        return False

    async def unheard(self) -> None:
        """`Listener.unheard`, awaited."""
        await run_calls_async(self._unheard())

    async def listening(self) -> bool:
        """`Listener.listening`, awaited."""
        return await run_calls_async(self._listening())

    async def wait(self, timeout: float) -> bool:
        """`Listener.wait`, awaited."""
        return await run_calls_async(self._waiting(timeout))

    async def close(self, *, final: bool = True) -> None:
        """`Listener.close`, awaited."""
        await run_calls_async(self._closing(final))
