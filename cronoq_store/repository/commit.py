"""Commit writing: a folded batch (`folding.Folded`) written into the tables, beside the
statements that write it.

`write` runs in the caller's fenced transaction and never commits: the lease check that
precedes it and the COMMIT that follows are the caller's (`face.transactions.commit`, the
way of a commit from BEGIN to COMMIT).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from functools import cache, partial
from typing import Any, Final, cast

from sqlalchemy import (
    Connection,
    Delete,
    Insert,
    Integer,
    Select,
    Update,
    any_,
    bindparam,
    case,
    delete,
    exists,
    func,
    insert,
    literal,
    null,
    select,
    true,
    union_all,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import dialect as postgresql_dialect
from sqlalchemy.dialects.postgresql import insert as pg_insert

from .. import codec, dialects, execution
from ..errors import CorruptValue
from ..model import RecurringNext, RecurringRemove, RecurringUpsert, TaskId, TaskStatus, TimeBase
from ..schema import inbox, recurring, task_deps, tasks
from . import arrays, folding

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


def _task_update() -> Update:
    """An UPDATE of the task `b_id`: what a transition and an output each start from."""
    return update(tasks).where(tasks.c.id == bindparam("b_id"))


@cache
def status_update_stmt() -> Update:
    """One task's transition; a terminal one releases its live key."""
    return _task_update().values(
        status=bindparam("b_status"),
        terminal=bindparam("b_terminal"),
        attempt=bindparam("b_attempt"),
        updated_unix_ns=bindparam("b_at"),
        message=func.coalesce(bindparam("b_message", type_=tasks.c.message.type), tasks.c.message),
        # A terminal transition releases the key; a live one (a revival too) holds it.
        live_key=case((bindparam("b_terminal") == true(), null()), else_=tasks.c.key),
        # Set when it finishes, NULL while live: a live transition changes no indexed
        # column, so PostgreSQL can update the row in place (HOT), leaving no dead index
        # entries behind.
        finished_unix_ns=case((bindparam("b_terminal") == true(), bindparam("b_at")), else_=null()),
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
def revival_guard_stmt() -> Select[Any]:
    """PostgreSQL, in a flight right behind the live transitions of the tasks `ids`
    (`status_update_live_stmt`): fails the flight (division by zero) when one of them is
    stored finished, so the UPDATE left it alone: a revival, which the optimistic flight
    cannot write (`RevivalGuard`). A live row it changed is live now; a missing one passes."""
    ids = bindparam("ids", type_=ARRAY(tasks.c.id.type))  # one array (`arrays.array_text`)
    finished = exists().where(tasks.c.terminal == True, tasks.c.id == any_(ids))  # noqa: E712
    return select(literal(1, Integer) // case((finished, 0), else_=1))


def _guard_params(ids: Sequence[int]) -> dict[str, int]:
    """`revival_guard_batched_stmt`'s parameters for `ids`: more than one padded to a power
    of two with the last (the same id twice changes nothing), so that few statements serve
    every batch size."""
    size = len(ids)
    if size > 1:
        size = 1 << (size - 1).bit_length()
    params = _numbered("g", ids)
    for i in range(len(ids), size):
        params[f"g{i}"] = ids[-1]
    return params


@cache
def revival_guard_batched_stmt(count: int) -> Select[Any]:
    """MariaDB's `revival_guard_stmt`, in a multi-statement packet right behind the live
    transitions of `count` tasks (`g0`...: `_guard_params`): a compound statement that
    SIGNALs when one of them is stored finished. Behind one UPDATE it reads nothing when
    that matched its row (`ROW_COUNT()`, matched rows): a revival, or a task not stored,
    did not."""
    ids = [bindparam(f"g{i}", type_=tasks.c.id.type) for i in range(count)]
    finished = select(literal(1, Integer)).where(
        tasks.c.terminal == True,  # noqa: E712
        tasks.c.id.in_(ids) if count > 1 else tasks.c.id == ids[0],
    )
    guard = dialects.FailsIfAny(finished, unless_counted=1 if count == 1 else None)
    return cast("Select[Any]", guard)  # compiled as any statement (`driver_sql`)


@cache
def delete_deps_of_stmt(count: int) -> Delete:
    """MariaDB's `delete_deps_stmt` of `count` tasks (`d0`...), one bind each: it rides in
    the packet (an expanding IN list runs on its own)."""
    ids = [bindparam(f"d{i}", type_=task_deps.c.task_id.type) for i in range(count)]
    where = task_deps.c.task_id.in_(ids) if count > 1 else task_deps.c.task_id == ids[0]
    return delete(task_deps).where(where)


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
        _task_update()
        .where(tasks.c.status == bindparam("b_succeeded"))
        .values(output=bindparam("b_output"))
    )


def _schedule_update(**binds: str) -> Update:
    """An UPDATE of the schedule `b_name` that sets each column named in `binds` to its bind
    parameter: a new spec, a next fire time."""
    values: dict[str, Any] = {column: bindparam(bind) for column, bind in binds.items()}
    return update(recurring).where(recurring.c.name == bindparam("b_name")).values(values)


@cache
def recurring_update_stmt() -> Update:
    """Replace a schedule's spec (its next/last stay)."""
    return _schedule_update(spec="b_spec", template_payload="b_payload")


@cache
def recurring_insert_stmt() -> Insert:
    """A new schedule."""
    return insert(recurring)


@cache
def recurring_upsert_stmt() -> Insert:
    """PostgreSQL: a new schedule, or a stored one's spec replaced (its next/last stay):
    `recurring_update_stmt` then `recurring_insert_stmt` in one statement, whose answer
    nothing waits for."""
    new = pg_insert(recurring)
    return new.on_conflict_do_update(
        index_elements=[recurring.c.name],
        set_={"spec": new.excluded.spec, "template_payload": new.excluded.template_payload},
    )


@cache
def recurring_delete_stmt() -> Delete:
    """Remove a schedule."""
    return delete(recurring).where(recurring.c.name == bindparam("b_name"))


@cache
def recurring_next_stmt() -> Update:
    """A schedule's next fire time and last task."""
    return _schedule_update(next_unix_ns="b_next", last_task_id="b_last")


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


class RevivalGuard:
    """The optimistic flight's bet that no live transition of a batch revives a finished task.

    Pipelined (PostgreSQL), a commit's live transitions go with a guard statement
    (`revival_guard_stmt`) behind them and nothing waits for their row count: the whole
    commit is one flight. A revival (rare: a finished task made live again) fails the guard,
    hence the flight, and nothing of it is written; the caller (`face.transactions.commit`)
    asks `failed` and commits the batch again without a guard, the way that reads which tasks
    revive and restores their dependency rows.

    MariaDB's batched flight (one multi-statement packet) does the same with a compound
    statement that SIGNALs (`revival_guard_batched_stmt`): a live transition then needs no
    packet of its own for its row count.
    """

    # Class attributes as the defaults, not an `__init__`: every commit makes one (most never
    # add the guard statement), and a constructor of its own would be a call.
    flight: execution.Flight | None = None
    """The flight the guard statement went in; None while none was added."""
    at = -1
    """The guard statement's index in `flight`."""

    def failed(self, exc: BaseException) -> bool:
        """Whether `exc` is the guard's failure: a revival, to commit again."""
        if self.flight is None or self.flight.failed != self.at:
            return False
        orig = getattr(exc, "orig", None)
        if getattr(orig, "sqlstate", None) == _DIVISION_BY_ZERO:
            return True
        return getattr(orig, "args", ())[:1] == (dialects.FAILED_ERRNO,)  # PyMySQL's


_DIVISION_BY_ZERO: Final = "22012"


def write(
    conn: Connection,
    base: TimeBase,
    folded: folding.Folded,
    outputs: Sequence[tuple[TaskId, bytes]],
    flight: execution.Flight,
    guard: RevivalGuard | None = None,
) -> None:
    """Write a folded batch (after the fence check), in the order of the design.

    Statements go into `flight` (a commit's, behind its fence: `face.transactions.commit`,
    which sends what is left in it with the COMMIT) until an answer is needed or a statement
    must run on its own (COPY, an IN list); on psycopg what is queued then leaves together,
    in one round trip. Before anything runs on its own the flight is sent, so the fence is
    answered first. The phases: transitions of stored tasks, new tasks with their
    dependency rows, outputs, inbox rows taken, recurring schedules.

    Pipelined, every phase rides in the flight: live transitions behind `guard` (when given:
    `RevivalGuard`), new tasks as one array per column (`arrays.insert_arrays_stmt`), inbox rows as
    one array, schedules by upserts; so a commit is one round trip, COMMIT included.
    """
    inserts = folded.inserts
    if not flight.defers:  # pipelined, or batched (MariaDB): nothing waits for the UPDATE
        guard = None
    if len(inserts) > 1 and not flight.pipelined:
        inserts = _existing_dropped(conn, inserts, flight)
        # The fence was answered (it holds the leader row): a revival found after it would
        # roll that back and let a takeover in before the commit ran again.
        guard = None
    # Each phase is entered only when it has something to write: a batch-1 commit's calls
    # are counted (`benchmarks/commit_calls.py`).
    pending: dict[int, bytes] = dict(outputs) if outputs else {}
    revived = _write_updates(conn, folded.updates, pending, flight, guard) if folded.updates else []
    if inserts or revived:
        _write_inserts(conn, folded, inserts, revived, flight)
    if outputs:
        rest = [(i, o) for i, o in outputs if i in pending]
        if rest:
            _write_outputs(rest, flight)
    if folded.inbox_taken:
        _write_inbox(folded.inbox_taken, flight)
    if folded.recurring:
        _write_recurring(conn, base, folded.recurring, flight)


def _existing_dropped(
    conn: Connection, inserts: dict[int, dict[str, Any]], flight: execution.Flight
) -> dict[int, dict[str, Any]]:
    """`inserts` (more than one: `write` asks) without the tasks stored already.

    Insert or ignore: a task stored already (a replayed batch) keeps its
    row, and the transitions folded into its insert (its dependency rows too) are ignored
    with it. One new task is inserted in a form that says whether it was stored already
    (`_write_inserts`): no lookup first; pipelined, any number too, in statements that
    ignore those stored (`arrays.insert_arrays_stmt`). Elsewhere more are looked up first, then
    loaded in one bulk statement (executemany).
    """
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
    guard: RevivalGuard | None,
) -> list[dict[str, Any]]:
    """Transitions of stored tasks, first, so the keys they release can be reused by the new
    tasks. A task that succeeded in this batch gets its output in the same statement (taken
    from `pending`). Returns the dependency rows of revived tasks, to insert again: none
    with a `guard`, which fails the flight on a revival instead (`RevivalGuard`)."""
    revived: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []  # without an output, in batch order
    with_output: list[dict[str, Any]] = []
    finished: list[int] = []
    live_count = 0
    for task_id, st in updates.items():
        status = st.status
        terminal = folding.IS_TERMINAL[status]
        params: dict[str, Any] = {
            "b_id": task_id,
            "b_status": folding.STATUS_NAME[status],
            "b_terminal": terminal,
            "b_attempt": st.attempt,
            "b_at": st.at,
            "b_message": st.message,
        }
        if not terminal:
            live_count += 1
            rows.append(params)
            continue
        finished.append(task_id)
        if status is TaskStatus.SUCCEEDED and task_id in pending:
            params["b_output"] = bytes(pending.pop(task_id))
            with_output.append(params)
        else:
            rows.append(params)
    sent: list[int] = []
    """The statements whose row counts nobody checked yet (`_warn_missing`)."""
    matched = 0
    """Rows known to have matched."""
    plain = rows
    if live_count:
        # A live transition of a task still live changes no live key: one statement for
        # all of them. Only when fewer rows matched than were sent can one be a revival.
        live = [p for p in rows if not p["b_terminal"]] if finished else rows
        stmt = status_update_live_stmt()
        at = flight.add(stmt, live[0]) if live_count == 1 else flight.add_many(stmt, live)
        again: set[int] = set()  # revived: written again, by `status_update_stmt`
        if flight.batched and live_count > execution.IN_CHUNK:
            guard = None  # MariaDB's guard binds each id: a batch this big waits instead
        if guard is not None:  # nothing waits: the guard fails the flight on a revival
            sent.append(at)
            if flight.pipelined:
                ids = arrays.array_text([p["b_id"] for p in live])
                guard.at = flight.add(revival_guard_stmt(), {"ids": ids})
            else:  # batched (MariaDB)
                given = _guard_params([p["b_id"] for p in live])
                guard.at = flight.add(revival_guard_batched_stmt(len(given)), given)
            guard.flight = flight
        elif flight.send()[at].rowcount == live_count:
            matched = live_count
        else:
            sent.append(at)
            again = _revive(conn, [p["b_id"] for p in live], revived)
        if again:
            plain = [p for p in rows if p["b_terminal"] or p["b_id"] in again]
        else:
            plain = [] if live is rows else [p for p in rows if p["b_terminal"]]
    for stmt, batch in ((status_update_stmt(), plain), (status_output_stmt(), with_output)):
        if batch:
            sent.append(flight.add_many(stmt, batch))
    if sent:  # only a log line: the statements need not wait for it
        flight.then(partial(_warn_missing, sent, len(updates) - matched))
    if finished:
        if flight.batched and len(finished) <= FLIGHT_ROWS:  # in the packet, not on its own
            flight.add(delete_deps_of_stmt(len(finished)), _numbered("d", finished))
        elif len(finished) <= execution.IN_CHUNK:
            flight.add_in(delete_deps_stmt(), finished)
        else:
            for chunk in execution.chunks(finished):
                flight.add_in(delete_deps_stmt(), chunk)
    return revived


