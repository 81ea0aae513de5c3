"""`status`, `tasks` and `show`: a look inside the database (`inspection`), printed."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Final

import click
from rich import box
from rich.table import Table

from .. import inspection, schemacheck
from ..model import INT64_MAX, INT64_MIN, TaskStatus
from ..repository import operators
from .output import cells, console, duration_option, echo_json, field_lines, print_table, short
from .target import Target, open_database


def lease_text(view: Mapping[str, Any]) -> str:
    """The lease (`inspection.lease_state`) in a line."""
    if view["state"] == "free":
        return f"free (last epoch {view['epoch']}; the next leader takes {view['next_epoch']})"
    if view["state"] == "held":
        return (
            f"held by {view['holder']}, epoch {view['epoch']}, "
            f"expires in {view['expires_in_s']:.1f} s (database clock)"
        )
    return (
        f"expired {-view['expires_in_s']:.1f} s ago (holder {view['holder']}, epoch "
        f"{view['epoch']}): a standby may take over"
    )


def _server_text(server: Mapping[str, Any]) -> str:
    if server["role"] == "standby":
        return "standby (read-only: a leader cannot commit here; reach the primary)"
    names, commit = server["synchronous_standby_names"], server["synchronous_commit"]
    if not names or commit in ("off", "local"):
        return (
            f"primary, no synchronous standby (synchronous_standby_names {names!r}, "
            f"synchronous_commit {commit}): a failover to an asynchronous replica can lose "
            "acknowledged commits"
        )
    return (
        f"primary, synchronous standbys {names!r} ({server['synchronous_standbys_connected']} "
        f"connected), synchronous_commit {commit}"
    )


def _durability_text(view: Mapping[str, Any]) -> str:
    """`status`'s durability line: safe, or which settings can lose acknowledged commits."""
    if view["safe"]:
        known = ", ".join(f"{k}={v}" for k, v in view["settings"].items() if v is not None)
        return f"safe ({known}): an acknowledged commit survives a crash"
    unsafe = "; ".join(f"{u['setting']}={u['value']} ({u['why']})" for u in view["unsafe"])
    return f"NOT SAFE: a crash can lose acknowledged commits: {unsafe}"


def _prometheus(data: Mapping[str, Any]) -> str:
    """`status`'s figures in the Prometheus text exposition format (gauges, `cronoq_` names,
    units in the names, the schema revision as a label)."""
    out: list[str] = []

    def gauge(name: str, text: str, samples: list[tuple[dict[str, str], float]]) -> None:
        out.append(f"# HELP {name} {text}")
        out.append(f"# TYPE {name} gauge")
        for labels, value in samples:
            shown = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
            out.append(f"{name}{{{shown}}} {value:g}" if shown else f"{name} {value:g}")

    lease_view, waiting, finished = data["lease"], data["inbox"], data["finished"]
    age, left = waiting["oldest_age_s"], lease_view["expires_in_s"]
    gauge(
        "cronoq_schema_info",
        "The schema revision of the database (label), and this build's head.",
        [({"revision": str(data["revision"]), "head": str(data["head"])}, 1)],
    )
    gauge(
        "cronoq_tasks",
        "Live tasks by pool and status (exact).",
        [({"pool": r["pool"], "status": r["status"]}, r["count"]) for r in data["tasks"]],
    )
    gauge(
        "cronoq_finished_last_hour_tasks",
        "Tasks finished in the last hour, by status.",
        [({"status": s}, n) for s, n in finished["last_hour"].items()],
    )
    singles: list[tuple[str, str, float]] = [
        (
            "cronoq_finished_tasks",
            "Finished tasks stored (exact up to 10,000; beyond, the planner's estimate).",
            finished["tasks"],
        ),
        ("cronoq_inbox_items", "Items waiting in the inbox.", waiting["items"]),
        (
            "cronoq_inbox_oldest_age_seconds",
            "Age of the oldest item waiting in the inbox (0 when empty).",
            0 if age is None else age,
        ),
        ("cronoq_inbox_set_aside", "Inbox rows set aside as undecodable.", waiting["set_aside"]),
        ("cronoq_lease_epoch", "The lease's fencing epoch.", lease_view["epoch"]),
        (
            "cronoq_lease_held",
            "1 while a leader holds an unexpired lease, else 0.",
            1 if lease_view["state"] == "held" else 0,
        ),
        (
            "cronoq_lease_expires_in_seconds",
            "Seconds until the lease expires, on the database's clock (negative: expired; "
            "0: free).",
            0 if left is None else left,
        ),
        (
            "cronoq_prune_backlog_tasks",
            "Finished tasks last updated longer ago than the retention (what prune would "
            "delete; exact up to 10,000, beyond the planner's estimate).",
            data["prune_backlog"]["tasks"],
        ),
    ]
    for name, text, value in singles:
        gauge(name, text, [({}, value)])
    if "lost_commits" in data:
        lost = data["lost_commits"]
        gauge(
            "cronoq_lost_commits",
            "Commits a leader found missing (an asynchronous failover); -1 when unknown.",
            [({"epoch": str(lost["epoch"])}, -1 if lost["commits"] is None else lost["commits"])],
        )
    return "\n".join(out) + "\n"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _lost_text(lost: Mapping[str, Any]) -> str:
    count = "an unknown number of" if lost["commits"] is None else f"up to {lost['commits']}"
    return (
        f"the leader of epoch {lost['epoch']} found {count} acknowledged commits missing "
        f"({inspection.when(lost['noticed_unix_ns'])}); cleared by the next leader's first "
        "commit"
    )


