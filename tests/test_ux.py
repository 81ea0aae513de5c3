"""Issue 24, "What a user meets": hints that can be pasted, errors in words, the same wording
on every dialect. Each test runs the CLI as a user would (CliRunner, or a real subprocess)."""

from __future__ import annotations

import shlex
import time
from pathlib import Path

import pytest
from click.testing import Result
from sqlalchemy import URL, create_engine, text
from test_cli import PASSWORD, cli_url, one_error, run, submit

from cronoq_store import SqlStore, TimeBase, migrate


def hint(line: str) -> list[str]:
    """The command a one-line error tells the user to run (between backquotes), as argv."""
    assert line.count("`") == 2, line
    argv = shlex.split(line.split("`")[1])
    assert argv[0] == "cronoq-store", line
    return argv[1:]


def paste(argv: list[str], *, code: int = 0) -> Result:
    """Run a hint as pasted (the masked password put back, as a user would type it)."""
    argv = [a.replace("***", PASSWORD) for a in argv]
    return run(None, *argv, code=code)


# 1. Every hint repeats the --url (password masked) and --schema given.


@pytest.mark.sqlite
def test_a_missing_sqlite_file_hint_creates_that_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CRONOQ_DATABASE_URL", raising=False)
    line = one_error(run("mydata.db", "status", code=1))
    assert "no SQLite database at mydata.db" in line
    assert hint(line) == ["--url", "mydata.db", "upgrade"]
    paste(hint(line))
    assert (tmp_path / "mydata.db").exists() and not (tmp_path / "cronoq.db").exists()
    run("mydata.db", "status")


@pytest.mark.sqlite
def test_the_environment_url_is_repeated_in_the_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CRONOQ_DATABASE_URL", "env data.db")
    line = one_error(run(None, "tasks", code=1))
    assert hint(line) == ["--url", "env data.db", "upgrade"]
    monkeypatch.delenv("CRONOQ_DATABASE_URL")
    paste(hint(line))
    assert (tmp_path / "env data.db").exists() and not (tmp_path / "cronoq.db").exists()


def test_a_database_behind_this_build_gets_a_hint_for_itself(db_url: URL) -> None:
    url = cli_url(db_url)
    run(url, "upgrade", "0001_initial")
    line = one_error(run(url, "status", code=1))
    assert "behind this build's" in line
    assert hint(line)[-1] == "upgrade" and "--url" in hint(line)
    assert PASSWORD not in line
    paste(hint(line))
    assert run(url, "current").stdout == f"{migrate.head_revision()}\n"
    run(url, "status")


# 2. A missing PostgreSQL schema is named; so is a schema without cronoq's tables.


