"""SQLite (pysqlite, aiosqlite): a file, no server; interrupted by `interrupt()`."""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Callable
from typing import Any, ClassVar, Final

from sqlalchemy import Engine
from sqlalchemy.engine.interfaces import Dialect

from .base import DefaultImpl, Risk, connect_with

__all__ = ["SQLITE_FULL", "SQLITE_TRANSIENT", "SQLiteImpl"]

SQLITE_TRANSIENT: Final = frozenset({5, 6})  # SQLITE_BUSY, SQLITE_LOCKED (primary codes)
SQLITE_FULL: Final = 13
_SYNCHRONOUS: Final = {"0": "off", "1": "normal", "2": "full", "3": "extra"}
"""`synchronous`'s levels by number, as `PRAGMA synchronous` prints them."""


class SQLiteImpl(DefaultImpl):
    """SQLite: its own cursor streams (it steps through a result as it is fetched), and a
    connection to a file is never lost."""

    name: ClassVar[str] = "sqlite"
    transient_codes: ClassVar[frozenset[Any]] = SQLITE_TRANSIENT
    disk_full_codes: ClassVar[frozenset[Any]] = frozenset({SQLITE_FULL})
    server: ClassVar[bool] = False
    sync_per_connection: ClassVar[bool] = True

    def __init__(self, dialect: Dialect) -> None:
        super().__init__(dialect)
        self._pysqlite = dialect.driver == "pysqlite"

    def streaming_cursor(self, dbapi_connection: Any) -> Any | None:
        """pysqlite's plain cursor (aiosqlite's only SQLAlchemy drives)."""
        return dbapi_connection.cursor() if self._pysqlite else None

    def numbers_in_order(self, driver_connection: Any) -> bool:
        """In one transaction (one begun, or one the driver begins before a write; not one per
        row, the driver's autocommit), SQLite's single writer holds the write lock from the
        first INSERT on: AUTOINCREMENT numbers the rows one after another."""
        driver = driver_connection  # sqlite3's or aiosqlite's: both say so alike
        if driver.in_transaction:
            return True
        legacy = getattr(driver, "autocommit", -1) == -1  # sqlite3.LEGACY_TRANSACTION_CONTROL
        return bool(legacy and driver.isolation_level is not None)

    def committer(self, dbapi_connection: Any) -> Callable[[], object]:
        """sqlite3's own connection: a COMMIT from its statement cache. Its `commit()`
        compiles the statement anew each time: on a leader's batch-1 commit, right after a
        flush has left the CPU's caches to others, about 3 us of CPU. A connection of
        another class (the testing kit's hooked `commit`) keeps its `commit`."""
        if type(dbapi_connection) is sqlite3.Connection:
            return functools.partial(dbapi_connection.execute, "COMMIT")
        return super().committer(dbapi_connection)

    def interrupter(self, driver_connection: Any) -> Any:
        """`interrupt()`, which rolls back the transaction it stops (aiosqlite's connection
        once it runs)."""
        driver = driver_connection
        if not isinstance(driver, sqlite3.Connection):
            driver = getattr(driver, "_conn", None)  # aiosqlite's, once it runs
        return driver.interrupt if isinstance(driver, sqlite3.Connection) else None

    acknowledged: ClassVar[str] = (
        "SQLite has fsynced the write-ahead log (journal_mode=wal, synchronous=FULL or EXTRA: "
        "StoreConfig.full_sync, the default)"
    )

    durability_risks: ClassVar[tuple[Risk, ...]] = (
        Risk(
            "journal_mode",
            lambda value: value in ("memory", "off"),
            "no journal on disk: a crash mid-commit can corrupt the database",
        ),
        Risk(
            "synchronous",
            lambda value: _SYNCHRONOUS.get(value, value) == "off",
            "SQLite never fsyncs: a power loss or OS crash loses "
            "acknowledged commits and can corrupt the database",
        ),
        Risk(
            "synchronous",
            lambda value: _SYNCHRONOUS.get(value, value) == "normal",
            "SQLite does not fsync each commit (StoreConfig.full_sync "
            "off): a power loss or OS crash loses the last acknowledged commits",
        ),
    )
    """No journal on disk, or `synchronous` below FULL (by name or number)."""

    def hook_cursors(self, engine: Engine, hooked: Callable[[type[Any]], type[Any]]) -> bool:
        """pysqlite: a connection factory whose `cursor()` makes hooked cursors."""
        if not self._pysqlite:
            return False

        def factory(base: type[sqlite3.Connection]) -> type[sqlite3.Connection]:
            cursor_class = hooked(sqlite3.Cursor)

            class Hooked(base):  # type: ignore[valid-type,misc]
                def cursor(self, factory: Any = None) -> Any:
                    return super().cursor(factory or cursor_class)

            return Hooked

        connect_with(engine, "factory", sqlite3.Connection, factory)
        return True

    def hook_commits(self, engine: Engine, committing: Callable[[type[Any]], type[Any]]) -> bool:
        """pysqlite: a connection factory."""
        if not self._pysqlite:
            return False
        connect_with(engine, "factory", sqlite3.Connection, committing)
        return True

    async_driver: ClassVar[str | None] = "aiosqlite"
    sync_drivers: ClassVar[frozenset[str]] = frozenset({"pysqlite"})
    checkpoint_sql: ClassVar[str | None] = "PRAGMA wal_checkpoint(TRUNCATE)"
