"""The migration lock: one cross-process lock per database, taken its dialect's way."""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, Final

try:
    import fcntl
except ImportError:  # Windows: one process migrates at a time, by the operator's care
    fcntl = None  # type: ignore[assignment]

from sqlalchemy import Connection, Select, func, select
from sqlalchemy import exc as sa_exc

from .. import galera
from ..errors import StoreError, StoreUnavailable
from .statements import name

MIGRATION_LOCK_KEY: Final = 0x63726F6E6F71  # "cronoq"
MIGRATION_LOCK_NAME: Final = "cronoq_store.migrate"
MIGRATION_LOCK_TIMEOUT_S: Final = 300


def _no_renewal() -> None:
    """What a migration lock that needs no renewal hands out."""


@contextlib.contextmanager
def migration_lock(conn: Connection, *, schema: str | None = None) -> Iterator[Callable[[], None]]:
    """Hold the migration lock on `conn` for the block, across the transactions it commits.

    The migrations run online (`cronoq_store.ddl`): each revision step commits on its own, and
    PostgreSQL builds indexes outside any transaction, so the lock is the session's, not a
    transaction's. `conn` must not be in a transaction; it is handed back outside one.

    Yields `renew`, which the migration calls after each revision step, in the transaction that
    writes the step's version row: it extends a lock that can expire (Galera's) and fails if the
    lock was lost. `schema`: the database (MySQL) whose lock this is, if not `conn`'s own.
    """
    dialect = name(conn.dialect)
    if dialect == "sqlite":
        with _sqlite_file_lock(conn):
            yield _no_renewal
    elif dialect == "postgresql":
        _pg_lock(conn)
        try:
            yield _no_renewal
        finally:
            _unlock(conn, select(func.pg_advisory_unlock(MIGRATION_LOCK_KEY)))
    elif dialect == "mysql" and galera.is_galera(conn):
        # GET_LOCK holds on one node only: a row certification makes cluster-wide (galera.py).
        holder = galera.new_holder()
        galera.acquire(conn, holder, timeout_s=MIGRATION_LOCK_TIMEOUT_S, schema=schema)
        conn.commit()
        try:
            yield functools.partial(galera.renew, conn, holder, schema=schema)
            if conn.in_transaction():
                conn.commit()  # the last version row, before the lock is free
        except BaseException:
            # Freeing commits: the failed run's uncommitted writes must not ride along. A dead
            # session cannot free it: the lock then expires (galera.LOCK_TTL_S).
            if not conn.invalidated:
                with contextlib.suppress(sa_exc.SQLAlchemyError):
                    conn.rollback()
                    galera.release(conn, holder, schema=schema)
                    conn.commit()
            raise
        galera.release(conn, holder, schema=schema)
        conn.commit()
    elif dialect == "mysql":
        # MySQL commits DDL implicitly, so the lock must outlive transactions: a named lock.
        got = conn.execute(
            select(func.get_lock(MIGRATION_LOCK_NAME, MIGRATION_LOCK_TIMEOUT_S))
        ).scalar()
        conn.commit()
        if got != 1:
            raise StoreUnavailable("timed out waiting for the migration lock")
        try:
            yield _no_renewal
            # The lock outlives the transaction too: commit the last version-table write
            # before the next process may read it, or it would run the same step again.
            if conn.in_transaction():
                conn.commit()
        finally:
            _unlock(conn, select(func.release_lock(MIGRATION_LOCK_NAME)))
    else:
        raise StoreError(f"unsupported dialect {conn.dialect.name!r}")


def _pg_lock(conn: Connection) -> None:
    """Take the session's advisory lock, polling: a session blocked in `pg_advisory_lock`
    holds a snapshot, which a concurrent index build of the holder would wait for (a deadlock);
    between polls this one holds nothing."""
    deadline = time.monotonic() + MIGRATION_LOCK_TIMEOUT_S
    pause = 0.01
    while True:
        got = conn.execute(select(func.pg_try_advisory_lock(MIGRATION_LOCK_KEY))).scalar()
        conn.commit()
        if got:
            return
        if time.monotonic() + pause > deadline:
            raise StoreUnavailable("timed out waiting for the migration lock")
        time.sleep(pause)
        pause = min(pause * 2, 0.25)


@contextlib.contextmanager
def _sqlite_file_lock(conn: Connection) -> Iterator[None]:
    """The lock of a SQLite database: an exclusive `flock` on `<file>-migrate.lock` beside
    it, which the OS frees when the process ends, however it ends. (Not the write
    transaction: a migration commits many short ones, for the leader's commits between.)
    The holder removes the file before it lets go, so none is left behind; a taker that got
    the lock of a file since removed (or replaced) takes it anew. A database in memory has no
    other process: nothing to lock."""
    row = conn.exec_driver_sql("PRAGMA database_list").first()
    if conn.in_transaction():
        conn.commit()
    path = f"{row[2]}-migrate.lock" if row is not None and row[2] else ""
    if not path or fcntl is None:
        yield
        return
    fd = _take_file_lock(path)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)  # frees the lock


def _take_file_lock(path: str) -> int:
    assert fcntl is not None
    deadline = time.monotonic() + MIGRATION_LOCK_TIMEOUT_S
    pause = 0.01
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() + pause > deadline:
                raise StoreUnavailable("timed out waiting for the migration lock") from None
            time.sleep(pause)
            pause = min(pause * 2, 0.25)
            continue
        try:
            current = os.stat(path).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(fd).st_ino:
            return fd
        os.close(fd)  # the holder removed it as we took it: take the new one


def _unlock(conn: Connection, unlock: Select[Any]) -> None:
    """Free a session's lock with `unlock` once the migration is over, never raising over the
    migration's own error. A session the server ended took its lock with it: releasing it on
    the dead connection would only hide why the migration failed (PendingRollbackError)."""
    if not conn.invalidated:
        with contextlib.suppress(sa_exc.SQLAlchemyError):
            if conn.in_transaction():
                conn.rollback()
            conn.execute(unlock)
            conn.commit()
