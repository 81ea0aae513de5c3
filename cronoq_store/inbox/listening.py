"""Waiting for an enqueue: LISTEN on PostgreSQL, a poll elsewhere."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from sqlalchemy.engine import Dialect, Engine

from .. import dialects
from .statements import CHANNEL

if TYPE_CHECKING:  # sync users never import the asyncio extension
    from sqlalchemy.ext.asyncio import AsyncEngine

log = logging.getLogger("cronoq_store.inbox")  # the package's, as before its split


SLOW_CHECK_S: Final = 1.0
"""While listening, PostgreSQL still checks this often (seconds): a notify that never came
(an enqueue by hand, in SQL) delays an item by at most this long."""


def can_listen(dialect: Dialect, *, pooled: bool = False) -> bool:
    """Whether an engine of `dialect` can LISTEN: PostgreSQL through psycopg 3 (whose notifies
    wait), unless `pooled` by a transaction pooler (`StoreConfig.transaction_pooler`), which
    delivers no notification: a LISTEN holds for the server connection it ran on, which the
    pooler hands to other clients right after."""
    return dialect.name == "postgresql" and dialect.driver == "psycopg" and not pooled


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


class Listener:
    """A dedicated PostgreSQL connection (outside the pool) listening on `CHANNEL`.

    `wait` returns True when a notification arrived within `timeout` seconds. Notifications
    that arrive between waits queue on the connection, so none is lost between a check and
    the next wait. A broken connection is dropped and made anew on the next wait.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._conn: Any = None
        self._closed = False
        self.lock = threading.Lock()
        self.warned = False
        """Whether it said that notifications do not reach it (`unheard`)."""

    def unheard(self) -> None:
        """An item arrived that no notification announced while this listened: unless its
        notification is just late, say once why (a transaction pooler, most likely)."""
        if self.warned or self.wait(UNHEARD_DRAIN_S):
            return
        self.warned = True
        log.warning(UNHEARD_WARNING, SLOW_CHECK_S)

    def listening(self) -> bool:
        """Start listening if not yet; False if the connection cannot be made (or closed)."""
        if self._conn is not None or self._closed:
            return self._conn is not None
        conn: Any = None
        try:
            raw = self._engine.raw_connection()
            conn = raw.driver_connection
            raw.detach()  # ours for good: the pool makes another in its place
            conn.rollback()
            conn.autocommit = True
            conn.execute(_listen_sql(self._engine))
        except Exception as exc:
            log.warning("cannot listen for inbox notifications: %s", dialects.redact(str(exc)))
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
            return False
        self._conn = conn
        return True

    def wait(self, timeout: float) -> bool:
        try:
            for _ in self._conn.notifies(timeout=max(0.0, timeout), stop_after=1):
                return True
            return False
        except Exception as exc:
            log.warning("inbox listener lost: %s", dialects.redact(str(exc)))
            self.close(final=False)
            return True  # the caller checks the inbox, then listens anew

    def close(self, *, final: bool = True) -> None:
        """Close the connection; for good unless not `final` (a broken one is made anew)."""
        self._closed = self._closed or final
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # already broken
                conn.close()


def wait(
    check: Callable[[], bool],
    timeout: float,
    *,
    poll: float,
    listener: Listener | None,
) -> bool:
    """Whether the inbox holds an item within `timeout` seconds (at once if it does now).

    With a `listener` (PostgreSQL) this waits on its notifications, checking again on each and
    every `SLOW_CHECK_S`; otherwise it checks every `poll` seconds.
    """
    deadline = time.monotonic() + max(0.0, timeout)
    locked = listener is not None and listener.lock.acquire(blocking=False)
    # Whether the last wait ended by a notification. An item found after one that timed out
    # came without its notification, which the listener ought to have heard: it then says
    # (once) that notifications do not reach it (`Listener.unheard`).
    heard = True
    try:
        while True:
            # Listening (anew, if the connection was lost) before each check: a commit that
            # lands after the check notifies a connection that already listens.
            listening = locked and listener is not None and listener.listening()
            if check():
                if listening and not heard and listener is not None:
                    listener.unheard()
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if listening and listener is not None:
                heard = listener.wait(min(left, SLOW_CHECK_S))
            else:
                time.sleep(min(left, poll))
    finally:
        if locked and listener is not None:
            listener.lock.release()


class AsyncListener:
    """`Listener` on an asyncio loop, with the async driver's connection (psycopg's)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._conn: Any = None
        self._closed = False
        self.warned = False

    async def unheard(self) -> None:
        """`Listener.unheard`."""
        if self.warned or await self.wait(UNHEARD_DRAIN_S):
            return
        self.warned = True
        log.warning(UNHEARD_WARNING, SLOW_CHECK_S)

    async def listening(self) -> bool:
        if self._conn is not None or self._closed:
            return self._conn is not None
        conn: Any = None
        try:
            raw = await self._engine.raw_connection()
            conn = raw.driver_connection
            raw.detach()
            await conn.rollback()
            await conn.set_autocommit(True)
            await conn.execute(_listen_sql(self._engine))
        except Exception as exc:
            log.warning("cannot listen for inbox notifications: %s", dialects.redact(str(exc)))
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()
            return False
        self._conn = conn
        return True

    async def wait(self, timeout: float) -> bool:
        try:
            async for _ in self._conn.notifies(timeout=max(0.0, timeout), stop_after=1):
                return True
            return False
        except Exception as exc:
            log.warning("inbox listener lost: %s", dialects.redact(str(exc)))
            await self.close(final=False)
            return True

    async def close(self, *, final: bool = True) -> None:
        self._closed = self._closed or final
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()
