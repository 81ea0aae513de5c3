"""Errors: what is worth retrying becomes `StoreUnavailable`, the rest `StoreError`, each in
the same words on every dialect; passwords and task data never reach a message."""

from __future__ import annotations

import errno
import re
import sqlite3
from collections.abc import Iterator
from typing import Any, Final

from sqlalchemy import exc as sa_exc

from ..errors import StoreError, StoreUnavailable
from .mysql import MySQLImpl
from .postgresql import PostgresqlImpl
from .sqlite import SQLITE_FULL, SQLITE_TRANSIENT
from .urls import redact

# The codes are the database classes' (`transient_codes`, `read_only_codes`, `disk_full_codes`);
# an error is read by its shape (SQLite's exception, a MySQL driver's number, a SQLSTATE),
# which needs no engine to say which database raised it.
_MYSQL_TRANSIENT: Final = MySQLImpl.transient_codes
_PG_TRANSIENT_SQLSTATE: Final = tuple(sorted(PostgresqlImpl.transient_codes))
_MYSQL_READ_ONLY: Final = MySQLImpl.read_only_codes
_PG_READ_ONLY: Final = PostgresqlImpl.read_only_codes
_MYSQL_DISK_FULL: Final = MySQLImpl.disk_full_codes
_PG_DISK_FULL: Final = PostgresqlImpl.disk_full_codes


def read_only(exc: BaseException) -> bool:
    """Whether `exc` is a server refusing writes: a PostgreSQL hot standby (or a primary being
    demoted: SQLSTATE 25006), a MariaDB/MySQL server in read-only mode (errors 1290, 1836).

    That server is not the primary (now): the error is `StoreUnavailable`, and the connection
    that met it must be dropped, not pooled (`face.transaction` does), so that the next one
    asks the URL anew: a multi-host URL with target_session_attrs=read-write, or a DNS name
    that moved, reaches the new primary.
    """
    orig: Any = exc.orig if isinstance(exc, sa_exc.DBAPIError) else exc
    args: Any = getattr(orig, "args", ())
    if args and isinstance(args[0], int):  # MySQL drivers: (errno, message); PyMySQL also
        return args[0] in _MYSQL_READ_ONLY  # sets a generic sqlstate, HY000
    sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    return sqlstate in _PG_READ_ONLY


_NO_SPACE: Final = re.compile(r"No space left on device|[Ee]rror(?: number)? 28\b")
DISK_FULL: Final = "the database's disk is full"
"""How every dialect's full disk begins its message (`translate`)."""


def disk_full(exc: BaseException) -> bool:
    """Whether `exc` is the database running out of disk: SQLite's SQLITE_FULL, PostgreSQL's
    53100 (or a message saying ENOSPC: a PANIC on a full pg_wal ends the session with it),
    MariaDB/MySQL's 1021 and 1114, or an OS error 28 in its message.

    Transient: freeing space is all it takes, and a retry of the same batch then lands."""
    orig: Any = exc.orig if isinstance(exc, sa_exc.DBAPIError) else exc
    if isinstance(orig, sqlite3.Error):
        return getattr(orig, "sqlite_errorcode", 0) & 0xFF == SQLITE_FULL
    args: Any = getattr(orig, "args", ())
    if args and isinstance(args[0], int) and args[0] in _MYSQL_DISK_FULL:
        return True
    if (getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)) in _PG_DISK_FULL:
        return True
    return orig is not None and bool(_NO_SPACE.search(str(orig)))


def _is_transient(exc: sa_exc.DBAPIError) -> bool:
    if exc.connection_invalidated or read_only(exc) or disk_full(exc):
        return True
    orig: Any = exc.orig
    if isinstance(orig, sqlite3.Error):
        code = getattr(orig, "sqlite_errorcode", None)
        if code is not None:
            return code & 0xFF in SQLITE_TRANSIENT
        return "locked" in str(orig) or "busy" in str(orig)
    args = getattr(orig, "args", ())
    if args and isinstance(args[0], int):  # MySQL drivers: (errno, message)
        return args[0] in _MYSQL_TRANSIENT
    sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    if isinstance(sqlstate, str):
        return sqlstate.startswith(_PG_TRANSIENT_SQLSTATE)
    return isinstance(exc, sa_exc.OperationalError) and type(orig).__module__.startswith("psycopg")


