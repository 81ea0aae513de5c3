"""The migration lock on MariaDB Galera: a row that certification makes cluster-wide.

On one MariaDB server `GET_LOCK` serializes migrations, but on Galera it holds on one node only:
processes opening a fresh database on two nodes at once both found a table missing and both
created it (1050 "already exists", 1061 "duplicate key name", 1684 "concurrent DDL"). Retrying
the DDL alone would not be enough: Alembic reads the version table once and then writes its
rows, so two unserialized runs can leave two heads behind.

So on Galera the lock is a row, `cronoq_migration_lock` (id 1: holder, expiry on the
database's clock), taken by a committed `UPDATE ... WHERE holder IS NULL OR expired`. Two nodes
that take it at once both see it free and both commit; Galera certifies the two write sets in
one total order, so the first wins and the other's commit fails with 1213 (deadlock), and a
node that has already applied the winner's write finds the row held. Exactly one process
holds it, on any node. A write set is applied on every node in that same order before a later
commit returns there, so the holder reads the version table as the previous holder left it.

A lock that outlives sessions needs an expiry, or a migrator killed while holding it would
block every open for good: `LOCK_TTL_S`, renewed after every revision step in the transaction
that writes that step's version row (`renew`). If a slow step lets the lock expire and another
process takes it, that transaction and the other's take conflict in certification, so at most
one of the two version-table writes lands and the loser fails as `StoreUnavailable`; the DDL
steps themselves are guarded (`cronoq_store.ddl`), so the next holder completes what either
left half done.
"""

from __future__ import annotations

__all__ = [
    "LOCK_TABLE",
    "LOCK_TTL_S",
    "acquire",
    "causal_reads",
    "is_galera",
    "release",
    "renew",
]

import contextlib
import os
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Final

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    MetaData,
    SmallInteger,
    String,
    Table,
    insert,
    inspect,
    or_,
    select,
    update,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.schema import CreateTable

from .dialects.base import dialect_of
from .dialects.statements import db_now_ns
from .errors import StoreUnavailable

LOCK_TABLE: Final = "cronoq_migration_lock"
"""The lock's table: one row, beside the store's tables, outside the Alembic history."""
LOCK_TTL_S: Final = 60.0
"""How long a taken or renewed lock holds without renewal: a killed migrator's lock is free
after this; every revision step renews it (a first migration takes well under a second)."""

_ROW: Final = 1


def lock_table(schema: str | None = None) -> Table:
    """The lock table, in `schema` (a MySQL database) or the connection's own."""
    return Table(
        LOCK_TABLE,
        MetaData(schema=schema),
        Column("id", SmallInteger(), primary_key=True, autoincrement=False),
        Column("holder", String(128), nullable=True),
        Column("expires_unix_ns", BigInteger(), nullable=False),
        mysql_engine="InnoDB",
    )


def is_galera(conn: Connection) -> bool:
    """Whether the server is a Galera node (`wsrep_on`); MySQL without it has no such variable."""
    row = conn.exec_driver_sql("SHOW GLOBAL VARIABLES LIKE 'wsrep_on'").first()
    return row is not None and str(row[1]).upper() == "ON"


@contextlib.contextmanager
def causal_reads(conn: Connection) -> Iterator[None]:
    """Reads in the block see every transaction the cluster committed before they began.

    A node applies other nodes' write sets a moment after they commit, so a process that
    opens the store through node 3 just after a deploy step migrated it through node 1 read an
    old revision and was refused ("behind this build", 2 of 5 trials here). Galera's
    `wsrep_sync_wait` (1: reads) makes a read wait until the node has caught up; the session's
    own setting is put back afterwards. Nothing on a server that is not a Galera node.
    """
    if not dialect_of(conn).galera_possible or not is_galera(conn):
        yield
        return
    before = int(conn.exec_driver_sql("SELECT @@SESSION.wsrep_sync_wait").scalar_one())
    conn.exec_driver_sql(f"SET SESSION wsrep_sync_wait = {before | 1}")
    try:
        yield
    finally:
        if not conn.invalidated:
            with contextlib.suppress(sa_exc.SQLAlchemyError):
                conn.exec_driver_sql(f"SET SESSION wsrep_sync_wait = {before}")


