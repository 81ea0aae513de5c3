"""`upgrade`, `downgrade`, `current` and `history`: the schema's revisions."""

from __future__ import annotations

import click
from alembic.script import ScriptDirectory

from .. import builds, migrate, schemacheck
from .output import echo_json
from .target import Target, errors, hint, open_database, shown


def known_revisions() -> set[str]:
    """Every revision the packaged migrations know."""
    script = ScriptDirectory.from_config(migrate.alembic_config())
    return {rev.revision for rev in script.walk_revisions()}


@click.command()
@click.argument("revision", default="head")
@click.option(
    "--sql",
    "as_sql",
    is_flag=True,
    help="Print the DDL from an empty database to REVISION for the URL's dialect, for a DBA "
    "to review and apply by hand (psql, mysql, sqlite3); touches no database.",
)
@click.pass_obj
def upgrade(target: Target, revision: str, as_sql: bool) -> None:
    """Migrate the database to REVISION (default: head); safe to run from many hosts at once."""
    with errors(shown(target.parsed())):
        migrate.require_target(revision)  # before a SQLite file is created
        if as_sql:
            migrate.upgrade_sql(target.parsed(), revision, schema=target.schema)
            return
    with open_database(target, write=True, create=True, need_schema=False) as store:
        before = migrate.current_revision(store.engine, schema=target.schema)
        restored = migrate.upgrade(store.engine, revision, schema=target.schema)
        after = migrate.current_revision(store.engine, schema=target.schema)
    if before != after:
        click.echo(f"upgraded {before or 'none'} -> {after}")
    elif restored is None:
        click.echo(f"at {after or 'none'}: nothing to do")
    if restored is not None:
        click.echo(f"restored the missing leader row (free, epoch 0); next task id {restored}")


@click.command()
@click.argument("revision")
@click.option(
    "--yes-destroy-data",
    is_flag=True,
    help="Required: a downgrade drops tables and the tasks in them.",
)
@click.pass_obj
def downgrade(target: Target, revision: str, yes_destroy_data: bool) -> None:
    """Migrate the database down to REVISION ("base" drops every cronoq table)."""
    if not yes_destroy_data:
        raise click.UsageError(
            "a downgrade drops tables and the data in them: pass --yes-destroy-data to go ahead"
        )
    with open_database(target, write=True, need_schema=False) as store:
        before = migrate.current_revision(store.engine, schema=target.schema)
        migrate.downgrade(store.engine, revision, schema=target.schema)
        after = migrate.current_revision(store.engine, schema=target.schema)
    click.echo(f"downgraded {before or 'none'} -> {after or 'none'}")


@click.command()
@click.option("--check", is_flag=True, help="Exit with status 1 unless at this build's head.")
@click.pass_obj
def current(target: Target, check: bool) -> None:
    """Print the database's schema revision ("none" before the first upgrade)."""
    floor = None
    with open_database(target, need_schema=False) as store:
        rev = migrate.current_revision(store.engine, schema=target.schema)
        if rev is not None and rev not in known_revisions():
            floor = migrate.read_floor(store.engine, schema=target.schema)
    click.echo(rev or "none")
    if rev is not None:
        with errors(shown(target.parsed())):
            migrate.require_known(rev, floor=floor)
    head = migrate.head_revision()
    if check and rev != head:
        raise click.ClickException(f"not at head {head!r}: run {hint(target, 'upgrade')}")


@click.command()
def history() -> None:
    """List the migrations this build ships, newest first (no database needed), each with its
    class: online (it runs while the previous release serves; the oldest release that may
    write the schema after it, "writers 0.1.0+"), or needs the old build stopped."""
    script = ScriptDirectory.from_config(migrate.alembic_config())
    for rev in script.walk_revisions():
        down = rev.down_revision
        parent = "<base>" if down is None else ", ".join([down] if isinstance(down, str) else down)
        mark = " (head)" if rev.is_head else ""
        kind = f"{builds.migration_class(rev.revision)}, writers "
        kind += f"{builds.oldest_writer(rev.revision)}+"
        click.echo(f"{parent} -> {rev.revision}{mark} [{kind}]: {rev.doc}")


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON, for scripts.")
@click.pass_obj
def check(target: Target, as_json: bool) -> None:
    """Check the live schema against this build: revision, tables, indexes (missing, or INVALID
    on PostgreSQL), storage parameters; each finding says what to run. Exit 1 on any."""
    with open_database(target, need_schema=False) as store:
        found = schemacheck.check(store.engine, schema=target.schema)
    if as_json:
        echo_json(found)
    elif found["ok"]:
        click.echo(f"ok: revision {found['revision']}, as this build ({builds.VERSION}) expects")
    else:
        for finding in found["findings"]:
            click.echo(f"- {finding['problem']}\n  fix: {finding['fix']}")
    if not found["ok"]:
        raise SystemExit(1)
