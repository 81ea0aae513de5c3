"""Commit writing: a folded batch (`folding.Folded`) written into the tables, beside the
statements that write it.

`write` runs in the caller's fenced transaction and never commits: the lease check that
precedes it (`lease.fence`) and the commit that follows are the caller's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import cache
from typing import Any

from sqlalchemy import (
    Connection,
    Delete,
    Insert,
    Select,
    Update,
    bindparam,
    case,
    delete,
    func,
    insert,
    null,
    select,
    true,
    update,
)

from .. import codec, dialects, execution
from ..errors import CorruptValue
from ..model import RecurringRemove, RecurringUpsert, TaskId, TaskStatus, TimeBase
from ..schema import inbox, recurring, task_deps, tasks
from . import folding

log = logging.getLogger(__name__)


@cache
def existing_ids_stmt() -> Select[Any]:
    """Which of the given task ids are already stored (makes inserts idempotent)."""
    return select(tasks.c.id).where(tasks.c.id.in_(bindparam("ids", expanding=True)))


@cache
def status_update_stmt() -> Update:
    """One task's transition; a terminal one releases its live key."""
    return (
        update(tasks)
        .where(tasks.c.id == bindparam("b_id"))
        .values(
            status=bindparam("b_status"),
            terminal=bindparam("b_terminal"),
            attempt=bindparam("b_attempt"),
            updated_unix_ns=bindparam("b_at"),
            message=func.coalesce(
                bindparam("b_message", type_=tasks.c.message.type), tasks.c.message
            ),
            # A terminal transition releases the key; a live one (a revival too) holds it.
            live_key=case((bindparam("b_terminal") == true(), null()), else_=tasks.c.key),
            # Set when it finishes, NULL while live: a live transition changes no indexed
            # column, so PostgreSQL can update the row in place (HOT), leaving no dead index
            # entries behind.
            finished_unix_ns=case(
                (bindparam("b_terminal") == true(), bindparam("b_at")), else_=null()
            ),
        )
    )


@cache
def status_update_live_stmt() -> Update:
    """`status_update_stmt` for a live transition, matching only a task still live (whose
    live key it keeps): what needs no look at the row first, as a revival does."""
    return status_update_stmt().where(tasks.c.terminal == False)  # noqa: E712


@cache
def revived_stmt() -> Select[Any]:
    """Which of the given tasks are finished now (a live transition revives them), with deps."""
    return select(tasks.c.id, tasks.c.deps).where(
        tasks.c.terminal == True,  # noqa: E712
        tasks.c.id.in_(bindparam("ids", expanding=True)),
    )


@cache
def status_output_stmt() -> Update:
    """A transition to succeeded that stores the task's output in the same statement."""
    return status_update_stmt().values(output=bindparam("b_output"))


@cache
def delete_deps_stmt() -> Delete:
    """Drop the dependency rows of tasks that finished."""
    return delete(task_deps).where(task_deps.c.task_id.in_(bindparam("ids", expanding=True)))


@cache
def insert_tasks_stmt() -> Insert:
    """New task rows."""
    return insert(tasks)


@cache
def insert_deps_stmt() -> Insert:
    """Dependency rows of new live tasks."""
    return insert(task_deps)


@cache
def inbox_take_stmt() -> Delete:
    """Remove inbox rows the engine has dealt with (a row already gone changes nothing)."""
    return delete(inbox).where(inbox.c.id.in_(bindparam("ids", expanding=True)))


@cache
def output_stmt() -> Update:
    """Store the output of a task that succeeded (`b_succeeded` is that status's name)."""
    return (
        update(tasks)
        .where(tasks.c.id == bindparam("b_id"), tasks.c.status == bindparam("b_succeeded"))
        .values(output=bindparam("b_output"))
    )


@cache
def recurring_update_stmt() -> Update:
    """Replace a schedule's spec (its next/last stay)."""
    return (
        update(recurring)
        .where(recurring.c.name == bindparam("b_name"))
        .values(spec=bindparam("b_spec"), template_payload=bindparam("b_payload"))
    )


@cache
def recurring_insert_stmt() -> Insert:
    """A new schedule."""
    return insert(recurring)


@cache
def recurring_delete_stmt() -> Delete:
    """Remove a schedule."""
    return delete(recurring).where(recurring.c.name == bindparam("b_name"))


@cache
def recurring_next_stmt() -> Update:
    """A schedule's next fire time and last task."""
    return (
        update(recurring)
        .where(recurring.c.name == bindparam("b_name"))
        .values(next_unix_ns=bindparam("b_next"), last_task_id=bindparam("b_last"))
    )


def _revive(conn: Connection, ids: Sequence[int], dep_out: list[dict[str, Any]]) -> set[int]:
    """Which of `ids` (tasks a live transition names) are finished: a live transition revives
    them, so their dependency rows return (into `dep_out`); their live key returns in the
    update itself."""
    finished: set[int] = set()
    for chunk in execution.chunks(ids):
        for task_id, deps in execution.run_in(conn, revived_stmt(), chunk).rows:
            finished.add(task_id)
            try:
                dep_out.extend(folding.dep_rows(task_id, codec.decode_deps(deps)))
            except CorruptValue as exc:  # recovery quarantines the row; nothing to restore
                log.warning("task %s revived with undecodable dependencies: %s", task_id, exc)
    return finished


