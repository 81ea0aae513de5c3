"""What each dashboard page shows, read on one connection through the store's own queries.

No HTTP here: each function takes a `Connection` (in a read-only transaction the app opened)
and returns plain data for a template. Every page is one or two indexed queries, so a large
store stays fast; the overview's counts are the indexed ones in `repository.operators`.
"""

from __future__ import annotations

import json
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
from . import charts

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


JSON_MAX: Final = 1024 * 1024
"""A payload up to this size is tried as JSON (a larger one is shown as hex only)."""
JSON_PREVIEW: Final = 1500
"""Characters of the decoded JSON shown at first; the rest behind "show all"."""
JSON_FULL: Final = 64 * 1024
"""Characters of the decoded JSON "show all" reveals at most."""


def json_text(data: bytes | None) -> str | None:
    """`data` as indented JSON when it is a JSON document (UTF-8), else None. Escaping is the
    template's (autoescape): a payload's `<script>` is shown, never run."""
    if not data or len(data) > JSON_MAX:
        return None
    try:
        value = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(value, dict | list):
        return None  # a bare number or string says little as "JSON"
    return json.dumps(value, indent=2, ensure_ascii=False)


def duration_text(ns: int | None) -> str | None:
    """A duration for people: `250 ms`, `1 s`, `1.5 s`, `90 s`, `5 min`, `2 h`, `3 d`."""
    if ns is None:
        return None
    for unit, size, below in (
        ("ns", 1, 1_000),
        ("µs", 1_000, 1_000_000),
        ("ms", 1_000_000, 1_000_000_000),
        ("s", 1_000_000_000, 120 * 1_000_000_000),
        ("min", 60 * 1_000_000_000, 120 * 60 * 1_000_000_000),
        ("h", 3600 * 1_000_000_000, 48 * 3600 * 1_000_000_000),
    ):
        if abs(ns) < below:
            return f"{ns / size:.3g} {unit}"
    return f"{ns / (86400 * 1_000_000_000):.3g} d"


def retry_text(retry: dict[str, Any] | None) -> str | None:
    """A retry policy as `3 attempts, 1 s-60 s x2` (with `±10 %` when it jitters)."""
    if retry is None:
        return None
    text = (
        f"{retry['max_attempts']} attempts, {duration_text(retry['initial_backoff_ns'])}-"
        f"{duration_text(retry['max_backoff_ns'])} x{retry['multiplier']:g}"
    )
    return text + (f" ±{retry['jitter'] * 100:g} %" if retry["jitter"] else "")


def ms(iso: str | None) -> str | None:
    """An ISO 8601 time as `inspection.when` writes it, cut to milliseconds."""
    if iso is None or "." not in iso:
        return iso
    head, _, frac = iso.partition(".")
    return f"{head}.{frac[:3]}Z"


# Activity over time: per-minute counts through existing indexes only (docs/dashboard.md).

HOUR_MINUTES: Final = 60
DAY_MINUTES: Final = 24 * 60


def first_id_since(conn: Connection, since_ns: int) -> int | None:
    """The lowest task id that arrived at or after `since_ns`, found by binary search on the
    primary key (arrival has no index; engines hand out ids in submission order): about 64
    one-row seeks at most, whatever the table's size. None when no task arrived since."""
    low, high = conn.execute(operators.id_bounds_stmt()).one()
    if low is None:
        return None
    seek = operators.first_at_or_above_stmt()
    last = conn.execute(seek, {"id": high}).one()
    if last.arrival_unix_ns < since_ns:
        return None
    answer, lo, hi = int(high), int(low), int(high)
    while lo < hi:
        mid = lo + (hi - lo) // 2
        row = conn.execute(seek, {"id": mid}).one()  # exists: `high` is at or above it
        if row.arrival_unix_ns >= since_ns:
            answer, hi = int(row.id), mid
        else:
            lo = int(row.id) + 1
    return answer


def activity(conn: Connection, *, minutes: int, now_ns: int | None = None) -> dict[str, Any]:
    """Submissions and finishes (by status) per minute over the last `minutes` minutes, the
    current minute last: two index range reads (`operators.finished_per_minute_stmt`,
    `operators.submitted_per_minute_stmt`)."""
    now_ns = time.time_ns() if now_ns is None else now_ns
    last = now_ns // operators.MINUTE_NS
    first = last - minutes + 1
    since = first * operators.MINUTE_NS
    finished = {s: [0] * minutes for s in charts.FINISHED_STATUSES}
    for r in conn.execute(operators.finished_per_minute_stmt(), {"since": since}):
        i = int(r.minute) - first
        if 0 <= i < minutes and r.status in finished:
            finished[r.status][i] += int(r.n)
    submitted = [0] * minutes
    from_id = first_id_since(conn, since)
    if from_id is not None:
        params = {"from_id": from_id, "since": since}
        for r in conn.execute(operators.submitted_per_minute_stmt(), params):
            i = int(r.minute) - first
            if 0 <= i < minutes:
                submitted[i] += int(r.n)
    return {"minutes": minutes, "submitted": submitted, "finished": finished}


