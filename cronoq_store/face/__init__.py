"""What both faces of the store share (`SqlStore` in store.py, `AsyncSqlStore` in aio.py), none
of it blocking or awaiting: who leads, the leader's operations written once as `Steps`
generators, and the one driver (`Face._driving`) that a face runs blocking or awaits.

The other operations, and what an operation is, are `operations`; how a transaction runs
(its kind, the runner) and the way of a commit (`transactions.Committing`: its plan, the
connection a leader's commits keep, BEGIN to COMMIT) are `transactions`; the engine factory is
`engines`. A face adds only what differs by nature: blocking or awaiting,
and a keeper of threads or of an asyncio task.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from typing import Any, ClassVar, Generic, Protocol, Self, TypeVar

from sqlalchemy import Connection
from sqlalchemy.engine import Dialect

from .. import codec, dialects, durability, inbox, leadership, lease, telemetry
from ..config import StoreConfig
from ..errors import (
    DatabaseBehind,
    LeaderRowMissing,
    StoreError,
    StoreUnavailable,
)
from ..model import TaskId
from .operations import Effect as Effect
from .operations import Operations
from .operations import Step as Step
from .operations import Steps as Steps
from .operations import judge_durability as judge_durability
from .operations import read_durability as read_durability
from .transactions import HOLD_MIN_POOL as HOLD_MIN_POOL
from .transactions import RETRIED as RETRIED
from .transactions import RETRY_COMMIT as RETRY_COMMIT
from .transactions import Commit as Commit
from .transactions import Committing
from .transactions import Kind as Kind
from .transactions import Op as Op
from .transactions import Tx as Tx
from .transactions import commit_lock_bound as commit_lock_bound
from .transactions import ns as ns
from .transactions import plan as plan
from .transactions import translated as translated

log = logging.getLogger(__name__)

T = TypeVar("T")

Outputs = Sequence[tuple[TaskId, bytes]]
"""Outputs of tasks that succeeded, by id, committed with a batch."""


def note(note: leadership.Note | None) -> None:
    if note is not None:
        log.log(*note)


class _Engine(Protocol):
    @property
    def dialect(self) -> Dialect: ...
    def execution_options(self, **opt: Any) -> Self: ...
    def dispose(self) -> Any: ...


class _Flag(Protocol):
    def set(self) -> None: ...
    def clear(self) -> None: ...
    def is_set(self) -> bool: ...


class _Keeper(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def renewed(self, started: float) -> None: ...
    def join(self, timeout: float | None = None) -> Any: ...


E = TypeVar("E", bound=_Engine)
K = TypeVar("K", bound=_Keeper)
C = TypeVar("C", bound=Callable[[], object])
H = TypeVar("H")


class Face(Committing[H], Operations, Generic[E, K, C, H]):
    """What `SqlStore` and `aio.AsyncSqlStore` share, none of it blocking or awaiting: the
    configuration, the engine, the holder's name, who leads (`leadership.Leadership`), and
    the way of a commit (`transactions.Committing`, with the connection its commits keep)."""

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
        self._dialect = self.engine.dialect
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
        self._commit_tx = plan("commit", self.config)
        """How every commit runs (`transactions.plan`), worked out once."""
        deadline = self._commit_tx.deadline
        self._commit_bound = None if deadline is None else deadline.total_seconds()
        self._ttl_ns = ns(self.config.lease_ttl)
        self._max_payload = self.config.max_payload_bytes
        self._telemetry = telemetry.Telemetry(dialects.name(self.engine.dialect))
        self._traced = False
        """Whether commits are measured and traced: decided as a term begins (`_lead`)."""
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
        store._own_engine()
        return store

    def _own_engine(self) -> None:
        """This store made its engine: it disposes of it on `close`, and with a pool of at least
        `HOLD_MIN_POOL` its commits keep a connection (`_keep_held`)."""
        self._owns_engine = True
        self._holds = self.config.pool_size >= HOLD_MIN_POOL

    def _opening(self, check_schema: bool) -> Steps[None]:
        """`open`, once the store has its engine: read what the server does with a commit and
        judge it (`judge_durability`), then migrate, or check the schema unless told not to.
        Any failure disposes of the engine."""
        try:
            found: durability.Durability | StoreError
            try:
                found = yield self.read_durability
            except StoreError as exc:
                found = exc
            judge_durability(found, self.config)
            if self.config.migrate:
                yield self.migrate
            elif check_schema:
                yield self.check_schema
        except BaseException:
            yield self._raw_engine.dispose
            raise

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

    def _mark_ended(
        self, why: str | StoreError, level: int, about: K | int | None, released: bool
    ) -> list[C]:
        """End the term (once): commits raise `Fenced` from here on; the callbacks to run.
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
        # Decided once a term, not per commit: an app sets its SDK up before it leads.
        self._traced = self._telemetry.enabled and telemetry.configured()
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

    def _take_keeper(self) -> K | None:
        """The keeper, to be stopped and joined: none keeps the lease from here on."""
        with self._lock:
            return self._leadership.detach()

    def _acquiring(self, timeout: float | None) -> Steps[int]:
        """`acquire_leadership`: end the term first (the timeout counts from before it), then
        take the lease at each poll (`_try_take`) as `leadership.Acquiring` decides, and lead
        under the new epoch, kept by a new keeper (`_keeper_type`)."""
        began = time.monotonic()
        yield partial(self._end_term, "taking the lease anew", logging.INFO, released=True)
        yield partial(self._stop_keeper, None if timeout is None else timeout / 10)
        acquiring = leadership.acquiring_for(self.config, timeout, began)
        give_up_at = None if timeout is None else began + timeout
        with self._telemetry.acquiring():
            while True:
                bound = leadership.take_bound(give_up_at, time.monotonic())
                taken = yield partial(self._try_take, self._ttl_ns, bound)
                step = acquiring.attempted(time.monotonic(), taken)
                note(step.note)
                if isinstance(step, leadership.GiveUp):
                    raise step.error
                if isinstance(taken, lease.Lease):
                    break
                if isinstance(step, leadership.Retry):
                    yield partial(self._sleep, max(0.0, step.at - time.monotonic()))
            epoch, started, commit_seq = taken
            keeper: K = self._keeper_type(
                renew=lambda: self._renew(epoch),
                lost=lambda why: self._end_term(why, about=keeper),
                **leadership.keeper_timing(self.config, epoch, started),
            )
            return self._lead(epoch, keeper, commit_seq)

    def _renewing(self, epoch: int) -> Steps[bool]:
        """One renewal of our lease (the keeper's); False once another instance took it, or
        when nothing is left to retry (the row gone, the database behind: the term ended)."""
        try:
            renewed: bool = yield Step("renew", self._renew_work(epoch))
        except DatabaseBehind as exc:
            yield from self._recording_lost(exc)
            yield partial(self._end_term, exc, about=epoch)
            return False
        except LeaderRowMissing as exc:  # nothing to retry: end the term now, saying why
            yield partial(self._end_term, exc, about=epoch)
            return False
        return renewed

    # What differs by face: blocking or awaiting (each face's own).

    _keeper_type: ClassVar[Callable[..., Any]]
    """`lease.Keeper` or `aio.AsyncKeeper`."""

    def _end_term(
        self,
        why: str | StoreError,
        level: int = logging.ERROR,
        *,
        about: K | int | None = None,
        released: bool = False,
    ) -> Any:
        """End the term (once), then call the callbacks (`_ending_term`, driven: on the asyncio face
        what returns is awaited)."""
        return self._drive(self._ending_term(why, level, about, released))

    def _ending_term(
        self, why: str | StoreError, level: int, about: K | int | None, released: bool
    ) -> Steps[None]:
        """End the term (once: `_mark_ended` decides), close the kept connection (after a loss
        without a word to the server, which may be cut off), then call each callback (the
        asyncio face awaits a coroutine it returns); a callback that fails only logs.
        `released` when by choice, else lost for `why` (a keeper's reason or the error that
        showed it)."""
        callbacks = self._mark_ended(why, level, about, released)
        yield partial(self._close_held, lost=not released)
        for callback in callbacks:
            try:
                yield callback
            except Exception:
                self._log.exception("leadership-lost callback failed")

    def _try_take(self, ttl_ns: int, bound: timedelta | None) -> Any:
        """One attempt at the lease, within `bound`: taken, held (None), or unreachable
        (`_taking`, driven)."""
        return self._drive(self._taking(ttl_ns, bound))

    def _renew(self, epoch: int) -> Any:
        """One renewal of our lease (the keeper's: `_renewing`, driven); False once another
        instance took it."""
        return self._drive(self._renewing(epoch))

    _awaits: ClassVar[bool]
    """Whether what a step starts is awaited (`_driving`): the asyncio face's."""

    async def _driving(self, steps: Steps[T], thrown: BaseException | None = None) -> T:
        """The one driver of both faces: what `steps` asks for, in turn (a transaction:
        `_transact`; a commit: `_transact_commit`; or an effect), its result sent back and its
        error thrown in. The asyncio face awaits it, and what a step starts is awaited; the
        blocking face awaits nothing, so it never suspends and `SqlStore._drive` runs it to its
        end in one `send`. `thrown`: `steps` is under way, and the error of what it last asked
        for is thrown in first (`SqlStore.commit`, which carried out its transaction itself)."""
        awaits = self._awaits
        try:
            step = next(steps) if thrown is None else steps.throw(thrown)
            while True:
                try:
                    if type(step) is Step:
                        result = self._transact(step.op, step.fn, deadline=step.deadline)
                    elif type(step) is Commit:
                        result = self._transact_commit(step)
                    else:
                        result = step()  # type: ignore[operator]
                    if awaits and inspect.isawaitable(result):
                        result = await result
                except BaseException as exc:  # to the operation's own with and finally
                    step = steps.throw(exc)
                else:
                    step = steps.send(result)
        except StopIteration as stop:
            value: T = stop.value
            return value

    def _drive(self, steps: Steps[T], thrown: BaseException | None = None) -> Any:
        """Run what `steps` asks for (`_driving`, `thrown` in first): blocking, or awaiting."""
        raise NotImplementedError

    def _transact(
        self, op: Op, fn: Callable[[Connection], T], *, deadline: timedelta | None = None
    ) -> Any:
        """`fn` in one transaction of the kind `op` runs (`transactions.plan`,
        `transactions.transaction`) on a connection of its own, errors translated; `deadline`
        bounds a lease transaction further."""
        raise NotImplementedError

    def _transact_commit(self, c: Commit) -> Any:
        """`c` (`transactions.commit`) on the connection the last commit kept, if any
        (`_keep_held`), or a new one, kept again after; errors translated."""
        raise NotImplementedError

    # `open`'s own steps (`_opening`): each face's public methods.
    read_durability: Callable[[], Any]
    migrate: Callable[[], Any]
    check_schema: Callable[[], Any]

    def _close_held(self, *, lost: bool = False) -> Any:
        """Close the kept connection (`lost`: without a word to the server)."""
        raise NotImplementedError

    def _stop_keeper(self, within: float | None = None) -> Any:
        """Stop the keeper (`_stopping_keeper`, driven)."""
        return self._drive(self._stopping_keeper(within))

    def _stopping_keeper(self, within: float | None) -> Steps[None]:
        """Stop the keeper and wait for it; a renewal hung in the database is not waited for
        past `lease_renew` (nor past `within` seconds: what an acquire's timeout leaves)."""
        if (keeper := self._take_keeper()) is not None:
            keeper.stop()
            wait = self.config.lease_renew.total_seconds()
            yield partial(keeper.join, wait if within is None else min(wait, within))

    def _sleep(self, seconds: float) -> Any:
        """Wait `seconds`: blocking or awaiting."""
        raise NotImplementedError

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
        """`release_leadership`: end the term, stop the keeper, and clear the lease if this
        instance held one; a failure only logs (it expires)."""
        yield partial(self._end_term, "released", logging.INFO, released=True)
        yield partial(self._stop_keeper)
        if self._leadership.epoch is not None:
            try:
                idle = ns(self.config.lease_ttl)  # its bound in its flight (`LEASE_FLIGHTS`)
                yield Step("release", partial(lease.release, holder=self.holder, idle_ns=idle))
            except StoreError as exc:
                self._log.warning("could not clear the lease; it will expire: %s", exc)
        self._leadership.released()

    def _take_work(self, ttl_ns: int) -> Callable[[Connection], lease.Lease | None]:
        """A take of the lease, checking the row against the highest commit sequence number
        this instance saw land, and its epoch."""
        with self._lock:
            acked, last = self._leadership.acked, self._leadership.acked_epoch
        return partial(
            lease.take,
            holder=self.holder,
            ttl_ns=ttl_ns,
            acked=acked,
            last_epoch=last,
            idle_ns=ns(self.config.lease_ttl),
        )

    def _renew_work(self, epoch: int) -> Callable[[Connection], bool]:
        """One renewal of our lease under `epoch`; False once another instance took it."""
        ttl = ns(self.config.lease_ttl)
        return partial(
            lease.renew,
            epoch=epoch,
            holder=self.holder,
            ttl_ns=ttl,
            acked=self._acked(),
            idle_ns=ttl,
        )

    def _acked(self) -> int:
        """The highest commit sequence number known to have landed (renewals check it)."""
        with self._lock:
            return self._leadership.acked


def renew_once(store: Face[Any, Any, Any, Any], epoch: int) -> Any:
    """One renewal of `store`'s lease under `epoch`, as its keeper makes it (blocking on
    `SqlStore`, awaitable on `AsyncSqlStore`); False once another instance took it. For
    measuring a renewal's round trips (`bench/rtt.py`) and for tests: a leader's keeper
    renews on its own."""
    return store._renew(epoch)
