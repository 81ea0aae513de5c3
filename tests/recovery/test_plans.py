"""Cost flat as history grows: recovery, the queries and the dashboard's counts read only what
they return, through indexes, however many old finished tasks the table holds.

Each statement runs over `HISTORY` finished tasks older than the retention (written straight
into the table, as `cronoq-store bench --history` fills it) beside `LIVE` live tasks, some of
which depend on old tasks by id and by key, and `RECENT` tasks finished within the retention.
What each reads of `cronoq_tasks` is taken from the server's own account of the statement:

- PostgreSQL: `EXPLAIN (ANALYZE, FORMAT JSON)`, the rows every scan of the table produced or
  filtered out (after `ANALYZE`, as autovacuum leaves a table);
- MariaDB: `ANALYZE FORMAT=JSON`, `r_rows` of every access to the table (after `ANALYZE
  TABLE`, as InnoDB's persistent statistics do);
- SQLite: `EXPLAIN QUERY PLAN` (no `SCAN` of the table), and the virtual machine's steps
  counted by a progress handler, which do not grow when the history grows five-fold.

On the servers a statement that reads a twentieth of the history fails: each reads what it
returns (at most a few rows per live task), where recovery's finished query read every old
finished task.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from builders import mysql_accesses
from sqlalchemy import URL, Engine, Executable, event, func, select

from cronoq_store import (
    ById,
    ByKey,
    Dep,
    SqlStore,
    StoreConfig,
    TaskId,
    TimeBase,
    dialects,
    execution,
)
from cronoq_store.bench import history
from cronoq_store.model import StatusChanged, Submitted, TaskSpec, TaskStatus
from cronoq_store.repository import arrays, folding, operators, prune, queries, recovery
from cronoq_store.schema import tasks

HISTORY = 100_000
"""Old finished tasks (ids 1..HISTORY, keys `history-<id>`)."""
LIVE = 200
"""Live tasks (ids from `LIVE_IDS`), each depending on an old task by id or by key."""
RECENT = 50
"""Tasks finished now, within the retention."""
LIVE_IDS = 10_000_000
CAP = 1000
"""`operators.COUNT_CAP` in these tests: a count stops after this many index entries."""
BUDGET = HISTORY // 20
"""Rows of cronoq_tasks a statement may read (PostgreSQL, MariaDB): a prune batch's 1000 and
a few per live task, never a share of the history."""


@dataclass(frozen=True)
class Case:
    """A statement, its parameters, and whether it is the store's own path or a count."""

    name: str
    stmt: Executable
    params: dict[str, Any]


