"""Operators' read-only queries: the statements the CLI and the dashboard run, and nothing of
the store's own path. Each is a Core statement the caller executes."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any, Final

from sqlalchemy import BigInteger, Select, bindparam, func, literal_column, select

from .. import codec
from ..schema import recurring, tasks
from . import prune, queries


def task_counts_stmt() -> Select[Any]:
    """How many tasks each pool holds in each status."""
    return (
        select(tasks.c.pool, tasks.c.status, func.count().label("n"))
        .group_by(tasks.c.pool, tasks.c.status)
        .order_by(tasks.c.pool, tasks.c.status)
    )


def prune_backlog_stmt() -> Select[Any]:
    """How many finished tasks were last updated before `cutoff` (what prune is behind by; the
    finished-by-time index answers it)."""
    return select(func.count()).where(
        tasks.c.terminal == True,  # noqa: E712
        tasks.c.finished_unix_ns < bindparam("cutoff"),
    )


_LIST_COLUMNS: Final = (
    *(c for c in queries.RECORD_COLUMNS if c.name != "output"),
    func.length(tasks.c.output).label("output_size"),
)
"""A task record's columns for listings: the output only as its size."""


def list_tasks_stmt(
    *,
    pools: Sequence[str],
    statuses: Sequence[str],
    key: str | None,
    tenant: str | None,
    after: int | None,
    limit: int,
    kind: str | None = None,
    before: int | None = None,
    newest_first: bool = False,
) -> Select[Any]:
    """Tasks (live and finished) in id order, filtered, keyset-paged by id: oldest first above
    `after` (the CLI), or `newest_first` below `before` (the dashboard)."""
    stmt = select(*_LIST_COLUMNS)
    if pools:
        stmt = stmt.where(tasks.c.pool.in_([codec.clean(p) for p in pools]))
    if statuses:
        stmt = stmt.where(tasks.c.status.in_(list(statuses)))
    if key is not None:
        stmt = stmt.where(tasks.c.key == codec.clean(key))
    if tenant is not None:
        stmt = stmt.where(tasks.c.tenant == codec.clean(tenant))
    if kind is not None:
        stmt = stmt.where(tasks.c.kind == codec.clean(kind))
    if after is not None:
        stmt = stmt.where(tasks.c.id > after)
    if before is not None:
        stmt = stmt.where(tasks.c.id < before)
    order = tasks.c.id.desc() if newest_first else tasks.c.id
    return stmt.order_by(order).limit(limit)


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
