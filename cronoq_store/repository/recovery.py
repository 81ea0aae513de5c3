"""Recovery: everything a new leader needs, read with every row decoded by codec, and the rows
that do not decode quarantined; and the repair of a lost leader row.

Functions take a `Connection` and never commit: the caller owns the transaction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from functools import cache
from typing import Any, Final, TypeVar

from sqlalchemy import (
    BindParameter,
    Boolean,
    CompoundSelect,
    Connection,
    Integer,
    Select,
    Update,
    and_,
    bindparam,
    func,
    insert,
    literal,
    or_,
    select,
    type_coerce,
    union_all,
    update,
)

from .. import codec, execution
from ..errors import CorruptValue
from ..model import (
    INT64_MAX,
    ById,
    LostCommits,
    Recovered,
    RecoveredRecurring,
    RecoveredTask,
    RecoveredTerminal,
    TaskId,
    TaskStatus,
    TimeBase,
)
from ..schema import LEADER_ROW, leader, recurring, task_deps, tasks
from . import commit, operators, prune

log = logging.getLogger(__name__)

_T = TypeVar("_T")

STREAM_ROWS: Final = 1000
"""Rows fetched at a time while recovering."""

# Recovery.

_RAW_TERMINAL: Final = type_coerce(tasks.c.terminal, Integer).label("terminal")
"""The terminal flag as stored (an integer: Boolean's result processor would read 2 as True),
so the row decoders can refuse a flag that is neither 0 nor 1."""

_LIVE_COLUMNS: Final = tuple(
    _RAW_TERMINAL if name == "terminal" else tasks.c[name] for name in codec.LIVE_COLUMNS
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


_FINISHED_COLUMNS: Final = (
    tasks.c.id,
    tasks.c.key,
    tasks.c.status,
    _RAW_TERMINAL,
    tasks.c.updated_unix_ns,
    tasks.c.finished_unix_ns,
)
_FINISHED_NAMES: Final = ("id", "key", "status", "terminal", "updated_unix_ns", "finished_unix_ns")
"""What `codec.finished_task_from_row` reads, in the order of `_FINISHED_COLUMNS`."""


@cache
def recent_stmt() -> CompoundSelect[Any]:
    """Finished tasks within retention (a range of the finished-time index), and every finished
    task without a finish time: those a build before revision 0005 (release 0.1.0) finished on
    the newer schema (`prune.unstamped_stmt`), off the finished-time index's NULLs (the live
    tasks and these). `recover` keeps the latter as recent as their last update, or needed.

    Never `(terminal, id)` for the flag: it holds every finished task. Nothing here tests a
    row against the dependency rows: an estimate of that (every dependency row) is what
    started PostgreSQL's JIT compiler on a recovery that returned nothing."""
    finished = prune.finished_flag()
    cutoff: BindParameter[Any] = bindparam("cutoff")
    return union_all(
        select(*_FINISHED_COLUMNS).where(finished, tasks.c.finished_unix_ns >= cutoff),
        select(*_FINISHED_COLUMNS).where(tasks.c.finished_unix_ns.is_(None), finished),
    )


@cache
def old_count_stmt() -> Select[Any]:
    """How many tasks finished before `cutoff`, counted no further than `cap`: a range of the
    finished-time index, which tells `recover` whether to read the old finished tasks whole
    or to look up the ones live tasks need (`operators.backlog_rows_stmt`, capped)."""
    return operators.capped_count_stmt(operators.backlog_rows_stmt())


@cache
def old_finished_stmt() -> Select[Any]:
    """Up to `limit` finished tasks that finished before `cutoff`, oldest first: all of them,
    when `old_count_stmt` found fewer than the targets live tasks need (`recover` keeps the
    needed ones). A range of the finished-time index."""
    return (
        select(*_FINISHED_COLUMNS)
        .where(prune.finished_flag(), tasks.c.finished_unix_ns < bindparam("cutoff"))
        .order_by(tasks.c.finished_unix_ns)
        .limit(bindparam("limit"))
    )


