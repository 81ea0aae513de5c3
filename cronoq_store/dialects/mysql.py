"""MariaDB and MySQL (PyMySQL, asyncmy): unbuffered cursors, sockets shut to interrupt."""

from __future__ import annotations

import functools
import importlib
import socket
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, ClassVar, Final

from sqlalchemy import Connection, Engine, Select
from sqlalchemy.engine.interfaces import Dialect

from .base import (
    DefaultImpl,
    connect_with,
    reclass_connections,
    setting_is_on,
    setting_of,
)
from .sockets import shut, shut_transport

__all__ = ["IDLE_INFO", "JEPSEN_GALERA", "MySQLImpl"]


class MySQLImpl(DefaultImpl):
    """MariaDB/MySQL. PyMySQL streams from its unbuffered cursor; PyMySQL's and asyncmy's
    sessions are interrupted by shutting their socket down."""

    name: ClassVar[str] = "mysql"
    schema_word: ClassVar[str | None] = "MySQL database"
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

    acknowledged: ClassVar[str] = (
        "InnoDB has written and flushed its redo log for the commit "
        "(innodb_flush_log_at_trx_commit=1), and, with a binary log, the binary log too "
        "(sync_binlog=1)"
    )

    @classmethod
    def unsafe_durability(cls, settings: Mapping[str, Any]) -> list[tuple[str, str]]:
        """InnoDB's redo log not flushed at each commit, no doublewrite buffer, a binary log
        not synced at each commit, and any Galera node (`JEPSEN_GALERA`)."""
        unsafe: list[tuple[str, str]] = []
        flush = setting_of(settings, "innodb_flush_log_at_trx_commit")
        if flush is not None and flush != "1":
            unsafe.append(
                (
                    "innodb_flush_log_at_trx_commit",
                    "the redo log is not flushed at each "
                    "commit: a crash (of the machine with 2, of the server with 0) loses up "
                    "to a second of acknowledged commits",
                )
            )
        if setting_of(settings, "innodb_doublewrite") in ("off", "0"):
            unsafe.append(
                (
                    "innodb_doublewrite",
                    "a page torn by a power loss cannot be repaired: "
                    "committed rows can be lost or the tablespace corrupted",
                )
            )
        sync_binlog = setting_of(settings, "sync_binlog")
        if setting_is_on(settings, "log_bin") and sync_binlog is not None and sync_binlog != "1":
            unsafe.append(
                (
                    "sync_binlog",
                    "the binary log is not flushed at each commit: after a crash "
                    "of the machine, replicas and point-in-time recovery miss acknowledged "
                    "commits",
                )
            )
        if setting_is_on(settings, "wsrep_on"):
            unsafe.append(("wsrep_on", f"a Galera node: {JEPSEN_GALERA}"))
        return unsafe

    def hook_cursors(self, engine: Engine, hooked: Callable[[type[Any]], type[Any]]) -> bool:
        """PyMySQL: its `cursorclass`."""
        if not self._pymysql:
            return False
        cursors: Any = importlib.import_module("pymysql.cursors")  # no type stubs
        connect_with(engine, "cursorclass", cursors.Cursor, hooked)
        return True

    def hook_commits(self, engine: Engine, committing: Callable[[type[Any]], type[Any]]) -> bool:
        """PyMySQL: each connection becomes one of `committing`'s class."""
        if not self._pymysql:
            return False
        reclass_connections(engine, committing)
        return True

    def bounds_idle(self) -> bool:
        """MariaDB 10.3+'s `idle_transaction_timeout`; MySQL has no such setting."""
        if not getattr(self.dialect, "is_mariadb", False):
            return False
        version = self.dialect.server_version_info or (0,)
        return tuple(version[:2]) >= (10, 3)

    def bound(
        self,
        conn: Connection,
        *,
        idle: timedelta | None,
        timeout: timedelta | None,
        idle_too: bool,
        defer: bool,
        lock: timedelta | None,
    ) -> tuple[Select[Any], dict[str, str]] | None:
        """Session settings, sent only when they change: the lock waits (whole seconds) and,
        on MariaDB 10.3+, `idle_transaction_timeout`. Nothing is deferred."""
        if timeout is not None:
            # Whole seconds: the statement's bound rounded up (the watchdog ends the
            # transaction on time), a shorter lock bound rounded down (its wait must end
            # before a renewal's).
            if lock is not None and lock < timeout:
                seconds = max(1, lock // timedelta(seconds=1))
            else:
                seconds = max(1, -(-timeout // timedelta(seconds=1)))
            if conn.info.get("cronoq_lock_wait_s") != seconds:
                # Row locks (InnoDB) and table locks (metadata: an ALTER TABLE under way).
                conn.exec_driver_sql(
                    f"SET SESSION innodb_lock_wait_timeout = {seconds}, "
                    f"lock_wait_timeout = {seconds}"
                )
                conn.info["cronoq_lock_wait_s"] = seconds
        if not idle_too or not self.bounds_idle():
            return None
        seconds = 0 if idle is None else max(1, -(-idle // timedelta(seconds=1)))
        if conn.info.get(IDLE_INFO, 0) != seconds:
            value = str(seconds) if seconds else "DEFAULT"
            conn.exec_driver_sql(f"SET SESSION idle_transaction_timeout = {value}")
            conn.info[IDLE_INFO] = seconds
        return None

    async_driver: ClassVar[str | None] = "asyncmy"
    sync_drivers: ClassVar[frozenset[str]] = frozenset({"pymysql"})
    wire: ClassVar[str | None] = "mysql"
    default_port: ClassVar[int | None] = 3306
    explain_json: ClassVar[str | None] = "EXPLAIN FORMAT=JSON"
    analyze_sql: ClassVar[str | None] = "ANALYZE TABLE"

    def server_name(self) -> str:
        """MariaDB by its own name."""
        return "mariadb" if getattr(self.dialect, "is_mariadb", False) else self.name


IDLE_INFO: Final = "cronoq_idle_s"
"""`Connection.info` key: the MariaDB session's idle_transaction_timeout as we last set it."""

JEPSEN_GALERA: Final = (
    "Jepsen's analysis of MariaDB Galera Cluster 12.1.2 (2026-03) found committed "
    "transactions lost: under the recommended settings when nodes crash in quick succession "
    "(no flush before acknowledgement), and occasionally with process crashes and network "
    "partitions even with innodb_flush_log_at_trx_commit=1"
)
"""Why a Galera node is never called safe (https://jepsen.io/analyses)."""
