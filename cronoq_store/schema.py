"""The tables of cronoq-store as SQLAlchemy Core metadata.

The Alembic migrations create exactly these tables (a drift test proves it on every dialect).
Tables carry no schema: an app that keeps them in a PostgreSQL schema or another MySQL database
sets `schema_translate_map={None: name}` on its connections, which `SqlStore` and the
migrations do for `StoreConfig.schema`.
"""

from __future__ import annotations

__all__ = [
    "NAMING_CONVENTION",
    "TABLES",
    "inbox",
    "inbox_rejects",
    "leader",
    "metadata",
    "recurring",
    "task_deps",
    "tasks",
    "writers",
]

import unicodedata
from typing import Any, Final

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    String,
    Table,
    Text,
    text,
)
from sqlalchemy.dialects import mysql
from sqlalchemy.types import TypeEngine

from . import codec
from .errors import InvalidValue

NAMING_CONVENTION: Final = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
"""Constraint and index names, the same on every dialect and in every migration."""

metadata = MetaData(naming_convention=NAMING_CONVENTION)
"""The store's tables: cronoq's own migrations compare with it; never an app's `target_metadata`."""

SCHEMA_NAME_MAX_BYTES: Final = 63
"""PostgreSQL's identifier limit (longer names are cut); MySQL's database names allow 64."""


def check_schema_name(name: object, what: str = "schema") -> None:
    """Refuse a schema name the store cannot use on every dialect, before anything is run.

    A dot would be read as two names (MariaDB then migrated half, PostgreSQL failed midway);
    SQLAlchemy's schema translation refuses square brackets; MySQL refuses trailing spaces in
    database names; control characters and over-long names are refused or cut by the servers.
    Anything else (quotes, %, spaces inside) is quoted where it is used.
    """
    if not isinstance(name, str):
        raise InvalidValue(f"{what} must be a str, not {type(name).__name__}")
    problems = (
        (not name, "is empty"),
        ("." in name, "contains '.'"),
        ("[" in name or "]" in name, "contains '[' or ']'"),
        (name != name.strip(), "starts or ends with whitespace"),
        (any(unicodedata.category(c) == "Cc" for c in name), "contains a control character"),
        (len(name.encode()) > SCHEMA_NAME_MAX_BYTES, f"is over {SCHEMA_NAME_MAX_BYTES} bytes"),
    )
    for bad, why in problems:
        if bad:
            raise InvalidValue(f"{what} {name!r} cannot be used: it {why}")


MYSQL_TABLE_ARGS: Final[dict[str, Any]] = {"mysql_engine": "InnoDB", "mysql_charset": "utf8mb4"}
"""utf8mb4 stores every character. The migration adds a binary no-pad collation, chosen per
server (`dialects.mysql_collation`), so keys compare exactly there as on the other dialects."""

#: Blobs of at least 16 MiB everywhere (MySQL's BLOB stops at 64 KiB).
Blob: Final[TypeEngine[bytes]] = LargeBinary().with_variant(mysql.LONGBLOB(), "mysql", "mariadb")
#: Long text of at least 16 MiB everywhere.
LongText: Final[TypeEngine[str]] = Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")


tasks = Table(
    "cronoq_tasks",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=False),
    Column("seq", BigInteger, nullable=False),
    Column("arrival_unix_ns", BigInteger, nullable=False),
    Column("pool", String(codec.POOL_MAX), nullable=False),
    Column("kind", String(codec.KIND_MAX), nullable=False),
    Column("priority", SmallInteger, nullable=False),
    Column("key", String(codec.KEY_MAX)),
    Column("live_key", String(codec.KEY_MAX)),
    Column("payload", Blob, nullable=False),
    Column("deadline_unix_ns", BigInteger),
    Column("fixed_at_unix_ns", BigInteger),
    Column("fixed_tolerance_ns", BigInteger),
    Column("fixed_on_miss", String(8)),
    Column("duration_hint_ns", BigInteger),
    Column("timeout_ns", BigInteger),
    Column("retry", LongText),
    Column("deps", LongText, nullable=False),
    Column("resources", LongText, nullable=False),
    Column("tags", LongText, nullable=False),
    Column("labels", LongText, nullable=False),
    Column("tenant", String(codec.TENANT_MAX)),
    Column("status", String(codec.STATUS_MAX), nullable=False),
    Column("terminal", Boolean(create_constraint=False), nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("updated_unix_ns", BigInteger, nullable=False),
    # When it finished (its last terminal transition); NULL while live. Only this, never
    # updated_unix_ns, is indexed: a live transition then changes no indexed column.
    Column("finished_unix_ns", BigInteger),
    Column("message", LongText),
    Column("output", Blob),
    # A key is unique among live tasks: live_key is the key while live, NULL once terminal.
    Index(None, "live_key", unique=True),
    # Live tasks by id (recovery) and finished tasks by id (listing).
    Index(None, "terminal", "id"),
    # Finished tasks by the time they finished (retention on recovery, prune).
    Index(None, "finished_unix_ns"),
    # Lookup by key, newest first.
    Index(None, "key", "id"),
    **MYSQL_TABLE_ARGS,
)
"""Every task: its spec in columns, where it stands, and its output; live and finished alike."""