@cache
def needed_by_id_stmt() -> Select[Any]:
    """Finished tasks among the ids `ids` (an IN list for `execution.run_in`): a probe of the
    primary key per id, whatever the history holds."""
    ids: BindParameter[Any] = bindparam("ids", expanding=True)
    return select(*_FINISHED_COLUMNS).where(tasks.c.id.in_(ids), prune.finished_flag())


@cache
def needed_by_key_stmt() -> Select[Any]:
    """Finished tasks with a key among `ids` (keys: the one IN list `execution.run_in` binds
    is named so): a probe of the key index per key, whatever the history holds."""
    keys: BindParameter[Any] = bindparam("ids", expanding=True)
    return select(*_FINISHED_COLUMNS).where(tasks.c.key.in_(keys), prune.finished_flag())


@cache
def deps_of_stmt() -> Select[Any]:
    """The dependency targets (id, key) of the tasks `ids`: those of rows set aside for
    quarantine, which still count as live when recovery looks for what live tasks need."""
    ids: BindParameter[Any] = bindparam("ids", expanding=True)
    return select(task_deps.c.target_id, task_deps.c.target_key).where(task_deps.c.task_id.in_(ids))


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
        """Keep `row` (a mapping, or a sequence of `codec.LIVE_COLUMNS` as the live tasks are
        read) for quarantine, with why it did not decode."""
        if not isinstance(row, Mapping):
            row = dict(zip(codec.LIVE_COLUMNS, row, strict=True))
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
        for chunk in execution.chunks(list(self.rows)):
            execution.run_in(conn, commit.delete_deps_stmt(), chunk)
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


# The finished tasks a recovery returns.


@dataclass(slots=True)
class _Targets:
    """What live tasks depend on: ids (less the live tasks' own: no finished task has one)
    and keys (all of them: a finished task may share its key with a live one)."""

    ids: set[Any]
    keys: set[Any]

    @classmethod
    def of(cls, live: Sequence[RecoveredTask], extra: Sequence[Any]) -> _Targets:
        """The targets of the decoded `live` tasks, and `extra` rows of `deps_of_stmt`."""
        ids: set[Any] = set()
        keys: set[Any] = set()
        for task in live:
            for dep in task.spec.deps:
                target = dep.target
                if isinstance(target, ById):
                    ids.add(target.id)  # needed by id
                else:
                    keys.add(target.key)
        for target_id, target_key in extra:
            if target_id is not None:
                ids.add(target_id)
            if target_key is not None:
                keys.add(target_key)
        ids.difference_update([task.id for task in live])
        return cls(ids, keys)

    def __len__(self) -> int:
        return len(self.ids) + len(self.keys)

    def wants(self, row: Any) -> bool:
        """Whether a live task needs the finished task `row` (of `_FINISHED_COLUMNS`)."""
        return row[0] in self.ids or row[1] in self.keys

    def lookup(self, conn: Connection) -> list[Any]:
        """The finished tasks with these ids or keys (of any age; one may come twice): a probe
        of the primary key or the key index for each, in IN lists of `execution.IN_CHUNK`."""
        rows: list[Any] = []
        for stmt, values in ((needed_by_id_stmt(), self.ids), (needed_by_key_stmt(), self.keys)):
            for chunk in execution.chunks(list(values)):
                rows.extend(execution.run_in(conn, stmt, chunk).rows)
        return rows


def _is_before(value: Any, cutoff: int) -> bool:
    """`value < cutoff` as SQL compares a stored time: only a number is before anything (SQLite
    orders text and blobs after numbers; such a row goes on to be refused by the decoder)."""
    return isinstance(value, int | float | Decimal) and value < cutoff


def _sql_rank(value: Any) -> tuple[int, Any]:
    """`value` as ORDER BY ranks it on SQLite, whose columns hold any type (NULL, numbers,
    text, blobs); on the servers every value here is an integer."""
    if value is None:
        return (0, 0)
    if isinstance(value, int | float | Decimal):
        return (1, value)
    if isinstance(value, str):
        return (2, value)
    return (3, bytes(value))


