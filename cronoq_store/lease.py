"""The leader lease: who may write, under which fencing epoch, until when.

Taking the lease bumps the epoch; the fence check of every commit (`fence`) matches only the
current epoch and holder, so a paused old leader can never write after a takeover. Expiry is
written and compared on the database's clock (`dialects.db_now_ns`). `Keeper` renews the lease
from threads and steps down on the holder's own monotonic clock.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from functools import cache
from typing import Any, Final

from sqlalchemy import Connection, Row, Select, Update, and_, bindparam, case, or_, select, update
from sqlalchemy.sql.elements import ColumnElement

from . import codec, execution, leadership
from .dialects import db_now_ns
from .errors import LeaderRowMissing
from .schema import leader

log = logging.getLogger(__name__)

MAX_EPOCH: Final = 32767
"""Epochs stay within 1..32767 so epoch-prefixed task ids fit a signed 64-bit integer."""


def next_epoch(epoch: int) -> int:
    """The epoch after `epoch`, wrapping 32767 to 1 (what `take_stmt` computes in SQL)."""
    return 1 if epoch >= MAX_EPOCH or epoch < 0 else epoch + 1


def new_holder() -> str:
    """A name for this store instance, unique across hosts and processes."""
    host = socket.gethostname()[:64]
    return f"{host}:{os.getpid()}:{uuid.uuid4().hex[:16]}"[: codec.HOLDER_MAX]


@cache
def lease_view_stmt() -> Select[Any]:
    """The lease row and the database's clock, unlocked: for operators' reads, which must never
    block a commit."""
    return select(
        leader.c.epoch,
        leader.c.holder,
        leader.c.expires_unix_ns,
        db_now_ns().label("now"),
    ).where(leader.c.id == 1)


@cache
def take_stmt() -> Update:
    """Take the lease for `b_holder` under the next epoch, until `b_ttl` from now, if it is free,
    ours, or expired: expiry is compared here, in SQL, on the database's clock.

    One conditional update, so the check and the take are one atomic step under the row lock; a
    host whose clock runs ahead has no say in it.
    """
    wraps = or_(leader.c.epoch >= MAX_EPOCH, leader.c.epoch < 0)
    return (
        update(leader)
        .where(
            leader.c.id == 1,
            or_(
                leader.c.holder.is_(None),
                leader.c.holder == bindparam("b_holder"),
                leader.c.expires_unix_ns <= db_now_ns(),
            ),
        )
        .values(
            epoch=case((wraps, 1), else_=leader.c.epoch + 1),
            holder=bindparam("b_holder"),
            expires_unix_ns=db_now_ns() + bindparam("b_ttl"),
        )
    )


def lease_view(conn: Connection) -> Row[Any]:
    """`lease_view_stmt`'s row; `LeaderRowMissing` when the lease row is gone."""
    row = conn.execute(lease_view_stmt()).one_or_none()
    if row is None:
        raise LeaderRowMissing()
    return row


def require_row(conn: Connection) -> None:
    """Raise `LeaderRowMissing` if the lease row is gone (why an update of it matched nothing)."""
    if conn.execute(epoch_stmt()).first() is None:
        raise LeaderRowMissing()


def may_take(conn: Connection, *, holder: str) -> bool:
    """Whether the lease looks free, expired or ours, read without locking anything.

    Standbys look before they try: the take itself needs the write lock (all of SQLite's).
    """
    row = lease_view(conn)
    return bool(row.holder is None or row.holder == holder or row.expires_unix_ns <= row.now)


@cache
def lock_stmt() -> Select[Any]:
    """The lease row, locked: waits out a commit or takeover in flight (SQLite: no-op)."""
    return select(leader.c.id).where(leader.c.id == 1).with_for_update()


def lock(conn: Connection) -> None:
    """Wait for the lease row's lock, so that a take after it runs at once."""
    if conn.execute(lock_stmt()).one_or_none() is None:
        raise LeaderRowMissing()


@cache
def epoch_stmt() -> Select[Any]:
    """The current epoch (read back by the transaction that just took the lease)."""
    return select(leader.c.epoch).where(leader.c.id == 1)


def _held() -> ColumnElement[bool]:
    """The lease row while `b_holder` holds it under `b_epoch`."""
    return and_(
        leader.c.id == 1,
        leader.c.epoch == bindparam("b_epoch"),
        leader.c.holder == bindparam("b_holder"),
    )


@cache
def renew_stmt() -> Update:
    """Extend our lease by `b_ttl`; matches nothing once another instance took it."""
    return update(leader).where(_held()).values(expires_unix_ns=db_now_ns() + bindparam("b_ttl"))


@cache
def fence_stmt() -> Update:
    """Fence check, the first write of every commit: extend our lease, raise the id high-water.

    It matches only while we hold the lease under our epoch. Its row lock serializes the commit
    against a takeover on PostgreSQL and MySQL (a plain read of the epoch would not, under READ
    COMMITTED); SQLite serializes all writers anyway.
    """
    return (
        update(leader)
        .where(_held())
        .values(
            next_id=case(
                (leader.c.next_id < bindparam("b_next_id"), bindparam("b_next_id")),
                else_=leader.c.next_id,
            ),
            expires_unix_ns=db_now_ns() + bindparam("b_ttl"),
        )
    )


