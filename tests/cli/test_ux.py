"""What a user meets: hints that can be pasted, errors in words, the same wording
on every dialect. Each test runs the CLI as a user would (CliRunner, or a real subprocess)."""

from __future__ import annotations

import shlex
import time
from pathlib import Path
from typing import Any

import pytest
from builders import captured, execute
from click.testing import Result
from sqlalchemy import URL, create_engine
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
def test_a_missing_sqlite_file_hint_creates_that_file(empty_dir: Path) -> None:
    line = one_error(run("mydata.db", "status", code=1))
    assert "no SQLite database at mydata.db" in line
    assert hint(line) == ["--url", "mydata.db", "upgrade"]
    paste(hint(line))
    assert (empty_dir / "mydata.db").exists() and not (empty_dir / "cronoq.db").exists()
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
    execute(db_url, "CREATE SCHEMA empty")
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


# 8. The filter an app's own env.py needs: its autogenerate leaves cronoq's tables alone.


APP_ENV = """
from alembic import context
from sqlalchemy import Column, Integer, MetaData, String, Table, create_engine, pool

from cronoq_store.migrate import {filter}

app_metadata = MetaData()
Table("app_users", app_metadata, Column("id", Integer, primary_key=True), Column("n", String(50)))

engine = create_engine(context.get_x_argument(as_dictionary=True)["url"], poolclass=pool.NullPool)
with engine.begin() as connection:
    context.configure(
        connection=connection, target_metadata=app_metadata, include_name={filter}
    )
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
"""


def _app_history(tmp_path: Path, filter_: str) -> Path:
    """An app's own Alembic history (alembic init's generic template, our env.py) in tmp."""
    from alembic import command
    from alembic.config import Config

    home = tmp_path / f"app-{filter_}"
    ini = tmp_path / f"alembic-{filter_}.ini"
    command.init(Config(str(ini)), str(home), template="generic")
    (home / "env.py").write_text(APP_ENV.format(filter=filter_))
    return ini


