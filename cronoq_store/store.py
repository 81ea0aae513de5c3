"""`SqlStore`: the facade a scheduler engine uses, and its configuration.

It runs transactions blocking (the repository and lease modules never commit: how each
transaction runs, a commit's way from BEGIN to COMMIT, and the translation of every database
error are `face.transactions`'s), and keeps the leader lease alive from a keeper thread. Its
operations are written once, for both faces, in `face` (`Steps` generators this face drives).
"""

from __future__ import annotations

__all__ = [
    "MAX_WAIT",
    "Outputs",
    "SqlStore",
    "StoreConfig",
]

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from types import TracebackType
from typing import Self, TypeVar

from sqlalchemy import URL, Connection, Engine, create_engine

from . import execution, face, inbox, leadership, migrate
from .config import MAX_WAIT, StoreConfig
from .durability import Durability
from .face import Face as _Face  # private here: the reference shows no internal base
from .face import Op, Outputs, Steps, engines, transactions
from .face.transactions import Commit
from .model import (
    InboxItem,
    Mutation,
    Recovered,
    TaskId,
    TaskRecord,
    TaskRef,
    TaskStatus,
    TimeBase,
)

log = logging.getLogger(__name__)

T = TypeVar("T")


def engine_for(
    target: str | os.PathLike[str] | URL, config: StoreConfig, *, read_only: bool = False
) -> Engine:
    """The engine `SqlStore.open` owns (`engines.new_engine`): a bare path means a SQLite file.
    `read_only` (SQLite; `cronoq-store`'s looks): see `engines.new_engine`."""
    url = engines.target_url(target, "pysqlite")
    return engines.new_engine(url, config, create_engine, lambda e: e, read_only=read_only)


