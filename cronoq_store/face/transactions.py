"""How the store runs a transaction, for both faces, none of it blocking or awaiting by
itself: the kind of transaction each operation runs (`KINDS`, `plan`), the runner of every
transaction (`transaction`), the way of a commit from BEGIN to COMMIT (`commit`), and the one
place database errors are translated (`translated`).

A face (`SqlStore`, `AsyncSqlStore`) only checks a connection out and calls these, blocking
or inside `run_sync`.
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from types import MappingProxyType
from typing import Any, Final, Literal, NamedTuple, TypeVar

from sqlalchemy import Connection
from sqlalchemy import exc as sa_exc

from .. import compat, dialects, execution, lease
from ..config import StoreConfig
from ..errors import Fenced, StoreError, StoreUnavailable
from ..model import TaskId, TimeBase
from ..repository import commit as writing
from ..repository import folding

T = TypeVar("T")


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


class Tx(NamedTuple):
    """How one transaction runs (`transaction`): what `plan` makes of an operation."""

    read_only: bool
    idle: timedelta | None = None
    timeout: timedelta | None = None
    deadline: timedelta | None = None
    unknown: str = RETRIED
    lock: timedelta | None = None
    """How long a statement may wait for a lock (`commit_lock_bound`)."""
    outside: bool = False
    """Run `fn` in autocommit mode, in no transaction (`Kind.OUTSIDE`)."""
    bounds_in_fn: bool = False
    """`fn` sends the idle bound itself, in its own flight (`LEASE_FLIGHTS`)."""

    @property
    def bounds(self) -> dialects.Bounds:
        """What the server is told to bound (`dialects.bound`)."""
        return dialects.Bounds(self.idle, self.timeout, self.lock)


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
            False, config.lease_ttl, timeout, timeout, RETRY_COMMIT, commit_lock_bound(config)
        )
    return Tx(
        False,
        config.lease_ttl,
        deadline=lease_bound(config, deadline),
        bounds_in_fn=op in LEASE_FLIGHTS,
    )


LEASE_FLIGHTS: Final[frozenset[Op]] = frozenset({"take", "renew", "release"})
"""Lease transactions that send their idle bound in their own flight (`lease.take`, `renew`,
`release`, given `idle_ns` = `lease_ttl` by the face): BEGIN, the bound, the statements and
COMMIT in one round trip on PostgreSQL, where `transaction` would send BEGIN and the bound
first (two more)."""


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
    (`dialects.READ_ONLY`); `tx.idle` and `tx.timeout` are `dialects.bound`'s.

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

    BEGIN (SQLite: IMMEDIATE, the engine's listener). The bounds: the lease TTL's idle bound
    and the commit timeout (`dialects.bound`, computed once; on PostgreSQL a statement that
    rides in the flight). The fence (`lease`): on a pipelined connection (psycopg) a
    statement that fails the flight when it matches nothing (`lease.fence_or_fail_stmt`),
    so the writes queued behind it never run, nor does the COMMIT that leaves with the last
    of them; the transaction is then rolled back and the row read for `lease.diagnose`.
    Elsewhere `lease.fence` runs and is checked at once. The writes (`repository.commit`),
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
    line = dialects.line_of(conn)  # worked out once per connection: kept on it
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
            if line.impl.server:  # a file has nothing to bound (`dialects.bound`)
                first = line.impl.bound(conn, tx.bounds, defer=True)
                if first is not None:
                    flight.add(*first)
            if flight.defers:  # pipelined, or batched (MariaDB)
                params = {
                    "b_epoch": c.epoch,
                    "b_holder": c.holder,
                    "b_next_id": c.next_id,
                    "b_ttl": c.ttl_ns,
                    "b_seq": c.seq,
                    "b_acked": c.acked,
                }
                fence_at = flight.add(lease.fence_or_fail_stmt(), params)
            elif not lease.fence(
                conn, epoch=c.epoch, holder=c.holder, next_id=c.next_id, ttl_ns=c.ttl_ns,
                seq=c.seq, acked=c.acked, flight=flight,
            ):  # fmt: skip
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
    but the store's own `begin` (`dialects.STORE_BEGIN`), no statement through SQLAlchemy's
    execution (`Flight.watched`; a recurring schedule's `conn.execute`; an IN list of more
    than `execution.SMALL_IN` ids), no transaction open: a small commit's case, where
    SQLAlchemy's bookkeeping of a transaction cost a batch-1 commit 10 us of CPU."""
    small = execution.SMALL_IN
    if (
        flight.watched
        or folded.recurring
        or len(folded.inserts) > small
        or len(folded.updates) > small
        or len(folded.inbox_taken) > small
        or conn.in_transaction()
    ):
        return conn.begin()
    found = compat.transaction_listeners(conn)
    if found is None or found[1]:
        return conn.begin()
    begin: list[str] = []
    for listener in found[0]:
        sql = getattr(listener, dialects.STORE_BEGIN, None)
        if sql is None:
            return conn.begin()
        begin.append(sql)
    return _Driven(conn, begin, line.dbapi)


class _Driven:
    """A transaction on the DB-API connection, begun as SQLAlchemy's would be (what the store's
    `begin` listener sends: SQLite's BEGIN IMMEDIATE; elsewhere the driver begins one itself),
    and ended by the driver's `commit()`, or `rollback()` when the block raised (`_opened`)."""

    __slots__ = ("_begin", "_conn", "_dbapi")

    def __init__(self, conn: Connection, begin: list[str], dbapi: Any) -> None:
        self._conn = conn
        self._begin = begin
        self._dbapi = dbapi

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
                self._dbapi.commit()
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
