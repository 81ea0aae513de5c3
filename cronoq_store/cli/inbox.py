"""The inbox's commands, `cronoq-store enqueue` and `cronoq-store inbox` (`LAZY_COMMANDS`).

`enqueue` is what an app does in its own transaction, from a shell: it commits one item and
prints its inbox id. `inbox` shows what waits for the leader and the rows set aside.
"""

from __future__ import annotations

import time
from typing import IO, Any, Final

import click
from rich import box
from rich.table import Table

from .. import codec, inbox
from ..errors import InvalidValue
from ..inspection import when
from ..model import Priority, TaskSpec
from .output import cells, console, echo_json, print_table
from .status import inbox_text
from .target import Target, open_database

_PRIORITIES: Final = click.Choice([p.name.lower() for p in Priority], case_sensitive=False)


def _label(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, str]:
    labels: dict[str, str] = {}
    for value in values:
        name, sep, text = value.partition("=")
        if not sep or not name:
            raise click.BadParameter(f"{value!r} is not NAME=VALUE", ctx, param)
        labels[name] = text
    return labels


@click.command("enqueue")
@click.argument("payload", required=False)
@click.option(
    "--payload-file",
    type=click.File("rb"),
    default=None,
    help="Read the payload from FILE ('-' for stdin) instead of PAYLOAD.",
)
@click.option("--key", default=None, help="The task's key (unique among live tasks).")
@click.option("--pool", default="default", show_default=True)
@click.option("--kind", default="", help="The task's kind.")
@click.option("--priority", type=_PRIORITIES, default="normal", show_default=True)
@click.option("--tenant", default=None)
@click.option("--tag", "tags", multiple=True, help="A tag (repeatable).")
@click.option("--label", "labels", multiple=True, callback=_label, help="NAME=VALUE (repeatable).")
@click.pass_obj
def enqueue_cmd(
    target: Target,
    payload: str | None,
    payload_file: IO[bytes] | None,
    key: str | None,
    pool: str,
    kind: str,
    priority: str,
    tenant: str | None,
    tags: tuple[str, ...],
    labels: dict[str, str],
) -> None:
    """Put one task into the inbox (committed at once) and print its inbox id."""
    if (payload is None) == (payload_file is None):
        raise click.UsageError("give PAYLOAD or --payload-file (not both)")
    data = payload.encode() if payload is not None else payload_file.read()  # type: ignore[union-attr]
    try:
        spec = TaskSpec(
            payload=data,
            key=key,
            pool=pool,
            kind=kind,
            priority=Priority[priority.upper()],
            tenant=tenant,
            tags=frozenset(tags),
            labels=labels,
        )
        codec.spec_columns(inbox.UNIX, spec)  # what cannot be stored is refused up front
    except InvalidValue as exc:
        raise click.UsageError(str(exc)) from exc
    with open_database(target, write=True) as store, store.engine.begin() as conn:
        inbox_id = inbox.enqueue(conn, spec)
    click.echo(inbox_id)


def _item_dict(row: Any, now_ns: int) -> dict[str, Any]:
    return {
        "inbox_id": row.id,
        "enqueued": when(row.enqueued_unix_ns),
        "age_s": round(max(0, now_ns - row.enqueued_unix_ns) / 1e9, 3),
        "key": row.key,
        "pool": row.pool,
        "kind": row.kind,
        "tenant": row.tenant,
        "payload_size": row.payload_size,
    }


def _reject_dict(row: Any) -> dict[str, Any]:
    return {
        "inbox_id": row.inbox_id,
        "enqueued": when(row.enqueued_unix_ns),
        "rejected": when(row.rejected_unix_ns),
        "reason": row.reason,
        "payload_size": row.payload_size,
        "fields": row.fields,
    }


@click.command("inbox")
@click.option("--after", type=int, default=None, help="Page on: only ids above this one.")
@click.option(
    "--limit", type=click.IntRange(1, 10_000), default=50, show_default=True, help="Page size."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON, for scripts.")
@click.pass_obj
def inbox_cmd(target: Target, after: int | None, limit: int, as_json: bool) -> None:
    """List what waits in the inbox (oldest first) and the rows set aside as undecodable."""
    params: dict[str, Any] = {"limit": limit}
    if after is not None:
        params["after"] = after
    with open_database(target) as store, store.engine.connect() as conn:
        now = time.time_ns()
        # Sizes, not payloads: a page of the largest items is no burden on the operator's
        # memory (`inbox.sized`).
        stmt = inbox.sized(inbox.oldest_stmt(after=after is not None))
        items = [_item_dict(r, now) for r in conn.execute(stmt, params)]
        rejected = inbox.sized(inbox.rejects_stmt())
        rejects = [_reject_dict(r) for r in conn.execute(rejected, {"limit": limit})]
        summary = inbox.depth(conn)
    next_after = items[-1]["inbox_id"] if len(items) == limit else None
    if as_json:
        echo_json({**summary, "inbox": items, "rejects": rejects, "next_after": next_after})
        return
    click.echo(f"inbox      {inbox_text(summary)}")
    out = console()
    if items:
        grid = Table(box=box.SIMPLE, show_edge=False, pad_edge=False)
        for name in ("inbox id", "enqueued", "key", "pool", "kind", "tenant", "payload"):
            grid.add_column(name, overflow="fold")
        for r in items:
            grid.add_row(
                *cells(
                    r["inbox_id"],
                    r["enqueued"],
                    r["key"],
                    r["pool"],
                    r["kind"],
                    r["tenant"],
                    f"{r['payload_size']} B",
                )
            )
        print_table(out, grid)
    if rejects:
        grid = Table(
            title="set aside", title_justify="left", box=box.SIMPLE, show_edge=False, pad_edge=False
        )
        for name in ("inbox id", "rejected", "reason"):
            grid.add_column(name, overflow="fold")
        for r in rejects:
            grid.add_row(*cells(r["inbox_id"], r["rejected"], r["reason"]))
        print_table(out, grid)
    if next_after is not None:
        click.echo(f"more: --after {next_after}")
