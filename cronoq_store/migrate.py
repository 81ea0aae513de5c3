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
    "current_revision",
    "downgrade",
    "head_revision",
    "include_name",
    "script_location",
    "upgrade",
]

import contextlib
import logging
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Final

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import Connection, Engine
from sqlalchemy.schema import CreateSchema

from . import dialects, galera, repository
from .errors import SchemaError, StoreError
from .schema import check_schema_name

log = logging.getLogger(__name__)

VERSION_TABLE: Final = "cronoq_alembic_version"
"""Where cronoq's Alembic history records its revision, apart from an app's `alembic_version`."""
TABLE_PREFIX: Final = "cronoq_"
"""Every table of the store is named with it."""


def include_name(name: str | None, type_: str, _parents: object) -> bool:
    """Autogenerate filter: only cronoq's own tables (an app's tables live beside them), not
    the version table nor Galera's migration lock, which live outside the history."""
    if type_ == "table":
        return (
            name is not None
            and name.startswith(TABLE_PREFIX)
            and name not in (VERSION_TABLE, galera.LOCK_TABLE)
        )
    return True


def script_location() -> Path:
    """The migrations folder: inside the installed package, or the source tree's."""
    packaged = Path(str(resources.files("cronoq_store"))) / "migrations"
    if (packaged / "env.py").is_file():
        return packaged
    return Path(__file__).resolve().parent.parent / "migrations"


def alembic_config(connection: Connection | None = None, *, schema: str | None = None) -> Config:
    """An Alembic `Config` for the packaged migrations, optionally bound to `connection`."""
    cfg = Config()
    cfg.set_main_option("script_location", str(script_location()))
    cfg.set_main_option("path_separator", "os")
    cfg.attributes["connection"] = connection
    cfg.attributes["schema"] = schema
    return cfg


def head_revision() -> str:
    """The newest revision this build knows."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "the packaged migrations have no head"
    return head


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


def _unknown(rev: str) -> SchemaError:
    return SchemaError(
        f"the database is at schema revision {rev!r}, which this build of cronoq-store "
        f"does not know (its newest is {head_revision()!r}); upgrade cronoq-store"
    )


def _check_known(conn: Connection, schema: str | None) -> None:
    for rev in _heads(conn, schema):
        if not _is_known(rev):
            raise _unknown(rev)


@contextlib.contextmanager
def _transaction(bind: Engine | Connection) -> Iterator[Connection]:
    """A connection in a transaction: the engine's, or the caller's (which it then commits)."""
    if isinstance(bind, Engine):
        with bind.begin() as conn:
            yield conn
    elif bind.in_transaction():
        yield bind
    else:
        with bind.begin():
            yield bind


def _run(bind: Engine | Connection, schema: str | None, action: str, revision: str) -> int | None:
    if schema is not None:
        check_schema_name(schema)  # before any DDL: a bad name must not leave half a schema
    restored = None
    try:
        with _transaction(bind) as conn:
            if schema and dialects.name(conn.dialect) == "postgresql":
                conn.execute(CreateSchema(schema, if_not_exists=True))
            with dialects.migration_lock(conn, schema=schema) as renew:
                _check_known(conn, schema)
                cfg = alembic_config(conn, schema=schema)
                cfg.attributes["renew_lock"] = renew
                before = _heads(conn, schema)
                if action == "upgrade":
                    command.upgrade(cfg, revision)
                    if _heads(conn, schema) == (head_revision(),):
                        restored = _restore_leader_row(conn, schema)
                else:
                    command.downgrade(cfg, revision)
                after = _heads(conn, schema)
                if after != before:
                    _log_migrated(action, before, after, schema)
    except StoreError:
        raise
    except CommandError as exc:
        raise SchemaError(str(exc)) from exc
    except Exception as exc:
        raise dialects.translate(exc) from exc
    return restored


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
    """Put back a lease row someone deleted (see `repository.restore_leader_row`)."""
    if schema:
        conn = conn.execution_options(schema_translate_map={None: schema})
    return repository.restore_leader_row(conn)


def upgrade(
    bind: Engine | Connection, revision: str = "head", *, schema: str | None = None
) -> int | None:
    """Migrate the database to `revision` (default: this build's newest) under the lock.

    At the head revision it also restores the leader row if it was deleted (without it no
    instance can lead): returns the restored row's id high-water mark, None when nothing was
    restored.
    """
    return _run(bind, schema, "upgrade", revision)


def downgrade(bind: Engine | Connection, revision: str, *, schema: str | None = None) -> None:
    """Migrate the database down to `revision` ("base" drops every cronoq table)."""
    _run(bind, schema, "downgrade", revision)


def current_revision(bind: Engine | Connection, *, schema: str | None = None) -> str | None:
    """The revision the database stands at; None for a database never migrated."""
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


def require_head(bind: Engine | Connection, *, schema: str | None = None) -> None:
    """Refuse (`SchemaError`) a database that does not stand at this build's head revision:
    never migrated, behind, or at a revision this build does not know. Only reads.

    What `SqlStore.open` checks when it does not migrate, so a store never leads or commits on
    a schema it was not written for.
    """
    # Galera: a causal read, or a node that has not applied a migration just made through
    # another node would refuse a database at head.
    if isinstance(bind, Engine):
        # Read-only: on SQLite it starts deferred and takes no write lock.
        with (
            bind.connect().execution_options(**{dialects.READ_ONLY: True}) as conn,
            galera.causal_reads(conn),
        ):
            rev = current_revision(conn, schema=schema)
    else:
        with galera.causal_reads(bind):
            rev = current_revision(bind, schema=schema)
    head = head_revision()
    if rev == head:
        return
    if rev is None:
        raise SchemaError(
            "no cronoq schema in this database: migrate it first (`cronoq-store upgrade`, or "
            "SqlStore.open with StoreConfig(migrate=True))"
        )
    if not _is_known(rev):
        raise _unknown(rev)
    raise SchemaError(
        f"the database is at schema revision {rev!r}, behind this build's {head!r}: migrate "
        "it first (`cronoq-store upgrade`, or SqlStore.open with StoreConfig(migrate=True))"
    )
