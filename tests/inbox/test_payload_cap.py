"""Payloads are capped (`StoreConfig.max_payload_bytes`, and enqueue's own argument), and a
drain's batch is bounded by bytes as well as by count (`StoreConfig.inbox_batch_bytes`), on
every dialect: refused before anything is written, set aside when an app wrote past the cap.
"""

from __future__ import annotations

import asyncio
import json

import builders
import pytest
from builders import BASE
from click.testing import CliRunner
from sqlalchemy import URL, func, select

from cronoq_store import (
    InboxTaken,
    InvalidValue,
    RecurringSpec,
    RecurringUpsert,
    SqlStore,
    StoreConfig,
    TaskSpec,
    enqueue,
    enqueue_many,
)
from cronoq_store import inbox as inbox_mod
from cronoq_store.aio import create_engine_for
from cronoq_store.cli import main
from cronoq_store.config import DEFAULT_MAX_PAYLOAD
from cronoq_store.inbox import enqueue_async
from cronoq_store.schema import inbox, inbox_rejects, tasks

CAP = 1024


def test_default_is_16_mib() -> None:
    assert StoreConfig().max_payload_bytes == DEFAULT_MAX_PAYLOAD == 16 * 2**20
    with pytest.raises(InvalidValue, match="max_payload_bytes"):
        StoreConfig(max_payload_bytes=0)
    with pytest.raises(InvalidValue, match="inbox_batch_bytes"):
        StoreConfig(inbox_batch_bytes=True)  # type: ignore[arg-type]


def count(store: SqlStore, table: object) -> int:
    with store.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(table)).scalar_one())  # type: ignore[arg-type]


def test_commit_refuses_a_payload_over_the_cap(db_url: URL) -> None:
    with SqlStore.open(db_url, StoreConfig(max_payload_bytes=CAP)) as store:
        epoch = store.acquire_leadership()
        store.commit(epoch, BASE, [builders.submit(1, b"x" * CAP)])  # at the cap: accepted
        with pytest.raises(InvalidValue, match=r"1025 bytes.*StoreConfig\.max_payload_bytes"):
            store.commit(epoch, BASE, [builders.submit(2), builders.submit(3, b"x" * (CAP + 1))])
        template = TaskSpec(payload=b"t" * (CAP + 1))
        sched = RecurringSpec(name="big", template=template, interval_ns=10**9)
        with pytest.raises(InvalidValue, match=r"StoreConfig\.max_payload_bytes"):
            store.commit(epoch, BASE, [RecurringUpsert(spec=sched)])
        assert count(store, tasks) == 1  # the refused batches wrote nothing
        store.commit(epoch, BASE, [builders.submit(2)])  # and the leader commits on


def test_enqueue_refuses_a_payload_over_the_cap(db_url: URL) -> None:
    with SqlStore.open(db_url) as store:
        with store.engine.begin() as conn:
            with pytest.raises(InvalidValue, match=r"max_payload_bytes"):
                enqueue(conn, TaskSpec(payload=b"x" * (DEFAULT_MAX_PAYLOAD + 1)))
            with pytest.raises(InvalidValue, match=r"1025 bytes.*max_payload_bytes"):
                enqueue_many(
                    conn,
                    [TaskSpec(payload=b"ok"), TaskSpec(payload=b"x" * (CAP + 1))],
                    max_payload_bytes=CAP,
                )
            enqueue(conn, TaskSpec(payload=b"x" * CAP), max_payload_bytes=CAP)
        assert count(store, inbox) == 1  # the refused call wrote nothing


def test_enqueue_async_refuses_a_payload_over_the_cap(db_url: URL) -> None:
    async def attempt() -> None:
        engine = create_engine_for(db_url, StoreConfig())
        try:
            async with engine.begin() as conn:
                with pytest.raises(InvalidValue, match="max_payload_bytes"):
                    await enqueue_async(
                        conn, TaskSpec(payload=b"x" * (CAP + 1)), max_payload_bytes=CAP
                    )
        finally:
            await engine.dispose()

    with SqlStore.open(db_url):
        asyncio.run(attempt())


