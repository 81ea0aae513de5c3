"""`cronoq-store upgrade --sql` (issue 37, item 5): the DDL for the URL's dialect, applied by
hand with the database's own client (sqlite3, psql, mysql) to an empty database, builds a schema
the store opens at head with `migrate=False`, and `cronoq-store check` finds nothing off."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
from pathlib import Path

from builders import BASE, submit
from click.testing import CliRunner
from sqlalchemy import URL, create_engine

from cronoq_store import ById, SqlStore, StoreConfig, TaskId, migrate
from cronoq_store.cli import main


def _apply_by_hand(db_url: URL, script: Path) -> None:
    """Run `script` as a DBA would, with the dialect's command-line client."""
    backend = db_url.get_backend_name()
    if backend == "sqlite":
        if shutil.which("sqlite3"):
            with script.open() as sql:
                subprocess.run(["sqlite3", "-bail", db_url.database or ""], stdin=sql, check=True)
        else:  # the same library the shell wraps
            conn = sqlite3.connect(db_url.database or "")
            conn.executescript(script.read_text())
            conn.close()
        return
    host, port = db_url.host or "127.0.0.1", str(db_url.port or "")
    if backend == "postgresql":
        command = ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", host, "-U"]
        command += [db_url.username or "postgres", "-d", db_url.database or "", "-f", str(script)]
        if port:
            command += ["-p", port]
        env = {"PGPASSWORD": db_url.password or ""} if db_url.password else {}
        subprocess.run(command, check=True, env={**os.environ, **env})
        return
    command = ["mysql", "--protocol=TCP", "-h", host, "-u", db_url.username or "root"]
    if port:
        command += ["-P", port]
    if db_url.password:
        command.append(f"--password={db_url.password}")
    command.append(db_url.database or "")
    with script.open() as sql:
        subprocess.run(command, stdin=sql, check=True)


def _is_mariadb(db_url: URL) -> bool:
    engine = create_engine(db_url)
    try:
        with engine.connect():
            return bool(getattr(engine.dialect, "is_mariadb", False))
    finally:
        engine.dispose()


def test_upgrade_sql_applied_by_hand_opens_at_head(db_url: URL, tmp_path: Path) -> None:
    url = db_url.render_as_string(hide_password=False)
    for_sql = url
    if db_url.get_backend_name() == "mysql" and _is_mariadb(db_url):  # as docs/deploying.md says
        for_sql = db_url.set(drivername="mariadb+pymysql").render_as_string(hide_password=False)
    printed = CliRunner().invoke(main, ["--url", for_sql, "upgrade", "--sql"])
    assert printed.exit_code == 0, printed.output
    assert "CREATE TABLE cronoq_tasks" in printed.output
    assert f"'{migrate.head_revision()}'" in printed.output
    if db_url.get_backend_name() == "sqlite":
        assert not Path(db_url.database or "").exists()  # --sql touches no database
    script = tmp_path / "cronoq.sql"
    script.write_text(printed.output)
    _apply_by_hand(db_url, script)

    with SqlStore.open(db_url, StoreConfig(migrate=False)) as store:
        assert migrate.current_revision(store.engine) == migrate.head_revision()
        epoch = store.acquire_leadership()
        store.commit(epoch, BASE, [submit(1)])
        assert store.get_task(ById(id=TaskId(1))) is not None
    checked = CliRunner().invoke(main, ["--url", url, "check"])
    assert checked.exit_code == 0, checked.output


def test_upgrade_sql_refuses_a_schema_and_an_unknown_revision() -> None:
    said = CliRunner().invoke(main, ["--url", "sqlite:///x.db", "upgrade", "0099_x", "--sql"])
    assert said.exit_code == 1 and "no schema revision '0099_x'" in said.output
    said = CliRunner().invoke(
        main, ["--url", "postgresql+psycopg://h/db", "--schema", "s", "upgrade", "--sql"]
    )
    assert said.exit_code == 1 and "leave out --schema" in said.output
