"""The migration lock: one cross-process lock per database, taken its dialect's way."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Final

from sqlalchemy import Connection, func, select
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
    """Hold the migration lock on `conn` (which must be in a transaction) for the block.

    Yields `renew`, which the migration calls after each revision step, in the transaction that
    writes the step's version row: it extends a lock that can expire (Galera's) and fails if the
    lock was lost. `schema`: the database (MySQL) whose lock this is, if not `conn`'s own.
    """
    dialect = name(conn.dialect)
    if dialect == "sqlite":
        # The write transaction is the lock. An engine of ours began it with BEGIN IMMEDIATE;
        # on an app's engine pysqlite has not started one yet, so take it here.
        driver = conn.connection.driver_connection  # sqlite3's, or aiosqlite's
        if driver is not None and not driver.in_transaction:
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        yield _no_renewal
    elif dialect == "postgresql":
        conn.execute(select(func.pg_advisory_xact_lock(MIGRATION_LOCK_KEY)))
        yield _no_renewal
    elif dialect == "mysql" and galera.is_galera(conn):
        # GET_LOCK holds on one node only: a row certification makes cluster-wide (galera.py).
        holder = galera.new_holder()
        galera.acquire(conn, holder, timeout_s=MIGRATION_LOCK_TIMEOUT_S, schema=schema)
        try:
            yield functools.partial(galera.renew, conn, holder, schema=schema)
            conn.exec_driver_sql("COMMIT")  # the last version row, before the lock is free
        except BaseException:
            # Freeing commits: the failed run's uncommitted writes must not ride along. A dead
            # session cannot free it: the lock then expires (galera.LOCK_TTL_S).
            if not conn.invalidated:
                with contextlib.suppress(sa_exc.SQLAlchemyError):
                    conn.exec_driver_sql("ROLLBACK")
                    galera.release(conn, holder, schema=schema)
            raise
        galera.release(conn, holder, schema=schema)
    elif dialect == "mysql":
        # MySQL commits DDL implicitly, so the lock must outlive transactions: a named lock.
        got = conn.execute(
            select(func.get_lock(MIGRATION_LOCK_NAME, MIGRATION_LOCK_TIMEOUT_S))
        ).scalar()
        if got != 1:
            raise StoreUnavailable("timed out waiting for the migration lock")
        try:
            yield _no_renewal
            # The lock outlives the transaction too: commit the last version-table write
            # before the next process may read it, or it would run the same step again.
            conn.exec_driver_sql("COMMIT")
        finally:
            # A session the server ended took its lock with it; releasing it on the dead
            # connection would only hide why the migration failed (PendingRollbackError).
            if not conn.invalidated:
                conn.execute(select(func.release_lock(MIGRATION_LOCK_NAME)))
    else:
        raise StoreError(f"unsupported dialect {conn.dialect.name!r}")
