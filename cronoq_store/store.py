"""`SqlStore`: the facade a scheduler engine uses, and its configuration.

It owns transactions (the repository and lease modules never commit), translates every database
error in one place, and keeps the leader lease alive from a keeper thread.
"""

from __future__ import annotations

__all__ = [
    "MAX_WAIT",
    "Outputs",
    "SqlStore",
    "StoreConfig",
]

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Final, Generic, Protocol, Self, TypedDict, TypeVar

from sqlalchemy import URL, Connection, Engine, create_engine, make_url
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Dialect

from . import dialects, execution, inbox, leadership, lease, migrate, telemetry
from .errors import (
    DatabaseBehind,
    Fenced,
    InvalidValue,
    LeaderRowMissing,
    StoreError,
    StoreUnavailable,
)
from .model import (
    INT64_MAX,
    ById,
    ByKey,
    InboxItem,
    Mutation,
    Recovered,
    TaskId,
    TaskRecord,
    TaskRef,
    TaskStatus,
    TimeBase,
)
from .repository import commit, folding, prune, queries, recovery
from .schema import check_schema_name

log = logging.getLogger(__name__)

T = TypeVar("T")

Outputs = Sequence[tuple[TaskId, bytes]]
"""Outputs of tasks that succeeded, by id, committed with a batch."""

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
    """Pool size of an engine the store creates (`open`); an engine handed in keeps its own."""
    schema: str | None = None
    """PostgreSQL schema (or MySQL database) holding the tables; None for the default. Any name
    up to 63 bytes without '.', '[', ']', control characters or outer whitespace."""
    migrate: bool = True
    """Whether `SqlStore.open` migrates the database to this build's schema."""
    inbox_poll: timedelta = timedelta(milliseconds=100)
    """How often `wait_inbox` checks the inbox on SQLite and MariaDB/MySQL, and on PostgreSQL
    with `transaction_pooler` or without `inbox_listen` (otherwise PostgreSQL's LISTEN/NOTIFY
    wakes it at once)."""
    inbox_listen: bool = True
    """PostgreSQL: `wait_inbox` listens for enqueues' notifications (waking within
    milliseconds); off, it polls every `inbox_poll`, for apps that enqueue with
    `notify=False` (whose commits then skip the lock a notifying commit holds through its WAL
    flush: docs/tuning.md, "Waking the leader")."""
    transaction_pooler: bool = False
    """PostgreSQL: the store reaches the server through a pooler in transaction mode
    (pgbouncer's `pool_mode = transaction`), where consecutive transactions run on different
    server connections. The engine `open` creates then makes no server-side prepared
    statements (psycopg's `prepare_threshold=None`), and `wait_inbox` polls every
    `inbox_poll` instead of LISTEN, which such a pooler cannot deliver. An engine handed in
    must be made so by its owner (docs/deploying.md, "Poolers")."""

    def __post_init__(self) -> None:
        for name in (
            "retention",
            "lease_ttl",
            "lease_renew",
            "lock_poll",
            "busy_timeout",
            "commit_timeout",
            "inbox_poll",
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
        for flag in ("inbox_listen", "transaction_pooler"):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidValue(f"StoreConfig.{flag} must be a bool")
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


def driver_options(url: URL, config: StoreConfig) -> tuple[URL, dict[str, Any]]:
    """`url` and the `connect_args` of an engine the store creates for it (both faces).

    URL options the driver needs as numbers come out of the URL (`dialects.connect_options`);
    behind a transaction pooler psycopg prepares nothing: a statement prepared on one server
    connection is unknown to (or already exists on) the next.
    """
    url, connect_args = dialects.connect_options(url)
    if config.transaction_pooler and url.get_driver_name() in ("psycopg", "psycopg_async"):
        if connect_args.get(dialects.PREPARE_THRESHOLD) is not None:
            raise InvalidValue(
                "prepare_threshold in the URL contradicts StoreConfig(transaction_pooler=True), "
                "which prepares no statement: leave the option out"
            )
        connect_args[dialects.PREPARE_THRESHOLD] = None
    return url, connect_args


def _engine_for(
    target: str | os.PathLike[str] | URL, config: StoreConfig, *, read_only: bool = False
) -> Engine:
    """The engine `SqlStore.open` owns. Its statement parameters are task data (payloads,
    labels), so `hide_parameters` keeps them out of SQLAlchemy's errors and logging.

    `read_only` (SQLite; `cronoq-store`'s looks): the file is not created, and its connections
    cannot write nor take the write lock (`dialects.configure_sqlite`)."""
    if isinstance(target, os.PathLike) or (isinstance(target, str) and "://" not in target):
        url = make_url("sqlite://").set(database=str(_sqlite_path(os.fspath(target))))
    else:
        url = target if isinstance(target, URL) else dialects.parse_url(target)
    dialects.check_url(url)
    if url.get_backend_name() == "sqlite":
        path = sqlite_file(url)
        if not read_only:
            _create_private(path)
        engine = create_engine(
            url, pool_size=config.pool_size, max_overflow=0, hide_parameters=True
        )
        dialects.configure_sqlite(
            engine,
            full_sync=config.full_sync,
            busy_timeout=min(config.busy_timeout, config.commit_timeout),
            read_only=read_only,
        )
        return engine
    try:
        url, connect_args = driver_options(url, config)
        engine = create_engine(
            url, pool_size=config.pool_size, hide_parameters=True, connect_args=connect_args
        )
    except (sa_exc.ArgumentError, ImportError) as exc:
        # With advice, SQLAlchemy's own text ("Can't load plugin: ...") only adds noise.
        advice = dialects.url_advice(url)
        why = f"bad database URL: {advice}" if advice else f"bad database URL: {exc}"
        raise StoreError(dialects.redact(why)) from exc
    execution.ping_when_idle(engine, execution.PING_IDLE)
    return engine


def lease_bound(config: StoreConfig, deadline: timedelta | None) -> timedelta:
    """How long a take, renewal or release may take: twice the lease TTL (or `deadline`, when
    shorter). It may wait up to one TTL on the leader row's lock for a holder paused inside
    its own transaction (the server ends that one after the TTL idle: `dialects.bound_idle`)
    and then needs its own round trips; past that, no renewal is of use (the keeper has
    stepped down) and a take is better retried."""
    bound = 2 * config.lease_ttl
    return bound if deadline is None else min(deadline, bound)


def take_bound(give_up_at: float | None, now: float) -> timedelta | None:
    """How long one attempt at the lease may take: what is left of an acquire's timeout
    (None: no timeout; `lease_bound` bounds it then), so that a take waiting on a row lock
    cannot carry `acquire_leadership` past its timeout."""
    if give_up_at is None:
        return None
    return timedelta(seconds=max(0.1, give_up_at - now))


def _note(note: leadership.Note | None) -> None:
    if note is not None:
        log.log(*note)


def acquiring_for(config: StoreConfig, timeout: float | None, now: float) -> leadership.Acquiring:
    """The acquire loop's decisions under `config`, from monotonic time `now` (both faces)."""
    poll = config.lock_poll.total_seconds()
    return leadership.Acquiring(poll=poll, max_delay=MAX_RETRY_DELAY, timeout=timeout, now=now)


class KeeperTiming(TypedDict):
    every: float
    ttl: float
    renewed_at: float
    name: str


def keeper_timing(config: StoreConfig, epoch: int, started: float) -> KeeperTiming:
    """A keeper's timing under `config`, for the lease taken under `epoch` at `started`."""
    return KeeperTiming(
        every=config.lease_renew.total_seconds(),
        ttl=config.lease_ttl.total_seconds(),
        renewed_at=started,
        name=f"cronoq-lease-keeper-{epoch}",
    )


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


RETRY_COMMIT: Final = "the batch is idempotent: commit it again"
"""What a commit whose outcome is unknown tells its caller."""
RETRIED: Final = "the store tries it again"
"""What a lease transaction (take, renew, release) whose outcome is unknown says."""


def transaction(
    conn: Connection,
    fn: Callable[[Connection], T],
    *,
    idle: timedelta | None = None,
    timeout: timedelta | None = None,
    deadline: timedelta | None = None,
    unknown: str = RETRIED,
    bounds: bool = True,
) -> T:
    """Run `fn` in one transaction on `conn`, under the bounds of `dialects.bound` (`idle`,
    `timeout`; not `bounds`: `fn` sets them itself, as a commit does in its first flight,
    `lease.fencing`): the runner of every transaction `SqlStore._run` and `AsyncSqlStore._run`
    start (the latter inside `run_sync`), so both faces keep the same rules.

    `deadline`: the whole transaction, COMMIT included, ends within it whatever the server
    waits on. Server-side bounds do not cover everything: PostgreSQL's `statement_timeout`
    does not apply to a COMMIT waiting for a synchronous standby, nor does anything else, and
    that commit holds its row locks meanwhile. Past the deadline `execution.WATCHDOG`
    interrupts the session (`dialects.interrupter`), and the transaction raises
    `StoreUnavailable`: "rolled back" if it had not reached COMMIT, "outcome unknown" (and
    `unknown`, what the caller should do) if it had, for a cancelled wait for a standby
    leaves the transaction committed locally, perhaps never replicated.

    The connection goes (invalidated: the pool opens a new one next time) after such an
    interruption, and after a server refused a write (`dialects.read_only`: a standby, a
    demoted primary), whichever path the statements took (the DB-API cursor or SQLAlchemy's
    execution), so that a multi-host or DNS URL can reach the new primary.
    """
    armed = None
    if deadline is not None:
        armed = execution.WATCHDOG.arm(deadline.total_seconds(), dialects.interrupter(conn))
    committing = False
    try:
        with conn.begin():
            if bounds:
                dialects.bound(conn, idle=idle, timeout=timeout)
            result = fn(conn)
            committing = True
    except BaseException as exc:
        overdue = armed is not None and execution.WATCHDOG.settle(armed)
        if overdue or (isinstance(exc, sa_exc.DBAPIError) and dialects.read_only(exc)):
            _drop(conn, exc)
        if overdue and not isinstance(exc, StoreError):  # the store's own (Fenced) stands
            raise StoreUnavailable(_overdue(deadline, committing, unknown)) from exc
        raise
    if armed is not None and execution.WATCHDOG.settle(armed):
        # COMMIT returned, but after the interruption: a cancelled wait for a standby
        # returns success with a warning, so success here proves nothing.
        _drop(conn, None)
        raise StoreUnavailable(_overdue(deadline, True, unknown))
    return result


def _drop(conn: Connection, exc: BaseException | None) -> None:
    """Invalidate `conn`: the pool closes it and opens a new one at its next checkout."""
    if not conn.invalidated:
        orig = exc.orig if isinstance(exc, sa_exc.DBAPIError) else exc
        conn.invalidate(orig if isinstance(orig, Exception) else None)


def _overdue(deadline: timedelta | None, committing: bool, unknown: str) -> str:
    if committing:
        return (
            f"the transaction did not finish within {deadline} (a COMMIT waiting for a lost "
            f"synchronous standby?); outcome unknown: it may have committed; {unknown}"
        )
    return f"the transaction did not finish within {deadline}; interrupted and rolled back"


def commit_work(
    *,
    epoch: int,
    holder: str,
    base: TimeBase,
    batch: Sequence[Mutation],
    outputs: Sequence[tuple[TaskId, bytes]],
    config: StoreConfig,
    now_unix_ns: int,
    seq: int,
    acked: int,
) -> Callable[[Connection], None]:
    """The body of one commit transaction; folds (and refuses bad values) before any I/O.

    It raises the lease row's commit sequence to `seq`, and fences off unless the row holds at
    least `acked` (`lease.fence`)."""
    folded = folding.fold(base, now_unix_ns, batch)
    outputs = folding.checked_outputs(outputs)
    # The first id never used, saturated: after 2**63 - 1 it stays there (`recover` reads
    # that as "no id left below 2**63").
    next_id = min(max(folded.inserts, default=-1) + 1, INT64_MAX)
    ttl = _ns(config.lease_ttl)
    timeout = config.commit_timeout
    deadline = time.monotonic() + timeout.total_seconds()

    def work(conn: Connection) -> None:
        # Run with `bounds=False` (`_lease_run`): its bounds (`dialects.bound`: the lease TTL's
        # idle bound, the commit timeout) ride in the fence's flight, before the fence.
        first = dialects.bound(conn, idle=config.lease_ttl, timeout=timeout, defer=True)
        with lease.fencing(
            conn, epoch=epoch, holder=holder, next_id=next_id, ttl_ns=ttl, seq=seq, acked=acked,
            first=first,
        ) as flight:  # fmt: skip
            commit.write(conn, base, folded, outputs, flight)
        if time.monotonic() > deadline:
            # Rolled back: a caller that gave up waiting must not find it committed later.
            raise StoreUnavailable(f"commit did not finish within {timeout}; rolled back")

    return work


class _Engine(Protocol):
    @property
    def dialect(self) -> Dialect: ...
    def execution_options(self, **opt: Any) -> Self: ...


class _Flag(Protocol):
    def set(self) -> None: ...
    def clear(self) -> None: ...
    def is_set(self) -> bool: ...


class _Keeper(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def renewed(self, started: float) -> None: ...


E = TypeVar("E", bound=_Engine)
K = TypeVar("K", bound=_Keeper)
C = TypeVar("C")


class _Face(Generic[E, K, C]):
    """What `SqlStore` and `aio.AsyncSqlStore` share, none of it blocking or awaiting: the
    configuration, the engine, the holder's name, and who leads (`leadership.Leadership`)."""

    _log: ClassVar[logging.Logger]
    _new_flag: ClassVar[Callable[[], _Flag]]
    _listener: Any

    def _new_listener(self) -> Any:
        """A face's own LISTEN connection (PostgreSQL), for `wait_inbox`."""
        raise NotImplementedError

    _lost: _Flag
    """`threading.Event` or `asyncio.Event`: set while this instance does not lead."""

    def __init__(self, engine: E, config: StoreConfig | None = None) -> None:
        """Wrap an app's own engine (no I/O: call `migrate()` or use `open`)."""
        self.config = config or StoreConfig()
        """How this store behaves."""
        self._owns_engine = False
        self._raw_engine = engine
        self.engine = (
            engine.execution_options(schema_translate_map={None: self.config.schema})
            if self.config.schema
            else engine
        )
        """The engine every transaction runs on (with `schema` applied, when set)."""
        self.holder = lease.new_holder()
        """This instance's name in the lease row (host, process id and a random part)."""
        self._lock = threading.Lock()
        self._leadership: leadership.Leadership[K] = leadership.Leadership()
        self._lost = type(self)._new_flag()
        self._lost.set()
        self._callbacks: list[C] = []
        self.inbox_rejected = 0
        """Undecodable inbox rows this instance has set aside."""
        self._telemetry = telemetry.Telemetry(dialects.name(self.engine.dialect))
        # PostgreSQL wakes `wait_inbox` by LISTEN on a connection of its own; elsewhere (and
        # behind a transaction pooler, which delivers no notification, or when told) it polls.
        listens = self.config.inbox_listen and inbox.can_listen(
            self.engine.dialect, pooled=self.config.transaction_pooler
        )
        self._listener = self._new_listener() if listens else None

    @classmethod
    def _owning(cls, engine: E, config: StoreConfig) -> Self:
        """A store on an engine it created, and disposes of on `close`."""
        store = cls(engine, config)
        store._owns_engine = True
        return store

    @staticmethod
    def _now() -> int:
        return time.time_ns()

    @property
    def epoch(self) -> int | None:
        """The fencing epoch while this instance leads."""
        return self._leadership.leading

    @property
    def is_leader(self) -> bool:
        """Whether this instance leads now: `epoch` is not None."""
        return self.epoch is not None

    def on_leadership_lost(self, callback: C) -> None:
        """Call `callback` once each time leadership ends (taken over, not renewable in time,
        fenced, released). `SqlStore` calls it from whichever thread noticed; `AsyncSqlStore`
        awaits a coroutine it returns. It must not block for long."""
        self._callbacks.append(callback)

    def _step_down(
        self, why: str, level: int, about: K | int | None, reason: str | None
    ) -> list[C]:
        """Step down (once): commits raise `Fenced` from here on; the callbacks to run.

        News `about` a keeper that no longer keeps the current lease (a stale one, still
        finishing a hung renewal), or about an epoch that is no longer ours (a commit fenced
        under the previous one), changes nothing: no callbacks.
        """
        keeper, epoch = (None, about) if isinstance(about, int) else (about, None)
        with self._lock:
            lost = self._leadership.lose(keeper=keeper, epoch=epoch)
            if lost is None:
                return []
            self._lost.set()
        if lost.keeper is not None:
            lost.keeper.stop()
        self._telemetry.stepped_down(reason)
        self._log.log(
            level,
            "cronoq leadership lost (epoch %s): %s",
            lost.epoch,
            why,
            extra={
                "epoch": lost.epoch,
                "holder": self.holder,
                "transition": "released" if reason is None else "lost",
                "reason": reason,
            },
        )
        return list(self._callbacks)

    def _lead(self, epoch: int, keeper: K, commit_seq: int) -> int:
        """Lead under `epoch`, kept by `keeper` (started here), the lease row's commit sequence
        standing at `commit_seq`."""
        with self._lock:
            self._leadership.acquired(epoch, keeper, commit_seq)
            self._lost.clear()
        keeper.start()
        self._telemetry.acquired(epoch)
        self._log.info(
            "cronoq leadership acquired (epoch %s)",
            epoch,
            extra={"epoch": epoch, "holder": self.holder, "transition": "acquired"},
        )
        return epoch

    def _detach(self) -> K | None:
        """The keeper, to be stopped and joined: none keeps the lease from here on."""
        with self._lock:
            return self._leadership.detach()

    def _commit_work(
        self, epoch: int, base: TimeBase, batch: Sequence[Mutation], outputs: Outputs
    ) -> tuple[Callable[[Connection], None], int]:
        """The body of a commit under `epoch` and its commit sequence number; `Fenced` at once
        if it does not lead."""
        with self._lock:
            if not self._leadership.may_commit(epoch):
                raise Fenced(f"epoch {epoch} does not lead")
            seq, acked = self._leadership.next_commit()
        return commit_work(
            epoch=epoch,
            holder=self.holder,
            base=base,
            batch=batch,
            outputs=outputs,
            config=self.config,
            now_unix_ns=self._now(),
            seq=seq,
            acked=acked,
        ), seq

    def _take_floor(self) -> tuple[int, int]:
        """What a take checks the row against: the highest commit sequence number this
        instance saw land, and its epoch."""
        with self._lock:
            return self._leadership.acked, self._leadership.acked_epoch

    def _gap_recorded(self) -> None:
        with self._lock:
            self._leadership.gap_recorded()

    def _recovered(self, result: Recovered, quarantined: int) -> None:
        self._telemetry.recovered(
            live=len(result.tasks),
            finished=max(0, len(result.terminal) - quarantined),
            quarantined=quarantined,
        )

    def _set_aside(self, moved: int) -> None:
        """`moved` undecodable inbox rows were set aside by this instance."""
        self.inbox_rejected += moved
        self._telemetry.set_aside(moved)

    def _acked(self) -> int:
        """The highest commit sequence number known to have landed (renewals check it)."""
        with self._lock:
            return self._leadership.acked

    def _lost_commits(self, exc: DatabaseBehind) -> Callable[[Connection], None]:
        """The transaction that records what `exc` found missing (and frees our lease)."""
        self._log.error(
            "cronoq leader found the database behind it: %s",
            exc,
            extra={"epoch": exc.lost.epoch, "lost_commits": exc.lost.commits},
        )
        return partial(lease.record_lost, holder=self.holder, lost=exc.lost)

    def _fence_renewed(self, epoch: int, started: float, seq: int) -> None:
        """Commit `seq` under `epoch`, begun at monotonic time `started`, landed: its fence check
        extended the lease, so it counts as a renewal. (A commit holds the leader row to its
        end, so the keeper's own renewal waits behind a long one.)"""
        with self._lock:
            keeper = self._leadership.fence_renewed(epoch, seq)
        if keeper is not None:
            keeper.renewed(started)


class SqlStore(_Face[Engine, lease.Keeper, Callable[[], None]]):
    """The durable state of one cronoq scheduler; cheap to share between threads."""

    _log = log
    _new_flag = threading.Event
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
        """
        config = config or StoreConfig()
        store = cls._owning(_engine_for(url_or_path, config), config)
        try:
            if config.migrate:
                store.migrate()
            elif check_schema:
                store.check_schema()
        except BaseException:
            store._raw_engine.dispose()
            raise
        return store

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
        with translated():
            migrate.require_head(self._raw_engine, schema=self.config.schema)

    def close(self) -> None:
        """Stop leading (releasing the lease) and dispose of an engine this store created.

        Raises nothing: a lease that cannot be cleared is logged and left to expire.
        """
        if self._leadership.epoch is not None:
            self.release_leadership()
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

    def _run(
        self,
        fn: Callable[[Connection], Any],
        *,
        idle: timedelta | None = None,
        timeout: timedelta | None = None,
        deadline: timedelta | None = None,
        unknown: str = RETRIED,
        bounds: bool = True,
    ) -> Any:
        """Run `fn` in one transaction (`transaction`). Every transaction that touches the
        leader row passes `idle` = the lease TTL: the server ends it if this process pauses
        inside it for longer (`dialects.bound_idle`), so a paused holder never blocks a
        standby past the TTL. A commit passes its `timeout` too (`dialects.bound`), set with
        it, and every lease transaction a `deadline` for the whole of it."""
        with translated(), self.engine.connect() as conn:
            return transaction(
                conn, fn, idle=idle, timeout=timeout, deadline=deadline, unknown=unknown,
                bounds=bounds,
            )  # fmt: skip

    def _lease_run(
        self,
        fn: Callable[[Connection], Any],
        *,
        timeout: timedelta | None = None,
        deadline: timedelta | None = None,
    ) -> Any:
        """`_run` for a transaction that touches the leader row (take, renew, commit, release):
        a commit ends within its `timeout`, the others within `lease_bound`."""
        if timeout is not None:
            return self._run(
                fn, idle=self.config.lease_ttl, timeout=timeout, deadline=timeout,
                unknown=RETRY_COMMIT, bounds=False,  # a commit's are in its flight
            )  # fmt: skip
        bound = lease_bound(self.config, deadline)
        return self._run(fn, idle=self.config.lease_ttl, deadline=bound)

    def _read(self, fn: Callable[[Connection], Any]) -> Any:
        """Run `fn` in a read-only transaction (on SQLite it does not take the write lock)."""
        with (
            translated(),
            self.engine.connect().execution_options(**{dialects.READ_ONLY: True}) as conn,
            conn.begin(),
        ):
            dialects.bound_idle(conn, None)
            return fn(conn)

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

    def _lose(
        self,
        why: str | StoreError,
        level: int = logging.ERROR,
        *,
        about: lease.Keeper | int | None = None,
        released: bool = False,
    ) -> None:
        """Step down (once), then call the callbacks (`_step_down` decides); `released` when
        by choice, else lost for `why` (a keeper's reason or the error that showed it)."""
        reason = None if released else telemetry.lost_reason(why)
        for callback in self._step_down(str(why), level, about, reason):
            try:
                callback()
            except Exception:
                log.exception("leadership-lost callback failed")

    def _try_take(
        self, ttl_ns: int, bound: timedelta | None
    ) -> lease.Lease | StoreUnavailable | None:
        """One attempt at the lease, within `bound`: taken, held (None), or unreachable."""
        try:
            if not self._read(lambda c: lease.may_take(c, holder=self.holder)):
                return None
            acked, last = self._take_floor()
            taken: lease.Lease | None = self._lease_run(
                lambda c: lease.take(
                    c, holder=self.holder, ttl_ns=ttl_ns, acked=acked, last_epoch=last
                ),
                deadline=bound,
            )
        except StoreUnavailable as exc:
            return exc
        except DatabaseBehind as exc:
            self._record_lost(exc)
            self._gap_recorded()
            return None  # tried again at the next poll, on the database's history
        return taken

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
        self._lose("taking the lease anew", logging.INFO, released=True)
        self._stop()
        began = time.monotonic()
        acquiring = acquiring_for(self.config, timeout, began)
        give_up_at = None if timeout is None else began + timeout
        ttl = _ns(self.config.lease_ttl)
        with self._telemetry.acquiring():
            while True:
                taken = self._try_take(ttl, take_bound(give_up_at, time.monotonic()))
                step = acquiring.attempted(time.monotonic(), taken)
                _note(step.note)
                if isinstance(step, leadership.GiveUp):
                    raise step.error
                if isinstance(taken, lease.Lease):
                    break
                if isinstance(step, leadership.Retry):
                    time.sleep(max(0.0, step.at - time.monotonic()))
            epoch, started, commit_seq = taken
            keeper = lease.Keeper(
                renew=lambda: self._renew(epoch),
                lost=lambda why: self._lose(why, about=keeper),
                **keeper_timing(self.config, epoch, started),
            )
            return self._lead(epoch, keeper, commit_seq)

    def _renew(self, epoch: int) -> bool:
        """One renewal of our lease (the keeper's); False once another instance took it."""
        ttl = _ns(self.config.lease_ttl)
        acked = self._acked()
        try:
            renewed: bool = self._lease_run(
                lambda c: lease.renew(c, epoch=epoch, holder=self.holder, ttl_ns=ttl, acked=acked)
            )
        except DatabaseBehind as exc:
            self._record_lost(exc)
            self._lose(exc, about=epoch)
            return False
        except LeaderRowMissing as exc:  # nothing to retry: step down now, saying why
            self._lose(exc, about=epoch)
            return False
        return renewed

    def _record_lost(self, exc: DatabaseBehind) -> None:
        """Record what `exc` found missing for the next recovery; a failure only logs."""
        try:
            self._lease_run(self._lost_commits(exc))
        except StoreError as error:
            log.warning("could not record the lost commits in the lease row: %s", error)

    def _stop(self) -> None:
        """Stop the keeper; a renewal hung in the database is not waited for past `lease_renew`."""
        if (keeper := self._detach()) is not None:
            keeper.stop()
            keeper.join(self.config.lease_renew.total_seconds())

    def release_leadership(self) -> None:
        """Give leadership up; a waiting standby can take over at once.

        Raises nothing: a lease that cannot be cleared is logged and expires on its own.
        """
        self._lose("released", logging.INFO, released=True)
        self._stop()
        if self._leadership.epoch is not None:
            try:
                self._lease_run(lambda c: lease.release(c, holder=self.holder))
            except StoreError as exc:
                log.warning("could not clear the lease; it will expire: %s", exc)
        self._leadership.released()

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
            InvalidValue: A mutation or value the store cannot hold (checked before writing).
            StoreError: Anything else the database refused; nothing was written.
        """
        with self._telemetry.commit(epoch, batch):
            work, seq = self._commit_work(epoch, base, batch, outputs)
            started = time.monotonic()
            try:
                self._lease_run(work, timeout=self.config.commit_timeout)
            except DatabaseBehind as exc:
                self._record_lost(exc)
                self._lose(exc, about=epoch)
                raise
            except Fenced as exc:
                self._lose(exc, about=epoch)
                raise
            self._fence_renewed(epoch, started, seq)

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
        now = self._now()

        def scan(conn: Connection) -> tuple[Recovered, int]:
            return recovery.recover(conn, base, now_unix_ns=now, retention=self.config.retention)

        result: Recovered
        quarantined: int
        with self._telemetry.recovering():
            try:
                # Streams without SQLite's write lock, so the keeper renews meanwhile; only a
                # quarantine writes, and where that cannot upgrade the read, it runs again below.
                result, quarantined = self._read(scan)
            except StoreUnavailable:
                result, quarantined = self._run(scan)
        self._recovered(result, quarantined)
        return result

    def prune(self, older_than: timedelta) -> int:
        """Delete finished tasks updated before `older_than` ago that no live task needs.

        Args:
            older_than: How long ago a finished task was last updated, at least.

        Returns:
            How many tasks were deleted (in short transactions; any instance may prune).

        Raises:
            StoreUnavailable: The database cannot be reached (earlier batches stay deleted).
        """
        cutoff = self._now() - _ns(older_than)
        limit = prune.PRUNE_BATCH
        total = 0
        with self._telemetry.pruning():
            try:
                while True:
                    # One transaction per batch: locks stay short while the leader commits.
                    n: int = self._run(lambda c: prune.prune_batch(c, cutoff, limit))
                    total += n
                    if n < limit:
                        return total
            finally:
                self._telemetry.pruned(total)

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
        if isinstance(ref, ById):
            return self._read(lambda c: queries.get_task(c, task_id=ref.id))  # type: ignore[no-any-return]
        if isinstance(ref, ByKey):
            return self._read(lambda c: queries.get_task(c, key=ref.key))  # type: ignore[no-any-return]
        raise InvalidValue(f"ref must be ById or ByKey, not {type(ref).__name__}")

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
        return self._read(  # type: ignore[no-any-return]
            lambda c: queries.list_finished(
                c, pools=pools, statuses=statuses, after=after, limit=limit
            )
        )

    def load_output(self, id: TaskId) -> bytes | None:
        """The output of a task that succeeded.

        Args:
            id: The task's id.

        Returns:
            Its output bytes, or None if it has none (or no such task exists).

        Raises:
            StoreUnavailable: The database cannot be reached.
        """
        return self._read(lambda c: queries.load_output(c, id))  # type: ignore[no-any-return]

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
        limit = inbox.check_limit(limit)
        after = inbox.check_after(after)
        items: list[InboxItem] = []
        while True:
            n = limit - len(items)
            got: inbox.Read = self._read(partial(inbox.read, base=base, limit=n, after=after))
            items += got.items
            if not got.bad:
                return items
            now = self._now()
            moved: int = self._run(partial(inbox.set_aside, bad=got.bad, now_unix_ns=now))
            self._set_aside(moved)
            after = got.last_id
            if len(items) >= limit:
                return items

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
            lambda: bool(self._read(inbox.has_items)),
            timeout,
            poll=self.config.inbox_poll.total_seconds(),
            listener=self._listener,
        )
