"""Recovery: everything a new leader needs, read with every row decoded by codec, and the rows
that do not decode quarantined; and the repair of a lost leader row.

Functions take a `Connection` and never commit: the caller owns the transaction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import closing
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cache
from typing import Any, Final, TypeVar

from sqlalchemy import (
    BindParameter,
    Boolean,
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
    union,
    update,
)

from .. import codec, execution
from ..errors import CorruptValue
from ..model import (
    INT64_MAX,
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
from . import commit, prune

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


@cache
def finished_stmt() -> Select[Any]:
    """Finished tasks within retention, and older ones that a live task depends on.

    Each part reads only what it returns, however much history the table holds: the recent
    ones are a range of the finished-time index; the older ones a live task needs are found
    from the dependency rows (the live tasks' own), each target looked up by id or by key,
    never by reading the old finished tasks to test each against the dependencies (an OR of
    the two tests can only be answered that way: a full scan on every dialect). A task
    needed both by id and by key is returned once.

    Also those a build before revision 0005 (release 0.1.0) finished on the newer schema,
    without a finish time (`prune.unstamped_stmt`): off the finished-time index's NULLs, as
    recent as their last update.
    """
    columns = (tasks.c.id, tasks.c.key, tasks.c.status, _RAW_TERMINAL, tasks.c.updated_unix_ns)
    target_ids = select(task_deps.c.target_id).where(task_deps.c.target_id.is_not(None))
    target_keys = select(task_deps.c.target_key).where(task_deps.c.target_key.is_not(None))
    needed = or_(tasks.c.id.in_(target_ids), tasks.c.key.in_(target_keys))
    finished = prune.finished_flag()  # never `(terminal, id)`: it holds every finished task
    unstamped = and_(tasks.c.finished_unix_ns.is_(None), finished)
    cutoff: BindParameter[Any] = bindparam("cutoff")
    old = (finished, tasks.c.finished_unix_ns < cutoff)
    # UNION, not UNION ALL: a task needed by id and by key comes once (the other parts are
    # disjoint). Not by `id NOT IN (...)` in the by-key part: MariaDB ran that as a probe per
    # finished task, 35 s over 20,000 of them.
    both = union(
        select(*columns).where(finished, tasks.c.finished_unix_ns >= cutoff),
        select(*columns).where(tasks.c.id.in_(target_ids), *old),
        select(*columns).where(tasks.c.key.in_(target_keys), *old),
        select(*columns).where(unstamped, or_(tasks.c.updated_unix_ns >= cutoff, needed)),
    ).subquery()
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
