"""Every statement of the store, as small named Core builders, and the functions that run them.

Functions take a `Connection` and never commit: the caller owns the transaction. Bulk work is
executemany, so a commit costs the same number of round trips whatever its batch size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import cache
from typing import Any, Final, TypeVar

from sqlalchemy import (
    Boolean,
    Connection,
    Delete,
    Insert,
    Integer,
    Select,
    Update,
    and_,
    bindparam,
    case,
    delete,
    exists,
    func,
    insert,
    literal,
    null,
    or_,
    select,
    true,
    type_coerce,
    union_all,
    update,
)
from sqlalchemy.dialects.postgresql import dialect as postgresql_dialect

from . import codec, compat, dialects, execution
from .errors import CorruptValue, InvalidValue, StoreError
from .model import (
    INT64_MAX,
    INT64_MIN,
    ById,
    Dep,
    InboxTaken,
    LostCommits,
    Recovered,
    RecoveredRecurring,
    RecoveredTask,
    RecoveredTerminal,
    RecurringNext,
    RecurringRemove,
    RecurringUpsert,
    StatusChanged,
    Submitted,
    TaskId,
    TaskRecord,
    TaskStatus,
    TimeBase,
)
from .model import Mutation as Mutation
from .schema import LEADER_ROW, inbox, leader, recurring, task_deps, tasks

log = logging.getLogger(__name__)

_T = TypeVar("_T")

PRUNE_BATCH: Final = 1000
"""Rows deleted per statement by `prune`."""
IN_CHUNK: Final = 1000
"""Most values bound into one IN list."""
STREAM_ROWS: Final = 1000
"""Rows fetched at a time while recovering."""


def _chunks(values: Sequence[Any], size: int = IN_CHUNK) -> Iterator[Sequence[Any]]:
    for start in range(0, len(values), size):
        yield values[start : start + size]


# Bulk statements: compiled once per dialect, run as the driver's executemany.


def _executemany(
    conn: Connection, stmt: Insert | Update | Delete, rows: Sequence[Mapping[str, Any]]
) -> execution.Ran:
    """Run `stmt` once per row (all rows share one key set) as one driver executemany."""
    return execution.run_many(conn, stmt, rows)


SMALL_IN: Final = 8
"""IN lists up to this long are compiled once per length, as the full chunk is."""
_FULL_IN: dict[tuple[Any, ...], tuple[str, tuple[str, ...] | None]] = {}
"""IN statements of a full chunk or a short list: SQL, and parameter names unless positional."""


def _run_in(
    conn: Connection, stmt: Select[Any] | Update | Delete, ids: Sequence[Any]
) -> execution.Ran:
    """Run `stmt` (its one expanding parameter "ids" bound to `ids`).

    A full chunk (the usual case in large commits and in prune), and a short list (a small
    commit's), run a form compiled once with that many plain placeholders, instead of
    rendering the placeholders on every execution (a third of a batch-1 commit's statement
    overhead).
    """
    count = len(ids)
    if count != IN_CHUNK and not 0 < count <= SMALL_IN:
        return _expanded(conn, stmt, ids)
    translate = conn.get_execution_options().get("schema_translate_map")
    key = execution.compile_key(conn, stmt, count)
    hit = _FULL_IN.get(key)
    if hit is None:
        compiled = stmt.compile(
            dialect=conn.dialect,
            schema_translate_map=translate,
            render_schema_translate=translate is not None,
        )
        state = compiled.construct_expanded_state({"ids": list(range(count))})
        names = tuple(state.positiontup or state.parameters)
        if len(names) != count:  # not a statement of one IN list
            return _expanded(conn, stmt, ids)
        hit = _FULL_IN[key] = (state.statement, None if compiled.positional else names)
    sql, names_or_none = hit
    if names_or_none is None:
        return execution.run(conn, sql, tuple(ids))
    return execution.run(conn, sql, dict(zip(names_or_none, ids, strict=True)))


def _expanded(
    conn: Connection, stmt: Select[Any] | Update | Delete, ids: Sequence[Any]
) -> execution.Ran:
    """`stmt` with its IN list rendered for `ids` by SQLAlchemy (any length)."""
    result = conn.execute(stmt, {"ids": list(ids)})
    rows = result.all() if result.returns_rows else []
    return execution.Ran(execution.counted(result.rowcount), rows)


def _can_copy(conn: Connection) -> bool:
    """Whether `conn` is sync psycopg, whose COPY FROM STDIN loads rows fastest."""
    return (
        conn.dialect.name == "postgresql"
        and conn.dialect.driver == "psycopg"
        and not conn.dialect.is_async
    )


def _copy_sql(conn: Connection, stmt: Insert, columns: Sequence[str]) -> str:
    """`COPY table (columns) FROM STDIN` for `stmt`'s table on `conn`: in the schema the
    connection translates to, every name quoted by the dialect's own identifier preparer.

    The preparer escapes `%` as `%%` for a format paramstyle (psycopg's is pyformat), which the
    driver undoes only in a statement run with parameters; COPY runs without any.
    """
    prep = conn.dialect.identifier_preparer
    table = stmt.table
    translate = conn.get_execution_options().get("schema_translate_map") or {}
    schema = translate.get(table.schema, table.schema)
    target = prep.quote(table.name)
    if schema is not None:
        target = f"{prep.quote_schema(schema)}.{target}"
    names = ", ".join(prep.quote(c) for c in columns)
    sql = f"COPY {target} ({names}) FROM STDIN"
    if conn.dialect.paramstyle in ("format", "pyformat"):
        sql = sql.replace("%%", "%")
    return sql


_COPY: dict[tuple[Any, ...], tuple[str, Callable[[Mapping[str, Any]], Any]]] = {}


def _copy_form(
    conn: Connection, stmt: Insert, keys: tuple[str, ...]
) -> tuple[str, Callable[[Mapping[str, Any]], Any]]:
    """The COPY statement for rows with `keys`, and how to turn a row into its values in
    column order: built once per statement, key set, dialect and schema."""
    cache_key = execution.compile_key(conn, stmt, keys)
    hit = _COPY.get(cache_key)
    if hit is None:
        wanted = set(keys)
        columns = [c.name for c in stmt.table.c if c.name in wanted]
        hit = _COPY[cache_key] = (_copy_sql(conn, stmt, columns), execution.positional(columns))
    return hit


def _insert_many(conn: Connection, stmt: Insert, rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert `rows`: COPY on psycopg, the driver's executemany elsewhere.

    psycopg's executemany still sends one INSERT per row (pipelined); COPY streams them in one
    statement: as cheap from two rows, two to three times faster for a batch of 1000. COPY
    reaches no statement listener, so an observed connection (`execution.observed`) inserts
    with executemany, which they see.
    """
    if len(rows) < 2 or not _can_copy(conn) or execution.observed(conn):
        _executemany(conn, stmt, rows)
        return
    copy_sql, getter = _copy_form(conn, stmt, tuple(rows[0]))
    cursor: Any = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
    try:
        with cursor.copy(copy_sql) as copy:
            write = copy.write_row
            for row in rows:
                write(getter(row))
    except conn.dialect.loaded_dbapi.Error as exc:
        raise compat.driver_error(conn, exc, copy_sql, cursor=cursor) from exc
    finally:
        cursor.close()


# Folding: a batch becomes one insert per new task and one update per existing task.

_NAME: Final = {s: s.value for s in TaskStatus}
"""Stored name of each status (a dict lookup is cheaper than the enum's `value` per row)."""
_TERMINAL: Final = {s: s.is_terminal for s in TaskStatus}


@dataclass(slots=True)
class _Status:
    """The latest transition of a task within a batch."""

    status: TaskStatus
    attempt: int
    at: int
    message: str | None

    def fold(self, later: _Status) -> None:
        """Apply a later transition, keeping the message unless the later one has its own."""
        self.status, self.attempt, self.at = later.status, later.attempt, later.at
        if later.message is not None:
            self.message = later.message


@dataclass(slots=True)
class Folded:
    """A batch folded as the reference folds it, so that splitting a batch changes no row.

    Mutations apply in batch order: a transition of a task submitted earlier in the batch is
    folded into its insert; any other transition (the task's `Submitted` has not come yet) is an
    update of the stored row, applied before the inserts, and changes nothing when the task is
    not stored yet. An insert of a task already stored is ignored with everything folded into it
    (a replayed batch changes nothing).
    """

    inserts: dict[int, dict[str, Any]] = field(default_factory=dict)
    """New task rows by id, each with the status it reached within the batch."""
    deps: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    """Dependency rows of the new tasks."""
    updates: dict[int, _Status] = field(default_factory=dict)
    """The latest transition of each stored task (those not submitted earlier in the batch)."""
    recurring: list[RecurringUpsert | RecurringRemove | RecurringNext] = field(default_factory=list)
    inbox_taken: dict[int, None] = field(default_factory=dict)
    """Inbox rows the batch removes (ordered, without repeats)."""


def _status(base: TimeBase, m: StatusChanged) -> _Status:
    return _Status(
        status=m.status,
        attempt=m.attempt,
        at=codec.to_unix(base, m.at, "StatusChanged.at"),
        message=codec.clean_opt(m.message),
    )


def dep_rows(task_id: int, deps: Sequence[Dep]) -> list[dict[str, Any]]:
    """The `cronoq_task_deps` rows of a live task's dependencies."""
    rows: list[dict[str, Any]] = []
    for i, d in enumerate(deps):
        target = d.target  # narrowed by type, not getattr with a default: no AttributeError
        if isinstance(target, ById):
            target_id, target_key = target.id, None
        else:
            target_id, target_key = None, codec.clean(target.key)
        rows.append(
            {"task_id": task_id, "ordinal": i, "target_id": target_id, "target_key": target_key}
        )
    return rows


def fold(base: TimeBase, now_unix_ns: int, batch: Iterable[Mutation]) -> Folded:
    """Fold `batch`; refuses (`InvalidValue`) anything that cannot be stored, before any write."""
    out = Folded()
    inserts, updates = out.inserts, out.updates
    for m in batch:
        if isinstance(m, Submitted):
            if m.id in inserts:
                continue
            row = codec.spec_columns(base, m.spec)
            row["id"] = m.id
            row["seq"] = m.seq
            row["arrival_unix_ns"] = codec.to_unix(base, m.arrival, "Submitted.arrival")
            row["updated_unix_ns"] = now_unix_ns
            row["finished_unix_ns"] = None
            row["status"] = TaskStatus.QUEUED.value
            row["terminal"] = False
            row["attempt"] = 0
            row["message"] = None
            inserts[m.id] = row
            if m.spec.deps:
                out.deps[m.id] = dep_rows(m.id, m.spec.deps)
        elif isinstance(m, StatusChanged):
            st = _status(base, m)
            if m.id in inserts:
                _apply(inserts[m.id], st)
            elif m.id in updates:
                updates[m.id].fold(st)
            else:
                updates[m.id] = st
        elif isinstance(m, InboxTaken):
            out.inbox_taken[m.inbox_id] = None
        else:
            out.recurring.append(m)
    for row in inserts.values():
        row["live_key"] = None if row["terminal"] else row["key"]
    return out


def checked_outputs(outputs: Iterable[tuple[TaskId, bytes]]) -> list[tuple[TaskId, bytes]]:
    """`outputs` as (id, bytes) pairs; refuses (`InvalidValue`) what no task could hold."""
    checked: list[tuple[TaskId, bytes]] = []
    for pair in outputs:
        try:
            task_id, output = pair
        except (TypeError, ValueError) as exc:
            raise InvalidValue("outputs must hold (task id, bytes) pairs") from exc
        if not isinstance(task_id, int) or isinstance(task_id, bool):
            raise InvalidValue(f"outputs: a task id must be an int, not {type(task_id).__name__}")
        if not INT64_MIN <= task_id <= INT64_MAX:
            raise InvalidValue(f"outputs: task id {task_id} is outside the 64-bit range")
        if not isinstance(output, bytes | bytearray | memoryview):
            raise InvalidValue(f"outputs: the output of task {task_id} must be bytes")
        checked.append((task_id, bytes(output)))
    return checked


def _apply(row: dict[str, Any], st: _Status) -> None:
    row["status"] = _NAME[st.status]
    row["terminal"] = _TERMINAL[st.status]
    row["attempt"] = st.attempt
    row["updated_unix_ns"] = st.at
    row["finished_unix_ns"] = st.at if row["terminal"] else None
    row["message"] = st.message if st.message is not None else row.get("message")


# Commit.


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
    for chunk in _chunks(ids):
        for task_id, deps in _run_in(conn, revived_stmt(), chunk).rows:
            finished.add(task_id)
            try:
                dep_out.extend(dep_rows(task_id, codec.decode_deps(deps)))
            except CorruptValue as exc:  # recovery quarantines the row; nothing to restore
                log.warning("task %s revived with undecodable dependencies: %s", task_id, exc)
    return finished


def write(
    conn: Connection,
    base: TimeBase,
    folded: Folded,
    outputs: Sequence[tuple[TaskId, bytes]],
    flight: execution.Flight | None = None,
) -> None:
    """Write a folded batch (after the fence check), in the order of the design.

    Statements go into `flight` (a commit's, behind its fence: `lease.fencing`) until an
    answer is needed or a statement must run on its own (COPY, an IN list); on psycopg what
    is queued then leaves together, in one round trip. Before anything runs on its own the
    flight is sent, so the fence is answered first. The phases: transitions of stored
    tasks, new tasks with their dependency rows, outputs, inbox rows taken, recurring
    schedules.
    """
    flight = flight or execution.Flight(conn)
    inserts = _existing_dropped(conn, folded.inserts, flight)
    pending: dict[int, bytes] = dict(outputs)
    revived = _write_updates(conn, folded.updates, pending, flight)
    _write_inserts(conn, folded, inserts, revived, flight)
    _write_outputs([(i, o) for i, o in outputs if i in pending], flight)
    if folded.inbox_taken or folded.recurring:
        flight.send()
        _write_inbox(conn, folded.inbox_taken)
        _write_recurring(conn, base, folded.recurring)
    flight.send()


def _existing_dropped(
    conn: Connection, inserts: dict[int, dict[str, Any]], flight: execution.Flight
) -> dict[int, dict[str, Any]]:
    """`inserts` without the tasks stored already, when there are more than one.

    Insert or ignore, as the reference: a task stored already (a replayed batch) keeps its
    row, and the transitions folded into its insert (its dependency rows too) are ignored
    with it. One new task is inserted in a form that says whether it was stored already
    (`_write_inserts`): no lookup first. More are looked up first, then loaded in one bulk
    statement (COPY).
    """
    if len(inserts) < 2:
        return inserts
    flight.send()
    existing: set[int] = set()
    for chunk in _chunks(list(inserts)):
        existing.update(row[0] for row in _run_in(conn, existing_ids_stmt(), chunk).rows)
    return {i: r for i, r in inserts.items() if i not in existing} if existing else inserts


def _write_updates(
    conn: Connection,
    updates: dict[int, _Status],
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
            "b_status": _NAME[st.status],
            "b_terminal": _TERMINAL[st.status],
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
    if sent:
        ran = flight.send()
        counts.extend(ran[i].rowcount for i in sent)
    if None not in counts:
        missing = len(updates) - sum(c for c in counts if c is not None)
        if missing > 0:
            log.warning("status updates for %d tasks missing from the store (pruned?)", missing)
    finished = [i for i, st in updates.items() if _TERMINAL[st.status]]
    for chunk in _chunks(finished):
        _run_in(conn, delete_deps_stmt(), chunk)
    return revived


FLIGHT_ROWS: Final = 8
"""Most dependency rows a flight carries as an executemany; more go by COPY, on their own."""


def _write_inserts(
    conn: Connection,
    folded: Folded,
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
            _insert_many(conn, insert_tasks_stmt(), list(inserts.values()))
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
    flight.send()
    _insert_many(conn, insert_deps_stmt(), new_deps)


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
    for chunk in _chunks(list(taken)):
        _run_in(conn, inbox_take_stmt(), chunk)


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


# Recovery.

_RAW_TERMINAL: Final = type_coerce(tasks.c.terminal, Integer).label("terminal")
"""The terminal flag as stored (an integer: Boolean's result processor would read 2 as True),
so the row decoders can refuse a flag that is neither 0 nor 1."""

_LIVE_COLUMNS: Final = (
    tasks.c.id,
    tasks.c.seq,
    tasks.c.arrival_unix_ns,
    tasks.c.attempt,
    tasks.c.status,
    _RAW_TERMINAL,
    *(tasks.c[name] for name in codec.SPEC_COLUMNS),
)


@cache
def high_water_stmt() -> Select[Any]:
    """The id high-water mark (the first id never committed) and the largest stored task id."""
    return select(
        select(leader.c.next_id).where(leader.c.id == 1).scalar_subquery(),
        select(func.max(tasks.c.id)).scalar_subquery(),
    )


@cache
def lost_stmt() -> Select[Any]:
    """The gap a leader recorded in the lease row when it found the database behind it."""
    return select(leader.c.lost_epoch, leader.c.lost_commits, leader.c.lost_unix_ns).where(
        leader.c.id == 1, leader.c.lost_epoch.is_not(None)
    )


def lost_commits(conn: Connection) -> LostCommits | None:
    """`lost_stmt`'s record, or None."""
    row = conn.execute(lost_stmt()).one_or_none()
    if row is None:
        return None
    return LostCommits(
        epoch=int(row.lost_epoch),
        commits=None if row.lost_commits is None else int(row.lost_commits),
        noticed_unix_ns=int(row.lost_unix_ns or 0),
    )


@cache
def live_tasks_stmt() -> Select[Any]:
    """Live tasks in id order."""
    return select(*_LIVE_COLUMNS).where(tasks.c.terminal == False).order_by(tasks.c.id)  # noqa: E712


@cache
def odd_flag_tasks_stmt() -> Select[Any]:
    """Tasks whose terminal flag is neither false nor true (SQLite and MySQL store any integer,
    SQLite any value), which neither the live nor the finished query would see.

    Written as ranges around 0 and 1 and unordered, so an index on the flag finds them
    (usually none) without a scan; on PostgreSQL the flag is a real boolean and this matches
    nothing.
    """
    flag = tasks.c.terminal
    no, yes = literal(False, Boolean()), literal(True, Boolean())
    return select(*_LIVE_COLUMNS).where(or_(flag < no, and_(flag > no, flag < yes), flag > yes))


@cache
def quarantine_stmt() -> Update:
    """Mark an undecodable task failed, with why."""
    return (
        update(tasks)
        .where(tasks.c.id == bindparam("b_id"))
        .values(
            status=TaskStatus.FAILED.value,
            terminal=True,
            live_key=None,
            updated_unix_ns=bindparam("b_at"),
            finished_unix_ns=bindparam("b_at"),
            message=bindparam("b_message"),
        )
    )


@cache
def finished_stmt() -> Select[Any]:
    """Finished tasks within retention, and older ones that a live task depends on."""
    columns = (tasks.c.id, tasks.c.key, tasks.c.status, _RAW_TERMINAL, tasks.c.updated_unix_ns)
    recent = select(*columns).where(
        tasks.c.terminal == True,  # noqa: E712
        tasks.c.finished_unix_ns >= bindparam("cutoff"),
    )
    depended = select(*columns).where(
        tasks.c.terminal == True,  # noqa: E712
        tasks.c.finished_unix_ns < bindparam("cutoff"),
        or_(
            tasks.c.id.in_(select(task_deps.c.target_id).where(task_deps.c.target_id.is_not(None))),
            tasks.c.key.in_(
                select(task_deps.c.target_key).where(task_deps.c.target_key.is_not(None))
            ),
        ),
    )
    both = union_all(recent, depended).subquery()
    return select(both).order_by(both.c.updated_unix_ns, both.c.id)


@cache
def recurring_stmt() -> Select[Any]:
    """Every schedule, by name."""
    return select(
        recurring.c.name,
        recurring.c.spec,
        recurring.c.template_payload,
        recurring.c.next_unix_ns,
        recurring.c.last_task_id,
    ).order_by(recurring.c.name)


@dataclass(slots=True)
class _Quarantine:
    """Task rows that did not decode, by stored id: their key and why, to mark them failed."""

    rows: dict[Any, tuple[str | None, str]] = field(default_factory=dict)

    def decode(self, decoder: Callable[[TimeBase, Any], _T], base: TimeBase, row: Any) -> _T | None:
        """`decoder(base, row)`, or None once the row is set aside for quarantine."""
        try:
            return decoder(base, row)
        except CorruptValue as exc:
            self.set_aside(row, exc)
            return None

    def set_aside(self, row: Any, exc: CorruptValue) -> None:
        """Keep `row` for quarantine, with why it did not decode."""
        log.error(
            "quarantining undecodable task row %r: %s",
            row["id"],
            exc,
            extra={"task_id": row["id"], "quarantined": 1},
        )
        key = row["key"] if isinstance(row["key"], str) else None
        self.rows[row["id"]] = (key, f"corrupt task row: {exc}")

    def write(self, conn: Connection, base: TimeBase, now_unix_ns: int) -> list[RecoveredTerminal]:
        """Mark every row set aside failed (releasing its key and dependency rows); what
        recovery reports of them."""
        if not self.rows:
            return []
        conn.execute(
            quarantine_stmt(),
            [
                {"b_id": i, "b_at": now_unix_ns, "b_message": codec.clean(m)}
                for i, (_, m) in self.rows.items()
            ],
        )
        for chunk in _chunks(list(self.rows)):
            _run_in(conn, delete_deps_stmt(), chunk)
        return [
            RecoveredTerminal(
                id=TaskId(i),
                key=key,
                status=TaskStatus.FAILED,
                at=codec.from_unix(base, now_unix_ns),
            )
            for i, (key, _) in self.rows.items()
            if type(i) is int  # an id SQLite holds as text is marked failed, not reported
        ]


def recover(
    conn: Connection, base: TimeBase, *, now_unix_ns: int, retention: timedelta
) -> tuple[Recovered, int]:
    """Everything a new leader needs, and how many task rows it quarantined (rows that do not
    decode, marked failed on `conn`).

    Every row goes through one of codec's row decoders, and a `CorruptValue` from any of them
    sets that row aside (a task: marked failed with the reason, its key released; a schedule:
    logged and skipped, left in place), so one damaged row never stops a recovery.
    """
    high_water, max_task = conn.execute(high_water_stmt()).one()
    if high_water == INT64_MAX:
        # Saturated: the id 2**63 - 1 may have been used (and pruned), so none is left below.
        high_water = INT64_MAX + 1
    next_id = TaskId(max(high_water or 0, -1 if max_task is None else max_task + 1))

    bad = _Quarantine()
    live: list[RecoveredTask] = []
    result = conn.execute(live_tasks_stmt().execution_options(yield_per=STREAM_ROWS))
    decode, keep = codec.live_task_from_row, live.append  # the hot loop of a recovery
    with execution.collection_paused():  # every object decoded is kept: no garbage to find
        for row in result.mappings():
            try:
                keep(decode(base, row))
            except CorruptValue as exc:
                bad.set_aside(row, exc)
    result.close()
    for row in conn.execute(odd_flag_tasks_stmt()).mappings():
        bad.decode(codec.live_task_from_row, base, row)  # always refused: the flag is damaged

    cutoff = codec.saturate(now_unix_ns - retention // timedelta(microseconds=1) * 1000)
    terminal: list[RecoveredTerminal] = []
    for row in conn.execute(finished_stmt(), {"cutoff": cutoff}).mappings():
        done = bad.decode(codec.finished_task_from_row, base, row)
        if done is not None:
            terminal.append(done)
    # Quarantined rows are updated now, so they come last in this order.
    terminal.extend(bad.write(conn, base, now_unix_ns))

    schedules: list[RecoveredRecurring] = []
    for row in conn.execute(recurring_stmt()).mappings():
        try:
            schedules.append(codec.recurring_from_row(base, row))
        except CorruptValue as exc:
            # Left in place, so it can be repaired, but not scheduled.
            log.error("skipping undecodable recurring schedule %r: %s", row["name"], exc)
    lost = lost_commits(conn)
    if lost is not None:
        log.error(
            "the leader of epoch %s found up to %s of its acknowledged commits missing from "
            "the database (an asynchronous failover that lost its tail?): what they held is "
            "not recovered",
            lost.epoch,
            "?" if lost.commits is None else lost.commits,
            extra={"epoch": lost.epoch, "lost_commits": lost.commits},
        )
    recovered = Recovered(
        next_id=next_id, tasks=live, terminal=terminal, recurring=schedules, lost=lost
    )
    return recovered, len(bad.rows)


# Repair.


@cache
def stored_ids_stmt() -> Select[Any]:
    """The largest task id each table still holds (a task's own, a dependency's target, a
    schedule's last task): what bounds the ids ever used once the leader row is lost."""
    return select(
        select(func.max(tasks.c.id)).scalar_subquery(),
        select(func.max(task_deps.c.task_id)).scalar_subquery(),
        select(func.max(task_deps.c.target_id)).scalar_subquery(),
        select(func.max(recurring.c.last_task_id)).scalar_subquery(),
    )


@cache
def leader_exists_stmt() -> Select[Any]:
    """Whether the lease row is there."""
    return select(leader.c.id).where(leader.c.id == 1)


def restore_leader_row(conn: Connection) -> int | None:
    """Insert the lease row if it is missing; its `next_id`, or None when it was there.

    The row comes back as the first migration made it (free, epoch 0), with the id
    high-water mark one above the largest id any table still holds, saturated at 2**63 - 1 as
    commits saturate it: no id still stored, or named by a stored task or schedule, is handed
    out again. Ids of tasks pruned before the row was lost, and named nowhere any more,
    cannot be known; `recover` raises the mark above every stored task id in any case.
    """
    if conn.execute(leader_exists_stmt()).first() is not None:
        return None
    stored = [i for i in conn.execute(stored_ids_stmt()).one() if i is not None]
    next_id = min(max(stored) + 1, INT64_MAX) if stored else 0
    conn.execute(insert(leader).values(LEADER_ROW | {"next_id": next_id}))
    log.warning("restored the missing leader row (cronoq_leader id = 1); next id %s", next_id)
    return next_id


# Prune.


def _prunable(*columns: Any) -> Select[Any]:
    """Finished tasks updated before `cutoff` that no live task depends on (by id or key).

    Anti-joins on the dependency indexes (a LEFT JOIN that finds no row), which MariaDB runs
    as one probe per candidate ("Not exists"), where it runs NOT EXISTS as a dependent
    subquery. A NULL key joins no row, so a keyless task needs no "key IS NULL OR".
    """
    by_id = task_deps.alias("by_id")
    by_key = task_deps.alias("by_key")
    joined = tasks.outerjoin(by_id, by_id.c.target_id == tasks.c.id).outerjoin(
        by_key, by_key.c.target_key == tasks.c.key
    )
    return (
        select(*columns)
        .select_from(joined)
        .where(
            tasks.c.terminal == True,  # noqa: E712
            tasks.c.finished_unix_ns < bindparam("cutoff"),
            by_id.c.task_id.is_(None),
            by_key.c.task_id.is_(None),
        )
    )


@cache
def prunable_stmt() -> Select[Any]:
    """Up to `limit` prunable tasks, oldest first (what one `prune_stmt` deletes)."""
    return _prunable(tasks.c.id).order_by(tasks.c.finished_unix_ns).limit(bindparam("limit"))


@cache
def prune_stmt(*, join: bool = False) -> Delete:
    """Delete one batch of prunable tasks in one statement, as the reference does.

    The dependency check is part of the DELETE itself, so a live task committed before the
    statement starts always spares its targets; selecting victims first and deleting them by
    id in a second statement would lose a dependency committed in between. The victims are a
    derived table so MySQL accepts LIMIT and the target table in the subquery.
    With `join` (where `dialects.delete_joins` says so) the victims are joined by primary key
    instead of tested with IN.
    """
    victims = prunable_stmt().subquery("victims")
    if join:
        return delete(tasks).where(tasks.c.id == victims.c.id)
    return delete(tasks).where(tasks.c.id.in_(select(victims.c.id)))


def prune_batch(conn: Connection, cutoff: int, limit: int = PRUNE_BATCH) -> int:
    """Delete one batch of prunable tasks; returns how many were deleted."""
    cutoff = codec.saturate(cutoff)
    stmt = prune_stmt(join=dialects.delete_joins(conn.dialect))
    deleted: int = conn.execute(stmt, {"cutoff": cutoff, "limit": limit}).rowcount
    return deleted


# Queries.

_RECORD_COLUMNS: Final = (
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


def record_from(row: Mapping[Any, Any]) -> TaskRecord:
    """A query row as a `TaskRecord`."""
    updated = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(
        microseconds=max(0, row["updated_unix_ns"]) // 1000
    )
    return TaskRecord(
        id=TaskId(row["id"]),
        key=row["key"],
        pool=row["pool"],
        kind=row["kind"],
        priority=codec.priority_from(row["priority"]),
        tenant=row["tenant"],
        status=TaskStatus.from_name(row["status"]),
        attempt=row["attempt"],
        message=row["message"],
        output=None if row["output"] is None else codec.stored_blob("output", row["output"]),
        updated=updated,
    )


@cache
def task_by_id_stmt() -> Select[Any]:
    """A task by id."""
    return select(*_RECORD_COLUMNS).where(tasks.c.id == bindparam("id"))


@cache
def task_by_key_stmt() -> Select[Any]:
    """The newest task with a key."""
    return (
        select(*_RECORD_COLUMNS)
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
        select(*_RECORD_COLUMNS)
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
    return None if row is None else record_from(row)


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
    return [record_from(r) for r in conn.execute(stmt, params).mappings()]


def load_output(conn: Connection, task_id: int) -> bytes | None:
    if not isinstance(task_id, int) or isinstance(task_id, bool):
        raise InvalidValue(f"a task id must be an int, not {type(task_id).__name__}")
    if not INT64_MIN <= task_id <= INT64_MAX:
        return None
    out = conn.execute(output_of_stmt(), {"id": task_id}).scalar()
    return None if out is None else codec.stored_blob("output", out)


# Operators' read-only queries (the CLI's).


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
    *(c for c in _RECORD_COLUMNS if c.name != "output"),
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


def prunable_count_stmt() -> Select[Any]:
    """How many tasks `prune` would delete now: `repository.prunable_stmt`, counted."""
    return select(func.count()).select_from(prunable_stmt().subquery())
