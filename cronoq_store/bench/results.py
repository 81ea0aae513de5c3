"""Results: the figures a run reports, read back from JSON, and the issue's goals."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Final, Literal

from sqlalchemy import (
    URL,
)

Metric = Literal["submit", "transition", "recover", "recover_memory", "prune"]
METRICS: Final[tuple[Metric, ...]] = ("submit", "transition", "recover", "recover_memory", "prune")


# Results.


@dataclass(frozen=True, slots=True, kw_only=True)
class Figure:
    """One measurement of the store beside the raw driver (medians over the runs)."""

    metric: Metric
    batch_size: int | None
    """Rows per commit (submit, transition) or per delete (prune); None for recovery."""
    unit: str
    store: float
    """The store's figure: rows/s for throughput, seconds for recovery, peak bytes for memory."""
    raw: float
    """The raw driver's figure, or for memory the size of what recovery returned."""
    ratio: float
    """Median over the runs of store/raw, each pair measured side by side."""
    goal: float | None
    higher_is_better: bool
    samples: int

    @property
    def met(self) -> bool | None:
        """Whether the ratio reaches the goal (None without a goal)."""
        if self.goal is None:
            return None
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
    full_sync: bool = True
    """SQLite only: synchronous=FULL (on) or NORMAL (off)."""

    @property
    def dialect(self) -> str:
        name = self.url.get_backend_name()
        return "mysql" if name in ("mysql", "mariadb") else name


def _goal(target: Target, metric: Metric, batch: int | None) -> tuple[float | None, bool]:
    """The issue's targets: (goal ratio, whether higher is better)."""
    if metric in ("recover", "recover_memory"):
        return 2.0, False
    if metric == "prune":
        return 0.8, True
    if target.dialect == "sqlite":
        if not target.full_sync:
            return None, True
        return {1: 0.9, 1000: 0.8}.get(batch or 0), True
    if metric == "submit" and batch == 1000:
        return 1.0, True
    return None, True
