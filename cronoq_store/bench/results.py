"""Results: the figures a run reports, read back from JSON, and the project's goals."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Final, Literal, get_args

from sqlalchemy import (
    URL,
)

from .. import dialects

Metric = Literal[
    "submit",
    "transition",
    "submit_cpu",
    "transition_cpu",
    "recover",
    "recover_memory",
    "prune",
    "leader_commit",
    "leader_cpu",
    "leader_p50",
    "leader_p99",
    "enqueue",
    "drain",
]
METRICS: Final[tuple[Metric, ...]] = get_args(Metric)
"""Every figure: throughput, CPU per commit at batch 1, recovery time and memory, prune, and
the leader's batch-1 commit against a hand-written fenced client (rate, CPU, latency),
and the inbox's (`bench.inbox`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Figure:
    """One measurement of the store beside a raw-driver baseline (medians over the pairs)."""

    metric: Metric
    batch_size: int | None
    """Rows per commit (submit, transition) or per delete (prune); None for recovery."""
    unit: str
    store: float
    """The store's figure: rows/s for throughput, ms of process time per commit for CPU,
    seconds for recovery, peak bytes for memory."""
    raw: float
    """The raw driver's figure, or for memory the size of what recovery returned."""
    ratio: float
    """Median over the pairs of store/raw, the two of each pair measured one after the other."""
    goal: float | None
    """The project's target: a ratio, or (CPU) the most milliseconds the store may add."""
    higher_is_better: bool
    samples: int
    baseline: str = ""
    """Which raw side (`json`, `pre-encoded`, `executemany`, `copy`; empty: the only one)."""
    ratio_min: float | None = None
    """The lowest per-pair ratio (the spread of `ratio`)."""
    ratio_max: float | None = None
    """The highest per-pair ratio."""
    excess: float | None = None
    """CPU only: median over the pairs of store minus raw, in `unit`."""

    @property
    def met(self) -> bool | None:
        """Whether the goal is reached (None without a goal): the ratio, or for CPU the
        milliseconds the store adds."""
        if self.goal is None:
            return None
        if self.excess is not None:
            return self.excess <= self.goal
        return self.ratio >= self.goal if self.higher_is_better else self.ratio <= self.goal

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["met"] = self.met
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class DatabaseResult:
    """Every figure of one database."""

    label: str
    """e.g. "sqlite full_sync=on", "postgresql 16.4", "mariadb 11.4"."""
    dialect: str
    url: str
    """The URL, password hidden."""
    figures: tuple[Figure, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchResult:
    tasks: int
    runs: int
    batch_sizes: tuple[int, ...]
    databases: tuple[DatabaseResult, ...]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchResult:
        """A result read back from `as_dict` (`--json`), e.g. to print or plot it later."""
        return cls(
            tasks=data["tasks"],
            runs=data["runs"],
            batch_sizes=tuple(data["batch_sizes"]),
            databases=tuple(
                DatabaseResult(
                    label=d["label"],
                    dialect=d["dialect"],
                    url=d["url"],
                    figures=tuple(
                        Figure(**{k: v for k, v in f.items() if k != "met"}) for f in d["figures"]
                    ),
                )
                for d in data["databases"]
            ),
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "tasks": self.tasks,
            "runs": self.runs,
            "batch_sizes": list(self.batch_sizes),
            "databases": [
                {
                    "label": d.label,
                    "dialect": d.dialect,
                    "url": d.url,
                    "figures": [f.as_dict() for f in d.figures],
                }
                for d in self.databases
            ],
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """A database to benchmark."""

    url: URL
    """Where the store runs (its store must hold no tasks)."""
    full_sync: bool = True
    """SQLite only: synchronous=FULL (on) or NORMAL (off)."""
    raw_url: URL | None = None
    """Where the raw driver runs: its own database, never the store's. None: a scratch one
    beside the store's (a sibling SQLite file, or a new database on the same server)."""

    @property
    def dialect(self) -> str:
        return dialects.class_of(self.url).name


_LEADER_COMMIT_GOALS: Final[dict[type[dialects.DefaultImpl], float]] = {
    dialects.PostgresqlImpl: 1.3
}
"""The leader's commit against the raw one, where it is not 1.0: a goal per database."""
_SUBMIT_GOALS: Final[dict[tuple[type[dialects.DefaultImpl], str], float]] = {
    (dialects.SQLiteImpl, "json"): 1.0,
    (dialects.PostgresqlImpl, "copy"): 0.9,
    (dialects.MySQLImpl, "executemany"): 1.0,
}
"""Batch-1000 submissions against each database's main raw baseline."""


def goal_of(
    target: Target, metric: Metric, batch: int | None, baseline: str
) -> tuple[float | None, bool]:
    """The project's targets: (goal, whether higher is better). SQLite is judged with
    full_sync only; latency is reported, not judged."""
    dialect = target.dialect
    server = dialects.class_of(dialect).server
    if not server and not target.full_sync:
        return None, metric not in ("recover", "recover_memory", "submit_cpu", "transition_cpu")
    match metric:
        case "leader_commit":
            return _LEADER_COMMIT_GOALS.get(dialects.class_of(dialect), 1.0), True
        case "leader_cpu":
            return (0.1 if server else 0.05), False
        case "leader_p50" | "leader_p99":
            return None, False
        case "recover":
            return (1.1 if server else 1.0), False
        case "recover_memory":
            return 1.5, False
        case "submit_cpu" | "transition_cpu":
            return (0.15 if server else 0.1), False
        case "prune":
            return 0.8, True
        case "enqueue":  # enqueue of 1 / enqueue_many of 100 vs a raw INSERT / COPY
            return (0.9 if batch == 1 else 0.8), True
        case "drain":
            return 0.8, True
        case "transition":
            return (0.9 if batch == 1000 else None), True
        case "submit" if batch == 1000:
            return _SUBMIT_GOALS.get((dialects.class_of(dialect), baseline)), True
    return None, True
