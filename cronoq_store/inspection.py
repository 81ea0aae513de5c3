"""What an operator reads of a database: status, counts, tasks and schedules, as plain data.

The one read-only API under `cronoq-store`'s commands and its dashboard (`web.views`): each
function takes a `Connection` (in whatever transaction the caller began) and returns dicts of
JSON-ready values (times as ISO 8601 UTC, durations in seconds), never a store object, and
never writes. How the figures are printed is the caller's.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from sqlalchemy import Connection
from sqlalchemy import exc as sa_exc

from . import codec, dialects, durability, inbox, lease, migrate
from .errors import CorruptValue
from .model import INT64_MAX, INT64_MIN, TaskStatus, TimeBase
from .repository import operators, recovery

UNIX: Final = TimeBase(unix_ns=0)
"""Decodes stored times as Unix nanoseconds (an operator has no engine time base)."""


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
        settings = dialects.durability_settings(conn)
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


# Counts.


def task_counts(conn: Connection) -> list[dict[str, Any]]:
    """How many tasks each pool holds in each status, live and finished."""
    return [
        {"pool": r.pool, "status": r.status, "count": r.n}
        for r in conn.execute(operators.task_counts_stmt())
    ]


def prune_backlog(conn: Connection, before: int) -> int:
    """How many finished tasks were last updated before `before` (Unix ns)."""
    return int(conn.execute(operators.prune_backlog_stmt(), {"cutoff": before}).scalar_one())


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
    revision, size, lease, task counts, schedules, inbox, prune backlog (finished tasks older
    than `retention`), and where known the server's role and the commits a failover lost."""
    revision = migrate.current_revision(conn, schema=schema)
    lease_view = lease_state(conn)
    counts = task_counts(conn)
    recurring = schedules(conn)
    size = database_size(conn, schema)
    url = dialects.safe_url(conn.engine.url)
    dialect = dialects.dialect_of(conn).name
    waiting = inbox.depth(conn)
    role = server(conn)
    durable = durability_view(conn)
    lost = recovery.lost_commits(conn)
    backlog = prune_backlog(conn, cutoff(retention))
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
        "prune_backlog": {"tasks": backlog, "retention_s": retention.total_seconds()},
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


def list_tasks(
    conn: Connection,
    *,
    pools: Sequence[str],
    statuses: Sequence[str],
    key: str | None,
    tenant: str | None,
    after: int | None,
    limit: int,
) -> list[dict[str, Any]]:
    """Tasks (live and finished) in id order above `after` (`task_dict` each), at most `limit`;
    an `after` beyond the 64-bit range clamps."""
    if after is not None and after < INT64_MIN:
        after = None  # every id is above it
    stmt = operators.list_tasks_stmt(
        pools=pools,
        statuses=[s.lower() for s in statuses],
        key=key,
        tenant=tenant,
        after=None if after is None else min(after, INT64_MAX),
        limit=limit,
    )
    return [task_dict(r) for r in conn.execute(stmt)]


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
