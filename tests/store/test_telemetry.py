"""OpenTelemetry: the instruments and spans a scripted sequence produces, on every dialect and
both faces, read with the SDK's in-memory reader and exporter; structured log fields; and no
task data in telemetry or logs.

The SDK is configured once for the process (OpenTelemetry allows one global provider): the
metric reader collects deltas, so each test sees only what it caused.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from builders import BASE
from faces import FACES, open_face
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import (
    Counter,
    Histogram,
    MeterProvider,
    UpDownCounter,
)
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import URL, Engine, create_engine, update

import cronoq_store as cq
from cronoq_store import execution
from cronoq_store.schema import inbox, leader, tasks
from cronoq_store.testing.statements import after_statements

CONFIG = cq.StoreConfig(lease_ttl=timedelta(seconds=30), lease_renew=timedelta(seconds=10))
SECRETS = ("sekret-payload", "sekret-key", "sekret-message", "sekret-label")
"""Task data the sequence writes: none of it may reach telemetry or a log line."""
SYSTEM = {"sqlite": "sqlite", "postgresql": "postgresql", "mysql": "mysql"}

DELTA = {
    Counter: AggregationTemporality.DELTA,
    UpDownCounter: AggregationTemporality.DELTA,
    Histogram: AggregationTemporality.DELTA,
}


@pytest.fixture(scope="session")
def otel() -> tuple[InMemoryMetricReader, InMemorySpanExporter]:
    reader = InMemoryMetricReader(preferred_temporality=DELTA)  # type: ignore[arg-type]
    exporter = InMemorySpanExporter()
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(tracer_provider)
    return reader, exporter


def points(reader: InMemoryMetricReader) -> dict[str, list[tuple[dict[str, Any], Any, str]]]:
    """Every data point collected since the last call: name -> (attributes, point, unit)."""
    out: dict[str, list[tuple[dict[str, Any], Any, str]]] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            if scope.scope.name != "cronoq_store":
                continue
            for metric in scope.metrics:
                for p in metric.data.data_points:
                    out.setdefault(metric.name, []).append((dict(p.attributes), p, metric.unit))
    return out


def total(found: dict[str, list[Any]], name: str, **attrs: Any) -> float:
    """A counter's sum, or a histogram's count, over the points with `attrs`."""
    n = 0.0
    for a, p, _ in found.get(name, []):
        if all(a.get(k) == v for k, v in attrs.items()):
            n += p.count if hasattr(p, "count") else p.value
    return n


def spec(i: int) -> cq.TaskSpec:
    return cq.TaskSpec(
        payload=b"sekret-payload-%d" % i,
        key=f"sekret-key-{i}",
        labels={"who": f"sekret-label-{i}"},
    )


@pytest.mark.parametrize("face", FACES)
def test_a_scripted_sequence_is_measured_and_traced(
    face: str,
    dialect: str,
    db_url: URL,
    engine: Engine,
    otel: tuple[InMemoryMetricReader, InMemorySpanExporter],
    cleanup: list[Callable[[], None]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    reader, exporter = otel
    store = open_face(face, db_url, CONFIG, cleanup)
    points(reader)  # this test's deltas from here
    exporter.clear()
    caplog.set_level(logging.INFO, logger="cronoq_store")

    epoch = store.acquire_leadership(timeout=10)
    # Three commits: six tasks; five of them finish; two inbox items become tasks.
    store.commit(
        epoch,
        BASE,
        [cq.Submitted(id=cq.TaskId(i), seq=i, arrival=0, spec=spec(i)) for i in (*range(1, 6), 8)],
    )
    store.commit(
        epoch,
        BASE,
        [
            cq.StatusChanged(
                id=cq.TaskId(i),
                status=cq.TaskStatus.SUCCEEDED,
                attempt=1,
                at=1,
                message=f"sekret-message-{i}",
            )
            for i in range(1, 6)
        ],
    )
    with engine.begin() as conn:
        ids = cq.enqueue_many(conn, [spec(6), spec(7), spec(9)])
        conn.execute(update(inbox).where(inbox.c.id == ids[2]).values(tags="[1]"))
    items = store.read_inbox(limit=10)  # the third row is set aside
    assert [i.inbox_id for i in items] == ids[:2]
    taken: list[Any] = []
    for n, item in zip((6, 7), items, strict=True):
        taken += [
            cq.Submitted(id=cq.TaskId(n), seq=n, arrival=0, spec=item.spec),
            cq.InboxTaken(inbox_id=item.inbox_id),
        ]
    store.commit(epoch, BASE, taken)
    assert store.prune(timedelta(0)) == 5  # tasks 1-5
    with engine.begin() as conn:  # task 8's row is damaged: recovery quarantines it
        conn.execute(update(tasks).where(tasks.c.id == 8).values(status="bogus"))
    recovered = store.recover(BASE)
    assert sorted(t.id for t in recovered.tasks) == [6, 7]
    # Another instance takes over; the old one's next commit is fenced by the database.
    with engine.begin() as conn:
        conn.execute(update(leader).where(leader.c.id == 1).values(expires_unix_ns=0))
    other = open_face(face, db_url, CONFIG, cleanup)
    other_epoch = other.acquire_leadership(timeout=10)
    with pytest.raises(cq.Fenced):
        store.commit(
            epoch, BASE, [cq.Submitted(id=cq.TaskId(10), seq=10, arrival=0, spec=spec(10))]
        )

    found = points(reader)
    system = SYSTEM[dialect]
    for name, recorded in found.items():
        for attributes, _, _ in recorded:
            assert attributes.get("db.system.name") == system, (name, attributes)
    units = {name: recorded[0][2] for name, recorded in found.items()}
    assert units["cronoq.store.commit.duration"] == "s"
    assert units["cronoq.store.commit.mutations"] == "{mutation}"
    assert units["cronoq.store.recovery.duration"] == "s"
    assert total(found, "cronoq.store.commit.duration", outcome="ok") == 3
    assert total(found, "cronoq.store.commit.duration", outcome="fenced") == 1
    ok_sizes = [p.sum for a, p, _ in found["cronoq.store.commit.mutations"] if a["outcome"] == "ok"]
    assert sum(ok_sizes) == 6 + 5 + 4
    assert total(found, "cronoq.store.lease.transitions", transition="acquired") == 2
    assert total(found, "cronoq.store.lease.transitions", transition="lost", reason="fenced") == 1
    assert total(found, "cronoq.store.leading") == 1  # +1, +1, -1
    assert total(found, "cronoq.store.recovery.duration") == 1
    assert total(found, "cronoq.store.recovery.tasks", kind="live") == 2
    assert total(found, "cronoq.store.recovery.tasks", kind="finished") == 0
    assert total(found, "cronoq.store.recovery.tasks", kind="quarantined") == 1
    assert total(found, "cronoq.store.prune.deleted") == 5
    assert total(found, "cronoq.store.inbox.taken") == 2
    assert total(found, "cronoq.store.inbox.set_aside") == 1

    spans = exporter.get_finished_spans()
    names = [s.name for s in spans]
    assert names.count("cronoq.store.commit") == 4
    assert names.count("cronoq.store.acquire_leadership") == 2
    assert names.count("cronoq.store.recover") == 1
    assert names.count("cronoq.store.prune") == 1
    commits = [s for s in spans if s.name == "cronoq.store.commit"]
    assert {s.attributes["cronoq.epoch"] for s in commits} == {epoch}
    assert [s.attributes["cronoq.batch.size"] for s in commits] == [6, 5, 4, 1]
    fenced = commits[-1]
    assert fenced.status.status_code == trace.StatusCode.ERROR
    assert [e.attributes["exception.type"] for e in fenced.events] == ["Fenced"]
    acquired = [s for s in spans if s.name == "cronoq.store.acquire_leadership"]
    assert [s.attributes["cronoq.epoch"] for s in acquired] == [epoch, other_epoch]
    for s in spans:
        assert s.attributes["db.system.name"] == system
        shown = repr(dict(s.attributes)) + repr([dict(e.attributes or {}) for e in s.events])
        shown += s.status.description or ""
        assert not any(secret in shown for secret in SECRETS), s

    # Structured log fields for lease transitions; no task data in any log line.
    transitions = [(r.transition, r.epoch) for r in caplog.records if hasattr(r, "transition")]
    assert ("acquired", epoch) in transitions and ("lost", epoch) in transitions
    assert [r.task_id for r in caplog.records if hasattr(r, "quarantined")] == [8]
    assert [r.inbox_id for r in caplog.records if hasattr(r, "set_aside")] == [ids[2]]
    for record in caplog.records:
        assert not any(secret in record.getMessage() for secret in SECRETS), record.getMessage()


def test_sqlalchemy_instrumentation_leaves_the_store_on_its_fast_path(
    dialect: str,
    db_url: URL,
    otel: tuple[InMemoryMetricReader, InMemorySpanExporter],
    cleanup: list[Callable[[], None]],
) -> None:
    """Instrumenting the store's engine does not slow its commits: they stay on the DB-API
    cursor, PostgreSQL's inserts in the pipelined flight (seen at the driver), and so reach
    no span."""
    from opentelemetry.instrumentation.sqlalchemy import SQLAlchemyInstrumentor

    _, exporter = otel
    store = open_face("sync", db_url, CONFIG, cleanup)
    sent: list[str] = []
    after_statements(store.engine, lambda _cursor, sql: sent.append(sql.split()[0].upper()))
    instrumentor = SQLAlchemyInstrumentor()
    # Its declared range ends below SQLAlchemy 2.1, which it instruments all the same.
    instrumentor.instrument(engine=store.engine, skip_dep_check=True)  # type: ignore[no-untyped-call]
    try:
        epoch = store.acquire_leadership(timeout=10)
        with store.engine.connect() as conn:
            assert not execution.observed(conn)
        exporter.clear()
        sent.clear()
        batch = [cq.Submitted(id=cq.TaskId(i), seq=i, arrival=0, spec=spec(i)) for i in (1, 2, 3)]
        store.commit(epoch, BASE, batch)
    finally:
        instrumentor.uninstrument()  # type: ignore[no-untyped-call]
    assert "INSERT" in sent, sent
    spans = exporter.get_finished_spans()
    (commit,) = [s for s in spans if s.name == "cronoq.store.commit"]
    statements = " ".join(str(s.attributes.get("db.statement", "")) for s in spans)
    assert "cronoq_tasks" not in statements and "cronoq_leader" not in statements, statements
    assert commit.attributes is not None and commit.attributes["cronoq.batch.size"] == 3


def test_sqlalchemy_instrumentation_shows_a_commits_statements_as_child_spans_when_asked(
    dialect: str,
    db_url: URL,
    otel: tuple[InMemoryMetricReader, InMemorySpanExporter],
    cleanup: list[Callable[[], None]],
) -> None:
    """With `execution.OBSERVED` on the store's engine (docs/observability.md)."""
    from opentelemetry.instrumentation.sqlalchemy import SQLAlchemyInstrumentor

    _, exporter = otel
    store = open_face("sync", db_url, CONFIG, cleanup)
    store.engine.update_execution_options(**{execution.OBSERVED: True})
    instrumentor = SQLAlchemyInstrumentor()
    # Its declared range ends below SQLAlchemy 2.1, which it instruments all the same.
    instrumentor.instrument(engine=store.engine, skip_dep_check=True)  # type: ignore[no-untyped-call]
    try:
        epoch = store.acquire_leadership(timeout=10)
        exporter.clear()
        store.commit(epoch, BASE, [cq.Submitted(id=cq.TaskId(1), seq=1, arrival=0, spec=spec(1))])
    finally:
        instrumentor.uninstrument()  # type: ignore[no-untyped-call]
    spans = exporter.get_finished_spans()
    (commit,) = [s for s in spans if s.name == "cronoq.store.commit"]
    children = [
        s for s in spans if s.parent is not None and s.parent.span_id == commit.context.span_id
    ]
    statements = " ".join(str(s.attributes.get("db.statement", "")) for s in children)
    assert "cronoq_leader" in statements and "cronoq_tasks" in statements, statements
    for s in children:  # statements, not their parameters: no task data
        assert not any(secret in repr(dict(s.attributes)) for secret in SECRETS)


