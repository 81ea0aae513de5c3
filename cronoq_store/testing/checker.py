"""`check`: compares a database with the log its drivers and enqueuers wrote. The invariants
it holds are listed in the package's docstring (`cronoq_store/testing/__init__.py`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select

from .. import codec
from ..errors import CorruptValue
from ..model import (
    ById,
    InboxItem,
    TaskId,
    TaskStatus,
)
from ..schema import tasks as tasks_table
from ..store import SqlStore
from .acklog import read_log
from .base import BASE, Store, digest


def _progress(status: str, attempt: int) -> tuple[int, int, int]:
    """How far a task got: terminal last, then by attempt, retrying after running."""
    st = TaskStatus.from_name(status)
    if st is None:
        return (-1, 0, 0)
    if st.is_terminal:
        return (2, 0, 0)
    sub = {TaskStatus.QUEUED: 0, TaskStatus.WAITING: 0, TaskStatus.RUNNING: 1}.get(st, 2)
    return (1 if attempt or sub else 0, attempt, sub)


@dataclass(slots=True)
class _TaskState:
    key: str | None
    digest: str
    status: str = TaskStatus.QUEUED.value
    attempt: int = 0
    message: str | None = None
    output: bytes | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredTask:
    """A task as the checker reads it from the store."""

    id: int
    """The task's id."""
    key: str | None
    """Its key, if any."""
    status: str
    """Its stored status name."""
    attempt: int
    """The attempt it reached."""
    message: str | None
    """Its stored message."""
    output: bytes | None
    """Its stored output."""
    digest: str | None = None
    """The digest of its stored spec (`base.digest`); None where the store cannot show it, or
    the spec does not decode."""


@dataclass(slots=True, kw_only=True)
class CheckReport:
    """What the checker found; `ok` when every invariant holds."""

    records: int = 0
    """Records read from the log."""
    torn_lines: int = 0
    """Log lines that did not parse (torn by a kill)."""
    batches: int = 0
    """Batches the log says may have been committed."""
    acked_batches: int = 0
    """Of those, the acknowledged ones."""
    acked_mutations: int = 0
    """Mutations in acknowledged batches."""
    visible_unacked_batches: int = 0
    """Committed but not acknowledged (killed between commit and log): allowed."""
    invisible_batches: int = 0
    """Never committed (killed before or during the commit, or fenced): allowed unless acked."""
    fenced_batches: int = 0
    """Batches the log records as rejected with `Fenced`."""
    tasks_expected: int = 0
    """Tasks that replaying the visible batches creates."""
    tasks_stored: int = 0
    """Tasks found in the store."""
    live_recovered: int = 0
    """Live tasks that recovery returned."""
    epochs: list[int] = field(default_factory=list)
    """The fencing epochs seen in the log, in order."""
    lost: list[str] = field(default_factory=list)
    """Acknowledged mutations missing, or tasks behind their last acknowledged transition."""
    lost_submissions: int = 0
    """Acknowledged new tasks not stored with the spec they were submitted with (missing, or
    their id holding another task: an asynchronous failover can hand lost ids out again)."""
    partial: list[str] = field(default_factory=list)
    """Batches only partly visible."""
    fenced_visible: list[str] = field(default_factory=list)
    """Batches rejected as fenced that are visible anyway."""
    mismatches: list[str] = field(default_factory=list)
    """Differences between the replayed log and the store (tasks, schedules, recovery)."""
    unexplained: list[str] = field(default_factory=list)
    """Stored tasks that no visible batch created."""
    enqueued_committed: int = 0
    """Inbox items whose enqueuing transaction an enqueuer saw commit."""
    enqueued_rolled_back: int = 0
    """Inbox items whose enqueuing transaction an enqueuer rolled back."""
    enqueued_unknown: int = 0
    """Enqueues whose commit raised: they may or may not have landed (both are fine)."""
    inbox_tasks: int = 0
    """Inbox items made into tasks by visible batches."""
    inbox_drops: int = 0
    """Inbox items dropped (alone) by visible batches."""
    inbox_waiting: int = 0
    """Items still in the inbox."""
    inbox_duplicates: list[str] = field(default_factory=list)
    """Inbox items consumed twice (or consumed and still waiting)."""
    inbox_lost: list[str] = field(default_factory=list)
    """Committed enqueues neither consumed nor waiting."""
    inbox_from_rolled_back: list[str] = field(default_factory=list)
    """Rolled-back enqueues that were consumed or are waiting."""

    @property
    def ok(self) -> bool:
        """Whether every invariant holds: all eight lists of findings are empty."""
        return not (
            self.lost
            or self.partial
            or self.fenced_visible
            or self.mismatches
            or self.unexplained
            or self.inbox_duplicates
            or self.inbox_lost
            or self.inbox_from_rolled_back
        )

    def as_dict(self, limit: int = 20) -> dict[str, Any]:
        """A JSON-ready summary (lists cut to `limit` items, with their full counts).

        Args:
            limit: At most this many items of each list.

        Returns:
            The summary: counts, the first `limit` problems of each kind, and `ok`.
        """
        out: dict[str, Any] = {"ok": self.ok}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list) and f.name != "epochs":
                out[f.name] = len(value)
                if value:
                    out[f"{f.name}_examples"] = value[:limit]
            else:
                out[f.name] = value
        return out


