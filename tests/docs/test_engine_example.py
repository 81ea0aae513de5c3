"""The engine loop of docs/engine.md (`cronoq_store.examples.engine`), run on every dialect:
inbox drain, dispatch, retries with backoff, a recurring schedule, prune, stepping down."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from builders import wait_until
from sqlalchemy import URL, Engine, update

import cronoq_store as cq
from cronoq_store.examples.engine import Engine as SchedulerEngine
from cronoq_store.examples.engine import Stats, next_fire
from cronoq_store.model import TimeBase
from cronoq_store.schema import leader

Running = tuple[cq.SqlStore, SchedulerEngine, threading.Event, list[Stats]]
CONFIG = cq.StoreConfig(lease_ttl=timedelta(seconds=3), lease_renew=timedelta(seconds=1))
FAST = cq.RetryPolicy(max_attempts=3, initial_backoff_ns=20_000_000, max_backoff_ns=50_000_000)


class Flaky:
    """Fails its first two attempts of each payload, then echoes it."""

    def __init__(self) -> None:
        self.seen: dict[bytes, int] = {}
        self.lock = threading.Lock()

    def __call__(self, payload: bytes) -> bytes:
        with self.lock:
            self.seen[payload] = self.seen.get(payload, 0) + 1
            if self.seen[payload] <= 2:
                raise ConnectionError(f"attempt {self.seen[payload]} refused")
        return payload.upper()


def always_fails(payload: bytes) -> bytes:
    raise ValueError("bad payload")


@pytest.fixture
def running(
    db_url: URL,
) -> Iterator[tuple[cq.SqlStore, SchedulerEngine, threading.Event, list[Stats]]]:
    store = cq.SqlStore.open(db_url, CONFIG)
    handlers = {"echo": lambda p: p, "flaky": Flaky(), "bad": always_fails}
    every = cq.RecurringSpec(
        name="tick", template=cq.TaskSpec(payload=b"tick", kind="echo"), interval_ns=150_000_000
    )
    engine = SchedulerEngine(
        store, handlers, workers=2, idle_wait=0.05, schedules=[every],
        prune_every=timedelta(seconds=0.2), retention=timedelta(hours=1),
    )  # fmt: skip
    stop = threading.Event()
    result: list[Stats] = []
    thread = threading.Thread(target=lambda: result.append(engine.run(stop, lead_timeout=30)))
    thread.start()
    try:
        yield store, engine, stop, result
    finally:
        stop.set()
        thread.join(30)
        store.close()
    assert not thread.is_alive()


def test_the_engine_runs_inbox_items_retries_and_schedules(
    running: Running, engine: Engine
) -> None:
    store, scheduler, stop, result = running
    with engine.begin() as conn:  # the app's own transaction
        cq.enqueue_many(
            conn,
            [
                cq.TaskSpec(payload=b"hello", kind="echo", key="greet"),
                cq.TaskSpec(payload=b"again", kind="echo", key="greet"),  # same key, one drain
                cq.TaskSpec(payload=b"retry me", kind="flaky", retry=FAST),
                cq.TaskSpec(payload=b"never", kind="bad", retry=cq.RetryPolicy(max_attempts=2,
                         initial_backoff_ns=1_000_000, max_backoff_ns=1_000_000)),
                cq.TaskSpec(payload=b"?", kind="unknown"),
            ],
        )  # fmt: skip

    def finished_kinds() -> dict[str, cq.TaskRecord]:
        found = {}
        for i in list(scheduler.stats.finished_ids):
            task = store.get_task(cq.ById(cq.TaskId(i)))
            if task is not None and task.kind != "echo":
                found[task.kind] = task
        return found

    def settled() -> bool:
        done = finished_kinds()
        return {"flaky", "bad", "unknown"} <= set(done) and scheduler.stats.fired >= 3

    wait_until(settled, "the inbox drained, the retries done, the schedule fired 3 times", 60)
    stop.set()
    wait_until(lambda: result, "the engine stepped down", 30)
    stats = result[0]
    assert stats.lost is None and not store.is_leader  # stopped: it released the lease
    assert stats.drained == 4 and stats.duplicates_dropped == 1 and not store.read_inbox()
    greet = store.get_task(cq.ByKey("greet"))  # the first of the two items with the key
    assert (
        greet is not None and greet.status is cq.TaskStatus.SUCCEEDED and greet.output == b"hello"
    )
    done = finished_kinds()
    flaky = done["flaky"]
    assert (flaky.status, flaky.attempt, flaky.output) == (cq.TaskStatus.SUCCEEDED, 3, b"RETRY ME")
    assert flaky.message == "ConnectionError: attempt 2 refused"  # the last retry's reason
    bad = done["bad"]
    assert (bad.status, bad.attempt, bad.message) == (
        cq.TaskStatus.FAILED, 2, "ValueError: bad payload"
    )  # fmt: skip
    assert done["unknown"].message == "no handler for kind 'unknown'"
    recovered = store.recover(TimeBase(0))
    (tick,) = recovered.recurring
    assert tick.next is not None and tick.last is not None
    fired = store.get_task(cq.ById(tick.last))
    assert (
        fired is not None and fired.kind == "echo" and tick.next > fired.updated.timestamp() * 1e9
    )


def test_a_new_term_recovers_and_a_fenced_engine_steps_down(
    running: Running,
    engine: Engine,
    db_url: URL,
) -> None:
    _, scheduler, _, result = running
    wait_until(lambda: scheduler.stats.fired >= 1, "the schedule fired", 30)
    epoch = scheduler.stats.epoch
    with engine.begin() as conn:  # another instance takes the lease, then lets it lapse
        conn.execute(update(leader).values(epoch=epoch + 1, holder="other", expires_unix_ns=0))
    wait_until(lambda: result, "the fenced engine stepped down", 30)
    assert result[0].lost is not None
    with cq.SqlStore.open(db_url, CONFIG) as other:
        again = SchedulerEngine(other, {"echo": lambda p: p}, idle_wait=0.05)
        stop2 = threading.Event()
        ran: list[Stats] = []
        thread = threading.Thread(target=lambda: ran.append(again.run(stop2, lead_timeout=30)))
        thread.start()
        try:
            wait_until(lambda: again.stats.fired >= 1, "the next leader fired the schedule", 30)
        finally:
            stop2.set()
            thread.join(30)
        assert ran and ran[0].epoch > epoch + 1 and ran[0].lost is None


def test_next_fire_of_intervals_and_calendars() -> None:
    base = TimeBase(unix_ns=1_767_225_600 * 10**9)  # 2026-01-01T00:00:00Z
    every = cq.RecurringSpec(name="i", template=cq.TaskSpec(payload=b""), interval_ns=10)
    assert next_fire(every, base, 0) == 10 and next_fire(every, base, 10) == 20
    nine = cq.RecurringSpec(
        name="c", template=cq.TaskSpec(payload=b""), cron="0 9 * * 1-5", timezone="Europe/Paris"
    )
    first = next_fire(nine, base, 0)  # Thursday 1 January 2026, 09:00 in Paris = 08:00 UTC
    assert first is not None and base.to_unix(first) == (1_767_225_600 + 8 * 3600) * 10**9
    july = TimeBase(unix_ns=1_782_864_000 * 10**9)  # Wednesday 1 July 2026, summer time
    summer = next_fire(nine, july, 0)  # 09:00 in Paris = 07:00 UTC
    assert summer is not None and july.to_unix(summer) == (1_782_864_000 + 7 * 3600) * 10**9
    bounded = cq.RecurringSpec(name="e", template=cq.TaskSpec(payload=b""), interval_ns=10, end=15)
    assert next_fire(bounded, base, 10) is None


def test_the_asyncio_engine_runs_the_same_loop(
    db_url: URL, engine: Engine, store: cq.SqlStore
) -> None:
    """`AsyncEngine`: the same core on `AsyncSqlStore`, attempts as asyncio tasks."""
    from cronoq_store.aio import AsyncSqlStore
    from cronoq_store.examples.aio_engine import AsyncEngine

    with engine.begin() as conn:
        cq.enqueue_many(
            conn,
            [
                cq.TaskSpec(payload=b"hello", kind="echo", key="a-greet"),
                cq.TaskSpec(payload=b"retry me", kind="flaky", retry=FAST),
            ],
        )
    failures: list[bytes] = []

    async def flaky(payload: bytes) -> bytes:
        if len(failures) < 2:
            failures.append(payload)
            raise ConnectionError(f"attempt {len(failures)} refused")
        return payload.upper()

    async def echo(payload: bytes) -> bytes:
        return payload

    every = cq.RecurringSpec(
        name="a-tick", template=cq.TaskSpec(payload=b"tick", kind="echo"), interval_ns=100_000_000
    )

    async def main() -> Stats:
        store = await AsyncSqlStore.open(db_url, CONFIG)
        try:
            scheduler = AsyncEngine(
                store, {"echo": echo, "flaky": flaky}, idle_wait=0.05, schedules=[every]
            )
            stop = asyncio.Event()
            run = asyncio.create_task(scheduler.run(stop, lead_timeout=30))
            deadline = time.monotonic() + 60
            while not (scheduler.stats.retried >= 2 and scheduler.stats.fired >= 2):
                assert time.monotonic() < deadline and not run.done(), scheduler.stats
                await asyncio.sleep(0.02)

            def flaky_live() -> bool:
                return any(t.spec.kind == "flaky" for t in list(scheduler.live.values()))

            while flaky_live() or scheduler.pending:
                assert time.monotonic() < deadline, scheduler.stats
                await asyncio.sleep(0.02)
            stop.set()
            return await asyncio.wait_for(run, 30)
        finally:
            await store.close()

    stats = asyncio.run(main())
    assert stats.lost is None and stats.drained == 2 and stats.retried == 2
    greet = store.get_task(cq.ByKey("a-greet"))  # `store` (migrated it) only reads
    assert greet is not None and greet.status is cq.TaskStatus.SUCCEEDED
    flaky_task = next(
        t
        for i in stats.finished_ids
        if (t := store.get_task(cq.ById(cq.TaskId(i)))) is not None and t.kind == "flaky"
    )
    assert (flaky_task.status, flaky_task.attempt, flaky_task.output) == (
        cq.TaskStatus.SUCCEEDED, 3, b"RETRY ME"
    )  # fmt: skip
    (tick,) = store.recover(TimeBase(0)).recurring
    assert tick.last is not None and store.get_task(cq.ById(tick.last)) is not None
