"""What an operator reads of a database: status, counts, tasks and schedules, as plain data.

The one read-only API under `cronoq-store`'s commands and its dashboard (`web.views`): each
function takes a `Connection` (in whatever transaction the caller began) and returns dicts of
JSON-ready values (times as ISO 8601 UTC, durations in seconds), never a store object, and
never writes. How the figures are printed is the caller's.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, Final, Literal, TypedDict

from sqlalchemy import Connection, Select
from sqlalchemy import exc as sa_exc

from . import codec, dialects, durability, execution, inbox, lease, migrate
from .errors import CorruptValue
from .model import INT64_MAX, INT64_MIN, TaskStatus, TimeBase
from .repository import operators, recovery

UNIX: Final = TimeBase(unix_ns=0)
"""Decodes stored times as Unix nanoseconds (an operator has no engine time base)."""


class Count(TypedDict):
    """A count of tasks and how far to trust it (`count`)."""

    tasks: int
    accuracy: Literal["exact", "about", "more than"]


# How figures read.


def when(unix_ns: int | None) -> str | None:
    """Unix nanoseconds as ISO 8601 UTC (to the microsecond)."""
    if unix_ns is None:
        return None
    moment = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=unix_ns // 1000)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def seconds_text(ns: int | None) -> str | None:
    """A duration in nanoseconds as "1.5 s"."""
    return None if ns is None else f"{ns / 1e9:g} s"


def size_text(size: int | None) -> str:
    """A size in bytes as "1.5 KiB" ("-" when unknown)."""
    if size is None:
        return "-"
    if size < 1024:
        return f"{size} B"
    value = size / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def cutoff(older_than: timedelta) -> int:
    """The Unix nanoseconds `older_than` ago, saturated to the 64-bit range."""
    return codec.saturate(time.time_ns() - (older_than // timedelta(microseconds=1)) * 1000)


# The lease, the server, the database.


def lease_state(conn: Connection) -> dict[str, Any]:
    """The lease row: state free/held/expired, seconds left on the database clock."""
    row = lease.lease_view(conn)
    left = (row.expires_unix_ns - row.now) / 1e9
    state = "free" if row.holder is None else ("held" if left > 0 else "expired")
    return {
        "state": state,
        "holder": row.holder,
        "epoch": row.epoch,
        "expires_in_s": None if row.holder is None else round(left, 3),
        "next_epoch": lease.next_epoch(row.epoch),
    }


def server(conn: Connection) -> dict[str, Any] | None:
    """PostgreSQL: the role of the server reached and its synchronous replication, or None.

    A courtesy, as the size: a locked-down server may refuse it, and then the transaction is
    rolled back (read nothing after it that must share its snapshot).
    """
    stmt = dialects.server_role_stmt(conn.dialect)
    if stmt is None:
        return None
    try:
        row = conn.execute(stmt).one()
    except sa_exc.DBAPIError:
        conn.rollback()
        return None
    return {
        "role": "standby" if row.standby else "primary",
        "synchronous_standby_names": row.names,
        "synchronous_standbys_connected": int(row.connected),
        "synchronous_commit": row.commit,
    }


def durability_view(conn: Connection) -> dict[str, Any] | None:
    """What the server does with a commit (`durability`), read live; None where the server
    refuses to tell (then the transaction is rolled back, as in `server`).

    On SQLite `synchronous` is a setting of each connection, which every process sets from
    its `StoreConfig.full_sync`: a reader's own says nothing of the leader's, so it is left
    out (unknown) and a note says so."""
    try:
        settings = dialects.durability_settings(conn, execution.Flight)
    except sa_exc.DBAPIError:
        conn.rollback()
        return None
    impl = dialects.dialect_of(conn)
    if impl.sync_per_connection:
        settings["synchronous"] = None
    view = durability.classify(impl.name, settings).as_dict()
    if impl.sync_per_connection:
        view["note"] = (
            "synchronous is set by each process on its own connections: FULL unless its "
            "StoreConfig.full_sync is off (then a power loss can lose the last commits)"
        )
    return view


def database_size(conn: Connection, schema: str | None) -> int | None:
    """The database's size in bytes, or None where the server refuses to tell (then the
    transaction is rolled back, as in `server`)."""
    try:
        size = conn.execute(dialects.database_size_stmt(conn.dialect, schema)).scalar()
    except sa_exc.DBAPIError:
        conn.rollback()
        return None
    return None if size is None else int(size)


# Counts: each reads what it returns, whatever the history's size.


def live_counts(conn: Connection) -> list[dict[str, Any]]:
    """How many live tasks each pool holds in each status, exactly: the live index finds them,
    so the finished tasks (most of a large store) are never read."""
    return [
        {"pool": r.pool, "status": r.status, "count": r.n}
        for r in conn.execute(operators.live_counts_stmt())
    ]


def count(conn: Connection, rows: Select[Any], params: Mapping[str, Any] | None = None) -> Count:
    """How many of `rows` (an index range of the task table) there are: counted exactly up to
    `operators.COUNT_CAP`; beyond, the server planner's estimate ("about"), or on SQLite,
    which keeps none, "more than" the cap. Never more than the cap's index entries read."""
    cap = operators.COUNT_CAP
    given = dict(params or {})
    stmt = operators.capped_count_stmt(rows)
    counted = int(conn.execute(stmt, {**given, "cap": cap + 1}).scalar_one())
    if counted <= cap:
        return {"tasks": counted, "accuracy": "exact"}
    estimate = None
    if dialects.dialect_of(conn).explain_json is not None:
        plan = conn.execute(operators.Explain(rows), given).scalar()
        estimate = operators.planned_rows(plan)
    if estimate is None or estimate <= cap:
        return {"tasks": cap, "accuracy": "more than"}
    return {"tasks": estimate, "accuracy": "about"}


