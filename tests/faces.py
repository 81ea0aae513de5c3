"""Both faces of the store behind one blocking interface, so that one test runs against each.

`Blocking` gives an `AsyncSqlStore` SqlStore's blocking interface by running each call on an
event loop in a thread of its own (so the async keeper keeps renewing between calls, as it
would in an app); `KeeperOnLoop` does the same for an `AsyncKeeper`. `FACES` parametrizes a
test over "sync" and "async".
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest
from sqlalchemy import URL, Connection, Engine, create_engine
from sqlalchemy.ext.asyncio import create_async_engine

from cronoq_store import SqlStore, StoreConfig, store
from cronoq_store.aio import AsyncKeeper, AsyncSqlStore, async_url

T = TypeVar("T")
CALL_TIMEOUT = 60.0
FACES = ["sync", "async"]
"""`SqlStore` (threads) and `AsyncSqlStore` (asyncio), driving the same leadership core."""

_loops = itertools.count()


class LoopThread:
    """An event loop running in a thread; `run` blocks the caller until a coroutine is done."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name=f"async-store-loop-{next(_loops)}"
        )
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(CALL_TIMEOUT)

    def call(self, fn: Callable[[], object]) -> None:
        """Call `fn` on the loop (a keeper belongs to its loop), without waiting."""
        self.loop.call_soon_threadsafe(fn)

    def close(self) -> None:
        """Let what still runs on the loop end first (an abandoned renewal, say: its driver's
        thread would otherwise report to a closed loop), then stop it."""

        async def settle() -> None:
            pending = asyncio.all_tasks() - {asyncio.current_task()}
            if pending:
                await asyncio.wait(pending, timeout=CALL_TIMEOUT / 2)

        self.run(settle())
        self.run(self.loop.shutdown_asyncgens())
        self.run(self.loop.shutdown_default_executor())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


class Blocking:
    """SqlStore's blocking interface over an `AsyncSqlStore`.

    `engine` is a plain sync engine on the same database, for the checks that inspect or damage
    rows behind the store's back; `sync_engine` is the store's own engine's sync side, for
    event hooks on the store's statements.
    """

    def __init__(self, store: AsyncSqlStore, loop: LoopThread, engine: Engine) -> None:
        self._store = store
        self._loop = loop
        self.engine = engine

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if inspect.iscoroutinefunction(attr):
            return lambda *args, **kwargs: self._loop.run(attr(*args, **kwargs))
        return attr

    @property
    def sync_engine(self) -> Engine:
        return self._store.engine.sync_engine


Store = SqlStore | Blocking


def open_face(face: str, url: URL, config: StoreConfig, cleanup: list[Callable[[], None]]) -> Any:
    """A store of `face` on `url`, its own engine and holder (and, async, its own loop);
    `cleanup` gets what closes it."""
    if face == "sync":
        store = SqlStore.open(url, config)
        cleanup.append(store.close)
        return store
    loop = LoopThread()
    sync_engine = create_engine(url)
    try:
        async_store = loop.run(AsyncSqlStore.open(url, config))
    except BaseException:
        sync_engine.dispose()
        loop.close()
        raise

    def close() -> None:
        try:
            loop.run(async_store.close())
        finally:
            sync_engine.dispose()
            loop.close()

    cleanup.append(close)
    return Blocking(async_store, loop, sync_engine)


def store_engine(store: Store) -> Engine:
    """The sync engine that runs the store's own statements (for event hooks)."""
    return store.sync_engine if isinstance(store, Blocking) else store.engine


def statement_thread(store: Store, caller: str) -> str:
    """The name of the thread that runs the store's statements for a call made from `caller`:
    the caller itself (sync), or the store's event loop (async)."""
    return store._loop.thread.name if isinstance(store, Blocking) else caller


def count_attempts(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The monotonic times of the store's attempts at the lease, from now on."""
    attempts: list[float] = []
    if isinstance(store, Blocking):
        inner = store._store
        take = inner._try_take

        async def counted_async(*args: Any) -> Any:
            attempts.append(time.monotonic())
            return await take(*args)

        monkeypatch.setattr(inner, "_try_take", counted_async)
    else:
        take_sync = store._try_take

        def counted(*args: Any) -> Any:
            attempts.append(time.monotonic())
            return take_sync(*args)

        monkeypatch.setattr(store, "_try_take", counted)
    return attempts


class KeeperOnLoop:
    """`store.Keeper`'s blocking interface over an `AsyncKeeper` on a loop thread of its own:
    `renew` runs in a worker thread (it may block), `lost` is called on the loop."""

    def __init__(
        self,
        *,
        renew: Callable[[], bool],
        lost: Callable[[str], None],
        every: float,
        ttl: float,
        renewed_at: float,
    ) -> None:
        self._loop = LoopThread()

        async def renew_async() -> bool:
            return await asyncio.to_thread(renew)

        async def lost_async(why: str) -> None:
            lost(why)

        async def make() -> AsyncKeeper:
            return AsyncKeeper(
                renew=renew_async, lost=lost_async, every=every, ttl=ttl, renewed_at=renewed_at
            )

        self._keeper = self._loop.run(make())

    def start(self) -> None:
        self._loop.call(self._keeper.start)

    def renewed(self, started: float) -> None:
        self._loop.call(lambda: self._keeper.renewed(started))

    def stop(self) -> None:
        self._loop.call(self._keeper.stop)

    def join(self, timeout: float | None = None) -> None:
        self._loop.run(self._keeper.join(timeout))
        self._loop.close()


def keeper(face: str, **kwargs: Any) -> Any:
    """A keeper of `face` (`store.Keeper` or `aio.AsyncKeeper`), with a blocking interface."""
    return store.Keeper(**kwargs) if face == "sync" else KeeperOnLoop(**kwargs)


def backend_pid(conn: Connection) -> int:
    """The PostgreSQL backend of a connection, sync or async driver alike."""
    pid: int = conn.connection.driver_connection.info.backend_pid  # type: ignore[union-attr]
    return pid


def wrap_engine(face: str, url: str, config: StoreConfig, cleanup: list[Callable[[], None]]) -> Any:
    """A store of `face` wrapping an app's engine on `url` (not opened: nothing is touched)."""
    if face == "sync":
        engine = create_engine(url)
        store = SqlStore(engine, config)
        cleanup.extend([engine.dispose, store.close])
        return store
    loop = LoopThread()

    async def make() -> AsyncSqlStore:
        return AsyncSqlStore(create_async_engine(async_url(url)), config)

    async_store = loop.run(make())

    async def close() -> None:
        await async_store.close()
        await async_store.engine.dispose()

    cleanup.extend([loop.close, lambda: loop.run(close())])
    return Blocking(async_store, loop, create_engine(url))


def transactions(face: str, url: URL) -> Iterator[Callable[[Callable[[Connection], T]], T]]:
    """A runner of one transaction per call, `fn(conn)` on a sync connection: on a sync engine,
    or on an async one through `run_sync` (as `AsyncSqlStore` runs the lease functions)."""
    if face == "sync":
        engine = create_engine(url)

        def run(fn: Callable[[Connection], T]) -> T:
            with engine.begin() as conn:
                return fn(conn)

        try:
            yield run
        finally:
            engine.dispose()
        return
    loop = LoopThread()
    async_engine = create_async_engine(async_url(url))

    async def run_async(fn: Callable[[Connection], T]) -> T:
        async with async_engine.begin() as conn:
            return await conn.run_sync(fn)

    try:
        yield lambda fn: loop.run(run_async(fn))
    finally:
        loop.run(async_engine.dispose())
        loop.close()
