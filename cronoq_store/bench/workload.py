"""The workload: realistic specs, handed out identically to the store and the raw driver."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any, Final

from ..model import (
    ById,
    ByKey,
    Dep,
    Submitted,
    TaskId,
    TaskSpec,
    TimeBase,
)

DEFAULT_TASKS: Final = 100_000
DEFAULT_BATCH_SIZES: Final = (1, 10, 100, 1000)
PAYLOAD_BYTES: Final = 100
MIN_COMMITS: Final = 20
"""Commits per throughput sample at least (large batches)."""
MIN_ROWS: Final = 500
"""Rows per throughput sample at least (small batches: this many commits)."""
POPULATE_BATCH: Final = 1000
DEFAULT_RUNS: Final = 5
"""Pairs per figure (each figure is the median of their ratios)."""


# The workload: realistic specs, the same for the store and the raw driver.


class Workload:
    """Task ids, specs and times, handed out identically to both sides."""

    def __init__(self, base: TimeBase) -> None:
        self.base = base
        rng = random.Random(42)
        self._payloads = [rng.randbytes(PAYLOAD_BYTES) for _ in range(64)]
        self.output = rng.randbytes(PAYLOAD_BYTES)
        self.next_id = 1

    def now(self) -> int:
        """Engine time now."""
        return time.time_ns() - self.base.unix_ns

    def spec(self, i: int) -> TaskSpec:
        deps: tuple[Dep, ...] = ()
        if i > 2:
            deps = (Dep(target=ById(id=TaskId(i - 1))), Dep(target=ByKey(key=f"bench-{i - 2}")))
        return TaskSpec(
            payload=self._payloads[i % 64],
            kind="bench.job",
            key=f"bench-{i}",
            deps=deps,
            tags=frozenset({"bench", f"t{i % 8}"}),
            labels={"team": "core", "shard": str(i % 16)},
        )

    def submissions(self, count: int) -> list[Submitted]:
        start = self.next_id
        self.next_id += count
        arrival = self.now()
        return [
            Submitted(id=TaskId(i), seq=i, arrival=arrival, spec=self.spec(i))
            for i in range(start, start + count)
        ]


def in_batches(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]