def count_text(found: Mapping[str, Any]) -> str:
    """A `count` for people: "12", "about 1,200,000", "more than 10,000"."""
    if found["accuracy"] == "exact":
        return f"{found['tasks']:,}"
    return f"{found['accuracy']} {found['tasks']:,}"


def finished_since(conn: Connection, *, seconds: int = 3600) -> dict[str, int]:
    """Tasks finished in the last `seconds`, by status (a short range of the finished-time
    index; every finished status listed, 0 when none)."""
    since = time.time_ns() - seconds * 1_000_000_000
    counts = {s.value: 0 for s in TaskStatus if s.is_terminal}
    for r in conn.execute(operators.finished_by_status_stmt(), {"since": since}):
        counts[r.status] = counts.get(r.status, 0) + int(r.n)
    return counts


def finished_counts(conn: Connection, retention: timedelta) -> dict[str, Count]:
    """How many tasks have finished, and how many of them finished longer ago than
    `retention` (the prune backlog, before `prune` spares those a live task depends on),
    each a `count`."""
    return {
        "finished": count(conn, operators.finished_rows_stmt()),
        "backlog": count(conn, operators.backlog_rows_stmt(), {"cutoff": cutoff(retention)}),
    }


def prunable_count(conn: Connection, before: int) -> int:
    """How many tasks `prune` would delete now, given its `before` (Unix ns)."""
    return int(conn.execute(operators.prunable_count_stmt(), {"cutoff": before}).scalar() or 0)


# Schedules.


def schedule(name: str, spec_text: str, payload: bytes | None, nxt: int | None, last: Any) -> Any:
    """A stored schedule as a dict; an undecodable one says why instead of failing."""
    out: dict[str, Any] = {"name": name, "next": when(nxt), "last_task": last}
    try:
        spec = codec.decode_recurring(UNIX, name, spec_text, payload)
    except CorruptValue as exc:
        out["schedule"] = f"undecodable: {exc}"
        return out
    if spec.cron is not None:
        out["schedule"] = f"cron {spec.cron} ({spec.timezone})"
    else:
        out["schedule"] = f"every {seconds_text(spec.interval_ns)}"
    out["pool"] = spec.template.pool
    return out


def schedules(conn: Connection) -> list[dict[str, Any]]:
    """Every schedule (`schedule`), by name."""
    return [
        schedule(r.name, r.spec, r.template_payload, r.next_unix_ns, r.last_task_id)
        for r in conn.execute(recovery.recurring_stmt())
    ]


# Status.