@cache
def release_stmt() -> Update:
    """Give the lease up at once."""
    return (
        update(leader)
        .where(leader.c.id == 1, leader.c.holder == bindparam("b_holder"))
        .values(holder=None, expires_unix_ns=0)
    )


def try_take(conn: Connection, *, holder: str, ttl_ns: int) -> int | None:
    """Take the lease if it is free, expired or already ours; the new epoch, or None.

    Expiry is judged on the database's clock, so a host whose clock runs ahead cannot steal a
    live lease. The epoch rises by one per take (`next_epoch`), never on renewal.
    """
    taken = conn.execute(take_stmt(), {"b_holder": holder, "b_ttl": ttl_ns}).rowcount == 1
    if not taken:
        return None
    epoch: int = conn.execute(epoch_stmt()).scalar_one()
    return epoch


def take(conn: Connection, *, holder: str, ttl_ns: int) -> tuple[int, float] | None:
    """`try_take` after waiting for the lease row's lock: the new epoch and the monotonic time
    the lease runs from, or None.

    The time is read once the lock is ours, not before: a killed leader's commit can hold it for
    a while, and a lease timed from before that wait would be lost on arrival.
    """
    lock(conn)
    started = time.monotonic()
    epoch = try_take(conn, holder=holder, ttl_ns=ttl_ns)
    return None if epoch is None else (epoch, started)


def renew(conn: Connection, *, epoch: int, holder: str, ttl_ns: int) -> bool:
    """Extend our lease by `ttl_ns`; False when it was taken over (`LeaderRowMissing` when the
    row is gone)."""
    params = {"b_epoch": epoch, "b_holder": holder, "b_ttl": ttl_ns}
    result = execution.run_stmt(conn, renew_stmt(), params)
    if result.rowcount == 1:
        return True
    require_row(conn)
    return False


def fence(conn: Connection, *, epoch: int, holder: str, next_id: int, ttl_ns: int) -> bool:
    """Run the fence check, raising the high-water to `next_id`; False when we do not lead
    (`LeaderRowMissing` when nobody can: the row is gone)."""
    params = {"b_epoch": epoch, "b_holder": holder, "b_next_id": next_id, "b_ttl": ttl_ns}
    result = execution.run_stmt(conn, fence_stmt(), params)
    if result.rowcount == 1:
        return True
    require_row(conn)
    return False


def release(conn: Connection, *, holder: str) -> None:
    """Give our lease up at once (a no-op once another instance holds it)."""
    conn.execute(release_stmt(), {"b_holder": holder})


class Keeper(leadership.KeeperShell[Callable[[], bool], Callable[[str], None]]):
    """Keeps one lease alive from two daemon threads, around `leadership.Keeping`'s decisions.

    The renewer calls `renew`: True means renewed, False that the lease was taken over, a
    `StoreError` a failed attempt (retried after `every` seconds). The watchdog thread waits for
    what the core decides (the next renewal, or the deadline while a renewal runs) and calls
    `lost` once the lease has not been renewed within `ttl` seconds of the START of the last
    successful renewal, on the monotonic clock, even while a renewal hangs (on a row lock, on a
    dead connection): a blocked call cannot postpone stepping down. The database clock sets each
    new expiry no earlier than that start plus the TTL, so the holder steps down before any
    standby may take over.

    `lost(reason)` is called at most once, from one of the threads; `stop` ends both threads
    without calling it.
    """

    def _setup(self) -> None:
        self._cond = threading.Condition()
        self._guard = self._cond
        self._threads = (
            threading.Thread(target=self._renew_loop, name=f"{self._name}-renew", daemon=True),
            threading.Thread(target=self._watch, name=f"{self._name}-watchdog", daemon=True),
        )

    def _wake(self) -> None:
        self._cond.notify_all()

    _start = _wake  # the renewer thread picks up the renewal the core started

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` seconds for each thread to end (a hung renewal may outlive it)."""
        for thread in self._threads:
            if thread.ident is not None and thread is not threading.current_thread():
                thread.join(timeout)

    def _watch(self) -> None:
        """Block until the core's next decision is due; report the step-down."""
        with self._cond:
            while isinstance(step := self._due(time.monotonic()), leadership.Wait):
                self._cond.wait(step.until - time.monotonic())
        if step is not None:
            self._lost(step.reason)

    def _renew_loop(self) -> None:
        """Run each renewal the core started (blocking as long as it takes), report its end."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._core.finished or self._core.running)
                if self._core.finished:
                    return
            result: bool | BaseException
            try:
                result = self._renew()
            except Exception as exc:
                result = exc
            if (note := self._ended(time.monotonic(), result)) is not None:
                log.log(*note)