def inbox_text(summary: Mapping[str, Any]) -> str:
    """The inbox's depth (`inbox.depth`) in a line."""
    age = summary["oldest_age_s"]
    return (
        f"{summary['items']} waiting"
        + ("" if age is None else f", oldest {age:g} s old")
        + f", {summary['set_aside']} set aside"
    )


def _finished_text(finished: Mapping[str, Any], backlog: Mapping[str, Any]) -> str:
    """The finished tasks, the last hour's by status, and the prune backlog, in a line."""
    hour = ", ".join(f"{s} {n:,}" for s, n in finished["last_hour"].items() if n) or "none"
    retention = inspection.seconds_text(int(backlog["retention_s"] * 1e9))
    return (
        f"{inspection.count_text(finished)} (last hour: {hour}); "
        f"{inspection.count_text(backlog)} past the retention ({retention})"
    )


def schema_check_text(found: Mapping[str, Any]) -> str:
    """`schemacheck.check`'s verdict in one line: what `cronoq-store check` details."""
    if found["ok"]:
        return "ok: tables, indexes and storage as this build expects"
    first = found["findings"][0]["problem"]
    more = len(found["findings"]) - 1
    return f"{first}" + (f" (+{more} more)" if more else "") + ": run `cronoq-store check`"


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON, for scripts (--format json).")
@click.option(
    "--format",
    "form",
    type=click.Choice(["text", "json", "prometheus"]),
    default="text",
    show_default=True,
    help="prometheus: the text exposition format, for a textfile collector or a scrape job.",
)
@click.option(
    "--retention",
    metavar="DURATION",
    callback=duration_option,
    default="1h",
    show_default=True,
    help="Finished tasks older than this count as prune backlog (StoreConfig.retention).",
)
@click.pass_obj
def status(target: Target, as_json: bool, form: str, retention: timedelta) -> None:
    """Schema revision, leader lease, live task counts, finished tasks, schedules and size."""
    form = "json" if as_json else form
    with open_database(target) as store, store.engine.connect() as conn:
        data = inspection.status(conn, schema=target.schema, retention=retention)
        data["schema_check"] = schemacheck.check(conn, schema=target.schema)
    if form == "json":
        echo_json(data)
        return
    if form == "prometheus":
        click.echo(_prometheus(data), nl=False)
        return
    click.echo(f"database   {data['database']} ({data['dialect']})")
    click.echo(f"schema     {data['revision']} (head)")
    click.echo(f"check      {schema_check_text(data['schema_check'])}")
    click.echo(f"size       {inspection.size_text(data['size_bytes'])}")
    if "server" in data:
        click.echo(f"server     {_server_text(data['server'])}")
    if "durability" in data:
        click.echo(f"durable    {_durability_text(data['durability'])}")
    click.echo(f"lease      {lease_text(data['lease'])}")
    if "lost_commits" in data:
        click.echo(f"lost       {_lost_text(data['lost_commits'])}")
    click.echo(f"inbox      {inbox_text(data['inbox'])}")
    click.echo(f"finished   {_finished_text(data['finished'], data['prune_backlog'])}")
    out = console()
    if data["tasks"]:
        grid = Table(
            title="tasks", title_justify="left", box=box.SIMPLE, show_edge=False, pad_edge=False
        )
        for name in ("pool", "status", "count"):
            grid.add_column(name, justify="right" if name == "count" else "left")
        for c in data["tasks"]:
            grid.add_row(*cells(c["pool"], c["status"], c["count"]))
        print_table(out, grid)
    else:
        click.echo("tasks      none")
    if data["recurring"]:
        grid = Table(
            title="recurring", title_justify="left", box=box.SIMPLE, show_edge=False, pad_edge=False
        )
        for name in ("name", "schedule", "next", "last task"):
            grid.add_column(name)
        for s in data["recurring"]:
            grid.add_row(*cells(s["name"], s["schedule"], s["next"], s["last_task"]))
        print_table(out, grid)
    else:
        click.echo("recurring  none")


