"""From inbox to task exactly once, with the leader crashing at every point of a drain.

A leader drains the inbox (read, commit the tasks with their `InboxTaken`, twice) and "dies"
right after its k-th statement or COMMIT at the driver, for every k until a drain completes:
from that point every statement its engine runs raises, its keeper's renewals included, as a
dead process runs none. Its lease runs out; a second leader takes over, recovers and drains
what is left under ids of its own. Then each item that was enqueued is checked on its own:
exactly one task holds its payload, and it no longer waits in the inbox
(docs/guarantees.md, "From inbox to task: exactly once"). On every dialect.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from builders import BASE
from sqlalchemy import URL, Engine, func, select, update

from cronoq_store import InboxTaken, SqlStore, StoreConfig, Submitted, TaskId, TaskSpec
from cronoq_store.inbox import enqueue_many
from cronoq_store.schema import leader, tasks
from cronoq_store.testing.statements import after_commits, after_statements

ITEMS = 4
PER_DRAIN = 2
"""Two drains of two items: read, commit, read, commit."""
LIMIT = 60
"""More points than any drain has (a bound, so that a drain that never completes fails)."""
CONFIG = StoreConfig(
    lease_ttl=timedelta(seconds=2),
    lease_renew=timedelta(milliseconds=400),
    lock_poll=timedelta(milliseconds=50),
)


class Crash(Exception):
    """The leader's process died here."""


class Crasher:
    """Counts the statements and COMMITs the thread `armed` runs, and dies after the `at`-th:
    from then on every statement of the engine raises, in any thread."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.seen = 0
        self.dead = False
        self.where = ""
        self.armed: threading.Thread | None = None
        self.buried = False
        """Set once the test is done with it: its store may be closed (its lease is gone)."""

    def point(self, what: str) -> None:
        if self.buried:
            return
        if self.dead:
            raise Crash("the process is dead")
        if threading.current_thread() is not self.armed:
            return
        self.seen += 1
        if self.seen == self.at:
            self.dead = True
            self.where = what
            raise Crash(f"died after {what}")

    def statement(self, _cursor: Any, statement: str) -> None:
        if statement.strip().upper() != "COMMIT":  # a flight's: counted as a commit
            self.point(" ".join(statement.split())[:50])

    def commit(self, _connection: Any) -> None:
        self.point("COMMIT")


def drain(store: SqlStore, epoch: int, next_id: int, rounds: int | None) -> int:
    """Make inbox items into tasks as an engine does, `PER_DRAIN` a commit, for `rounds`
    commits (None: until the inbox is empty); the next free id."""
    done = 0
    while rounds is None or done < rounds:
        items = store.read_inbox(limit=PER_DRAIN, base=BASE)
        if not items:
            break
        batch: list[Any] = []
        for item in items:
            batch.append(Submitted(id=TaskId(next_id), seq=next_id, arrival=0, spec=item.spec))
            batch.append(InboxTaken(inbox_id=item.inbox_id))
            next_id += 1
        store.commit(epoch, BASE, batch)
        done += 1
    return next_id


def payload_counts(engine: Engine, payloads: list[bytes]) -> dict[bytes, int]:
    with engine.connect() as conn:
        stmt = (
            select(tasks.c.payload, func.count())
            .where(tasks.c.payload.in_(payloads))
            .group_by(tasks.c.payload)
        )
        counted = {bytes(p): n for p, n in conn.execute(stmt)}
    return {p: counted.get(p, 0) for p in payloads}


def test_a_crash_at_every_point_of_a_drain_loses_and_repeats_no_item(
    db_url: URL, engine: Engine, cleanup: list[Callable[[], None]]
) -> None:
    successor = SqlStore.open(db_url, CONFIG)
    cleanup.append(successor.close)
    crashes: list[str] = []
    for at in range(1, LIMIT + 1):
        payloads = [b"item %d of round %d" % (i, at) for i in range(ITEMS)]
        with engine.begin() as conn:
            enqueue_many(conn, [TaskSpec(payload=p) for p in payloads])

        dying = SqlStore.open(db_url, CONFIG)
        crasher = Crasher(at)
        after_statements(dying.engine, crasher.statement)
        after_commits(dying.engine, crasher.commit)
        epoch = dying.acquire_leadership(timeout=10)
        first = dying.recover(BASE).next_id
        crasher.armed = threading.current_thread()
        try:
            drain(dying, epoch, first, rounds=ITEMS // PER_DRAIN)
        except Exception:
            if not crasher.dead:
                raise
        finally:
            crasher.armed = None
        if crasher.dead:
            crashes.append(crasher.where)
            # Its lease runs out (it renews no more); the successor takes over.
            with engine.begin() as conn:
                conn.execute(update(leader).where(leader.c.id == 1).values(expires_unix_ns=0))
            epoch = successor.acquire_leadership(timeout=10)
            recovered = successor.recover(BASE)
            assert recovered.next_id >= first
            drain(successor, epoch, recovered.next_id, rounds=None)
            successor.release_leadership()

        crasher.buried = True
        dying.close()  # its lease is not its own any more: it releases nothing

        counts = payload_counts(engine, payloads)
        assert counts == dict.fromkeys(payloads, 1), (at, crasher.where, counts)
        assert successor.read_inbox(limit=100) == []
        if not crasher.dead:
            break  # the drain ran to its end: every point before it was tried
    else:
        raise AssertionError(f"a drain did not complete within {LIMIT} points")
    # Points inside both commits and between them were reached.
    assert crashes.count("COMMIT") >= 3, crashes
