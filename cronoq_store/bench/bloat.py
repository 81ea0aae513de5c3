"""`cronoq-store bench --bloat CYCLES`: whether the tables stay the same size in the long run.

Each cycle takes `tasks` tasks through submitted, running and succeeded in commits of `batch`,
then prunes them: at most `tasks` rows live at any time. After each cycle it prints the size of
the store's task tables with their indexes, the commit rate of the cycle's transitions and, on
PostgreSQL, the share of live transitions (to running) that were heap-only (HOT) updates.
Run it against a server with the autovacuum settings production has (a PostgreSQL cluster at
its defaults, say): benchmarks/README.md has the figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Final

from sqlalchemy import URL, Connection, text

from .. import dialects
from ..model import StatusChanged, Submitted, TaskId, TaskSpec, TaskStatus, TimeBase
from ..store import SqlStore, StoreConfig

TABLES = ("cronoq_tasks", "cronoq_task_deps")


@dataclass(frozen=True, slots=True)
class Cycle:
    """What one cycle measured."""

    cycle: int
    size_mib: float
    """The task tables with their indexes (and TOAST) after the cycle's prune; SQLite: the
    database file."""
    commits_per_s: float
    """Transition commits (running, succeeded) per second in the cycle."""
    live_hot: float | None
    """PostgreSQL: the share of the cycle's live transitions that were HOT updates."""


def _size_bytes(conn: Connection) -> int:
    """The tables' size on disk, indexes included, as each database counts it."""
    return _SIZES.get(type(dialects.dialect_of(conn)), _file_size)(conn)


def _postgresql_size(conn: Connection) -> int:
    """Each table's whole size: heap, TOAST and indexes."""
    total = " + ".join(f"pg_total_relation_size('{t}')" for t in TABLES)
    return int(conn.execute(text(f"SELECT {total}")).scalar_one())


def _mysql_size(conn: Connection) -> int:
    """ANALYZE first: InnoDB's sizes are its statistics'."""
    for t in TABLES:
        conn.execute(text(f"ANALYZE TABLE {t}"))
    return int(
        conn.execute(
            text(
                "SELECT COALESCE(SUM(data_length + index_length), 0) FROM "
                "information_schema.tables WHERE table_schema = DATABASE() "
                "AND table_name IN ('cronoq_tasks', 'cronoq_task_deps')"
            )
        ).scalar_one()
    )


def _file_size(conn: Connection) -> int:
    """The whole file, free pages included: what the disk holds (SQLite reuses them)."""
    pages = conn.execute(text("PRAGMA page_count")).scalar_one()
    size = conn.execute(text("PRAGMA page_size")).scalar_one()
    return int(pages * size)


_SIZES: Final[dict[type[dialects.DefaultImpl], Callable[[Connection], int]]] = {
    dialects.PostgresqlImpl: _postgresql_size,
    dialects.MySQLImpl: _mysql_size,
}
"""How each server counts its tables' size, by the class of its database (a file's by
default)."""


def _hot(conn: Connection) -> tuple[int, int] | None:
    """PostgreSQL's updates and HOT updates of the task table so far (None elsewhere)."""
    if not isinstance(dialects.dialect_of(conn), dialects.PostgresqlImpl):
        return None
    conn.execute(text("SELECT pg_stat_clear_snapshot()"))
    row = conn.execute(
        text(
            "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
            "WHERE relname = 'cronoq_tasks'"
        )
    ).one()
    return int(row[0]), int(row[1])


def run_bloat(url: URL, *, cycles: int, tasks: int, batch: int = 1000) -> Iterator[Cycle]:
    """Run the cycles on `url` (an empty store), yielding each cycle's figures."""
    base = TimeBase(unix_ns=time.time_ns())
    spec = TaskSpec(payload=b"p" * 200, labels={"team": "bench"}, tags=frozenset({"bloat"}))
    at = 0
    next_id = 0
    for n in range(1, cycles + 1):
        # A store per cycle: its backends end with it, so PostgreSQL's counts are reported.
        with SqlStore.open(url, StoreConfig(lease_ttl=timedelta(seconds=60))) as store:
            epoch = store.acquire_leadership(timeout=30)
            ids = range(next_id, next_id + tasks)
            next_id += tasks
            for start in range(0, tasks, batch):
                chunk = ids[start : start + batch]
                store.commit(
                    epoch,
                    base,
                    [Submitted(id=TaskId(i), seq=i, arrival=0, spec=spec) for i in chunk],
                )
            with store.engine.connect() as conn:
                before = _hot(conn)
            began = time.perf_counter()
            commits = 0
            for status in (TaskStatus.RUNNING, TaskStatus.SUCCEEDED):
                at += 1
                for start in range(0, tasks, batch):
                    chunk = ids[start : start + batch]
                    store.commit(
                        epoch,
                        base,
                        [
                            StatusChanged(id=TaskId(i), status=status, attempt=1, at=at)
                            for i in chunk
                        ],
                    )
                    commits += 1
            elapsed = time.perf_counter() - began
            store.prune(timedelta(0))
        with (
            SqlStore.open(url, StoreConfig(migrate=False)) as reader,
            reader.engine.connect() as conn,
        ):
            after = _waited_hot(conn, before, tasks * 2)
            size = _size_bytes(conn)
        live_hot = None
        if before is not None and after is not None:
            # Each cycle makes `tasks` live transitions (HOT-able) and `tasks` terminal ones
            # (which set the indexed finished time: never HOT).
            live_hot = (after[1] - before[1]) / tasks
        yield Cycle(n, round(size / 2**20, 2), round(commits / elapsed, 1), live_hot)


def _waited_hot(
    conn: Connection, before: tuple[int, int] | None, updates: int
) -> tuple[int, int] | None:
    """PostgreSQL's counts once the cycle's `updates` are reported (bounded wait)."""
    if before is None:
        return None
    deadline = time.monotonic() + 10
    while True:
        now = _hot(conn)
        assert now is not None
        if now[0] - before[0] >= updates or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def as_rows(cycles: list[Cycle]) -> list[dict[str, Any]]:
    """The cycles as JSON-ready dicts."""
    return [asdict(c) for c in cycles]
