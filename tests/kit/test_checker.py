"""`cronoq_store.testing.check`, fed histories known to be bad: each kind of violation it
reports is reported for the history that has it, and only that one (the fault tests trust a
clean report). A store and a log are built by hand: the commits that the log says happened,
or not, as each case needs. On SQLite: the checker reads any store the same way."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from builders import BASE, status, submit
from sqlalchemy import URL

from cronoq_store import InboxTaken, SqlStore, StatusChanged, Submitted, TaskStatus
from cronoq_store.inbox import enqueue_many
from cronoq_store.testing import check, digest
from cronoq_store.testing.acklog import AckLog
from cronoq_store.testing.checker import CheckReport

FINDINGS = (
    "lost",
    "partial",
    "fenced_visible",
    "mismatches",
    "unexplained",
    "inbox_duplicates",
    "inbox_lost",
    "inbox_from_rolled_back",
)


class History:
    """A store and the log a driver would have written for it."""

    def __init__(self, store: SqlStore, log: Path) -> None:
        self.store = store
        self.path = log
        self.log = AckLog(log)
        self.epoch = store.acquire_leadership()
        self._seq = itertools.count(1)

    def batch(
        self,
        muts: Sequence[tuple[Any, dict[str, Any]]],
        *,
        commit: Sequence[Any] | None = None,
        outcome: str = "ack",
    ) -> str:
        """Log a batch of `muts` (each a mutation and its log record); commit the mutations
        (or `commit`, when given: what the database really got), then log `outcome`: "ack",
        "fenced", or "none" (killed before the log)."""
        seq = next(self._seq)
        batch = f"run:1:{self.epoch}:{seq}"
        head = {"batch": batch, "run": "run", "epoch": self.epoch, "seq": seq, "term": 1}
        records = [r for _, r in muts]
        self.log.append({"type": "intent", **head, "muts": records}, sync=False)
        writes = [m for m, _ in muts] if commit is None else list(commit)
        if writes:
            self.store.commit(self.epoch, BASE, writes)
        if outcome == "ack":
            self.log.append({"type": "ack", **head, "muts": records}, sync=True)
        elif outcome == "fenced":
            self.log.append({"type": "fenced", **head, "retried": False}, sync=True)
        return batch

    def enqueued(self, *payloads: bytes, kind: str = "enqueue_ack") -> list[Any]:
        """Items an app enqueued (and committed), logged as `kind`; the inbox items."""
        specs = [submit(0, p).spec for p in payloads]
        with self.store.engine.begin() as conn:
            ids = enqueue_many(conn, specs)
        record = {"inbox_ids": ids, "digests": [digest(s) for s in specs]}
        self.log.append({"type": "enqueue_intent", **record}, sync=False)
        self.log.append({"type": kind, **record}, sync=True)
        return self.store.read_inbox(limit=1000, base=BASE)

    def check(self) -> CheckReport:
        self.log.close()
        return check(self.store, self.path)


def sub(i: int, payload: bytes | None = None) -> tuple[Submitted, dict[str, Any]]:
    m = submit(i, payload)
    return m, {"op": "submit", "id": i, "key": None, "digest": digest(m.spec)}


def st(i: int, s: TaskStatus, attempt: int = 1) -> tuple[StatusChanged, dict[str, Any]]:
    m = status(i, s, attempt=attempt)
    return m, {"op": "status", "id": i, "status": s.value, "attempt": attempt, "message": None}


def taken(item: Any, task_id: int) -> list[tuple[Any, dict[str, Any]]]:
    """The task made of inbox `item`, and its `InboxTaken`."""
    m = Submitted(id=task_id, seq=task_id, arrival=0, spec=item.spec)
    d = digest(item.spec)
    return [
        (m, {"op": "submit", "id": task_id, "key": None, "digest": d}),
        (
            InboxTaken(inbox_id=item.inbox_id),
            {"op": "inbox_taken", "inbox_id": item.inbox_id, "id": task_id, "digest": d},
        ),
    ]


@pytest.fixture
def history(tmp_path: Path) -> Iterator[History]:
    url = URL.create("sqlite", database=str(tmp_path / "check.db"))
    with SqlStore.open(url) as store:
        yield History(store, tmp_path / "log.jsonl")
        store.release_leadership()


def only(report: CheckReport, finding: str, also: tuple[str, ...] = ()) -> list[str]:
    """The findings of kind `finding`, failing when any other kind (but those it implies,
    `also`) has one."""
    others = {
        f: getattr(report, f)
        for f in FINDINGS
        if f != finding and f not in also and getattr(report, f)
    }
    assert not others, others
    found: list[str] = getattr(report, finding)
    assert found and not report.ok, report.as_dict()
    return found


def test_a_clean_history_is_ok(history: History) -> None:
    """The baseline each case below breaks in one way: everything holds."""
    history.batch([sub(1), sub(2)])
    history.batch([st(1, TaskStatus.RUNNING), st(2, TaskStatus.SUCCEEDED)])
    history.batch([sub(3)], outcome="none")  # committed, killed before its ack: allowed
    history.batch([sub(4)], commit=[], outcome="fenced")  # fenced, nothing written
    [item] = history.enqueued(b"app item")
    history.batch(taken(item, 5))
    report = history.check()
    assert report.ok, report.as_dict()
    assert report.acked_batches == 3 and report.visible_unacked_batches == 1
    assert report.invisible_batches == 1 and report.fenced_batches == 1
    assert report.inbox_tasks == 1 and report.enqueued_committed == 1


def test_an_acknowledged_batch_not_stored_is_lost(history: History) -> None:
    history.batch([sub(1)])
    lost = history.batch([sub(2)], commit=[])  # acknowledged, never written
    found = only(history.check(), "lost")
    assert found == [f"{lost}: acknowledged batch not stored"]


def test_an_acknowledged_transition_not_stored_is_lost(history: History) -> None:
    history.batch([sub(1)])
    history.batch([st(1, TaskStatus.SUCCEEDED)], commit=[])  # acknowledged, never written
    # The replay expects succeeded, the store has queued: a mismatch too, by construction.
    report = history.check()
    assert report.lost == ["task 1: acknowledged succeeded/1, stored queued/0"]


def test_a_batch_half_stored_is_partial(history: History) -> None:
    one, two = sub(1), sub(2)
    half = history.batch([one, two], commit=[one[0]], outcome="none")
    # Not replayed (it is not visible as a whole): its stored task is unexplained too.
    found = only(history.check(), "partial", also=("mismatches", "unexplained"))
    assert found == [f"{half}: 1 of 2 new tasks stored"]


def test_a_fenced_batch_that_is_visible_is_reported(history: History) -> None:
    fenced = history.batch([sub(1)], outcome="fenced")  # said fenced, yet it landed
    assert only(history.check(), "fenced_visible") == [fenced]


def test_a_stored_task_that_differs_from_the_replay_is_a_mismatch(history: History) -> None:
    history.batch([sub(1)], commit=[submit(1), status(1, TaskStatus.FAILED)])
    found = only(history.check(), "mismatches")
    assert any(f.startswith("task 1: stored") and "failed" in f for f in found), found


def test_a_stored_task_no_batch_made_is_unexplained(history: History) -> None:
    history.batch([sub(1)])
    history.store.commit(history.epoch, BASE, [submit(2)])  # nobody logged it
    # Recovery returns it, the replay does not have it: a mismatch too.
    assert only(history.check(), "unexplained", also=("mismatches",)) == ["task 2 (queued)"]


def test_an_item_made_into_two_tasks_is_a_duplicate(history: History) -> None:
    [item] = history.enqueued(b"once")
    first = history.batch(taken(item, 1))
    second = history.batch(taken(item, 2))  # drained again, under another id
    found = only(history.check(), "inbox_duplicates")
    assert len(found) == 1 and digest(item.spec) in found[0]
    assert f"{first}#{item.inbox_id}" in found[0] and f"{second}#{item.inbox_id}" in found[0]


def test_an_item_consumed_and_still_waiting_is_a_duplicate(history: History) -> None:
    [item] = history.enqueued(b"kept")
    made = taken(item, 1)
    history.batch(made, commit=[made[0][0]])  # the task landed, the inbox row stayed
    found = only(history.check(), "inbox_duplicates")
    assert len(found) == 1 and f"still waiting as {item.inbox_id}" in found[0]


def test_a_committed_item_neither_consumed_nor_waiting_is_lost(history: History) -> None:
    [item] = history.enqueued(b"gone")
    made = taken(item, 1)
    history.batch(made, commit=[made[1][0]], outcome="none")  # the row went, with no task
    report = history.check()
    assert report.inbox_lost == [f"item {digest(item.spec)}: committed, never consumed"]


def test_a_rolled_back_item_that_was_consumed_is_reported(history: History) -> None:
    [item] = history.enqueued(b"undone", kind="enqueue_rollback")  # it committed after all
    history.batch(taken(item, 1))
    found = only(history.check(), "inbox_from_rolled_back")
    assert found == [f"item {digest(item.spec)}: its enqueue was rolled back"]
