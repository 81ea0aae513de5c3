"""The leader lease: who may write, under which fencing epoch, until when.

Taking the lease bumps the epoch; the fence check of every commit (`fence`) matches only the
current epoch and holder, so a paused old leader can never write after a takeover. Every commit
also raises the row's `commit_seq` to its own sequence number, and fences and renewals match only
while it is at least the leader's last acknowledged one: a database that went back in time (an
asynchronous failover losing its tail) shows up as `DatabaseBehind`, never as a fence that
passes on a rolled-back row. Expiry is
written and compared on the database's clock (`dialects.db_now_ns`). `store.Keeper` renews the lease
from threads and steps down on the holder's own monotonic clock.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import typing
import uuid
from datetime import timedelta
from functools import cache
from typing import Any, Final, NamedTuple

from sqlalchemy import (
    BigInteger,
    Connection,
    Delete,
    Insert,
    Integer,
    Row,
    Select,
    Update,
    and_,
    bindparam,
    case,
    cast,
    delete,
    func,
    insert,
    literal,
    literal_column,
    null,
    or_,
    select,
    update,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.sql.elements import ColumnElement

from . import builds, codec, dialects, execution
from .dialects import db_now_ns
from .errors import BuildTooOld, DatabaseBehind, LeaderRowMissing
from .model import LostCommits
from .schema import leader, recurring, writers

log = logging.getLogger(__name__)

MAX_EPOCH: Final = 32767
"""Epochs stay within 1..32767 so epoch-prefixed task ids fit a signed 64-bit integer."""


def next_epoch(epoch: int) -> int:
    """The epoch after `epoch`, wrapping 32767 to 1 (what `take_stmt` computes in SQL)."""
    return 1 if epoch >= MAX_EPOCH or epoch < 0 else epoch + 1


def new_holder() -> str:
    """A name for this store instance, unique across hosts and processes."""
    host = socket.gethostname()[:64]
    return f"{host}:{os.getpid()}:{uuid.uuid4().hex[:16]}"[: codec.HOLDER_MAX]


@cache
def lease_view_stmt() -> Select[Any]:
    """The lease row and the database's clock, unlocked: for operators' reads, which must never
    block a commit."""
    return select(
        leader.c.epoch,
        leader.c.holder,
        leader.c.expires_unix_ns,
        db_now_ns().label("now"),
    ).where(leader.c.id == 1)


@cache
def take_stmt() -> Update:
    """Take the lease for `b_holder` under the next epoch, until `b_ttl` from now, if it is free,
    ours, or expired: expiry is compared here, in SQL, on the database's clock.

    One conditional update, so the check and the take are one atomic step under the row lock; a
    host whose clock runs ahead has no say in it.
    """
    wraps = or_(leader.c.epoch >= MAX_EPOCH, leader.c.epoch < 0)
    return (
        update(leader)
        .where(
            leader.c.id == 1,
            _writable(),
            or_(
                leader.c.holder.is_(None),
                leader.c.holder == bindparam("b_holder"),
                leader.c.expires_unix_ns <= db_now_ns(),
            ),
        )
        .values(
            epoch=case((wraps, 1), else_=leader.c.epoch + 1),
            holder=bindparam("b_holder"),
            expires_unix_ns=db_now_ns() + bindparam("b_ttl"),
        )
    )


def lease_view(conn: Connection) -> Row[Any]:
    """`lease_view_stmt`'s row; `LeaderRowMissing` when the lease row is gone."""
    row = conn.execute(lease_view_stmt()).one_or_none()
    if row is None:
        raise LeaderRowMissing()
    return row


@cache
def peek_stmt() -> Select[Any]:
    """`lease_view_stmt` and the schema's oldest writer: what a standby looks at before it
    tries to take the lease."""
    return lease_view_stmt().add_columns(_oldest_writer().label("floor"))


