"""What an operation is (`Step`, `Effect`, `Steps`), and the operations that are no part of
leading (`Operations`): reads, recovery, prune, the inbox's read, and what `open` reads of
the server. `Face` adds the leader's: acquire, renew, commit, release.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Sequence
from datetime import timedelta
from functools import partial
from typing import Any, ClassVar, NamedTuple, TypeVar

from sqlalchemy import Connection
from sqlalchemy.engine import Dialect

from .. import codec, dialects, durability, execution, inbox, lease, model, telemetry
from ..config import StoreConfig
from ..durability import Durability
from ..errors import InvalidValue, NotDurable, StoreError, StoreUnavailable
from ..model import InboxItem, Recovered, TaskId, TimeBase
from ..repository import prune, queries, recovery
from .transactions import Commit, Op, ns

log = logging.getLogger(__name__)

T = TypeVar("T")


class Step(NamedTuple):
    """One transaction an operation asks its face to run (`plan`, `transaction`)."""

    op: Op
    fn: Callable[[Connection], Any]
    deadline: timedelta | None = None
    """A lease transaction's bound below `lease_bound` (what is left of an acquire's timeout)."""


Effect = Callable[[], Any]
"""What an operation asks its face to do besides a transaction: call it (and await what it
returns, on the asyncio face). Only the face's own blocking or awaiting methods: `_end_term`,
`_stop_keeper`, `_try_take`, `_sleep`, and `open`'s own steps."""

Steps = Generator[Step | Commit | Effect, Any, T]
"""An operation, written once for both faces: it yields each `Step` (a transaction), `Commit`
(the way of a commit: `transactions.commit`) or `Effect`, is sent back its result (or thrown
its error), and returns the operation's result. A face drives it (`_drive`: `Face._driving`,
the one driver of both faces), blocking or awaiting."""


def read_durability(conn: Connection) -> Durability:
    """What the server `conn` reaches does with a commit (`durability.classify`)."""
    settings = dialects.durability_settings(conn, execution.Flight)
    return durability.classify(dialects.name(conn.dialect), settings)


def judge_durability(found: Durability | StoreError, config: StoreConfig) -> None:
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


class Operations:
    """The operations no part of leading, as `Steps` generators (`Face` drives them); what they
    need of the store is declared here."""

    config: StoreConfig
    durability: Durability | None
    _dialect: Dialect
    inbox_rejected: int
    _log: ClassVar[logging.Logger]
    _telemetry: telemetry.Telemetry
    _inbox_specs: codec.StoredSpecs | None

    @staticmethod
    def _now() -> int:
        raise NotImplementedError

    def _reading_durability(self) -> Steps[Durability]:
        """`read_durability`: one round trip, kept as `durability`."""
        self.durability = yield Step("durability", read_durability)
        return self.durability

    def _listing_finished(
        self,
        pools: Sequence[str],
        statuses: Sequence[model.TaskStatus],
        after: TaskId | None,
        limit: int,
    ) -> Steps[list[model.TaskRecord]]:
        """`list_finished`: one read."""
        found: list[model.TaskRecord] = yield Step(
            "list_finished",
            partial(
                queries.list_finished, pools=pools, statuses=statuses, after=after, limit=limit
            ),
        )
        return found

    def _loading_output(self, id: TaskId) -> Steps[bytes | None]:
        """`load_output`: one read."""
        output: bytes | None = yield Step("load_output", partial(queries.load_output, task_id=id))
        return output

    def _releasing_lease_of(self, holder: str) -> Steps[bool]:
        """`release_lease_of`: clear the lease `holder` holds, if it still does."""
        work = partial(lease.release_held_by, holder=holder, idle=self.config.lease_ttl)
        released: int = yield Step("release", work)
        return released == 1

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

    def _pruning(
        self,
        older_than: timedelta,
        batch_size: int | None = None,
        progress: Callable[[int], object] | None = None,
    ) -> Steps[int]:
        """`prune` (and `cronoq-store prune`): one transaction per batch, so locks stay short
        while the leader commits; `progress` gets each batch's count of deleted tasks."""
        cutoff = self._now() - ns(older_than)
        limit = prune.PRUNE_BATCH if batch_size is None else prune.check_batch(batch_size)
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
                    if progress is not None:
                        progress(n)
                    if n < limit:
                        break
            finally:
                self._telemetry.pruned(total)
        if total and dialects.vacuums(self._dialect):
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

    def _set_aside(self, moved: int) -> None:
        """`moved` undecodable inbox rows were set aside by this instance."""
        self.inbox_rejected += moved
        self._telemetry.set_aside(moved)
