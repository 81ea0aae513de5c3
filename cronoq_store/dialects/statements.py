"""The statements and expressions each dialect writes its own way: the database clock, an
INSERT that skips stored keys, sizes, server roles, MySQL's databases."""

from __future__ import annotations

import functools
import sqlite3
import time
from collections.abc import Callable
from typing import Any, Final

from sqlalchemy import (
    BigInteger,
    Connection,
    Insert,
    Select,
    Table,
    bindparam,
    cast,
    func,
    literal,
    literal_column,
    select,
    table,
)
from sqlalchemy import column as sql_column
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine.interfaces import Dialect
from sqlalchemy.exc import CompileError
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.schema import CreateSchema, PrimaryKeyConstraint
from sqlalchemy.sql.base import Executable
from sqlalchemy.sql.compiler import DDLCompiler, SQLCompiler
from sqlalchemy.sql.elements import ClauseElement, ColumnElement
from sqlalchemy.sql.functions import FunctionElement


def name(dialect: Dialect) -> str:
    """ "sqlite", "postgresql" or "mysql" (MariaDB included)."""
    return "mysql" if dialect.name in ("mysql", "mariadb") else dialect.name


def mysql_collation(dialect: Dialect) -> str:
    """A binary collation without trailing-space padding, so "a" and "a " are distinct keys."""
    return "utf8mb4_nopad_bin" if getattr(dialect, "is_mariadb", False) else "utf8mb4_0900_bin"


TABLE_PREFIX: Final = "cronoq_"
"""Every table the store creates (and Alembic's version table for it) is named so."""


@compiles(PrimaryKeyConstraint, "mysql", "mariadb")
def _unnamed_primary_key(element: PrimaryKeyConstraint, compiler: DDLCompiler, **kw: Any) -> str:
    """MySQL names every primary key PRIMARY and warns at a `CONSTRAINT name` (1280: "Name
    'pk_cronoq_tasks' ignored for PRIMARY key."), which asyncmy logs, one line per table on
    stderr where the app set no logging: the store's tables leave the name out on MySQL, as
    MySQL does anyway. Other tables (an app's own) compile as SQLAlchemy compiles them."""
    text: str = compiler.visit_primary_key_constraint(element, **kw)
    table = getattr(element, "table", None)
    if table is None or not str(table.name).startswith(TABLE_PREFIX):
        return text
    return text[text.index("PRIMARY KEY") :] if text.startswith("CONSTRAINT ") else text


class db_now_ns(FunctionElement[int]):
    """Unix nanoseconds on the database's clock: one clock for every host sharing a server.

    One expression, compiled per dialect: `clock_timestamp()` on PostgreSQL (the time of
    evaluation, not of the transaction's start), `UTC_TIMESTAMP(6)` on MariaDB/MySQL (UTC, so
    the session's time zone and its daylight-saving jumps cannot shift it; `NOW(6)` through
    `UNIX_TIMESTAMP` is ambiguous for an hour each autumn). SQLite has no server: the processes
    sharing its file share the host's clock instead, bound as `b_host_now` (pass that parameter
    to judge a lease at another instant).
    """

    type = BigInteger()
    name = "db_now_ns"
    inherit_cache = True


def host_now_ns() -> int:
    """The host's wall clock in Unix nanoseconds, read when a SQLite statement runs (through
    `time.time_ns` as the module holds it: a test skews the host's clock by replacing it)."""
    return time.time_ns()


@compiles(db_now_ns)
def _db_now_unknown(element: db_now_ns, compiler: SQLCompiler, **kw: Any) -> str:
    raise CompileError(f"no database clock known for dialect {compiler.dialect.name!r}")


@compiles(db_now_ns, "postgresql")
def _db_now_postgresql(element: db_now_ns, compiler: SQLCompiler, **kw: Any) -> str:
    seconds = func.extract("epoch", func.clock_timestamp())  # numeric, microseconds exact
    return compiler.process(
        cast(seconds * 1_000_000_000, BigInteger), **{**kw, "literal_binds": True}
    )


@compiles(db_now_ns, "mysql", "mariadb")
def _db_now_mysql(element: db_now_ns, compiler: SQLCompiler, **kw: Any) -> str:
    micros = func.timestampdiff(
        literal_column("MICROSECOND"), literal("1970-01-01 00:00:00"), func.utc_timestamp(6)
    )
    return compiler.process(micros * 1000, **{**kw, "literal_binds": True})


@compiles(db_now_ns, "sqlite")
def _db_now_sqlite(element: db_now_ns, compiler: SQLCompiler, **kw: Any) -> str:
    host_now = bindparam("b_host_now", type_=BigInteger, callable_=host_now_ns)
    return compiler.process(host_now, **kw)


