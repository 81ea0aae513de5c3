"""Online, guarded DDL for the migrations: the API every revision builds its changes from.

Operators migrate while a leader serves (a rolling deploy), so no step may hold a lock the
leader's commits wait for, and a run killed at any statement must be completed by the next.

Online, dialect by dialect:

- PostgreSQL: a statement that takes a table lock (`add_column`, `rename_column`,
  `set_storage`) runs in its own transaction under a short `lock_timeout`
  (`LOCK_TIMEOUT_MS`) and is retried with backoff: it never queues in front of the leader's
  commits for longer than that. Indexes are built and dropped `CONCURRENTLY`, outside any
  transaction; an index a killed build left INVALID is dropped and built again. `backfill`
  updates `BATCH_ROWS` rows per transaction.
- MariaDB/MySQL: DDL commits at once anyway; it asks for `ALGORITHM=INSTANT` or `INPLACE` and
  `LOCK=NONE` (falling back where the server refuses). MariaDB: `NOWAIT`, so an ALTER never
  waits in the metadata-lock queue (where it made a leader's commit a deadlock victim); MySQL:
  a wait of at most `lock_wait_timeout` (1 s). Refused, it is retried after a pause.
  `backfill` commits each batch, at READ COMMITTED.
- SQLite: each step commits on its own, and `backfill` writes one batch per (short) write
  transaction, so the leader's busy timeout absorbs every one of them.

Guarded: each step skips what the database already holds. MySQL commits every DDL statement
at once, and on PostgreSQL the online steps commit on their own, so a migration killed
half-way leaves part of a revision behind; run again (under the migration lock, which spans
the whole run), the helpers find what is done and complete the rest.

Offline (`alembic upgrade --sql`): the helpers read nothing and retry nothing; they emit the
plain statements (a backfill as one UPDATE, the concurrent index builds between COMMIT and
BEGIN), for a DBA to review and run.

Call them only from inside a revision's `upgrade()` (they use `alembic.op`). A table created
by this run (`create_table`) has no reader or writer yet: its indexes are built at once, in the
revision's transaction.
"""

from __future__ import annotations

__all__ = [
    "BATCH_ROWS",
    "LOCK_TIMEOUT_MS",
    "RETRY_FOR_S",
    "add_column",
    "backfill",
    "create_index",
    "create_table",
    "drop_index",
    "has_column",
    "has_index",
    "has_table",
    "index_state",
    "insert_missing",
    "is_offline",
    "rename_column",
    "schema",
    "set_storage",
]

import contextlib
import random
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Final, Literal

import sqlalchemy as sa
from alembic import op
from alembic.runtime.migration import MigrationContext
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine.reflection import Inspector

from .compat import copy_column
from .dialects.base import DefaultImpl, dialect_of
from .errors import StoreUnavailable

LOCK_TIMEOUT_MS: Final = 200
"""PostgreSQL: how long one DDL attempt waits for its table lock before it gives way (and the
leader's commits queued behind it go on), to retry after a pause."""
MYSQL_LOCK_WAIT_S: Final = 1
"""MariaDB/MySQL: the same bound on a metadata-lock wait (whole seconds on these servers)."""
RETRY_FOR_S: Final = 600.0
"""How long a step goes on retrying its lock before the migration fails (a transaction that
holds the table that long must be ended first; the error says so)."""
BATCH_ROWS: Final = 5000
"""Rows a backfill updates per transaction."""

_PAUSE_S: Final = 0.05
_MAX_PAUSE_S: Final = 2.0

_created: weakref.WeakKeyDictionary[MigrationContext, set[str]] = weakref.WeakKeyDictionary()
"""The tables this run created, by migration context: nobody uses them yet."""


# What the database holds.


def _context() -> MigrationContext:
    return op.get_context()


def is_offline() -> bool:
    """Whether Alembic is writing a script (`--sql`) rather than running on a database."""
    return bool(_context().as_sql)


def _dialect() -> DefaultImpl:
    """The class of the database migrated (`dialects.dialect_of`), offline too."""
    return dialect_of(_context().dialect)


def schema() -> str | None:
    """The schema env.py maps the tables into (reflection and DDL by name do not see the map)."""
    if is_offline():
        offline: str | None = _context().opts.get("version_table_schema")
        return offline
    options = op.get_bind().get_execution_options()
    name: str | None = (options.get("schema_translate_map") or {}).get(None)
    return name


def _inspector() -> Inspector:
    """A fresh inspector: a cached one would not see what this run has just created."""
    return sa.inspect(op.get_bind())