def _alembic(ini: Path, url: str, *args: str) -> str:
    import sys

    done = captured(
        [sys.executable, "-m", "alembic", "-c", str(ini), "-x", f"url={url}", *args],
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def _proposed(ini: Path, url: str) -> str:
    """The upgrade body of a fresh `alembic revision --autogenerate` (a real subprocess)."""
    out = _alembic(ini, url, "revision", "--autogenerate", "-m", "app")
    path = Path(out.split("Generating ", 1)[1].split(" ...", 1)[0].strip())
    body = path.read_text()
    return body.split("def upgrade()", 1)[1].split("def downgrade()", 1)[0]


def test_an_apps_autogenerate_leaves_cronoqs_tables_alone(db_url: URL, tmp_path: Path) -> None:
    """cronoq's tables beside an app's in one database (one schema): the app's env.py with
    `migrate.without_cronoq_tables` proposes its own table and nothing about `cronoq_` ones;
    the filter of cronoq's own history, used there by mistake, proposes dropping them."""
    url = db_url.render_as_string(hide_password=False)
    engine = create_engine(db_url)
    try:
        migrate.upgrade(engine)
    finally:
        engine.dispose()
    mistaken = _proposed(_app_history(tmp_path, "cronoq_tables_only"), url)
    assert "drop_table('cronoq_tasks')" in mistaken
    ini = _app_history(tmp_path, "without_cronoq_tables")
    first = _proposed(ini, url)
    assert "create_table('app_users'" in first and "cronoq_" not in first, first
    (tmp_path / "app-cronoq_tables_only" / "versions").rename(tmp_path / "mistaken")
    _alembic(ini, url, "upgrade", "head")
    again = _proposed(ini, url)
    assert "cronoq_" not in again and "app_users" not in again and "pass" in again, again
    engine = create_engine(db_url)
    try:
        assert migrate.current_revision(engine) == migrate.head_revision()
    finally:
        engine.dispose()


# 7. Docs that cannot drift.

DOCS_DIR = Path(__file__).resolve().parents[2] / "docs"
PAGES = [*sorted(DOCS_DIR.glob("*.md")), DOCS_DIR.parent / "README.md"]


@pytest.mark.sqlite
def test_every_revision_the_docs_name_exists() -> None:
    """A revision named anywhere in the guides is one this build ships (no 0001_initial shown
    as what `upgrade` reaches when the head is later)."""
    from cronoq_store.cli import known_revisions

    known = known_revisions()
    for page in PAGES:
        text_ = page.read_text(encoding="utf-8")
        future = set(  # a revision made up to show how an unknown one is refused
            re_findall(r"SET version_num = '(\d{4}_\w+)'", text_)
            + re_findall(r"revision\s'(\d{4}_\w+)', which this build", text_)
        )
        for rev in set(re_findall(r"\b\d{4}_[a-z][a-z_]*\b", text_)) - future:
            assert rev in known, (page.name, rev)
        for rev in re_findall(r"(?:upgraded none -> |at )(\d{4}_[a-z_]+)", text_):
            assert rev == migrate.head_revision(), (page.name, rev)


@pytest.mark.sqlite
def test_no_cronoq_store_output_is_shown_outside_a_transcript() -> None:
    """What a command prints is shown only in ```console blocks, which tests/docs/test_readme.py
    runs; a comment quoting output in a ```sh block would drift unseen."""
    import re

    other = re.compile(r"^```(?!console)\w*\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)
    for page in PAGES:
        for block in other.findall(page.read_text(encoding="utf-8")):
            for line in block.splitlines():
                if re.match(r"\s*(?:\S+=\S+\s+)*cronoq-store\b", line) and "#" in line:
                    comment = line.split("#", 1)[1]
                    assert not re.search(r"prints|\"", comment), (page.name, line)


@pytest.mark.sqlite
def test_the_tuning_table_has_every_store_config_field() -> None:
    import dataclasses

    from cronoq_store import StoreConfig

    table = (DOCS_DIR / "tuning.md").read_text(encoding="utf-8")
    for field in dataclasses.fields(StoreConfig):
        assert f"| `{field.name}` |" in table, field.name


def re_findall(pattern: str, text_: str) -> list[str]:
    import re

    return re.findall(pattern, text_)


NEEDS_HEAD_PROBES: dict[str, list[str]] = {
    "status": ["status"],
    "tasks": ["tasks"],
    "show": ["show", "1"],
    "prune": ["prune", "--older-than", "1d"],
    "lease": ["lease", "release", "--force", "--yes"],
    "enqueue": ["enqueue", "x"],
    "inbox": ["inbox"],
    "current": ["current"],
    "downgrade": ["downgrade", "base", "--yes-destroy-data"],
    "history": ["history"],
}


@pytest.mark.sqlite
def test_cli_md_names_every_command_that_needs_the_head(tmp_path: Path) -> None:
    """The commands the page says need the head revision are exactly those that refuse a
    database that was never migrated."""
    import re

    db = tmp_path / "empty.db"
    db.write_bytes(b"")
    refusing = set()
    for name, args in NEEDS_HEAD_PROBES.items():
        result = run(str(db), *args, code=None)
        if result.exit_code != 0 and "no cronoq tables" in result.stderr:
            refusing.add(name)
    text_ = (DOCS_DIR / "cli.md").read_text(encoding="utf-8")
    sentence = text_.split("need\nthe database at this build's head revision")[0].rsplit(".", 1)[1]
    named = set(re.findall(r"`(\w+)`", sentence))
    assert named == refusing, (named, refusing)


# 6. Alembic from the tree: one line for an error, a SQLite file 0600 as the CLI makes it.

ROOT = Path(__file__).resolve().parents[2]


def _tree_alembic(*args: str, cwd: Path) -> tuple[int, str]:
    import sys

    done = captured(
        [sys.executable, "-m", "alembic", "-c", str(ROOT / "alembic.ini"), *args],
        timeout=120,
        cwd=cwd,
    )
    return done.returncode, done.stderr


@pytest.mark.parametrize(
    "dialect",
    [
        pytest.param("postgresql", marks=pytest.mark.postgresql),
        pytest.param("mysql", marks=pytest.mark.mysql),
    ],
)
def test_alembic_from_the_tree_fails_in_one_line(db_url: URL, tmp_path: Path) -> None:
    url = cli_url(db_url)
    code, err = _tree_alembic(
        "-x", f"url={url}", "-x", "schema=nope", "upgrade", "head", cwd=tmp_path
    )
    assert code == 1, err
    assert "Traceback" not in err and PASSWORD not in err, err
    lines = [line for line in err.splitlines() if not line.startswith("INFO ")]
    assert len(lines) == 1, err
    assert "no PostgreSQL schema 'nope'" in lines[0] or "no MySQL database 'nope'" in lines[0]
    assert url.startswith("mysql") or "***@" in lines[0], lines[0]


@pytest.mark.sqlite
def test_alembic_from_the_tree_creates_a_private_sqlite_file(tmp_path: Path) -> None:
    import os
    import stat

    old = os.umask(0o022)
    try:
        code, err = _tree_alembic(
            "-x", f"url=sqlite:///{tmp_path}/t.db", "upgrade", "head", cwd=tmp_path
        )
    finally:
        os.umask(old)
    assert code == 0, err
    assert stat.S_IMODE((tmp_path / "t.db").stat().st_mode) == 0o600
    run(str(tmp_path / "c.db"), "upgrade")
    assert stat.S_IMODE((tmp_path / "c.db").stat().st_mode) == 0o600


# 10. `make test` on a machine without PostgreSQL or MariaDB.

CLOSED = {
    "CRONOQ_TEST_POSTGRESQL_URL": "postgresql+psycopg://postgres@127.0.0.1:1/postgres",
    "CRONOQ_TEST_MYSQL_URL": "mysql+pymysql://root@127.0.0.1:1/",
}


def _env(*, ci: bool, **extra: str) -> dict[str, str]:
    import os
    import uuid

    env = {k: v for k, v in os.environ.items() if k not in ("CI", "CRONOQ_REQUIRE_DIALECTS")}
    env["CRONOQ_PGPAIR_NAME"] = f"cqux{uuid.uuid4().hex[:6]}"  # never another run's pair
    if ci:
        env["CI"] = "true"
    return {**env, **extra}


def _script(env: dict[str, str]) -> tuple[int, str, str, float]:

    started = time.monotonic()
    done = captured(
        [str(ROOT / "scripts" / "test-servers")],
        env=env,
        timeout=300,
    )
    return done.returncode, done.stdout, done.stderr, time.monotonic() - started


@pytest.mark.sqlite
def test_test_servers_outside_ci_names_a_missing_server_and_goes_on() -> None:
    code, out, err, _ = _script(_env(ci=False, **CLOSED))
    assert code == 0, out + err
    lines = out.splitlines()
    for name, var in (
        ("PostgreSQL", "CRONOQ_TEST_POSTGRESQL_URL"),
        ("MariaDB", "CRONOQ_TEST_MYSQL_URL"),
    ):
        said = [line for line in lines if line.startswith(f"test-servers: {name} ")]
        assert len(said) == 1 and var in said[0] and "will not run" in said[0], out
        # Only checked for reachability: not waited for (60 s) as a local server would be.
        assert "is not reachable at" in said[0] and "within 60 s" not in said[0], out
    assert "NOT UP: PostgreSQL MariaDB" in out, out


@pytest.mark.sqlite
def test_test_servers_in_ci_fails_for_a_missing_server() -> None:
    code, out, err, _ = _script(_env(ci=True, **CLOSED))
    assert code != 0, out + err
    assert "test-servers: PostgreSQL is not reachable" in err and "required" in err, err
    assert "within 60 s" not in out + err  # failed at once, not after waiting for it


@pytest.mark.sqlite
def test_test_servers_on_a_machine_without_servers(tmp_path: Path) -> None:
    """No server tools at all on PATH (a laptop): one line each with how to get it."""
    import os
    import shutil

    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for tool in ("bash", "seq", "sleep", "dirname", "timeout", "id", "ls", "head", "cat"):
        found = shutil.which(tool)
        assert found is not None, tool
        os.symlink(found, bin_ / tool)
    env = _env(ci=False, PATH=str(bin_))
    env.pop("CRONOQ_TEST_POSTGRESQL_URL", None)
    env.pop("CRONOQ_TEST_MYSQL_URL", None)
    code, out, err, _ = _script(env)
    assert code == 0, out + err
    assert (
        "test-servers: PostgreSQL is not installed: its tests will not run; install it "
        "(apt-get install postgresql), or point CRONOQ_TEST_POSTGRESQL_URL at one"
    ) in out, out
    assert "test-servers: MariaDB is not installed" in out and "CRONOQ_TEST_MYSQL_URL" in out
    assert "within 60 s" not in out  # nothing installed: nothing waited for
    code, out, err, _ = _script({**env, "CI": "true"})
    assert code != 0 and "test-servers: " in err and "PostgreSQL" in err, out + err


def _pytest(env: dict[str, str]) -> tuple[int, str]:
    import sys

    done = captured(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "tests/cli/test_ux.py",
            "-k",
            "prune_beyond_the_epoch",
        ],
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    return done.returncode, done.stdout + done.stderr


@pytest.mark.sqlite
def test_pytest_without_servers_runs_the_rest_and_says_so_loudly() -> None:
    code, out = _pytest(_env(ci=False, **CLOSED))
    assert code == 0, out
    assert "1 passed, 2 skipped" in out, out
    loud = [line for line in out.splitlines() if "DIALECTS NOT TESTED" in line]
    assert loud, out
    assert "postgresql" in out.split("DIALECTS NOT TESTED", 1)[1], out
    assert "mysql" in out.split("DIALECTS NOT TESTED", 1)[1], out
    code, out = _pytest(_env(ci=True, **CLOSED))
    assert code == 1 and "1 passed" in out and ("2 errors" in out or "2 failed" in out), out


# 9. The API reference: parameters, returns and raises, or the docs build fails.


def _reference_checks() -> object:
    import importlib.util

    pytest.importorskip("griffe")
    spec = importlib.util.spec_from_file_location(
        "griffe_reference", ROOT / "scripts" / "griffe_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.sqlite
def test_the_reference_check_names_what_a_docstring_leaves_out(tmp_path: Path) -> None:
    griffe = pytest.importorskip("griffe")  # the docs extra; the range runs have none
    checks: Any = _reference_checks()
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text(
        'def bare(a: int, b: str) -> int:\n    """Two lines, no sections."""\n    return a\n\n\n'
        "def full(a: int) -> int:\n"
        '    """Full.\n\n    Args:\n        a: A.\n\n    Returns:\n        A.\n\n'
        '    Raises:\n        ValueError: Never.\n    """\n    return a\n'
    )
    pkg = griffe.load("pkg", search_paths=[str(tmp_path)])
    assert checks.missing_signature_docs(pkg["bare"], raises=True) == [
        "parameter 'a' (Args:)",
        "parameter 'b' (Args:)",
        "what it returns (Returns:)",
        "what it raises (Raises:)",
    ]
    assert checks.missing_signature_docs(pkg["full"], raises=True) == []


@pytest.mark.sqlite
def test_the_public_api_documents_parameters_returns_and_raises() -> None:
    """What `make docs` checks, without building the site: the store's, the inbox's and the
    migrations' functions (the issue's SqlStore.commit, recover, acquire_leadership,
    enqueue among them) document every parameter, the return value and the errors."""
    griffe = pytest.importorskip("griffe")  # the docs extra; the range runs have none
    checks: Any = _reference_checks()
    pkg = griffe.load("cronoq_store", search_paths=[str(ROOT)], resolve_aliases=False)
    missing = {}
    for path in (
        "store.SqlStore.commit",
        "store.SqlStore.recover",
        "store.SqlStore.acquire_leadership",
        "store.SqlStore.open",
        "inbox.enqueue",
        "inbox.enqueue_many",
        "migrate.upgrade",
    ):
        found = checks.missing_signature_docs(pkg[path], raises=True)
        if found:
            missing[path] = found
    assert missing == {}
    text_ = pkg["store.SqlStore.commit"].docstring.value
    for error in ("Fenced", "StoreUnavailable", "InvalidValue"):
        assert f"{error}:" in text_, error


@pytest.mark.sqlite
def test_the_async_face_shows_the_sync_faces_contract() -> None:
    """The async methods say only what differs (`as SqlStore.x`); the reference gives each the
    sync twin's sections (`SharedFaceDocs`), so both pages document every parameter, return
    value and error, from one text. A method with sections of its own keeps them (`open`)."""
    griffe = pytest.importorskip("griffe")  # the docs extra; the range runs have none
    checks: Any = _reference_checks()
    pkg = griffe.load(
        "cronoq_store",
        search_paths=[str(ROOT)],
        resolve_aliases=False,
        extensions=griffe.load_extensions(checks.SharedFaceDocs),
    )
    async_cls, sync_cls = pkg["aio.AsyncSqlStore"], pkg["store.SqlStore"]
    shared = 0
    for name, method in async_cls.members.items():
        if name.startswith("_") or not method.is_function:
            continue
        assert checks.missing_signature_docs(method, raises=True) == [], name
        twin = sync_cls.members.get(name)
        if twin is not None and checks.SECTION.search(twin.docstring.value):
            own = method.docstring.value
            if name != "open":
                assert own.endswith(
                    twin.docstring.value[checks.SECTION.search(twin.docstring.value).start() :]
                )
                shared += 1
    assert shared >= 10
    assert "async driver" in async_cls.members["open"].docstring.value