def status(conn: Connection, *, schema: str | None, retention: timedelta) -> dict[str, Any]:
    """Everything `cronoq-store status` reports, in its JSON form: the database, its schema
    revision, size, lease, live task counts, finished tasks (a `count`, and the last hour's
    by status), schedules, inbox, prune backlog (finished tasks older than `retention`, a
    `count`), and where known the server's role and the commits a failover lost."""
    revision = migrate.current_revision(conn, schema=schema)
    lease_view = lease_state(conn)
    counts = live_counts(conn)
    finished = finished_counts(conn, retention)
    recurring = schedules(conn)
    size = database_size(conn, schema)
    url = dialects.safe_url(conn.engine.url)
    dialect = dialects.dialect_of(conn).name
    waiting = inbox.depth(conn)
    role = server(conn)
    durable = durability_view(conn)
    lost = recovery.lost_commits(conn)
    last_hour = finished_since(conn)
    data: dict[str, Any] = {
        "database": url,
        "dialect": dialect,
        "revision": revision,
        "head": migrate.head_revision(),
        "size_bytes": size,
        "lease": lease_view,
        "tasks": counts,
        "recurring": recurring,
        "inbox": waiting,
        "finished": {**finished["finished"], "last_hour": last_hour},
        "prune_backlog": {**finished["backlog"], "retention_s": retention.total_seconds()},
    }
    if role is not None:
        data["server"] = role
    if durable is not None:
        data["durability"] = durable
    if lost is not None:
        data["lost_commits"] = dataclasses.asdict(lost)
    return data


# Tasks.


def task_dict(row: Any) -> dict[str, Any]:
    """A listed task row (`repository.operators.list_tasks_stmt`, `task_row_stmt`) as a dict."""
    status = TaskStatus.from_name(row.status)
    return {
        "id": row.id,
        "key": row.key,
        "pool": row.pool,
        "kind": row.kind,
        "priority": codec.priority_from(row.priority).name.lower(),
        "tenant": row.tenant,
        "status": row.status,
        "terminal": None if status is None else status.is_terminal,
        "attempt": row.attempt,
        "updated": when(row.updated_unix_ns),
        "message": row.message,
        "output_size": row.output_size,
    }


def task_detail(row: Any) -> dict[str, Any]:
    """One task row in full: its record and its decoded spec (or why it cannot be decoded)."""
    out = task_dict(row)
    out["seq"] = row.seq
    out["arrival"] = when(row.arrival_unix_ns)
    out["payload_size"] = len(row.payload)
    try:
        spec = codec.spec_from_columns(UNIX, row._mapping)
    except CorruptValue as exc:
        out["spec_error"] = str(exc)
        return out
    fixed = spec.fixed_start
    out["spec"] = {
        "deadline": when(spec.deadline),
        "fixed_start": None
        if fixed is None
        else {"at": when(fixed.at), "tolerance_ns": fixed.tolerance_ns, "on_miss": fixed.on_miss},
        "duration_hint_ns": spec.duration_hint_ns,
        "timeout_ns": spec.timeout_ns,
        "retry": None if spec.retry is None else codec.retry_obj(spec.retry),
        "deps": [
            {
                "id": getattr(d.target, "id", None),
                "key": getattr(d.target, "key", None),
                "on": d.on,
            }
            for d in spec.deps
        ],
        "resources": dict(spec.resources),
        "tags": sorted(spec.tags),
        "labels": dict(spec.labels),
    }
    return out


def list_tasks(conn: Connection, query: operators.TaskQuery) -> list[dict[str, Any]]:
    """Tasks (live and finished) as `query` pages them (`task_dict` each); an `after` or
    `before` beyond the 64-bit range clamps."""
    after, before = query.after, query.before
    if after is not None:
        after = None if after < INT64_MIN else min(after, INT64_MAX)  # below: every id is above
    if before is not None:
        before = max(before, INT64_MIN) if before <= INT64_MAX else None
    clamped = dataclasses.replace(query, after=after, before=before)
    return [task_dict(r) for r in conn.execute(operators.list_tasks_stmt(clamped))]


def find_task(
    conn: Connection, *, task_id: int | None = None, key: str | None = None
) -> dict[str, Any] | None:
    """One task in full (`task_detail`) by id, or the newest task with `key`; None if absent."""
    if task_id is not None:
        if not INT64_MIN <= task_id <= INT64_MAX:
            return None  # no task can have it
        stmt = operators.task_row_stmt(task_id=task_id)
    else:
        stmt = operators.task_row_stmt(key=key)
    row = conn.execute(stmt).first()
    return None if row is None else task_detail(row)
