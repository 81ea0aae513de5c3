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
from typing import Any, cast

from sqlalchemy import Column, Connection
from sqlalchemy import exc as sa_exc

__all__ = ["TESTED_ON", "copy_column", "driver_error", "logs_statements", "transaction_listeners"]

TESTED_ON = ("2.0.30", "2.1.9")
"""The SQLAlchemy versions this module is tested on: pyproject's floor and the newest."""


def logs_statements(conn: Connection) -> bool:
    """Whether SQLAlchemy logs `conn`'s statements: the engine made with `echo`, or the
    `sqlalchemy.engine` logger at INFO. (`Engine.logger` is SQLAlchemy's own; it is what
    `Connection` asks when it opens, but per statement here, as logging can be set any time.)
    """
    logger: Any = conn.engine.logger
    return bool(logger.isEnabledFor(logging.INFO))


def transaction_listeners(conn: Connection) -> tuple[list[Any], bool] | None:
    """The listeners of `conn`'s `begin` event, and whether anything listens to its `commit`
    or `rollback`; None when that cannot be told (listeners on the connection itself, or an
    engine whose dispatch is joined to another's: an `execution_options` copy). SQLAlchemy's
    event dispatch (`Engine.dispatch`, its `listeners` and `parent_listeners`) is read as
    its own `Connection._has_events` test reads it; not documented."""
    if conn._has_events:
        return None
    d: Any = conn.engine.dispatch
    try:
        begin = [*d.begin.parent_listeners, *d.begin.listeners]
        ends = bool(
            d.commit.parent_listeners
            or d.commit.listeners
            or d.rollback.parent_listeners
            or d.rollback.listeners
        )
    except AttributeError:
        return None
    return begin, ends


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
