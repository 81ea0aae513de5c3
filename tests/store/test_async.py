"""`AsyncSqlStore` on every dialect: SqlStore's own behaviour checks, then what only async has.

The checks of test_store.py run unchanged against the async store through `faces.Blocking`,
which gives it SqlStore's blocking interface by running each call on an event loop in a thread
(so the async keeper keeps renewing between calls, as it would in an app); test_leadership.py
runs every leadership test on both faces the same way. pytest-asyncio is not needed: the
async-only tests drive their coroutine with `asyncio.run`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import test_store as sync_checks
from builders import BASE, no_connection_left, status, submit
from faces import Blocking, open_face
from sqlalchemy import URL, create_engine, update
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import AsyncAdaptedQueuePool, NullPool, Pool

import cronoq_store as cq
from cronoq_store.aio import AsyncKeeper, AsyncSqlStore, async_url
from cronoq_store.schema import leader

SLACK = 1.5
"""What a deadline may be overshot by on a loaded machine (a wake-up, a slow round trip)."""


@pytest.fixture
def blocking(
    db_url: URL, store_config: cq.StoreConfig, cleanup: list[Callable[[], None]]
) -> Iterator[Blocking]:
    """The async store, opened as `store` is, behind SqlStore's blocking interface."""
    store: Blocking = open_face("async", db_url, store_config, cleanup)
    yield store
    no_connection_left(store, store.sync_engine)


SHARED_CHECKS = [
    sync_checks.test_commit_recover_query,
    sync_checks.test_duplicate_live_key_writes_nothing,
    sync_checks.test_over_long_key_refused,
    sync_checks.test_fenced_after_takeover,
    sync_checks.test_prune,
    sync_checks.test_quarantine_damaged_rows,
    sync_checks.test_list_finished_pages_each_once,
    sync_checks.test_strings_are_cleaned,
    sync_checks.test_dependency_rows_live_only_while_their_task_does,
    sync_checks.test_16_mib_payload_round_trips,
]


@pytest.mark.parametrize(
    "check", SHARED_CHECKS, ids=[c.__name__.removeprefix("test_") for c in SHARED_CHECKS]
)
def test_sync_store_checks(check: Callable[..., None], blocking: Blocking, db_url: URL) -> None:
    """The same behaviour checks as SqlStore's, unchanged, on the async store."""
    available = {"store": blocking, "db_url": db_url}
    check(**{name: available[name] for name in inspect.signature(check).parameters})


# What only the async face has, or what it must do with the sync store beside it.


def done(i: int, st: cq.TaskStatus = cq.TaskStatus.SUCCEEDED) -> cq.StatusChanged:
    return status(i, st, f"m{i}")


def fast_lease(renew: float = 0.2, ttl: float = 1.0) -> cq.StoreConfig:
    return cq.StoreConfig(
        lease_ttl=timedelta(seconds=ttl),
        lease_renew=timedelta(seconds=renew),
        lock_poll=timedelta(milliseconds=100),
    )


def expire_lease(db_url: URL) -> None:
    """As if the leader had been paused past its lease: a standby may take over now."""
    engine = create_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(update(leader).values(expires_unix_ns=0))
    finally:
        engine.dispose()


def test_idempotent_commit_and_concurrent_batches(db_url: URL) -> None:
    async def main() -> None:
        async with await AsyncSqlStore.open(db_url) as store:
            epoch = await store.acquire_leadership()
            batch = [submit(1, key="k"), done(1), submit(2, key="k")]
            await store.commit(epoch, BASE, batch, outputs=[(cq.TaskId(1), b"out")])
            first = await store.recover(BASE)
            await store.commit(epoch, BASE, batch, outputs=[(cq.TaskId(1), b"out")])
            assert await store.recover(BASE) == first
            assert await store.load_output(cq.TaskId(1)) == b"out"
            # More concurrent commits than the pool has connections: each waits its turn.
            await asyncio.gather(
                *(store.commit(epoch, BASE, [submit(i), done(i)]) for i in range(10, 30))
            )
            page = await store.list_finished(after=cq.TaskId(9), limit=100)
            assert [r.id for r in page] == list(range(10, 30))
            newest = await store.get_task(cq.ByKey(key="k"))
            assert newest is not None and newest.id == 2 and newest.status is cq.TaskStatus.QUEUED

    asyncio.run(main())


def test_leadership_loss_fires_when_a_sync_store_takes_over(db_url: URL) -> None:
    """A paused async leader's keeper notices the takeover: the awaitable and callback fire."""

    async def main() -> None:
        async with await AsyncSqlStore.open(db_url, fast_lease()) as store:
            calls: list[str] = []

            async def async_callback() -> None:
                calls.append("async")

            store.on_leadership_lost(lambda: calls.append("sync"))
            store.on_leadership_lost(async_callback)
            epoch = await store.acquire_leadership()
            assert store.is_leader and not await store.wait_leadership_lost(0.05)
            # Block the loop (a paused process): the keeper cannot renew, the lease runs out
            # on the database's clock and a sync store takes over.
            with cq.SqlStore.open(db_url, fast_lease()) as thief:
                assert thief.acquire_leadership(timeout=10) == epoch + 1
                await asyncio.wait_for(store.leadership_lost(), 5)
                assert calls == ["sync", "async"]
                assert (store.is_leader, store.epoch) == (False, None)
                with pytest.raises(cq.Fenced):
                    await store.commit(epoch, BASE, [submit(1)])
                thief.commit(epoch + 1, BASE, [submit(2)])
            assert await store.get_task(cq.ById(id=cq.TaskId(1))) is None
            assert await store.get_task(cq.ById(id=cq.TaskId(2))) is not None
            # Leading again after the thief released.
            assert await store.acquire_leadership(timeout=5) == epoch + 2
            assert calls == ["sync", "async"]

    asyncio.run(main())


