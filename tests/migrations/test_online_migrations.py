"""The migrations run online (cronoq_store.ddl): beside a leader that goes on committing.

PostgreSQL: a step that needs a table lock waits for it at most `ddl.LOCK_TIMEOUT_MS` and
retries, so a transaction holding the table does not make the migration queue an ACCESS
EXCLUSIVE request that every later commit waits behind; 0005's index is built and the old one
dropped CONCURRENTLY, outside any transaction. Every dialect: a backfill commits batch by
batch, and a populated database at 0004 reaches a head identical to `schema.py`. Offline
(`--sql`), the helpers emit plain statements and read nothing. The drill with a real leader
and 1.5 M tasks is benchmarks/drill_online_migration.py (timings there, not here).
"""

from __future__ import annotations

import importlib.util
import io
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from alembic.operations import Operations
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from builders import wait_until
from figures import figures
from sqlalchemy import URL, Engine, create_engine, event, text
from test_migration_crash import schema_drift

from cronoq_store import ddl, migrate

REPO = Path(__file__).resolve().parents[2]
BEFORE = "0004_commit_seq"
FINISHED = 7
LIVE = 3


def _populate(engine: Engine) -> None:
    """The schema at 0004, `FINISHED` finished tasks and `LIVE` live ones (plain SQL)."""
    migrate.upgrade(engine, BEFORE)
    rows = [
        {
            "id": i,
            "seq": i,
            "pool": "p",
            "kind": "k",
            "payload": b"x",
            "status": "succeeded" if i < FINISHED else "running",
            "terminal": i < FINISHED,
            "updated": 1000 + i,
        }
        for i in range(FINISHED + LIVE)
    ]
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO cronoq_tasks (id, seq, arrival_unix_ns, pool, kind, priority, "
                "payload, deps, resources, tags, labels, status, terminal, attempt, "
                "updated_unix_ns) VALUES (:id, :seq, 0, :pool, :kind, 0, :payload, '[]', "
                "'{}', '[]', '{}', :status, :terminal, 1, :updated)"
            ),
            rows,
        )


def _assert_at_head(engine: Engine) -> None:
    assert migrate.current_revision(engine) == migrate.head_revision()
    with engine.connect() as conn:
        assert schema_drift(conn) == []
        finished = dict(conn.execute(text("SELECT id, finished_unix_ns FROM cronoq_tasks")).all())
    assert finished == {i: (1000 + i if i < FINISHED else None) for i in range(FINISHED + LIVE)}