def _stored_tasks(store: Store, ids: Sequence[int]) -> Iterator[StoredTask]:
    """Every stored task (SqlStore: one scan), or the given ids one by one (any store)."""
    if isinstance(store, SqlStore):
        t = tasks_table.c
        spec = (t[name] for name in codec.SPEC_COLUMNS if name != "key")
        stmt = select(t.id, t.key, t.status, t.attempt, t.message, t.output, *spec).order_by(t.id)
        with store.engine.connect() as conn:
            for row in conn.execute(stmt).mappings():
                yield StoredTask(
                    id=row["id"],
                    key=row["key"],
                    status=row["status"],
                    attempt=row["attempt"],
                    message=row["message"],
                    output=None if row["output"] is None else bytes(row["output"]),
                    digest=_spec_digest(row),
                )
        return
    for task_id in ids:
        rec = store.get_task(ById(id=TaskId(task_id)))
        if rec is not None:
            yield StoredTask(
                id=int(rec.id),
                key=rec.key,
                status=rec.status.value if rec.status is not None else "?",
                attempt=rec.attempt,
                message=rec.message,
                output=rec.output,
            )


def _spec_digest(row: Mapping[Any, Any]) -> str | None:
    try:
        return digest(codec.spec_from_columns(BASE, row))
    except CorruptValue:
        return None


def _holds(stored: Mapping[int, StoredTask], task_id: int, spec_digest: str) -> bool:
    """Whether `task_id` is stored as the task submitted with `spec_digest` (by id alone where
    the store cannot show specs)."""
    got = stored.get(task_id)
    return got is not None and got.digest in (None, spec_digest)