def _numbered(prefix: str, values: Sequence[Any]) -> dict[str, Any]:
    """`values` as the parameters `prefix`0, `prefix`1, ..."""
    return {f"{prefix}{i}": v for i, v in enumerate(values)}


def _warn_missing(sent: Sequence[int], expected: int, ran: Sequence[execution.Ran]) -> None:
    """Log the status updates that matched no row: of `expected` rows, the statements at the
    indexes `sent` of `ran` matched fewer (unless the driver cannot tell)."""
    counts = [ran[i].rowcount for i in sent]
    if None in counts:
        return
    missing = expected - sum(c for c in counts if c is not None)
    if missing > 0:
        log.warning("status updates for %d tasks missing from the store (pruned?)", missing)


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
        deps = folded.deps.get(new["id"], []) if folded.deps and not new["terminal"] else []
        # None when stored already (nothing of it is written), or its rows went with it.
        new_deps = deps if _insert_one(conn, new, deps, flight) else []
    else:
        new_deps = [
            d
            for i, rows in folded.deps.items()
            if i in inserts and not inserts[i]["terminal"]
            for d in rows
        ]
        if flight.pipelined and len(inserts) > 1:
            arrays.insert_chunks(list(inserts.values()), new_deps, flight)
            new_deps = []
        elif inserts:
            flight.insert_many(insert_tasks_stmt(), list(inserts.values()))
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
    """Insert one new task unless its id is stored already; whether its dependency rows
    `deps` are still to insert (it was inserted, and they did not go with it).

    Pipelined (PostgreSQL), it is not asked: the task goes with its live dependency rows
    in one statement (`insert_with_deps_stmt`), which inserts them only with the task, and
    nothing waits for its answer. Elsewhere the dialect's "ignore a stored id" form says it
    (`dialects.insert_ignoring`), or on MariaDB an INSERT ... SELECT of the row where its id
    is absent (`insert_if_absent_stmt`), batched with its dependency rows in a statement
    that inserts them only if it did (`insert_deps_if_inserted_stmt`). Either way a
    live-key clash is still refused.
    """
    if flight.pipelined and deps:
        flight.add(insert_with_deps_stmt(tuple(new), len(deps)), {**new, **_dep_params(deps)})
        return False
    ignoring = dialects.insert_ignoring(conn.dialect, tasks, returning=False)
    if ignoring is None:
        at = flight.add(insert_if_absent_stmt(tuple(new)), new)
        if not deps:
            return False  # nothing waits on the answer (MariaDB's batch leaves with the COMMIT)
        if flight.batched:  # no answer waited for: its rows go only if it was inserted
            params = {"id": new["id"], **_dep_params(deps)}
            flight.add(insert_deps_if_inserted_stmt(len(deps)), params)
            return False
        return flight.send()[at].rowcount != 0
    at = flight.add(ignoring, new)
    if not deps:
        return False  # nothing waits on the answer
    return flight.send()[at].rowcount != 0  # one row: its count says it, no RETURNING to read


