"""`AsyncSqlStore`: the store's asyncio face, on SQLAlchemy's `AsyncEngine`.

There is no second copy of SQL here. Every transaction body is a plain function of a sync
`Connection` made of the repository and lease functions `SqlStore` uses, run through
`AsyncConnection.run_sync` (SQLAlchemy drives the async driver underneath on a greenlet), and
every error is translated as `SqlStore` translates it. There is no second copy of leadership's
rules either: both faces drive `leadership`'s decisions, nor of the operations: both drive the
same `face` generators (`Steps`). What is left is what differs by nature: awaiting instead of
blocking, and a keeper that is an asyncio task instead of threads.

A store belongs to the event loop that first uses it; share it between that loop's tasks.
"""

from __future__ import annotations

__all__ = [
    "AsyncSqlStore",
    "LeadershipLostCallback",
    "async_url",
    "create_engine_for",
]

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Self, TypeVar

from sqlalchemy import URL, Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import AsyncAdaptedQueuePool

from . import dialects, execution, face, inbox, migrate
from .config import StoreConfig
from .durability import Durability
from .face import Face as _Face  # private here: the reference shows no internal base
from .face import Op, Outputs, Steps, engines, transactions
from .face.transactions import Commit
from .leadership import KeeperShell, Wait
from .model import InboxItem

if TYPE_CHECKING:
    from .model import Mutation, Recovered, TaskId, TaskRecord, TaskRef, TaskStatus, TimeBase

log = logging.getLogger(__name__)

T = TypeVar("T")

LeadershipLostCallback = Callable[[], object]
"""Called on leadership loss; a coroutine it returns is awaited."""


def async_url(target: str | os.PathLike[str] | URL) -> URL:
    """The async-driver URL for `target`: a bare path means a SQLite file (aiosqlite).

    Args:
        target: A URL (sync or async driver) or a SQLite file path.

    Returns:
        The URL with the async driver the store is tested with (aiosqlite, psycopg,
        asyncmy); an async driver named explicitly is kept.

    Raises:
        InvalidValue: A URL the store cannot parse or use.
    """
    url = engines.target_url(target, dialects.SQLiteImpl.async_driver or "")
    backend, _, driver = url.drivername.partition("+")
    impl = dialects.class_of(backend)  # each database's class names its drivers
    if impl.async_driver and (not driver or driver in impl.sync_drivers):
        return url.set(drivername=f"{backend}+{impl.async_driver}")
    return url  # an async driver named explicitly (asyncpg, aiomysql, ...) is kept


def create_engine_for(target: str | os.PathLike[str] | URL, config: StoreConfig) -> AsyncEngine:
    """An `AsyncEngine` set up as `SqlStore.open` sets up its engine (SQLite: same pragmas).

    Args:
        target: A URL or a SQLite file path (created 0600 if missing).
        config: Pool size and SQLite timeouts come from it.

    Returns:
        The engine; the caller disposes of it.

    Raises:
        InvalidValue: A URL the store cannot use.
        StoreError: Its async driver is not installed (the message says what to install).
    """
    # Named, not left to the dialect: SQLAlchemy before 2.0.38 gave aiosqlite files a NullPool,
    # which refuses pool_size (and would reconnect, pragmas and all, per use).
    return engines.new_engine(
        async_url(target),
        config,
        create_async_engine,
        lambda e: e.sync_engine,  # pool and transaction events live on the sync engine
        poolclass=AsyncAdaptedQueuePool,
    )


async def _wait(event: asyncio.Event, timeout: float | None) -> bool:
    """Whether `event` was set within `timeout` seconds (forever if None)."""
    if timeout is None:
        await event.wait()
        return True
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return event.is_set()
    return True