def has_table(name: str) -> bool:
    """Whether the table exists (offline: assumed not, the script builds everything)."""
    if is_offline():
        return False
    return _inspector().has_table(name, schema=schema())


def has_index(table: str, name: str) -> bool:
    """Whether `table` has an index called `name` (on PostgreSQL, valid or not)."""
    return name in _names(table, Inspector.get_indexes)


def has_column(table: str, name: str) -> bool:
    """Whether `table` has a column called `name`."""
    return name in _names(table, Inspector.get_columns)


def _names(table: str, listing: Callable[..., Sequence[Mapping[str, Any]]]) -> set[str]:
    """The names of what `listing` (an `Inspector` method) finds on `table`: none offline (the
    script builds everything), or where the table does not exist."""
    if is_offline():
        return set()
    inspector = _inspector()
    if not inspector.has_table(table, schema=schema()):
        return set()
    return {item["name"] for item in listing(inspector, table, schema=schema())}


def index_state(table: str, name: str) -> Literal["missing", "valid", "invalid"]:
    """Whether the index exists, and on PostgreSQL whether it is usable: a `CREATE INDEX
    CONCURRENTLY` killed before it finished leaves an INVALID index behind (`pg_index.
    indisvalid`), which is never used for queries but slows every write."""
    if is_offline():
        return "missing"
    if not _dialect().builds_indexes_concurrently:  # only such a build leaves one INVALID
        return "valid" if has_index(table, name) else "missing"
    where = schema()
    row = (
        op.get_bind()
        .execute(
            sa.text(
                "SELECT i.indisvalid FROM pg_index i "
                "JOIN pg_class c ON c.oid = i.indexrelid "
                "JOIN pg_namespace n ON n.oid = c.relnamespace "
                "JOIN pg_class t ON t.oid = i.indrelid "
                "WHERE c.relname = :name AND t.relname = :table AND n.nspname = "
                + (":schema" if where else "current_schema()")
            ),
            {"name": name, "table": table, **({"schema": where} if where else {})},
        )
        .first()
    )
    if row is None:
        return "missing"
    return "valid" if row[0] else "invalid"


# How a step runs: its own transaction, a short lock wait, retried.


def _quote(name: str) -> str:
    """`name` quoted for DDL text (where needed), its '%' left single: the text is either run
    as it is (`exec_driver_sql`) or compiled once more, which doubles them (`op.execute`)."""
    preparer = _context().dialect.identifier_preparer
    quoted = str(preparer.quote(name))
    return quoted.replace("%%", "%") if getattr(preparer, "_double_percents", False) else quoted


def _target(table: str) -> str:
    """`table` as DDL text, schema-qualified when env.py maps one."""
    where = schema()
    return f"{_quote(where)}.{_quote(table)}" if where else _quote(table)


def _sqlite_commit() -> None:
    """End the revision's open SQLite transaction, so the next write starts a short one.

    Not through SQLAlchemy's AUTOCOMMIT switch: on SQLite it resets pysqlite's isolation level
    afterwards, undoing the store engine's own BEGIN handling. The connection's SQLAlchemy
    transaction stays open; the next statement (or its COMMIT) starts SQLite's anew.
    """
    driver = op.get_bind().connection.driver_connection
    if driver is not None and driver.in_transaction:
        op.get_bind().exec_driver_sql("COMMIT")


@contextlib.contextmanager
def _own_transactions() -> Iterator[sa.Connection | None]:
    """Commit what the revision did so far, and run the block with each statement committed
    on its own (PostgreSQL, MySQL: autocommit; SQLite: the caller's explicit short
    transactions). Offline, the script's COMMIT/BEGIN around the block. Yields the
    connection (None offline)."""
    if not _dialect().server:  # SQLite: a file's short transactions of its own
        if is_offline():
            yield None
            return
        _sqlite_commit()
        yield op.get_bind()
        _sqlite_commit()
        return
    block = _context().autocommit_block()
    block.__enter__()
    try:
        yield None if is_offline() else op.get_bind()
    except BaseException as exc:
        # Alembic's block then commits on a connection the failure may have invalidated:
        # that error must not hide the failure itself.
        with contextlib.suppress(sa_exc.SQLAlchemyError):
            block.__exit__(type(exc), exc, exc.__traceback__)
        raise
    block.__exit__(None, None, None)


def _lock_refused(exc: sa_exc.DBAPIError) -> bool:
    """The statement gave up waiting for a lock: PostgreSQL's lock_timeout (55P03), a
    deadlock (40P01), MySQL's lock wait timeout (1205) or deadlock (1213)."""
    orig = exc.orig
    if getattr(orig, "sqlstate", None) in ("55P03", "40P01"):
        return True
    args: tuple[object, ...] = tuple(getattr(orig, "args", ()))
    return bool(args) and args[0] in (1205, 1213)


