"""Commit writing: a folded batch (`folding.Folded`) written into the tables, beside the
statements that write it.

`write` runs in the caller's fenced transaction and never commits: the lease check that
precedes it and the COMMIT that follows are the caller's (`face.transactions.commit`, the
way of a commit from BEGIN to COMMIT).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from functools import cache
from typing import Any, Final

from sqlalchemy import (
    Connection,
    Delete,
    Insert,
    Select,
    Update,
    bindparam,
    case,
    delete,
    exists,
    func,
    insert,
    null,
    select,
    true,
    union_all,
    update,
)
from sqlalchemy.dialects.postgresql import dialect as postgresql_dialect

from .. import codec, dialects, execution
from ..errors import CorruptValue
from ..model import RecurringNext, RecurringRemove, RecurringUpsert, TaskId, TaskStatus, TimeBase
from ..schema import inbox, recurring, task_deps, tasks
from . import folding

log = logging.getLogger(__name__)


@cache
def existing_ids_stmt() -> Select[Any]:
    """Which of the given task ids are already stored (makes inserts idempotent)."""
    return select(tasks.c.id).where(tasks.c.id.in_(bindparam("ids", expanding=True)))


@cache
def stored_ids_between_stmt() -> Select[Any]:
    """The stored task ids from `b_low` to `b_high`: one range of the primary key, where an
    IN list of the same ids is a lookup each."""
    return select(tasks.c.id).where(tasks.c.id.between(bindparam("b_low"), bindparam("b_high")))


DENSE: Final = 4
"""New ids spanning at most this many ids each are looked up as one range (a leader hands
ids out in order, so a batch's usually span no more than their count)."""


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
    flight: execution.Flight,
) -> None:
    """Write a folded batch (after the fence check), in the order of the design.

    Statements go into `flight` (a commit's, behind its fence: `face.transactions.commit`,
    which sends what is left in it with the COMMIT) until an answer is needed or a statement
    must run on its own (COPY, an IN list); on psycopg what is queued then leaves together,
    in one round trip. Before anything runs on its own the flight is sent, so the fence is
    answered first. The phases: transitions of stored tasks, new tasks with their
    dependency rows, outputs, inbox rows taken, recurring schedules.
    """
    inserts = _existing_dropped(conn, folded.inserts, flight)
    pending: dict[int, bytes] = dict(outputs)
    revived = _write_updates(conn, folded.updates, pending, flight)
    _write_inserts(conn, folded, inserts, revived, flight)
    _write_outputs([(i, o) for i, o in outputs if i in pending], flight)
    if folded.inbox_taken or folded.recurring:
        flight.send()
        _write_inbox(conn, folded.inbox_taken)
        _write_recurring(conn, base, folded.recurring)


def _existing_dropped(
    conn: Connection, inserts: dict[int, dict[str, Any]], flight: execution.Flight
) -> dict[int, dict[str, Any]]:
    """`inserts` without the tasks stored already, when there are more than one.

    Insert or ignore: a task stored already (a replayed batch) keeps its
    row, and the transitions folded into its insert (its dependency rows too) are ignored
    with it. One new task is inserted in a form that says whether it was stored already
    (`_write_inserts`): no lookup first. More are looked up first, then loaded in one bulk
    statement (COPY).
    """
    if len(inserts) < 2:
        return inserts
    flight.send()
    existing: set[int] = set()
    low, high = min(inserts), max(inserts)
    if high - low < DENSE * len(inserts):
        bounds = {"b_low": low, "b_high": high}
        stored = execution.run_stmt(conn, stored_ids_between_stmt(), bounds).rows
        existing.update(row[0] for row in stored if row[0] in inserts)
    else:
        for chunk in execution.chunks(list(inserts)):
            ran = execution.run_in(conn, existing_ids_stmt(), chunk)
            existing.update(row[0] for row in ran.rows)
    return {i: r for i, r in inserts.items() if i not in existing} if existing else inserts


def _write_updates(
    conn: Connection,
    updates: dict[int, folding.FoldedStatus],
    pending: dict[int, bytes],
    flight: execution.Flight,
) -> list[dict[str, Any]]:
    """Transitions of stored tasks, first, so the keys they release can be reused by the new
    tasks. A task that succeeded in this batch gets its output in the same statement (taken
    from `pending`). Returns the dependency rows of revived tasks, to insert again."""
    revived: list[dict[str, Any]] = []
    if not updates:
        return revived
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
    counts: list[int | None] = []
    if live:
        # A live transition of a task still live changes no live key: one statement for
        # all of them. Only when fewer rows matched than were sent can one be a revival.
        at = flight.add_many(status_update_live_stmt(), live)
        matched = flight.send()[at].rowcount
        counts.append(matched)
        done = {p["b_id"] for p in live}
        if matched != len(live):
            done -= _revive(conn, list(done), revived)
        plain = [p for p in plain if p["b_id"] not in done]
    sent = [
        flight.add_many(stmt, rows)
        for stmt, rows in ((status_update_stmt(), plain), (status_output_stmt(), with_output))
        if rows
    ]

    def warn_missing(ran: Sequence[execution.Ran]) -> None:
        matched = [*counts, *(ran[i].rowcount for i in sent)]
        missing = len(updates) - sum(c for c in matched if c is not None)
        if None not in matched and missing > 0:
            log.warning("status updates for %d tasks missing from the store (pruned?)", missing)

    flight.then(warn_missing)  # only a log line: the statements need not wait for it
    finished = [i for i, st in updates.items() if folding.IS_TERMINAL[st.status]]
    for chunk in execution.chunks(finished):
        flight.add_in(delete_deps_stmt(), chunk)
    return revived


