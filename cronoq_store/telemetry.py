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
from typing import Any, Final

from .errors import DatabaseBehind, Fenced, LeaderRowMissing, StoreUnavailable
from .model import InboxTaken, Mutation

METER_NAME: Final = "cronoq_store"
"""The name of the store's meter and tracer."""

try:
    from opentelemetry import metrics as _metrics
    from opentelemetry import trace as _trace
    from opentelemetry.trace import ProxyTracerProvider, Status, StatusCode
except ImportError:  # the `otel` extra is not installed
    _metrics = None  # type: ignore[assignment]
    _trace = None  # type: ignore[assignment]


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


def _outcome(exc: BaseException | None) -> str:
    if exc is None:
        return "ok"
    if isinstance(exc, Fenced):
        return "fenced"
    if isinstance(exc, StoreUnavailable):
        return "unavailable"
    return "error"


class Telemetry:
    """One store's instruments, with its `db.system.name` on every measurement."""

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
        self._commit_duration = meter.create_histogram(
            "cronoq.store.commit.duration", unit="s", description="Time a commit took."
        )
        self._commit_mutations = meter.create_histogram(
            "cronoq.store.commit.mutations",
            unit="{mutation}",
            description="Mutations in a committed (or refused) batch.",
        )
        self._transitions = meter.create_counter(
            "cronoq.store.lease.transitions",
            unit="{transition}",
            description="Leases acquired, lost and released.",
        )
        self._leading = meter.create_up_down_counter(
            "cronoq.store.leading", unit="{instance}", description="Instances that lead now."
        )
        self._recovery_duration = meter.create_histogram(
            "cronoq.store.recovery.duration", unit="s", description="Time a recovery took."
        )
        self._recovery_tasks = meter.create_counter(
            "cronoq.store.recovery.tasks",
            unit="{task}",
            description="Tasks recovered, by kind (live, finished, quarantined).",
        )
        self._pruned = meter.create_counter(
            "cronoq.store.prune.deleted", unit="{task}", description="Finished tasks pruned."
        )
        self._taken = meter.create_counter(
            "cronoq.store.inbox.taken", unit="{item}", description="Inbox items committed taken."
        )
        self._set_aside = meter.create_counter(
            "cronoq.store.inbox.set_aside",
            unit="{item}",
            description="Undecodable inbox rows set aside.",
        )

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

    @contextlib.contextmanager
    def commit(self, epoch: int, batch: Sequence[Mutation]) -> Iterator[None]:
        """Around one commit: its span, duration and size by outcome, the inbox items taken."""
        if not self.enabled:
            yield
            return
        size = len(batch)
        started = time.perf_counter()
        failed: BaseException | None = None
        try:
            if self._tracing():
                attributes = {**self._system, "cronoq.epoch": epoch, "cronoq.batch.size": size}
                with self._span("cronoq.store.commit", attributes):
                    yield
            else:  # the span's own context manager left out too: one per commit
                yield
        except BaseException as exc:
            failed = exc
            raise
        finally:
            by = self._by_outcome[_outcome(failed)]
            self._commit_duration.record(time.perf_counter() - started, by)
            self._commit_mutations.record(size, by)
            if failed is None:
                taken = sum(1 for m in batch if type(m) is InboxTaken)
                if taken:
                    self._taken.add(taken, self._system)

    @contextlib.contextmanager
    def acquiring(self) -> Iterator[None]:
        """Around `acquire_leadership`: its span."""
        if not self.enabled:
            yield
            return
        with self._span("cronoq.store.acquire_leadership", dict(self._system)):
            yield

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

    @contextlib.contextmanager
    def pruning(self) -> Iterator[None]:
        """Around a prune: its span."""
        if not self.enabled:
            yield
            return
        with self._span("cronoq.store.prune", dict(self._system)):
            yield

    def pruned(self, deleted: int) -> None:
        if self.enabled:
            self._pruned.add(deleted, self._system)

    def set_aside(self, items: int) -> None:
        if self.enabled and items:
            self._set_aside.add(items, self._system)