@pytest.mark.parametrize("dialect", [pytest.param("postgresql", marks=pytest.mark.postgresql)])
def test_a_missing_postgresql_schema_is_named(db_url: URL) -> None:
    url = cli_url(db_url)
    line = one_error(run(url, "--schema", "missing", "status", code=1))
    assert "no PostgreSQL schema 'missing' in this database" in line, line
    assert hint(line)[-3:] == ["--schema", "missing", "upgrade"]
    engine = create_engine(db_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE SCHEMA empty"))
    finally:
        engine.dispose()
    line = one_error(run(url, "--schema", "empty", "tasks", code=1))
    assert "PostgreSQL schema 'empty' has no cronoq tables" in line, line
    line = one_error(run(url, "status", code=1))
    assert "no cronoq tables in PostgreSQL schema 'public'" in line, line
    assert "--schema" not in hint(line)
    paste(hint(line))  # creates them in public: what was asked
    paste(hint(one_error(run(url, "--schema", "missing", "status", code=1))))
    run(url, "--schema", "missing", "status")


# 4. One wording for one cause on every dialect.


SERVER = {
    "postgresql": "postgresql+psycopg://{user}:{pw}@127.0.0.1:{port}/{db}",
    "mysql": "mysql+pymysql://{user}:{pw}@127.0.0.1:{port}/{db}",
}
PORT = {"postgresql": 5432, "mysql": 3306}


def _words(dialect: str, *, user: str, db: str, port: int | None = None, pw: str = "") -> str:
    url = SERVER[dialect].format(user=user, pw=pw, port=port or PORT[dialect], db=db)
    line = one_error(run(url, "status", code=1))
    assert "(1045" not in line and "(1049" not in line and "(2003" not in line, line
    return line.split("): ", 1)[1]


@pytest.mark.parametrize(
    "dialect",
    [
        pytest.param("postgresql", marks=pytest.mark.postgresql),
        pytest.param("mysql", marks=pytest.mark.mysql),
    ],
)
def test_one_wording_for_one_cause_on_every_dialect(dialect: str, db_url: URL) -> None:
    """Access denied, unknown database, unreachable server: the same words on PostgreSQL and
    MariaDB (the fixture's database proves the server is up)."""
    assert _words(dialect, user="no_such_user", db=db_url.database or "", pw="x") == (
        "access denied for user 'no_such_user': check the URL's user and password"
    )
    assert _words(dialect, user=db_url.username or "", db="no_such_db") == (
        "no database 'no_such_db' on this server: create it, or fix the URL's database name"
    )
    assert _words(dialect, user="u", db="x", port=1) == (
        "cannot reach the server: is it running, and are the URL's host and port right?"
    )


# 5. Smaller ones.


@pytest.mark.sqlite
def test_an_unknown_url_scheme_names_the_supported_forms() -> None:
    line = one_error(run("banana://x/y", "status", code=1))
    assert "Can't load plugin" not in line
    for form in ("sqlite:///PATH", "postgresql+psycopg://", "mysql+pymysql://"):
        assert form in line, line


def test_show_a_negative_id_is_no_such_task(db_url: URL) -> None:
    url = cli_url(db_url)
    run(url, "upgrade")
    assert "no task with id -5" in one_error(run(url, "show", "-5", code=1))


def test_prune_beyond_the_epoch_never_wraps(db_url: URL) -> None:
    url = cli_url(db_url)
    run(url, "upgrade")
    out = run(url, "prune", "--older-than", "99999999999999999999d", "--dry-run").stdout
    assert "1677" not in out and "1970-01-01" in out, out


@pytest.mark.sqlite
def test_demo_overwrite_on_another_file_says_pass_once(tmp_path: Path) -> None:
    other = tmp_path / "mine.db"
    other.write_bytes(b"")
    line = one_error(run(str(other), "demo", "--overwrite", code=1))
    assert line.count("pass") == 1, line
    assert other.read_bytes() == b""


def test_tables_end_lines_without_spaces(db_url: URL) -> None:
    url = cli_url(db_url)
    with SqlStore.open(db_url) as store:
        epoch = store.acquire_leadership()
        store.commit(epoch, TimeBase(unix_ns=time.time_ns()), [submit(1)])
    run(url, "enqueue", "x", "--pool", "a")
    for args in (["status"], ["inbox"]):
        out = run(url, *args).stdout
        assert out and all(line == line.rstrip() for line in out.splitlines()), (args, out)


# 3. `enqueue` where the tables are not: a SchemaError naming the schema searched and schema=.


@pytest.mark.parametrize(
    "dialect",
    [
        pytest.param("sqlite", marks=pytest.mark.sqlite),
        pytest.param("postgresql", marks=pytest.mark.postgresql),
        pytest.param("mysql", marks=pytest.mark.mysql),
    ],
)
def test_enqueue_where_the_tables_are_not_is_a_schema_error(db_url: URL) -> None:
    """The tables live in a schema (PostgreSQL) or are missing (SQLite, MariaDB's own
    database): an app's ORM Session enqueues without `schema=` and gets a SchemaError, never
    a driver exception; with `schema=` the same call works."""
    from sqlalchemy.orm import Session

    from cronoq_store import SchemaError, StoreConfig, TaskSpec, enqueue

    postgresql = db_url.get_backend_name() == "postgresql"
    schema = "jobs" if postgresql else None
    if postgresql:
        SqlStore.open(db_url, StoreConfig(schema=schema)).close()
    engine = create_engine(db_url)
    try:
        with Session(engine) as session, pytest.raises(SchemaError) as raised:
            enqueue(session, TaskSpec(payload=b"x", pool="a"))
        message = str(raised.value)
        assert "cronoq_inbox" in message and "schema=" in message, message
        if postgresql:
            assert "PostgreSQL schema 'public'" in message, message
        assert not isinstance(raised.value.__cause__, SchemaError)
        if postgresql:
            with Session(engine) as session, session.begin():
                assert enqueue(session, TaskSpec(payload=b"x", pool="a"), schema=schema) > 0
    finally:
        engine.dispose()