def test_fence_check_refuses_a_commit_after_takeover(db_url: URL) -> None:
    """The database's fence, not the local flag, stops a leader that has not noticed yet."""

    async def main() -> None:
        # The keeper renews every 5 s: it cannot notice within this test.
        async with await AsyncSqlStore.open(db_url, fast_lease(renew=5, ttl=10)) as store:
            lost: list[bool] = []
            store.on_leadership_lost(lambda: lost.append(True))
            epoch = await store.acquire_leadership()
            await store.commit(epoch, BASE, [submit(1)])
            await asyncio.to_thread(expire_lease, db_url)
            with cq.SqlStore.open(db_url) as thief:
                assert await asyncio.to_thread(thief.acquire_leadership, 5) == epoch + 1
                assert store.is_leader  # not noticed yet
                with pytest.raises(cq.Fenced, match="fenced off"):
                    await store.commit(epoch, BASE, [done(1), submit(2)])
                assert lost == [True] and await store.wait_leadership_lost(0)
                thief.release_leadership()
            one = await store.get_task(cq.ById(id=cq.TaskId(1)))
            assert one is not None and one.status is cq.TaskStatus.QUEUED
            assert await store.get_task(cq.ById(id=cq.TaskId(2))) is None

    asyncio.run(main())


def hold_lease_row(db_url: URL, seconds: float, held: threading.Event) -> None:
    """Lock the lease row (SQLite: the whole database) for `seconds`, as a stuck writer would."""
    engine = create_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(update(leader).where(leader.c.id == 1).values(epoch=leader.c.epoch))
            held.set()
            time.sleep(seconds)
    finally:
        engine.dispose()


def test_steps_down_on_time_while_a_renewal_hangs(
    db_url: URL, caplog: pytest.LogCaptureFixture
) -> None:
    """A renewal stuck behind a lock cannot postpone stepping down past the TTL."""

    async def main() -> None:
        async with await AsyncSqlStore.open(db_url, fast_lease(renew=0.2, ttl=1.0)) as store:
            epoch = await store.acquire_leadership()
            taken = time.monotonic()
            held = threading.Event()
            blocker = threading.Thread(target=hold_lease_row, args=(db_url, 2.0, held))
            blocker.start()
            try:
                await asyncio.to_thread(held.wait, 5)
                assert await store.wait_leadership_lost(3)
                assert time.monotonic() - taken < 1.0 + 0.5
                assert "within its TTL (1 s): a renewal hung" in caplog.text
                with pytest.raises(cq.Fenced):
                    await store.commit(epoch, BASE, [submit(1)])
            finally:
                await asyncio.to_thread(blocker.join)
        # The abandoned renewal finished once the lock went; nothing was left checked out.

    asyncio.run(main())


def test_standby_waits_then_takes_over_on_release(db_url: URL) -> None:
    async def main() -> None:
        async with (
            await AsyncSqlStore.open(db_url, fast_lease()) as first,
            await AsyncSqlStore.open(db_url, fast_lease()) as second,
        ):
            epoch = await first.acquire_leadership()
            with pytest.raises(cq.StoreUnavailable, match="holds the lease"):
                await second.acquire_leadership(timeout=0.5)  # renewed meanwhile: held
            assert first.is_leader
            # The standby is waiting (it found the lease held) when the leader lets go.
            held = asyncio.Event()
            attempt = second._try_take

            async def attempted(*args: Any) -> Any:
                taken = await attempt(*args)
                if taken is None:
                    held.set()
                return taken

            second._try_take = attempted  # type: ignore[method-assign]
            standby = asyncio.create_task(second.acquire_leadership(timeout=5))
            await asyncio.wait_for(held.wait(), 5)
            await first.release_leadership()
            assert await standby == epoch + 1
            assert await first.wait_leadership_lost(0)
            with pytest.raises(cq.Fenced):
                await first.commit(epoch, BASE, [submit(1)])

    asyncio.run(main())


