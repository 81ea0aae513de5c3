"""MariaDB and MySQL (PyMySQL, asyncmy): unbuffered cursors, sockets shut to interrupt."""

from __future__ import annotations

import functools
import socket
from collections.abc import Callable
from typing import Any, ClassVar

from sqlalchemy import Connection
from sqlalchemy.engine.interfaces import Dialect

from .base import DefaultImpl
from .sockets import shut, shut_transport

__all__ = ["MySQLImpl"]


class MySQLImpl(DefaultImpl):
    """MariaDB/MySQL. PyMySQL streams from its unbuffered cursor; PyMySQL's and asyncmy's
    sessions are interrupted by shutting their socket down."""

    name: ClassVar[str] = "mysql"
    transient_codes: ClassVar[frozenset[Any]] = frozenset(
        {
            1205,  # lock wait timeout
            1213,  # deadlock
            2002,  # cannot connect
            2003,  # cannot connect
            2006,  # server has gone away
            2013,  # lost connection during query
            2055,  # lost connection
            1927,  # connection killed (MariaDB)
            1053,  # server shutdown in progress
            3024,  # query execution interrupted, maximum statement execution time exceeded
            1684,  # table skipped: its definition is being changed by concurrent DDL (Galera)
            1047,  # Galera: the node is not ready (not in the primary component)
        }
    )
    read_only_codes: ClassVar[frozenset[Any]] = frozenset(
        {
            1290,  # the server runs with --read-only (read_only = ON)
            1836,  # running in read-only mode
        }
    )
    disk_full_codes: ClassVar[frozenset[Any]] = frozenset(
        {
            1021,  # disk full, waiting for someone to free space
            1114,  # the table is full (InnoDB could not extend its tablespace)
        }
    )

    schema_is_database: ClassVar[bool] = True
    galera_possible: ClassVar[bool] = True
    alters_online: ClassVar[bool] = True
    gap_locks: ClassVar[bool] = True

    def __init__(self, dialect: Dialect) -> None:
        super().__init__(dialect)
        self._pymysql = dialect.driver == "pymysql"

    def streaming_cursor(self, dbapi_connection: Any) -> Any | None:
        """PyMySQL's unbuffered cursor (`SSCursor`)."""
        if not self._pymysql:
            return None
        return dbapi_connection.cursor(self.dialect.loaded_dbapi.cursors.SSCursor)

    def abandon(self, cursor: Any) -> None:
        """Mark a PyMySQL unbuffered result of a lost connection finished. Closed, or
        collected, it would read the rest of the result from the closed socket and fail (an
        AttributeError, "Exception ignored" when collected: PyMySQL pull request #810, open)."""
        result = getattr(cursor, "_result", None)
        if getattr(result, "unbuffered_active", False):
            result.unbuffered_active = False  # type: ignore[union-attr]

    def short_lock_waits(
        self, conn: Connection, *, ms: int, seconds: int
    ) -> Callable[[], object] | None:
        """The session's `lock_wait_timeout` (metadata locks: whole seconds)."""
        before = conn.exec_driver_sql("SELECT @@SESSION.lock_wait_timeout").scalar_one()
        conn.exec_driver_sql(f"SET SESSION lock_wait_timeout = {seconds}")
        return lambda: conn.exec_driver_sql(f"SET SESSION lock_wait_timeout = {int(before)}")

    def interrupter(self, driver_connection: Any) -> Any:
        """Shut the socket down (PyMySQL's, or asyncmy's transport's): the blocked read fails
        at once as a lost connection; the server ends the transaction when it notices."""
        sock = getattr(driver_connection, "_sock", None)  # PyMySQL's
        if isinstance(sock, socket.socket):
            return functools.partial(shut, sock)
        transport = getattr(driver_connection, "_transport", None)  # asyncmy's transport
        if transport is not None:
            return functools.partial(shut_transport, transport)
        return None
