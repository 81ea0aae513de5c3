"""Durability stated and checked: what the server does with an acknowledged commit, read at
`open` (one WARNING, or `NotDurable` with `require_durable`) and live by `status`.

The reading runs on the real servers: their defaults (safe), PostgreSQL with
`synchronous_commit = off` for the test's database (`ALTER DATABASE`, which touches no other),
SQLite with `full_sync` off. What the shared MariaDB cannot be set to without `SET GLOBAL`
(`innodb_flush_log_at_trx_commit = 2`, a Galera node) is covered by the classification, a pure
function, on every combination hypothesis draws.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner
from faces import FACES, open_face
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import URL, create_engine, inspect, make_url, text
from sqlalchemy.exc import OperationalError

from cronoq_store import NotDurable, SqlStore, StoreConfig, StoreError, StoreUnavailable
from cronoq_store.cli import main
from cronoq_store.durability import classify
from cronoq_store.face import judge_durability

WARNING = "can lose acknowledged commits on a crash"

on_off = st.sampled_from(["on", "off", "ON", "OFF", None])


@given(
    fsync=on_off, commit=st.sampled_from(["on", "off", "local", "remote_write", None]), fpw=on_off
)
def test_postgresql_classification(fsync: str | None, commit: str | None, fpw: str | None) -> None:
    found = classify(
        "postgresql", {"fsync": fsync, "synchronous_commit": commit, "full_page_writes": fpw}
    )
    off = {
        name
        for name, value in (
            ("fsync", fsync),
            ("synchronous_commit", commit),
            ("full_page_writes", fpw),
        )
        if value is not None and value.lower() == "off"
    }
    assert {u.setting for u in found.unsafe} == off
    assert found.safe == (not off)
    assert found.as_dict()["safe"] is found.safe


@given(
    flush=st.sampled_from(["0", "1", "2", None]),
    doublewrite=st.sampled_from(["ON", "OFF", "fast", None]),
    log_bin=on_off,
    sync_binlog=st.sampled_from(["0", "1", "100", None]),
    wsrep=on_off,
)
def test_mysql_classification(
    flush: str | None,
    doublewrite: str | None,
    log_bin: str | None,
    sync_binlog: str | None,
    wsrep: str | None,
) -> None:
    settings = {
        "innodb_flush_log_at_trx_commit": flush,
        "innodb_doublewrite": doublewrite,
        "log_bin": log_bin,
        "sync_binlog": sync_binlog,
        "wsrep_on": wsrep,
    }
    found = classify("mysql", settings)
    expected = set()
    if flush in ("0", "2"):
        expected.add("innodb_flush_log_at_trx_commit")
    if doublewrite == "OFF":
        expected.add("innodb_doublewrite")
    if log_bin is not None and log_bin.lower() == "on" and sync_binlog in ("0", "100"):
        expected.add("sync_binlog")
    if wsrep is not None and wsrep.lower() == "on":
        expected.add("wsrep_on")  # a Galera node is never called safe: Jepsen, 2026
    assert {u.setting for u in found.unsafe} == expected
    assert found.safe == (not expected)
    if "wsrep_on" in expected:
        assert "Jepsen" in found.summary()


@given(
    journal=st.sampled_from(["wal", "delete", "truncate", "persist", "memory", "off", None]),
    sync=st.sampled_from(["off", "normal", "full", "extra", "0", "1", "2", "3", None]),
)
def test_sqlite_classification(journal: str | None, sync: str | None) -> None:
    found = classify("sqlite", {"journal_mode": journal, "synchronous": sync})
    expected = set()
    if journal in ("memory", "off"):
        expected.add("journal_mode")
    if sync in ("off", "normal", "0", "1"):
        expected.add("synchronous")
    assert {u.setting for u in found.unsafe} == expected


def status_json(url: URL) -> dict[str, object]:
    argv = ["--url", url.render_as_string(hide_password=False), "status", "--json"]
    result = CliRunner().invoke(main, argv, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data: dict[str, object] = json.loads(result.stdout)
    return data


def test_defaults_are_safe(db_url: URL, dialect: str, caplog: pytest.LogCaptureFixture) -> None:
    """The shared servers run with their safe defaults: nothing is said, status says safe."""
    caplog.set_level(logging.WARNING, logger="cronoq_store")
    with SqlStore.open(db_url, StoreConfig(require_durable=True)) as store:
        assert store.durability is not None and store.durability.safe, store.durability
        settings = store.durability.settings
    assert WARNING not in caplog.text
    expected = {
        "postgresql": {"fsync": "on", "synchronous_commit": "on", "full_page_writes": "on"},
        "mysql": {"innodb_flush_log_at_trx_commit": "1"},
        "sqlite": {"journal_mode": "wal", "synchronous": "full"},
    }[dialect]
    assert expected.items() <= dict(settings).items()
    view = status_json(db_url)["durability"]
    assert isinstance(view, dict) and view["safe"] is True and view["unsafe"] == []


@pytest.mark.sqlite
def test_sqlite_without_full_sync(tmp_path: object, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="cronoq_store")
    path = f"{tmp_path}/cronoq.db"
    with SqlStore.open(path, StoreConfig(full_sync=False)) as store:
        assert store.durability is not None and not store.durability.safe
    warned = [r for r in caplog.records if WARNING in r.getMessage()]
    assert len(warned) == 1 and "synchronous=normal" in warned[0].getMessage()
    with pytest.raises(NotDurable, match=r"synchronous=normal.*require_durable") as caught:
        SqlStore.open(path, StoreConfig(full_sync=False, require_durable=True))
    assert [u.setting for u in caught.value.durability.unsafe] == ["synchronous"]


@pytest.fixture
def lossy_postgresql(dialect: str, db_url: URL) -> URL:
    """The test's own PostgreSQL database with `synchronous_commit = off` for every session
    (set on that database alone; the server's other databases keep theirs)."""
    if dialect != "postgresql":
        pytest.skip("a per-database synchronous_commit is PostgreSQL's")
    admin = create_engine(db_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{db_url.database}" SET synchronous_commit = off'))
    finally:
        admin.dispose()
    return db_url


@pytest.mark.postgresql
@pytest.mark.parametrize("dialect", ["postgresql"], indirect=True)
@pytest.mark.parametrize("face", FACES)
def test_postgresql_synchronous_commit_off(
    face: str, lossy_postgresql: URL, caplog: pytest.LogCaptureFixture
) -> None:
    url = lossy_postgresql
    caplog.set_level(logging.WARNING, logger="cronoq_store")
    cleanup: list[Callable[[], None]] = []
    try:
        with pytest.raises(NotDurable, match=r"synchronous_commit=off") as caught:
            open_face(face, url, StoreConfig(require_durable=True), cleanup)
        assert not caught.value.durability.safe
        # Refused before migrating: nothing was written.
        engine = create_engine(url)
        try:
            assert "cronoq_tasks" not in inspect(engine).get_table_names()
        finally:
            engine.dispose()
        assert WARNING not in caplog.text  # refused, not warned
        store = open_face(face, url, StoreConfig(), cleanup)
        warned = [r for r in caplog.records if WARNING in r.getMessage()]
        assert len(warned) == 1 and "synchronous_commit=off" in warned[0].getMessage()
        assert store.durability is not None
        assert [u.setting for u in store.durability.unsafe] == ["synchronous_commit"]
    finally:
        for close in reversed(cleanup):
            close()
    view = status_json(url)["durability"]
    assert isinstance(view, dict) and view["safe"] is False
    assert [(u["setting"], u["value"]) for u in view["unsafe"]] == [("synchronous_commit", "off")]
    argv = ["--url", url.render_as_string(hide_password=False), "status"]
    text_out = CliRunner().invoke(main, argv, catch_exceptions=False).stdout
    assert "NOT SAFE" in text_out and "synchronous_commit=off" in text_out


LOSSY_MARIADB_PORT = 3361
"""This suite's own MariaDB (ports 3361-3362 are its to use)."""


@pytest.fixture(scope="module")
def lossy_mariadb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[URL]:
    """A MariaDB of the test's own with `innodb_flush_log_at_trx_commit = 2` (which the shared
    server must keep at 1): a datadir under /var/tmp, run as the mysql user, removed after.
    About 5 s to install and start here."""
    mariadbd, install = shutil.which("mariadbd"), shutil.which("mariadb-install-db")
    if mariadbd is None or install is None or shutil.which("runuser") is None or os.getuid():
        pytest.skip("needs mariadbd, mariadb-install-db and root (to run it as mysql)")
    root = Path(tempfile.mkdtemp(prefix="cq_hard_mariadb_", dir="/var/tmp"))
    shutil.chown(root, "mysql", "mysql")
    data, log = root / "data", root / "err.log"
    as_mysql = ["runuser", "-u", "mysql", "--"]
    server: subprocess.Popen[bytes] | None = None
    try:
        subprocess.run(
            [*as_mysql, install, "--no-defaults", f"--datadir={data}", "--skip-test-db",
             "--auth-root-authentication-method=normal"],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        server = subprocess.Popen(
            [*as_mysql, mariadbd, "--no-defaults", f"--datadir={data}",
             f"--socket={root / 'sock'}", f"--port={LOSSY_MARIADB_PORT}",
             "--bind-address=127.0.0.1", f"--log-error={log}", "--skip-log-bin",
             "--innodb-buffer-pool-size=16M", "--innodb-flush-log-at-trx-commit=2"],
        )  # fmt: skip
        url = make_url(f"mysql+pymysql://root@127.0.0.1:{LOSSY_MARIADB_PORT}/")
        admin = create_engine(url, isolation_level="AUTOCOMMIT")
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    with admin.connect() as conn:
                        conn.execute(text("CREATE DATABASE cq_hard_lossy"))
                    break
                except OperationalError:
                    assert server.poll() is None, log.read_text()
                    assert time.monotonic() < deadline, "the own MariaDB did not start in 60 s"
                    time.sleep(0.1)
        finally:
            admin.dispose()
        yield url.set(database="cq_hard_lossy")
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.mysql
def test_mariadb_flushing_once_a_second(
    lossy_mariadb: URL, caplog: pytest.LogCaptureFixture
) -> None:
    """A real server with innodb_flush_log_at_trx_commit = 2: refused, warned, NOT SAFE."""
    caplog.set_level(logging.WARNING, logger="cronoq_store")
    with pytest.raises(NotDurable, match=r"innodb_flush_log_at_trx_commit=2"):
        SqlStore.open(lossy_mariadb, StoreConfig(require_durable=True))
    with SqlStore.open(lossy_mariadb) as store:
        assert store.durability is not None
        assert [u.setting for u in store.durability.unsafe] == ["innodb_flush_log_at_trx_commit"]
    warned = [r for r in caplog.records if WARNING in r.getMessage()]
    assert len(warned) == 1
    view = status_json(lossy_mariadb)["durability"]
    assert isinstance(view, dict) and view["safe"] is False
    assert view["settings"]["innodb_flush_log_at_trx_commit"] == "2"


def test_settings_that_cannot_be_read(caplog: pytest.LogCaptureFixture) -> None:
    """A server that refuses to show its settings: a WARNING, or with `require_durable` the
    error itself (nothing vouches for the server); an unreachable one is raised either way."""
    caplog.set_level(logging.WARNING, logger="cronoq_store")
    refused = StoreError("permission denied to read fsync")
    judge_durability(refused, StoreConfig())
    assert "could not read what the server does with a commit" in caplog.text
    with pytest.raises(StoreError, match="permission denied"):
        judge_durability(refused, StoreConfig(require_durable=True))
    with pytest.raises(StoreUnavailable):
        judge_durability(StoreUnavailable("down"), StoreConfig())
