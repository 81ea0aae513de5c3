"""Two builds side by side (issue 37, item 3): the rule of which build may write a schema
(`cronoq_store.builds`), and rows the previous release writes on the current schema read right.

Release 0.1.0 (head 0004) finishes a task without `finished_unix_ns`, which 0005 added: the
rows it writes after an upgrade are written here as it writes them (the rolling-deploy test in
tests/migrations/test_rolling_deploy.py runs that release itself)."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
from builders import BASE, status, submit
from click.testing import CliRunner
from sqlalchemy import URL, Engine, create_engine, select, update

import cronoq_store as cq
from cronoq_store import builds, migrate
from cronoq_store.cli import main
from cronoq_store.schema import leader, tasks, writers


def _as_release_0_1_0_finished(engine: Engine, *ids: int) -> None:
    """What 0.1.0's terminal transition leaves on the 0005 schema: no finish time."""
    with engine.begin() as conn:
        conn.execute(update(tasks).where(tasks.c.id.in_(ids)).values(finished_unix_ns=None))


def _finished_two(store: cq.SqlStore) -> int:
    epoch = store.acquire_leadership()
    store.commit(epoch, BASE, [submit(1), submit(2), submit(3)])
    store.commit(epoch, BASE, [status(1, cq.TaskStatus.SUCCEEDED), status(2, cq.TaskStatus.FAILED)])
    _as_release_0_1_0_finished(store.engine, 1, 2)
    return epoch


def test_old_release_rows_are_pruned(store: cq.SqlStore) -> None:
    _finished_two(store)
    assert store.prune(timedelta(0)) == 2
    assert store.get_task(cq.ById(id=cq.TaskId(1))) is None
    assert store.get_task(cq.ById(id=cq.TaskId(3))) is not None


@pytest.fixture
def store_config() -> cq.StoreConfig:
    # The test kit's times are in 2023: a retention that still holds them.
    return cq.StoreConfig(retention=timedelta(days=3650))


def test_old_release_rows_are_recovered_and_queried(store: cq.SqlStore) -> None:
    _finished_two(store)
    store.release_leadership()
    store.acquire_leadership()
    recovered = store.recover(BASE)
    assert sorted(t.id for t in recovered.terminal) == [1, 2]
    assert [t.id for t in recovered.tasks] == [3]
    assert [t.id for t in store.list_finished()] == [1, 2]


def _raise_floor(engine: Engine, version: str) -> None:
    """What a later release's migration does: raise the oldest build that may write."""
    with engine.begin() as conn:
        conn.execute(update(writers).values(oldest_writer=builds.encode(version)))


def test_versions_encode_in_order() -> None:
    assert builds.encode("0.2.0") == 2000
    assert builds.decode(builds.encode("12.345.678")) == "12.345.678"
    assert builds.encode("0.10.0") > builds.encode("0.9.9")
    with pytest.raises(ValueError, match="parts below 1000"):
        builds.encode("1.1000.0")


def test_the_version_is_the_packages() -> None:
    import tomllib
    from importlib.metadata import version

    from cronoq_store import __version__

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert __version__ == project["project"]["version"] == builds.VERSION
    assert version("cronoq-store") == __version__


def test_every_revision_declares_its_writer_and_class() -> None:
    lines = CliRunner().invoke(main, ["history"]).output.splitlines()
    assert len(lines) >= 6
    assert lines[0].startswith("0005_finished_index -> 0006_oldest_writer (head) [online")
    for line in lines:
        assert "[online, writers 0.1.0+]" in line or "[needs the old build stopped" in line


def test_floors_never_fall_along_the_history() -> None:
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(migrate.alembic_config())
    chain = [rev.revision for rev in script.walk_revisions()][::-1]  # base first
    floors = [builds.encode(builds.oldest_writer(rev)) for rev in chain]
    assert floors == sorted(floors)
    assert builds.head_floor() == floors[-1] <= builds.BUILD
    for rev in chain:
        assert builds.migration_class(rev) in builds.CLASSES


def test_a_migration_that_outdates_this_build_fences_its_next_commit(store: cq.SqlStore) -> None:
    epoch = store.acquire_leadership()
    store.commit(epoch, BASE, [submit(1)])
    _raise_floor(store.engine, "0.3.0")
    with pytest.raises(cq.BuildTooOld) as caught:
        store.commit(epoch, BASE, [submit(2)])
    assert isinstance(caught.value, cq.Fenced)
    assert "(0.2.0)" in str(caught.value) and "(0.3.0)" in str(caught.value)
    assert store.get_task(cq.ById(id=cq.TaskId(2))) is None
    assert store.get_task(cq.ById(id=cq.TaskId(1))) is not None


def test_an_outdated_build_never_takes_the_lease(db_url: URL) -> None:
    with cq.SqlStore.open(db_url) as first:
        _raise_floor(first.engine, "0.3.0")
    with cq.SqlStore.open(db_url, cq.StoreConfig(migrate=False)) as second:
        with pytest.raises(cq.BuildTooOld, match=r"\(0\.2\.0\).*\(0\.3\.0\)"):
            second.acquire_leadership(timeout=5)
        with second.engine.connect() as conn:
            assert conn.execute(select(leader.c.holder)).scalar() is None


