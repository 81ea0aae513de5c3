"""A migration killed after any of its statements is completed by the next one, on every dialect.

MySQL and MariaDB commit each DDL statement at once, so a first migration that dies after
`CREATE TABLE cronoq_tasks` leaves that table behind with no version row; the next
`SqlStore.open` or `cronoq-store upgrade` must complete it rather than fail for good. The
in-process test stops the migration after each write statement in turn (an exception no
handler catches, and its connection dropped as a dying process's would be); one test kills a
real process with SIGKILL. The migrations run online, each step committing on its own, so on
every dialect a kill leaves part of a revision behind; on PostgreSQL one test kills a
`CREATE INDEX CONCURRENTLY` mid-build, whose INVALID index the next run rebuilds.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from builders import wait_until
from sqlalchemy import URL, Connection, Engine, MetaData, create_engine, event, func, select, text

from cronoq_store import SqlStore, StoreConfig, StoreUnavailable, ddl, migrate
from cronoq_store.schema import leader, metadata

REPO = Path(__file__).resolve().parents[2]
WRITES = ("CREATE", "ALTER", "INSERT", "UPDATE", "DROP", "RENAME")


class Killed(BaseException):
    """Stands for the process dying: nothing in the store catches it."""


def schema_drift(conn: Connection) -> list[Any]:
    """What differs between the database's cronoq tables and the package's schema (alembic's
    autogenerate comparison, types included): empty when a migration left nothing off."""
    context = MigrationContext.configure(
        conn,
        opts={
            "include_name": migrate.cronoq_tables_only,
            "compare_type": True,
            "version_table": migrate.VERSION_TABLE,
        },
    )
    diff: list[Any] = compare_metadata(context, metadata)
    return diff


def _is_write(statement: str) -> bool:
    words = statement.split(None, 1)
    return bool(words) and words[0].upper() in WRITES


def _writes_of_a_migration(db_url: URL) -> list[str]:
    """The write statements a full migration of an empty database runs, in order."""
    engine = create_engine(db_url)
    seen: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if _is_write(statement):
            seen.append(" ".join(statement.split())[:70])

    event.listen(engine, "after_cursor_execute", record)
    try:
        migrate.upgrade(engine)
    finally:
        engine.dispose()
    return seen


@contextmanager
def _killed_after(engine: Engine, k: int) -> Iterator[None]:
    """Raise `Killed` right after the `k`-th write statement (counting from 0) has run."""
    count = 0

    def after(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        nonlocal count
        if _is_write(statement):
            if count == k:
                raise Killed(statement)
            count += 1

    event.listen(engine, "after_cursor_execute", after)
    try:
        yield
    finally:
        event.remove(engine, "after_cursor_execute", after)


def _reset(engine: Engine) -> None:
    """Drop every table, for the next round."""
    tables = MetaData()
    tables.reflect(engine)
    tables.drop_all(engine)


def assert_schema_complete(engine: Engine) -> None:
    """At head, the leader row as the first migration leaves it, and no drift from metadata."""
    assert migrate.current_revision(engine) == migrate.head_revision()
    with engine.connect() as conn:
        rows = conn.execute(select(leader)).mappings().all()
        assert [dict(r) for r in rows] == [
            {
                "id": 1,
                "epoch": 0,
                "holder": None,
                "expires_unix_ns": 0,
                "next_id": 0,
                "commit_seq": 0,
                "lost_epoch": None,
                "lost_commits": None,
                "lost_unix_ns": None,
            }
        ]
        assert schema_drift(conn) == []


def test_killed_after_any_statement_the_next_open_completes(db_url: URL) -> None:
    writes = _writes_of_a_migration(db_url)
    assert any("CREATE TABLE cronoq_tasks" in w for w in writes), writes
    plain = create_engine(db_url)
    try:
        _reset(plain)
        for k, statement in enumerate(writes):
            victim = create_engine(db_url)
            killed = False
            try:
                with _killed_after(victim, k):
                    migrate.upgrade(victim)
            except Killed:
                killed = True
            finally:
                # A dead process's connections close and the server rolls them back; here the
                # dropped traceback's reference cycles must go too (SQLite: an open cursor).
                gc.collect()
                victim.dispose()
            assert killed, f"the migration did not reach {statement!r}"
            with SqlStore.open(db_url, StoreConfig()) as store:  # migrates under the lock
                epoch = store.acquire_leadership()
                assert epoch == 1, f"after a kill following {statement!r}"
                store.release_leadership()
            with plain.begin() as conn:  # undo the lease for the schema check
                conn.execute(leader.update().values(epoch=0))
            assert_schema_complete(plain)
            _reset(plain)
    finally:
        plain.dispose()


KILL_SCRIPT = """
import os, signal, sys
from sqlalchemy import create_engine, event
from cronoq_store import migrate

