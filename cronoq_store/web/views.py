"""What each dashboard page shows, read on one connection through the store's own queries.

No HTTP here: each function takes a `Connection` (in a read-only transaction the app opened)
and returns plain data for a template. Every page is one or two indexed queries, so a large
store stays fast; the overview's counts are the indexed ones in `repository.operators`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final

from sqlalchemy import Connection

from .. import codec, inbox, inspection, migrate
from ..errors import CorruptValue
from ..model import TaskStatus
from ..repository import operators, recovery
from ..schema import inbox as inbox_table

PAGE: Final = 50
"""Tasks per page unless the address asks for another size (up to `PAGE_MAX`)."""
PAGE_MAX: Final = 500
LIST_MAX: Final = 200
"""Inbox items and set-aside rows shown (the oldest first)."""
PREVIEW_BYTES: Final = 32
"""How much of a payload or output is shown, in hexadecimal: never the whole, never as HTML."""
STATUSES: Final = tuple(s.value for s in TaskStatus)


def hex_preview(data: bytes | None) -> str:
    """The first `PREVIEW_BYTES` bytes as spaced hex pairs, with "…" when there is more."""
    if not data:
        return ""
    head = bytes(data[:PREVIEW_BYTES]).hex(" ")
    return head + (" …" if len(data) > PREVIEW_BYTES else "")


def overview(conn: Connection, *, schema: str | None, retention: timedelta) -> dict[str, Any]:
    """The overview: revision, lease, live tasks by pool and status, finished and prunable
    counts, inbox, schedules, and on PostgreSQL the server's role."""
    cutoff = codec.saturate(time.time_ns() - (retention // timedelta(microseconds=1)) * 1000)
    live = [
        {"pool": r.pool, "status": r.status, "count": r.n}
        for r in conn.execute(operators.live_counts_stmt())
    ]
    pools = sorted({c["pool"] for c in live})
    statuses = [s for s in STATUSES if any(c["status"] == s for c in live)]
    grid = {(c["pool"], c["status"]): c["count"] for c in live}
    finished = int(conn.execute(operators.finished_count_stmt()).scalar_one())
    recent = int(
        conn.execute(operators.finished_since_count_stmt(), {"cutoff": cutoff}).scalar_one()
    )
    return {
        "revision": migrate.current_revision(conn, schema=schema),
        "head": migrate.head_revision(),
        "lease": inspection.lease_state(conn),
        "live": live,
        "pools": pools,
        "statuses": statuses,
        "grid": grid,
        "live_total": sum(c["count"] for c in live),
        "finished": finished,
        # Under READ COMMITTED each count has its own snapshot: a prune in between must not
        # make the backlog negative.
        "past_retention": max(0, finished - recent),
        "retention": inspection.seconds_text(retention // timedelta(microseconds=1) * 1000),
        "schedules": int(conn.execute(operators.recurring_count_stmt()).scalar_one()),
        "inbox": inbox.depth(conn),
        "lost": recovery.lost_commits(conn),
        # Last: on a server that refuses it, `inspection.server` rolls back (ending the read-only
        # transaction), and nothing may read after that.
        "server": inspection.server(conn),
    }


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskFilter:
    """The tasks page's filters and page position, as the address gives them."""

    pool: str | None = None
    """Only this pool."""
    status: str | None = None
    """Only this status (one of `STATUSES`)."""
    kind: str | None = None
    """Only this kind."""
    key: str | None = None
    """Only tasks with this key."""
    before: int | None = None
    """Only ids below this one (the next page of a newest-first listing)."""
    limit: int = PAGE
    """Page size."""

    def query(self, **changes: object) -> dict[str, str]:
        """The filters as address parameters (those set), with `changes` applied."""
        values: dict[str, object] = {
            "pool": self.pool,
            "status": self.status,
            "kind": self.kind,
            "key": self.key,
            "before": self.before,
            "limit": None if self.limit == PAGE else self.limit,
        } | changes
        return {k: str(v) for k, v in values.items() if v is not None and v != ""}


def tasks_page(conn: Connection, flt: TaskFilter) -> dict[str, Any]:
    """One page of tasks, newest first, and where the next (older) page starts."""
    stmt = operators.list_tasks_stmt(
        pools=[flt.pool] if flt.pool else [],
        statuses=[flt.status] if flt.status else [],
        key=flt.key,
        tenant=None,
        after=None,
        kind=flt.kind,
        before=flt.before,
        newest_first=True,
        limit=flt.limit + 1,  # one more says whether an older page exists
    )
    rows = [inspection.task_dict(r) for r in conn.execute(stmt)]
    more = len(rows) > flt.limit
    rows = rows[: flt.limit]
    return {"tasks": rows, "older": rows[-1]["id"] if more else None}


def task_page(conn: Connection, task_id: int) -> dict[str, Any] | None:
    """One task in full (as `cronoq-store show --json`), with hex previews; None if absent."""
    row = conn.execute(operators.task_row_stmt(task_id=task_id)).first()
    if row is None:
        return None
    detail = inspection.task_detail(row)
    detail["payload_preview"] = hex_preview(row.payload)
    detail["payload_size_text"] = inspection.size_text(detail["payload_size"])
    detail["output_size_text"] = inspection.size_text(detail["output_size"])
    head = None
    if row.output_size:
        head = conn.execute(
            operators.output_head_stmt(), {"task_id": task_id, "n": PREVIEW_BYTES + 1}
        ).scalar()
    detail["output_preview"] = hex_preview(head)
    return detail


def schedules(conn: Connection) -> list[dict[str, Any]]:
    """Every schedule: name, cron or interval, time zone, next run, last task."""
    out = []
    for r in conn.execute(recovery.recurring_stmt()):
        item: dict[str, Any] = {
            "name": r.name,
            "next": inspection.when(r.next_unix_ns),
            "last_task": r.last_task_id,
        }
        try:
            spec = codec.decode_recurring(inspection.UNIX, r.name, r.spec, r.template_payload)
        except CorruptValue as exc:
            item["error"] = str(exc)
        else:
            item["cron"] = spec.cron
            item["interval"] = inspection.seconds_text(spec.interval_ns)
            item["timezone"] = spec.timezone
            item["pool"] = spec.template.pool
        out.append(item)
    return out


def inbox_page(conn: Connection) -> dict[str, Any]:
    """The oldest waiting inbox items and the rows set aside, with why."""
    now = time.time_ns()
    items = [
        {
            "id": r.id,
            "age_s": round(max(0, now - r.enqueued_unix_ns) / 1e9, 1),
            "kind": r.kind,
            "pool": r.pool,
            "key": r.key,
        }
        for r in conn.execute(
            inbox.oldest_stmt(after=False).with_only_columns(
                inbox_table.c.id,
                inbox_table.c.enqueued_unix_ns,
                inbox_table.c.kind,
                inbox_table.c.pool,
                inbox_table.c.key,
            ),
            {"limit": LIST_MAX},
        )
    ]
    rejects = [
        {
            "inbox_id": r.inbox_id,
            "enqueued": inspection.when(r.enqueued_unix_ns),
            "rejected": inspection.when(r.rejected_unix_ns),
            "reason": r.reason,
            "payload_size": inspection.size_text(None if r.payload is None else len(r.payload)),
        }
        for r in conn.execute(inbox.rejects_stmt(), {"limit": LIST_MAX})
    ]
    return {"depth": inbox.depth(conn), "items": items, "rejects": rejects}