class unindexed(FunctionElement[Any]):
    """A column that SQLite must not use an index for (its unary `+`, as its docs advise);
    the column itself elsewhere. Where SQLite picks an index for an equality over the one
    a range and its ORDER BY need, it would read every match and sort them."""

    name = "unindexed"
    inherit_cache = True

    def __init__(self, column: ColumnElement[Any]) -> None:
        super().__init__(column)
        self.type = column.type


@compiles(unindexed)
def _unindexed(element: unindexed, compiler: SQLCompiler, **kw: Any) -> str:
    return compiler.process(element.clauses, **kw)


@compiles(unindexed, "sqlite")
def _unindexed_sqlite(element: unindexed, compiler: SQLCompiler, **kw: Any) -> str:
    return "+" + compiler.process(element.clauses, **kw)


class Vacuum(Executable, ClauseElement):
    """PostgreSQL's plain `VACUUM` of `tables` (in the schema the connection translates to):
    it blocks no reader or writer, and makes the dead rows' space reusable at once. Without
    truncating the table's empty tail (PostgreSQL 12 and later): the next tasks fill it, and
    truncating takes an exclusive lock, which waits up to 5 s behind any open transaction
    that read the table and, replayed on a hot standby, cancels the queries there.
    Without `index_cleanup`, the dead rows' index entries are left to the next vacuum
    (`INDEX_CLEANUP OFF`): that pass reads every index whole (`repository.prune.vacuum`)."""

    inherit_cache = False

    def __init__(self, *tables: Table, index_cleanup: bool = True) -> None:
        self.tables = tables
        self.index_cleanup = index_cleanup


@compiles(Vacuum, "postgresql")
def _vacuum(element: Vacuum, compiler: SQLCompiler, **kw: Any) -> str:
    tables = ", ".join(compiler.preparer.format_table(t) for t in element.tables)
    version = compiler.dialect.server_version_info or (0,)
    if version < (12,):
        return f"VACUUM {tables}"
    cleanup = "" if element.index_cleanup else ", INDEX_CLEANUP OFF"
    return f"VACUUM (TRUNCATE false{cleanup}) {tables}"


def vacuums(dialect: Dialect) -> bool:
    """Whether a prune should reclaim the space it freed itself (`Vacuum`): PostgreSQL leaves
    it to autovacuum, which visits a table at most once a minute (`autovacuum_naptime`), while
    a busy scheduler fills it with as many tasks again meanwhile. InnoDB purges deleted rows on
    its own, and SQLite reuses free pages."""
    return dialect.name == "postgresql"


@functools.lru_cache(maxsize=64)  # per engine's dialect: a commit's lookup makes no call
def insert_ignoring(dialect: Dialect, target: Table, *, returning: bool = True) -> Insert | None:
    """An INSERT into `target` that skips a row whose primary key is stored already and
    (`returning`) returns the primary key of each row it inserted, or None where there is
    none to trust. One row's insert needs no RETURNING: the driver's row count says it.

    PostgreSQL's `ON CONFLICT (pk) DO NOTHING` and SQLite's (3.35+, for RETURNING) name the
    primary key alone, so any other unique index (a live key in use) still refuses the row.
    MariaDB/MySQL have no such form: `INSERT IGNORE` and `ON DUPLICATE KEY` would also swallow
    a live-key conflict (and IGNORE turns bad values into warnings), so none is given there.
    """
    return _insert_ignoring(name(dialect), target, returning)


@functools.cache
def _insert_ignoring(which: str, target: Table, returning: bool) -> Insert | None:
    key = list(target.primary_key.columns)
    stmt: Insert
    if which == "postgresql":
        stmt = postgresql.insert(target).on_conflict_do_nothing(index_elements=key)
    elif which == "sqlite" and sqlite3.sqlite_version_info >= (3, 35):
        stmt = sqlite.insert(target).on_conflict_do_nothing(index_elements=key)
    else:
        return None
    return stmt.returning(*key) if returning else stmt


def says_lastrowid(dialect: Dialect) -> bool:
    """Whether the driver tells the key an INSERT's one row got with the statement's answer
    (DB-API `lastrowid`: SQLite's rowid, MySQL's AUTO_INCREMENT value), so that a one-row
    insert needs no RETURNING result set. psycopg has no `lastrowid`."""
    return name(dialect) in ("sqlite", "mysql")


def delete_joins(dialect: Dialect) -> bool:
    """Whether a DELETE of rows chosen by a subquery should join it rather than test IN.

    MariaDB/MySQL run a single-table `DELETE ... WHERE id IN (subquery)` as a dependent
    subquery probed for every row of the table, a full scan per prune batch; their
    multi-table DELETE joins the derived rows by primary key. SQLite has no such DELETE, and
    PostgreSQL plans the IN as a semi-join already.
    """
    return name(dialect) == "mysql"


