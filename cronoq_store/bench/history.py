"""`cronoq-store bench --history N`: what the store's own work costs as history piles up.

The same measurements (recovery of `LIVE` live tasks, batch-`BATCH` commits, prune of `LIVE`
old tasks) on two databases in turns: one holding `BASELINE` finished tasks older than the
retention, the other each history size given, topped up from one size to the next.
The history is written straight into the table with one INSERT ... SELECT over a recursive
row generator per chunk (server-side, no row crosses the wire), outside the store: filling
10,000,000 tasks through commits would take longer than everything measured.

The figures at each size are medians over `runs` pairs, the order reversed from one pair to
the next (a shared machine drifts); a ratio is the median of the per-pair ratios. Recovery
should depend on the live tasks, not on the history (ratio <= 1.2); commits and prune should
not slow down (>= 0.9).
"""

from __future__ import annotations

import contextlib
import gc
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from functools import partial
from typing import Any, Final

import click
from sqlalchemy import (
    BigInteger,
    Boolean,
    Engine,
    Insert,
    Integer,
    String,
    bindparam,
    cast,
    delete,
    func,
    insert,
    literal,
    select,
)
from sqlalchemy import exc as sa_exc

from .. import codec, dialects, inspection
from ..model import Mutation, StatusChanged, TaskSpec, TaskStatus, TimeBase
from ..schema import task_deps, tasks
from ..store import SqlStore, StoreConfig
from .results import Target
from .targets import raw_database, resolve_targets
from .workload import PAYLOAD_BYTES, Workload, in_batches

BASELINE: Final = 10_000
"""The history every size is compared with."""
LIVE: Final = 10_000
"""Live tasks recovered, and old tasks pruned, at each size."""
BATCH: Final = 1000
"""Rows per commit."""
FILL_CHUNK: Final = 100_000
"""History rows per INSERT (and transaction) while filling."""
RETENTION: Final = timedelta(hours=1)
HISTORY_AGE: Final = timedelta(hours=2)
"""How long ago the history finished: past the retention, so recovery returns none of it."""
PRUNED_AGE: Final = timedelta(hours=10)
"""How long ago the tasks each prune deletes finished: before the whole history."""
PRUNE_OLDER_THAN: Final = timedelta(hours=5)
"""The prune's cutoff: between the pruned tasks and the history, which stays."""
VICTIM_IDS: Final = 4_000_000_000_000
"""Where the pruned tasks' ids start (above the history and the live tasks)."""
LIVE_IDS: Final = 2_000_000_000_000
"""Where the live tasks' ids start (above every history size)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HistoryFigures:
    """Medians at one history size, and the medians of its per-pair ratios against a database
    holding `BASELINE` old tasks, measured in turns with it."""

    history: int
    """Finished tasks older than the retention in the table."""
    recover_s: float
    """Seconds to recover `LIVE` live tasks."""
    commit_rows_s: float
    """Rows/s of batch-`BATCH` commits: submissions, then transitions (running, succeeded)."""
    prune_rows_s: float
    """Rows/s of `SqlStore.prune` deleting `LIVE` old tasks (the history stays)."""
    looks_s: float
    """Seconds of `cronoq-store status`'s and the dashboard overview's reads, together."""
    base_recover_s: float
    base_commit_rows_s: float
    base_prune_rows_s: float
    base_looks_s: float
    """The same figures on the `BASELINE` database, in the same turns."""
    recover_ratio: float
    """Median of recovery time at `history` over the baseline's (lower is better; goal 1.2)."""
    commit_ratio: float
    """Median of the commit rate over the baseline's (goal >= 0.9)."""
    prune_ratio: float
    """Median of the prune rate over the baseline's (goal >= 0.9)."""
    looks_ratio: float
    """Median of status + overview time over the baseline's (lower is better)."""
    fill_s: float
    """Seconds the fill to this size took (not a figure of the store)."""


def _ns_ago(age: timedelta) -> int:
    return time.time_ns() - age // timedelta(microseconds=1) * 1000