@contextlib.contextmanager
def _short_lock_waits(conn: sa.Connection) -> Iterator[None]:
    """Bound each lock wait of the block's statements (PostgreSQL, MySQL); the session's own
    setting is put back afterwards, or, if it cannot be, the connection is discarded (its pool
    must not hand out a session with the migration's short bound)."""
    restore = _dialect().short_lock_waits(conn, ms=LOCK_TIMEOUT_MS, seconds=MYSQL_LOCK_WAIT_S)
    if restore is None:
        yield
        return
    try:
        yield
    finally:
        try:
            restore()
        except sa_exc.SQLAlchemyError:
            with contextlib.suppress(Exception):
                conn.invalidate()


def _retrying(step: Callable[[], None], what: str) -> None:
    """Run `step` (one statement, its own transaction) until it gets its lock, pausing with
    backoff between attempts; give up after `RETRY_FOR_S`."""
    deadline = time.monotonic() + RETRY_FOR_S
    pause = _PAUSE_S
    while True:
        try:
            step()
            return
        except sa_exc.DBAPIError as exc:
            if not _lock_refused(exc):
                raise
            if time.monotonic() + pause > deadline:
                raise StoreUnavailable(
                    f"{what}: no lock on the table within {RETRY_FOR_S:g} s of retries; a long "
                    "transaction holds it: end it, and migrate again"
                ) from exc
        time.sleep(pause * random.uniform(0.5, 1.0))
        pause = min(pause * 2, _MAX_PAUSE_S)


def _alter(statement: Callable[[], None], what: str) -> None:
    """Run one table-locking DDL statement online: its own transaction, a short lock wait,
    retried (offline: the plain statement, in the script's transaction)."""
    if is_offline():
        statement()
        return
    with _own_transactions() as conn:
        assert conn is not None
        if not _dialect().server:
            statement()  # SQLite's ALTER is one short write transaction of its own
            _sqlite_commit()
            return
        with _short_lock_waits(conn):
            _retrying(statement, what)


def _mysql_online(table: str, action: str, clauses: Sequence[str], what: str) -> None:
    """Run `ALTER TABLE table action` on MySQL with the first of `clauses` (", ALGORITHM=...,
    LOCK=...") the server accepts for it (1845/1846: not supported), else plainly.

    MariaDB: with `NOWAIT`, so it never waits in the metadata-lock queue at all. A waiting
    ALTER made the old leader's commit a deadlock victim (1213, in the drill): the commit
    reads cronoq_tasks, then writes it, and its second metadata lock queued behind the ALTER,
    which waited for its first. Refused (1205), the statement is retried after a pause.
    Offline: with the first clause, and without NOWAIT (a DBA's script waits)."""
    if is_offline():
        op.execute(f"ALTER TABLE {_target(table)} {action}{clauses[0]}")
        return
    mariadb = bool(getattr(_context().dialect, "is_mariadb", False))
    head = f"ALTER TABLE {_target(table)}{' NOWAIT' if mariadb else ''} {action}"
    for clause in (*clauses, ""):

        def statement(text: str = head + clause) -> None:
            # Sent as it is: without parameters the driver formats nothing ('%' in a name).
            op.get_bind().exec_driver_sql(text, execution_options={"no_parameters": True})

        try:
            _alter(statement, what)
            return
        except sa_exc.DBAPIError as exc:
            code = next(iter(getattr(exc.orig, "args", ())), None)
            if code not in (1845, 1846) or clause == "":
                raise


# The steps.


def create_table(name: str, *elements: Any, **kw: Any) -> sa.Table:
    """`op.create_table`, unless the table exists; the table either way (for inserts).

    A new table is in no one's use: the run's later steps on it need not be online."""
    if not has_table(name):
        table: sa.Table = op.create_table(name, *elements, **kw)
        _created.setdefault(_context(), set()).add(name)
        return table
    return sa.Table(name, sa.MetaData(), *elements, **kw)


def _is_new(table: str) -> bool:
    return table in _created.get(_context(), set())