def may_take(conn: Connection, *, holder: str) -> bool:
    """Whether the lease looks free, expired or ours, read without locking anything.

    Standbys look before they try: the take itself needs the write lock (all of SQLite's).
    `BuildTooOld` when a migration made the schema one this build may not write. Pipelined,
    the read is its transaction's one flight (BEGIN, SELECT, COMMIT): one round trip.
    """
    flight = execution.Flight(conn)
    at = flight.add(peek_stmt())
    rows = flight.commit()[at].rows
    if not rows:
        raise LeaderRowMissing()
    _epoch, row_holder, expires, now, floor = rows[0]
    if int(floor) > builds.BUILD:
        raise BuildTooOld(builds.refusal(int(floor)), floor=int(floor))
    return bool(row_holder is None or row_holder == holder or expires <= now)


@cache
def lock_stmt() -> Select[Any]:
    """The lease row, locked: waits out a commit or takeover in flight (SQLite: no-op)."""
    return select(leader.c.id).where(leader.c.id == 1).with_for_update()


def lock(conn: Connection) -> None:
    """Wait for the lease row's lock, so that a take after it runs at once."""
    if conn.execute(lock_stmt()).one_or_none() is None:
        raise LeaderRowMissing()


@cache
def epoch_stmt() -> Select[Any]:
    """The current epoch and commit sequence (read back by the transaction that just took the
    lease: the new leader's commits number on from there)."""
    return select(leader.c.epoch, leader.c.commit_seq).where(leader.c.id == 1)


@cache
def diagnosis_stmt() -> Select[Any]:
    """Why a fence or renewal matched nothing: the row as it is."""
    return select(
        leader.c.epoch, leader.c.holder, leader.c.commit_seq, _oldest_writer().label("floor")
    ).where(leader.c.id == 1)


def _oldest_writer() -> ColumnElement[int]:
    """The schema's oldest writer (`cronoq_writers`; 0 without its row), as a scalar subquery
    of the statement that needs it."""
    floor = select(writers.c.oldest_writer).where(writers.c.id == _ONE).scalar_subquery()
    return func.coalesce(floor, literal_column("0"))


_ONE: Final = literal_column("1", Integer)
"""The one row's id, in the text of a statement every commit runs (the fence): a constant
parameter would be a value to fill in on each run (`dialects.compiled`)."""


def _writable() -> ColumnElement[bool]:
    """The schema lets this build write: its oldest writer is at most this build
    (`cronoq_store.builds`). In the statement itself, this build a constant in its text: no
    parameter, no round trip."""
    return _oldest_writer() <= literal_column(str(builds.BUILD))


def _held() -> ColumnElement[bool]:
    """The lease row while `b_holder` holds it under `b_epoch`, and it holds every commit we
    acknowledged (`b_acked`), on a schema this build may write."""
    return and_(
        leader.c.id == _ONE,
        _writable(),
        leader.c.epoch == bindparam("b_epoch"),
        leader.c.holder == bindparam("b_holder"),
        leader.c.commit_seq >= bindparam("b_acked"),
    )


@cache
def renew_stmt() -> Update:
    """Extend our lease by `b_ttl`; matches nothing once another instance took it."""
    return update(leader).where(_held()).values(expires_unix_ns=db_now_ns() + bindparam("b_ttl"))


@cache
def fence_stmt() -> Update:
    """Fence check, the first write of every commit: extend our lease, raise the id high-water
    and the commit sequence (`b_seq`; raised, never lowered, as two commits of one leader may
    land out of order), clear a gap recorded under another epoch (it has been recovered from).

    It matches only while we hold the lease under our epoch. Its row lock serializes the commit
    against a takeover on PostgreSQL and MySQL (a plain read of the epoch would not, under READ
    COMMITTED); SQLite serializes all writers anyway.
    """
    return (
        update(leader)
        .where(_held())
        .values(
            next_id=case(
                (leader.c.next_id < bindparam("b_next_id"), bindparam("b_next_id")),
                else_=leader.c.next_id,
            ),
            expires_unix_ns=db_now_ns() + bindparam("b_ttl"),
            commit_seq=case(
                (leader.c.commit_seq < bindparam("b_seq"), bindparam("b_seq")),
                else_=leader.c.commit_seq,
            ),
            lost_epoch=case(
                (leader.c.lost_epoch == bindparam("b_epoch"), leader.c.lost_epoch), else_=null()
            ),
        )
    )


