"""How much Python a batch-1 commit runs: the package modules it enters and its calls.

Opens a SQLite store in a temporary directory, leads, warms up (compile caches, the kept
connection), then profiles one batch-1 commit of a submission and one of a transition with
cProfile (built-ins included) and prints, for each, the number of distinct `cronoq_store`
modules entered, their names, and the total number of calls. Deterministic: the same build
prints the same figures (telemetry off unless an SDK is configured, as in production).

    python benchmarks/commit_calls.py [--verbose]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
from collections.abc import Callable
from pathlib import Path

from cronoq_store import SqlStore, StatusChanged, Submitted, TaskId, TaskSpec, TaskStatus, TimeBase

BASE = TimeBase(unix_ns=1_700_000_000_000_000_000)
PACKAGE = "cronoq_store"


def profiled(fn: Callable[[], None]) -> tuple[set[str], int, pstats.Stats]:
    """The package modules `fn` enters and its total calls (built-ins included)."""
    profile = cProfile.Profile(builtins=True)
    profile.runcall(fn)
    stats = pstats.Stats(profile)
    modules: set[str] = set()
    calls = 0
    for (path, _line, _name), (_cc, nc, _tt, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        calls += nc
        parts = Path(path).parts
        if PACKAGE in parts:
            modules.add("/".join(parts[parts.index(PACKAGE) :]))
    return modules, calls, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="print the top functions too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, SqlStore.open(Path(tmp) / "s.db") as store:
        epoch = store.acquire_leadership()
        next_id = 0

        def submission() -> Callable[[], None]:
            nonlocal next_id
            next_id += 1
            spec = TaskSpec(payload=b"x", key=f"k{next_id}")
            batch = [Submitted(id=TaskId(next_id), seq=next_id, arrival=0, spec=spec)]
            return lambda: store.commit(epoch, BASE, batch)

        def transition() -> Callable[[], None]:
            change = StatusChanged(id=TaskId(next_id), status=TaskStatus.RUNNING, attempt=1, at=5)
            return lambda: store.commit(epoch, BASE, [change])

        for _ in range(50):  # warm-up: caches filled, the connection kept
            submission()()
            transition()()
        for name, fn in (("submission", submission), ("transition", transition)):
            modules, calls, stats = profiled(fn())  # the batch built outside
            print(f"batch-1 {name}: {len(modules)} package modules, {calls} calls")
            print("  " + ", ".join(sorted(modules)))
            if args.verbose:
                stats.sort_stats("ncalls").print_stats(25)


if __name__ == "__main__":
    main()