def new_holder() -> str:
    """A name no other process uses, readable by an operator: host, pid, a random part."""
    return f"{socket.gethostname()[:64]}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


def _retryable(exc: sa_exc.DBAPIError) -> bool:
    """A certification conflict (1213), a lock wait (1205) or concurrent DDL (1684)."""
    args: tuple[object, ...] = tuple(getattr(exc.orig, "args", ()))
    return bool(args) and args[0] in (1205, 1213, 1684)


def acquire(
    conn: Connection, holder: str, *, timeout_s: float, poll_s: float = 0.2, schema: str | None
) -> None:
    """Take the lock for `holder`, waiting up to `timeout_s`; commits what it wrote.

    `conn` must not hold uncommitted work of its caller: each attempt ends in a COMMIT.
    """
    table = lock_table(schema)
    deadline = time.monotonic() + timeout_s
    now = db_now_ns()
    take = (
        update(table)
        .where(table.c.id == _ROW)
        .where(or_(table.c.holder.is_(None), table.c.expires_unix_ns < now))
        .values(holder=holder, expires_unix_ns=now + int(LOCK_TTL_S * 1e9))
    )
    while True:
        try:
            # DDL stalls the whole cluster a moment (total order): only when the table is
            # missing. IF NOT EXISTS makes creators racing on several nodes agree.
            if not inspect(conn).has_table(LOCK_TABLE, schema=schema):
                conn.execute(CreateTable(table, if_not_exists=True))
            taken = conn.execute(take).rowcount == 1
            missing = not taken and conn.execute(select(table.c.id)).first() is None
            conn.exec_driver_sql("COMMIT")  # a certification conflict fails here (1213)
            if taken:
                return
            if missing:
                # A new table, or its creator died before this: put the free row in, and try
                # again at once (several inserting it conflict, and retry, as takers do).
                seed = insert(table).prefix_with("IGNORE")
                conn.execute(seed.values(id=_ROW, holder=None, expires_unix_ns=0))
                conn.exec_driver_sql("COMMIT")
                continue
        except sa_exc.DBAPIError as exc:
            if not _retryable(exc):
                raise
            conn.exec_driver_sql("ROLLBACK")
        if time.monotonic() >= deadline:
            raise StoreUnavailable(
                f"timed out after {timeout_s:g} s waiting for the Galera migration lock "
                f"({LOCK_TABLE})"
            )
        time.sleep(poll_s)


def renew(conn: Connection, holder: str, *, schema: str | None) -> None:
    """Extend the lock in the caller's transaction; `StoreUnavailable` if it is no longer ours
    (it expired and another process took it: this migrator must stop)."""
    table = lock_table(schema)
    stmt = (
        update(table)
        .where(table.c.id == _ROW, table.c.holder == holder)
        .values(expires_unix_ns=db_now_ns() + int(LOCK_TTL_S * 1e9))
    )
    if conn.execute(stmt).rowcount != 1:
        raise StoreUnavailable("lost the Galera migration lock (it expired): migrate again")


def release(conn: Connection, holder: str, *, schema: str | None) -> None:
    """Free the lock if `holder` still has it, and commit; a failure leaves it to expire."""
    table = lock_table(schema)
    stmt = (
        update(table)
        .where(table.c.id == _ROW, table.c.holder == holder)
        .values(holder=None, expires_unix_ns=0)
    )
    for _ in range(3):
        try:
            conn.execute(stmt)
            conn.exec_driver_sql("COMMIT")
            return
        except sa_exc.DBAPIError as exc:
            if not _retryable(exc) or conn.invalidated:
                return
            conn.exec_driver_sql("ROLLBACK")