@cache
def record_lost_stmt() -> Update:
    """Record a gap the leader `b_holder` found under `b_epoch`, and free its lease if the row
    still names it (so a standby need not wait out the rolled-back expiry)."""
    ours = and_(leader.c.epoch == bindparam("b_epoch"), leader.c.holder == bindparam("b_holder"))
    return (
        update(leader)
        .where(leader.c.id == 1)
        .values(
            lost_epoch=bindparam("b_epoch"),
            lost_commits=bindparam("b_commits"),
            lost_unix_ns=db_now_ns(),
            holder=case((ours, null()), else_=leader.c.holder),
            expires_unix_ns=case((ours, 0), else_=leader.c.expires_unix_ns),
        )
    )


@cache
def release_stmt() -> Update:
    """Give the lease up at once."""
    return (
        update(leader)
        .where(leader.c.id == 1, leader.c.holder == bindparam("b_holder"))
        .values(holder=None, expires_unix_ns=0)
    )


class Lease(NamedTuple):
    """A lease just taken."""

    epoch: int
    """The new fencing epoch."""
    started: float
    """The monotonic time the lease runs from."""
    commit_seq: int
    """The row's commit sequence when taken: this leader's commits number on from it."""


def _take(conn: Connection, *, holder: str, ttl_ns: int) -> tuple[int, int] | None:
    """Take the lease if it is free, expired or already ours; the new epoch and the row's
    commit sequence, or None.

    Expiry is judged on the database's clock, so a host whose clock runs ahead cannot steal a
    live lease. The epoch rises by one per take (`next_epoch`), never on renewal.
    """
    taken = conn.execute(take_stmt(), {"b_holder": holder, "b_ttl": ttl_ns}).rowcount == 1
    if not taken:
        return None
    epoch, seq = conn.execute(epoch_stmt()).one()
    return int(epoch), int(seq)


def try_take(conn: Connection, *, holder: str, ttl_ns: int) -> int | None:
    """`_take`'s epoch: the new epoch, or None."""
    taken = _take(conn, holder=holder, ttl_ns=ttl_ns)
    return None if taken is None else taken[0]


def take(
    conn: Connection,
    *,
    holder: str,
    ttl_ns: int,
    acked: int = 0,
    last_epoch: int = 0,
    idle_ns: int | None = None,
) -> Lease | None:
    """`try_take` after waiting for the lease row's lock, with `probe`: the lease, or None.

    The time is read once the lock is ours, not before: a killed leader's commit can hold it for
    a while, and a lease timed from before that wait would be lost on arrival.

    `acked` is the highest commit sequence number this instance saw land (under `last_epoch`):
    a row below it means the database lost commits of ours (an instance that lost its lease in
    the outage of a lossy failover retakes it there), and raises `DatabaseBehind`, the take
    rolled back with it.

    Pipelined (`execution.Flight`), the take, the probe and the COMMIT leave in one flight
    (`_take_in_flight`); batched (MariaDB), the take and the probe in one packet, the COMMIT
    in a second (`_take_in_batch`). `idle_ns`, when given, is the transaction's idle bound,
    sent in that flight (`dialects.bound`) by a caller that did not send it first.
    """
    flight = _flight(conn, idle_ns)
    if flight.pipelined:
        return _take_in_flight(
            conn, flight, holder=holder, ttl_ns=ttl_ns, acked=acked, last_epoch=last_epoch
        )
    if flight.batched:
        return _take_in_batch(
            flight, holder=holder, ttl_ns=ttl_ns, acked=acked, last_epoch=last_epoch
        )
    lock(conn)
    started = time.monotonic()
    taken = _take(conn, holder=holder, ttl_ns=ttl_ns)
    if taken is None:
        return None
    probe(conn, holder=holder)  # after the take: a standby's attempt on a held lease writes nothing
    epoch, seq = taken
    if seq < acked:
        raise _behind(seq, acked, last_epoch)
    return Lease(epoch, started, seq)