def fill_stmt() -> Insert:
    """Insert history rows with ids `lo`..`hi`, finished (succeeded) at `finished` + id ns:
    every NOT NULL column as a commit writes it, a 100-byte payload, a key per row."""
    spec = TaskSpec(payload=bytes(PAYLOAD_BYTES), kind="bench.history")
    values = codec.spec_columns(TimeBase(unix_ns=0), spec)
    # 0..999 by recursion (MariaDB stops a recursion at max_recursive_iterations, 1000 by
    # default), then thousands x units: up to 1,000,000 ids from `lo`, cut at `hi`.
    units = select(literal(0, BigInteger).label("i")).cte("units", recursive=True)
    units = units.union_all(select(units.c.i + 1).where(units.c.i < 999))
    thousands = units.alias("thousands")
    i = (bindparam("lo", type_=BigInteger) + thousands.c.i * 1000 + units.c.i).label("i")
    seq = (
        select(i)
        .select_from(thousands.join(units, literal(True, Boolean)))
        .where(thousands.c.i <= bindparam("top", type_=BigInteger))
        .subquery("seq")
    )
    at = bindparam("finished", type_=BigInteger) + seq.c.i
    row: dict[str, Any] = {
        "id": seq.c.i,
        "seq": seq.c.i,
        "arrival_unix_ns": at,
        "key": literal("history-", String) + cast(seq.c.i, String),
        "status": literal(TaskStatus.SUCCEEDED.value, String),
        "terminal": literal(True, Boolean),
        "attempt": literal(1, Integer),
        "updated_unix_ns": at,
        "finished_unix_ns": at,
    }
    for name, value in values.items():
        if name not in row and value is not None:
            row[name] = literal(value, tasks.c[name].type)
    picked = select(*row.values()).where(seq.c.i <= bindparam("hi", type_=BigInteger))
    return insert(tasks).from_select(list(row), picked)


def fill(engine: Engine, lo: int, hi: int, finished_unix_ns: int) -> None:
    """History rows with ids `lo`..`hi`-1, in chunks of `FILL_CHUNK` rows per transaction."""
    stmt = fill_stmt()
    for start in range(lo, hi, FILL_CHUNK):
        end = min(hi, start + FILL_CHUNK) - 1
        with engine.begin() as conn:
            top = (end - start) // 1000
            conn.execute(stmt, {"lo": start, "hi": end, "top": top, "finished": finished_unix_ns})


def analyze(engine: Engine) -> None:
    """What the server's own upkeep does after a large load: PostgreSQL VACUUM ANALYZE
    (autovacuum, off on the shared development server), MariaDB ANALYZE TABLE (InnoDB's
    persistent statistics after 10 % changed). SQLite keeps no statistics unless asked."""
    dialect = dialects.name(engine.dialect)
    if dialect == "sqlite":
        return
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        prep = conn.dialect.identifier_preparer
        for table in (tasks, task_deps):
            name = prep.format_table(table)
            word = "VACUUM ANALYZE" if dialect == "postgresql" else "ANALYZE TABLE"
            conn.exec_driver_sql(f"{word} {name}").close()