def test_an_item_over_the_stores_cap_is_set_aside(db_url: URL) -> None:
    """An app that enqueued past the store's cap (its own argument larger) blocks no drain:
    the leader sets the item aside, naming the setting, and delivers the rest."""
    with SqlStore.open(db_url, StoreConfig(max_payload_bytes=CAP)) as store:
        with store.engine.begin() as conn:
            enqueue(conn, TaskSpec(payload=b"a"))
            enqueue(conn, TaskSpec(payload=b"x" * (CAP + 1)), max_payload_bytes=None)
            enqueue(conn, TaskSpec(payload=b"c"))
        epoch = store.acquire_leadership()
        items = store.read_inbox()
        assert [i.spec.payload for i in items] == [b"a", b"c"]
        assert store.inbox_rejected == 1
        store.commit(epoch, BASE, [InboxTaken(inbox_id=i.inbox_id) for i in items])
        with store.engine.connect() as conn:
            reason = conn.execute(select(inbox_rejects.c.reason)).scalar_one()
        assert "StoreConfig.max_payload_bytes" in reason
    # The operator's listing shows sizes, which the database computes (no payload is read).
    argv = ["--url", db_url.render_as_string(hide_password=False), "inbox", "--json"]
    listing = json.loads(CliRunner().invoke(main, argv, catch_exceptions=False).stdout)
    assert [r["payload_size"] for r in listing["rejects"]] == [CAP + 1]
    statement = str(inbox_mod.sized(inbox_mod.rejects_stmt()))
    assert "length(" in statement.lower() and ".payload," not in statement


def test_a_drain_is_bounded_by_bytes(db_url: URL) -> None:
    """10 items of 3000 bytes, a budget of 10,000: each read returns the items that start
    within the budget (4: 12,000 bytes, at most the budget plus one payload), whatever its
    `limit`; an item larger than the whole budget still comes."""
    config = StoreConfig(inbox_batch_bytes=10_000)
    with SqlStore.open(db_url, config) as store:
        with store.engine.begin() as conn:
            enqueue_many(conn, [TaskSpec(payload=bytes([i]) * 3000) for i in range(10)])
            enqueue(conn, TaskSpec(payload=b"B" * 20_000))
            enqueue(conn, TaskSpec(payload=b"z"))
        epoch = store.acquire_leadership()
        sizes: list[list[int]] = []
        while items := store.read_inbox(limit=1000):
            sizes.append([len(i.spec.payload) for i in items])
            store.commit(epoch, BASE, [InboxTaken(inbox_id=i.inbox_id) for i in items])
        assert sizes == [[3000] * 4, [3000] * 4, [3000, 3000, 20_000], [1]]
        assert store.read_inbox(limit=2) == []


def test_a_budget_past_32_bits(db_url: URL) -> None:
    """A budget of a TiB is a 64-bit parameter on every dialect (not PostgreSQL's INTEGER)."""
    with SqlStore.open(db_url, StoreConfig(inbox_batch_bytes=2**40)) as store:
        with store.engine.begin() as conn:
            enqueue_many(conn, [TaskSpec(payload=b"x"), TaskSpec(payload=b"y")])
        store.acquire_leadership()
        assert [i.spec.payload for i in store.read_inbox()] == [b"x", b"y"]


def test_both_budgeted_reads_take_the_same_rows(db_url: URL) -> None:
    """The budgeted read as a key range up to the last id within the budget (where the planner
    ranges by a subquery) and as lookups of each id within it read the same rows, whatever
    `after`, `limit` and the budget; an empty inbox above `after` reads none."""
    sizes = [100 * (i % 4) for i in range(12)]
    with SqlStore.open(db_url) as store:
        with store.engine.begin() as conn:
            enqueue_many(conn, [TaskSpec(payload=bytes([i]) * n) for i, n in enumerate(sizes)])
            ids = conn.execute(select(inbox.c.id).order_by(inbox.c.id)).scalars().all()
        size_of = dict(zip(ids, sizes, strict=True))
        cases = [
            (after, limit, budget)
            for after in (None, ids[0], ids[5], ids[-1])
            for limit in (1, 3, 1000)
            for budget in (1, 250, 600, 2**40)
        ]
        with store.engine.connect() as conn:
            for after, limit, budget in cases:
                params = {"limit": limit, "budget": budget}
                if after is not None:
                    params["after"] = after
                got = [
                    conn.execute(
                        inbox_mod.oldest_stmt(after=after is not None, budget=True, ranged=r),
                        params,
                    )
                    .scalars()
                    .all()
                    for r in (True, False)
                ]
                want, before = [], 0
                for i in [i for i in ids if after is None or i > after][:limit]:
                    if before >= budget:
                        break
                    want.append(i)
                    before += size_of[i]
                assert got[0] == got[1] == want, (after, limit, budget)