def _behind(seq: int, acked: int, last_epoch: int) -> DatabaseBehind:
    """What a take that found the row below our acknowledged commits raises."""
    return DatabaseBehind(
        f"the database holds commit {seq} of the lease's sequence, but this instance "
        f"committed up to {acked} under epoch {last_epoch}: up to {acked - seq} "
        "acknowledged commits are gone (an asynchronous failover that lost its tail?)",
        lost=LostCommits(epoch=last_epoch, commits=acked - seq, noticed_unix_ns=time.time_ns()),
    )


def _flight(conn: Connection, idle_ns: int | None) -> execution.Flight:
    """A flight for a lease transaction, opening with its idle bound when `idle_ns` is given
    (MySQL's, a session setting, is sent at once, and only when it changes)."""
    flight = execution.Flight(conn)
    if idle_ns is not None:
        idle = timedelta(microseconds=idle_ns // 1000)
        bounds = dialects.bound(conn, idle=idle, timeout=None, defer=True)
        if bounds is not None:
            flight.add(*bounds)
    return flight


def _arrived_ns() -> ColumnElement[int]:
    """When the server received the statement, in Unix nanoseconds on its clock
    (PostgreSQL's `statement_timestamp()`): never before the client sent it."""
    seconds = func.extract("epoch", func.statement_timestamp())
    return cast(seconds * 1_000_000_000, BigInteger)


@cache
def lock_flight_stmt() -> Select[Any]:
    """`lock_stmt`, with when the server received it (`_arrived_ns`, before any wait)."""
    return select(leader.c.id, _arrived_ns()).where(leader.c.id == 1).with_for_update()


@cache
def take_flight_stmt() -> Update:
    """`take_stmt` answering with the new epoch, the row's commit sequence and the instant
    the expiry was computed from (`b_ttl` off it, on the database's clock): one row when
    taken, none otherwise.

    It fails (division by zero) when the row holds fewer commits than `b_acked`, so that a
    take on a database that went back in time commits nothing (`DatabaseBehind`)."""
    behind = case((leader.c.commit_seq < bindparam("b_acked"), 0), else_=1)
    return take_stmt().returning(
        leader.c.epoch,
        leader.c.commit_seq,
        (leader.c.expires_unix_ns - bindparam("b_ttl")).label("taken_at"),
        (literal(1, Integer) // behind).label("ok"),
    )


@cache
def probe_if_taken_stmt() -> Insert:
    """`probe`'s write, of a row only where the take before it in the transaction succeeded
    (the lease row names `b_holder`, on a schema this build may write): a flight cannot wait
    for the take's answer to decide."""
    row = (
        select(
            bindparam("b_name", type_=recurring.c.name.type),
            literal("{}", recurring.c.spec.type),
            bindparam("b_bytes", type_=recurring.c.template_payload.type),
        )
        .where(leader.c.id == 1, leader.c.holder == bindparam("b_holder"), _writable())
        .select_from(leader)
    )
    return insert(recurring).from_select(["name", "spec", "template_payload"], row)


def _take_in_flight(
    conn: Connection,
    flight: execution.Flight,
    *,
    holder: str,
    ttl_ns: int,
    acked: int,
    last_epoch: int,
) -> Lease | None:
    """`take` in one flight: the row's lock (`lock_flight_stmt`), `take_flight_stmt`, the
    probe (`probe_if_taken_stmt`) and its removal, and the COMMIT.

    The lease runs from when the flight left plus, on the server's clock, the time from the
    lock's arrival to the instant the take computed the expiry from: never later than that
    instant (the server received the lock after the flight left), so the holder steps down
    no later than the expiry written says; and a wait for the lock behind a killed leader's
    commit, counted in, does not use the lease up on arrival."""
    name = f"cronoq:take-probe:{holder}"[: codec.NAME_MAX]
    params = {"b_holder": holder, "b_name": name, "b_bytes": os.urandom(TAKE_PROBE_BYTES)}
    locked = flight.add(lock_flight_stmt())
    at = flight.add(take_flight_stmt(), {"b_holder": holder, "b_ttl": ttl_ns, "b_acked": acked})
    flight.add(probe_if_taken_stmt(), params)
    flight.add(_probe_stmts()[1], {"b_name": name})
    sent = time.monotonic()
    try:
        ran = flight.commit()
    except sa_exc.DBAPIError as exc:
        if flight.failed != at or getattr(exc.orig, "sqlstate", None) != _DIVISION_BY_ZERO:
            raise
        # Behind: nothing was committed. End the failed transaction, read the row's sequence
        # in a new one (the caller's rollback then ends that one).
        conn.connection.dbapi_connection.rollback()  # type: ignore[union-attr]
        _epoch, seq = conn.execute(epoch_stmt()).one()
        raise _behind(int(seq), acked, last_epoch) from None
    if not ran[locked].rows:
        raise LeaderRowMissing()
    if not ran[at].rows:
        return None
    epoch, seq, taken_at, _ok = ran[at].rows[0]
    waited = max(0, int(taken_at) - int(ran[locked].rows[0][1]))
    started = min(time.monotonic(), sent + waited / 1e9)
    return Lease(int(epoch), started, int(seq))


@cache
def lock_batch_stmt() -> Select[Any]:
    """`lock_stmt`, with the database's clock when the statement began (MariaDB's
    `UTC_TIMESTAMP()` is the statement's start: before any wait for the lock)."""
    return select(leader.c.id, db_now_ns()).where(leader.c.id == 1).with_for_update()


@cache
def taken_stmt() -> Select[Any]:
    """`epoch_stmt` and the expiry just written: read back after a take in its batch."""
    return select(leader.c.epoch, leader.c.commit_seq, leader.c.expires_unix_ns).where(
        leader.c.id == 1
    )


def _take_in_batch(
    flight: execution.Flight, *, holder: str, ttl_ns: int, acked: int, last_epoch: int
) -> Lease | None:
    """`take` in two packets (MariaDB's multi-statement batches): the row's lock
    (`lock_batch_stmt`), `take_stmt`, the row read back (`taken_stmt`), the probe
    (`probe_if_taken_stmt`) and its removal; then, taken and not behind, the COMMIT. Behind
    (`DatabaseBehind`) or not taken, the caller's transaction ends it, nothing of ours
    written.

    The lease runs from when the packet left plus, on the server's clock, the time from the
    lock statement's start to the take's (the expiry written less `ttl_ns`), as in
    `_take_in_flight`."""
    name = f"cronoq:take-probe:{holder}"[: codec.NAME_MAX]
    params = {"b_holder": holder, "b_name": name, "b_bytes": os.urandom(TAKE_PROBE_BYTES)}
    locked = flight.add(lock_batch_stmt())
    at = flight.add(take_stmt(), {"b_holder": holder, "b_ttl": ttl_ns})
    row = flight.add(taken_stmt())
    flight.add(probe_if_taken_stmt(), params)
    flight.add(_probe_stmts()[1], {"b_name": name})
    sent = time.monotonic()
    ran = flight.send()
    if not ran[locked].rows:
        raise LeaderRowMissing()
    if ran[at].rowcount != 1:
        return None
    epoch, seq, expires = ran[row].rows[0]
    if int(seq) < acked:
        raise _behind(int(seq), acked, last_epoch)
    flight.commit()
    waited = max(0, int(expires) - ttl_ns - int(ran[locked].rows[0][1]))
    started = min(time.monotonic(), sent + waited / 1e9)
    return Lease(int(epoch), started, int(seq))


TAKE_PROBE_BYTES: Final = 1 << 20
"""What a take writes (and removes) besides the lease row (`probe`): room for a commit of
about this size must be there for a take to succeed."""


@cache
def _probe_stmts() -> tuple[Insert, Delete]:
    name: Any = bindparam("b_name")
    return (
        insert(recurring).values(name=name, spec="{}", template_payload=bindparam("b_bytes")),
        delete(recurring).where(recurring.c.name == name),
    )


def probe(conn: Connection, *, holder: str) -> None:
    """Write `TAKE_PROBE_BYTES` of incompressible bytes and remove them, in the take's
    transaction, so that a take fails where a commit would: a database out of disk.

    A take rewrites only the lease row, which fits where it stands (PostgreSQL's heap page,
    SQLite's reused WAL frames) on a disk too full for any commit of tasks: takes succeeded
    there, one epoch after another, while every commit failed. With the probe the take fails
    too (`StoreUnavailable`, the full disk named) and no epoch is spent on a term that could
    not commit. The row (a schedule named after this holder) is never visible: it goes in the
    same transaction."""
    put, remove = _probe_stmts()
    name = f"cronoq:take-probe:{holder}"[: codec.NAME_MAX]
    execution.run_stmt(conn, put, {"b_name": name, "b_bytes": os.urandom(TAKE_PROBE_BYTES)})
    execution.run_stmt(conn, remove, {"b_name": name})


class _Diagnosis(NamedTuple):
    """The leader row as `diagnosis_stmt` reads it."""

    epoch: int
    holder: str | None
    commit_seq: int
    floor: int


def diagnose(conn: Connection, *, epoch: int, holder: str, acked: int) -> None:
    """Why our fence or renewal matched nothing: return when another instance took the lease
    (fenced, as designed); raise `LeaderRowMissing` when the row is gone, `DatabaseBehind`
    when the database went back in time.

    Back in time: the row still names us but holds fewer commits than we acknowledged; or it
    names our epoch under another holder, or an earlier epoch than ours (within half the epoch
    range, which wraps), either of which no takeover produces (epochs rise by one per take): our
    own take was lost with the tail.
    """
    # On the cursor, not SQLAlchemy's execution: inside a commit's transaction too, which may
    # be the driver's own (`face.transactions`), where SQLAlchemy would begin another.
    ran = execution.run_stmt(conn, diagnosis_stmt())
    if not ran.rows:
        raise LeaderRowMissing()
    row = _Diagnosis(*ran.rows[0])
    if int(row.floor) > builds.BUILD:
        raise BuildTooOld(builds.refusal(int(row.floor)), floor=int(row.floor))
    missing = acked - int(row.commit_seq)
    if row.epoch == epoch and row.holder == holder:
        if missing <= 0:
            return  # not ours to judge (cannot happen: the fence would have matched)
        raise DatabaseBehind(
            f"epoch {epoch}: the database holds commit {row.commit_seq} of this leader's "
            f"sequence, but it acknowledged up to {acked}: up to {missing} acknowledged commits "
            "are gone (an asynchronous failover that lost its tail?); stepping down",
            lost=LostCommits(epoch=epoch, commits=missing, noticed_unix_ns=time.time_ns()),
        )
    behind = (epoch - int(row.epoch)) % MAX_EPOCH
    regranted = row.epoch == epoch and row.holder is not None  # None: released, by us or --force
    earlier = row.epoch != 0 and 0 < behind < MAX_EPOCH // 2  # 0: a restored row's
    if regranted or earlier:
        raise DatabaseBehind(
            f"epoch {epoch}: the database has the lease at epoch {row.epoch} held by "
            f"{row.holder!r}, which no takeover after this leader's produces: it lost this "
            "leader's own take and the commits after it (an asynchronous failover that lost "
            "its tail?); stepping down",
            lost=LostCommits(
                epoch=epoch,
                commits=missing if missing > 0 else None,
                noticed_unix_ns=time.time_ns(),
            ),
        )


def renew(
    conn: Connection,
    *,
    epoch: int,
    holder: str,
    ttl_ns: int,
    acked: int,
    idle_ns: int | None = None,
) -> bool:
    """Extend our lease by `ttl_ns`; False when it was taken over (`LeaderRowMissing` when the
    row is gone, `DatabaseBehind` when it lost commits we `acked`).

    Pipelined, the UPDATE and the COMMIT leave in one flight (with the transaction's idle
    bound, given `idle_ns`: see `take`); the diagnosis of a renewal that matched nothing
    reads the row in a new transaction."""
    params = {"b_epoch": epoch, "b_holder": holder, "b_ttl": ttl_ns, "b_acked": acked}
    flight = _flight(conn, idle_ns)
    at = flight.add(renew_stmt(), params)
    if flight.commit()[at].rowcount == 1:
        return True
    diagnose(conn, epoch=epoch, holder=holder, acked=acked)
    return False


def fence(
    conn: Connection,
    *,
    epoch: int,
    holder: str,
    next_id: int,
    ttl_ns: int,
    seq: int,
    acked: int,
    flight: execution.Flight | None = None,
) -> bool:
    """Run the fence check on its own, raising the high-water to `next_id` and the commit
    sequence to `seq`; False when we do not lead (`LeaderRowMissing` when nobody can: the row
    is gone; `DatabaseBehind` when it lost commits we `acked`). `flight`: one whose statements
    run as they are added, which runs it. (A commit runs `fence_stmt` itself, and asks
    `diagnose` of a miss: `face.transactions.commit`.)"""
    params = {
        "b_epoch": epoch,
        "b_holder": holder,
        "b_next_id": next_id,
        "b_ttl": ttl_ns,
        "b_seq": seq,
        "b_acked": acked,
    }
    if flight is None:
        result = execution.run_stmt(conn, fence_stmt(), params)
    else:
        result = flight.send()[flight.add(fence_stmt(), params)]
    if result.rowcount == 1:
        return True
    diagnose(conn, epoch=epoch, holder=holder, acked=acked)
    return False


@cache
def fence_or_fail_stmt() -> Select[Any]:
    """`fence_stmt` as a statement that fails (division by zero) when it matches nothing: in a
    `execution.Flight`, whose statements run without waiting for each answer, a fenced
    commit's writes are then never run, and COMMIT cannot apply anything. MariaDB's form is
    a compound statement that SIGNALs it (`dialects.FailsUnlessOne`)."""
    fenced = fence_stmt().returning(leader.c.id).cte("fence")
    otherwise = select(literal(1, Integer) // func.count(fenced.c.id))
    either = dialects.FailsUnlessOne(fence_stmt(), otherwise)
    return typing.cast("Select[Any]", either)  # compiled as any statement (`driver_sql`)


FENCED: Final = "epoch {epoch} was fenced off: another instance leads"
"""What `Fenced` says when a commit's fence check matched nothing."""


def fence_failed(exc: BaseException) -> bool:
    """Whether `exc`, raised by the statement `fence_or_fail_stmt` put in a flight, says the
    fence matched nothing (its division by zero): diagnose it (`diagnose`)."""
    orig = getattr(exc, "orig", None)
    if getattr(orig, "sqlstate", None) == _DIVISION_BY_ZERO:
        return True
    return getattr(orig, "args", ())[:1] == (dialects.FAILED_ERRNO,)  # PyMySQL's


_DIVISION_BY_ZERO: Final = "22012"


def record_lost(conn: Connection, *, holder: str, lost: LostCommits) -> None:
    """Record `lost` in the lease row for the next recovery, freeing our lease there."""
    params = {"b_epoch": lost.epoch, "b_holder": holder, "b_commits": lost.commits}
    execution.run_stmt(conn, record_lost_stmt(), params)


def release(conn: Connection, *, holder: str, idle_ns: int | None = None) -> None:
    """Give our lease up at once (a no-op once another instance holds it). Pipelined, the
    UPDATE and the COMMIT leave in one flight (with the idle bound, given `idle_ns`)."""
    flight = _flight(conn, idle_ns)
    flight.add(release_stmt(), {"b_holder": holder})
    flight.commit()


def release_held_by(conn: Connection, *, holder: str, idle: timedelta) -> int:
    """Free the lease `holder` holds (a process the operator found dead), in the store's
    transaction for the leader row, bounded idle (`dialects.bound_idle`): 1 if it was freed,
    0 if another holds it now. A release sends its own bound (`face.transactions.LEASE_FLIGHTS`).
    """
    dialects.bound(conn, idle=idle, timeout=None)
    return int(conn.execute(release_stmt(), {"b_holder": holder}).rowcount)