def check(store: Store, log_path: str | os.PathLike[str]) -> CheckReport:
    """Compare `store` with the log its drivers wrote (see the module docs for what holds).

    A `SqlStore` is read with one scan of its tasks table; any other store task by task with
    `get_task`, so that stored tasks no log record names are not looked for there.

    Args:
        store: The store the drivers committed to (any `testing.Store`).
        log_path: The acknowledgement log the drivers wrote.

    Returns:
        What was checked and every violation found (`CheckReport.ok` when none).
    """
    records, torn = read_log(log_path)
    report = CheckReport(records=len(records), torn_lines=torn)
    intents: dict[str, dict[str, Any]] = {}
    acked: set[str] = set()
    fenced: dict[str, bool] = {}
    for rec in records:
        kind, batch = rec.get("type"), str(rec.get("batch"))
        if kind == "intent" or (kind == "ack" and batch not in intents):
            intents[batch] = rec
        if kind == "ack":
            acked.add(batch)
        elif kind == "fenced":
            fenced[batch] = bool(rec.get("retried"))
    report.batches = len(intents)
    report.acked_batches = len(acked)
    report.fenced_batches = len(fenced)

    all_ids = sorted(
        {int(m["id"]) for r in intents.values() for m in r["muts"] if m["op"] == "submit"}
    )
    stored = {t.id: t for t in _stored_tasks(store, all_ids)}
    report.tasks_stored = len(stored)

    # Which batches committed: all their new tasks are stored, or none is. A task counts as
    # stored when its id holds the spec it was submitted with, not merely its id.
    visible: list[dict[str, Any]] = []
    for batch, rec in intents.items():
        subs = [(int(m["id"]), str(m["digest"])) for m in rec["muts"] if m["op"] == "submit"]
        seen = sum(1 for i, d in subs if _holds(stored, i, d))
        if subs and 0 < seen < len(subs):
            report.partial.append(f"{batch}: {seen} of {len(subs)} new tasks stored")
        if (subs and seen == len(subs)) or (not subs and batch in acked):
            visible.append(rec)
            if batch not in acked:
                report.visible_unacked_batches += 1
            if batch in fenced and not fenced[batch]:
                report.fenced_visible.append(batch)
        else:
            report.invisible_batches += 1
            if batch in acked:
                report.lost.append(f"{batch}: acknowledged batch not stored")
        if batch in acked:
            report.lost_submissions += len(subs) - seen

    # Replay the committed batches in commit order: epoch, then sequence within the term.
    visible.sort(key=lambda r: (int(r["epoch"]), int(r["seq"])))
    report.epochs = sorted({int(r["epoch"]) for r in visible})
    expected: dict[int, _TaskState] = {}
    schedules: dict[str, list[Any]] = {}  # name -> [digest, next, last]
    best: dict[int, tuple[tuple[int, int, int], dict[str, Any]]] = {}
    for rec in visible:
        is_acked = str(rec["batch"]) in acked
        muts: list[dict[str, Any]] = rec["muts"]
        for m in muts:
            op = m["op"]
            if op == "submit":
                expected.setdefault(int(m["id"]), _TaskState(key=m["key"], digest=m["digest"]))
            elif op == "status":
                task = expected.get(int(m["id"]))
                if task is None:
                    report.mismatches.append(f"{rec['batch']}: status of unknown task {m['id']}")
                    continue
                task.status, task.attempt = m["status"], int(m["attempt"])
                if m["message"] is not None:
                    task.message = m["message"]
                if is_acked:
                    prog = _progress(m["status"], int(m["attempt"]))
                    prev = best.get(int(m["id"]))
                    if prev is None or prog >= prev[0]:
                        best[int(m["id"])] = (prog, m)
            elif op == "rec_upsert":
                if m["name"] in schedules:
                    schedules[m["name"]][0] = m["digest"]
                else:
                    schedules[m["name"]] = [m["digest"], None, None]
            elif op == "rec_remove":
                schedules.pop(m["name"], None)
            elif op == "rec_next" and m["name"] in schedules:
                schedules[m["name"]][1:] = [m["next"], m["last"]]
        for m in muts:  # outputs land after the batch's transitions, on succeeded tasks only
            if m["op"] == "output":
                task = expected.get(int(m["id"]))
                if task is not None and task.status == TaskStatus.SUCCEEDED.value:
                    task.output = bytes.fromhex(m["hex"])
        if is_acked:
            report.acked_mutations += len(muts)
    report.tasks_expected = len(expected)

    # Acknowledged mutations lost: missing, or behind the last acknowledged transition.
    for rec in visible:
        if str(rec["batch"]) not in acked:
            continue
        for m in rec["muts"]:
            if m["op"] == "submit" and not _holds(stored, int(m["id"]), str(m["digest"])):
                report.lost.append(f"{rec['batch']}: task {m['id']} not stored")
    for task_id, (prog, m) in best.items():
        got = stored.get(task_id)
        if got is None:
            continue  # reported above
        have = _progress(got.status, got.attempt)
        if have < prog or (prog[0] == 2 and got.status != m["status"]):
            report.lost.append(
                f"task {task_id}: acknowledged {m['status']}/{m['attempt']}, "
                f"stored {got.status}/{got.attempt}"
            )

    # Exact replay: tasks.
    for task_id, want in expected.items():
        got = stored.get(task_id)
        if got is None:
            continue  # a visible batch's tasks are all stored, by construction
        row = (got.key, got.status, got.attempt, got.message, got.output)
        wanted = (want.key, want.status, want.attempt, want.message, want.output)
        if row != wanted:
            report.mismatches.append(f"task {task_id}: stored {row!r}, replayed {wanted!r}")
    for task_id in stored:
        if task_id not in expected:
            report.unexplained.append(f"task {task_id} ({stored[task_id].status})")

    # Recovery: live tasks (their specs round-trip), schedules, and the next id.
    recovered = store.recover(BASE)
    report.live_recovered = len(recovered.tasks)
    live_expected = {i for i, s in expected.items() if not TaskStatus(s.status).is_terminal}
    live_got = {int(t.id) for t in recovered.tasks}
    for task_id in sorted(live_expected ^ live_got)[:100]:
        where = "in the log only" if task_id in live_expected else "in recovery only"
        report.mismatches.append(f"task {task_id}: live {where}")
    for t in recovered.tasks:
        want_state = expected.get(int(t.id))
        if want_state is None:
            continue
        if digest(t.spec) != want_state.digest:
            report.mismatches.append(f"task {t.id}: recovered spec differs from the submitted one")
        if t.attempt != want_state.attempt:
            report.mismatches.append(
                f"task {t.id}: recovered attempt {t.attempt}, replayed {want_state.attempt}"
            )
    _check_inbox(store, records, visible, report)
    top = max(stored, default=-1)
    if stored and recovered.next_id <= top:
        report.mismatches.append(f"recovered next_id {recovered.next_id} <= stored id {top}")
    got_sched = {r.spec.name: [digest(r.spec), r.next, r.last] for r in recovered.recurring}
    for name in sorted(set(schedules) | set(got_sched)):
        if schedules.get(name) != got_sched.get(name):
            report.mismatches.append(
                f"schedule {name}: stored {got_sched.get(name)!r}, replayed {schedules.get(name)!r}"
            )
    return report