def create_index(name: str, table: str, columns: Sequence[str], **kw: Any) -> None:
    """Build an index online, unless a usable one of that name exists on `table`.

    PostgreSQL: `CREATE INDEX CONCURRENTLY` outside the transaction (writes go on while it
    builds); an INVALID index of that name, left by a killed build, is dropped concurrently
    first. MySQL: `ALGORITHM=INPLACE, LOCK=NONE`. On a table this run created: at once, in the
    revision's transaction.
    """
    if _is_new(table):
        if not has_index(table, name):
            op.create_index(name, table, list(columns), schema=schema(), **kw)
        return
    state = index_state(table, name)
    if state == "valid":
        return
    impl = _dialect()
    if impl.builds_indexes_concurrently:
        with _own_transactions():
            if state == "invalid":
                _drop_concurrently(name, table)
            op.create_index(
                name, table, list(columns), schema=schema(), postgresql_concurrently=True, **kw
            )
    elif impl.alters_online:
        unique = "UNIQUE " if kw.pop("unique", False) else ""
        if kw:
            raise TypeError(f"ddl.create_index on MySQL takes no {sorted(kw)}")
        cols = ", ".join(_quote(c) for c in columns)
        action = f"ADD {unique}INDEX {_quote(name)} ({cols})"
        _mysql_online(table, action, (", ALGORITHM=INPLACE, LOCK=NONE",), f"create index {name}")
    else:
        with _own_transactions():
            op.create_index(name, table, list(columns), schema=schema(), **kw)


def _drop_concurrently(name: str, table: str) -> None:
    """PostgreSQL's `DROP INDEX CONCURRENTLY IF EXISTS`, outside any transaction."""
    op.drop_index(
        name, table_name=table, schema=schema(), postgresql_concurrently=True, if_exists=True
    )


def drop_index(name: str, table: str) -> None:
    """Drop an index online, unless `table` has no index of that name (any more).

    PostgreSQL: `DROP INDEX CONCURRENTLY` outside the transaction. MySQL: `ALGORITHM=INSTANT`
    (else `INPLACE`), `LOCK=NONE`."""
    if _is_new(table):
        if is_offline() or has_index(table, name):
            op.drop_index(name, table_name=table, schema=schema())
        return
    if not is_offline() and index_state(table, name) == "missing":
        return
    impl = _dialect()
    if impl.builds_indexes_concurrently:
        with _own_transactions():
            _drop_concurrently(name, table)
    elif impl.alters_online:
        clauses = (", ALGORITHM=INSTANT, LOCK=NONE", ", ALGORITHM=INPLACE, LOCK=NONE")
        _mysql_online(table, f"DROP INDEX {_quote(name)}", clauses, f"drop index {name}")
    else:
        with _own_transactions():
            op.drop_index(name, table_name=table, schema=schema())


def add_column(table: str, column: sa.Column[Any]) -> None:
    """Add a column online, unless `table` already has one of that name.

    Keep it instant: nullable, or with a constant `server_default` (PostgreSQL 11+ and
    MariaDB 10.3+ then rewrite no row). PostgreSQL: a short lock wait, retried. MySQL:
    `ALGORITHM=INSTANT` (else `INPLACE`), `LOCK=NONE`."""
    if has_column(table, column.name):
        return
    if _is_new(table):
        op.add_column(table, column, schema=schema())
        return
    if _dialect().alters_online:
        spec = sa.schema.CreateColumn(copy_column(column)).compile(dialect=_context().dialect)
        clauses = (", ALGORITHM=INSTANT, LOCK=NONE", ", ALGORITHM=INPLACE, LOCK=NONE")
        _mysql_online(table, f"ADD COLUMN {spec}", clauses, f"add column {table}.{column.name}")
        return
    _alter(
        lambda: op.add_column(table, copy_column(column), schema=schema()),
        f"add column {table}.{column.name}",
    )


def rename_column(table: str, old: str, new: str, **kw: Any) -> None:
    """`op.alter_column(new_column_name=...)` online, unless `old` is already renamed to `new`
    (a short lock wait, retried)."""
    if has_column(table, new) and not has_column(table, old):
        return
    if _dialect().alters_online and _renames_in_place():
        clauses = (", ALGORITHM=INSTANT, LOCK=NONE", ", ALGORITHM=INPLACE, LOCK=NONE")
        action = f"RENAME COLUMN {_quote(old)} TO {_quote(new)}"
        _mysql_online(table, action, clauses, f"rename column {table}.{old}")
        return
    _alter(
        lambda: op.alter_column(table, old, new_column_name=new, schema=schema(), **kw),
        f"rename column {table}.{old}",
    )


def _renames_in_place() -> bool:
    """Whether the server has `RENAME COLUMN` (MariaDB 10.5+, MySQL 8.0+)."""
    dialect = _context().dialect
    version = tuple(dialect.server_version_info or ())
    if is_offline() or not version:
        return False
    return version >= ((10, 5) if getattr(dialect, "is_mariadb", False) else (8, 0))