class AsyncKeeper(KeeperShell[Callable[[], Awaitable[bool]], Callable[[str], Awaitable[None]]]):
    """`store.Keeper`'s contract on an event loop, around `leadership.Keeping`'s decisions.

    One task awaits what the core decides: it starts each renewal (`renew()`: True renewed,
    False taken over, a `StoreError` a failed attempt, retried) as a task of its own, and awaits
    `lost(reason)` once the lease has not been renewed within `ttl` seconds of the START of the
    last successful renewal, on the monotonic clock. A renewal hung on a row lock or a dead
    connection cannot postpone stepping down (it is left to finish on its own). `lost` is
    awaited at most once; `stop` ends the keeper without calling it.
    """

    def _setup(self) -> None:
        self._guard = contextlib.nullcontext()  # one loop: no await inside, no interleaving
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._renewals: set[asyncio.Future[bool]] = set()

    def _wake(self) -> None:
        self._changed.set()

    def _start(self) -> None:
        renewal = asyncio.ensure_future(self._renew())
        self._renewals.add(renewal)  # kept referenced until it ends
        renewal.add_done_callback(self._settle)

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name=self._name)

    async def join(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` seconds for the keeper and a renewal in flight to end, as
        `store.Keeper.join` waits for its threads (a hung renewal may outlive it)."""
        waits: set[asyncio.Future[Any]] = set(self._renewals)
        if self._task is not None and self._task is not asyncio.current_task():
            waits.add(self._task)
        if waits:
            await asyncio.wait(waits, timeout=timeout)

    def _settle(self, renewal: asyncio.Future[bool]) -> None:
        """A renewal task ended (perhaps long after the keeper stopped): tell the core."""
        self._renewals.discard(renewal)
        result: bool | BaseException
        if renewal.cancelled():
            result = asyncio.CancelledError()
        else:
            result = renewal.exception() or renewal.result()
        if (note := self._ended(time.monotonic(), result)) is not None:
            log.log(*note)

    async def _watch(self) -> None:
        try:
            while isinstance(step := self._due(time.monotonic()), Wait):
                self._changed.clear()  # no await since `_due`: no event is missed
                await _wait(self._changed, step.until - time.monotonic())
            if step is None:
                return
            reason = step.reason
        except Exception as exc:
            # A keeper that died silently would leave its holder believing it leads.
            log.exception("the cronoq lease keeper failed")
            self._core.stop()
            reason = f"the lease keeper failed: {exc!r}"
        await self._lost(reason)


class AsyncSqlStore(_Face[AsyncEngine, AsyncKeeper, LeadershipLostCallback, AsyncConnection]):
    """`SqlStore`, awaitable: the durable state of one cronoq scheduler on an asyncio loop."""

    _log = log
    _new_flag = asyncio.Event
    _keeper_type = AsyncKeeper
    _lost: asyncio.Event
    _listener: inbox.AsyncListener | None

    def __init__(self, engine: AsyncEngine, config: StoreConfig | None = None) -> None:
        """Wrap an app's own engine (no I/O: call `migrate()` or use `open`)."""
        super().__init__(engine, config)
        self._listening = asyncio.Lock()  # one waiter at a time on the LISTEN connection

    def _new_listener(self) -> inbox.AsyncListener:
        return inbox.AsyncListener(self.engine)

    @classmethod
    async def open(
        cls,
        url_or_path: str | os.PathLike[str] | URL,
        config: StoreConfig | None = None,
        *,
        check_schema: bool = True,
    ) -> AsyncSqlStore:
        """Open a database (a bare path means a SQLite file), migrating it unless told not to.

        Sync URLs are accepted and mapped to their async drivers (see `async_url`). As
        `SqlStore.open`: with `StoreConfig.migrate` off, the schema must already stand at head,
        unless `check_schema=False` (tools that inspect or migrate a database at any revision).

        Args:
            url_or_path: A SQLAlchemy URL or a SQLite file path.
            config: How the store behaves; `StoreConfig()` when None.
            check_schema: With migration off, refuse a database not at head.

        Returns:
            A store that owns its engine (`close` disposes of it); it does not lead yet.

        Raises:
            InvalidValue: A URL or path the store cannot use.
            StoreError: A URL whose async driver is not installed.
            StoreUnavailable: The database cannot be reached.
            SchemaError: The schema is newer than this build, or (migration off) not at head.
            NotDurable: As `SqlStore.open`, with `StoreConfig.require_durable`.
        """
        config = config or StoreConfig()
        store = cls._owning(create_engine_for(url_or_path, config), config)
        await store._drive(store._opening(check_schema))
        return store

    async def read_durability(self) -> Durability:
        """As `SqlStore.read_durability`: what the server does with a commit (one round trip)."""
        return await self._drive(self._reading_durability())

    async def migrate(self) -> None:
        """Migrate the database to this build's schema (as `SqlStore.migrate`)."""
        schema = self.config.schema
        with face.translated():
            async with self._raw_engine.connect() as conn:
                await conn.run_sync(lambda c: migrate.upgrade(c, schema=schema))

    async def check_schema(self) -> None:
        """Refuse a database not at this build's head revision (as `SqlStore.check_schema`)."""
        schema = self.config.schema
        with face.translated():
            async with self._raw_engine.connect() as conn:
                await conn.execution_options(**{dialects.READ_ONLY: True})  # as SqlStore's
                await conn.run_sync(lambda c: migrate.require_head(c, schema=schema))

    async def close(self) -> None:
        """Stop leading (releasing the lease) and dispose of an engine this store created.

        Raises nothing: a lease that cannot be cleared is logged and left to expire.
        """
        if self._leadership.epoch is not None:
            await self.release_leadership()
        await self._stop_keeper()
        await self._close_held()
        if self._listener is not None:
            await self._listener.close()
        if self._owns_engine:
            await self._raw_engine.dispose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _transact(
        self, op: Op, fn: Callable[[Connection], T], *, deadline: timedelta | None = None
    ) -> T:
        """`face.Face._transact`, awaiting: the same `transactions.transaction` runs inside
        `run_sync`, on a sync-style connection."""
        tx = face.plan(op, self.config, deadline)
        bound = None if tx.deadline is None else tx.deadline.total_seconds()
        with face.translated(), execution.bounded(bound) as armed:
            async with self.engine.connect() as conn:
                return await conn.run_sync(transactions.transaction, fn, tx, armed)

    async def _transact_commit(self, c: Commit) -> None:
        """`face.Face._transact_commit`, awaiting (`transactions.commit` inside `run_sync`)."""
        commit, tx = transactions.commit, self._commit_tx
        try:
            with execution.bounded(self._commit_bound) as armed:
                if not self._holds:
                    async with self.engine.connect() as conn:
                        return await conn.run_sync(commit, c, tx, armed)
                conn = await self._held_connection()
                try:
                    await conn.run_sync(commit, c, tx, armed)
                except BaseException:
                    await conn.close()
                    raise
                if not self._keep_held(conn):
                    await conn.close()
        except transactions.DATABASE_ERRORS as exc:
            if (error := transactions.translate(exc)) is exc:
                raise
            raise error from exc
        return None

    async def _held_connection(self) -> AsyncConnection:
        held = self._take_held()
        if held is not None:
            conn, idle = held
            try:
                if not idle or await conn.run_sync(execution.still_there):
                    return conn
            except BaseException:
                await conn.close()
                raise
            await conn.close()
        return await self.engine.connect()

    async def _close_held(self, *, lost: bool = False) -> None:
        """Close the kept connection; after a loss (`lost`) without a word to the server,
        which may be cut off: a pool's reset of it (a ROLLBACK) would wait on the network."""
        if (conn := self._drop_held()) is not None:
            if lost:
                await conn.invalidate()
            await conn.close()

    _awaits = True

    async def _drive(self, steps: Steps[T], thrown: BaseException | None = None) -> T:
        """Drive `steps` awaiting (`face.Face._driving`)."""
        return await self._driving(steps, thrown)

    # Leadership.

    async def leadership_lost(self) -> None:
        """Return once leadership is lost (at once if this instance does not lead).

        Raises nothing: it only waits on this instance's own state.
        """
        await self._lost.wait()

    async def wait_leadership_lost(self, timeout: float | None = None) -> bool:
        """Wait until leadership is lost (as `SqlStore.wait_leadership_lost`)."""
        return await _wait(self._lost, timeout)

    async def acquire_leadership(self, timeout: float | None = None) -> int:
        """Wait until this instance leads; returns the new fencing epoch.

        As `SqlStore.acquire_leadership`: polls every `lock_poll`, backs off while the database
        cannot be reached; an instance that leads already steps down first and leads anew
        under the next epoch.
        """
        return await self._drive(self._acquiring(timeout))

    async def _sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def release_leadership(self) -> None:
        """Give leadership up; a waiting standby can take over at once.

        Raises nothing: a lease that cannot be cleared is logged and expires on its own.
        """
        await self._drive(self._releasing())

    # Commits and recovery.

    async def commit(
        self, epoch: int, base: TimeBase, batch: Sequence[Mutation], outputs: Outputs = ()
    ) -> None:
        """As `SqlStore.commit`: make `batch` durable in one transaction, or raise and write
        nothing; committing the same batch again changes nothing.
        """
        await self._drive(self._committing(epoch, base, batch, outputs))

    async def recover(self, base: TimeBase) -> Recovered:
        """Everything a new leader needs to resume (as `SqlStore.recover`)."""
        return await self._drive(self._recovering(base))

    async def prune(
        self,
        older_than: timedelta,
        *,
        batch_size: int | None = None,
        progress: Callable[[int], object] | None = None,
    ) -> int:
        """Delete finished tasks updated before `older_than` ago that no live task needs; on
        PostgreSQL then vacuum the task tables (as `SqlStore.prune`).
        """
        return await self._drive(self._pruning(older_than, batch_size, progress))

    # Queries.

    async def get_task(self, ref: TaskRef) -> TaskRecord | None:
        """A task by id, or the newest task with a key (as `SqlStore.get_task`)."""
        return await self._drive(self._getting(ref))

    async def list_finished(
        self,
        pools: Sequence[str] = (),
        statuses: Sequence[TaskStatus] = (),
        after: TaskId | None = None,
        limit: int = 100,
    ) -> list[TaskRecord]:
        """Finished tasks by id above `after` (as `SqlStore.list_finished`)."""
        return await self._drive(self._listing_finished(pools, statuses, after, limit))

    async def load_output(self, id: TaskId) -> bytes | None:
        """The output of a task that succeeded (as `SqlStore.load_output`)."""
        return await self._drive(self._loading_output(id))

    # The inbox (see `SqlStore.read_inbox`).

    async def read_inbox(
        self, limit: int = 1000, *, after: int | None = None, base: TimeBase = inbox.UNIX
    ) -> list[InboxItem]:
        """The oldest inbox items (above inbox id `after`), left in place (as
        `SqlStore.read_inbox`, which says how to take them).
        """
        return await self._drive(self._reading_inbox(limit, after, base))

    async def wait_inbox(self, timeout: float) -> bool:
        """Wait until the inbox holds an item, or `timeout` seconds (as `SqlStore.wait_inbox`)."""
        listener = self._listener
        if listener is not None and self._listening.locked():
            listener = None  # another task listens: poll
        async with contextlib.AsyncExitStack() as stack:
            if listener is not None:
                await stack.enter_async_context(self._listening)
            calls = inbox.waiting(
                lambda: self._transact("has_items", inbox.has_items),
                timeout,
                poll=self.config.inbox_poll.total_seconds(),
                listener=listener,
                sleep=asyncio.sleep,
            )
            return await inbox.run_calls_async(calls)

    async def release_lease_of(self, holder: str) -> bool:
        """Free the lease that `holder`, a process known to be dead, still holds (as
        `SqlStore.release_lease_of`).
        """
        return await self._drive(self._releasing_lease_of(holder))

    async def close_held_connection(self) -> None:
        """Close the connection a leader keeps from one commit to the next (as
        `SqlStore.close_held_connection`).

        Raises nothing: the pool's reset of the connection discards it on a failure.
        """
        await self._close_held()