FLIGHT_ROWS: Final = 8
"""Most dependency rows a flight carries as an executemany; more go by COPY, on their own."""


def _write_inserts(
    conn: Connection,
    folded: folding.Folded,
    inserts: dict[int, dict[str, Any]],
    revived: list[dict[str, Any]],
    flight: execution.Flight,
) -> None:
    """New tasks, and the dependency rows of those still live and of revived ones."""
    if len(inserts) == 1:
        (new,) = inserts.values()
        deps = [] if new["terminal"] else folded.deps.get(new["id"], [])
        inserted = _insert_one(conn, new, deps, flight)
        # Stored already (nothing of it is written), or its rows went in the same statement.
        new_deps = [] if not inserted or flight.pipelined else deps
    else:
        if inserts:
            flight.insert_many(insert_tasks_stmt(), list(inserts.values()))
        new_deps = [
            d
            for i, rows in folded.deps.items()
            if i in inserts and not inserts[i]["terminal"]
            for d in rows
        ]
    new_deps = [*new_deps, *revived]
    if not new_deps:
        return
    if flight.pipelined and len(new_deps) <= FLIGHT_ROWS:
        flight.add_many(insert_deps_stmt(), new_deps)
        return
    flight.insert_many(insert_deps_stmt(), new_deps)


def _insert_one(
    conn: Connection, new: dict[str, Any], deps: list[dict[str, Any]], flight: execution.Flight
) -> bool:
    """Insert one new task unless its id is stored already; whether it was inserted.

    Pipelined (PostgreSQL), it is not asked: the task goes with its live dependency rows
    in one statement (`insert_with_deps_stmt`), which inserts them only with the task, and
    nothing waits for its answer. Elsewhere the dialect's "ignore a stored id" form says it
    (`dialects.insert_ignoring`), or on MariaDB an INSERT ... SELECT of the row where its id
    is absent (`insert_if_absent_stmt`). Either way a live-key clash is still refused.
    """
    if flight.pipelined and deps:
        params = dict(new)
        for i, d in enumerate(deps):
            params[f"d{i}_ordinal"] = d["ordinal"]
            params[f"d{i}_target_id"] = d["target_id"]
            params[f"d{i}_target_key"] = d["target_key"]
        flight.add(insert_with_deps_stmt(tuple(new), len(deps)), params)
        return True
    ignoring = dialects.insert_ignoring(conn.dialect, tasks)
    if ignoring is None:
        at = flight.add(insert_if_absent_stmt(tuple(new)), new)
        if not deps:
            return True  # nothing waits on the answer (MariaDB's batch leaves with the COMMIT)
        return flight.send()[at].rowcount != 0
    at = flight.add(ignoring, new)
    if flight.pipelined and not deps:
        return True  # nothing waits on the answer
    return bool(flight.send()[at].rows)


@cache
def insert_if_absent_stmt(keys: tuple[str, ...]) -> Insert:
    """One new task row of the columns `keys`, unless a task with its id is stored (then it
    inserts nothing): what "insert or ignore" is where no ignoring form can be trusted
    (MariaDB, MySQL), in one statement that refuses a live-key clash as a plain INSERT does."""
    columns = [c for c in tasks.c if c.name in keys]
    row = select(*(bindparam(c.name, type_=c.type) for c in columns)).where(
        ~exists().where(tasks.c.id == bindparam("id", type_=tasks.c.id.type))
    )
    return insert(tasks).from_select([c.name for c in columns], row)


@cache
def insert_with_deps_stmt(keys: tuple[str, ...], count: int) -> Insert:
    """PostgreSQL: one new task row of the columns `keys` (unless its id is stored) and, only
    if it was inserted, its `count` dependency rows (`d{i}_ordinal`, `d{i}_target_id`,
    `d{i}_target_key`): the task's insert is a data-modifying CTE they select from."""
    ignoring = dialects.insert_ignoring(postgresql_dialect(), tasks)  # type: ignore[no-untyped-call]
    assert ignoring is not None
    values = {c.name: bindparam(c.name, type_=c.type) for c in tasks.c if c.name in keys}
    new = ignoring.values(values).cte("new")
    rows = [
        select(
            new.c.id,
            bindparam(f"d{i}_ordinal", type_=task_deps.c.ordinal.type),
            bindparam(f"d{i}_target_id", type_=task_deps.c.target_id.type),
            bindparam(f"d{i}_target_key", type_=task_deps.c.target_key.type),
        )
        for i in range(count)
    ]
    names = ["task_id", "ordinal", "target_id", "target_key"]
    return (
        insert(task_deps)
        .from_select(names, rows[0] if count == 1 else union_all(*rows))
        .add_cte(new)
    )


def _write_outputs(rest: Sequence[tuple[TaskId, bytes]], flight: execution.Flight) -> None:
    """The other outputs of tasks that succeeded (in this batch or an earlier one)."""
    if rest:
        succeeded = TaskStatus.SUCCEEDED.value
        flight.add_many(
            output_stmt(),
            [{"b_id": i, "b_succeeded": succeeded, "b_output": bytes(o)} for i, o in rest],
        )


def _write_inbox(conn: Connection, taken: Mapping[int, None]) -> None:
    """Inbox rows made into these tasks (or dropped), gone in the same fenced transaction."""
    for chunk in execution.chunks(list(taken)):
        execution.run_in(conn, inbox_take_stmt(), chunk)


def _write_recurring(
    conn: Connection,
    base: TimeBase,
    changes: Sequence[RecurringUpsert | RecurringRemove | RecurringNext],
) -> None:
    """Recurring schedules, in batch order."""
    for m in changes:
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
