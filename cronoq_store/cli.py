"""The `cronoq-store` command: migrations and a first look at a database."""

from __future__ import annotations

import os
import sys

import click
from sqlalchemy import Engine, create_engine, inspect
from sqlalchemy.engine import make_url

from . import migrate
from .dialects import redact
from .errors import StoreError

DEFAULT_URL = "sqlite:///cronoq.db"


def _url(url: str | None) -> str:
    url = url or os.environ.get("CRONOQ_DATABASE_URL") or DEFAULT_URL
    if "://" not in url:  # a bare path means a SQLite file
        url = f"sqlite:///{url}"
    return url


@click.group()
@click.option("--url", envvar="CRONOQ_DATABASE_URL", help="database URL or SQLite file path")
@click.pass_context
def main(ctx: click.Context, url: str | None) -> None:
    """cronoq-store: durable state of the cronoq scheduler."""
    ctx.obj = _url(url)


def _engine(url: str) -> Engine:
    try:
        return create_engine(make_url(url))
    except Exception as exc:
        raise click.ClickException(redact(f"bad database URL: {exc}")) from exc


@main.command()
@click.argument("revision", default="head")
@click.pass_obj
def upgrade(url: str, revision: str) -> None:
    """Migrate the database to REVISION (default: head)."""
    engine = _engine(url)
    try:
        migrate.upgrade(engine, revision)
        click.echo(migrate.current_revision(engine))
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        engine.dispose()


@main.command()
@click.pass_obj
def current(url: str) -> None:
    """Print the database's schema revision."""
    engine = _engine(url)
    try:
        click.echo(migrate.current_revision(engine) or "none")
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        engine.dispose()


@main.command()
@click.pass_obj
def demo(url: str) -> None:
    """Create (or migrate) the embedded SQLite database and show its schema."""
    engine = _engine(url)
    try:
        migrate.upgrade(engine)
        click.echo(f"database:  {redact(engine.url.render_as_string(hide_password=True))}")
        click.echo(f"revision:  {migrate.current_revision(engine)}")
        for table in sorted(inspect(engine).get_table_names()):
            if table.startswith(migrate.TABLE_PREFIX):
                click.echo(f"table:     {table}")
    except StoreError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        engine.dispose()


if __name__ == "__main__":
    sys.exit(main())
