"""How the store runs a transaction, for both faces, none of it blocking or awaiting by
itself: the kind of transaction each operation runs (`KINDS`, `plan`), the runner of every
transaction (`transaction`), the way of a commit (`Committing`: planned before any I/O, the
connection a leader's commits keep, what a landed or fenced commit means for the term; and
`commit`, from BEGIN to COMMIT), and the one place database errors are translated
(`translated`).

A face (`SqlStore`, `AsyncSqlStore`) only checks a connection out and calls these, blocking
or inside `run_sync`.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from datetime import timedelta
from functools import partial
from types import MappingProxyType
from typing import Any, Final, Generic, Literal, NamedTuple, TypeVar

from sqlalchemy import Connection
from sqlalchemy import exc as sa_exc

from .. import codec, compat, dialects, execution, leadership, lease, telemetry
from ..config import StoreConfig
from ..errors import DatabaseBehind, Fenced, StoreError, StoreUnavailable
from ..model import INT64_MAX, Mutation, TaskId, TimeBase
from ..repository import commit as writing
from ..repository import folding

T = TypeVar("T")
H = TypeVar("H")


def ns(d: timedelta) -> int:
    """`d` in nanoseconds."""
    return (d // timedelta(microseconds=1)) * 1000


def lease_bound(config: StoreConfig, deadline: timedelta | None) -> timedelta:
    """How long a take, renewal or release may take: twice the lease TTL (or `deadline`, when
    shorter). It may wait up to one TTL on the leader row's lock for a holder paused inside
    its own transaction (the server ends that one after the TTL idle: `dialects.bound_idle`)
    and then needs its own round trips; past that, no renewal is of use (the keeper has
    stepped down) and a take is better retried."""
    bound = 2 * config.lease_ttl
    return bound if deadline is None else min(deadline, bound)


DATABASE_ERRORS: Final = (StoreError, sa_exc.SQLAlchemyError, OSError)
"""What `translate` makes a `StoreError` of."""


def translate(exc: BaseException) -> BaseException:
    """The `StoreError` that `exc` (one of `DATABASE_ERRORS`) leaves the store as: `exc`
    itself when it is one already (`dialects.translate` strips task data from its chain)."""
    error = dialects.translate(exc)
    if error is not exc and isinstance(exc, sa_exc.IntegrityError):
        return StoreError(f"the batch conflicts with stored tasks (a live key in use?): {error}")
    return error


@contextlib.contextmanager
def translated() -> Iterator[None]:
    """Every database error leaves the store as a `StoreError` (sync and asyncio alike)."""
    try:
        yield
    except DATABASE_ERRORS as exc:
        error = translate(exc)
        if error is exc:
            raise
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


UNBOUNDED: Final = dialects.Bounds(None, None)
"""The bounds of a transaction that touches no leader row: the server's defaults (MariaDB's
idle bound put back on a connection a lease transaction changed)."""


class Tx(NamedTuple):
    """How one transaction runs (`transaction`): what `plan` makes of an operation."""

    read_only: bool
    bounds: dialects.Bounds | None = UNBOUNDED
    """What the server is told to bound (`dialects.bound`), worked out once by `plan`; None
    where the transaction's statements carry their own, in their flight (`LEASE_FLIGHTS`)."""
    deadline: timedelta | None = None
    unknown: str = RETRIED
    outside: bool = False
    """Run `fn` in autocommit mode, in no transaction (`Kind.OUTSIDE`)."""


