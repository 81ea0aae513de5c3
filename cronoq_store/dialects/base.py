"""One class per database, Alembic's `DefaultImpl` way: `DefaultImpl` says what every
database does, and each subclass (`SQLiteImpl`, `PostgresqlImpl`, `MySQLImpl`) overrides
what its database does differently. So a difference between databases is a method override,
never a test of a dialect or driver name in the code that uses it.

A subclass registers itself by its `name` (`dialects.name`: MariaDB is "mysql"); one
instance is made per SQLAlchemy dialect, that is once per engine, and kept
(`dialect_of`). What a subclass may depend on beyond its database (the driver, sync or
asyncio) it reads once, when it is made.

The public surface, all on `DefaultImpl`:
- `name`, `dialect`: which database, and SQLAlchemy's dialect of the engine;
- `pipelined`, `copies`, `binds_arrays`, `loses_connections`: what the driver can do;
- `streaming_cursor`, `abandon`: cursors that hold a chunk of a result at a time;
- `copy_rows`: a bulk load (COPY), where `copies`;
- `interrupter`: how another thread stops the session's wait (the watchdog's);
- `transient_codes`, `read_only_codes`, `disk_full_codes`: the server's error codes that
  `translation` reads.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from sqlalchemy import Connection, Engine
from sqlalchemy.engine.interfaces import Dialect

from .statements import name as dialect_name

__all__ = ["DefaultImpl", "dialect_of"]


class DefaultImpl:
    """What the store does on a database that no subclass speaks for: no pipeline, no COPY,
    IN lists as lists, results read through SQLAlchemy, and no way to interrupt a session.
    Subclasses override what their database does better."""

    name: ClassVar[str] = "default"
    """The database, as `dialects.name` says it: "sqlite", "postgresql" or "mysql"."""

    transient_codes: ClassVar[frozenset[Any]] = frozenset()
    """Error codes worth retrying (SQLite's primary codes, MySQL's numbers, PostgreSQL's
    SQLSTATEs and their classes)."""
    read_only_codes: ClassVar[frozenset[Any]] = frozenset()
    """Error codes of a server that refuses writes (not the primary now)."""
    disk_full_codes: ClassVar[frozenset[Any]] = frozenset()
    """Error codes of a server whose disk is full."""

    _registry: ClassVar[dict[str, type[DefaultImpl]]] = {}

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        DefaultImpl._registry[cls.name] = cls

    def __init__(self, dialect: Dialect) -> None:
        self.dialect = dialect
        """SQLAlchemy's dialect of the engine this instance serves."""
        self.pipelined = False
        """Statements can be sent without waiting for each answer (`execution.Flight`)."""
        self.copies = False
        """Rows can be loaded with COPY FROM STDIN (`copy_rows`)."""
        self.binds_arrays = False
        """An IN list runs better as one array parameter (`execution.run_in`)."""
        self.loses_connections = True
        """A connection can be lost under the store (a server's); a file's never is."""

    def streaming_cursor(self, dbapi_connection: Any) -> Any | None:
        """A DB-API cursor of `dbapi_connection` that holds no more than a chunk of a result
        at a time (`execution.stream`); None where none is known (SQLAlchemy's result then)."""
        return None

    def abandon(self, cursor: Any) -> None:
        """Mark what `cursor` has left to read finished, its connection being lost: closing
        it must not read from the server."""

    def copy_rows(
        self,
        cursor: Any,
        sql: str,
        rows: Sequence[Mapping[str, Any]],
        values: Callable[[Mapping[str, Any]], Any],
    ) -> None:
        """Load `rows` with the COPY statement `sql` on the driver's `cursor`, each row as
        `values(row)` in the statement's column order. Only where `copies`; the caller owns
        the cursor (and closes it) and wraps the driver's errors."""
        raise NotImplementedError(f"no COPY on {self.name}")

    def interrupter(self, driver_connection: Any) -> Callable[[], None] | None:
        """How another thread stops whatever the session of `driver_connection` (a driver's
        connection) waits on (None: no way known), for an operation's deadline
        (`execution.Watchdog`). Safe to call from any thread, and it never blocks: no new
        connection to the server."""
        return None


_IMPLS: weakref.WeakKeyDictionary[Dialect, DefaultImpl] = weakref.WeakKeyDictionary()


def dialect_of(where: Engine | Connection | Dialect) -> DefaultImpl:
    """The class of `where`'s database, made once per SQLAlchemy dialect (once per engine)
    and kept as long as that dialect is.

    Args:
        where: An engine, a connection, or SQLAlchemy's dialect of one.
    """
    dialect = where.dialect if isinstance(where, (Engine, Connection)) else where
    impl = _IMPLS.get(dialect)
    if impl is None:
        cls = DefaultImpl._registry.get(dialect_name(dialect), DefaultImpl)
        impl = _IMPLS[dialect] = cls(dialect)
    return impl
