"""Operators' read-only queries: the statements the CLI and the dashboard run, and nothing of
the store's own path. Each is a Core statement the caller executes.

`status` and the overview read only what they return, whatever the history's size: live
tasks exactly through the live index, finished tasks counted up to `COUNT_CAP` on the
finished-time index and beyond it estimated by the server's planner (`Explain`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Final

import sqlalchemy as sa
from sqlalchemy import BigInteger, Select, bindparam, func, literal_column, select
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler

from .. import codec
from ..schema import recurring, tasks
from . import prune, queries

COUNT_CAP: Final = 10_000
"""Finished tasks counted one by one at most: beyond, a count is the planner's estimate."""


def task_counts_stmt() -> Select[Any]:
    """How many tasks each pool holds in each status, live and finished: every row of the
    table (`benchmarks/bench_web.py` compares it; `status` counts the live ones only)."""
    return (
        select(tasks.c.pool, tasks.c.status, func.count().label("n"))
        .group_by(tasks.c.pool, tasks.c.status)
        .order_by(tasks.c.pool, tasks.c.status)
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskQuery:
    """Which tasks a listing returns: filters, and a keyset page by id."""

    pools: Sequence[str] = ()
    statuses: Sequence[str] = ()
    key: str | None = None
    tenant: str | None = None
    kind: str | None = None
    after: int | None = None
    """Oldest first above this id (the CLI)."""
    before: int | None = None
    """Only ids below this one (the dashboard's next page)."""
    limit: int = 50
    newest_first: bool = False


_LIST_COLUMNS: Final = (
    *(c for c in queries.RECORD_COLUMNS if c.name != "output"),
    func.length(tasks.c.output).label("output_size"),
)
"""A task record's columns for listings: the output only as its size."""


def list_tasks_stmt(q: TaskQuery) -> Select[Any]:
    """Tasks (live and finished) in id order, filtered, keyset-paged by id: oldest first above
    `after` (the CLI), or `newest_first` below `before` (the dashboard)."""
    stmt = select(*_LIST_COLUMNS)
    if q.pools:
        stmt = stmt.where(tasks.c.pool.in_([codec.clean(p) for p in q.pools]))
    if q.statuses:
        stmt = stmt.where(tasks.c.status.in_(list(q.statuses)))
    for column, value in ((tasks.c.key, q.key), (tasks.c.tenant, q.tenant), (tasks.c.kind, q.kind)):
        if value is not None:
            stmt = stmt.where(column == codec.clean(value))
    if q.after is not None:
        stmt = stmt.where(tasks.c.id > q.after)
    if q.before is not None:
        stmt = stmt.where(tasks.c.id < q.before)
    order = tasks.c.id.desc() if q.newest_first else tasks.c.id
    return stmt.order_by(order).limit(q.limit)


# The dashboard's overview: each count on an index, so it stays fast on a large store.


@cache
def live_counts_stmt() -> Select[Any]:
    """How many live tasks each pool holds in each status: the (terminal, id) index finds
    them, so the finished tasks (most of a large store) are never read."""
    return (
        select(tasks.c.pool, tasks.c.status, func.count().label("n"))
        .where(tasks.c.terminal == False)  # noqa: E712
        .group_by(tasks.c.pool, tasks.c.status)
        .order_by(tasks.c.pool, tasks.c.status)
    )


@cache
def finished_count_stmt() -> Select[Any]:
    """How many tasks have finished: a count of the (terminal, id) index alone."""
    return select(func.count()).select_from(tasks).where(tasks.c.terminal == True)  # noqa: E712


@cache
def finished_since_count_stmt() -> Select[Any]:
    """How many tasks finished at or after `cutoff`: a range of the finished-time index. The
    finished count less this is the prune backlog (before `prune` spares those a live task
    depends on); on a large store most finished tasks are old, so counting the recent ones
    reads far fewer index entries than counting the old."""
    return (
        select(func.count())
        .select_from(tasks)
        .where(tasks.c.finished_unix_ns >= bindparam("cutoff"))
    )


@cache
def finished_rows_stmt() -> Select[Any]:
    """Every finished task, as finish times: the finished-time index alone (its NULLs are the
    live tasks). Counted by `capped_count_stmt`, estimated by `Explain`."""
    return select(tasks.c.finished_unix_ns).where(tasks.c.finished_unix_ns.is_not(None))


@cache
def backlog_rows_stmt() -> Select[Any]:
    """The finished tasks that finished before `cutoff` (the prune backlog, before `prune`
    spares those a live task depends on): a range of the finished-time index."""
    return select(tasks.c.finished_unix_ns).where(tasks.c.finished_unix_ns < bindparam("cutoff"))


def capped_count_stmt(rows: Select[Any]) -> Select[Any]:
    """How many of `rows` there are, counting no further than `cap` (a bound parameter): the
    cost of a count that stops, whatever the history's size."""
    return select(func.count()).select_from(rows.limit(bindparam("cap")).subquery("capped"))


class Explain(sa.Executable, sa.ClauseElement):
    """The server's plan of `stmt`, not run: its estimate of the rows is the count of a large
    history without reading it (PostgreSQL: `EXPLAIN (FORMAT JSON)`, from the statistics
    ANALYZE and autovacuum keep; MariaDB/MySQL: `EXPLAIN FORMAT=JSON`, from a few index dives).
    SQLite has no estimate: `planned_rows` is for the servers only."""

    inherit_cache = False

    def __init__(self, stmt: Select[Any]) -> None:
        self.stmt = stmt


@compiles(Explain, "postgresql")
def _explain_postgresql(element: Explain, compiler: SQLCompiler, **kw: Any) -> str:
    return "EXPLAIN (FORMAT JSON) " + compiler.process(element.stmt, **kw)


@compiles(Explain, "mysql")
@compiles(Explain, "mariadb")
def _explain_mysql(element: Explain, compiler: SQLCompiler, **kw: Any) -> str:
    return "EXPLAIN FORMAT=JSON " + compiler.process(element.stmt, **kw)


def planned_rows(doc: Any) -> int | None:
    """The rows a plan (`Explain`'s one value, parsed or as text) expects from the task table:
    PostgreSQL's top node's "Plan Rows"; MariaDB/MySQL's access to the table, its rows less
    those it expects to filter out."""
    if isinstance(doc, str | bytes):
        doc = json.loads(doc)
    if isinstance(doc, list):  # PostgreSQL
        return int(doc[0]["Plan"]["Plan Rows"])
    found = _mysql_access(doc)
    if found is None:
        return None
    rows = float(found.get("rows") or 0) * float(found.get("filtered") or 100) / 100
    return int(rows)


def _mysql_access(node: Any) -> dict[str, Any] | None:
    if isinstance(node, dict):
        if node.get("table_name") == tasks.name and "rows" in node:
            return node
        nodes = list(node.values())
    elif isinstance(node, list):
        nodes = node
    else:
        return None
    for child in nodes:
        found = _mysql_access(child)
        if found is not None:
            return found
    return None


@cache
def recurring_count_stmt() -> Select[Any]:
    """How many schedules there are."""
    return select(func.count()).select_from(recurring)


@cache
def output_head_stmt() -> Select[Any]:
    """The first `n` bytes of one task's output (a preview; the output is never read whole)."""
    return select(func.substr(tasks.c.output, 1, bindparam("n"))).where(
        tasks.c.id == bindparam("task_id")
    )


def task_row_stmt(*, task_id: int | None = None, key: str | None = None) -> Select[Any]:
    """Every column of one task, by id, or the newest task with `key`; the output as its size."""
    columns = [c for c in tasks.c if c.name != "output"]
    stmt = select(*columns, func.length(tasks.c.output).label("output_size"))
    if task_id is not None:
        return stmt.where(tasks.c.id == task_id)
    return stmt.where(tasks.c.key == codec.clean(key or "")).order_by(tasks.c.id.desc()).limit(1)


@cache
def prunable_count_stmt() -> Select[Any]:
    """What `prune` would delete now, counted: its batch statement without order or LIMIT."""
    victims = prune.prunable_stmt().order_by(None).limit(None)
    return select(func.count()).select_from(victims.subquery())


# The dashboard's activity over time: per-minute counts read through existing indexes only.

MINUTE_NS: Final = 60 * 1_000_000_000
_MINUTE: Final = literal_column(str(MINUTE_NS), BigInteger)
"""Inline, not bound: a bound divisor is a new parameter in GROUP BY, which PostgreSQL then
does not see as the selected expression."""


@cache
def finished_per_minute_stmt() -> Select[Any]:
    """Tasks finished at or after `since`, per minute (`finished_unix_ns // MINUTE_NS`) and
    status: a range of the finished-time index, each row's status read beside it."""
    minute = (tasks.c.finished_unix_ns // _MINUTE).label("minute")
    return (
        select(minute, tasks.c.status, func.count().label("n"))
        .where(tasks.c.finished_unix_ns >= bindparam("since"))
        .group_by(minute, tasks.c.status)
    )


@cache
def finished_by_status_stmt() -> Select[Any]:
    """Tasks finished at or after `since`, by status (the overview's finished counts): the
    same index range as `finished_per_minute_stmt`."""
    return (
        select(tasks.c.status, func.count().label("n"))
        .where(tasks.c.finished_unix_ns >= bindparam("since"))
        .group_by(tasks.c.status)
    )


@cache
def id_bounds_stmt() -> Select[Any]:
    """The lowest and highest task id: both ends of the primary key, each its own subquery
    (SQLite reads a lone MIN or MAX off the index's end, but scans for the two together)."""
    return select(
        select(func.min(tasks.c.id)).scalar_subquery(),
        select(func.max(tasks.c.id)).scalar_subquery(),
    )


@cache
def first_at_or_above_stmt() -> Select[Any]:
    """The first task at or above id `id`, with its arrival: one primary-key seek."""
    return (
        select(tasks.c.id, tasks.c.arrival_unix_ns)
        .where(tasks.c.id >= bindparam("id"))
        .order_by(tasks.c.id)
        .limit(1)
    )


@cache
def submitted_per_minute_stmt() -> Select[Any]:
    """Tasks at or above id `from_id` that arrived at or after `since`, per minute of
    arrival: a primary-key range (arrival has no index; engines hand out ids in submission
    order, so the ids of the window's tasks are one range, found by `first_at_or_above_stmt`)."""
    minute = (tasks.c.arrival_unix_ns // _MINUTE).label("minute")
    return (
        select(minute, func.count().label("n"))
        .where(tasks.c.id >= bindparam("from_id"), tasks.c.arrival_unix_ns >= bindparam("since"))
        .group_by(minute)
    )
