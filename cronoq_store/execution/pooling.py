"""The pool's connections checked before use, cheaply: a ping only after they sat idle
(`ping_when_idle`), and the same check for one kept checked out (`still_there`)."""

from __future__ import annotations

import time
from typing import Any, Final

from sqlalchemy import Connection, Engine, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Dialect

from ..dialects.base import dialect_of
from .deadlines import WATCHDOG, current_bound

__all__ = ["PING_IDLE", "ping_when_idle", "still_there"]


PING_IDLE: Final = 1.0
"""Seconds a pooled connection may sit unused before its next checkout pings it."""

_CHECKED_IN: Final = "cronoq_checked_in"


def ping_when_idle(engine: Engine, idle: float = PING_IDLE) -> None:
    """Ping a pooled connection at checkout only when it sat unused for `idle` seconds.

    What `pool_pre_ping` is for (a restarted server costs a reconnect, not an error) at a
    fraction of its price: a leader committing back to back reuses connections within
    milliseconds, and a ping before each commit was a round trip and a tenth of its CPU. A
    connection lost within `idle` of its last use fails its statement instead, as one lost
    between a ping and the statement always could: `StoreUnavailable`, and the pool drops it.
    """
    dialect = engine.dialect

    @event.listens_for(engine, "checkin")
    def _checkin(_dbapi_connection: Any, record: Any) -> None:
        record.info[_CHECKED_IN] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checkout(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        since = record.info.get(_CHECKED_IN)
        if since is None or time.monotonic() - since < idle:
            return  # new (just connected), or used a moment ago
        _bind_current(dialect, dbapi_connection)
        if not _answers(dialect, dbapi_connection):
            # The pool discards this connection and checks out another (documented).
            raise sa_exc.DisconnectionError("connection lost while pooled")


def _answers(dialect: Dialect, dbapi_connection: Any) -> bool:
    """Whether a ping of `dbapi_connection` is answered (False if it was lost)."""
    try:
        return bool(dialect.do_ping(dbapi_connection))
    except dialect.loaded_dbapi.Error as exc:
        if not dialect.is_disconnect(exc, dbapi_connection, None):
            raise
        return False


def _bind_current(dialect: Dialect, dbapi_connection: Any) -> None:
    """Make the operation's deadline, if any, interrupt `dbapi_connection` (about to be
    pinged): a ping of a connection whose server went silent waits no longer than it."""
    deadline = current_bound()
    if deadline is not None:
        driver = getattr(dbapi_connection, "driver_connection", dbapi_connection)
        WATCHDOG.bind(deadline, dialect_of(dialect).interrupter(driver))


def still_there(conn: Connection) -> bool:
    """Whether `conn`, kept checked out while unused for `PING_IDLE` or longer, may be used:
    the check the pool makes of an idle connection at checkout (`ping_when_idle`), for one
    that never went back to it. A lost one is invalidated. SQLite's is never lost."""
    if not dialect_of(conn).server:
        return True
    dbapi_conn = conn.connection.dbapi_connection
    _bind_current(conn.dialect, dbapi_conn)
    if _answers(conn.dialect, dbapi_conn):
        return True
    conn.invalidate()
    return False