def _statements(engine: Engine, dialect: str) -> list[tuple[str, bool]]:
    """Every statement `engine` runs from now on: its text, and whether the DB-API connection
    then committed each statement on its own (SQLite: False)."""
    seen: list[tuple[str, bool]] = []

    def before(conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        driver = conn.connection.driver_connection
        seen.append((" ".join(statement.split()), _outside_transaction(dialect, driver)))

    event.listen(engine, "before_cursor_execute", before)
    return seen


def _outside_transaction(dialect: str, driver: Any) -> bool:
    """Whether the DB-API connection commits each statement on its own."""
    if dialect == "postgresql":
        return bool(driver.autocommit)
    if dialect == "mysql":
        return bool(driver.get_autocommit())
    return False


def test_backfill_commits_batch_by_batch(
    engine: Engine, dialect: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _populate(engine)
    monkeypatch.setattr(ddl, "BATCH_ROWS", 2)
    seen = _statements(engine, dialect)
    migrate.upgrade(engine)
    updates = [
        i for i, (sql, _) in enumerate(seen) if sql.startswith("UPDATE cronoq_tasks SET finished")
    ]
    assert len(updates) == -(-FINISHED // 2), [seen[i][0] for i in updates]
    for i in updates:
        if dialect == "sqlite":
            # Each batch is its own short write transaction.
            assert seen[i - 1][0] == "BEGIN IMMEDIATE" and seen[i + 1][0] == "COMMIT"
        else:
            assert seen[i][1], seen[i][0]
    _assert_at_head(engine)


@pytest.mark.parametrize("dialect", ["postgresql"], indirect=True)
def test_indexes_are_built_and_dropped_concurrently(engine: Engine) -> None:
    _populate(engine)
    seen = _statements(engine, "postgresql")
    migrate.upgrade(engine)
    ddl_of_0005 = {
        sql: outside
        for sql, outside in seen
        if "ix_cronoq_tasks_finished_unix_ns" in sql
        or "ix_cronoq_tasks_terminal_updated_unix_ns" in sql
    }
    assert set(ddl_of_0005) == {
        "CREATE INDEX CONCURRENTLY ix_cronoq_tasks_finished_unix_ns ON cronoq_tasks "
        "(finished_unix_ns)",
        "DROP INDEX CONCURRENTLY IF EXISTS ix_cronoq_tasks_terminal_updated_unix_ns",
    }
    for sql, outside in ddl_of_0005.items():
        assert outside, f"{sql} ran inside a transaction"
    _assert_at_head(engine)


def _waiting_for_lock(admin: Engine, pid: int) -> bool:
    with admin.connect() as conn:
        return bool(
            conn.execute(
                text("SELECT count(*) FROM pg_locks WHERE pid = :pid AND NOT granted"),
                {"pid": pid},
            ).scalar_one()
        )


@pytest.mark.parametrize("dialect", ["postgresql"], indirect=True)
def test_a_held_table_makes_the_migration_wait_not_the_leader(db_url: URL, engine: Engine) -> None:
    """A transaction holding cronoq_tasks (a long report, an old leader's stalled commit):
    the migration's ALTER gives way after its lock_timeout rather than queue in front of
    every later write, so another session's commits go on; the migration completes once the
    holder ends."""
    _populate(engine)
    admin = create_engine(db_url, isolation_level="AUTOCOMMIT")
    holder = engine.connect()
    migrating = create_engine(db_url)
    pids: list[int] = []
    event.listen(
        migrating,
        "connect",
        lambda dbapi, _record: pids.append(int(dbapi.info.backend_pid)),
    )
    failure: list[BaseException] = []

    def run() -> None:
        try:
            migrate.upgrade(migrating)
        except BaseException as exc:  # reported by the test
            failure.append(exc)

    thread = threading.Thread(target=run)
    try:
        holder.execute(text("UPDATE cronoq_tasks SET attempt = attempt WHERE id = 0"))
        thread.start()
        wait_until(
            lambda: bool(pids) and _waiting_for_lock(admin, pids[0]),
            "the migration waiting for its lock",
            timeout=30,
        )
        # While the holder keeps the table, each of these writes would queue behind a
        # waiting ACCESS EXCLUSIVE request until the holder ended; here each waits at most
        # the migration's lock_timeout (200 ms) before it gives way.
        held_for = time.monotonic()
        worst = 0.0
        for i in range(10):
            with engine.begin() as conn:
                began = time.monotonic()
                conn.execute(text("SET LOCAL lock_timeout = '10s'"))
                conn.execute(
                    text("UPDATE cronoq_tasks SET attempt = attempt + 1 WHERE id = :id"),
                    {"id": FINISHED + i % LIVE},
                )
            worst = max(worst, time.monotonic() - began)
            time.sleep(0.1)
        assert thread.is_alive(), "the migration did not wait for the held table"
        assert worst < 5.0, f"a write waited {worst:.1f} s behind the migration"
        assert time.monotonic() - held_for > 1.0
    finally:
        holder.rollback()
        holder.close()
        thread.join(timeout=120)
        migrating.dispose()
        admin.dispose()
    assert not thread.is_alive() and not failure, failure
    _assert_at_head(engine)


def _offline_script(dialect: str, since: str | None) -> str:
    """The SQL the revisions after `since` (None: all) emit offline (Alembic's `--sql`),
    run here without env.py: the helpers must read nothing and retry nothing."""
    script = ScriptDirectory.from_config(migrate.alembic_config())
    out = io.StringIO()
    context = MigrationContext.configure(
        dialect_name=dialect,
        opts={"as_sql": True, "output_buffer": out, "literal_binds": True},
    )
    revisions = list(reversed(list(script.walk_revisions("base", "heads"))))
    if since is not None:
        revisions = revisions[[r.revision for r in revisions].index(since) + 1 :]
    with Operations.context(context):
        for revision in revisions:
            revision.module.upgrade()
    return " ".join(out.getvalue().split())


@pytest.mark.sqlite  # needs no server: once per run
@pytest.mark.parametrize("dialect", ["postgresql", "mysql", "sqlite"])
def test_offline_the_helpers_emit_plain_statements(dialect: str) -> None:
    whole = _offline_script(dialect, None)
    assert "CREATE TABLE cronoq_tasks" in whole
    since = _offline_script(dialect, BEFORE)
    # The backfill is one UPDATE; nothing is read or retried.
    assert since.count("UPDATE cronoq_tasks SET finished_unix_ns") == 1
    assert "SELECT" not in since
    if dialect == "postgresql":
        assert "COMMIT; CREATE INDEX CONCURRENTLY ix_cronoq_tasks_finished_unix_ns" in since, since
        assert "DROP INDEX CONCURRENTLY IF EXISTS ix_cronoq_tasks_terminal_updated" in since
        assert "ALTER TABLE cronoq_tasks SET (fillfactor = 50" in since
    elif dialect == "mysql":
        assert "ADD INDEX ix_cronoq_tasks_finished_unix_ns (finished_unix_ns), ALGORITHM=" in since
        assert "ADD COLUMN finished_unix_ns BIGINT, ALGORITHM=INSTANT, LOCK=NONE" in since


OLD_BUILD = "128166a"
"""The build just before revision 0005 (head 0004): the issue's old leader."""
DRILL_ROWS = {"postgresql": 1_500_000, "sqlite": 500_000, "mysql": 500_000}
WORST_COMMIT_S = {"postgresql": 1.0, "sqlite": 2.0, "mysql": 1.0}


@pytest.mark.soak
@pytest.mark.parametrize("dialect", DRILL_ROWS)
def test_drill_an_old_leader_commits_through_the_upgrade(dialect: str, tmp_path: Path) -> None:
    """benchmarks/drill_online_migration.py as a test: the old build's leader, on a database
    with the issue's history, keeps committing through this build's upgrade; worst commit
    within the issue's bound (1 s, SQLite 2 s), no error, lease kept. Needs the servers and
    git history (the old build is extracted with `git archive`)."""
    old = tmp_path / "old"
    old.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", OLD_BUILD], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
    spec = importlib.util.spec_from_file_location(
        "drill", REPO / "benchmarks" / "drill_online_migration.py"
    )
    assert spec is not None and spec.loader is not None
    drill = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(drill)
    rows = DRILL_ROWS[dialect]
    try:
        url = drill.prepare(dialect, rows, old, tmp_path)
        result = drill.drill(dialect, url, rows, old, REPO, tmp_path)
    finally:
        drill.cleanup(dialect, rows, drop_template=True)
    figures("online migration drill")[dialect] = result
    leader = result["leader"]
    assert result["upgrade_ok"], result
    assert leader["error_count"] == 0 and leader["lease_kept"], result
    assert leader["worst_s"] <= WORST_COMMIT_S[dialect], result