_CAUSES: Final = (
    (
        re.compile(
            r"Access denied for user '([^']*)'"
            r"|password authentication failed for user \"([^\"]*)\""
            r"|role \"([^\"]*)\" does not exist"
        ),
        "access denied for user {!r}: check the URL's user and password",
    ),
    (
        re.compile(r"Unknown database '([^']*)'|database \"([^\"]*)\" does not exist"),
        "no database {!r} on this server: create it, or fix the URL's database name",
    ),
    (
        re.compile(
            r"Can't connect to (?:MySQL|local MySQL) server|Connection refused"
            r"|failed to resolve host|Name or service not known|could not translate host name"
            r"|No route to host|timeout expired|Connection timed out|No such file or directory"
        ),
        "cannot reach the server: is it running, and are the URL's host and port right?",
    ),
)
"""Driver messages of one cause on every dialect (PostgreSQL's libpq and MariaDB's), and the
one wording `describe` gives it."""


def missing_table(exc: sa_exc.DBAPIError) -> bool:
    """Whether `exc` says a table does not exist (PostgreSQL 42P01, MySQL 1146, SQLite's "no
    such table"): the store's tables are not where the statement looked."""
    orig: Any = exc.orig
    if isinstance(orig, sqlite3.Error):
        return str(orig).startswith("no such table")
    args = getattr(orig, "args", ())
    if args and isinstance(args[0], int):
        return args[0] == 1146
    return getattr(orig, "sqlstate", None) == "42P01"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and every error in its chain (causes and contexts, depth first), each once."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += (e.__cause__, e.__context__)


def describe(exc: BaseException) -> str | None:
    """The cause of a failed connection in the same words on every dialect (access denied,
    unknown database, unreachable server), or None: MariaDB's driver tuples such as
    `(1045, "Access denied ...")` and libpq's "FATAL: role ..." say one thing three ways.

    Looks through `exc`'s chain, so a `StoreError` raised from a driver error is described too.
    """
    for e in _chain(exc):
        if isinstance(e, sa_exc.DBAPIError) and e.orig is not None:
            text = str(e.orig)
            for pattern, words in _CAUSES:
                found = pattern.search(text)
                if found is not None:
                    name = next((g for g in found.groups() if g is not None), None)
                    return redact(words.format(name) if name is not None else words)
    return None


def hide_parameters(exc: BaseException) -> None:
    """Drop the bound parameters from every SQLAlchemy error in `exc`'s chain, in place.

    They are task data (payloads, labels: often personal data), and a chained error prints
    them in every traceback and `log.exception` of the store's error, whatever the engine's
    own `hide_parameters`. Emptied, not just flagged hidden: nothing keeps them alive.
    """
    for e in _chain(exc):
        if isinstance(e, sa_exc.StatementError):
            e.params = None
            e.hide_parameters = True


def translate(exc: BaseException) -> StoreError:
    """The store error for a database or pool exception (raise it `from exc`).

    `exc` loses its statement parameters here (`hide_parameters`), so the chain of the error
    raised from it shows no task data.

    Args:
        exc: What the driver, SQLAlchemy or the pool raised (a `StoreError` passes through).

    Returns:
        `StoreUnavailable` for what is worth retrying (a lost or refused connection, a busy or
        locked database, a timeout, a read-only server), else `StoreError`; the message in
        the words of `describe` where it knows the cause, passwords masked.

    Raises nothing: the error is returned, for the caller to raise from `exc`.
    """
    hide_parameters(exc)
    if isinstance(exc, StoreError):
        return exc
    if isinstance(exc, sa_exc.TimeoutError):  # the pool ran dry
        return StoreUnavailable(redact(f"no database connection available: {exc}"))
    if isinstance(exc, sa_exc.DBAPIError):
        message = (
            describe(exc) or redact(str(exc.orig) if exc.orig is not None else str(exc)).strip()
        )
        if disk_full(exc):
            return StoreUnavailable(f"{DISK_FULL}: free space, then retry ({message})")
        if _is_transient(exc):
            return StoreUnavailable(message)
        return StoreError(message)
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return StoreUnavailable(redact(f"{DISK_FULL}: free space, then retry ({exc})"))
    if isinstance(exc, ConnectionError | TimeoutError):
        return StoreUnavailable(redact(str(exc)))
    return StoreError(redact(f"{type(exc).__name__}: {exc}"))
