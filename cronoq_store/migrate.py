"""Programmatic Alembic: run the packaged migrations without a source tree or alembic.ini.

`upgrade` holds a cross-process migration lock (see `dialects.migration_lock`), so any number of
processes opening a fresh database at once all succeed and leave one schema (on MariaDB Galera
too, from any nodes: there the lock is a row certification makes cluster-wide, `galera.py`),
and refuses a database at a revision this build does not know, touching nothing.
"""

from __future__ import annotations

__all__ = [
    "TABLE_PREFIX",
    "VERSION_TABLE",
    "alembic_config",
    "cronoq_tables_only",
    "current_revision",
    "downgrade",
    "head_revision",
    "script_location",
    "upgrade",
    "without_cronoq_tables",
]

import contextlib
import logging
from collections.abc import Callable, Iterator
from functools import cache
from typing import Any, Final, NamedTuple, TextIO

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.script.revision import ResolutionError
from alembic.util.exc import CommandError
from sqlalchemy import (
    URL,
    Column,
    Connection,
    Engine,
    MetaData,
    Select,
    String,
    Table,
    insert,
    inspect,
    select,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.schema import CreateSchema

from . import builds, dialects, execution, galera
from .builds import head_revision, script_location  # public here too, as they were
from .errors import SchemaError, StoreError
from .repository import recovery
from .schema import check_schema_name, writers

log = logging.getLogger(__name__)

VERSION_TABLE: Final = "cronoq_alembic_version"
"""Where cronoq's Alembic history records its revision, apart from an app's `alembic_version`."""
TABLE_PREFIX: Final = "cronoq_"
"""Every table of the store is named with it."""


def without_cronoq_tables(name: str | None, type_: str, parent_names: object) -> bool:
    """The autogenerate filter for an APP's own `env.py`: everything except cronoq's tables.

    One import and one line, `context.configure(..., include_name=without_cronoq_tables)`:
    the app's `alembic revision --autogenerate` then never proposes dropping the `cronoq_`
    tables beside its own (nor their indexes, which are compared with their table).

    Args:
        name: The name of the reflected object (a table, index, column, ... or schema).
        type_: What it is, as Alembic says it ("table", "index", "schema", ...).
        parent_names: Alembic's names of its schema and table (unused).

    Returns:
        False for a table named with `TABLE_PREFIX` (the version table included), else True.
    """
    return not (type_ == "table" and (name or "").startswith(TABLE_PREFIX))


def cronoq_tables_only(name: str | None, type_: str, parent_names: object) -> bool:
    """The autogenerate filter of CRONOQ's own history (its `migrations/env.py`): only its
    tables, so an app's tables beside them are never proposed for dropping. Not for an app's
    `env.py`: there it hides the app's tables; use `without_cronoq_tables`.

    Args:
        name: The name of the reflected object.
        type_: What it is, as Alembic says it ("table", "index", ...).
        parent_names: Alembic's names of its schema and table (unused).

    Returns:
        For a table, whether it is one of cronoq's (its version table and Galera's
        migration lock excepted); else True.
    """
    if type_ == "table":
        return (
            name is not None
            and name.startswith(TABLE_PREFIX)
            and name not in (VERSION_TABLE, galera.LOCK_TABLE)
        )
    return True


include_name = cronoq_tables_only
"""The earlier name of `cronoq_tables_only`, kept for existing env.py files (not in __all__:
it read as the filter an app wants, which it is not)."""


def alembic_config(connection: Connection | None = None, *, schema: str | None = None) -> Config:
    """An Alembic `Config` for the packaged migrations, optionally bound to `connection`.

    Args:
        connection: The connection `env.py` migrates on; None for commands that need none
            (`history`, `heads`).
        schema: The PostgreSQL schema (MySQL database) of the tables, if any.

    Returns:
        A `Config` for `alembic.command` functions; it needs no alembic.ini.
    """
    cfg = Config()
    cfg.set_main_option("script_location", str(builds.script_location()))
    cfg.set_main_option("path_separator", "os")
    cfg.attributes["connection"] = connection
    cfg.attributes["schema"] = schema
    return cfg


def _heads(conn: Connection, schema: str | None) -> tuple[str, ...]:
    context = MigrationContext.configure(
        conn, opts={"version_table": VERSION_TABLE, "version_table_schema": schema}
    )
    return tuple(context.get_current_heads())


def _is_known(rev: str) -> bool:
    try:
        return ScriptDirectory.from_config(alembic_config()).get_revision(rev) is not None
    except CommandError:
        return False


HISTORY: Final = "`cronoq-store history` lists the revisions this build knows"


def require_known(rev: str, *, floor: int | None = None) -> None:
    """Refuse (`SchemaError`) a revision this build does not know: a newer cronoq-store
    migrated the database. `floor` is the database's `oldest_writer`, when it was read: the
    message names that release."""
    if not _is_known(rev):
        floor_text = ""
        if floor:
            floor_text = f" (the oldest build that may write it: {builds.decode(floor)})"
        raise SchemaError(
            f"the database is at schema revision {rev!r}, which this build of cronoq-store "
            f"does not know (this build: {builds.VERSION}, newest revision {head_revision()!r}): "
            f"a newer cronoq-store migrated it{floor_text}; run that build or a newer one "
            f"({HISTORY})"
        )


def require_target(revision: str) -> None:
    """Refuse (`SchemaError`) a target revision this build does not know, before any database
    is touched: an upgrade to it could only fail half-way."""
    if revision in ("head", "heads", "base"):
        return
    try:
        ScriptDirectory.from_config(alembic_config()).get_revisions(revision)
    except CommandError:
        raise SchemaError(
            f"no schema revision {revision!r} in this build of cronoq-store ({builds.VERSION}, "
            f"newest revision {head_revision()!r}); nothing was done ({HISTORY})"
        ) from None


def oldest_writer_floor(conn: Connection, schema: str | None) -> int | None:
    """The database's oldest writer (`cronoq_writers`, `builds.encode`d), or None where the
    table (before 0006) or its row is not there. Only reads."""
    if not inspect(conn).has_table(writers.name, schema=schema):
        return None
    table = writers if not schema else writers.to_metadata(MetaData(), schema=schema)
    value = conn.execute(select(table.c.oldest_writer).where(table.c.id == 1)).scalar()
    return None if value is None else int(value)


def _restore_writers_row(conn: Connection, schema: str | None) -> None:
    """Put back the oldest-writer row someone deleted, at this build's head's floor."""
    if oldest_writer_floor(conn, schema) is not None:
        return
    table = writers if not schema else writers.to_metadata(MetaData(), schema=schema)
    conn.execute(insert(table).values(id=1, oldest_writer=builds.head_floor()))


def _check_known(conn: Connection, schema: str | None) -> None:
    for rev in _heads(conn, schema):
        if not _is_known(rev):
            require_known(rev, floor=oldest_writer_floor(conn, schema))


@contextlib.contextmanager
def _connection(bind: Engine | Connection) -> Iterator[Connection]:
    """A connection outside any transaction: the engine's, or the caller's (whose open
    transaction is committed first). The migrations commit step by step on it."""
    if isinstance(bind, Engine):
        with bind.connect() as conn:
            yield conn
        return
    if bind.in_transaction():
        bind.commit()
    yield bind


def _run(bind: Engine | Connection, schema: str | None, action: str, revision: str) -> int | None:
    if schema is not None:
        check_schema_name(schema)  # before any DDL: a bad name must not leave half a schema
    restored = None
    try:
        with _connection(bind) as conn:
            if schema and dialects.dialect_of(conn).creates_schemas:
                with conn.begin():
                    conn.execute(CreateSchema(schema, if_not_exists=True))
            if (
                action == "upgrade"
                and revision in ("head", head_revision())
                and _settled(conn, schema)
            ):
                return None  # nothing to do: no lock, so no wait behind a migration
            with dialects.migration_lock(conn, schema=schema) as renew:
                with conn.begin():
                    _check_known(conn, schema)
                    before = _heads(conn, schema)
                cfg = alembic_config(conn, schema=schema)
                cfg.attributes["renew_lock"] = renew
                # Each revision step commits on its own (env.py: transaction_per_migration),
                # and the online steps inside it commit theirs (cronoq_store.ddl).
                if action == "upgrade":
                    command.upgrade(cfg, revision)
                else:
                    command.downgrade(cfg, revision)
                if conn.in_transaction():
                    conn.commit()
                with conn.begin():
                    after = _heads(conn, schema)
                    if action == "upgrade" and after == (head_revision(),):
                        restored = _restore_leader_row(conn, schema)
                if after != before:
                    _log_migrated(action, before, after, schema)
    except StoreError:
        raise
    except CommandError as exc:
        raise _schema_error(exc) from exc
    except Exception as exc:
        raise dialects.translate(exc) from exc
    return restored


_VERSIONS: Final = Table(VERSION_TABLE, MetaData(), Column("version_num", String(32)))
"""Alembic's version table, as cronoq's history names it (`VERSION_TABLE`)."""


class Standing(NamedTuple):
    """Where a database stands, read in one statement (`standing`)."""

    heads: tuple[str, ...]
    """The revisions in the version table (one, unless a branch was merged by hand)."""
    floor: int | None
    """The oldest writer (`cronoq_writers`); None without its row."""
    leader: bool
    """Whether the lease row is there."""


@cache
def standing_stmt() -> Select[Any]:
    """The version table's rows, each with the oldest writer and whether the lease row is
    there: a database's standing in one statement, which fails (no such table) on a schema
    that is not at revision 0006 or later."""
    floor = select(writers.c.oldest_writer).where(writers.c.id == 1).scalar_subquery()
    lease = recovery.leader_exists_stmt().scalar_subquery()
    return select(_VERSIONS.c.version_num, floor.label("floor"), lease.label("leader"))


def standing(conn: Connection, schema: str | None) -> Standing | None:
    """The database's standing, read in one transaction of its own on `conn` (outside any),
    in one flight where the driver pipelines: one round trip, no reflection. None when the
    statement fails (a schema without one of the tables: never migrated, or older than 0006),
    the connection still usable: the caller then looks the slow way, which tells which."""
    if schema:
        conn = conn.execution_options(schema_translate_map={None: schema})
    try:
        with conn.begin():
            flight = execution.Flight(conn)
            at = flight.add(standing_stmt())
            rows = flight.commit()[at].rows
    except sa_exc.DBAPIError as exc:
        if exc.connection_invalidated:
            raise
        return None
    heads = tuple(str(r[0]) for r in rows)
    first = rows[0] if rows else None
    floor = None if first is None or first[1] is None else int(first[1])
    return Standing(heads, floor, first is not None and first[2] is not None)


def _settled(conn: Connection, schema: str | None) -> bool:
    """Whether the database is at this build's head with its lease and oldest-writer rows:
    what an upgrade would leave, so the usual open (of a migrated database) takes no lock.
    One statement (`standing`): the open of a database at head costs one round trip here.

    Behind a transaction pooler the lock (a session's) is not safe to take at all (docs/
    deploying.md: migrate on a direct connection); this way the store's own opens there never
    take it once the database is migrated."""
    found = standing(conn, schema)
    return (
        found is not None
        and found.heads == (head_revision(),)
        and found.floor is not None
        and found.leader
    )


def _schema_error(exc: CommandError) -> SchemaError:
    """Alembic's refusal in the store's words: the one place a migration command's errors are
    translated, so the CLI and the API say the same. A revision asked for that this build does
    not ship (Alembic: "Can't locate revision ...") names where the known ones are listed."""
    cause = exc.__cause__
    if isinstance(cause, ResolutionError):
        return SchemaError(
            f"this build of cronoq-store has no schema revision {cause.argument!r} (its newest "
            f"is {head_revision()!r}): `cronoq-store history` lists the revisions it knows"
        )
    return SchemaError(str(exc))


def _log_migrated(
    action: str, before: tuple[str, ...], after: tuple[str, ...], schema: str | None
) -> None:
    was, now = ",".join(before) or "none", ",".join(after) or "none"
    log.info(
        "cronoq schema %sd from %s to %s",
        action,
        was,
        now,
        extra={"action": action, "from_revision": was, "to_revision": now, "schema": schema},
    )


def _restore_leader_row(conn: Connection, schema: str | None) -> int | None:
    """Put back a lease row someone deleted (see `repository.recovery.restore_leader_row`),
    and the oldest-writer row."""
    _restore_writers_row(conn, schema)
    if schema:
        conn = conn.execution_options(schema_translate_map={None: schema})
    return recovery.restore_leader_row(conn)


def upgrade(
    bind: Engine | Connection, revision: str = "head", *, schema: str | None = None
) -> int | None:
    """Migrate the database to `revision` (default: this build's newest) under the lock.

    At the head revision it also restores the leader row if it was deleted (without it no
    instance can lead).

    Args:
        bind: An engine, or a connection (a transaction the caller left open on it is
            committed first: the migration commits step by step, online).
        revision: The revision to reach; "head" for this build's newest.
        schema: The PostgreSQL schema (created if missing) or MySQL database of the tables.

    Returns:
        The restored leader row's next task id; None when nothing was restored.

    Raises:
        InvalidValue: An unusable `schema` name (before any DDL).
        SchemaError: The database stands at a revision this build does not know.
        StoreUnavailable: The database cannot be reached.
        StoreError: A migration the database refused (it rolls back where DDL is
            transactional).
    """
    require_target(revision)
    return _run(bind, schema, "upgrade", revision)


def upgrade_sql(
    url: URL, revision: str = "head", *, schema: str | None = None, out: TextIO | None = None
) -> None:
    """Write the DDL that builds the schema from an empty database up to `revision`, for
    `url`'s dialect (Alembic's offline mode; no connection is made): what `cronoq-store
    upgrade --sql` prints for a DBA to apply by hand.

    Raises:
        SchemaError: A revision this build does not know, or a `schema` (the script is
            unqualified: run it with the schema first on the search path).
    """
    require_target(revision)
    if schema:
        raise SchemaError(
            "--sql writes the tables unqualified: leave out --schema, and run the script with "
            "the schema first on the search path (PostgreSQL) or as the database (MySQL)"
        )
    cfg = alembic_config()
    cfg.attributes["url"] = url.render_as_string(hide_password=False)
    if out is not None:
        cfg.output_buffer = out
    try:
        command.upgrade(cfg, f"base:{revision}", sql=True)
    except CommandError as exc:
        raise SchemaError(str(exc)) from exc


def downgrade(bind: Engine | Connection, revision: str, *, schema: str | None = None) -> None:
    """Migrate the database down to `revision` ("base" drops every cronoq table).

    Args:
        bind: An engine, or a connection in the caller's transaction.
        revision: The revision to go down to, or "base".
        schema: The PostgreSQL schema or MySQL database of the tables.

    Raises:
        InvalidValue: An unusable `schema` name.
        SchemaError: The database stands at a revision this build does not know.
        StoreUnavailable: The database cannot be reached.
    """
    require_target(revision)
    _run(bind, schema, "downgrade", revision)


def current_revision(bind: Engine | Connection, *, schema: str | None = None) -> str | None:
    """The revision the database stands at.

    Args:
        bind: An engine or a connection.
        schema: The PostgreSQL schema or MySQL database of the tables.

    Returns:
        The revision id; None for a database never migrated.

    Raises:
        SchemaError: The version table holds several heads.
        StoreUnavailable: The database cannot be reached.
    """
    try:
        if isinstance(bind, Engine):
            with bind.connect() as conn:
                heads = _heads(conn, schema)
        else:
            heads = _heads(bind, schema)
    except Exception as exc:
        raise dialects.translate(exc) from exc
    if len(heads) > 1:
        raise SchemaError(f"the database has several schema heads: {', '.join(heads)}")
    return heads[0] if heads else None


def read_floor(bind: Engine | Connection, *, schema: str | None = None) -> int | None:
    """`oldest_writer_floor` for a refusal's message: None when it cannot be read."""
    try:
        if isinstance(bind, Engine):
            with bind.connect() as conn:
                return oldest_writer_floor(conn, schema)
        return oldest_writer_floor(bind, schema)
    except Exception:  # the message is the refusal's, not this read's
        return None


MIGRATE_FIRST: Final = (
    "migrate it first (`cronoq-store upgrade`, or SqlStore.open with StoreConfig(migrate=True))"
)
"""What `require_head` advises for a database not migrated, or behind, unless told otherwise."""
NO_SCHEMA: Final = "no cronoq schema in this database"


def _at_head(conn: Connection, schema: str | None, *, ours: bool) -> bool:
    """Whether the database stands at this build's head, in one round trip (`standing`);
    False when that cannot tell (the caller then asks Alembic). Only on a connection whose
    transaction is `ours` to end (the causal read's look at the server, on MySQL)."""
    if not ours:
        return False
    if conn.in_transaction():
        conn.commit()
    found = standing(conn, schema)
    return found is not None and found.heads == (head_revision(),)


def require_head(
    bind: Engine | Connection,
    *,
    schema: str | None = None,
    advice: str = MIGRATE_FIRST,
    missing: Callable[[], str] = lambda: NO_SCHEMA,
) -> None:
    """Refuse (`SchemaError`) a database that does not stand at this build's head revision:
    never migrated, behind, or at a revision this build does not know. Only reads.

    What `SqlStore.open` checks when it does not migrate, so a store never leads or commits on
    a schema it was not written for; `cronoq-store` too, in its own words: `advice` (what to
    run) for a database not migrated or behind, and `missing` (called only then) saying what is
    not there.
    """
    # Galera: a causal read, or a node that has not applied a migration just made through
    # another node would refuse a database at head.
    if isinstance(bind, Engine):
        # Read-only: on SQLite it starts deferred and takes no write lock. Whatever connecting
        # raises is translated, as `current_revision` translates it.
        try:
            with (
                bind.connect().execution_options(**{dialects.READ_ONLY: True}) as conn,
                galera.causal_reads(conn),
            ):
                if _at_head(conn, schema, ours=True):
                    return
                rev = current_revision(conn, schema=schema)
        except Exception as exc:
            raise dialects.translate(exc) from exc
    else:
        ours = not bind.in_transaction()
        with galera.causal_reads(bind):
            if _at_head(bind, schema, ours=ours):
                return
            rev = current_revision(bind, schema=schema)
    head = head_revision()
    if rev == head:
        return
    if rev is None:
        raise SchemaError(f"{missing()}: {advice}")
    if not _is_known(rev):
        require_known(rev, floor=read_floor(bind, schema=schema))
    raise SchemaError(
        f"the database is at schema revision {rev!r}, behind this build's {head!r}: {advice}"
    )