def _ahead(engine: Engine) -> None:
    """The database as a newer release leaves it: a revision this build does not know."""
    from cronoq_store.migrate import VERSION_TABLE

    _raise_floor(engine, "0.3.0")
    with engine.begin() as conn:
        conn.exec_driver_sql(f"UPDATE {VERSION_TABLE} SET version_num = '0007_from_the_future'")


def test_a_database_ahead_of_the_build_is_refused_at_open(db_url: URL) -> None:
    with cq.SqlStore.open(db_url) as first:
        _ahead(first.engine)
    for config in (cq.StoreConfig(), cq.StoreConfig(migrate=False)):
        with pytest.raises(cq.SchemaError) as caught:
            cq.SqlStore.open(db_url, config)
        said = str(caught.value)
        assert "'0007_from_the_future'" in said and "may write it: 0.3.0" in said
        assert "(this build: 0.2.0," in said
        assert "cronoq-store history" in said
    with cq.SqlStore.open(db_url, cq.StoreConfig(migrate=False), check_schema=False) as store:
        assert migrate.current_revision(store.engine) == "0007_from_the_future"


def test_upgrade_of_a_database_ahead_is_one_error_through_the_cli(db_url: URL) -> None:
    with cq.SqlStore.open(db_url) as first:
        _ahead(first.engine)
    url = db_url.render_as_string(hide_password=False)
    result = CliRunner().invoke(main, ["--url", url, "upgrade"])
    assert result.exit_code == 1
    assert "0007_from_the_future" in result.output and "cronoq-store history" in result.output
    assert "Traceback" not in result.output
    with cq.SqlStore.open(db_url, cq.StoreConfig(migrate=False), check_schema=False) as store:
        assert migrate.current_revision(store.engine) == "0007_from_the_future"


def test_upgrade_to_an_unknown_revision_touches_nothing(db_url: URL) -> None:
    url = db_url.render_as_string(hide_password=False)
    result = CliRunner().invoke(main, ["--url", url, "upgrade", "0099_nope"])
    assert result.exit_code != 0
    assert "no schema revision '0099_nope'" in result.output
    assert "cronoq-store history" in result.output
    if db_url.get_backend_name() == "sqlite":
        assert not os.path.exists(db_url.database or "")
    else:
        with cq.SqlStore.open(db_url, cq.StoreConfig(migrate=False), check_schema=False) as store:
            assert migrate.current_revision(store.engine) is None
    with pytest.raises(cq.SchemaError, match="0099_nope"):
        migrate.upgrade(create_engine(db_url), "0099_nope")


def _check(url: str, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["--url", url, "check", *args])
    return result.exit_code, result.output


def test_check_finds_what_is_off_and_says_what_to_run(db_url: URL) -> None:
    import json

    from sqlalchemy import text

    url = db_url.render_as_string(hide_password=False)
    assert CliRunner().invoke(main, ["--url", url, "upgrade"]).exit_code == 0
    code, out = _check(url)
    assert (code, out) == (
        0,
        f"ok: revision {migrate.head_revision()}, as this build (0.2.0) expects\n",
    )
    engine = create_engine(db_url)
    pg = db_url.get_backend_name() == "postgresql"
    try:
        with engine.begin() as conn:
            if db_url.get_backend_name() == "mysql":
                conn.execute(text("DROP INDEX ix_cronoq_tasks_key_id ON cronoq_tasks"))
            else:
                conn.execute(text("DROP INDEX ix_cronoq_tasks_key_id"))
            if pg:
                conn.execute(text("ALTER TABLE cronoq_tasks RESET (fillfactor)"))
        code, out = _check(url, "--json")
        found = json.loads(out)
        assert code == 1 and not found["ok"]
        problems = [f["problem"] for f in found["findings"]]
        assert "index ix_cronoq_tasks_key_id on cronoq_tasks is missing" in problems
        fixes = [f["fix"] for f in found["findings"]]
        if pg:
            assert any("fillfactor = default (want 50)" in p for p in problems)
            assert "CREATE INDEX CONCURRENTLY ix_cronoq_tasks_key_id" in fixes[0]
        # status says it in one line
        status = CliRunner().invoke(main, ["--url", url, "status"]).output
        assert "check      index ix_cronoq_tasks_key_id on cronoq_tasks is missing" in status
        # What it says to run fixes it.
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            for fix in fixes:
                conn.execute(text(fix))
        assert _check(url)[0] == 0
        if pg:  # an index a failed concurrent build left INVALID (as a killed one does)
            with cq.SqlStore.open(db_url) as store:
                store.commit(store.acquire_leadership(), BASE, [submit(1), submit(2)])
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.execute(text("DROP INDEX ix_cronoq_tasks_key_id"))
                with pytest.raises(Exception, match="could not create unique index"):
                    conn.execute(
                        text(
                            "CREATE UNIQUE INDEX CONCURRENTLY ix_cronoq_tasks_key_id "
                            "ON cronoq_tasks ((1))"
                        )
                    )
            code, out = _check(url)
            assert code == 1
            assert "index ix_cronoq_tasks_key_id is INVALID" in out
            assert "fix: REINDEX INDEX CONCURRENTLY ix_cronoq_tasks_key_id;" in out
    finally:
        engine.dispose()