def set_storage(table: str, parameters: Mapping[str, str]) -> None:
    """PostgreSQL: `ALTER TABLE ... SET (parameters)` online (its SHARE UPDATE EXCLUSIVE lock
    under a short wait, retried), unless they are set already. Other dialects: nothing."""
    if not _dialect().storage_parameters:
        return
    wanted = {f"{k}={v}" for k, v in parameters.items()}
    if not is_offline() and wanted <= _reloptions(table):
        return
    settings = ", ".join(f"{k} = {v}" for k, v in parameters.items())
    _alter(lambda: op.execute(f"ALTER TABLE {_target(table)} SET ({settings})"), "set storage")


def _reloptions(table: str) -> set[str]:
    row = (
        op.get_bind()
        .execute(
            sa.text(
                "SELECT c.reloptions FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE c.relname = :table AND n.nspname = "
                + (":schema" if schema() else "current_schema()")
            ),
            {"table": table, **({"schema": schema()} if schema() else {})},
        )
        .first()
    )
    return set(row[0] or ()) if row is not None else set()


def backfill(
    table: sa.TableClause,
    values: Mapping[str, Any],
    where: Sequence[sa.ColumnElement[bool]],
    *,
    key: str = "id",
    batch: int | None = None,
) -> int:
    """`UPDATE table SET values WHERE where`, `batch` rows (default `BATCH_ROWS`, in `key`
    order) per transaction.

    `where` must exclude the rows already done (`column IS NULL`, say): the update is then
    safe to run again after a kill, and each batch re-checks it. A keyset walk on `key`
    (which should be indexed with the leading `where` columns) never rescans done rows.
    Offline: one UPDATE. Returns the rows updated (offline: 0).
    """
    if is_offline():
        op.execute(table.update().where(*where).values(**values))
        return 0
    column = table.c[key]
    size = BATCH_ROWS if batch is None else batch
    done = 0
    last: Any = None
    with _own_transactions() as conn, _no_gap_locks(conn):
        assert conn is not None
        sqlite = not _dialect().server  # a file: one writer, BEGIN IMMEDIATE per batch
        while True:
            bound = [*where] if last is None else [*where, column > _key(last)]
            ids = sa.select(column).where(*bound).order_by(column).limit(size).subquery()
            high = conn.execute(sa.select(sa.func.max(ids.c[key]))).scalar()
            if sqlite:
                _sqlite_commit()  # the read's snapshot, before the write lock
            if high is None:
                return done
            update = table.update().where(*bound, column <= _key(high)).values(**values)
            if sqlite:
                conn.exec_driver_sql("BEGIN IMMEDIATE")
                done += conn.execute(update).rowcount
                conn.exec_driver_sql("COMMIT")
            else:
                done += conn.execute(update).rowcount
            last = high


@contextlib.contextmanager
def _no_gap_locks(conn: sa.Connection | None) -> Iterator[None]:
    """MySQL: run the block at READ COMMITTED. At InnoDB's REPEATABLE READ a batch's UPDATE
    also locks the index gaps it scans, up to the next key, where the leader inserts the
    entries of the tasks it finishes. Elsewhere nothing."""
    if conn is None or not _dialect().gap_locks:
        yield
        return
    dbapi = conn.connection.dbapi_connection
    before = conn.dialect.get_isolation_level(dbapi)  # type: ignore[arg-type]
    conn.exec_driver_sql("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
    try:
        yield
    finally:
        with contextlib.suppress(sa_exc.SQLAlchemyError):
            conn.exec_driver_sql(f"SET SESSION TRANSACTION ISOLATION LEVEL {before}")


def _key(value: Any) -> sa.BindParameter[Any]:
    """A key bound as BIGINT (psycopg would cast a bare int to INTEGER: ids pass 2**31)."""
    kind: sa.types.TypeEngine[Any] = sa.BigInteger() if isinstance(value, int) else sa.String()
    return sa.bindparam(None, value, type_=kind)


def insert_missing(table: sa.Table, rows: Sequence[Mapping[str, Any]], key: str = "id") -> None:
    """Insert each of `rows` whose `key` is not stored yet (MySQL may have committed the table
    without them); offline, all of them."""
    if is_offline():
        op.bulk_insert(table, [dict(r) for r in rows])
        return
    column = table.c[key]
    stored = set(op.get_bind().execute(sa.select(column)).scalars())
    missing = [dict(r) for r in rows if r[key] not in stored]
    if missing:
        op.bulk_insert(table, missing)