def _timed(fn: Callable[[], Any]) -> float:
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class _History:
    """One database: its store leads; its history grows from size to size."""

    def __init__(self, target: Target) -> None:
        config = StoreConfig(
            full_sync=target.full_sync,
            retention=RETENTION,
            lease_ttl=timedelta(minutes=10),
            lease_renew=timedelta(seconds=5),
        )
        self.store = SqlStore.open(target.url, config)
        self.engine = self.store.engine
        self.base = TimeBase(unix_ns=time.time_ns())
        self.work = Workload(self.base)
        self.work.next_id = LIVE_IDS
        self.epoch = self.store.acquire_leadership()
        self.size = 0
        with self.engine.connect() as conn:
            dialect = conn.dialect
            version = ".".join(str(v) for v in (dialect.server_version_info or ())[:3])
            name = "mariadb" if getattr(dialect, "is_mariadb", False) else dialect.name
        self.label = f"{name} {version}"

    def close(self) -> None:
        self.store.close()

    def commit(self, batch: Sequence[Mutation]) -> None:
        if not self.store.is_leader:
            self.epoch = self.store.acquire_leadership()
        self.store.commit(self.epoch, self.base, batch)

    def commit_all(self, batches: Sequence[Sequence[Mutation]]) -> None:
        for b in batches:
            self.commit(b)

    def grow(self, size: int) -> float:
        """Top the history up to `size` tasks; seconds taken (with the server's upkeep)."""
        start = time.perf_counter()
        fill(self.engine, self.size + 1, size + 1, _ns_ago(HISTORY_AGE) - size)
        analyze(self.engine)
        with self.engine.connect() as conn:
            stored = conn.execute(
                select(func.count()).select_from(tasks).where(tasks.c.id.between(1, size))
            ).scalar_one()
        if stored != size:
            raise RuntimeError(f"the history holds {stored} tasks, expected {size}")
        self.size = size
        return time.perf_counter() - start

    def _drop_live(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(delete(task_deps).where(task_deps.c.task_id >= LIVE_IDS))
            conn.execute(delete(tasks).where(tasks.c.id >= LIVE_IDS, tasks.c.id < VICTIM_IDS))

    def _looks(self) -> None:
        """What an operator reads: `cronoq-store status` and the dashboard's overview (when
        the web extra is installed)."""
        with self.engine.connect() as conn:
            inspection.status(conn, schema=None, retention=RETENTION)
        try:
            from ..web import views
        except ImportError:  # pragma: no cover - without the web extra
            return
        with self.engine.connect() as conn:
            views.overview(conn, schema=None, retention=RETENTION)

    def one_run(self) -> tuple[float, float, float, float]:
        """Recovery seconds, commit rows/s, prune rows/s, status + overview seconds, once."""
        subs = self.work.submissions(LIVE)
        t = self.work.now()
        running = [StatusChanged(id=m.id, status=TaskStatus.RUNNING, attempt=1, at=t) for m in subs]
        done = [
            StatusChanged(id=m.id, status=TaskStatus.SUCCEEDED, attempt=1, at=t + 1) for m in subs
        ]
        commit_s = _timed(partial(self.commit_all, in_batches(subs, BATCH)))
        recovered: list[int] = []
        recover_s = _timed(lambda: recovered.append(len(self.store.recover(self.base).tasks)))
        if recovered != [LIVE]:
            raise RuntimeError(f"recovered {recovered} live tasks, expected {LIVE}")
        looks_s = _timed(self._looks)
        commit_s += _timed(
            partial(self.commit_all, in_batches(running, BATCH) + in_batches(done, BATCH))
        )
        self._drop_live()
        fill(self.engine, VICTIM_IDS, VICTIM_IDS + LIVE, _ns_ago(PRUNED_AGE))
        if dialects.vacuums(self.engine.dialect):
            analyze(self.engine)  # the dead rows of earlier runs, not this prune's
        # The pages this run's commits and fill dirtied, written out: SQLite's WAL otherwise
        # held them all, and the prune's first automatic checkpoint paid for their writes.
        checkpoint(self.engine)
        pruned: list[int] = []
        prune_s = _timed(lambda: pruned.append(self.store.prune(PRUNE_OLDER_THAN)))
        if pruned != [LIVE]:
            raise RuntimeError(f"pruned {pruned}, expected {LIVE}")
        return recover_s, 3 * LIVE / commit_s, LIVE / prune_s, looks_s


def checkpoint(engine: Engine) -> None:
    """Write out what a fill left to flush, so the measurements do not pay for it
    (PostgreSQL's CHECKPOINT needs a privileged user: skipped where refused)."""
    dialect = dialects.name(engine.dialect)
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        try:
            if dialect == "postgresql":
                conn.exec_driver_sql("CHECKPOINT").close()
            elif dialect == "sqlite":
                conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)").close()
        except sa_exc.DBAPIError:
            pass


