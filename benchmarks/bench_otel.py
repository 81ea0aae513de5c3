"""What OpenTelemetry costs a batch-1 commit: CPU per commit and commits/s on SQLite (full_sync
off, so the figure is the client's), each mode in a fresh process (a global provider cannot be
unset), the modes alternating over several rounds.

Modes: `off` (the store's telemetry disabled, as without opentelemetry-api), `api` (the API
installed, no SDK: what every app that does not configure one runs), `sdk` (an SDK with a
metric reader and a span processor), `sdk+sqlalchemy` (and OpenTelemetry's SQLAlchemy
instrumentation on the store's engine, which leaves commits on the DB-API cursor),
`sdk+sqlalchemy+observed` (and the engine's `cronoq_observed` option, which runs them through
SQLAlchemy's execution, so that they are spans: `execution.OBSERVED`).

    python benchmarks/bench_otel.py [--commits 3000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("off", "api", "sdk", "sdk+sqlalchemy", "sdk+sqlalchemy+observed")


def child(mode: str, commits: int) -> None:
    from cronoq_store import SqlStore, StoreConfig, Submitted, TaskId, TaskSpec, TimeBase, execution

    if mode.startswith("sdk"):
        from opentelemetry import metrics, trace
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        metrics.set_meter_provider(MeterProvider(metric_readers=[InMemoryMetricReader()]))
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
        trace.set_tracer_provider(provider)
    with tempfile.TemporaryDirectory() as tmp:
        store = SqlStore.open(Path(tmp) / "otel.db", StoreConfig(full_sync=False))
        if mode == "off":
            store._telemetry.enabled = False
        if mode.startswith("sdk+sqlalchemy"):
            from opentelemetry.instrumentation.sqlalchemy import SQLAlchemyInstrumentor

            SQLAlchemyInstrumentor().instrument(engine=store.engine, skip_dep_check=True)
        if mode.endswith("+observed"):
            store.engine.update_execution_options(**{execution.OBSERVED: True})
        base = TimeBase(unix_ns=time.time_ns())
        epoch = store.acquire_leadership()
        spec = TaskSpec(payload=b"x" * 100)
        for i in range(200):  # warm-up
            store.commit(epoch, base, [Submitted(id=TaskId(i), seq=i, arrival=0, spec=spec)])
        started, wall = time.process_time(), time.perf_counter()
        for i in range(200, 200 + commits):
            store.commit(epoch, base, [Submitted(id=TaskId(i), seq=i, arrival=0, spec=spec)])
        cpu = time.process_time() - started
        wall = time.perf_counter() - wall
        store.close()
    print(
        json.dumps(
            {"mode": mode, "cpu_ms_per_commit": cpu / commits * 1000, "per_s": commits / wall}
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--child", choices=MODES)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.commits)
        return
    got: dict[str, list[float]] = {m: [] for m in MODES}
    rate: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        order = MODES if r % 2 == 0 else tuple(reversed(MODES))
        for mode in order:
            out = subprocess.run(
                [sys.executable, __file__, "--child", mode, "--commits", str(args.commits)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            figures = json.loads(out.splitlines()[-1])
            got[mode].append(figures["cpu_ms_per_commit"])
            rate[mode].append(figures["per_s"])
    off = statistics.median(got["off"])
    print("| mode | CPU per batch-1 commit, median (min-max) | over `off` | commits/s, median |")
    print("|---|---|---|---|")
    for mode in MODES:
        med = statistics.median(got[mode])
        spread = f"{min(got[mode]):.3f}-{max(got[mode]):.3f}"
        per_s = statistics.median(rate[mode])
        print(f"| {mode} | {med:.3f} ms ({spread}) | {med - off:+.3f} ms | {per_s:,.0f} |")


if __name__ == "__main__":
    main()