def _cases(now_ns: int) -> list[Case]:
    cutoff = now_ns - 3600 * 10**9
    return [
        # Recovery.
        Case("high_water", recovery.high_water_stmt(), {}),
        Case("live_tasks", recovery.live_tasks_stmt(), {}),
        Case("odd_flag_tasks", recovery.odd_flag_tasks_stmt(), {}),
        Case("recent", recovery.recent_stmt(), {"cutoff": cutoff}),
        Case("old_count", recovery.old_count_stmt(), {"cutoff": cutoff, "cap": LIVE + 1}),
        Case("old_finished", recovery.old_finished_stmt(), {"cutoff": cutoff, "limit": LIVE + 1}),
        # The targets live tasks need, as recovery looks them up (IN lists, or arrays).
        Case("needed_by_id", recovery.needed_by_id_stmt(), {"ids": sorted(_NEEDED_IDS)}),
        Case("needed_by_key", recovery.needed_by_key_stmt(), {"ids": sorted(_NEEDED_KEYS)}),
        Case(
            "needed_live_keys",
            recovery.needed_by_key_stmt(),
            {"ids": [f"live-{i}" for i in range(LIVE)]},
        ),
        # Prune: one batch's victims, and the finished tasks without a finish time.
        Case("prunable", prune.prunable_stmt(), {"cutoff": cutoff, "limit": 1000}),
        Case("unstamped", prune.unstamped_stmt(), {"limit": 1000}),
        # Queries.
        Case("task_by_id", queries.task_by_id_stmt(), {"id": HISTORY // 2}),
        Case("task_by_key", queries.task_by_key_stmt(), {"key": f"history-{HISTORY // 3}"}),
        Case(
            "list_finished",
            queries.list_finished_stmt(pools=False, statuses=False, after=True),
            {"after": HISTORY // 2, "limit": 50},
        ),
        Case("output_of", queries.output_of_stmt(), {"id": HISTORY // 4}),
        # The dashboard's overview.
        Case("live_counts", operators.live_counts_stmt(), {}),
        Case("finished_since", operators.finished_since_count_stmt(), {"cutoff": cutoff}),
        Case("finished_by_status", operators.finished_by_status_stmt(), {"since": cutoff}),
        Case("finished_per_minute", operators.finished_per_minute_stmt(), {"since": cutoff}),
        # `status`'s and the overview's finished counts, capped (`inspection.count`).
        Case(
            "finished_capped",
            operators.capped_count_stmt(operators.finished_rows_stmt()),
            {"cap": CAP + 1},
        ),
        Case(
            "backlog_capped",
            operators.capped_count_stmt(operators.backlog_rows_stmt()),
            {"cap": CAP + 1, "cutoff": cutoff},
        ),
    ]


def _by_key(i: int) -> int:
    """The old task live task `i` depends on by key: every tenth also by id (returned once)."""
    return 1 + i * 499 if i % 10 == 0 else HISTORY - i * 41


_NEEDED_IDS = {1 + i * 499 for i in range(LIVE)}
"""The old tasks the live ones depend on by id."""
_NEEDED_KEYS = {f"history-{_by_key(i)}" for i in range(LIVE)}
"""The keys of those they depend on by key."""


@pytest.fixture
def filled(db_url: URL) -> Iterator[Engine]:
    """The store's database holding the history, the live tasks and the recent ones."""
    config = StoreConfig(retention=timedelta(hours=1), lease_ttl=timedelta(minutes=5))
    with SqlStore.open(db_url, config) as store:
        history.fill(store.engine, 1, HISTORY + 1, time.time_ns() - 2 * 3600 * 10**9 - HISTORY)
        base = TimeBase(unix_ns=time.time_ns())
        epoch = store.acquire_leadership(timeout=10)
        live = [
            Submitted(
                id=TaskId(LIVE_IDS + i),
                seq=i,
                arrival=0,
                spec=TaskSpec(
                    payload=b"live",
                    key=f"live-{i}",
                    deps=(
                        Dep(target=ById(id=TaskId(1 + i * 499))),
                        Dep(target=ByKey(key=f"history-{_by_key(i)}")),
                    ),
                ),
            )
            for i in range(LIVE)
        ]
        store.commit(epoch, base, live)
        recent_ids = [TaskId(LIVE_IDS + LIVE + i) for i in range(RECENT)]
        store.commit(
            epoch,
            base,
            [
                Submitted(id=i, seq=i, arrival=0, spec=TaskSpec(payload=b"r", key=f"recent-{i}"))
                for i in recent_ids
            ]
            + [
                StatusChanged(id=i, status=TaskStatus.SUCCEEDED, attempt=1, at=1)
                for i in recent_ids
            ],
        )
        store.release_leadership()
        history.analyze(store.engine)
        yield store.engine


def _compiled(engine: Engine, case: Case) -> tuple[str, Any]:
    """The SQL and parameters the store sends: an IN list ("ids") as one array where the
    driver binds arrays (`execution.run_in`), its values' placeholders elsewhere."""
    stmt: Any = case.stmt
    if "ids" in case.params and dialects.dialect_of(engine).binds_arrays:
        stmt = execution.in_as_any(stmt)
    compiled = stmt.compile(dialect=engine.dialect)
    state = compiled.construct_expanded_state(case.params)
    params: Any = state.parameters
    if state.positiontup is not None:
        params = tuple(params[name] for name in state.positiontup)
    return state.statement, params


def _pg_rows_read(plan: dict[str, Any]) -> int:
    """Rows every scan of cronoq_tasks in `plan` produced or filtered out, over all loops."""
    read = 0
    if plan.get("Relation Name") == tasks.name:
        per_loop = (
            plan.get("Actual Rows", 0)
            + plan.get("Rows Removed by Filter", 0)
            + plan.get("Rows Removed by Index Recheck", 0)
        )
        read += per_loop * plan.get("Actual Loops", 1)
    for child in plan.get("Plans", ()):
        read += _pg_rows_read(child)
    return read


def _pg_node_types(plan: dict[str, Any]) -> Iterator[tuple[str, str | None]]:
    yield plan["Node Type"], plan.get("Relation Name")
    for child in plan.get("Plans", ()):
        yield from _pg_node_types(child)


def _sqlite_steps(engine: Engine, sql: str, params: Any) -> int:
    """Virtual machine instructions `sql` ran, in thousands (a progress handler's calls)."""
    steps = 0

    def count() -> int:
        nonlocal steps
        steps += 1
        return 0

    raw = engine.raw_connection()
    try:
        conn = raw.driver_connection
        assert conn is not None
        conn.set_progress_handler(count, 1000)
        try:
            conn.execute(sql, params).fetchall()
        finally:
            conn.set_progress_handler(None, 0)
    finally:
        raw.close()
    return steps


CASE_NAMES = [c.name for c in _cases(0)]


def _assert_reads_little(engine: Engine, dialect: str, name: str, sql: str, params: Any) -> None:
    """The server's account of `sql`: no full scan of the task table, and (on the servers)
    at most `BUDGET` of its rows read."""
    if dialect == "postgresql":
        with engine.connect() as conn:
            doc = conn.exec_driver_sql(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", params).scalar()
        plan = (doc if isinstance(doc, list) else json.loads(doc))[0]["Plan"]
        text = json.dumps(plan, indent=1)
        scans = [t for t, rel in _pg_node_types(plan) if rel == tasks.name]
        assert "Seq Scan" not in scans, f"{name}: {text}"
        read = _pg_rows_read(plan)
        assert read <= BUDGET, f"{name} read {read} rows of {tasks.name}:\n{text}"
    elif dialect == "mysql":
        with engine.connect() as conn:
            doc = conn.exec_driver_sql(f"ANALYZE FORMAT=JSON {sql}", params).scalar()
        accesses = list(mysql_accesses(json.loads(doc)))
        text = json.dumps(accesses, indent=1)
        assert all(a.get("access_type") not in ("ALL", "index") for a in accesses), text
        read = sum(float(a.get("r_rows") or 1) * float(a.get("r_loops") or 1) for a in accesses)
        assert read <= BUDGET, f"{name} read {read} rows of {tasks.name}:\n{text}"
    else:
        with engine.connect() as conn:
            steps = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {sql}", params).all()
        lines = [str(row[-1]) for row in steps]
        assert not any(line.startswith(f"SCAN {tasks.name}") for line in lines), (name, lines)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_reads_only_what_it_returns(filled: Engine, dialect: str, name: str) -> None:
    engine = filled
    case = next(c for c in _cases(time.time_ns()) if c.name == name)
    sql, params = _compiled(engine, case)
    with engine.connect() as conn:
        returned = len(conn.exec_driver_sql(sql, params).all())
    _assert_reads_little(engine, dialect, name, sql, params)
    assert returned <= 1000 + LIVE + RECENT


def _statements_of(engine: Engine, look: Any) -> list[tuple[str, Any]]:
    """Every statement `look(conn)` sends that reads the task table (its EXPLAINs aside)."""
    sent: list[tuple[str, Any]] = []

    def record(_c: Any, _cursor: Any, sql: str, params: Any, _ctx: Any, _many: bool) -> None:
        if tasks.name in sql and not sql.lstrip().upper().startswith("EXPLAIN"):
            sent.append((sql, params))

    event.listen(engine, "before_cursor_execute", record)
    try:
        with engine.connect() as conn:
            look(conn)
    finally:
        event.remove(engine, "before_cursor_execute", record)
    return sent


def test_status_and_overview_read_no_history(
    filled: Engine, dialect: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each statement `cronoq-store status` and the dashboard's overview send to the task table,
    asked of the server as above: none scans it, none reads a share of the history. Live
    counts are exact; the history's counts stop at the cap and are the planner's estimate
    beyond it (SQLite keeps none: "more than")."""
    from cronoq_store import inspection
    from cronoq_store.web import views

    monkeypatch.setattr(operators, "COUNT_CAP", CAP)
    retention = timedelta(hours=1)
    data: dict[str, Any] = {}

    def looks(conn: Any) -> None:
        data["status"] = inspection.status(conn, schema=None, retention=retention)
        conn.rollback()
        data["overview"] = views.overview(conn, schema=None, retention=retention)

    sent = _statements_of(filled, looks)
    assert len(sent) >= 4, sent
    for i, (sql, params) in enumerate(sent):
        _assert_reads_little(filled, dialect, f"statement {i}: {sql}", sql, params)
    status = data["status"]
    assert status["tasks"] == [{"pool": "default", "status": "queued", "count": LIVE}]
    assert status["finished"]["last_hour"]["succeeded"] == RECENT
    for got in (status["finished"], status["prune_backlog"]):
        if dialect == "sqlite":
            assert (got["tasks"], got["accuracy"]) == (CAP, "more than"), got
        else:
            assert got["accuracy"] == "about", got
            assert HISTORY // 3 <= got["tasks"] <= HISTORY * 3, got
    assert data["overview"]["live_total"] == LIVE


@pytest.mark.parametrize("dialect", [pytest.param("sqlite", marks=pytest.mark.sqlite)])
def test_sqlite_work_does_not_grow_with_history(filled: Engine) -> None:
    """SQLite reports no rows read; the virtual machine's steps stand in. Five times the
    history leaves every statement's steps as they were (within noise), where a statement
    that reads the history takes about five times as many."""
    now = time.time_ns()

    def steps() -> dict[str, int]:
        return {c.name: _sqlite_steps(filled, *_compiled(filled, c)) for c in _cases(now)}

    before = steps()
    history.fill(filled, HISTORY + 1, 5 * HISTORY + 1, now - 3 * 3600 * 10**9)
    after = steps()
    grown = {n: (before[n], after[n]) for n in before if after[n] > 1.5 * before[n] + 2}
    assert not grown, f"steps (thousands) before and after 5x the history: {grown}"


def test_recovery_returns_the_old_tasks_live_ones_need(filled: Engine, dialect: str) -> None:
    """What recovery returns of the finished tasks: the recent ones, and the old ones a live
    task depends on (by id, by key), each once; none of the rest of the history. Each
    statement it sends to the task table, asked of the server as above, reads little: with
    more old tasks than live ones, the targets are looked up, the history is not read."""
    now = time.time_ns()
    data: dict[str, Any] = {}

    def look(conn: Any) -> None:
        observed = conn.execution_options(**{execution.OBSERVED: True})  # run_in's too
        base = TimeBase(unix_ns=now)
        data["got"] = recovery.recover(
            observed, base, now_unix_ns=now, retention=timedelta(hours=1)
        )

    sent = _statements_of(filled, look)
    got, quarantined = data["got"]
    recent = {LIVE_IDS + LIVE + i for i in range(RECENT)}
    by_key = {_by_key(i) for i in range(LIVE)}
    assert quarantined == 0
    assert sorted(t.id for t in got.terminal) == sorted(_NEEDED_IDS | by_key | recent)
    assert len(got.tasks) == LIVE
    whole = Case("old_finished", recovery.old_finished_stmt(), {"cutoff": 0, "limit": 1})
    assert _compiled(filled, whole)[0] not in [sql for sql, _ in sent], "the history was read"
    for i, (sql, params) in enumerate(sent):
        _assert_reads_little(filled, dialect, f"statement {i}: {sql}", sql, params)


@pytest.mark.parametrize("dialect", [pytest.param("postgresql", marks=pytest.mark.postgresql)])
def test_new_tasks_in_arrays_probe_the_history_by_id(filled: Engine) -> None:
    """PostgreSQL's array INSERT of a commit's new tasks (`arrays.insert_arrays_stmt`) skips
    those stored by a probe of the primary key per row (NOT EXISTS), not by a scan of the
    history: 1000 rows, the first 100 replayed old ids, with dependency rows."""
    spec = TaskSpec(payload=b"p", deps=(Dep(target=ById(id=TaskId(1))),))
    new = [*range(1, 101), *range(2 * LIVE_IDS, 2 * LIVE_IDS + 900)]
    folded = folding.fold(
        TimeBase(unix_ns=time.time_ns()),
        time.time_ns(),
        [Submitted(id=TaskId(i), seq=i, arrival=0, spec=spec) for i in new],
    )
    sent: list[tuple[Executable, dict[str, Any]]] = []

    class Flight:
        def add(self, stmt: Executable, params: dict[str, Any]) -> None:
            sent.append((stmt, params))

    deps = [d for i in folded.inserts for d in folded.deps[i]]
    arrays.insert_chunks(list(folded.inserts.values()), deps, Flight())  # type: ignore[arg-type]
    ((stmt, params),) = sent
    sql, values = _compiled(filled, Case("insert_arrays", stmt, params))
    with filled.connect() as conn:
        doc = conn.exec_driver_sql(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", values).scalar()
        inserted = conn.execute(select(func.count()).select_from(tasks)).scalar()
        conn.rollback()
    plan = (doc if isinstance(doc, list) else json.loads(doc))[0]["Plan"]
    text = json.dumps(plan, indent=1)
    assert "Seq Scan" not in [t for t, rel in _pg_node_types(plan) if rel == tasks.name], text
    assert _pg_rows_read(plan) <= BUDGET, text
    assert inserted == HISTORY + LIVE + RECENT + 900