def measure(small: _History, big: _History, runs: int, fill_s: float) -> HistoryFigures:
    """`runs` pairs, the order reversed from one pair to the next so that drift (a
    neighbour's load, caches) favours neither side; medians and per-pair ratios."""
    pairs = []
    for run in range(runs):
        first, second = (big, small) if run % 2 else (small, big)
        one = first.one_run()
        other = second.one_run()
        pairs.append((one, other) if first is small else (other, one))

    def med(side: int, i: int) -> float:
        return statistics.median(p[side][i] for p in pairs)

    def ratio(i: int) -> float:
        return statistics.median(p[1][i] / p[0][i] for p in pairs)

    return HistoryFigures(
        history=big.size,
        recover_s=med(1, 0),
        commit_rows_s=med(1, 1),
        prune_rows_s=med(1, 2),
        looks_s=med(1, 3),
        base_recover_s=med(0, 0),
        base_commit_rows_s=med(0, 1),
        base_prune_rows_s=med(0, 2),
        base_looks_s=med(0, 3),
        recover_ratio=ratio(0),
        commit_ratio=ratio(1),
        prune_ratio=ratio(2),
        looks_ratio=ratio(3),
        fill_s=fill_s,
    )


def run_history(
    target: Target, sizes: Sequence[int], *, runs: int
) -> tuple[str, list[HistoryFigures]]:
    """The server's name and version, and the figures at each of `sizes` (ascending: the
    target's history is topped up from one to the next), each beside a database of its own
    (`targets.raw_database`) holding `BASELINE` old tasks."""
    with contextlib.ExitStack() as stack:
        base_url = stack.enter_context(raw_database(target))
        small = _History(Target(url=base_url, full_sync=target.full_sync))
        stack.callback(small.close)
        big = _History(target)
        stack.callback(big.close)
        click.echo(f"{big.label}:", err=True)
        small.grow(BASELINE)
        checkpoint(small.engine)
        figures = []
        for size in sorted(set(sizes)):
            fill_s = big.grow(size)
            checkpoint(big.engine)
            click.echo(f"  history {size}: filled in {fill_s:.1f} s", err=True)
            small.one_run()  # warm-up, untimed: caches, plans, the servers' own first reads
            big.one_run()
            f = measure(small, big, runs, fill_s)
            figures.append(f)
            click.echo(
                f"  history {size}: recover {f.recover_s:.3f} s (x{f.recover_ratio:.2f}), "
                f"commits {f.commit_rows_s:.0f} rows/s (x{f.commit_ratio:.2f}), "
                f"prune {f.prune_rows_s:.0f} rows/s (x{f.prune_ratio:.2f}), "
                f"status + overview {f.looks_s:.3f} s (x{f.looks_ratio:.2f})",
                err=True,
            )
        return big.label, figures
    raise AssertionError("unreachable")  # pragma: no cover


def history_command(
    urls: Sequence[str],
    dialect_names: Sequence[str],
    sizes: Sequence[int],
    runs: int,
    as_json: bool,
) -> None:
    """`--history`: every target in turn (SQLite with full_sync on only), a table per target."""
    results: dict[str, list[dict[str, Any]]] = {}
    with resolve_targets(urls, dialect_names) as targets:
        for target in targets:
            if not target.full_sync:
                continue  # the history's cost does not depend on fsync
            name, figures = run_history(target, sizes, runs=runs)
            results[name] = [asdict(f) for f in figures]
            if not as_json:
                click.echo(history_table(name, figures))
    if as_json:
        click.echo(json.dumps(results, indent=2))


def history_table(name: str, figures: Sequence[HistoryFigures]) -> str:
    """The figures as a Markdown table, each size's ratios against the baseline database's."""
    lines = [
        f"{name}: recovery of {LIVE:,} live tasks, batch-{BATCH} commits, prune of {LIVE:,}; "
        f"x: median per-pair ratio against {BASELINE:,} old tasks",
        "",
        "| old finished tasks | recover (s) | x | commits (rows/s) | x | prune (rows/s) | x "
        "| status + overview (s) | x |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for f in figures:
        lines.append(
            f"| {f.history:,} | {f.recover_s:.3f} | {f.recover_ratio:.2f} | "
            f"{f.commit_rows_s:,.0f} | {f.commit_ratio:.2f} | {f.prune_rows_s:,.0f} | "
            f"{f.prune_ratio:.2f} | {f.looks_s:.3f} | {f.looks_ratio:.2f} |"
        )
    return "\n".join(lines) + "\n"