task_deps = Table(
    "cronoq_task_deps",
    metadata,
    Column("task_id", BigInteger, primary_key=True, autoincrement=False),
    Column("ordinal", Integer, primary_key=True, autoincrement=False),
    Column("target_id", BigInteger),
    Column("target_key", String(codec.KEY_MAX)),
    Index(None, "target_id"),
    Index(None, "target_key"),
    **MYSQL_TABLE_ARGS,
)
"""The dependencies of live tasks, so finished targets are found by indexed joins, not JSON."""

recurring = Table(
    "cronoq_recurring",
    metadata,
    Column("name", String(codec.NAME_MAX), primary_key=True),
    Column("spec", LongText, nullable=False),
    Column("template_payload", Blob, nullable=False),
    Column("next_unix_ns", BigInteger),
    Column("last_task_id", BigInteger),
    **MYSQL_TABLE_ARGS,
)
"""The recurring schedules, by name, with their next fire time and last task."""

leader = Table(
    "cronoq_leader",
    metadata,
    Column("id", SmallInteger, primary_key=True, autoincrement=False),
    Column("epoch", Integer, nullable=False),
    Column("holder", String(codec.HOLDER_MAX)),
    Column("expires_unix_ns", BigInteger, nullable=False),
    Column("next_id", BigInteger, nullable=False),
    # The first task id never committed: recovery never hands out a used id, pruned or not.
    Column("commit_seq", BigInteger, nullable=False, server_default=text("0")),
    # Raised by every commit to its leader's sequence number: a leader that made seq N durable
    # and finds less here knows the database lost commits (an asynchronous failover's tail).
    Column("lost_epoch", Integer),
    Column("lost_commits", BigInteger),
    Column("lost_unix_ns", BigInteger),
    # What the leader that found such a gap recorded, for the next recovery to report.
    CheckConstraint("id = 1", name="single_row"),
    **MYSQL_TABLE_ARGS,
)
"""The one lease row (id = 1): who leads, under which fencing epoch, until when."""

writers = Table(
    "cronoq_writers",
    metadata,
    Column("id", SmallInteger, primary_key=True, autoincrement=False),
    Column("oldest_writer", BigInteger, nullable=False),
    CheckConstraint("id = 1", name="single_row"),
    **MYSQL_TABLE_ARGS,
)
"""One row (id = 1): the oldest release that may write this schema (`builds.encode`d). The
lease statements of every build from 0.2.0 on match only while it is at most their own
(`cronoq_store.builds`); each migration raises it."""

LEADER_ROW: Final = {
    "id": 1,
    "epoch": 0,
    "holder": None,
    "expires_unix_ns": 0,
    "next_id": 0,
    "commit_seq": 0,
}
"""The leader row as the first migration inserts it: the first leader gets epoch 1."""

#: The inbox's ids: BIGINT, but SQLite assigns ids only to an INTEGER PRIMARY KEY (its rowid).
InboxId: Final[TypeEngine[int]] = BigInteger().with_variant(Integer(), "sqlite")

inbox = Table(
    "cronoq_inbox",
    metadata,
    Column("id", InboxId, primary_key=True, autoincrement=True),
    Column("enqueued_unix_ns", BigInteger, nullable=False),
    # The spec, encoded as cronoq_tasks encodes it (`codec.spec_columns`).
    *(tasks.c[name]._copy() for name in codec.SPEC_COLUMNS),
    sqlite_autoincrement=True,  # never reuse an id, even once the newest row was taken
    **MYSQL_TABLE_ARGS,
)
"""Task specs that apps wrote in their own transactions, waiting for the leader (in id order)."""

inbox_rejects = Table(
    "cronoq_inbox_rejects",
    metadata,
    Column("inbox_id", BigInteger, primary_key=True, autoincrement=False),
    Column("enqueued_unix_ns", BigInteger),
    Column("rejected_unix_ns", BigInteger, nullable=False),
    Column("reason", LongText, nullable=False),
    Column("payload", Blob),
    Column("fields", LongText, nullable=False),
    **MYSQL_TABLE_ARGS,
)
"""Inbox rows that could not be decoded, set aside for inspection: the payload as stored and
the other columns as JSON text, so the rows behind them are still delivered."""

TABLES: Final = (tasks, task_deps, recurring, leader, inbox, inbox_rejects, writers)
"""Every table of the store."""