engine = create_engine(sys.argv[1])

@event.listens_for(engine, "after_cursor_execute")
def _die(conn, cursor, statement, *args):
    if statement.lstrip().upper().startswith("CREATE TABLE CRONOQ_TASKS"):
        os.kill(os.getpid(), signal.SIGKILL)

migrate.upgrade(engine)
"""


def test_sigkill_after_create_table_then_cli_upgrade_completes(db_url: URL, tmp_path: Path) -> None:
    url = db_url.render_as_string(hide_password=False)
    killed = subprocess.run(
        [sys.executable, "-c", KILL_SCRIPT, url], cwd=REPO, capture_output=True, timeout=120
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    cli = Path(sys.executable).parent / "cronoq-store"
    done = subprocess.run(
        [str(cli), "--url", url, "upgrade"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_COLOR": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    engine = create_engine(db_url)
    try:
        assert_schema_complete(engine)
        with engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(leader)).scalar_one() == 1
            assert conn.execute(text("SELECT COUNT(*) FROM cronoq_tasks")).scalar_one() == 0
    finally:
        engine.dispose()


def _session_id(dbapi_connection: Any, dialect: str) -> int:
    if dialect == "postgresql":
        return int(dbapi_connection.info.backend_pid)
    return int(dbapi_connection.thread_id())


@pytest.mark.parametrize("dialect", ["postgresql", "mysql"], indirect=True)
def test_connection_killed_mid_migration_is_unavailable(db_url: URL, dialect: str) -> None:
    """The server ends the migrating session (an admin's KILL, a failover) after the first
    table is created: the caller gets StoreUnavailable (worth retrying), and a retry completes
    the migration."""
    victim = create_engine(db_url)
    admin = create_engine(db_url, isolation_level="AUTOCOMMIT")
    kill = "SELECT pg_terminate_backend(:id)" if dialect == "postgresql" else "KILL :id"

    def after(conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if statement.lstrip().upper().startswith("CREATE TABLE CRONOQ_TASKS"):
            session = _session_id(conn.connection.driver_connection, dialect)
            with admin.connect() as other:
                other.execute(text(kill), {"id": session})

    event.listen(victim, "after_cursor_execute", after)
    try:
        with pytest.raises(StoreUnavailable):
            migrate.upgrade(victim)
    finally:
        victim.dispose()
        admin.dispose()
    engine = create_engine(db_url)
    try:
        migrate.upgrade(engine)
        assert_schema_complete(engine)
    finally:
        engine.dispose()


def _index_valid(engine: Engine, name: str) -> bool | None:
    """pg_index.indisvalid of the index `name`; None when there is none."""
    with engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
                "WHERE c.relname = :name"
            ),
            {"name": name},
        ).first()
    return None if row is None else bool(row[0])


@pytest.mark.parametrize("dialect", ["postgresql"], indirect=True)
def test_invalid_index_of_a_killed_concurrent_build_is_rebuilt(db_url: URL, engine: Engine) -> None:
    """A `CREATE INDEX CONCURRENTLY` killed while it waits (here for a writer's open
    transaction) leaves its index behind, INVALID: never used, yet kept up by every write.
    The next run finds it so, drops it concurrently and builds it again."""
    index = "ix_cronoq_tasks_finished_unix_ns"
    migrate.upgrade(engine, "0004_commit_seq")
    admin = create_engine(db_url, isolation_level="AUTOCOMMIT")
    writer = engine.connect()
    victim = create_engine(db_url)
    pids: list[int] = []

    def before(conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if statement.startswith(f"CREATE INDEX CONCURRENTLY {index}"):
            pids.append(_session_id(conn.connection.driver_connection, "postgresql"))
            writer.execute(text("LOCK TABLE cronoq_tasks IN ROW EXCLUSIVE MODE"))

    event.listen(victim, "before_cursor_execute", before)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            migrate.upgrade(victim)
        except BaseException as exc:  # the kill, reported below
            failure.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        wait_until(
            lambda: bool(pids) and _index_valid(admin, index) is False, "an INVALID index", 30
        )
        with admin.connect() as conn:
            conn.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pids[0]})
        thread.join(timeout=60)
    finally:
        writer.rollback()
        writer.close()
        victim.dispose()
    assert isinstance(failure[0], StoreUnavailable), failure
    assert _index_valid(admin, index) is False  # what the killed build left
    assert migrate.current_revision(engine) == "0004_commit_seq"
    try:
        with SqlStore.open(db_url, StoreConfig()) as store:  # migrates under the lock
            store.acquire_leadership()
            store.release_leadership()
        assert _index_valid(admin, index) is True
        with engine.begin() as conn:  # undo the lease for the schema check
            conn.execute(leader.update().values(epoch=0))
        assert_schema_complete(engine)
    finally:
        admin.dispose()


FINISHED = 5


def _populated_at_0004(engine: Engine) -> None:
    _reset(engine)
    with engine.begin() as conn:
        conn.execute(text(f"DROP TABLE IF EXISTS {migrate.VERSION_TABLE}"))
    migrate.upgrade(engine, "0004_commit_seq")
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO cronoq_tasks (id, seq, arrival_unix_ns, pool, kind, priority, "
                "payload, deps, resources, tags, labels, status, terminal, attempt, "
                "updated_unix_ns) VALUES (:id, :id, 0, 'p', 'k', 0, :payload, '[]', '{}', "
                "'[]', '{}', 'succeeded', :terminal, 1, :updated)"
            ),
            [
                {"id": i, "payload": b"x", "terminal": i < FINISHED, "updated": 100 + i}
                for i in range(FINISHED + 1)
            ],
        )


def test_killed_at_any_statement_of_an_online_revision_the_next_run_completes(
    db_url: URL, monkeypatch: pytest.MonkeyPatch
) -> None:
    """0005 on a database with history: its column, each backfill batch (2 rows here), its
    concurrent index build and drop, its storage parameters each commit on their own; killed
    after any of them, the next run completes the revision, every finished task backfilled."""
    monkeypatch.setattr(ddl, "BATCH_ROWS", 2)
    plain = create_engine(db_url)
    seen: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if _is_write(statement):
            seen.append(" ".join(statement.split())[:70])

    try:
        _populated_at_0004(plain)
        event.listen(plain, "after_cursor_execute", record)
        migrate.upgrade(plain)
        event.remove(plain, "after_cursor_execute", record)
        assert sum("SET finished_unix_ns" in w for w in seen) == 3, seen
        for k, statement in enumerate(seen):
            _populated_at_0004(plain)
            victim = create_engine(db_url)
            try:
                with _killed_after(victim, k), pytest.raises(Killed):
                    migrate.upgrade(victim)
            finally:
                gc.collect()
                victim.dispose()
            migrate.upgrade(plain)
            assert migrate.current_revision(plain) == migrate.head_revision(), statement
            with plain.connect() as conn:
                done = dict(
                    conn.execute(text("SELECT id, finished_unix_ns FROM cronoq_tasks")).all()
                )
                assert schema_drift(conn) == [], statement
            want = {i: (100 + i if i < FINISHED else None) for i in range(FINISHED + 1)}
            assert done == want, f"after a kill following {statement!r}"
    finally:
        plain.dispose()