_STATUSES: Final = click.Choice([s.value for s in TaskStatus], case_sensitive=False)


@click.command("tasks")
@click.option("--pool", "pools", multiple=True, help="Only this pool (repeatable).")
@click.option(
    "--status", "statuses", type=_STATUSES, multiple=True, help="Only this status (repeatable)."
)
@click.option("--key", default=None, help="Only tasks with this key.")
@click.option("--tenant", default=None, help="Only this tenant's tasks.")
@click.option("--after", type=int, default=None, help="Page on: only ids above this one.")
@click.option(
    "--limit", type=click.IntRange(1, 10_000), default=50, show_default=True, help="Page size."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON, for scripts.")
@click.pass_obj
def tasks_cmd(
    target: Target,
    pools: tuple[str, ...],
    statuses: tuple[str, ...],
    key: str | None,
    tenant: str | None,
    after: int | None,
    limit: int,
    as_json: bool,
) -> None:
    """List tasks, live and finished, in id order (page on with --after)."""
    with open_database(target) as store, store.engine.connect() as conn:
        query = operators.TaskQuery(
            pools=pools,
            statuses=[s.lower() for s in statuses],
            key=key,
            tenant=tenant,
            after=after,
            limit=limit,
        )
        rows = inspection.list_tasks(conn, query)
    next_after = rows[-1]["id"] if len(rows) == limit else None
    if as_json:
        echo_json({"tasks": rows, "next_after": next_after})
        return
    if not rows:
        click.echo("no tasks match")
        return
    grid = Table(box=box.SIMPLE, show_edge=False, pad_edge=False)
    for name in ("id", "key", "pool", "kind", "status", "attempt", "tenant", "updated", "message"):
        grid.add_column(
            name, no_wrap=name in ("id", "status", "updated", "message"), overflow="fold"
        )
    for r in rows:
        grid.add_row(
            *cells(
                r["id"],
                r["key"],
                r["pool"],
                r["kind"],
                r["status"],
                r["attempt"],
                r["tenant"],
                r["updated"],
                short(r["message"]),
            )
        )
    print_table(console(), grid)
    if next_after is not None:
        click.echo(f"more: --after {next_after}")


@click.command(context_settings={"ignore_unknown_options": True})  # `show -5`: an id
@click.argument("ref")
@click.option("--by-key", is_flag=True, help="REF is a key even if it looks like an id.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON, for scripts.")
@click.pass_obj
def show(target: Target, ref: str, by_key: bool, as_json: bool) -> None:
    """Show one task by ID, or the newest task with KEY."""
    task_id: int | None = None
    if not by_key and re.fullmatch(r"-?\d+", ref):
        task_id = int(ref)
        if not INT64_MIN <= task_id <= INT64_MAX:  # no task can have it
            raise click.ClickException(f"no task with id {task_id} (ids are 64-bit)")
    with open_database(target) as store, store.engine.connect() as conn:
        if task_id is not None:
            detail = inspection.find_task(conn, task_id=task_id)
        else:
            detail = inspection.find_task(conn, key=ref)
    if detail is None:
        raise click.ClickException(
            f"no task with id {task_id}" if task_id is not None else f"no task with key {ref!r}"
        )
    if as_json:
        echo_json(detail)
        return
    lines: list[tuple[str, object]] = [
        ("id", detail["id"]),
        ("key", detail["key"]),
        ("status", detail["status"]),
        ("attempt", detail["attempt"]),
        ("message", detail["message"]),
        ("pool", detail["pool"]),
        ("kind", detail["kind"]),
        ("priority", detail["priority"]),
        ("tenant", detail["tenant"]),
        ("arrival", detail["arrival"]),
        ("updated", detail["updated"]),
        ("payload", inspection.size_text(detail["payload_size"])),
        ("output", inspection.size_text(detail["output_size"])),
    ]
    if "spec_error" in detail:
        lines.append(("spec", f"undecodable: {detail['spec_error']}"))
    else:
        spec = detail["spec"]
        lines += [
            (name, value if isinstance(value, str) else json.dumps(value))
            for name, value in spec.items()
            if value
        ]
    for line in field_lines(lines):
        click.echo(line)
