"""What both faces of the store share (`SqlStore` in store.py, `AsyncSqlStore` in aio.py), none
of it blocking or awaiting: the one engine factory, the one table of what kind of transaction
each operation runs, the one runner of a transaction, the one commit, and who leads.

A face adds only what differs by nature: blocking or awaiting, and a keeper of threads or of
an asyncio task. Whatever else the faces do, they take from here, so they cannot drift.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from datetime import timedelta
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import (
    Any,
    ClassVar,
    Final,
    Generic,
    Literal,
    NamedTuple,
    Protocol,
    Self,
    TypedDict,
    TypeVar,
)

from sqlalchemy import URL, Connection, Engine, event, make_url
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Dialect

from . import codec, dialects, durability, execution, inbox, leadership, lease, telemetry
from .config import StoreConfig
from .errors import (
    DatabaseBehind,
    Fenced,
    InvalidValue,
    NotDurable,
    StoreError,
    StoreUnavailable,
)
from .model import INT64_MAX, InboxItem, Mutation, Recovered, TaskId, TimeBase
from .repository import commit, folding, prune, recovery

log = logging.getLogger(__name__)

T = TypeVar("T")

Outputs = Sequence[tuple[TaskId, bytes]]
"""Outputs of tasks that succeeded, by id, committed with a batch."""

MAX_RETRY_DELAY: Final = 5.0
"""Longest wait, in seconds, between attempts to reach the database while acquiring."""


def ns(d: timedelta) -> int:
    """`d` in nanoseconds."""
    return (d // timedelta(microseconds=1)) * 1000


def sqlite_path(path: str) -> Path:
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
    return sqlite_path(url.database or "")


def create_private(path: Path) -> None:
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


def _flights_prepare(url: URL, config: StoreConfig, connect_args: Mapping[str, Any]) -> bool:
    """Whether the store's flights on a sync psycopg engine prepare their statements
    (`wire.prepare_on`): unless a transaction pooler stands in front, or the URL says to
    prepare nothing (`?prepare_threshold=`, as behind one)."""
    if url.get_driver_name() != "psycopg" or config.transaction_pooler:
        return False
    return connect_args.get(dialects.PREPARE_THRESHOLD, 0) is not None


def target_url(target: str | os.PathLike[str] | URL, sqlite_driver: str) -> URL:
    """The URL `open` was given: a bare path means a SQLite file (with `sqlite_driver`)."""
    if isinstance(target, os.PathLike) or (isinstance(target, str) and "://" not in target):
        scheme = f"sqlite+{sqlite_driver}://"
        return make_url(scheme).set(database=str(sqlite_path(os.fspath(target))))
    return target if isinstance(target, URL) else dialects.parse_url(target)


def new_engine(
    url: URL,
    config: StoreConfig,
    create: Callable[..., E],
    sync: Callable[[E], Engine],
    *,
    read_only: bool = False,
    **sqlite_options: Any,
) -> E:
    """The engine `open` owns, on either face: made by `create` (`create_engine` or
    `create_async_engine`), its events set on `sync(engine)`, the engine that runs the
    statements. SQLite: the file created 0600, the pragmas, and a busy timeout no longer than a
    commit may take; on the servers a pooled connection is pinged only when it sat idle
    (`execution.ping_when_idle`). Its statement parameters are task data (payloads, labels),
    so `hide_parameters` keeps them out of SQLAlchemy's errors and logging. `read_only`
    (SQLite): the file is not created, and its connections cannot write nor take the write
    lock (`dialects.configure_sqlite`)."""
    dialects.check_url(url)
    dialects.require_database(url, config.schema)
    try:
        if url.get_backend_name() == "sqlite":
            path = sqlite_file(url)  # refuses a path SQLite would not lock, before anything
            if not read_only:
                create_private(path)
            engine = create(
                url,
                pool_size=config.pool_size,
                max_overflow=0,
                hide_parameters=True,
                **sqlite_options,
            )
            dialects.configure_sqlite(
                sync(engine),
                full_sync=config.full_sync,
                busy_timeout=min(config.busy_timeout, config.commit_timeout),
                read_only=read_only,
            )
            return engine
        url, connect_args = driver_options(url, config)
        connect_args = dialects.net_options(url, connect_args)
        engine = create(
            url,
            pool_size=config.pool_size,
            hide_parameters=True,
            connect_args=connect_args,
            **dialects.pool_options(url),
        )
        if _flights_prepare(url, config, connect_args) and not sync(engine).dialect.is_async:
            from . import wire  # psycopg's

            event.listen(sync(engine), "connect", lambda conn, _record: wire.prepare_on(conn))
    except sa_exc.InvalidRequestError as exc:  # a sync driver asyncio cannot drive
        raise StoreError(
            dialects.redact(f"{url.drivername!r} is not an async driver: {exc}")
        ) from exc
    except (sa_exc.ArgumentError, ImportError) as exc:
        # With advice, SQLAlchemy's own text ("Can't load plugin: ...") only adds noise.
        advice = dialects.url_advice(url)
        why = f"bad database URL: {advice}" if advice else f"bad database URL: {exc}"
        raise StoreError(dialects.redact(why)) from exc
    execution.ping_when_idle(sync(engine), execution.PING_IDLE)
    if url.get_backend_name() != "sqlite":
        whole = url.get_driver_name() in ("psycopg", "psycopg_async")  # libpq: whole seconds
        execution.bound_connects(sync(engine), "connect_timeout", whole=whole)
        dialects.tune_sockets(sync(engine))
    dialects.reset_after_commit(sync(engine))
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


def note(note: leadership.Note | None) -> None:
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


class Kind(enum.Enum):
    """What kind of transaction an operation runs."""

    READ = "read"
    """Read-only: SQLite begins it deferred, so it never waits for (or holds) the write lock,
    and a leader keeps committing and renewing meanwhile."""
    WRITE = "write"
    """Writes rows other than the leader row: SQLite takes the write lock up front."""
    OUTSIDE = "outside"
    """Outside any transaction, for what cannot run in one (PostgreSQL's VACUUM)."""
    LEASE = "lease"
    """Touches the leader row (take, renew, release, record the lost commits, commit): the
    server ends it if this process pauses inside it past the lease TTL
    (`dialects.bound_idle`), so a paused holder never blocks a standby for longer; and the
    whole of it ends within a deadline (`transaction`)."""


Op = Literal[
    "peek",
    "take",
    "renew",
    "release",
    "record_lost",
    "commit",
    "recover",
    "recover_writing",
    "prune",
    "vacuum",
    "get_task",
    "list_finished",
    "load_output",
    "read_inbox",
    "set_aside",
    "has_items",
    "durability",
]
"""Every transaction a store runs, by name."""

KINDS: Final[Mapping[Op, Kind]] = MappingProxyType(
    {
        "peek": Kind.READ,  # whether the lease may be taken, before a take locks its row
        "take": Kind.LEASE,
        "renew": Kind.LEASE,
        "release": Kind.LEASE,
        "record_lost": Kind.LEASE,
        "commit": Kind.LEASE,
        "recover": Kind.READ,  # streams without the write lock, so the keeper renews meanwhile
        "recover_writing": Kind.WRITE,  # again, where a quarantine could not upgrade the read
        "prune": Kind.WRITE,
        "vacuum": Kind.OUTSIDE,  # after a prune, on PostgreSQL (`dialects.vacuums`)
        "get_task": Kind.READ,
        "list_finished": Kind.READ,
        "load_output": Kind.READ,
        "read_inbox": Kind.READ,
        "set_aside": Kind.WRITE,
        "has_items": Kind.READ,
        "durability": Kind.READ,  # once, at open: never on a commit's path
    }
)
"""What kind of transaction each operation runs: the one table both faces read."""


def read_durability(conn: Connection) -> durability.Durability:
    """What the server `conn` reaches does with a commit (`durability.classify`)."""
    return durability.classify(dialects.name(conn.dialect), dialects.durability_settings(conn))


def judge_durability(found: durability.Durability | StoreError, config: StoreConfig) -> None:
    """At `open`: refuse an unsafe server when `config.require_durable`, else say so once (a
    WARNING naming the settings). `found` is the error when the settings could not be read
    (a server that refuses to show them): raised with `require_durable` (nothing vouches for
    the server), else a WARNING; an unreachable server (`StoreUnavailable`) is raised."""
    if isinstance(found, StoreError):
        if config.require_durable or isinstance(found, StoreUnavailable):
            raise found
        log.warning("could not read what the server does with a commit: %s", found)
        return
    if found.safe:
        return
    what = found.summary()
    if config.require_durable:
        raise NotDurable(
            f"this database can lose acknowledged commits on a crash: {what}; refused because "
            "StoreConfig.require_durable is set (docs/guarantees.md, 'Durability')",
            durability=found,
        )
    log.warning(
        "this database can lose acknowledged commits on a crash: %s (docs/guarantees.md, "
        "'Durability'; StoreConfig(require_durable=True) refuses such a server)",
        what,
        extra={"durable": False, "unsafe": [u.setting for u in found.unsafe]},
    )


class Tx(NamedTuple):
    """How one transaction runs (`transaction`): what `plan` makes of an operation."""

    read_only: bool
    idle: timedelta | None = None
    timeout: timedelta | None = None
    deadline: timedelta | None = None
    unknown: str = RETRIED
    bounds_in_fn: bool = False
    """Whether `fn` sends the bounds itself (a commit, in its first flight: `lease.fencing`)."""
    lock: timedelta | None = None
    """How long a statement may wait for a lock (`commit_lock_bound`)."""
    outside: bool = False
    """Run `fn` in autocommit mode, in no transaction (`Kind.OUTSIDE`)."""


def plan(op: Op, config: StoreConfig, deadline: timedelta | None = None) -> Tx:
    """How `op` runs under `config` (its kind from `KINDS`). A commit ends within
    `commit_timeout` (each statement bounded by it too, and its unknown outcome retried by
    committing the batch again); another lease transaction within `lease_bound` of `deadline`.
    """
    kind = KINDS[op]
    if kind is Kind.READ:
        return Tx(read_only=True, deadline=deadline)
    if kind is Kind.WRITE:
        return Tx(read_only=False)
    if kind is Kind.OUTSIDE:
        return Tx(read_only=False, outside=True)
    if op == "commit":
        timeout = config.commit_timeout
        return Tx(
            False,
            config.lease_ttl,
            timeout,
            timeout,
            RETRY_COMMIT,
            bounds_in_fn=True,
            lock=commit_lock_bound(config),
        )
    return Tx(False, config.lease_ttl, deadline=lease_bound(config, deadline))


def commit_lock_bound(config: StoreConfig) -> timedelta:
    """How long a commit's statement may wait for a lock: a third of `lease_ttl` -
    `lease_renew`, or `commit_timeout` if shorter.

    A commit holds the lease row from its fence check on, so a renewal that starts meanwhile
    waits for it; a commit waiting on a table lock (a migration's ALTER TABLE queued on the
    tasks table) held the renewal past the keeper's deadline, and the leader stepped down
    with nobody to take over. A leader that retries such commits back to back makes each
    renewal wait up to one bound `W`, and the next one starts `lease_renew` after it ended:
    the one after a renewal that started at `t` ends by `t + 2W + lease_renew`, which must
    come before the keeper's deadline, `t + lease_ttl`. A third leaves a third as margin, and
    the stalled commit fails with `StoreUnavailable` (rolled back: retry it). MariaDB counts
    lock waits in whole seconds (rounded down, at least 1): there, keep `lease_ttl` at
    least `lease_renew` + 3 s."""
    return min(config.commit_timeout, (config.lease_ttl - config.lease_renew) / 3)


def transaction(
    conn: Connection,
    fn: Callable[[Connection], T],
    tx: Tx,
    armed: execution.Deadline | None = None,
) -> T:
    """Run `fn` in one transaction on `conn` as `tx` says: the runner of every transaction
    `SqlStore._run` and `AsyncSqlStore._run` start (the latter inside `run_sync`), so both
    faces keep the same rules. `tx.read_only` marks it for SQLite's deferred BEGIN
    (`dialects.READ_ONLY`); `tx.idle` and `tx.timeout` are `dialects.bound`'s.

    `tx.deadline`: the whole transaction, COMMIT included, ends within it whatever the server
    or the network does; the one place a commit's timeout is enforced. `armed` is that
    deadline when it was armed before connecting (`execution.bounded`: the faces' `_run`),
    so that connecting and the pool's ping count against it too. Server-side bounds do not cover
    everything: PostgreSQL's `statement_timeout` does not apply to a COMMIT waiting for a
    synchronous standby, nor does anything else, and that commit holds its row locks
    meanwhile. Past the deadline `execution.WATCHDOG` interrupts the session
    (`dialects.interrupter`: its socket is shut down), and the transaction raises
    `StoreUnavailable`: "rolled back" if its COMMIT had not been sent (nor is it sent when
    its statements end past the deadline: a caller that gave up waiting must not find it
    committed later), "outcome unknown" (and `tx.unknown`, what the caller should do) if it
    had, for a COMMIT may land after its answer was lost, and a cancelled wait for a standby
    leaves the transaction committed locally, perhaps never replicated.

    The connection goes (invalidated: the pool opens a new one next time) after such an
    interruption, and after a server refused a write (`dialects.read_only`: a standby, a
    demoted primary), whichever path the statements took (the DB-API cursor or SQLAlchemy's
    execution), so that a multi-host or DNS URL can reach the new primary.
    """
    if tx.read_only:
        conn.execution_options(**{dialects.READ_ONLY: True})
    if tx.outside:  # the pool restores the isolation level when the connection comes back
        return fn(conn.execution_options(isolation_level="AUTOCOMMIT"))
    deadline = tx.deadline
    if armed is None and deadline is not None:  # not armed before connecting: arm it here
        with execution.bounded(deadline.total_seconds()) as own:
            return transaction(conn, fn, tx, own)
    if armed is not None:
        execution.WATCHDOG.bind(armed, dialects.interrupter(conn))
    info = conn.info
    info.pop(execution.COMMIT_SENT, None)
    committing = False
    try:
        with conn.begin():
            if not tx.bounds_in_fn:
                dialects.bound(conn, idle=tx.idle, timeout=tx.timeout, lock=tx.lock)
            result = fn(conn)
            if (
                armed is not None
                and time.monotonic() > armed.at
                and not execution.ended(conn)  # committed in its last flight: too late
            ):
                raise StoreUnavailable(
                    f"the transaction did not finish within {deadline}; rolled back"
                )
            committing = True
        dialects.committed(conn)
    except BaseException as exc:
        overdue = armed is not None and execution.WATCHDOG.settle(armed)
        if overdue or (isinstance(exc, sa_exc.DBAPIError) and dialects.read_only(exc)):
            _drop(conn, exc)
        if overdue and not isinstance(exc, StoreError):  # the store's own (Fenced) stands
            sent = committing or bool(info.get(execution.COMMIT_SENT))
            raise StoreUnavailable(_overdue(deadline, sent, tx.unknown)) from exc
        raise
    if armed is not None and execution.WATCHDOG.settle(armed):
        # COMMIT returned, but after the interruption: a cancelled wait for a standby
        # returns success with a warning, so success here proves nothing.
        _drop(conn, None)
        raise StoreUnavailable(_overdue(deadline, True, tx.unknown))
    return result


def _drop(conn: Connection, exc: BaseException | None) -> None:
    """Invalidate `conn`: the pool closes it and opens a new one at its next checkout."""
    if not conn.invalidated:
        orig = exc.orig if isinstance(exc, sa_exc.DBAPIError) else exc
        conn.invalidate(orig if isinstance(orig, Exception) else None)


def _overdue(deadline: timedelta | None, sent: bool, unknown: str) -> str:
    """What a transaction cut off at its deadline knows of itself: whether its COMMIT had
    left, nothing of why no answer came (a silent network and a lost standby look alike)."""
    if sent:
        return (
            f"the transaction did not finish within {deadline}: its COMMIT was sent and "
            f"no answer came in time; outcome unknown: it may have committed; {unknown}"
        )
    return (
        f"the transaction did not finish within {deadline}: interrupted before its COMMIT "
        "was sent; rolled back"
    )


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
H = TypeVar("H")


class Step(NamedTuple):
    """One transaction an operation asks its face to run (`plan`, `transaction`)."""

    op: Op
    fn: Callable[[Connection], Any]
    deadline: timedelta | None = None
    """A lease transaction's bound below `lease_bound` (what is left of an acquire's timeout)."""


Steps = Generator[Step, Any, T]
"""An operation of several transactions, written once for both faces: it yields each `Step`,
is sent back its result (or thrown its error), and returns the operation's result. A face
drives it (`_drive`), blocking or awaiting."""


class Commit(NamedTuple):
    """A commit ready to run: its transaction, and what to do once it landed (its fence check
    extended the lease: a renewal)."""

    work: Callable[[Connection], None]
    landed: Callable[[], None]


HOLD_MIN_POOL: Final = 3
"""The smallest pool (`StoreConfig.pool_size`) from which a leader keeps a connection for its
commits (`Face._keep_held`)."""


class Face(Generic[E, K, C, H]):
    """What `SqlStore` and `aio.AsyncSqlStore` share, none of it blocking or awaiting: the
    configuration, the engine, the holder's name, who leads (`leadership.Leadership`), and
    the connection a leader's commits keep (`_keep_held`)."""

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
        self._holds = False
        """Whether commits keep their connection for the next (`_owning`, `_keep_held`)."""
        self._held: tuple[H, float] | None = None
        self._inbox_specs: codec.StoredSpecs | None = None
        self._leadership: leadership.Leadership[K] = leadership.Leadership()
        self._lost = type(self)._new_flag()
        self._lost.set()
        self._callbacks: list[C] = []
        self.inbox_rejected = 0
        """Undecodable inbox rows this instance has set aside."""
        self.durability: durability.Durability | None = None
        """What the server does with a commit, as `open` read it (None until read: a store
        made on an app's engine reads it with `read_durability`)."""
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
        store._holds = config.pool_size >= HOLD_MIN_POOL
        return store

    # The connection a leader's commits keep.

    def _take_held(self) -> tuple[H, bool] | None:
        """The connection the last commit kept, if any, and whether it sat unused for
        `execution.PING_IDLE` (then it is checked first, as the pool checks an idle one: by
        `execution.still_there`). No other commit gets it meanwhile."""
        with self._lock:
            held, self._held = self._held, None
        if held is None:
            return None
        conn, used = held
        return conn, time.monotonic() - used >= execution.PING_IDLE

    def _keep_held(self, conn: H) -> bool:
        """Keep `conn`, on which a commit just ran, for the next commit, instead of returning
        it to the pool: False (close it) unless the store made its engine with a pool of at
        least `HOLD_MIN_POOL` (an app's engine keeps its own pool's budget), this instance
        leads, and no other is kept.

        A checkout and a SQLAlchemy `Connection` per commit cost a batch-1 commit about 30 us
        of its CPU (a sixth on SQLite). Only commits run on it: other transactions change a
        connection's execution options (a read's deferred BEGIN, autocommit for a VACUUM),
        which the pool resets only when it comes back. It goes back when a commit on it
        fails, when leadership ends (`_drop_held`), and at `close`.
        """
        with self._lock:
            if not self._holds or self._held is not None or self._leadership.leading is None:
                return False
            self._held = (conn, time.monotonic())
            return True

    def _drop_held(self) -> H | None:
        """The kept connection, to be closed (back to the pool), if any."""
        with self._lock:
            held, self._held = self._held, None
        return None if held is None else held[0]

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
        self, why: str | StoreError, level: int, about: K | int | None, released: bool
    ) -> list[C]:
        """Step down (once): commits raise `Fenced` from here on; the callbacks to run.
        `released` when by choice, else lost for `why` (a keeper's reason or the error that
        showed it).

        News `about` a keeper that no longer keeps the current lease (a stale one, still
        finishing a hung renewal), or about an epoch that is no longer ours (a commit fenced
        under the previous one), changes nothing: no callbacks.
        """
        reason = None if released else telemetry.lost_reason(why)
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
    ) -> Commit:
        """The one commit both faces run (`_run("commit", ...)`): `Fenced` at once if `epoch`
        does not lead; the batch folded (and bad values refused) before any I/O; then, in
        the transaction, the fence check, which raises the lease row's commit sequence to
        the commit's and fences off unless the row holds at least what this leader saw land
        (`lease.fence`), and the writes. `plan("commit")` bounds it by `commit_timeout`."""
        with self._lock:
            if not self._leadership.may_commit(epoch):
                raise Fenced(f"epoch {epoch} does not lead")
            seq, acked = self._leadership.next_commit()
        # A batch's rows are all kept until written: collector passes meanwhile find no garbage.
        with execution.collection_paused():
            folded = folding.fold(
                base,
                self._now(),
                batch,
                self._inbox_specs,
                max_payload=self.config.max_payload_bytes,
            )
        checked = folding.checked_outputs(outputs)
        # The first id never used, saturated: after 2**63 - 1 it stays there (`recover` reads
        # that as "no id left below 2**63").
        next_id = min(max(folded.inserts, default=-1) + 1, INT64_MAX)
        ttl = ns(self.config.lease_ttl)
        holder = self.holder
        tx = plan("commit", self.config)

        def work(conn: Connection) -> None:
            # The bounds (`plan`: the lease TTL's idle bound, the commit timeout) ride in the
            # fence's flight, before the fence (`Tx.bounds_in_fn`).
            first = dialects.bound(conn, idle=tx.idle, timeout=tx.timeout, defer=True, lock=tx.lock)
            try:
                with execution.collection_paused(), lease.fencing(
                    conn, epoch=epoch, holder=holder, next_id=next_id, ttl_ns=ttl, seq=seq,
                    acked=acked, first=first,
                ) as flight:  # fmt: skip
                    commit.write(conn, base, folded, checked, flight)
            except sa_exc.IntegrityError as exc:
                inside = folding.same_live_key(folded)  # else: `translated` says "stored tasks"
                if inside is None:
                    raise
                raise inside from exc

        return Commit(work, partial(self._fence_renewed, epoch, time.monotonic(), seq))

    def _recovering(self, base: TimeBase) -> Steps[Recovered]:
        """`recover`: it streams without SQLite's write lock, so the keeper renews meanwhile;
        only a quarantine writes, and where that cannot upgrade the read, it runs again in a
        write transaction."""
        scan = partial(
            recovery.recover, base=base, now_unix_ns=self._now(), retention=self.config.retention
        )
        with self._telemetry.recovering():
            scanned: tuple[Recovered, int]
            try:
                scanned = yield Step("recover", scan)
            except StoreUnavailable:
                scanned = yield Step("recover_writing", scan)
        result, quarantined = scanned
        self._telemetry.recovered(
            live=len(result.tasks),
            finished=max(0, len(result.terminal) - quarantined),
            quarantined=quarantined,
        )
        return result

    def _pruning(self, older_than: timedelta) -> Steps[int]:
        """`prune`: one transaction per batch, so locks stay short while the leader commits."""
        cutoff = self._now() - ns(older_than)
        limit = prune.PRUNE_BATCH
        total = 0
        # Rows an older build finished without a finish time first (`prune.unstamped_stmt`).
        while (yield Step("prune", partial(prune.stamp_batch, limit=limit))) == limit:
            pass
        with self._telemetry.pruning():
            try:
                while True:
                    n: int = yield Step(
                        "prune",
                        partial(prune.prune_batch, cutoff=cutoff, limit=limit),
                    )
                    total += n
                    if n < limit:
                        break
            finally:
                self._telemetry.pruned(total)
        if total and dialects.vacuums(self.engine.dialect):
            try:
                yield Step("vacuum", prune.vacuum)
            except StoreError as exc:  # the rows are gone; autovacuum reclaims them later
                self._log.warning("could not vacuum the task tables after a prune: %s", exc)
        return total

    def _reading_inbox(
        self, limit: int, after: int | None, base: TimeBase
    ) -> Steps[list[InboxItem]]:
        """`read_inbox`: reads, and sets aside the undecodable rows it met, until `limit`."""
        limit = inbox.check_limit(limit)
        after = inbox.check_after(after)
        items: list[InboxItem] = []
        # The commit that drains these items copies their columns instead of encoding them
        # again; only the last read's are kept.
        self._inbox_specs = stored = codec.StoredSpecs(base)
        budget = self.config.inbox_batch_bytes
        while True:
            n = limit - len(items)
            got: inbox.Read = yield Step(
                "read_inbox",
                partial(
                    inbox.read,
                    base=base,
                    limit=n,
                    after=after,
                    stored=stored,
                    budget=budget,
                    max_payload=self.config.max_payload_bytes,
                ),
            )
            items += got.items
            budget -= sum(len(item.spec.payload) for item in got.items)
            if not got.bad or budget <= 0:
                return items
            now = self._now()
            self._set_aside(
                (yield Step("set_aside", partial(inbox.set_aside, bad=got.bad, now_unix_ns=now)))
            )
            after = got.last_id
            if len(items) >= limit:
                return items

    def _taking(
        self, ttl_ns: int, bound: timedelta | None
    ) -> Steps[lease.Lease | StoreUnavailable | None]:
        """One attempt at the lease, within `bound`: taken, held (None), or unreachable. It
        looks first, without locking the row (SQLite: without the write lock a leader needs)."""
        try:
            if not (yield Step("peek", partial(lease.may_take, holder=self.holder), bound)):
                return None
            taken: lease.Lease | None = yield Step("take", self._take_work(ttl_ns), bound)
        except StoreUnavailable as exc:
            return exc
        except DatabaseBehind as exc:
            yield from self._recording_lost(exc)
            with self._lock:
                self._leadership.gap_recorded()
            return None  # tried again at the next poll, on the database's history
        return taken

    def _recording_lost(self, exc: DatabaseBehind) -> Steps[None]:
        """Record what `exc` found missing (and free our lease) for the next recovery; a
        failure only logs."""
        self._log.error(
            "cronoq leader found the database behind it: %s",
            exc,
            extra={"epoch": exc.lost.epoch, "lost_commits": exc.lost.commits},
        )
        try:
            yield Step("record_lost", partial(lease.record_lost, holder=self.holder, lost=exc.lost))
        except StoreError as error:
            self._log.warning("could not record the lost commits in the lease row: %s", error)

    def _releasing(self) -> Steps[None]:
        """Clear the lease, if this instance held one; a failure only logs (it expires)."""
        if self._leadership.epoch is not None:
            try:
                yield Step("release", partial(lease.release, holder=self.holder))
            except StoreError as exc:
                self._log.warning("could not clear the lease; it will expire: %s", exc)
        self._leadership.released()

    def _take_work(self, ttl_ns: int) -> Callable[[Connection], lease.Lease | None]:
        """A take of the lease, checking the row against the highest commit sequence number
        this instance saw land, and its epoch."""
        with self._lock:
            acked, last = self._leadership.acked, self._leadership.acked_epoch
        return partial(lease.take, holder=self.holder, ttl_ns=ttl_ns, acked=acked, last_epoch=last)

    def _renew_work(self, epoch: int) -> Callable[[Connection], bool]:
        """One renewal of our lease under `epoch`; False once another instance took it."""
        ttl = ns(self.config.lease_ttl)
        return partial(
            lease.renew, epoch=epoch, holder=self.holder, ttl_ns=ttl, acked=self._acked()
        )

    def _set_aside(self, moved: int) -> None:
        """`moved` undecodable inbox rows were set aside by this instance."""
        self.inbox_rejected += moved
        self._telemetry.set_aside(moved)

    def _acked(self) -> int:
        """The highest commit sequence number known to have landed (renewals check it)."""
        with self._lock:
            return self._leadership.acked

    def _fence_renewed(self, epoch: int, started: float, seq: int) -> None:
        """Commit `seq` under `epoch`, begun at monotonic time `started`, landed: its fence check
        extended the lease, so it counts as a renewal. (A commit holds the leader row to its
        end, so the keeper's own renewal waits behind a long one.)"""
        with self._lock:
            keeper = self._leadership.fence_renewed(epoch, seq)
        if keeper is not None:
            keeper.renewed(started)