def database_size_stmt(dialect: Dialect, schema: str | None) -> Select[Any]:
    """The size of the whole database in bytes, as each dialect reports it."""
    which = name(dialect)
    if which == "postgresql":
        return select(func.pg_database_size(func.current_database()))
    if which == "mysql":
        info = table(
            "tables",
            sql_column("table_schema"),
            sql_column("data_length"),
            sql_column("index_length"),
            schema="information_schema",
        )
        return select(func.coalesce(func.sum(info.c.data_length + info.c.index_length), 0)).where(
            info.c.table_schema == (schema if schema else func.database())
        )
    pages = func.pragma_page_count().table_valued("page_count")
    size = func.pragma_page_size().table_valued("page_size")
    return select(
        select(pages.c.page_count).scalar_subquery() * select(size.c.page_size).scalar_subquery()
    )


def server_role_stmt(dialect: Dialect) -> Select[Any] | None:
    """PostgreSQL: whether the server is a standby, its synchronous standbys as configured and
    as connected, and `synchronous_commit`: what decides whether a failover can lose
    acknowledged commits (docs/deploying.md). None elsewhere."""
    if name(dialect) != "postgresql":
        return None
    replication = table("pg_stat_replication", sql_column("sync_state"), schema="pg_catalog")
    connected = (
        select(func.count())
        .select_from(replication)
        .where(replication.c.sync_state.in_(("sync", "quorum")))
        .scalar_subquery()
    )
    return select(
        func.pg_is_in_recovery().label("standby"),
        func.current_setting("synchronous_standby_names").label("names"),
        func.current_setting("synchronous_commit").label("commit"),
        connected.label("connected"),
    )


def database_exists(conn: Connection, schema: str) -> bool:
    """MySQL: whether the server has a database named `schema` (its --schema)."""
    schemata = table("schemata", sql_column("schema_name"), schema="information_schema")
    found = conn.execute(select(literal(1)).where(schemata.c.schema_name == schema)).first()
    return found is not None


def create_database(conn: Connection, schema: str) -> None:
    """MySQL: create the database `schema` if it is missing (the tables name their charset)."""
    conn.execute(CreateSchema(schema, if_not_exists=True))


def read_only_sql(dialect: Dialect) -> str | None:
    """The statement (for `exec_driver_sql`) that makes the transaction it starts read-only
    (PostgreSQL, MySQL), so a reader that must never write (the dashboard) cannot, even by
    mistake. None on SQLite, whose reader connections run with `PRAGMA query_only` instead."""
    which = name(dialect)
    if which in ("postgresql", "mysql"):
        return "SET TRANSACTION READ ONLY"
    return None


PG_DURABILITY: Final = ("fsync", "synchronous_commit", "full_page_writes")
"""PostgreSQL's settings that decide whether a crash can take back an acknowledged commit."""
MYSQL_DURABILITY: Final = (
    "innodb_flush_log_at_trx_commit",
    "innodb_doublewrite",
    "log_bin",
    "sync_binlog",
    "wsrep_on",
)
"""MariaDB/MySQL's: InnoDB's flush and doublewrite, the binary log's sync, Galera."""


def durability_settings(
    conn: Connection, flight_of: Callable[[Connection], Any] | None = None
) -> dict[str, str | None]:
    """The settings `durability.classify` judges, as the server reports them to this session
    (PostgreSQL: `current_setting`, so a per-database or per-role `synchronous_commit` shows;
    MySQL: the global variables, in one `SHOW`, which lists only those the server has, so a
    server without Galera has no `wsrep_on`; SQLite: this connection's pragmas, `synchronous`
    being per connection). One round trip on the servers (PostgreSQL pipelined: its BEGIN and
    COMMIT too, which ends the transaction); nothing is changed. `flight_of`: what makes
    the flight PostgreSQL's read rides in (`execution.Flight`, given by the caller: this
    floor does not reach up to `execution`)."""
    which = name(conn.dialect)
    if which == "postgresql":
        if flight_of is None:
            raise TypeError("PostgreSQL's durability settings are read in a flight")
        flight = flight_of(conn)
        at = flight.add(select(*(func.current_setting(s) for s in PG_DURABILITY)))
        row = flight.commit()[at].rows[0]
        return {s: str(v) for s, v in zip(PG_DURABILITY, row, strict=True)}
    if which == "mysql":
        names = ", ".join(f"'{s}'" for s in MYSQL_DURABILITY)  # constants, no input
        rows = conn.exec_driver_sql(f"SHOW GLOBAL VARIABLES WHERE Variable_name IN ({names})").all()
        found = {str(k).lower(): str(v) for k, v in rows}
        return {s: found.get(s) for s in MYSQL_DURABILITY}
    journal = conn.exec_driver_sql("PRAGMA journal_mode").scalar()
    sync = conn.exec_driver_sql("PRAGMA synchronous").scalar()
    levels = {0: "off", 1: "normal", 2: "full", 3: "extra"}
    return {
        "journal_mode": None if journal is None else str(journal),
        "synchronous": None if sync is None else levels.get(int(sync), str(sync)),
    }
