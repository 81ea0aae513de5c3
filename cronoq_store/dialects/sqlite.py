"""SQLite (pysqlite, aiosqlite): a file, no server; interrupted by `interrupt()`."""

from __future__ import annotations

import sqlite3
from typing import Any, ClassVar, Final

from sqlalchemy.engine.interfaces import Dialect

from .base import DefaultImpl

__all__ = ["SQLITE_FULL", "SQLITE_TRANSIENT", "SQLiteImpl"]

SQLITE_TRANSIENT: Final = frozenset({5, 6})  # SQLITE_BUSY, SQLITE_LOCKED (primary codes)
SQLITE_FULL: Final = 13


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

    def interrupter(self, driver_connection: Any) -> Any:
        """`interrupt()`, which rolls back the transaction it stops (aiosqlite's connection
        once it runs)."""
        driver = driver_connection
        if not isinstance(driver, sqlite3.Connection):
            driver = getattr(driver, "_conn", None)  # aiosqlite's, once it runs
        return driver.interrupt if isinstance(driver, sqlite3.Connection) else None