def plan(op: Op, config: StoreConfig, deadline: timedelta | None = None) -> Tx:
    """How `op` runs under `config` (its kind from `KINDS`). A commit ends within
    `commit_timeout` (each statement bounded by it too, a lock wait by `commit_lock_bound`,
    and its unknown outcome retried by committing the batch again); another lease
    transaction within `lease_bound` of `deadline`, idle no longer than the lease TTL.
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
        commits = dialects.Bounds(config.lease_ttl, timeout, commit_lock_bound(config))
        return Tx(False, commits, timeout, RETRY_COMMIT)
    own = None if op in LEASE_FLIGHTS else dialects.Bounds(config.lease_ttl, None)
    return Tx(False, own, deadline=lease_bound(config, deadline))


LEASE_FLIGHTS: Final[frozenset[Op]] = frozenset({"take", "renew", "release"})
"""Lease transactions whose statements carry the idle bound in their own flight (`lease.take`,
`renew`, `release`, given `idle_ns` = `lease_ttl` by the face): BEGIN, the bound, the
statements and COMMIT in one round trip on PostgreSQL, where `transaction` would send BEGIN
and the bound first (two more). Their `Tx.bounds` is None: `transaction` sends none."""


def commit_lock_bound(config: StoreConfig) -> timedelta:
    """How long a commit's statement may wait for a lock: a third of `lease_ttl` -
    `lease_renew`, or `LOCK_SHARE` of `commit_timeout` if shorter.

    Under `commit_timeout`, so the server gives up a blocked statement before the deadline
    cuts the session off: where the COMMIT rides in the flight behind it (PostgreSQL), the
    server fails the flight and the commit is rolled back, not of unknown outcome.

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
    return min(config.commit_timeout * LOCK_SHARE, (config.lease_ttl - config.lease_renew) / 3)


LOCK_SHARE: Final = 0.8
"""The share of `commit_timeout` a commit's statement may wait for a lock
(`commit_lock_bound`): the rest is the server's answer's way back."""


def transaction(
    conn: Connection,
    fn: Callable[[Connection], T],
    tx: Tx,
    armed: execution.Deadline | None = None,
) -> T:
    """Run `fn` in one transaction on `conn` as `tx` says: the runner of every transaction
    `SqlStore._transact` and `AsyncSqlStore._transact` start (the latter inside `run_sync`), but a
    commit's (`commit`), so both
    faces keep the same rules. `tx.read_only` marks it for SQLite's deferred BEGIN
    (`dialects.READ_ONLY`); `tx.bounds`, when given, are sent first (`dialects.bound`).

    `tx.deadline`: the whole transaction, COMMIT included, ends within it whatever the server
    or the network does; the one place a commit's timeout is enforced. `armed` is that
    deadline when it was armed before connecting (`execution.bounded`: the faces' `_transact`),
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
    info = conn.info  # kept: once invalidated, `conn.info` would connect again
    info.pop(execution.COMMIT_SENT, None)
    committing = False
    try:
        with conn.begin():
            if tx.bounds is not None and (impl := dialects.dialect_of(conn)).server:
                impl.bound(conn, tx.bounds, defer=False)
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
        _failed(conn, info, exc, tx, armed, committing)
        raise
    if armed is not None:
        _settled(conn, tx, armed)
    return result


def _failed(
    conn: Connection,
    info: dict[Any, Any],
    exc: BaseException,
    tx: Tx,
    armed: execution.Deadline | None,
    committing: bool,
) -> None:
    """A transaction raised `exc`: drop `conn` when it was interrupted past its deadline or
    a server refused a write; raise what the caller may know of an interrupted one (else
    the caller raises `exc`). `info` is `conn.info` read before the transaction: reading it
    off a connection the failure invalidated would connect again, past the deadline."""
    overdue = armed is not None and execution.WATCHDOG.settle(armed)
    if overdue or (isinstance(exc, sa_exc.DBAPIError) and dialects.read_only(exc)):
        _drop(conn, exc)
    if overdue and not isinstance(exc, StoreError):  # the store's own (Fenced) stands
        sent = committing or bool(info.get(execution.COMMIT_SENT))
        raise StoreUnavailable(_overdue(tx.deadline, sent, tx.unknown)) from exc


def _settled(conn: Connection, tx: Tx, armed: execution.Deadline) -> None:
    """The transaction ended: unless the watchdog interrupted it meanwhile. COMMIT returned,
    but after the interruption: a cancelled wait for a standby returns success with a
    warning, so success here proves nothing."""
    if execution.WATCHDOG.settle(armed):
        _drop(conn, None)
        raise StoreUnavailable(_overdue(tx.deadline, True, tx.unknown))


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


class Commit(NamedTuple):
    """A commit ready to run (`Face._commit_plan`): the batch folded and checked before any
    I/O, and what its fence checks and raises."""

    epoch: int
    holder: str
    seq: int
    """This commit's sequence number: the fence raises the row's `commit_seq` to it."""
    acked: int
    """The highest sequence number known to have landed: the fence's floor."""
    next_id: int
    """The first task id never used: the fence raises the row's high-water to it."""
    ttl_ns: int
    base: TimeBase
    folded: folding.Folded
    outputs: Sequence[tuple[TaskId, bytes]]
    started: float
    """The monotonic time it began: once landed its fence counts as a renewal from there."""


