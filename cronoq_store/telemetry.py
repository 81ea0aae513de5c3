"""OpenTelemetry metrics and spans of a store (the API only: an app that configures an SDK sees
them, one that does not pays next to nothing; without `opentelemetry-api` installed, nothing).

The instrument and span names, units and attributes are a public contract (docs/observability.md).
No task data reaches telemetry: attributes are the dialect, the epoch, counts and outcomes, and
an error is recorded by its type alone (a database's message can quote a key).
"""

from __future__ import annotations

__all__ = ["METER_NAME", "Telemetry", "lost_reason"]

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final

from .errors import DatabaseBehind, Fenced, LeaderRowMissing, StoreUnavailable
from .model import InboxTaken, Mutation

if TYPE_CHECKING:
    from opentelemetry.metrics import Counter, Histogram, UpDownCounter

METER_NAME: Final = "cronoq_store"
"""The name of the store's meter and tracer."""

try:
    from opentelemetry import metrics as _metrics
    from opentelemetry import trace as _trace
    from opentelemetry.metrics import _internal as _metrics_internal
    from opentelemetry.trace import ProxyTracerProvider, Status, StatusCode
except ImportError:  # the `otel` extra is not installed
    _metrics = None  # type: ignore[assignment]
    _trace = None  # type: ignore[assignment]
    _metrics_internal = None  # type: ignore[assignment]


def lost_reason(why: str | BaseException) -> str:
    """The `reason` attribute of a lost lease: a few fixed words, never a message."""
    if isinstance(why, DatabaseBehind):
        return "database_behind"
    if isinstance(why, LeaderRowMissing):
        return "leader_row_missing"
    if isinstance(why, Fenced):
        return "fenced"
    if isinstance(why, str) and why.startswith("the lease was taken over"):
        return "taken_over"
    if isinstance(why, str) and why.startswith("the lease was not renewed"):
        return "not_renewed"
    return "other"


def configured() -> bool:
    """Whether an app has set a meter or tracer provider (an SDK): until then every
    instrument is the API's proxy, which records nothing, and a commit skips its telemetry
    (a dozen calls, 5% of a batch-1 commit's). Read from the API's own globals, which stay
    None until a provider is set (or made from the environment, which `get_meter` and
    `get_tracer` do at `Telemetry`'s creation): no call."""
    return _metrics_internal._METER_PROVIDER is not None or _trace._TRACER_PROVIDER is not None


def _outcome(exc: BaseException | None) -> str:
    if exc is None:
        return "ok"
    if isinstance(exc, Fenced):
        return "fenced"
    if isinstance(exc, StoreUnavailable):
        return "unavailable"
    return "error"


INSTRUMENTS: Final = (
    ("_commit_duration", "histogram", "cronoq.store.commit.duration", "s", "Time a commit took."),
    (
        "_commit_mutations",
        "histogram",
        "cronoq.store.commit.mutations",
        "{mutation}",
        "Mutations in a committed (or refused) batch.",
    ),
    (
        "_transitions",
        "counter",
        "cronoq.store.lease.transitions",
        "{transition}",
        "Leases acquired, lost and released.",
    ),
    (
        "_leading",
        "up_down_counter",
        "cronoq.store.leading",
        "{instance}",
        "Instances that lead now.",
    ),
    (
        "_recovery_duration",
        "histogram",
        "cronoq.store.recovery.duration",
        "s",
        "Time a recovery took.",
    ),
    (
        "_recovery_tasks",
        "counter",
        "cronoq.store.recovery.tasks",
        "{task}",
        "Tasks recovered, by kind (live, finished, quarantined).",
    ),
    ("_pruned", "counter", "cronoq.store.prune.deleted", "{task}", "Finished tasks pruned."),
    ("_taken", "counter", "cronoq.store.inbox.taken", "{item}", "Inbox items committed taken."),
    (
        "_set_aside",
        "counter",
        "cronoq.store.inbox.set_aside",
        "{item}",
        "Undecodable inbox rows set aside.",
    ),
)
"""Every instrument of a store, as docs/observability.md lists them: the attribute that holds
it, its kind (`Meter.create_<kind>`), name, unit and description."""


