"""`prune` and `lease release`: the upkeep an operator does by hand."""

from __future__ import annotations

import time
from datetime import timedelta

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .. import inspection
from ..face import translated
from ..repository.prune import PRUNE_BATCH
from .output import duration_option, echo_json, progress_console
from .status import lease_text
from .target import Target, open_database


@click.command()
@click.option(
    "--older-than",
    required=True,
    metavar="DURATION",
    callback=duration_option,
    help="Delete finished tasks last updated longer ago than this (30s, 15m, 2h, 7d).",
)
@click.option("--dry-run", is_flag=True, help="Only count what would be deleted.")
@click.option(
    "--batch-size",
    type=click.IntRange(1, 100_000),
    default=PRUNE_BATCH,
    show_default=True,
    help="Rows deleted per transaction.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON, for scripts.")
@click.pass_obj
def prune(
    target: Target, older_than: timedelta, dry_run: bool, batch_size: int, as_json: bool
) -> None:
    """Delete old finished tasks that no live task depends on, in short transactions.

    The store's own prune (`SqlStore.prune`): finished tasks an older build left without a
    finish time are stamped first, and on PostgreSQL the task tables are vacuumed after.
    """
    # Saturates at the Unix epoch, before which no task was updated (never at int64's 1677).
    cutoff = max(0, time.time_ns() - (older_than // timedelta(microseconds=1)) * 1000)
    with open_database(target, write=True) as store, translated():
        with store.engine.connect() as conn:
            total = inspection.prunable_count(conn, cutoff)
        deleted = 0
        if not dry_run:
            progress = Progress(
                TextColumn("pruning"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=progress_console(),
            )
            with progress:
                bar = progress.add_task("prune", total=total)

                def advance(n: int) -> None:
                    nonlocal deleted
                    deleted += n  # stamped rows were not in `total`: it grows to fit
                    progress.update(bar, advance=n, total=max(total, deleted))

                deleted = store.prune(older_than, batch_size=batch_size, progress=advance)
    when = inspection.when(cutoff)
    if as_json:
        count = total if dry_run else deleted
        echo_json({"dry_run": dry_run, "cutoff": when, "count": count})
    elif dry_run:
        click.echo(f"would delete {total} finished tasks updated before {when}")
    else:
        click.echo(f"deleted {deleted} finished tasks updated before {when}")


@click.group("lease")
def lease_group() -> None:
    """The leader lease (see `status` for who holds it)."""


@lease_group.command("release")
@click.option("--force", is_flag=True, help="Required: you know the holder is dead.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation.")
@click.pass_obj
def lease_release(target: Target, force: bool, yes: bool) -> None:
    """Free the lease of a dead leader, so a standby takes over now instead of after its TTL.

    Safe for writes even if the holder is alive after all: its next commit is fenced off and
    it steps down. Its in-flight work is not stopped, though.
    """
    if not force:
        raise click.UsageError(
            "releasing another instance's lease needs --force (and the holder must be dead)"
        )
    with open_database(target, write=True) as store:
        with store.engine.connect() as conn:
            view = inspection.lease_state(conn)
        if view["state"] == "free":
            click.echo("the lease is free: nothing to release")
            return
        click.echo(f"lease: {lease_text(view)}")
        if not yes:
            click.confirm("Release it? Only do this if that process is dead", abort=True)
        released = store.release_lease_of(view["holder"])
    if not released:
        raise click.ClickException("the lease changed hands meanwhile: nothing released")
    click.echo(
        f"released the lease of {view['holder']} (epoch {view['epoch']}); "
        f"the next leader takes epoch {view['next_epoch']}"
    )