HOLD_MIN_POOL: Final = 3
"""The smallest pool (`StoreConfig.pool_size`) from which a leader keeps a connection for its
commits (`Committing._keep_held`)."""

NOT_TRACED: Final = contextlib.nullcontext()
"""Around a commit when no SDK was configured as the term began (`Committing._traced`)."""


class Committing(Generic[H]):
    """The way of a commit on a face (`face.Face`), up to its transaction and back: the batch
    planned before any I/O (`_commit_plan`), the transaction (`commit`, which a face's
    `_transact_commit` runs on the connection the last commit kept), and what its landing or
    its fencing means for the term (`_committing`). Both faces drive `_committing`; the
    blocking face drives a landed commit's own way itself (`SqlStore.commit`)."""

    _lock: threading.Lock
    _holds: bool
    """Whether commits keep their connection for the next (`_keep_held`)."""
    _held: tuple[H, float] | None
    _leadership: leadership.Leadership[Any]
    _inbox_specs: codec.StoredSpecs | None
    _max_payload: int | None
    _ttl_ns: int
    _telemetry: telemetry.Telemetry
    _traced: bool
    """Whether commits are measured and traced (`Telemetry.commit`): decided as a term
    begins, when an SDK is configured (`telemetry.configured`), not per commit."""
    holder: str

    def _end_term(
        self, why: str | StoreError, level: int = logging.ERROR, *, about: Any = None,
        released: bool = False,
    ) -> Any:  # fmt: skip
        raise NotImplementedError

    def _recording_lost(self, exc: DatabaseBehind) -> Generator[Any, Any, None]:
        raise NotImplementedError

    @staticmethod
    def _now() -> int:
        """The host's clock in Unix nanoseconds, which new tasks are stamped with."""
        return time.time_ns()

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
        of its CPU (a sixth on SQLite), and the connection's facts (`dialects.Line`) are
        worked out once. Only commits run on it: other transactions change a connection's
        execution options (a read's deferred BEGIN, autocommit for a VACUUM), which the pool
        resets only when it comes back. It goes back when a commit on it fails, when
        leadership ends (`_drop_held`), and at `close`.
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

    def _commit_plan(
        self,
        epoch: int,
        base: TimeBase,
        batch: Sequence[Mutation],
        outputs: Sequence[tuple[TaskId, bytes]],
    ) -> Commit:
        """A commit ready to run (`commit`): `Fenced` at once if `epoch` does not lead; its
        sequence number and the fence's floor (`leadership.Leadership`); the batch folded, and
        bad values refused, before any I/O."""
        with self._lock:
            numbers = self._leadership.begin_commit(epoch)
        if numbers is None:
            raise Fenced(f"epoch {epoch} does not lead")
        folded = folding.fold(
            base, self._now(), batch, self._inbox_specs, max_payload=self._max_payload
        )
        # The first id never used, saturated: after 2**63 - 1 it stays there (`recover` reads
        # that as "no id left below 2**63").
        next_id = min(max(folded.inserts, default=-1) + 1, INT64_MAX)
        return Commit(
            epoch,
            self.holder,
            *numbers,
            next_id,
            self._ttl_ns,
            base,
            folded,
            folding.checked_outputs(outputs) if outputs else (),
            time.monotonic(),
        )

    def _committing(
        self,
        epoch: int,
        base: TimeBase,
        batch: Sequence[Mutation],
        outputs: Sequence[tuple[TaskId, bytes]],
    ) -> Generator[Any, Any, None]:
        """`commit`, as `face.Steps`: the batch folded (`_commit_plan`), then its one
        transaction (yielded: the `Commit` a face's `_transact_commit` carries out). Landed,
        its fence check extended the lease: a renewal. A fenced one ends the term; one that
        found the database behind records the gap first.

        The collector is paused from the fold to the COMMIT (as `execution.collection_paused`
        pauses it, inline: a commit's way enters no module it can spare): a batch's rows are
        all kept until written, so its passes would find no garbage."""
        with self._telemetry.commit(epoch, batch) if self._traced else NOT_TRACED:
            c = None
            paused = gc.isenabled()
            try:
                if paused:
                    gc.disable()
                c = self._commit_plan(epoch, base, batch, outputs)
                yield c
            except (DatabaseBehind, Fenced) as exc:
                if paused:
                    gc.enable()
                    paused = False
                if c is None:  # refused before any I/O: this epoch does not lead
                    raise
                if isinstance(exc, DatabaseBehind):
                    yield from self._recording_lost(exc)
                yield partial(self._end_term, exc, about=epoch)
                raise exc
            finally:
                if paused:
                    gc.enable()
            with self._lock:
                keeper = self._leadership.fence_renewed(epoch, c.seq)
            if keeper is not None:
                keeper.renewed(c.started)


def commit(
    conn: Connection,
    c: Commit,
    tx: Tx,
    armed: execution.Deadline | None = None,
    *,
    optimistic: bool = True,
) -> None:
    """The way of a commit, from BEGIN to COMMIT, in one transaction on `conn` under `tx`
    (`plan("commit")`): the bounds, the fence check, the folded writes, the COMMIT.

    BEGIN (SQLite: IMMEDIATE, the engine's listener). The bounds: `tx.bounds`, worked out once
    (`plan`): the lease TTL's idle bound and the commit timeout (`dialects.bound`; on
    PostgreSQL a statement that rides in the flight). The fence: `lease` gives only the
    statement and the diagnosis of a miss. On a pipelined or batched connection the
    statement fails the flight when it matches nothing (`lease.fence_or_fail_stmt`), so the
    writes queued behind it never run, nor does the COMMIT that leaves with the last of them;
    the transaction is then rolled back and the row read for `lease.diagnose`. Elsewhere
    `lease.fence_stmt` runs at once (SQLite: given the host's clock) and a miss is diagnosed
    (`lease.diagnose`) there. The writes (`repository.commit`),
    in the same flight. Then the COMMIT: pipelined, in the last flight; else the end of the
    transaction. `Fenced` (or what the diagnosis raises) when this instance does not lead;
    a live-key clash inside the batch is `InvalidValue` (`folding.same_live_key`). The
    deadline's rules are `transaction`'s.

    `optimistic`: pipelined, the live transitions ride in the flight behind a guard that
    fails it on a revival (`repository.commit.RevivalGuard`); the commit then runs again,
    not optimistic (`_revived_again`).
    """
    if armed is None and tx.deadline is not None:  # not armed before connecting: arm it here
        with execution.bounded(tx.deadline.total_seconds()) as own:
            return commit(conn, c, tx, own, optimistic=optimistic)
    line = getattr(conn, dialects.LINE, None) or dialects.line_of(conn)  # kept on it
    if armed is not None:
        execution.WATCHDOG.bind(armed, line.interrupter)
    info = line.info
    info.pop(execution.COMMIT_SENT, None)
    committing = False
    fence_at = -1
    guard = writing.RevivalGuard() if optimistic else None
    flight = execution.Flight(conn, line)  # no I/O yet: how its statements run, worked out
    try:
        with _opened(conn, flight, c.folded, line):  # the collector paused (`Face._committing`)
            if line.impl.server and tx.bounds is not None:  # a file has nothing to bound
                first = line.impl.bound(conn, tx.bounds, defer=True)
                if first is not None:
                    flight.add(*first)
            params = {
                "b_epoch": c.epoch,
                "b_holder": c.holder,
                "b_next_id": c.next_id,
                "b_ttl": c.ttl_ns,
                "b_seq": c.seq,
                "b_acked": c.acked,
            }
            if line.host_clock:  # no server: the database's clock is the host's, given here
                params["b_host_now"] = time.time_ns()
            if flight.defers:  # pipelined, or batched (MariaDB): a miss fails the flight
                fence_at = flight.add(lease.fence_or_fail_stmt(), params)
            elif flight.send()[flight.add(lease.fence_stmt(), params)].rowcount != 1:
                lease.diagnose(conn, epoch=c.epoch, holder=c.holder, acked=c.acked)
                raise Fenced(lease.FENCED.format(epoch=c.epoch))
            writing.write(conn, c.base, c.folded, c.outputs, flight, guard)
            flight.commit()  # pipelined: the COMMIT leaves in this flight; else at the end
            if armed is not None and time.monotonic() > armed.at and not execution.ended(conn):
                raise StoreUnavailable(
                    f"the transaction did not finish within {tx.deadline}; rolled back"
                )
            committing = True
        info[dialects.COMMITTED] = True  # nothing left for the pool to roll back
    except BaseException as exc:
        if guard is not None and guard.failed(exc):
            return _revived_again(conn, c, tx, armed)
        fenced = fence_at >= 0 and flight.failed == fence_at and lease.fence_failed(exc)
        error = _commit_error(conn, c, exc, fenced)
        _failed(conn, info, exc if error is None else error, tx, armed, committing)
        if error is None:
            raise
        raise error from (None if fenced else exc)
    if armed is not None:
        _settled(conn, tx, armed)


def _revived_again(conn: Connection, c: Commit, tx: Tx, armed: execution.Deadline | None) -> None:
    """The optimistic flight found a revival (its guard failed it, so it was rolled back with
    nothing written): commit the batch again, the way that restores revived tasks' rows,
    under the same deadline."""
    commit(conn, c, tx, armed, optimistic=False)


def _opened(
    conn: Connection, flight: execution.Flight, folded: folding.Folded, line: dialects.Line
) -> contextlib.AbstractContextManager[Any]:
    """The commit's transaction: SQLAlchemy's (`Connection.begin`), or, where nothing but the
    store would see the difference, the driver's own (`_Driven`): no listener of the engine's
    but the store's own `begin` (`dialects.Line.driver_begin`, asked on each commit: an app
    may add one at any time), no statement through SQLAlchemy's execution (`Flight.watched`; a
    recurring schedule's `conn.execute`; an IN list of more than `execution.SMALL_IN` ids),
    no transaction open: a small commit's case, where SQLAlchemy's bookkeeping of a
    transaction cost a batch-1 commit 10 us of CPU."""
    small = execution.SMALL_IN
    if (
        flight.watched
        or folded.recurring
        or len(folded.inserts) > small
        or len(folded.updates) > small
        or len(folded.inbox_taken) > small
        or conn.in_transaction()
        or (begin := line.driver_begin()) is None
    ):
        return conn.begin()
    return _Driven(conn, begin, line)


class _Driven:
    """A transaction on the DB-API connection, begun as SQLAlchemy's would be (what the store's
    `begin` listener sends: SQLite's BEGIN IMMEDIATE; elsewhere the driver begins one itself),
    and ended by the driver's commit (`dialects.Line.commit`), or `rollback()` when the block
    raised (`_opened`)."""

    __slots__ = ("_begin", "_commit", "_conn", "_dbapi")

    def __init__(self, conn: Connection, begin: tuple[str, ...], line: dialects.Line) -> None:
        self._conn = conn
        self._begin = begin
        self._dbapi = line.dbapi
        self._commit = line.commit

    def __enter__(self) -> None:
        for sql in self._begin:
            execution.run_on(self._conn, self._dbapi, sql, None)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        conn = self._conn
        if conn.in_transaction():  # SQLAlchemy began one after all: it ends with this one
            if kind is None:
                conn.commit()
            else:
                conn.rollback()
        if kind is None:
            try:
                self._commit()
                return
            except conn.dialect.loaded_dbapi.Error as error:
                self._rollback()
                raise compat.driver_error(conn, error, "COMMIT") from error
        self._rollback()

    def _rollback(self) -> None:
        """Roll back, as SQLAlchemy's transaction would; a connection that cannot is lost (its
        holder closes it), and the error that ended the block is what the caller sees."""
        with contextlib.suppress(Exception):
            self._dbapi.rollback()


def _commit_error(
    conn: Connection, c: Commit, exc: BaseException, fenced: bool
) -> StoreError | None:
    """What a commit that raised `exc` raises instead, if anything: when the pipelined fence
    failed (`fenced`), `Fenced` or what `lease.diagnose` finds (read in a new transaction:
    the failed one is rolled back); for a live-key clash inside the batch, `InvalidValue`
    (else `translated` says "stored tasks")."""
    if fenced:
        try:
            lease.diagnose(conn, epoch=c.epoch, holder=c.holder, acked=c.acked)
        except StoreError as diagnosed:
            return diagnosed
        return Fenced(lease.FENCED.format(epoch=c.epoch))
    if isinstance(exc, sa_exc.IntegrityError):
        return folding.same_live_key(c.folded)
    return None