def _update_order(row: Any) -> tuple[tuple[int, Any], tuple[int, Any]]:
    """ORDER BY updated_unix_ns, id."""
    return _sql_rank(row[4]), _sql_rank(row[0])


def finished_rows(
    conn: Connection, live: Sequence[RecoveredTask], set_aside: Sequence[Any], cutoff: int
) -> list[Any]:
    """Finished tasks (rows of `_FINISHED_COLUMNS`) updated since `cutoff`, and older ones a
    live task depends on (by id or key), each once, by update time, then id.

    Each statement reads what it returns, or at most as much as the live tasks' targets:
    - the recent ones, and those without a finish time (`recent_stmt`);
    - how many finished before `cutoff`, up to one more than the live tasks (`old_count_stmt`):
      none, the usual case of a recovery after a prune, ends it, before any target is
      gathered;
    - fewer than the targets the live tasks need: all of them (`old_finished_stmt`), kept
      here if needed; else the targets looked up by id and by key (`_Targets.lookup`).
    What the live tasks need is read off their decoded specs, and the dependency rows of
    `set_aside` (live rows quarantined: as before, what they needed comes back this once),
    never by aggregating every dependency row in SQL (on PostgreSQL a probe of the primary key
    per dependency, and the JIT compiler its estimate started: 1 s for 100,000 live tasks
    that needed no finished one).
    """
    found: dict[Any, Any] = {}  # by id: a task needed both by id and by key comes once
    unstamped: list[Any] = []  # without a finish time, updated before the cutoff
    for row in conn.execute(recent_stmt(), {"cutoff": cutoff}):
        if row[5] is None and _is_before(row[4], cutoff):
            unstamped.append(row)
        else:
            found[row[0]] = row
    extra: list[Any] = []
    for chunk in execution.chunks(list(set_aside)):
        extra.extend(execution.run_in(conn, deps_of_stmt(), chunk).rows)
    targets: _Targets | None = None
    if live or extra:
        cap = len(live) + len(extra) + 1
        old = conn.execute(old_count_stmt(), {"cutoff": cutoff, "cap": cap}).scalar_one()
        if old:
            targets = _Targets.of(live, extra)
            needed: list[Any] | None = None
            if old < cap and old <= len(targets):
                params = {"cutoff": cutoff, "limit": cap}
                rows = conn.execute(old_finished_stmt(), params).all()
                if len(rows) < cap:  # all of them
                    needed = [r for r in rows if targets.wants(r)]
            if needed is None:
                needed = targets.lookup(conn)
            for row in needed:
                found.setdefault(row[0], row)
    if unstamped:
        if targets is None:
            targets = _Targets.of(live, extra)
        for row in unstamped:
            if targets.wants(row):
                found.setdefault(row[0], row)
    return sorted(found.values(), key=_update_order)


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
    decode, keep = codec.live_task_from_row, live.append  # the hot loop of a recovery
    with (
        execution.collection_paused(),  # every object decoded is kept: no garbage to find
        closing(execution.stream(conn, live_tasks_stmt(), STREAM_ROWS)) as chunks,
    ):
        for chunk in chunks:
            for live_row in chunk:
                try:
                    keep(decode(base, live_row))
                except CorruptValue as exc:
                    bad.set_aside(live_row, exc)
    for odd_row in conn.execute(odd_flag_tasks_stmt()):
        bad.decode(codec.live_task_from_row, base, odd_row)  # always refused: the flag is damaged

    cutoff = codec.saturate(now_unix_ns - retention // timedelta(microseconds=1) * 1000)
    terminal: list[RecoveredTerminal] = []
    for row in finished_rows(conn, live, list(bad.rows), cutoff):
        found = dict(zip(_FINISHED_NAMES, row, strict=True))
        done = bad.decode(codec.finished_task_from_row, base, found)
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
