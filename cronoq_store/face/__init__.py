"""What both faces of the store share (`SqlStore` in store.py, `AsyncSqlStore` in aio.py), none
of it blocking or awaiting: who leads, the connection a leader's commits keep, and every
operation written once as a `Steps` generator that a face drives, blocking or awaiting.

How a transaction runs (its kind, the runner, the way of a commit) is `transactions`; the
engine factory is `engines`. A face adds only what differs by nature: blocking or awaiting,
and a keeper of threads or of an asyncio task.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator, Sequence
from datetime import timedelta
from functools import partial
from typing import Any, ClassVar, Final, Generic, NamedTuple, Protocol, Self, TypeVar

from sqlalchemy import Connection
from sqlalchemy.engine import Dialect

from .. import codec, dialects, durability, execution, inbox, leadership, lease, model, telemetry
from ..config import StoreConfig
from ..errors import (
    DatabaseBehind,
    Fenced,
    InvalidValue,
    LeaderRowMissing,
    NotDurable,
    StoreError,
    StoreUnavailable,
)
from ..model import INT64_MAX, InboxItem, Mutation, Recovered, TaskId, TimeBase
from ..repository import folding, prune, queries, recovery
from .transactions import RETRIED as RETRIED
from .transactions import RETRY_COMMIT as RETRY_COMMIT
from .transactions import Commit as Commit
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
C = TypeVar("C", bound=Callable[[], object])
H = TypeVar("H")


class Step(NamedTuple):
    """One transaction an operation asks its face to run (`plan`, `transaction`)."""

    op: Op
    fn: Callable[[Connection], Any]
    deadline: timedelta | None = None
    """A lease transaction's bound below `lease_bound` (what is left of an acquire's timeout)."""


Effect = Callable[[], Any]
"""What an operation asks its face to do besides a transaction: call it (and await what it
returns, on the asyncio face). Only the face's own blocking or awaiting methods: `_lose`,
`_stop`, `_try_take`, `_sleep`."""

Steps = Generator[Step | Commit | Effect, Any, T]
"""An operation, written once for both faces: it yields each `Step` (a transaction), `Commit`
(the way of a commit: `transactions.commit`) or `Effect`, is sent back its result (or thrown
its error), and returns the operation's result. A face drives it (`_drive`), blocking or
awaiting."""


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
        self._commit_tx = plan("commit", self.config)
        """How every commit runs (`transactions.plan`), worked out once."""
        deadline = self._commit_tx.deadline
        self._commit_bound = None if deadline is None else deadline.total_seconds()
        self._ttl_ns = ns(self.config.lease_ttl)
        self._max_payload = self.config.max_payload_bytes
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

    def _commit_plan(
        self, epoch: int, base: TimeBase, batch: Sequence[Mutation], outputs: Outputs
    ) -> Commit:
        """A commit ready to run (`transactions.commit`): `Fenced` at once if `epoch` does not
        lead; its sequence number and the fence's floor (`leadership.Leadership`); the batch
        folded, and bad values refused, before any I/O."""
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
        self, epoch: int, base: TimeBase, batch: Sequence[Mutation], outputs: Outputs
    ) -> Steps[None]:
        """`commit`: the batch folded (`_commit_plan`), then its one transaction
        (`transactions.commit`). Landed, its fence check extended the lease: a renewal. A
        fenced one steps down; one that found the database behind records the gap first.

        The collector is paused from the fold to the COMMIT (`execution.collection_paused`):
        a batch's rows are all kept until written, so its passes would find no garbage."""
        with self._telemetry.commit(epoch, batch):
            c = None
            try:
                with execution.collection_paused():
                    c = self._commit_plan(epoch, base, batch, outputs)
                    yield c
            except (DatabaseBehind, Fenced) as exc:
                if c is None:  # refused before any I/O: this epoch does not lead
                    raise
                if isinstance(exc, DatabaseBehind):
                    yield from self._recording_lost(exc)
                yield partial(self._lose, exc, about=epoch)
                raise exc
            with self._lock:
                keeper = self._leadership.fence_renewed(epoch, c.seq)
            if keeper is not None:
                keeper.renewed(c.started)

    def _acquiring(self, timeout: float | None) -> Steps[int]:
        """`acquire_leadership`: step down first (the timeout counts from before it), then
        take the lease at each poll (`_try_take`) as `leadership.Acquiring` decides, and lead
        under the new epoch, kept by a new keeper (`_keeper_type`)."""
        began = time.monotonic()
        yield partial(self._lose, "taking the lease anew", logging.INFO, released=True)
        yield partial(self._stop, None if timeout is None else timeout / 10)
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
                lost=lambda why: self._lose(why, about=keeper),
                **leadership.keeper_timing(self.config, epoch, started),
            )
            return self._lead(epoch, keeper, commit_seq)

    def _renewing(self, epoch: int) -> Steps[bool]:
        """One renewal of our lease (the keeper's); False once another instance took it, or
        when nothing is left to retry (the row gone, the database behind: stepped down)."""
        try:
            renewed: bool = yield Step("renew", self._renew_work(epoch))
        except DatabaseBehind as exc:
            yield from self._recording_lost(exc)
            yield partial(self._lose, exc, about=epoch)
            return False
        except LeaderRowMissing as exc:  # nothing to retry: step down now, saying why
            yield partial(self._lose, exc, about=epoch)
            return False
        return renewed

    # What differs by face: blocking or awaiting (each face's own).

    _keeper_type: ClassVar[Callable[..., Any]]
    """`lease.Keeper` or `aio.AsyncKeeper`."""

    def _lose(
        self,
        why: str | StoreError,
        level: int = logging.ERROR,
        *,
        about: K | int | None = None,
        released: bool = False,
    ) -> Any:
        """Step down (once), then call the callbacks (`_losing`, driven: on the asyncio face
        what returns is awaited)."""
        return self._drive(self._losing(why, level, about, released))

    def _losing(
        self, why: str | StoreError, level: int, about: K | int | None, released: bool
    ) -> Steps[None]:
        """Step down (once: `_step_down` decides), close the kept connection (after a loss
        without a word to the server, which may be cut off), then call each callback (the
        asyncio face awaits a coroutine it returns); a callback that fails only logs.
        `released` when by choice, else lost for `why` (a keeper's reason or the error that
        showed it)."""
        callbacks = self._step_down(why, level, about, released)
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

    def _drive(self, steps: Steps[T]) -> Any:
        """Run what `steps` asks for, in turn: blocking, or awaiting (what returns is then
        awaited)."""
        raise NotImplementedError

    def _close_held(self, *, lost: bool = False) -> Any:
        """Close the kept connection (`lost`: without a word to the server)."""
        raise NotImplementedError

    def _stop(self, within: float | None = None) -> Any:
        """Stop the keeper (waiting for it up to `within` seconds)."""
        raise NotImplementedError

    def _sleep(self, seconds: float) -> Any:
        """Wait `seconds`: blocking or awaiting."""
        raise NotImplementedError

    def _getting(self, ref: model.TaskRef) -> Steps[model.TaskRecord | None]:
        """`get_task`: by id, or the newest task with a key."""
        if isinstance(ref, model.ById):
            found: model.TaskRecord | None = yield Step(
                "get_task", partial(queries.get_task, task_id=ref.id)
            )
        elif isinstance(ref, model.ByKey):
            found = yield Step("get_task", partial(queries.get_task, key=ref.key))
        else:
            raise InvalidValue(f"ref must be ById or ByKey, not {type(ref).__name__}")
        return found

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
                yield Step("vacuum", partial(prune.vacuum, deleted=total))
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
        """`release_leadership`: step down, stop the keeper, and clear the lease if this
        instance held one; a failure only logs (it expires)."""
        yield partial(self._lose, "released", logging.INFO, released=True)
        yield partial(self._stop)
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

    def _set_aside(self, moved: int) -> None:
        """`moved` undecodable inbox rows were set aside by this instance."""
        self.inbox_rejected += moved
        self._telemetry.set_aside(moved)

    def _acked(self) -> int:
        """The highest commit sequence number known to have landed (renewals check it)."""
        with self._lock:
            return self._leadership.acked
