"""Where the database is, and the one way every command opens it.

Every command that needs the database opens it through `open_database`: one engine per run
(the store's own), every error made one line on stderr with exit status 1 (never a
traceback), the engine disposed afterwards, and no password in anything printed.
"""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import click
from sqlalchemy import URL, Engine, inspect
from sqlalchemy import exc as sa_exc

from .. import dialects, migrate
from ..errors import InvalidValue, SchemaError, StoreError, StoreUnavailable
from ..store import SqlStore, StoreConfig, engine_for


@dataclass(frozen=True, slots=True)
class Target:
    """The database the command line names (parsed only when a command needs it)."""

    url: str
    schema: str | None

    def parsed(self) -> URL:
        """The URL; a bare path means a SQLite file."""
        if "://" not in self.url:
            return URL.create(dialects.SQLiteImpl.name, database=self.url)
        try:
            return dialects.parse_url(self.url)
        except InvalidValue as exc:
            raise click.ClickException(str(exc)) from exc


def shown(url: URL) -> str:
    """`url` as it may be printed: never with its password (`dialects.safe_url`)."""
    return dialects.safe_url(url)


def shown_target(ctx: click.Context) -> str:
    """The command line's database as it may be printed ("?" if it cannot be parsed)."""
    target = ctx.find_object(Target)
    try:
        return shown(target.parsed()) if target is not None else "?"
    except click.ClickException:
        return "?"


def hint(target: Target, *command: str) -> str:
    """The command line to run next, in backquotes, as it can be pasted: the database named as
    it was given (a bare path as typed, a URL with its password masked) and the --schema."""
    url = target.url if "://" not in target.url else shown(target.parsed())
    schema = ["--schema", target.schema] if target.schema else []
    return "`" + shlex.join(["cronoq-store", "--url", url, *schema, *command]) + "`"


def one_line(text: str) -> str:
    """Driver messages span lines ("... failed\\n\\tIs the server running?"): join them."""
    return dialects.redact("; ".join(part.strip() for part in text.splitlines() if part.strip()))


@contextlib.contextmanager
def errors(where: str) -> Iterator[None]:
    """Turn every store and database error in the block into a one-line `click` error."""
    try:
        yield
    except BrokenPipeError:
        raise  # stdout closed by the reader (`| head`): click exits quietly
    except (sa_exc.SQLAlchemyError, OSError) as exc:
        raise failure(where, dialects.translate(exc), exc) from exc
    except StoreError as exc:
        raise failure(where, exc) from exc


def failure(
    where: str, exc: StoreError, cause: BaseException | None = None
) -> click.ClickException:
    """One line; a connection's cause (`dialects.describe`) under one label on every dialect."""
    unavailable = isinstance(exc, StoreUnavailable) or dialects.describe(cause or exc) is not None
    what = "database unavailable" if unavailable else "failed"
    return click.ClickException(one_line(f"{what} ({where}): {exc}"))


@contextlib.contextmanager
def open_database(
    target: Target, *, write: bool = False, create: bool = False, need_schema: bool = True
) -> Iterator[SqlStore]:
    """The store at `target` for one command, disposed afterwards; errors become one line.

    A missing SQLite file is refused unless `create` (only `upgrade` creates one), so a typo in
    a path never leaves an empty database behind. With `need_schema` the database must stand
    at this build's head revision. Without `write`, a SQLite file is opened read-only and
    without the store's BEGIN IMMEDIATE, so looking at a busy database never holds up its
    leader's commits (WAL readers do not block the writer).
    """
    url = target.parsed()
    where = shown(url)
    config = StoreConfig(migrate=False, schema=target.schema, pool_size=2)
    if not dialects.class_of(url).server:  # SQLite's file
        if target.schema:
            raise click.UsageError("--schema is for PostgreSQL and MySQL; SQLite has no schemas")
        path = url.database or ""
        plain = path and not path.startswith(":") and path[:5].lower() != "file:"
        if plain and not create and not Path(path).exists():  # SqlStore refuses the others
            raise click.ClickException(
                f"no SQLite database at {path}: {hint(target, 'upgrade')} creates one"
            )
    with errors(where):
        # The store's engine, without `SqlStore.open`'s checks: each command checks what it
        # needs itself (`current` must show a revision this build does not know).
        engine = engine_for(url, config, read_only=not write)
        try:
            store = SqlStore(engine, config)
            try:
                if target.schema and dialects.dialect_of(engine).schema_is_database:
                    _mysql_database(engine, target, create=create)
                if need_schema:
                    migrate.require_head(
                        engine,
                        schema=target.schema,
                        advice=f"run {hint(target, 'upgrade')}",
                        missing=lambda: _where_tables(engine, target),
                    )
                yield store
            finally:
                store.close()
        finally:
            engine.dispose()


def _mysql_database(engine: Engine, target: Target, *, create: bool) -> None:
    """MySQL's --schema is a database of its own: `upgrade` creates it (as PostgreSQL's first
    migration creates its schema); any other command names it and says what to do."""
    schema = target.schema or ""
    with engine.begin() as conn:
        if dialects.database_exists(conn, schema):
            return
        if not create:
            raise SchemaError(
                f"no database {schema!r} on this server (--schema): "
                f"{hint(target, 'upgrade')} creates it"
            )
        dialects.create_database(conn, schema)


def _where_tables(engine: Engine, target: Target) -> str:
    """What is missing where: the PostgreSQL schema itself, or cronoq's tables in it."""
    if not dialects.dialect_of(engine).creates_schemas:
        return "no cronoq tables in this database"
    inspector = inspect(engine)
    if target.schema is None:
        return f"no cronoq tables in PostgreSQL schema {inspector.default_schema_name!r}"
    if not inspector.has_schema(target.schema):
        return f"no PostgreSQL schema {target.schema!r} in this database"
    return f"PostgreSQL schema {target.schema!r} has no cronoq tables"
