"""`SqlStore`: the facade a scheduler engine uses, and its configuration.

It owns transactions (the repository and lease modules never commit), translates every database
error in one place, and keeps the leader lease alive from a keeper thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Self

from sqlalchemy import URL, Connection, Engine, create_engine, make_url
from sqlalchemy import exc as sa_exc

from . import dialects, lease, migrate, repository
from .errors import Fenced, InvalidValue, StoreError, StoreUnavailable
from .model import (
    INT64_MAX,
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
from .schema import check_schema_name

log = logging.getLogger(__name__)

MAX_RETRY_DELAY: Final = 5.0
"""Longest wait, in seconds, between attempts to reach the database while acquiring."""


MAX_WAIT: Final = timedelta(milliseconds=2**31 - 1)
"""Longest lease, poll or timeout: what every dialect enforces (PostgreSQL's statement_timeout
and SQLite's busy_timeout are 32-bit milliseconds), about 24.8 days."""


def _ns(d: timedelta) -> int:
    return (d // timedelta(microseconds=1)) * 1000


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreConfig:
    """How a store behaves; durations are `timedelta`."""

    retention: timedelta = timedelta(hours=1)
    """How long finished tasks are returned by recovery (key deduplication)."""
    lease_ttl: timedelta = timedelta(seconds=10)
    """How long a lease lasts unrenewed; a standby takes over once it runs out."""
    lease_renew: timedelta = timedelta(seconds=2)
    """How often the leader renews its lease; well below `lease_ttl`."""
    lock_poll: timedelta = timedelta(milliseconds=500)
    """How often a standby checks whether the lease has run out."""
    busy_timeout: timedelta = timedelta(seconds=5)
    """How long a SQLite statement waits for another process's write."""
    commit_timeout: timedelta = timedelta(seconds=30)
    """Longest a commit may take; past it the commit rolls back with `StoreUnavailable`."""
    full_sync: bool = True
    """SQLite: fsync every commit (synchronous=FULL); off, a power loss may drop the last ones."""
    pool_size: int = 4
    schema: str | None = None
    """PostgreSQL schema (or MySQL database) holding the tables; None for the default. Any name
    up to 63 bytes without '.', '[', ']', control characters or outer whitespace."""
    migrate: bool = True
    """Whether `SqlStore.open` migrates the database to this build's schema."""

    def __post_init__(self) -> None:
        for name in (
            "retention",
            "lease_ttl",
            "lease_renew",
            "lock_poll",
            "busy_timeout",
            "commit_timeout",
        ):
            value = getattr(self, name)
            if not isinstance(value, timedelta):
                raise InvalidValue(f"StoreConfig.{name} must be a timedelta")
            if name == "retention":
                continue  # any length: recovery's cutoff saturates
            if value <= timedelta(0):
                raise InvalidValue(f"StoreConfig.{name} must be positive")
            if value > MAX_WAIT:
                raise InvalidValue(f"StoreConfig.{name} must be at most {MAX_WAIT}")
        if self.retention < timedelta(0):
            raise InvalidValue("StoreConfig.retention must not be negative")
        if self.lease_renew * 2 > self.lease_ttl:
            raise InvalidValue(
                "StoreConfig.lease_renew must be at most half of lease_ttl, so that one failed "
                "renewal does not lose the lease"
            )
        if self.lock_poll >= self.lease_ttl:
            raise InvalidValue(
                "StoreConfig.lock_poll must be below lease_ttl: a standby that checks less often "
                "than a lease lasts leaves the scheduler leaderless for longer than the TTL"
            )
        if not isinstance(self.pool_size, int) or isinstance(self.pool_size, bool):
            raise InvalidValue("StoreConfig.pool_size must be an int")
        if self.pool_size < 1:
            raise InvalidValue("StoreConfig.pool_size must be at least 1")
        if self.schema is not None:
            check_schema_name(self.schema, "StoreConfig.schema")


def _sqlite_path(path: str) -> Path:
    """Refuse what SQLite would not treat as a plain local file (memory, URIs)."""
    if not path or path.startswith(":") or path[:5].lower() == "file:":
        raise InvalidValue(
            f"invalid SQLite path {path!r}: use a plain file path on a local filesystem"
        )
    return Path(path)


def sqlite_file(url: URL) -> Path:
    """The file a SQLite URL names, refusing query options.

    pysqlite's `uri=true` hands the path and every other option to SQLite as a `file:` URI:
    SQLite would then open another file (`x.db?nolock=1`), in memory, or without the locking
    that fencing relies on, while the store checked and created `x.db`. No option is needed
    (the store sets timeouts and pragmas itself), so none is accepted.
    """
    if url.query:
        raise InvalidValue(
            f"SQLite URL options are not accepted ({', '.join(sorted(url.query))}): "
            "use a plain file path; the store sets what SQLite needs"
        )
    return _sqlite_path(url.database or "")


def _create_private(path: Path) -> None:
    """Create the database file 0600 if it does not exist; SQLite's -wal and -shm follow it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    except OSError as exc:
        raise StoreError(f"cannot create {path}: {exc.strerror}") from exc
    os.close(fd)


def _engine_for(target: str | os.PathLike[str] | URL, config: StoreConfig) -> Engine:
    """The engine `SqlStore.open` owns. Its statement parameters are task data (payloads,
    labels), so `hide_parameters` keeps them out of SQLAlchemy's errors and logging."""
    if isinstance(target, os.PathLike) or (isinstance(target, str) and "://" not in target):
        url = make_url("sqlite://").set(database=str(_sqlite_path(os.fspath(target))))
    else:
        url = target if isinstance(target, URL) else dialects.parse_url(target)
    if url.get_backend_name() == "sqlite":
        path = sqlite_file(url)
        _create_private(path)
        engine = create_engine(
            url, pool_size=config.pool_size, max_overflow=0, hide_parameters=True
        )
        dialects.configure_sqlite(
            engine,
            full_sync=config.full_sync,
            busy_timeout=min(config.busy_timeout, config.commit_timeout),
        )
        return engine
    try:
        return create_engine(
            url, pool_size=config.pool_size, pool_pre_ping=True, hide_parameters=True
        )
    except (sa_exc.ArgumentError, ImportError) as exc:
        advice = dialects.url_advice(url)
        why = dialects.redact(f"bad database URL: {exc}")
        raise StoreError(f"{why}; {advice}" if advice else why) from exc


@contextlib.contextmanager
def translated() -> Iterator[None]:
    """Every database error leaves the store as a `StoreError` (sync and asyncio alike)."""
    try:
        yield
    except (StoreError, sa_exc.SQLAlchemyError, OSError) as exc:
        error = dialects.translate(exc)  # which also strips task data from exc's chain
        if error is exc:
            raise
        if isinstance(exc, sa_exc.IntegrityError):
            error = StoreError(
                f"the batch conflicts with stored tasks (a live key in use?): {error}"
            )
        raise error from exc


def commit_work(
    *,
    epoch: int,
    holder: str,
    base: TimeBase,
    batch: Sequence[Mutation],
    outputs: Sequence[tuple[TaskId, bytes]],
    config: StoreConfig,
    now_unix_ns: int,
) -> Callable[[Connection], None]:
    """The body of one commit transaction; folds (and refuses bad values) before any I/O."""
    folded = repository.fold(base, now_unix_ns, batch)
    outputs = repository.checked_outputs(outputs)
    # The first id never used, saturated: after 2**63 - 1 it stays there (`recover` reads
    # that as "no id left below 2**63").
    next_id = min(max(folded.inserts, default=-1) + 1, INT64_MAX)
    ttl = _ns(config.lease_ttl)
    timeout = config.commit_timeout
    deadline = time.monotonic() + timeout.total_seconds()

    def work(conn: Connection) -> None:
        dialects.bound_transaction(conn, timeout)
        if not lease.fence(conn, epoch=epoch, holder=holder, next_id=next_id, ttl_ns=ttl):
            raise Fenced(f"epoch {epoch} was fenced off: another instance leads")
        repository.write(conn, base, folded, outputs)
        if time.monotonic() > deadline:
            # Rolled back: a caller that gave up waiting must not find it committed later.
            raise StoreUnavailable(f"commit did not finish within {timeout}; rolled back")

    return work


class SqlStore:
    """The durable state of one cronoq scheduler; cheap to share between threads."""

    def __init__(self, engine: Engine, config: StoreConfig | None = None) -> None:
        """Wrap an app's own engine (no side effects: call `migrate()` or use `open`)."""
        self.config = config or StoreConfig()
        self._owns_engine = False
        self._raw_engine = engine
        self.engine = (
            engine.execution_options(schema_translate_map={None: self.config.schema})
            if self.config.schema
            else engine
        )
        self.holder = lease.new_holder()
        self._lock = threading.Lock()
        self._epoch: int | None = None
        self._lost = threading.Event()
        self._lost.set()
        self._keeper: lease.Keeper | None = None
        self._callbacks: list[Callable[[], None]] = []

    @classmethod
    def open(
        cls, url_or_path: str | os.PathLike[str] | URL, config: StoreConfig | None = None
    ) -> SqlStore:
        """Open a database (a bare path means a SQLite file), migrating it unless told not to."""
        config = config or StoreConfig()
        engine = _engine_for(url_or_path, config)
        store = cls(engine, config)
        store._owns_engine = True
        try:
            if config.migrate:
                store.migrate()
        except BaseException:
            engine.dispose()
            raise
        return store

    def migrate(self) -> None:
        """Migrate the database to this build's schema (idempotent; safe from many processes)."""
        migrate.upgrade(self._raw_engine, schema=self.config.schema)

    def close(self) -> None:
        """Stop leading (releasing the lease) and dispose of an engine this store created."""
        if self._epoch is not None:
            self.release_leadership()
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

    def _run(self, fn: Callable[[Connection], Any], *, idle: timedelta | None = None) -> Any:
        """Run `fn` in one transaction. Every transaction that touches the leader row passes
        `idle` = the lease TTL: the server ends it if this process pauses inside it for longer
        (`dialects.bound_idle`), so a paused holder never blocks a standby past the TTL."""
        with translated(), self.engine.begin() as conn:
            dialects.bound_idle(conn, idle)
            return fn(conn)

    def _lease_run(self, fn: Callable[[Connection], Any]) -> Any:
        """`_run` for a transaction that touches the leader row (take, renew, commit, release)."""
        return self._run(fn, idle=self.config.lease_ttl)

    def _read(self, fn: Callable[[Connection], Any]) -> Any:
        """Run `fn` in a read-only transaction (on SQLite it does not take the write lock)."""
        with (
            translated(),
            self.engine.connect().execution_options(**{dialects.READ_ONLY: True}) as conn,
            conn.begin(),
        ):
            dialects.bound_idle(conn, None)
            return fn(conn)

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

    def on_leadership_lost(self, callback: Callable[[], None]) -> None:
        """Call `callback` once each time leadership ends (taken over, not renewable in time,
        fenced, released), from whichever thread noticed; it must not block for long."""
        self._callbacks.append(callback)

    def wait_leadership_lost(self, timeout: float | None = None) -> bool:
        """Block until leadership is lost; False if `timeout` seconds passed first."""
        return self._lost.wait(timeout)

    def _lose(
        self,
        why: str,
        level: int = logging.ERROR,
        *,
        keeper: lease.Keeper | None = None,
        epoch: int | None = None,
    ) -> None:
        """Step down (once): commits raise `Fenced` from here on.

        A `keeper` that no longer keeps the current lease (a stale one, still finishing a hung
        renewal), or an `epoch` that is no longer ours (a commit fenced under the previous one),
        changes nothing.
        """
        with self._lock:
            if (
                self._lost.is_set()
                or (keeper is not None and keeper is not self._keeper)
                or (epoch is not None and epoch != self._epoch)
            ):
                return
            self._lost.set()
            current = self._keeper
        if current is not None:
            current.stop()
        log.log(level, "cronoq leadership lost (epoch %s): %s", self._epoch, why)
        for callback in list(self._callbacks):
            try:
                callback()
            except Exception:
                log.exception("leadership-lost callback failed")

    def acquire_leadership(self, timeout: float | None = None) -> int:
        """Block until this instance leads; returns the new fencing epoch.

        Checks every `lock_poll` whether the lease is free, expired (on the database's clock) or
        ours, and backs off up to `MAX_RETRY_DELAY` while the database cannot be reached. With
        `timeout` (seconds), raises `StoreUnavailable` if this instance does not lead by then.
        An instance that leads already steps down first and leads anew under the next epoch.
        """
        self._lose("taking the lease anew", logging.INFO)
        self._stop()
        deadline = None if timeout is None else time.monotonic() + timeout
        poll = self.config.lock_poll.total_seconds()
        delay = poll
        ttl = _ns(self.config.lease_ttl)
        unreachable: StoreUnavailable | None = None
        taken: tuple[int, float] | None
        while True:
            try:
                taken = None
                if self._read(lambda c: lease.may_take(c, holder=self.holder)):
                    taken = self._lease_run(lambda c: lease.take(c, holder=self.holder, ttl_ns=ttl))
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
            time.sleep(wait)
        epoch, started = taken
        with self._lock:
            keeper = lease.Keeper(
                renew=lambda: self._renew(epoch),
                lost=lambda why: self._lose(why, keeper=keeper),
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

    def _renew(self, epoch: int) -> bool:
        """One renewal of our lease (the keeper's); False once another instance took it."""
        ttl = _ns(self.config.lease_ttl)
        renewed: bool = self._lease_run(
            lambda c: lease.renew(c, epoch=epoch, holder=self.holder, ttl_ns=ttl)
        )
        return renewed

    def _fence_renewed(self, epoch: int, started: float) -> None:
        """A commit under `epoch`, begun at monotonic time `started`, landed: its fence check
        extended the lease, so it counts as a renewal. (A commit holds the leader row to its
        end, so the keeper's own renewal waits behind a long one.)"""
        with self._lock:
            keeper = self._keeper if epoch == self._epoch and not self._lost.is_set() else None
        if keeper is not None:
            keeper.renewed(started)

    def _stop(self) -> None:
        """Stop the keeper; a renewal hung in the database is not waited for past `lease_renew`."""
        with self._lock:
            keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.stop()
            keeper.join(self.config.lease_renew.total_seconds())

    def release_leadership(self) -> None:
        """Give leadership up; a waiting standby can take over at once."""
        self._lose("released", logging.INFO)
        self._stop()
        if self._epoch is not None:
            try:
                self._lease_run(lambda c: lease.release(c, holder=self.holder))
            except StoreError as exc:
                log.warning("could not clear the lease; it will expire: %s", exc)
        self._epoch = None

    # Commits and recovery.

    def commit(
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
        started = time.monotonic()
        try:
            self._lease_run(work)
        except Fenced as exc:
            self._lose(str(exc), epoch=epoch)
            raise
        self._fence_renewed(epoch, started)

    def recover(self, base: TimeBase) -> Recovered:
        """Everything a new leader needs to resume (quarantining undecodable rows)."""
        now = self._now()

        def scan(conn: Connection) -> Recovered:
            return repository.recover(conn, base, now_unix_ns=now, retention=self.config.retention)

        try:
            # Streams without SQLite's write lock, so the keeper renews meanwhile; only a
            # quarantine writes, and where that cannot upgrade the read, it runs again below.
            result: Recovered = self._read(scan)
        except StoreUnavailable:
            result = self._run(scan)
        return result

    def prune(self, older_than: timedelta) -> int:
        """Delete finished tasks updated before `older_than` ago that no live task needs."""
        cutoff = self._now() - _ns(older_than)
        limit = repository.PRUNE_BATCH
        total = 0
        while True:
            # One transaction per batch: locks stay short while the leader keeps committing.
            n: int = self._run(lambda c: repository.prune_batch(c, cutoff, limit))
            total += n
            if n < limit:
                return total

    # Queries.

    def get_task(self, ref: TaskRef) -> TaskRecord | None:
        """A task by id, or the newest task with a key."""
        if isinstance(ref, ById):
            return self._read(lambda c: repository.get_task(c, task_id=ref.id))  # type: ignore[no-any-return]
        if isinstance(ref, ByKey):
            return self._read(lambda c: repository.get_task(c, key=ref.key))  # type: ignore[no-any-return]
        raise InvalidValue(f"ref must be ById or ByKey, not {type(ref).__name__}")

    def list_finished(
        self,
        pools: Sequence[str] = (),
        statuses: Sequence[TaskStatus] = (),
        after: TaskId | None = None,
        limit: int = 100,
    ) -> list[TaskRecord]:
        """Finished tasks by id above `after`: in `pools` (any if empty), with `statuses`."""
        return self._read(  # type: ignore[no-any-return]
            lambda c: repository.list_finished(
                c, pools=pools, statuses=statuses, after=after, limit=limit
            )
        )

    def load_output(self, id: TaskId) -> bytes | None:
        """The output of a task that succeeded."""
        return self._read(lambda c: repository.load_output(c, id))  # type: ignore[no-any-return]
