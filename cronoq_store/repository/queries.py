"""The store's queries: a task by id or key, the finished tasks, a task's output. Rows become
`TaskRecord`s through `codec.record_from`."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any, Final

from sqlalchemy import Connection, Select, and_, bindparam, select

from .. import codec
from ..errors import InvalidValue, StoreError
from ..model import INT64_MAX, INT64_MIN, TaskRecord, TaskStatus
from ..schema import tasks

RECORD_COLUMNS: Final = (
    tasks.c.id,
    tasks.c.key,
    tasks.c.pool,
    tasks.c.kind,
    tasks.c.priority,
    tasks.c.tenant,
    tasks.c.status,
    tasks.c.attempt,
    tasks.c.message,
    tasks.c.output,
    tasks.c.updated_unix_ns,
)
"""A task record's columns, as `codec.record_from` reads them."""


@cache
def task_by_id_stmt() -> Select[Any]:
    """A task by id."""
    return select(*RECORD_COLUMNS).where(tasks.c.id == bindparam("id"))


@cache
def task_by_key_stmt() -> Select[Any]:
    """The newest task with a key."""
    return (
        select(*RECORD_COLUMNS)
        .where(tasks.c.key == bindparam("key"))
        .order_by(tasks.c.id.desc())
        .limit(1)
    )


@cache
def list_finished_stmt(*, pools: bool, statuses: bool, after: bool) -> Select[Any]:
    """Finished tasks in id order, optionally filtered; keyset-paged by id."""
    conditions = [tasks.c.terminal == True]  # noqa: E712
    if pools:
        conditions.append(tasks.c.pool.in_(bindparam("pools", expanding=True)))
    if statuses:
        conditions.append(tasks.c.status.in_(bindparam("statuses", expanding=True)))
    if after:
        conditions.append(tasks.c.id > bindparam("after"))
    return (
        select(*RECORD_COLUMNS)
        .where(and_(*conditions))
        .order_by(tasks.c.id)
        .limit(bindparam("limit"))
    )


@cache
def output_of_stmt() -> Select[Any]:
    """The output of a task that succeeded."""
    return select(tasks.c.output).where(
        tasks.c.id == bindparam("id"), tasks.c.status == TaskStatus.SUCCEEDED.value
    )


def get_task(
    conn: Connection, *, task_id: int | None = None, key: str | None = None
) -> TaskRecord | None:
    if task_id is not None:
        if not INT64_MIN <= task_id <= INT64_MAX:
            return None  # no stored id lies outside the 64-bit range
        row = conn.execute(task_by_id_stmt(), {"id": task_id}).mappings().first()
    else:
        row = conn.execute(task_by_key_stmt(), {"key": codec.clean(key or "")}).mappings().first()
    return None if row is None else codec.record_from(row)


def list_finished(
    conn: Connection,
    *,
    pools: Sequence[str],
    statuses: Sequence[TaskStatus],
    after: int | None,
    limit: int,
) -> list[TaskRecord]:
    for name, value in (("limit", limit), ("after", after)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise InvalidValue(f"{name} must be an int, not {type(value).__name__}")
    if limit < 0:
        raise StoreError("limit must not be negative")
    # Bounds beyond the 64-bit range clamp: every id lies above a lower `after`, none above
    # the top one, and no LIMIT larger than BIGINT is needed.
    limit = min(limit, INT64_MAX)
    if after is not None and after < INT64_MIN:
        after = None
    elif after is not None and after >= INT64_MAX:
        return []
    stmt = list_finished_stmt(pools=bool(pools), statuses=bool(statuses), after=after is not None)
    params: dict[str, Any] = {"limit": limit}
    if pools:
        params["pools"] = [codec.clean(p) for p in pools]
    if statuses:
        params["statuses"] = [TaskStatus(s).value for s in statuses]
    if after is not None:
        params["after"] = after
    return [codec.record_from(r) for r in conn.execute(stmt, params).mappings()]


def load_output(conn: Connection, task_id: int) -> bytes | None:
    if not isinstance(task_id, int) or isinstance(task_id, bool):
        raise InvalidValue(f"a task id must be an int, not {type(task_id).__name__}")
    if not INT64_MIN <= task_id <= INT64_MAX:
        return None
    out = conn.execute(output_of_stmt(), {"id": task_id}).scalar()
    return None if out is None else codec.stored_blob("output", out)
