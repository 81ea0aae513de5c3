"""The leader lease: who may write, under which fencing epoch, until when.

Taking the lease bumps the epoch; the fence check of every commit (`repository.fence`) matches
only the current epoch and holder, so a paused old leader can never write after a takeover.
"""

from __future__ import annotations

import os
import socket
import uuid
from typing import Any, Final

from sqlalchemy import Connection, Select, Update, and_, bindparam, case, select, update
from sqlalchemy.engine.interfaces import Dialect
from sqlalchemy.sql.elements import ColumnElement

from . import codec
from .dialects import db_now_ns
from .schema import leader

MAX_EPOCH: Final = 32767
"""Epochs stay within 1..32767 so epoch-prefixed task ids fit a signed 64-bit integer."""


def next_epoch(epoch: int) -> int:
    """The epoch after `epoch`, wrapping 32767 to 1."""
    return 1 if epoch >= MAX_EPOCH or epoch < 0 else epoch + 1


def new_holder() -> str:
    """A name for this store instance, unique across hosts and processes."""
    host = socket.gethostname()[:64]
    return f"{host}:{os.getpid()}:{uuid.uuid4().hex[:16]}"[: codec.HOLDER_MAX]


def lease_stmt(dialect: Dialect) -> Select[Any]:
    """The lease row and the database's clock, the row locked until the end of the transaction."""
    return (
        select(
            leader.c.epoch,
            leader.c.holder,
            leader.c.expires_unix_ns,
            db_now_ns(dialect).label("now"),
        )
        .where(leader.c.id == 1)
        .with_for_update()
    )


def take_stmt(dialect: Dialect) -> Update:
    """Take the lease under a new epoch, until `b_ttl` from now on the database's clock."""
    return (
        update(leader)
        .where(leader.c.id == 1)
        .values(
            epoch=bindparam("b_epoch"),
            holder=bindparam("b_holder"),
            expires_unix_ns=db_now_ns(dialect) + bindparam("b_ttl"),
        )
    )


def _held() -> ColumnElement[bool]:
    """The lease row while `b_holder` holds it under `b_epoch`."""
    return and_(
        leader.c.id == 1,
        leader.c.epoch == bindparam("b_epoch"),
        leader.c.holder == bindparam("b_holder"),
    )


def renew_stmt(dialect: Dialect) -> Update:
    """Extend our lease by `b_ttl`; matches nothing once another instance took it."""
    return (
        update(leader)
        .where(_held())
        .values(expires_unix_ns=db_now_ns(dialect) + bindparam("b_ttl"))
    )


def fence_stmt(dialect: Dialect) -> Update:
    """Fence check, the first write of every commit: extend our lease, raise the id high-water.

    It matches only while we hold the lease under our epoch. Its row lock serializes the commit
    against a takeover on PostgreSQL and MySQL (a plain read of the epoch would not, under READ
    COMMITTED); SQLite serializes all writers anyway.
    """
    return (
        update(leader)
        .where(_held())
        .values(
            max_id=case(
                (leader.c.max_id < bindparam("b_max_id"), bindparam("b_max_id")),
                else_=leader.c.max_id,
            ),
            expires_unix_ns=db_now_ns(dialect) + bindparam("b_ttl"),
        )
    )


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
    live lease.
    """
    row = conn.execute(lease_stmt(conn.dialect)).one()
    if row.holder is not None and row.holder != holder and row.expires_unix_ns > row.now:
        return None
    epoch = next_epoch(row.epoch)
    conn.execute(take_stmt(conn.dialect), {"b_epoch": epoch, "b_holder": holder, "b_ttl": ttl_ns})
    return epoch


def renew(conn: Connection, *, epoch: int, holder: str, ttl_ns: int) -> bool:
    """Extend our lease by `ttl_ns`; False when it was taken over."""
    result = conn.execute(
        renew_stmt(conn.dialect), {"b_epoch": epoch, "b_holder": holder, "b_ttl": ttl_ns}
    )
    return result.rowcount == 1


def fence(conn: Connection, *, epoch: int, holder: str, max_id: int, ttl_ns: int) -> bool:
    """Run the fence check; False when another instance holds the lease."""
    result = conn.execute(
        fence_stmt(conn.dialect),
        {"b_epoch": epoch, "b_holder": holder, "b_max_id": max_id, "b_ttl": ttl_ns},
    )
    return result.rowcount == 1


def release(conn: Connection, *, holder: str) -> None:
    conn.execute(release_stmt(), {"b_holder": holder})