@pytest.mark.parametrize("poolclass", [AsyncAdaptedQueuePool, NullPool])
def test_wraps_an_app_engine(db_url: URL, poolclass: type[Pool]) -> None:
    """Whichever pool the app chose (SQLAlchemy before 2.0.38 gives aiosqlite files NullPool)."""

    async def main() -> None:
        engine = create_async_engine(async_url(db_url), poolclass=poolclass)
        try:
            store = AsyncSqlStore(engine)
            await store.migrate()
            await store.migrate()  # idempotent
            async with store:
                epoch = await store.acquire_leadership()
                await store.commit(epoch, BASE, [submit(1, key="a")])
                with pytest.raises(cq.StoreError, match="conflicts"):
                    await store.commit(epoch, BASE, [submit(2, key="a")])
            if isinstance(engine.sync_engine.pool, AsyncAdaptedQueuePool):
                assert engine.sync_engine.pool.checkedout() == 0
        finally:
            await engine.dispose()

    asyncio.run(main())


def test_urls_map_to_async_drivers(tmp_path: Path) -> None:
    assert str(async_url(tmp_path / "a.db")) == f"sqlite+aiosqlite:///{tmp_path / 'a.db'}"
    assert async_url("sqlite:///x.db").drivername == "sqlite+aiosqlite"
    assert async_url("postgresql://u@h/d").drivername == "postgresql+psycopg"
    assert async_url("postgresql+psycopg://u@h/d").drivername == "postgresql+psycopg"
    assert async_url("mysql://u@h/d").drivername == "mysql+asyncmy"
    assert async_url("mysql+pymysql://u@h/d?charset=utf8mb4").query == {"charset": "utf8mb4"}
    assert async_url("mariadb+pymysql://u@h/d").drivername == "mariadb+asyncmy"
    assert async_url("mysql+aiomysql://u@h/d").drivername == "mysql+aiomysql"
    assert async_url("postgresql+asyncpg://u@h/d").drivername == "postgresql+asyncpg"
    for path in ("", ":memory:", "file:x.db"):
        with pytest.raises(cq.InvalidValue):
            async_url(path)
    with pytest.raises(cq.StoreError) as info:  # no async face (and not installed here)
        asyncio.run(AsyncSqlStore.open("postgresql+pg8000://u:secret@h/d"))
    assert "secret" not in str(info.value)


@pytest.mark.parametrize(
    "url", ["postgresql://postgres:secret@127.0.0.1:1/x", "mysql://root:secret@127.0.0.1:1/x"]
)
def test_unreachable_server_is_unavailable(url: str) -> None:
    with pytest.raises(cq.StoreUnavailable) as info:
        asyncio.run(AsyncSqlStore.open(url))
    assert "secret" not in str(info.value)


@pytest.mark.postgresql
@pytest.mark.parametrize("dialect", ["postgresql"])
def test_tables_in_a_postgresql_schema(db_url: URL) -> None:
    async def main() -> None:
        config = cq.StoreConfig(schema="cronoq")
        async with await AsyncSqlStore.open(db_url, config) as store:
            epoch = await store.acquire_leadership()
            await store.commit(epoch, BASE, [submit(1, key="a")])
            assert (await store.recover(BASE)).next_id == 2
        with cq.SqlStore.open(db_url, config) as same:  # the sync face sees the same rows
            one = same.get_task(cq.ByKey(key="a"))
            assert one is not None and one.id == 1

    asyncio.run(main())


def test_keeper_retries_then_steps_down_by_its_deadline() -> None:
    """`AsyncKeeper` against fake renewals: a failure is retried, a hang or a streak is not."""

    async def run(outcomes: list[str], seconds: float) -> tuple[list[str], float | None]:
        """The keeper's step-downs within `seconds` (it stops at the first) and when."""
        lost: list[str] = []
        started = time.monotonic()
        when: list[float] = []
        stepped_down = asyncio.Event()

        async def renew() -> bool:
            outcome = outcomes.pop(0) if outcomes else "ok"
            if outcome == "fail":
                raise cq.StoreUnavailable("down")
            if outcome == "hang":
                await asyncio.sleep(10)
            return outcome == "ok"

        async def on_lost(why: str) -> None:
            lost.append(why)
            when.append(time.monotonic() - started)
            stepped_down.set()

        keeper = AsyncKeeper(
            renew=renew, lost=on_lost, every=0.05, ttl=0.2, renewed_at=started, name="test"
        )
        keeper.start()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stepped_down.wait(), seconds)
        keeper.stop()
        await keeper.join(1)
        return lost, (when[0] if when else None)

    async def main() -> None:
        # One failure among successes: still leading, past two TTLs; stop reports nothing.
        assert await run(["ok", "fail", "ok"], 0.5) == ([], None)
        # Taken over: at once, not at the deadline (the reason says which).
        lost, _ = await run(["ok", "taken"], 0.2 + SLACK)
        assert lost == ["the lease was taken over"]
        # Never before the deadline (the TTL after the last renewal's start), and then
        # within what a loaded machine adds to a wake-up.
        lost, at = await run(["fail"] * 1000, 0.2 + SLACK)
        assert lost == ["the lease was not renewed within its TTL (0.2 s): down"]
        assert at is not None and 0.2 <= at < 0.2 + SLACK
        lost, at = await run(["hang"], 0.2 + SLACK)
        assert lost == ["the lease was not renewed within its TTL (0.2 s): a renewal hung"]
        assert at is not None and 0.2 <= at < 0.2 + SLACK

    asyncio.run(main())