def _waiting(store: Store) -> list[InboxItem]:
    read = getattr(store, "read_inbox", None)
    return [] if read is None else list(read(limit=2**31 - 1, base=BASE))


def _check_inbox(
    store: Store,
    records: Sequence[Mapping[str, Any]],
    visible: Sequence[Mapping[str, Any]],
    report: CheckReport,
) -> None:
    """Every committed enqueue became exactly one task or one drop (or still waits), none
    from a rolled-back transaction, none twice, each task with the spec enqueued.

    Items are told apart by their spec's digest (an enqueuer makes every payload unique), not
    by inbox id: SQLite hands the id of a rolled-back insert out again.
    """
    outcome: dict[str, str] = {}
    for rec in records:
        kind = rec.get("type")
        if kind == "enqueue_intent":
            for d in rec["digests"]:
                outcome.setdefault(d, "unknown")
        elif kind in ("enqueue_ack", "enqueue_rollback"):
            for d in rec["digests"]:
                outcome[d] = "committed" if kind == "enqueue_ack" else "rolled_back"
    report.enqueued_committed = sum(1 for o in outcome.values() if o == "committed")
    report.enqueued_rolled_back = sum(1 for o in outcome.values() if o == "rolled_back")
    report.enqueued_unknown = sum(1 for o in outcome.values() if o == "unknown")
    consumed: dict[str, list[str]] = {}
    for rec in visible:
        submitted = {int(m["id"]): m for m in rec["muts"] if m["op"] == "submit"}
        for m in rec["muts"]:
            if m["op"] not in ("inbox_taken", "inbox_drop"):
                continue
            consumed.setdefault(m["digest"], []).append(f"{rec['batch']}#{m['inbox_id']}")
            if m["op"] == "inbox_drop":
                report.inbox_drops += 1
                continue
            report.inbox_tasks += 1
            made = submitted.get(int(m["id"]))
            if made is None or made["digest"] != m["digest"]:
                report.mismatches.append(f"inbox {m['inbox_id']}: task {m['id']} differs")
    waiting = {digest(i.spec): i.inbox_id for i in _waiting(store)}
    report.inbox_waiting = len(waiting)
    for d, where in sorted(consumed.items()):
        if len(where) > 1 or d in waiting:
            also = f" and still waiting as {waiting[d]}" if d in waiting else ""
            report.inbox_duplicates.append(f"item {d}: consumed by {', '.join(where)}{also}")
    for d in sorted(set(consumed) | set(waiting)):
        if outcome.get(d) == "rolled_back":
            report.inbox_from_rolled_back.append(f"item {d}: its enqueue was rolled back")
    for d, o in sorted(outcome.items()):
        if o == "committed" and d not in consumed and d not in waiting:
            report.inbox_lost.append(f"item {d}: committed, never consumed")
