"""Recovery of more live tasks than one streamed chunk holds, with damaged rows in the later
chunks: every live task comes back, in id order, whichever chunk it was read in, and each
damaged row is quarantined without costing its neighbours (docs/guarantees.md, "Recovery" and
"Damaged rows"). On every dialect."""

from __future__ import annotations

from typing import Any

from builders import BASE, submit
from sqlalchemy import update

from cronoq_store import ById, SqlStore, TaskId, TaskStatus
from cronoq_store.repository import recovery
from cronoq_store.schema import tasks

CHUNK = recovery.STREAM_ROWS
LIVE = 2 * CHUNK + CHUNK // 2
"""Three chunks: the last one partly filled."""


def damage(store: SqlStore, ids: list[int], **values: Any) -> None:
    with store.engine.begin() as conn:
        conn.execute(update(tasks).where(tasks.c.id.in_(ids)).values(**values))


def test_recovery_returns_every_chunk_and_quarantines_only_the_bad_rows(store: SqlStore) -> None:
    assert LIVE > 2 * CHUNK  # the chunk size the stream reads (not a guess of it)
    epoch = store.acquire_leadership()
    store.commit(epoch, BASE, [submit(i, key=f"k{i}") for i in range(1, LIVE + 1)])
    # The first row of the second chunk, two neighbours inside it, one in the last chunk.
    bad = [CHUNK + 1, CHUNK + CHUNK // 2, CHUNK + CHUNK // 2 + 1, 2 * CHUNK + 7]
    damage(store, bad, status="bogus")
    healthy = [i for i in range(1, LIVE + 1) if i not in bad]

    rec = store.recover(BASE)
    assert [int(t.id) for t in rec.tasks] == healthy
    quarantined = {int(t.id): t for t in rec.terminal}
    assert sorted(quarantined) == bad
    assert all(t.status is TaskStatus.FAILED for t in quarantined.values())
    assert all(quarantined[i].key == f"k{i}" for i in bad)
    assert rec.next_id == LIVE + 1

    # Marked failed in the store, keys released; a second recovery finds the same live set.
    for i in bad:
        row = store.get_task(ById(id=TaskId(i)))
        assert row is not None and row.status is TaskStatus.FAILED
    store.commit(epoch, BASE, [submit(LIVE + n, key=f"k{i}") for n, i in enumerate(bad, 1)])
    again = store.recover(BASE)
    assert [int(t.id) for t in again.tasks] == healthy + [LIVE + n for n in range(1, len(bad) + 1)]
    assert {int(t.id) for t in again.terminal} == set(bad)
