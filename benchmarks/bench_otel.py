"""What OpenTelemetry costs a batch-1 commit: CPU per commit on SQLite (full_sync off, so the
figure is the client's), each mode in a fresh process (a global provider cannot be unset), the
modes alternating over several rounds.

Modes: `off` (the store's telemetry disabled, as without opentelemetry-api), `api` (the API
installed, no SDK: what every app that does not configure one runs), `sdk` (an SDK with a
metric reader and a span processor), `sdk+sqlalchemy` (and OpenTelemetry's SQLAlchemy
instrumentation on the store's engine, which moves commits to the observed path).

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

MODES = ("off", "api", "sdk", "sdk+sqlalchemy")


def child(mode: str, commits: int) -> None:
    from cronoq_store import SqlStore, StoreConfig, Submitted, TaskId, TaskSpec, TimeBase

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
        if mode == "sdk+sqlalchemy":
            from opentelemetry.instrumentation.sqlalchemy import SQLAlchemyInstrumentor

            SQLAlchemyInstrumentor().instrument(engine=store.engine, skip_dep_check=True)
        base = TimeBase(unix_ns=time.time_ns())
        epoch = store.acquire_leadership()
        spec = TaskSpec(payload=b"x" * 100)
        for i in range(200):  # warm-up
            store.commit(epoch, base, [Submitted(id=TaskId(i), seq=i, arrival=0, spec=spec)])
        started = time.process_time()
        for i in range(200, 200 + commits):
            store.commit(epoch, base, [Submitted(id=TaskId(i), seq=i, arrival=0, spec=spec)])
        cpu = time.process_time() - started
        store.close()
    print(json.dumps({"mode": mode, "cpu_ms_per_commit": cpu / commits * 1000}))


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
    for r in range(args.rounds):
        order = MODES if r % 2 == 0 else tuple(reversed(MODES))
        for mode in order:
            out = subprocess.run(
                [sys.executable, __file__, "--child", mode, "--commits", str(args.commits)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            got[mode].append(json.loads(out.splitlines()[-1])["cpu_ms_per_commit"])
    off = statistics.median(got["off"])
    print("| mode | CPU per batch-1 commit, median (min-max) | over `off` |")
    print("|---|---|---|")
    for mode in MODES:
        med = statistics.median(got[mode])
        spread = f"{min(got[mode]):.3f}-{max(got[mode]):.3f}"
        print(f"| {mode} | {med:.3f} ms ({spread}) | {med - off:+.3f} ms |")


if __name__ == "__main__":
    main()