def test_status_in_prometheus_format_carries_the_json_figures(
    db_url: URL, engine: Engine, cleanup: list[Callable[[], None]]
) -> None:
    from click.testing import CliRunner
    from prometheus_client.parser import text_string_to_metric_families

    from cronoq_store.cli import main

    store = open_face("sync", db_url, CONFIG, cleanup)
    epoch = store.acquire_leadership(timeout=10)
    store.commit(
        epoch,
        BASE,
        [cq.Submitted(id=cq.TaskId(i), seq=i, arrival=0, spec=spec(i)) for i in range(1, 4)]
        + [cq.StatusChanged(id=cq.TaskId(1), status=cq.TaskStatus.FAILED, attempt=1, at=1)],
    )
    with engine.begin() as conn:
        cq.enqueue_many(conn, [cq.TaskSpec(payload=b"a"), cq.TaskSpec(payload=b"b")])
        # Task 1 finished long ago: past the default retention of one hour.
        conn.execute(update(tasks).where(tasks.c.id == 1).values(updated_unix_ns=1))
    url = db_url.render_as_string(hide_password=False)
    run = CliRunner().invoke
    shown = run(main, ["--url", url, "status", "--format", "prometheus"])
    assert shown.exit_code == 0, shown.output
    families = {f.name: f for f in text_string_to_metric_families(shown.output)}
    value = {
        name: {tuple(sorted(s.labels.items())): s.value for s in f.samples}
        for name, f in families.items()
    }
    assert all(f.type == "gauge" and f.documentation for f in families.values())
    assert value["cronoq_tasks"] == {(("pool", "default"), ("status", "queued")): 2}  # live
    assert value["cronoq_finished_tasks"] == {(): 1}
    assert set(value["cronoq_finished_last_hour_tasks"].values()) == {0}  # task 1: long ago
    assert value["cronoq_inbox_items"] == {(): 2}
    assert value["cronoq_inbox_oldest_age_seconds"][()] >= 0
    assert value["cronoq_lease_epoch"] == {(): epoch}
    assert value["cronoq_lease_held"] == {(): 1}
    assert 0 < value["cronoq_lease_expires_in_seconds"][()] <= 30
    assert value["cronoq_prune_backlog_tasks"] == {(): 1}
    (revision,) = value["cronoq_schema_info"]
    assert dict(revision)["revision"] == dict(revision)["head"]
    data = json.loads(run(main, ["--url", url, "status", "--json"]).output)
    assert data["prune_backlog"]["tasks"] == 1 and data["inbox"]["items"] == 2
    assert data["lease"]["epoch"] == epoch
    later = json.loads(run(main, ["--url", url, "status", "--retention", "0s", "--json"]).output)
    assert later["prune_backlog"]["tasks"] == 1  # the other two have not finished


def test_a_migration_logs_its_revisions_as_fields(
    db_url: URL, caplog: pytest.LogCaptureFixture
) -> None:
    from cronoq_store import migrate

    caplog.set_level(logging.INFO, logger="cronoq_store")
    engine = create_engine(db_url)
    try:
        migrate.upgrade(engine)
        migrate.upgrade(engine)  # at head: nothing to log
    finally:
        engine.dispose()
    moved = [r for r in caplog.records if hasattr(r, "to_revision")]
    assert [(r.action, r.from_revision, r.to_revision) for r in moved] == [
        ("upgrade", "none", migrate.head_revision())
    ]
