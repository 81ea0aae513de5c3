"""`demo`: the failover demo on a SQLite file of its own (`cronoq_store.demo`, loaded when run)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Final

import click

from .. import dialects
from .target import Target, errors, shown

DEMO_URL: Final = "cronoq-demo.db"
"""Where `demo` writes without --url: never the default database, which holds a user's real
data once they ran `upgrade` there."""


@click.command("demo")
@click.option(
    "--overwrite", is_flag=True, help="Replace an earlier demo's files (never another database)."
)
@click.option(
    "--ttl",
    type=click.FloatRange(min=0.1),
    default=1.0,
    show_default=True,
    help="Lease TTL in seconds of the demo's processes.",
)
@click.pass_context
def demo_cmd(ctx: click.Context, overwrite: bool, ttl: float) -> None:
    """Run the failover demo on a SQLite file of its own (--url, default ./cronoq-demo.db) and
    check it. Only a database an earlier demo made is ever overwritten.

    Exits with status 1 when the demo's own check fails.
    """
    target: Target = ctx.obj
    if ctx.parent is not None and ctx.parent.get_parameter_source("url") in (
        click.core.ParameterSource.DEFAULT,
        None,
    ):
        target = Target(url=DEMO_URL, schema=target.schema)
    url = target.parsed()
    if dialects.class_of(url).server or not url.database:
        raise click.UsageError("demo runs on a SQLite file: pass --url PATH")
    try:
        demo = importlib.import_module("cronoq_store.demo")
    except ModuleNotFoundError as exc:
        if exc.name != "cronoq_store.demo":
            raise
        raise click.ClickException("this build of cronoq-store has no demo module") from exc
    with errors(shown(url)):
        try:
            report = demo.run(Path(url.database), overwrite=overwrite, ttl=ttl)
        except FileExistsError as exc:  # the demo writes a workload of its own, never reuses
            if overwrite:
                raise click.ClickException(
                    f"{url.database} is not a database the demo made: it is never "
                    "overwritten; pass --url NEW_PATH"
                ) from exc
            raise click.ClickException(
                f"{url.database} exists: pass --overwrite (if an earlier demo made it), "
                "or --url NEW_PATH"
            ) from exc
    click.echo(demo.format_report(report))
    if not getattr(report, "ok", True):
        raise click.ClickException("the demo's check failed (see above)")
