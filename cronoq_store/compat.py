"""What the store needs from SQLAlchemy beyond its documented API, in one place.

As Alembic's `util/sqla_compat.py` does: when a SQLAlchemy release moves one of these, this
module is the one to change. Tested on SQLAlchemy 2.0.30 (pyproject's floor: `make
test-lowest`) and the newest release (`make test-newest`; 2.1.9 when this was written).

The store runs most of its statements on the DB-API cursor, past SQLAlchemy's execution
(`execution.run`, PostgreSQL's COPY): these functions give such a statement what SQLAlchemy's
execution would have, SQLAlchemy's statement log (`logs_statements`) and its error wrapping
(`driver_error`). The compiler attributes `execution.driver_sql` and the IN-list runner read
(`bind_names`, `positiontup`, `construct_expanded_state`) are documented, and stay there.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, cast

from sqlalchemy import Column, Connection
from sqlalchemy import exc as sa_exc

__all__ = [
    "TESTED_ON",
    "TransactionListeners",
    "copy_column",
    "driver_error",
    "logs_statements",
    "transaction_listeners",
]

TESTED_ON = ("2.0.30", "2.1.9")
"""The SQLAlchemy versions this module is tested on: pyproject's floor and the newest."""


def logs_statements(conn: Connection) -> bool:
    """Whether SQLAlchemy logs `conn`'s statements: the engine made with `echo`, or the
    `sqlalchemy.engine` logger at INFO. (`Engine.logger` is SQLAlchemy's own; it is what
    `Connection` asks when it opens, but per statement here, as logging can be set any time.)
    """
    logger: Any = conn.engine.logger
    return bool(logger.isEnabledFor(logging.INFO))


class TransactionListeners:
    """The listeners SQLAlchemy calls when a transaction on one connection begins, commits or
    rolls back, pinned once per connection (`transaction_listeners`), so that a caller can
    tell on each transaction, at one builtin call, whether any came or went since it last
    looked: they did when `any(empty) or full != seen`. Then `take` hands the current ones
    over, and they count as seen from there on.

    An app may add a listener to its engine at any time: `event.listen` appends it to one of
    these very deques (`live`), which SQLAlchemy's dispatch reads; pinning them made the
    engine's and the connection's collections modifiable, as the first `event.listen` on
    them does (an empty one dispatches nothing). Those that were empty are only tested for
    emptiness (`empty`); the others (the store's own `begin`) compared with a copy, element
    by element (`full`, `seen`): a comparison of deques costs a pair of iterators even when
    both are empty."""

    __slots__ = ("empty", "full", "live", "seen")

    def __init__(self, live: tuple[deque[Any], ...]) -> None:
        self.live = live
        """Per event of `EVENTS`, the deques SQLAlchemy calls in that order: the
        `Connection` class's, the connection's, the `Engine` class's, the engine's."""
        self.empty: tuple[deque[Any], ...] = ()
        """Those of `live` that were empty when last taken."""
        self.full: tuple[deque[Any], ...] = ()
        """The others of `live`."""
        self.seen: tuple[deque[Any], ...] | None = None
        """A copy of each of `full` as it was when taken (None: never taken)."""

    def take(self) -> tuple[list[Any], bool]:
        """The `begin` listeners, in SQLAlchemy's order, and whether anything listens to a
        `commit` or a `rollback`; from now on seen."""
        copies = [deque(listeners) for listeners in self.live]
        self.empty = tuple(d for d, copy in zip(self.live, copies, strict=True) if not copy)
        self.full = tuple(d for d, copy in zip(self.live, copies, strict=True) if copy)
        self.seen = tuple(copy for copy in copies if copy)
        width = len(copies) // len(EVENTS)
        return [fn for listeners in copies[:width] for fn in listeners], any(copies[width:])


EVENTS = ("begin", "commit", "rollback")
"""The transaction events `TransactionListeners` pins, in the order of its `live`."""


def transaction_listeners(conn: Connection) -> TransactionListeners | None:
    """`conn`'s `TransactionListeners`; None when they cannot be pinned (a connection made
    with its own dispatch, or an engine whose dispatch is joined to another's: an
    `execution_options` copy). SQLAlchemy's event dispatch is read as its own `Connection`
    dispatches (`Connection.dispatch`, joined to `Engine.dispatch`; each collection's
    `parent_listeners` and `listeners`) and made modifiable as `event.listen` makes it
    (`for_modify`); not documented."""
    own: Any = conn.dispatch
    engine: Any = conn.engine.dispatch
    live: list[Any] = []
    try:
        for name in EVENTS:
            local = getattr(own, name).for_modify(own).local  # the connection's, joined
            mine = getattr(engine, name).for_modify(engine)
            live += (
                local.parent_listeners,
                local.listeners,
                mine.parent_listeners,
                mine.listeners,
            )
    except AttributeError:
        return None
    if not all(type(listeners) is deque for listeners in live):
        return None
    return TransactionListeners(tuple(live))


def driver_error(
    conn: Connection,
    exc: BaseException,
    statement: str,
    *,
    cursor: Any = None,
    many: bool = False,
) -> sa_exc.DBAPIError:
    """`exc`, a DB-API error that `statement` raised on `conn`'s driver connection, as
    SQLAlchemy's execution raises it: a `DBAPIError` of the matching subclass, parameters
    hidden (they are task data), and `conn` invalidated when the error says the connection is
    lost (so the pool drops it, and `connection_invalidated` tells callers so).

    Args:
        conn: The connection whose driver connection ran `statement`.
        exc: The driver's exception (an instance of the driver's `Error`).
        statement: The SQL that raised it.
        cursor: The driver cursor that ran it, if any (the dialect's disconnect test reads it).
        many: Whether it ran as executemany.

    Returns:
        The exception to raise (`raise driver_error(...) from exc`).
    """
    dbapi_error = conn.dialect.loaded_dbapi.Error
    invalidated = bool(
        isinstance(exc, dbapi_error)
        and conn.dialect.is_disconnect(exc, conn.connection.dbapi_connection, cursor)
    )
    if invalidated:
        conn.invalidate(exc)
    # `DBAPIError.instance` is how SQLAlchemy's execution wraps driver errors (not documented).
    wrapped = sa_exc.DBAPIError.instance(
        statement,
        None,
        exc,
        dbapi_error,
        hide_parameters=True,
        connection_invalidated=invalidated,
        dialect=conn.dialect,
        ismulti=many,
    )
    return cast(sa_exc.DBAPIError, wrapped)  # what it makes of a driver `Error`


def copy_column(column: Column[Any]) -> Column[Any]:
    """A copy of `column`, bound to no table, for another table or an `ALTER TABLE ... ADD`
    (`Column._copy`: SQLAlchemy's own, what `Table.to_metadata` copies columns with; not
    documented)."""
    return column._copy()
