"""`AsyncSqlStore`: the store's asyncio face, on SQLAlchemy's `AsyncEngine`.

There is no second copy of SQL here. Every transaction body is a plain function of a sync
`Connection` made of the repository and lease functions `SqlStore` uses, run through
`AsyncConnection.run_sync` (SQLAlchemy drives the async driver underneath on a greenlet), and
every error is translated as `SqlStore` translates it. What is left is what differs by nature:
awaiting instead of blocking, and a keeper that is an asyncio task instead of a thread.

A store belongs to the event loop that first uses it; share it between that loop's tasks.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from types import TracebackType
from typing import Final, Self, TypeVar

from sqlalchemy import URL, Connection, make_url
from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import AsyncAdaptedQueuePool

from . import dialects, lease, migrate, repository
from .errors import Fenced, InvalidValue, StoreError, StoreUnavailable
from .model import (
    ById,
    ByKey,
    Mutation,
    Recovered,
    TaskId,
    TaskRecord,
    TaskRef,
    TaskStatus,
    TimeBase,
)
from .store import (
    MAX_RETRY_DELAY,
    StoreConfig,
    _create_private,
    _ns,
    _sqlite_path,
    commit_work,
    sqlite_file,
    translated,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

ASYNC_DRIVERS: Final = {
    "sqlite": "aiosqlite",
    "postgresql": "psycopg",
    "mysql": "asyncmy",
    "mariadb": "asyncmy",
}
"""The async driver each backend gets when a URL names none, or names its sync counterpart."""
SYNC_DRIVERS: Final = {
    "sqlite": frozenset({"pysqlite"}),
    "postgresql": frozenset({"psycopg", "psycopg2"}),
    "mysql": frozenset({"pymysql"}),
    "mariadb": frozenset({"pymysql"}),
}
"""Sync drivers whose URLs (query options included) their async counterparts also accept."""

LeadershipLostCallback = Callable[[], object]
"""Called on leadership loss; a coroutine it returns is awaited."""


# Engine-independent parts: they mirror `SqlStore`'s and belong in store.py, shared by both faces.


def async_url(target: str | os.PathLike[str] | URL) -> URL:
    """The async-driver URL for `target`: a bare path means a SQLite file (aiosqlite)."""
    if isinstance(target, os.PathLike) or (isinstance(target, str) and "://" not in target):
        return make_url("sqlite+aiosqlite://").set(database=str(_sqlite_path(os.fspath(target))))
    url = target if isinstance(target, URL) else dialects.parse_url(target)
    backend, _, driver = url.drivername.partition("+")
    if backend in ASYNC_DRIVERS and (not driver or driver in SYNC_DRIVERS[backend]):
        return url.set(drivername=f"{backend}+{ASYNC_DRIVERS[backend]}")
    return url  # an async driver named explicitly (asyncpg, aiomysql, ...) is kept


def create_engine_for(target: str | os.PathLike[str] | URL, config: StoreConfig) -> AsyncEngine:
    """An `AsyncEngine` set up as `SqlStore.open` sets up its engine (SQLite: same pragmas)."""
    url = async_url(target)
    try:
        if url.get_backend_name() == "sqlite":
            path = sqlite_file(url)
            _create_private(path)
            # Named, not left to the dialect: SQLAlchemy before 2.0.38 gave aiosqlite files a
            # NullPool, which refuses pool_size (and would reconnect, pragmas and all, per use).
            engine = create_async_engine(
                url,
                poolclass=AsyncAdaptedQueuePool,
                pool_size=config.pool_size,
                max_overflow=0,
                hide_parameters=True,
            )
            # Pool and transaction events live on the sync engine the async one proxies.
            dialects.configure_sqlite(
                engine.sync_engine, full_sync=config.full_sync, busy_timeout=config.busy_timeout
            )
            return engine
        return create_async_engine(
            url, pool_size=config.pool_size, pool_pre_ping=True, hide_parameters=True
        )
    except sa_exc.InvalidRequestError as exc:  # a sync driver asyncio cannot drive
        raise StoreError(
            dialects.redact(f"{url.drivername!r} is not an async driver: {exc}")
        ) from exc
    except (sa_exc.ArgumentError, ImportError) as exc:
        raise StoreError(dialects.redact(f"bad database URL: {exc}")) from exc


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


class AsyncKeeper:
    """`lease.Keeper`'s contract on an event loop: keeps one lease alive from one task.

    Every `every` seconds it awaits `renew()`: True means renewed, False that the lease was taken
    over, a `StoreError` a failed attempt (retried). It calls `lost(reason)` once the lease has
    not been renewed within `ttl` seconds of the START of the last successful renewal, on the
    monotonic clock: the wait for each renewal is bounded by that deadline, so a renewal hung on
    a row lock or a dead connection cannot postpone stepping down (it is left to finish on its
    own). `lost` is awaited at most once; `stop` ends the keeper without calling it.
    """

    def __init__(
        self,
        *,
        renew: Callable[[], Awaitable[bool]],
        lost: Callable[[str], Awaitable[None]],
        every: float,
        ttl: float,
        renewed_at: float,
        name: str = "cronoq-lease-keeper",
    ) -> None:
        """`renewed_at`: the monotonic time at which the lease was taken (or last renewed)."""
        self._renew = renew
        self._lost = lost
        self._every = every
        self._ttl = ttl
        self._deadline = renewed_at + ttl
        self._name = name
        self._stopped = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._abandoned: set[asyncio.Future[bool]] = set()

    @property
    def deadline(self) -> float:
        """The monotonic time at which the holder steps down unless renewed before."""
        return self._deadline

    def start(self) -> None:
        self._task = asyncio.create_task(self._keep(), name=self._name)

    def stop(self) -> None:
        """Stop renewing, without reporting a loss; returns at once."""
        self._stopped.set()

    async def join(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` seconds for the keeper to end (a hung renewal may outlive it)."""
        task = self._task
        if task is not None and task is not asyncio.current_task():
            await asyncio.wait({task}, timeout=timeout)

    async def _finish(self, why: str) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        await self._lost(why)

    def _abandon(self, renewal: asyncio.Future[bool]) -> None:
        """Let a hung renewal finish on its own, keeping a reference and consuming its error."""
        self._abandoned.add(renewal)

        def done(f: asyncio.Future[bool]) -> None:
            self._abandoned.discard(f)
            if not f.cancelled() and f.exception() is not None:
                log.warning("an abandoned cronoq lease renewal failed: %s", f.exception())

        renewal.add_done_callback(done)

    async def _keep(self) -> None:
        stopper = asyncio.ensure_future(self._stopped.wait())
        failure = ""
        try:
            while True:
                left = self._deadline - time.monotonic()
                if left <= 0:
                    await self._finish(f"could not renew the lease within its TTL{failure}")
                    return
                if await _wait(self._stopped, min(self._every, left)):
                    return
                if self._deadline <= time.monotonic():
                    continue  # waited out the deadline after failed renewals
                started = time.monotonic()
                renewal = asyncio.ensure_future(self._renew())
                await asyncio.wait(
                    {renewal, stopper},
                    timeout=self._deadline - started,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if not renewal.done():
                    self._abandon(renewal)
                    failure = ": a renewal hung"
                    continue  # stopped (the loop ends) or past the deadline (steps down)
                error = renewal.exception()
                if isinstance(error, StoreError):
                    log.warning("renewing the cronoq lease failed, retrying: %s", error)
                    failure = f": {error}"
                    continue
                if error is not None:
                    log.error("renewing the cronoq lease failed unexpectedly, retrying: %r", error)
                    failure = f": {error!r}"
                    continue
                if not renewal.result():
                    await self._finish("the lease was taken over")
                    return
                failure = ""
                self._deadline = max(self._deadline, started + self._ttl)
        except Exception as exc:
            # A keeper that died silently would leave its holder believing it leads.
            log.exception("the cronoq lease keeper failed")
            await self._finish(f"the lease keeper failed: {exc!r}")
        finally:
            stopper.cancel()


class AsyncSqlStore:
    """`SqlStore`, awaitable: the durable state of one cronoq scheduler on an asyncio loop."""

    def __init__(self, engine: AsyncEngine, config: StoreConfig | None = None) -> None:
        """Wrap an app's own engine (no I/O: call `migrate()` or use `open`)."""
        self.config = config or StoreConfig()
        self._owns_engine = False
        self._raw_engine = engine
        self.engine = (
            engine.execution_options(schema_translate_map={None: self.config.schema})
            if self.config.schema
            else engine
        )
        self.holder = lease.new_holder()
        self._epoch: int | None = None
        self._lost = asyncio.Event()
        self._lost.set()
        self._keeper: AsyncKeeper | None = None
        self._callbacks: list[LeadershipLostCallback] = []

    @classmethod
    async def open(
        cls, url_or_path: str | os.PathLike[str] | URL, config: StoreConfig | None = None
    ) -> AsyncSqlStore:
        """Open a database (a bare path means a SQLite file), migrating it unless told not to.

        Sync URLs are accepted and mapped to their async drivers (see `async_url`).
        """
        config = config or StoreConfig()
        engine = create_engine_for(url_or_path, config)
        store = cls(engine, config)
        store._owns_engine = True
        try:
            if config.migrate:
                await store.migrate()
        except BaseException:
            await engine.dispose()
            raise
        return store

    async def migrate(self) -> None:
        """Migrate the database to this build's schema (idempotent; safe from many processes)."""
        schema = self.config.schema
        with translated():
            async with self._raw_engine.connect() as conn:
                await conn.run_sync(lambda c: migrate.upgrade(c, schema=schema))

    async def close(self) -> None:
        """Stop leading (releasing the lease) and dispose of an engine this store created."""
        if self._epoch is not None:
            await self.release_leadership()
        await self._stop()
        if self._owns_engine:
            await self._raw_engine.dispose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _run(self, fn: Callable[[Connection], T], *, idle: timedelta | None = None) -> T:
        """Run `fn` in one transaction on a sync-style connection; errors leave translated.

        `idle`: as `SqlStore._run`, the lease TTL for a transaction that touches the leader row.
        """

        def bounded(conn: Connection) -> T:
            dialects.bound_idle(conn, idle)
            return fn(conn)

        with translated():
            async with self.engine.begin() as conn:
                return await conn.run_sync(bounded)

    async def _lease_run(self, fn: Callable[[Connection], T]) -> T:
        """`_run` for a transaction that touches the leader row (take, renew, commit, release)."""
        return await self._run(fn, idle=self.config.lease_ttl)

    @staticmethod
    def _now() -> int:
        return time.time_ns()

    # Leadership.

    @property
    def epoch(self) -> int | None:
        """The fencing epoch while this instance leads."""
        return None if self._lost.is_set() else self._epoch

    @property
    def is_leader(self) -> bool:
        return self.epoch is not None

    def on_leadership_lost(self, callback: LeadershipLostCallback) -> None:
        """Call `callback` once each time leadership ends (taken over, not renewable in time,
        fenced, released); a coroutine it returns is awaited. It must not block the loop."""
        self._callbacks.append(callback)

    async def leadership_lost(self) -> None:
        """Return once leadership is lost (at once if this instance does not lead)."""
        await self._lost.wait()

    async def wait_leadership_lost(self, timeout: float | None = None) -> bool:
        """Wait until leadership is lost; False if `timeout` seconds passed first."""
        return await _wait(self._lost, timeout)

    async def _lose(
        self,
        why: str,
        level: int = logging.ERROR,
        *,
        keeper: AsyncKeeper | None = None,
        epoch: int | None = None,
    ) -> None:
        """Step down (once): commits raise `Fenced` from here on. A `keeper` that no longer
        keeps the current lease (a stale one), or a commit fenced under an epoch that is no
        longer ours, changes nothing."""
        # No await before set(): on one loop the check and the set are one step.
        stale = (keeper is not None and keeper is not self._keeper) or (
            epoch is not None and epoch != self._epoch
        )
        if self._lost.is_set() or stale:
            return
        self._lost.set()
        if self._keeper is not None:
            self._keeper.stop()
        log.log(level, "cronoq leadership lost (epoch %s): %s", self._epoch, why)
        for callback in list(self._callbacks):
            try:
                result = callback()
                if inspect.isawaitable(result):
                    await result
            except Exception:
                log.exception("leadership-lost callback failed")

    async def acquire_leadership(self, timeout: float | None = None) -> int:
        """Wait until this instance leads; returns the new fencing epoch.

        As `SqlStore.acquire_leadership`: polls every `lock_poll`, backs off while the database
        cannot be reached, raises `StoreUnavailable` after `timeout` seconds; an instance that
        leads already steps down first and leads anew under the next epoch.
        """
        await self._lose("taking the lease anew", logging.INFO)
        await self._stop()
        deadline = None if timeout is None else time.monotonic() + timeout
        poll = self.config.lock_poll.total_seconds()
        delay = poll
        ttl = _ns(self.config.lease_ttl)
        holder = self.holder
        unreachable: StoreUnavailable | None = None
        while True:
            try:
                taken = await self._lease_run(lambda c: lease.take(c, holder=holder, ttl_ns=ttl))
            except StoreUnavailable as exc:
                if unreachable is None:
                    log.warning("cannot reach the database to acquire leadership: %s", exc)
                unreachable, taken, wait = exc, None, delay
                delay = min(delay * 2, max(MAX_RETRY_DELAY, poll))
            else:
                if unreachable is not None:
                    log.info("the database is reachable again")
                unreachable, wait, delay = None, poll, poll
            if taken is not None:
                break
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    why = "another instance holds the lease"
                    if unreachable is not None:
                        why = f"the database is unreachable: {unreachable}"
                    raise StoreUnavailable(f"not leader after {timeout} s: {why}")
                wait = min(wait, left)
            await asyncio.sleep(wait)
        epoch, started = taken

        async def lost(why: str) -> None:
            await self._lose(why, keeper=keeper)

        keeper = AsyncKeeper(
            renew=lambda: self._renew(epoch),
            lost=lost,
            every=self.config.lease_renew.total_seconds(),
            ttl=self.config.lease_ttl.total_seconds(),
            renewed_at=started,
            name=f"cronoq-lease-keeper-{epoch}",
        )
        self._keeper = keeper
        self._epoch = epoch
        self._lost.clear()
        keeper.start()
        log.info("cronoq leadership acquired (epoch %s)", epoch)
        return epoch

    async def _renew(self, epoch: int) -> bool:
        """One renewal of our lease (the keeper's); False once another instance took it."""
        ttl = _ns(self.config.lease_ttl)
        holder = self.holder
        return await self._lease_run(
            lambda c: lease.renew(c, epoch=epoch, holder=holder, ttl_ns=ttl)
        )

    async def _stop(self) -> None:
        """Stop the keeper; a renewal hung in the database is not waited for past `lease_renew`."""
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.stop()
            await keeper.join(self.config.lease_renew.total_seconds())

    async def release_leadership(self) -> None:
        """Give leadership up; a waiting standby can take over at once."""
        await self._lose("released", logging.INFO)
        await self._stop()
        if self._epoch is not None:
            holder = self.holder
            try:
                await self._lease_run(lambda c: lease.release(c, holder=holder))
            except StoreError as exc:
                log.warning("could not clear the lease; it will expire: %s", exc)
        self._epoch = None

    # Commits and recovery.

    async def commit(
        self,
        epoch: int,
        base: TimeBase,
        batch: Sequence[Mutation],
        outputs: Sequence[tuple[TaskId, bytes]] = (),
    ) -> None:
        """Make `batch` durable in one transaction, or raise and write nothing.

        Idempotent: committing the same batch again (after a timeout, say) changes nothing.
        """
        if self._lost.is_set() or epoch != self._epoch:
            raise Fenced(f"epoch {epoch} does not lead")
        work = commit_work(
            epoch=epoch,
            holder=self.holder,
            base=base,
            batch=batch,
            outputs=outputs,
            config=self.config,
            now_unix_ns=self._now(),
        )
        try:
            await self._lease_run(work)
        except Fenced as exc:
            await self._lose(str(exc), epoch=epoch)
            raise

    async def recover(self, base: TimeBase) -> Recovered:
        """Everything a new leader needs to resume (quarantining undecodable rows)."""
        now = self._now()
        retention = self.config.retention
        return await self._run(
            lambda c: repository.recover(c, base, now_unix_ns=now, retention=retention)
        )

    async def prune(self, older_than: timedelta) -> int:
        """Delete finished tasks updated before `older_than` ago that no live task needs."""
        cutoff = self._now() - _ns(older_than)
        total = 0
        while True:
            n = await self._run(lambda c: repository.prune_batch(c, cutoff))
            total += n
            if n < repository.PRUNE_BATCH:
                return total

    # Queries.

    async def get_task(self, ref: TaskRef) -> TaskRecord | None:
        """A task by id, or the newest task with a key."""
        if isinstance(ref, ById):
            task_id = ref.id
            return await self._run(lambda c: repository.get_task(c, task_id=task_id))
        if isinstance(ref, ByKey):
            key = ref.key
            return await self._run(lambda c: repository.get_task(c, key=key))
        raise InvalidValue(f"ref must be ById or ByKey, not {type(ref).__name__}")

    async def list_finished(
        self,
        pools: Sequence[str] = (),
        statuses: Sequence[TaskStatus] = (),
        after: TaskId | None = None,
        limit: int = 100,
    ) -> list[TaskRecord]:
        """Finished tasks by id above `after`: in `pools` (any if empty), with `statuses`."""
        return await self._run(
            lambda c: repository.list_finished(
                c, pools=pools, statuses=statuses, after=after, limit=limit
            )
        )

    async def load_output(self, id: TaskId) -> bytes | None:
        """The output of a task that succeeded."""
        return await self._run(lambda c: repository.load_output(c, id))