def _dep_params(deps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One new task's dependency rows as the parameters `d{i}_ordinal`, `d{i}_target_id`,
    `d{i}_target_key` (`insert_with_deps_stmt`, `insert_deps_if_inserted_stmt`)."""
    params: dict[str, Any] = {}
    for i, d in enumerate(deps):
        params[f"d{i}_ordinal"] = d["ordinal"]
        params[f"d{i}_target_id"] = d["target_id"]
        params[f"d{i}_target_key"] = d["target_key"]
    return params


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
def insert_deps_if_inserted_stmt(count: int) -> Insert:
    """MariaDB: the `count` dependency rows of the new task `id` (`_dep_params`), inserted
    only if the statement right before, its `insert_if_absent_stmt` in the same packet,
    inserted the task (`ROW_COUNT()` is 1): a task stored already keeps the rows it has. A
    compound statement around one multi-row INSERT (an INSERT ... SELECT of a UNION, the
    plain form of the same, fills a temporary table first)."""
    task_id = bindparam("id", type_=task_deps.c.task_id.type)
    rows = [
        {
            "task_id": task_id,
            "ordinal": bindparam(f"d{i}_ordinal", type_=task_deps.c.ordinal.type),
            "target_id": bindparam(f"d{i}_target_id", type_=task_deps.c.target_id.type),
            "target_key": bindparam(f"d{i}_target_key", type_=task_deps.c.target_key.type),
        }
        for i in range(count)
    ]
    either = dialects.OnlyIfCounted(insert(task_deps).values(rows), 1)
    return cast("Insert", either)  # compiled as any statement (`driver_sql`)


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


def _write_inbox(taken: Mapping[int, None], flight: execution.Flight) -> None:
    """Inbox rows made into these tasks (or dropped), gone in the same fenced transaction."""
    for chunk in execution.chunks(list(taken)):
        flight.add_in(inbox_take_stmt(), chunk)


def _write_recurring(
    conn: Connection,
    base: TimeBase,
    changes: Sequence[RecurringUpsert | RecurringRemove | RecurringNext],
    flight: execution.Flight,
) -> None:
    """Recurring schedules, in batch order: pipelined, in the flight (an upsert is then one
    statement, `recurring_upsert_stmt`); elsewhere each at once, after what is queued
    (MariaDB's batch: the fence is answered first)."""
    if not flight.pipelined:
        flight.send()
    for m in changes:
        if isinstance(m, RecurringUpsert):
            name = codec.bounded("RecurringSpec.name", m.spec.name, codec.NAME_MAX)
            spec_text = codec.encode_recurring(base, m.spec)
            payload = m.spec.template.payload
            if flight.pipelined:
                flight.add(
                    recurring_upsert_stmt(),
                    {"name": name, "spec": spec_text, "template_payload": payload},
                )
                continue
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
            _recurring_run(conn, flight, recurring_delete_stmt(), {"b_name": codec.clean(m.name)})
        else:
            params = {
                "b_name": codec.clean(m.name),
                "b_next": codec.to_unix_opt(base, m.next, "RecurringNext.next"),
                "b_last": m.last,
            }
            _recurring_run(conn, flight, recurring_next_stmt(), params)


def _recurring_run(
    conn: Connection, flight: execution.Flight, stmt: Update | Delete, params: dict[str, Any]
) -> None:
    """`stmt` in the flight where it pipelines; elsewhere at once, as ever."""
    if flight.pipelined:
        flight.add(stmt, params)
    else:
        conn.execute(stmt, params)