class Keeper(leadership.KeeperShell[Callable[[], bool], Callable[[str], None]]):
    """Keeps one lease alive from two daemon threads, around `leadership.Keeping`'s decisions.

    The renewer calls `renew`: True means renewed, False that the lease was taken over, a
    `StoreError` a failed attempt (retried after `every` seconds). The watchdog thread waits for
    what the core decides (the next renewal, or the deadline while a renewal runs) and calls
    `lost` once the lease has not been renewed within `ttl` seconds of the START of the last
    successful renewal, on the monotonic clock, even while a renewal hangs (on a row lock, on a
    dead connection): a blocked call cannot postpone stepping down. The database clock sets each
    new expiry no earlier than that start plus the TTL, so the holder steps down before any
    standby may take over.

    `lost(reason)` is called at most once, from one of the threads; `stop` ends both threads
    without calling it.
    """

    def _setup(self) -> None:
        lock = threading.Lock()  # never taken twice by one thread: not an RLock
        self._cond = threading.Condition(lock)
        # Entered as the plain lock (C `__enter__`), as `execution.Watchdog` does: every
        # landed commit takes it (`renewed`), where the condition's own costs two calls.
        self._guard = lock
        self._threads = (
            threading.Thread(target=self._renew_loop, name=f"{self._name}-renew", daemon=True),
            threading.Thread(target=self._watch, name=f"{self._name}-watchdog", daemon=True),
        )

    def _wake(self) -> None:
        self._cond.notify_all()

    _start = _wake  # the renewer thread picks up the renewal the core started

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait up to `timeout` seconds for each thread to end (a hung renewal may outlive it)."""
        for thread in self._threads:
            if thread.ident is not None and thread is not threading.current_thread():
                thread.join(timeout)

    def _watch(self) -> None:
        """Block until the core's next decision is due; report the step-down."""
        with self._cond:
            while isinstance(step := self._due(time.monotonic()), leadership.Wait):
                self._cond.wait(step.until - time.monotonic())
        if step is not None:
            self._lost(step.reason)

    def _renew_loop(self) -> None:
        """Run each renewal the core started (blocking as long as it takes), report its end."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._core.finished or self._core.running)
                if self._core.finished:
                    return
            result: bool | BaseException
            try:
                result = self._renew()
            except Exception as exc:
                result = exc
            if (note := self._ended(time.monotonic(), result)) is not None:
                log.log(*note)


class SqlStore(_Face[Engine, Keeper, Callable[[], None], Connection]):
    """The durable state of one cronoq scheduler; cheap to share between threads."""

    _log = log
    _new_flag = threading.Event
    _keeper_type = Keeper
    _lost: threading.Event
    _listener: inbox.Listener | None

    def _new_listener(self) -> inbox.Listener:
        return inbox.Listener(self.engine)

    @classmethod
    def open(
        cls,
        url_or_path: str | os.PathLike[str] | URL,
        config: StoreConfig | None = None,
        *,
        check_schema: bool = True,
    ) -> SqlStore:
        """Open a database (a bare path means a SQLite file), migrating it unless told not to.

        With `StoreConfig.migrate` off, the schema must already stand at this build's head
        (`SchemaError` otherwise, nothing written); `check_schema=False` skips that check, for
        tools that inspect or migrate a database at any revision.

        Args:
            url_or_path: A SQLAlchemy URL (string or `URL`) or a SQLite file path (created
                0600 if missing).
            config: How the store behaves; `StoreConfig()` when None.
            check_schema: With migration off, refuse a database not at head.

        Returns:
            A store that owns its engine (`close` disposes of it); it does not lead yet.

        Raises:
            InvalidValue: A URL or path the store cannot use (query options on SQLite,
                PostgreSQL host lists that can never connect).
            StoreError: A URL whose dialect or driver is not installed (the message says
                what to install and write).
            StoreUnavailable: The database cannot be reached.
            SchemaError: The schema is newer than this build, or (migration off) not at head.
            NotDurable: With `StoreConfig.require_durable`, a server that can lose an
                acknowledged commit on a crash (nothing written). Without it, `open` logs one
                WARNING naming the settings instead.
        """
        config = config or StoreConfig()
        store = cls._owning(engine_for(url_or_path, config), config)
        store._drive(store._opening(check_schema))
        return store

    def read_durability(self) -> Durability:
        """Read what the server does with a commit (one round trip; `open` does it once, and
        keeps it as `durability`). Never on a commit's path.

        Returns:
            The settings read, whether they are `safe`, and those that are not.

        Raises:
            StoreUnavailable: The database cannot be reached.
        """
        return self._drive(self._reading_durability())

    def migrate(self) -> None:
        """Migrate the database to this build's schema (idempotent; safe from many processes).

        Raises:
            SchemaError: The database stands at a revision this build does not know.
            StoreUnavailable: The database cannot be reached.
        """
        migrate.upgrade(self._raw_engine, schema=self.config.schema)

    def check_schema(self) -> None:
        """Refuse a database not at this build's head revision; only reads.

        Raises:
            SchemaError: Not migrated, behind, or newer than this build.
            StoreUnavailable: The database cannot be reached.
        """
        with face.translated():
            migrate.require_head(self._raw_engine, schema=self.config.schema)

    def close(self) -> None:
        """Stop leading (releasing the lease) and dispose of an engine this store created.

        Raises nothing: a lease that cannot be cleared is logged and left to expire.
        """
        if self._leadership.epoch is not None:
            self.release_leadership()
        self._close_held()
        if self._listener is not None:
            self._listener.close()
        if self._owns_engine:
            self._raw_engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # Transactions: every database error leaves here translated.

    def _transact(
        self, op: Op, fn: Callable[[Connection], T], *, deadline: timedelta | None = None
    ) -> T:
        """`face.Face._transact`, blocking."""
        tx = face.plan(op, self.config, deadline)
        bound = None if tx.deadline is None else tx.deadline.total_seconds()
        # Armed before connecting: a connect, or the ping of an idle connection, counts too.
        with face.translated(), execution.bounded(bound) as armed, self.engine.connect() as conn:
            return transactions.transaction(conn, fn, tx, armed)

    def _transact_commit(self, c: Commit) -> None:
        """`face.Face._transact_commit`, blocking."""
        try:
            with execution.bounded(self._commit_bound) as armed:
                if not self._holds:
                    with self.engine.connect() as conn:
                        return transactions.commit(conn, c, self._commit_tx, armed)
                conn = self._held_connection()
                try:
                    transactions.commit(conn, c, self._commit_tx, armed)
                except BaseException:
                    conn.close()
                    raise
                if not self._keep_held(conn):
                    conn.close()
        except transactions.DATABASE_ERRORS as exc:
            if (error := transactions.translate(exc)) is exc:
                raise
            raise error from exc
        return None

    def _held_connection(self) -> Connection:
        held = self._take_held()
        if held is not None:
            conn, idle = held
            try:
                if not idle or execution.still_there(conn):
                    return conn
            except BaseException:
                conn.close()
                raise
            conn.close()
        return self.engine.connect()

    def _close_held(self, *, lost: bool = False) -> None:
        """Close the kept connection; after a loss (`lost`) without a word to the server,
        which may be cut off: a pool's reset of it (a ROLLBACK) would wait on the network."""
        if (conn := self._drop_held()) is not None:
            if lost:
                conn.invalidate()
            conn.close()

    _awaits = False

    def _drive(self, steps: Steps[T], thrown: BaseException | None = None) -> T:
        """Drive `steps` blocking (`face.Face._driving`): nothing is awaited on this face, so
        the driver ends at its first `send`."""
        driving = self._driving(steps, thrown)
        try:
            driving.send(None)
        except StopIteration as done:
            value: T = done.value
            return value
        driving.close()
        raise AssertionError("the blocking face's driver awaited")

    # Leadership.

    def wait_leadership_lost(self, timeout: float | None = None) -> bool:
        """Block until leadership is lost (at once if this instance does not lead).

        Args:
            timeout: Seconds to wait at most; None waits as long as it takes.

        Returns:
            True once leadership is lost; False if `timeout` passed first.

        Raises nothing: it only waits on this instance's own state.
        """
        return self._lost.wait(timeout)

    def acquire_leadership(self, timeout: float | None = None) -> int:
        """Block until this instance leads; returns the new fencing epoch.

        Checks every `lock_poll` whether the lease is free, expired (on the database's clock) or
        ours, and backs off up to 5 s between attempts while the database cannot be reached.
        An instance that leads already steps down first and leads anew under the next epoch.

        Args:
            timeout: Seconds to try at most; None tries until it leads.

        Returns:
            The new fencing epoch, which every `commit` of this term passes.

        Raises:
            StoreUnavailable: `timeout` passed before this instance could lead (the database
                unreachable, or another instance holding a live lease).
            LeaderRowMissing: The lease row is gone (`cronoq-store upgrade` restores it).
        """
        return self._drive(self._acquiring(timeout))

    def _sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def release_leadership(self) -> None:
        """Give leadership up; a waiting standby can take over at once.

        Raises nothing: a lease that cannot be cleared is logged and expires on its own.
        """
        self._drive(self._releasing())

    # Commits and recovery.

    def commit(
        self, epoch: int, base: TimeBase, batch: Sequence[Mutation], outputs: Outputs = ()
    ) -> None:
        """Make `batch` durable in one transaction, or raise and write nothing.

        Idempotent: committing the same batch again (after a timeout, say) changes nothing.
        A successful commit also renews the lease (fencing and renewal are one row).

        Args:
            epoch: The epoch `acquire_leadership` returned for this term.
            base: The engine's time base: every time in `batch` is an engine time under it.
            batch: The mutations, applied in order (`Submitted`, `StatusChanged`,
                `RecurringUpsert`, `RecurringRemove`, `RecurringNext`, `InboxTaken`).
            outputs: `(task id, bytes)` pairs: the outputs of tasks that succeeded.

        Raises:
            Fenced: Another instance leads (or this one's lease expired): nothing was
                written and this instance stepped down. `DatabaseBehind` (a `Fenced`) when
                the database lost commits this leader had made durable.
            StoreUnavailable: The database could not be reached, or the commit took longer
                than `StoreConfig.commit_timeout`; retry the same batch.
            InvalidValue: A mutation or value the store cannot hold (checked before writing),
                or two new tasks of the batch that live under one key (nothing written).
            StoreError: Anything else the database refused; nothing was written.
        """
        # `_committing`, driven here: it asks for one `Commit`, carried out at once, and, only
        # when that raised, for what ends the term (the one driver runs the rest of it).
        steps = self._committing(epoch, base, batch, outputs)
        c = next(steps)  # planned, before any I/O (refused: raised here)
        try:
            self._transact_commit(c)
        except BaseException as exc:
            self._drive(steps, exc)  # raises: `_committing` raises what ended the commit
            raise
        try:
            steps.send(None)
        except StopIteration:
            return
        steps.close()
        raise AssertionError("a landed commit asked for more")

    def recover(self, base: TimeBase) -> Recovered:
        """Everything a new leader needs to resume (quarantining undecodable rows).

        Args:
            base: The engine's time base: times come back as engine times under it.

        Returns:
            Live tasks, recently finished ones (`StoreConfig.retention`), recurring schedules,
            the next free task id and any commits a failover lost.

        Raises:
            StoreUnavailable: The database cannot be reached.
            StoreError: Anything else the database refused.
        """
        return self._drive(self._recovering(base))

    def prune(
        self,
        older_than: timedelta,
        *,
        batch_size: int | None = None,
        progress: Callable[[int], object] | None = None,
    ) -> int:
        """Delete finished tasks updated before `older_than` ago that no live task needs.

        On PostgreSQL a prune that deleted tasks then vacuums the task tables (a plain VACUUM,
        which blocks no reader or writer), so that the next tasks reuse the space at once
        instead of after autovacuum's next visit; a failed VACUUM is logged, not raised.

        Args:
            older_than: How long ago a finished task was last updated, at least.
            batch_size: Tasks deleted per transaction, at most; None: 1000 (`cronoq-store
                prune --batch-size`).
            progress: Called with each transaction's count of deleted tasks (the CLI's
                progress bar).

        Returns:
            How many tasks were deleted (in short transactions; any instance may prune).

        Raises:
            StoreUnavailable: The database cannot be reached (earlier batches stay deleted).
        """
        return self._drive(self._pruning(older_than, batch_size, progress))

    # Queries.

    def get_task(self, ref: TaskRef) -> TaskRecord | None:
        """A task by id, or the newest task with a key.

        Args:
            ref: `ById(id)` or `ByKey(key)`.

        Returns:
            The task, or None if there is none.

        Raises:
            InvalidValue: `ref` is neither `ById` nor `ByKey`.
            CorruptValue: The row cannot be decoded.
            StoreUnavailable: The database cannot be reached.
        """
        return self._drive(self._getting(ref))

    def list_finished(
        self,
        pools: Sequence[str] = (),
        statuses: Sequence[TaskStatus] = (),
        after: TaskId | None = None,
        limit: int = 100,
    ) -> list[TaskRecord]:
        """Finished tasks by id above `after`: in `pools` (any if empty), with `statuses`.

        Args:
            pools: Only these pools; every pool when empty.
            statuses: Only these terminal statuses; every one when empty.
            after: Only ids above it (the last id of the previous page).
            limit: At most this many.

        Returns:
            The tasks, by ascending id.

        Raises:
            StoreUnavailable: The database cannot be reached.
        """
        return self._drive(self._listing_finished(pools, statuses, after, limit))

    def load_output(self, id: TaskId) -> bytes | None:
        """The output of a task that succeeded.

        Args:
            id: The task's id.

        Returns:
            Its output bytes, or None if it has none (or no such task exists).

        Raises:
            StoreUnavailable: The database cannot be reached.
        """
        return self._drive(self._loading_output(id))

    # The inbox: what apps enqueue in their own transactions (`cronoq_store.enqueue`).

    def read_inbox(
        self, limit: int = 1000, *, after: int | None = None, base: TimeBase = inbox.UNIX
    ) -> list[InboxItem]:
        """The oldest inbox items (above inbox id `after`), left in place: commit `InboxTaken`
        for each with its `Submitted` (or alone, to drop it). Spec times are engine times under
        `base` (Unix nanoseconds by default). Undecodable rows are set aside, not returned
        (`inbox_rejected` counts them), and the rows behind them still are.

        Args:
            limit: At most this many items.
            after: Only inbox ids above it.
            base: The engine's time base for the specs' times.

        Returns:
            The items, oldest first.

        Raises:
            InvalidValue: `limit` or `after` out of range.
            StoreUnavailable: The database cannot be reached.
        """
        return self._drive(self._reading_inbox(limit, after, base))

    def wait_inbox(self, timeout: float) -> bool:
        """Block until the inbox holds an item, or until `timeout` seconds passed.

        Args:
            timeout: Seconds to wait at most.

        Returns:
            True once the inbox holds an item (at once if it holds one now); else False.

        Raises:
            StoreUnavailable: The database cannot be reached.
        """
        return inbox.wait(
            lambda: bool(self._transact("has_items", inbox.has_items)),
            timeout,
            poll=self.config.inbox_poll.total_seconds(),
            listener=self._listener,
        )

    def release_lease_of(self, holder: str) -> bool:
        """Free the lease that `holder`, a process known to be dead, still holds, so that a
        standby takes over at once instead of after `lease_ttl` (`cronoq-store lease release`).

        Args:
            holder: The holder the lease names (`inspection.lease_state`).

        Returns:
            True if it was freed; False if another holder has it now.

        Raises:
            StoreUnavailable: The database cannot be reached.
        """
        return self._drive(self._releasing_lease_of(holder))

    def close_held_connection(self) -> None:
        """Close the held connection (the one a leader keeps from one commit to the next), so
        that the store has none checked out until its next commit: for a process about to stop
        itself (SIGSTOP) holding no connection.

        Raises nothing: the pool's reset of the connection discards it on a failure.
        """
        self._close_held()