def activity_charts(conn: Connection) -> dict[str, Any]:
    """The overview's two charts (the last hour and the last day) and the day's totals."""
    day = activity(conn, minutes=DAY_MINUTES)
    hour = {
        "minutes": HOUR_MINUTES,
        "submitted": day["submitted"][-HOUR_MINUTES:],
        "finished": {s: v[-HOUR_MINUTES:] for s, v in day["finished"].items()},
    }
    return {
        "hour_svg": charts.activity_svg(
            chart_id="chart-hour", title="The last hour, per minute", span_label="-60 min",
            **hour,
        ),
        "day_svg": charts.activity_svg(
            chart_id="chart-day", title="The last day, per minute", span_label="-24 h", **day
        ),
        "hour_submitted": sum(hour["submitted"]),
        "day_submitted": sum(day["submitted"]),
        "hour_finished": {s: sum(v) for s, v in hour["finished"].items()},
        "day_finished": {s: sum(v) for s, v in day["finished"].items()},
    }  # fmt: skip


def finished_recently(conn: Connection, *, seconds: int = 3600) -> dict[str, int]:
    """Tasks finished in the last `seconds`, by status (the overview's Finished card)."""
    return inspection.finished_since(conn, seconds=seconds)


def overview(conn: Connection, *, schema: str | None, retention: timedelta) -> dict[str, Any]:
    """The overview: revision, lease, live tasks by pool and status (exact), finished and
    prunable counts (`inspection.count`: exact up to a cap, beyond it the planner's estimate),
    inbox, schedules, and on PostgreSQL the server's role. Nothing reads the history."""
    live = inspection.live_counts(conn)
    pools = sorted({c["pool"] for c in live})
    statuses = [s for s in STATUSES if any(c["status"] == s for c in live)]
    grid = {(c["pool"], c["status"]): c["count"] for c in live}
    counts = inspection.finished_counts(conn, retention)
    return {
        "revision": migrate.current_revision(conn, schema=schema),
        "head": migrate.head_revision(),
        "lease": inspection.lease_state(conn),
        "live": live,
        "pools": pools,
        "statuses": statuses,
        "grid": grid,
        "live_total": sum(c["count"] for c in live),
        "finished": inspection.count_text(counts["finished"]),
        "past_retention": inspection.count_text(counts["backlog"]),
        "retention": inspection.seconds_text(retention // timedelta(microseconds=1) * 1000),
        "schedules": int(conn.execute(operators.recurring_count_stmt()).scalar_one()),
        "inbox": inbox.depth(conn),
        "lost": recovery.lost_commits(conn),
        "finished_hour": finished_recently(conn),
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
    query = operators.TaskQuery(
        pools=[flt.pool] if flt.pool else [],
        statuses=[flt.status] if flt.status else [],
        key=flt.key,
        kind=flt.kind,
        before=flt.before,
        newest_first=True,
        limit=flt.limit + 1,  # one more says whether an older page exists
    )
    rows = inspection.list_tasks(conn, query)
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
    detail["payload_json"] = json_text(row.payload)
    detail["arrival"], detail["updated"] = ms(detail["arrival"]), ms(detail["updated"])
    spec = detail.get("spec")
    if spec is not None:
        spec["retry_text"] = retry_text(spec["retry"])
        spec["timeout_text"] = duration_text(spec["timeout_ns"])
        spec["duration_hint_text"] = duration_text(spec["duration_hint_ns"])
        spec["deadline"] = ms(spec["deadline"])
        if spec["fixed_start"] is not None:
            fixed = spec["fixed_start"]
            fixed["at"], fixed["tolerance"] = ms(fixed["at"]), duration_text(fixed["tolerance_ns"])
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
            "payload_size": inspection.size_text(r.payload_size),
        }
        for r in conn.execute(inbox.sized(inbox.rejects_stmt()), {"limit": LIST_MAX})
    ]
    return {"depth": inbox.depth(conn), "items": items, "rejects": rejects}