class Telemetry:
    """One store's instruments, with its `db.system.name` on every measurement."""

    _commit_duration: Histogram
    _commit_mutations: Histogram
    _transitions: Counter
    _leading: UpDownCounter
    _recovery_duration: Histogram
    _recovery_tasks: Counter
    _pruned: Counter
    _taken: Counter
    _set_aside: Counter

    def __init__(self, system: str) -> None:
        self.enabled = _metrics is not None and _trace is not None
        self._system = {"db.system.name": system}
        self._by_outcome = {
            o: {**self._system, "outcome": o} for o in ("ok", "fenced", "unavailable", "error")
        }
        if not self.enabled:
            return
        meter = _metrics.get_meter(METER_NAME)
        self._tracer = _trace.get_tracer(METER_NAME)
        for attribute, kind, name, unit, description in INSTRUMENTS:
            create = getattr(meter, f"create_{kind}")
            setattr(self, attribute, create(name, unit=unit, description=description))

    @staticmethod
    def _tracing() -> bool:
        """Whether an app has set a tracer provider: until then spans are left out, as the
        API's own no-op span would cost a batch-1 commit a few percent of its CPU for
        nothing (benchmarks/bench_otel.py)."""
        return not isinstance(_trace.get_tracer_provider(), ProxyTracerProvider)

    @contextlib.contextmanager
    def _span(self, name: str, attributes: dict[str, Any]) -> Iterator[Any]:
        """A span that records an error by its type only (no message: it may quote task data);
        None while not `_tracing`."""
        if not self._tracing():
            yield None
            return
        with self._tracer.start_as_current_span(
            name, attributes=attributes, record_exception=False, set_status_on_exception=False
        ) as span:
            try:
                yield span
            except BaseException as exc:
                kind = type(exc).__name__
                span.add_event("exception", {"exception.type": kind})
                span.set_status(Status(StatusCode.ERROR, kind))
                raise

    def commit(
        self, epoch: int, batch: Sequence[Mutation]
    ) -> _Commit | contextlib.nullcontext[None]:
        """Around one commit: its span, duration and size by outcome, the inbox items taken;
        nothing at all until an app sets a meter or tracer provider (`configured`)."""
        if not self.enabled or not configured():
            return _NOTHING
        return _Commit(self, epoch, batch)

    @contextlib.contextmanager
    def _around(self, name: str) -> Iterator[None]:
        """Around an operation: its span `name` (while enabled)."""
        if not self.enabled:
            yield
            return
        with self._span(name, dict(self._system)):
            yield

    def acquiring(self) -> contextlib.AbstractContextManager[None]:
        """Around `acquire_leadership`: its span."""
        return self._around("cronoq.store.acquire_leadership")

    def acquired(self, epoch: int) -> None:
        if not self.enabled:
            return
        self._transitions.add(1, {**self._system, "transition": "acquired"})
        self._leading.add(1, self._system)
        span = _trace.get_current_span()
        if span.is_recording():  # inside `acquiring`'s span
            span.set_attribute("cronoq.epoch", epoch)

    def stepped_down(self, reason: str | None) -> None:
        """Leadership ended: released (`reason` None) or lost for `reason` (`lost_reason`)."""
        if not self.enabled:
            return
        if reason is None:
            attributes = {**self._system, "transition": "released"}
        else:
            attributes = {**self._system, "transition": "lost", "reason": reason}
        self._transitions.add(1, attributes)
        self._leading.add(-1, self._system)

    @contextlib.contextmanager
    def recovering(self) -> Iterator[None]:
        """Around a recovery: its span and duration."""
        if not self.enabled:
            yield
            return
        started = time.perf_counter()
        try:
            with self._span("cronoq.store.recover", dict(self._system)):
                yield
        finally:
            self._recovery_duration.record(time.perf_counter() - started, self._system)

    def recovered(self, *, live: int, finished: int, quarantined: int) -> None:
        if not self.enabled:
            return
        for kind, n in (("live", live), ("finished", finished), ("quarantined", quarantined)):
            self._recovery_tasks.add(n, {**self._system, "kind": kind})

    def pruning(self) -> contextlib.AbstractContextManager[None]:
        """Around a prune: its span."""
        return self._around("cronoq.store.prune")

    def pruned(self, deleted: int) -> None:
        if self.enabled:
            self._pruned.add(deleted, self._system)

    def set_aside(self, items: int) -> None:
        if self.enabled and items:
            self._set_aside.add(items, self._system)


_NOTHING: Final = contextlib.nullcontext()


class _Commit:
    """`Telemetry.commit`'s context: a class, not a generator, as it wraps every commit (a
    generator's context manager costs a batch-1 commit a few percent of its calls); the
    span's own context is entered only while an app traces (`Telemetry._tracing`)."""

    __slots__ = ("_batch", "_epoch", "_span", "_started", "_telemetry")

    def __init__(self, telemetry: Telemetry, epoch: int, batch: Sequence[Mutation]) -> None:
        self._telemetry = telemetry
        self._epoch = epoch
        self._batch = batch
        self._span: contextlib.AbstractContextManager[Any] | None = None
        self._started = 0.0

    def __enter__(self) -> None:
        t = self._telemetry
        if t._tracing():
            attributes = {
                **t._system,
                "cronoq.epoch": self._epoch,
                "cronoq.batch.size": len(self._batch),
            }
            self._span = t._span("cronoq.store.commit", attributes)
            self._span.__enter__()
        self._started = time.perf_counter()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        t = self._telemetry
        elapsed = time.perf_counter() - self._started
        try:
            if self._span is not None:
                self._span.__exit__(kind, exc, tb)
        finally:
            batch = self._batch
            by = t._by_outcome[_outcome(exc)]
            t._commit_duration.record(elapsed, by)
            t._commit_mutations.record(len(batch), by)
            if exc is None:
                taken = [type(m) for m in batch].count(InboxTaken)
                if taken:
                    t._taken.add(taken, t._system)