def write(
    conn: Connection,
    base: TimeBase,
    folded: folding.Folded,
    outputs: Sequence[tuple[TaskId, bytes]],
) -> None:
    """Write a folded batch (after the fence check), in the order of the design."""
    inserts = folded.inserts
    updates = folded.updates
    # Insert or ignore, as the reference: a task stored already (a replayed batch) keeps its
    # row, and the transitions folded into its insert (its dependency rows too) are ignored
    # with it. One new task is inserted with the dialect's own "ignore duplicates" form where
    # it has one (`dialects.insert_ignoring`), which says whether it was stored already: no
    # lookup first. More are looked up first, then loaded in one bulk statement (COPY).
    ignoring = dialects.insert_ignoring(conn.dialect, tasks) if len(inserts) == 1 else None
    if inserts and ignoring is None:
        existing: set[int] = set()
        for chunk in execution.chunks(list(inserts)):
            existing.update(
                row[0] for row in execution.run_in(conn, existing_ids_stmt(), chunk).rows
            )
        if existing:
            inserts = {i: r for i, r in inserts.items() if i not in existing}
    # 1. Transitions of stored tasks first, so the keys they release can be reused below. A
    # task that succeeded in this batch gets its output in the same statement.
    revived: list[dict[str, Any]] = []
    pending: dict[int, bytes] = dict(outputs)
    if updates:
        live: list[dict[str, Any]] = []
        plain: list[dict[str, Any]] = []
        with_output: list[dict[str, Any]] = []
        for task_id, st in updates.items():
            params: dict[str, Any] = {
                "b_id": task_id,
                "b_status": folding.STATUS_NAME[st.status],
                "b_terminal": folding.IS_TERMINAL[st.status],
                "b_attempt": st.attempt,
                "b_at": st.at,
                "b_message": st.message,
            }
            if st.status is TaskStatus.SUCCEEDED and task_id in pending:
                params["b_output"] = bytes(pending.pop(task_id))
                with_output.append(params)
            else:
                plain.append(params)
                if not params["b_terminal"]:
                    live.append(params)
        updated = 0
        if live:
            # A live transition of a task still live changes no live key: one statement for
            # all of them. Only when fewer rows matched than were sent can one be a revival.
            matched = execution.run_many(conn, status_update_live_stmt(), live).rowcount
            updated = -1 if matched < 0 else matched
            done = {p["b_id"] for p in live}
            if matched != len(live):
                done -= _revive(conn, list(done), revived)
            plain = [p for p in plain if p["b_id"] not in done]
        for stmt, rows in ((status_update_stmt(), plain), (status_output_stmt(), with_output)):
            if rows:
                count = execution.run_many(conn, stmt, rows).rowcount
                updated = -1 if count < 0 or updated < 0 else updated + count
        if 0 <= updated < len(updates):
            log.warning(
                "status updates for %d tasks missing from the store (pruned?)",
                len(updates) - updated,
            )
        finished = [i for i, st in updates.items() if folding.IS_TERMINAL[st.status]]
        for chunk in execution.chunks(finished):
            execution.run_in(conn, delete_deps_stmt(), chunk)
    # 2. New tasks, and the dependency rows of those still live and of revived ones.
    if ignoring is not None:
        (new,) = inserts.values()
        if not execution.run_stmt(conn, ignoring, new).rows:
            inserts = {}  # stored already
    elif inserts:
        execution.insert_many(conn, insert_tasks_stmt(), list(inserts.values()))
    new_deps = [
        d
        for i, rows in folded.deps.items()
        if i in inserts and not inserts[i]["terminal"]
        for d in rows
    ]
    new_deps.extend(revived)
    if new_deps:
        execution.insert_many(conn, insert_deps_stmt(), new_deps)
    # 3. The other outputs of tasks that succeeded (in this batch or an earlier one).
    rest = [(i, o) for i, o in outputs if i in pending]
    if rest:
        succeeded = TaskStatus.SUCCEEDED.value
        execution.run_many(
            conn,
            output_stmt(),
            [{"b_id": i, "b_succeeded": succeeded, "b_output": bytes(o)} for i, o in rest],
        )
    # 4. Inbox rows made into these tasks (or dropped), gone in the same fenced transaction.
    for chunk in execution.chunks(list(folded.inbox_taken)):
        execution.run_in(conn, inbox_take_stmt(), chunk)
    # 5. Recurring schedules, in batch order.
    for m in folded.recurring:
        if isinstance(m, RecurringUpsert):
            name = codec.bounded("RecurringSpec.name", m.spec.name, codec.NAME_MAX)
            spec_text = codec.encode_recurring(base, m.spec)
            payload = m.spec.template.payload
            result = conn.execute(
                recurring_update_stmt(),
                {"b_name": name, "b_spec": spec_text, "b_payload": payload},
            )
            if result.rowcount == 0:
                conn.execute(
                    recurring_insert_stmt(),
                    {"name": name, "spec": spec_text, "template_payload": payload},
                )
        elif isinstance(m, RecurringRemove):
            conn.execute(recurring_delete_stmt(), {"b_name": codec.clean(m.name)})
        else:
            conn.execute(
                recurring_next_stmt(),
                {
                    "b_name": codec.clean(m.name),
                    "b_next": codec.to_unix_opt(base, m.next, "RecurringNext.next"),
                    "b_last": m.last,
                },
            )
