"""What a newcomer meets first (issue 42): each error through the CLI or the public API as a
user calls it, worded so the next step is plain."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from builders import BASE, status, submit
from servers import SERVER_URLS, admin_engine
from sqlalchemy import URL, Engine, make_url, text
from test_cli import cli_url, one_error, run

from cronoq_store import (
    InboxTaken,
    InvalidValue,
    SqlStore,
    StoreConfig,
    StoreError,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    enqueue_many,
)
from cronoq_store.cli import main

CLI = [sys.executable, "-m", "cronoq_store.cli"]
NO_DATABASE = make_url(SERVER_URLS["mysql"]).set(database="").render_as_string(hide_password=False)


def test_a_mysql_url_without_a_database_names_what_is_missing() -> None:
    """Refused before any connection, naming the missing database and both ways to give one."""
    line = one_error(run(NO_DATABASE, "status", code=1))
    assert "AssertionError" not in line
    assert "no database name" in line and "/DB" in line and "--schema" in line, line
    with pytest.raises(InvalidValue, match="no database name") as caught:
        SqlStore.open(NO_DATABASE)
    assert "StoreConfig.schema" in str(caught.value)


def test_upgrade_to_an_unknown_revision_points_at_history(db_url: URL) -> None:
    line = one_error(run(cli_url(db_url), "upgrade", "0099_nope", code=1))
    assert "0099_nope" in line and "cronoq-store history" in line, line
    assert "Can't locate" not in line


def test_two_items_with_one_key_in_one_drain_say_the_conflict_is_in_the_batch(
    store: SqlStore, engine: Engine
) -> None:
    with engine.begin() as conn:
        enqueue_many(conn, [TaskSpec(payload=b"a", key="k"), TaskSpec(payload=b"b", key="k")])
    epoch = store.acquire_leadership()
    batch: list[Submitted | InboxTaken] = []
    for n, item in enumerate(store.read_inbox(base=BASE)):
        batch += [Submitted(id=TaskId(10 + n), seq=n, arrival=0, spec=item.spec)]
        batch += [InboxTaken(inbox_id=item.inbox_id)]
    with pytest.raises(InvalidValue) as caught:
        store.commit(epoch, BASE, batch)
    message = str(caught.value)
    assert "within the batch" in message and "'k'" in message and "10" in message, message
    assert "stored tasks" not in message
    assert len(store.read_inbox()) == 2  # nothing written
    store.commit(epoch, BASE, batch[:2])  # the first; then the second conflicts with it, stored
    with pytest.raises(StoreError, match="conflicts with stored tasks"):
        store.commit(epoch, BASE, batch[2:])


def _listening() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


@pytest.mark.parametrize("where", ["port in use", "unresolvable host"])
def test_web_that_cannot_listen_is_one_error_line_and_status_1(where: str, tmp_path: Path) -> None:
    """Checked before the banner: nothing on stdout, one `Error:` line, status 1."""
    pytest.importorskip("uvicorn")
    db = tmp_path / "cronoq.db"
    run(str(db), "upgrade")
    sock, port = _listening()
    host = "127.0.0.1" if where == "port in use" else "no-such-host.invalid"
    token = [] if where == "port in use" else ["--token", "t0k3n"]
    try:
        done = subprocess.run(
            [*CLI, "--url", str(db), "web", "--host", host, "--port", str(port), *token],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        sock.close()
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), done.stderr
    assert (str(port) if where == "port in use" else "no-such-host.invalid") in lines[0]


@pytest.mark.mysql
def test_store_config_schema_still_opens_a_mysql_url_without_a_database() -> None:
    """The refusal is only for a URL that names no database at all: `schema` names one."""
    admin = admin_engine("mysql")
    name = "cq_newc_nodb"
    try:
        with admin.connect() as conn:
            conn.execute(text(f"CREATE DATABASE {name} CHARACTER SET utf8mb4"))
        with SqlStore.open(NO_DATABASE, StoreConfig(schema=name)) as store:
            assert store.epoch is None and store.check_schema() is None
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {name}"))
        admin.dispose()


@pytest.mark.parametrize("dialect", [pytest.param("mysql", marks=pytest.mark.mysql)])
def test_async_open_on_a_fresh_mariadb_writes_nothing_to_stderr(db_url: URL) -> None:
    """asyncmy logs every server warning (`Name 'pk_cronoq_tasks' ignored for PRIMARY key.`,
    one per table), which Python prints to stderr where the app configured no logging; the
    migration gives the server nothing to warn about. A process of its own: pytest's logging
    capture would hide what a user's program prints."""
    pytest.importorskip("asyncmy")
    program = (
        "import asyncio, sys\n"
        "from cronoq_store.aio import AsyncSqlStore\n"
        "async def main():\n"
        "    store = await AsyncSqlStore.open(sys.argv[1])\n"
        "    await store.close()\n"
        "asyncio.run(main())\n"
    )
    url = db_url.render_as_string(hide_password=False)
    done = subprocess.run(
        [sys.executable, "-c", program, url], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout == "" and done.stderr == "", done.stderr


INHERITED = ("is_leader", "on_leadership_lost", "epoch", "engine", "config", "holder")


@pytest.mark.sqlite
@pytest.mark.parametrize("path", ["store.SqlStore", "aio.AsyncSqlStore"])
def test_the_reference_shows_what_the_stores_inherit(path: str) -> None:
    """The reference's own extensions applied (mkdocs.yml): the members a store takes from its
    private base are on its page, and the base itself is not."""
    griffe = pytest.importorskip("griffe")  # the docs extra
    from test_ux import ROOT

    names = [
        f"{ROOT / 'scripts' / 'griffe_reference.py'}:{name}"
        for name in ("HideUndocumentedHooks", "HideInternals")
    ]
    pkg = griffe.load(
        "cronoq_store", search_paths=[str(ROOT)], extensions=griffe.load_extensions(*names)
    )
    cls = pkg[path]
    shown = set(cls.all_members)
    assert set(INHERITED) | {"inbox_rejected"} <= shown, sorted(shown)
    assert not [str(b) for b in cls.bases if str(b).lstrip(".").startswith("_")]
    assert cls.all_members["is_leader"].docstring is not None


def _commands(group: click.Group, ctx: click.Context, prefix: str = "") -> Iterator[click.Command]:
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None, name
        if isinstance(command, click.Group):
            yield from _commands(command, ctx, f"{prefix}{name} ")
        else:
            command.name = f"{prefix}{name}"
            yield command


def test_cli_md_shows_every_option_of_every_command() -> None:
    """Each command's heading in docs/cli.md (`### \\`status [--format ...]\\``) names each of
    its long options and arguments, read from the commands themselves: a new option that the
    page leaves out fails here instead of drifting."""
    from test_ux import ROOT

    page = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    headings = {
        m.group(1).split(" ")[0] if m.group(1) != "lease release" else "lease release": m.group(0)
        for m in re.finditer(r"^### `((?:lease )?[a-z]+)[^`]*`", page, re.MULTILINE)
    }
    missing = {}
    ctx = click.Context(main)
    for command in _commands(main, ctx):
        name = str(command.name)
        heading = headings.get(name)
        if heading is None:
            missing[name] = ["no `### ` heading"]
            continue
        words = [
            opt
            for param in command.params
            for opt in (
                param.opts if isinstance(param, click.Option) else [str(param.name).upper()]
            )
            if opt.startswith("--") or isinstance(param, click.Argument)
        ]
        absent = [w for w in words if not re.search(rf"(?<![\w-]){re.escape(w)}(?![\w-])", heading)]
        if absent:
            missing[name] = absent
    assert missing == {}


def test_cli_md_status_json_example_has_every_key(tmp_path: Path) -> None:
    """The page's `status --json` example has the keys the command prints."""
    from test_ux import ROOT

    db = tmp_path / "x.db"
    run(str(db), "upgrade")
    printed = json.loads(run(str(db), "status", "--json").stdout)
    page = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    section = page[page.index("### `status") :]
    start = section.index("```json") + len("```json")
    example = json.loads(section[start : section.index("```", start)])
    assert set(example) == set(printed)
    assert set(example["prune_backlog"]) == set(printed["prune_backlog"])


def _owner(module: str) -> str | None:
    """The distribution that installs `module`'s file (None: the standard library)."""
    spec = importlib.util.find_spec(module)
    origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
    if origin is None or "site-packages" not in origin.parts:
        return None
    for dist in importlib.metadata.distributions():
        for file in dist.files or ():
            if file.name == origin.name and Path(str(dist.locate_file(file))).resolve() == origin:
                return str(dist.metadata["Name"]).lower()
    return None


def test_observability_md_says_to_install_what_its_example_imports() -> None:
    """The example imports `opentelemetry.sdk`, which the `otel` extra (the API only) does not
    install: the page's `pip install` line must name every distribution the example's imports
    come from (the example itself runs in test_readme's `test_docs_examples_run`)."""
    from test_readme import ROOT, python_blocks

    page = ROOT / "docs" / "observability.md"
    text_ = page.read_text(encoding="utf-8")
    installed: set[str] = set()
    for line in re.findall(r"pip install ([^`\n]+)", text_):
        for word in shlex.split(line):
            name, _, extras = word.partition("[")
            installed.add(name.lower())
            for extra in extras.rstrip("]").split(","):
                for req in importlib.metadata.requires(name) or ():
                    if extra and re.search(rf"extra == [\"']{extra}[\"']", req):
                        installed.add(re.split(r"[<>=\[; ]", req, maxsplit=1)[0].lower())
    code = "\n".join(python_blocks(page))
    modules = re.findall(r"^(?:from|import) ([\w.]+)", code, re.MULTILINE)
    needed = {owner for m in modules if (owner := _owner(m)) is not None}
    needed.discard("cronoq-store")
    assert "opentelemetry-sdk" in needed  # what the check is about
    assert needed <= installed, (needed - installed, installed)


@pytest.mark.parametrize("dialect", [pytest.param("postgresql", marks=pytest.mark.postgresql)])
def test_status_shows_a_multi_host_url_as_written(db_url: URL) -> None:
    """`?host=h:p&host=h:p` is shown as written (not `h%3Ap`), the password still masked, and
    the hint it prints pastes as a working command line."""
    host = f"{db_url.host}:{db_url.port or 5432}"
    url = (
        f"postgresql+psycopg://{db_url.username}:s3cr3t-pw@/{db_url.database}"
        f"?host={host}&host={host}&target_session_attrs=read-write"
    )
    line = one_error(run(url, "status", code=1))  # not migrated yet: a hint to paste
    assert f"?host={host}&host={host}&target_session_attrs" in line, line
    assert "%3A" not in line and "postgres:***@" in line
    hint = line[line.index("`") + 1 : line.rindex("`")]
    _, _, pasted, *command = shlex.split(hint)  # the server trusts: `***` is accepted
    assert command == ["upgrade"]
    run(pasted, *command)  # the hint's URL, as printed, reaches the same database
    shown = run(url, "status").stdout.splitlines()[0]
    assert f"host={host}&host={host}" in shown and "%" not in shown, shown


def test_tasks_shows_why_each_task_failed_cut_short(store: SqlStore, db_url: URL) -> None:
    """A message column, each cut to one short line, so `tasks --status failed` says why
    without a `show` per task."""
    epoch = store.acquire_leadership()
    long = "connection refused by smtp.example.com:25 after 3 tries; giving up on this one"
    store.commit(
        epoch,
        BASE,
        [
            submit(1, pool="mail"),
            status(1, TaskStatus.FAILED, message=long),
            submit(2, pool="mail"),
            status(2, TaskStatus.FAILED, message="bad address\nsecond line"),
            submit(3, pool="mail"),
        ],
    )
    store.release_leadership()
    lines = run(cli_url(db_url), "tasks", "--pool", "mail").stdout.splitlines()
    assert lines[0].split()[-1] == "message", lines[0]
    by_id = {line.split()[0]: line for line in lines[2:]}
    assert by_id["1"].endswith("connection refused by smtp.example.com:…"), by_id["1"]
    assert by_id["2"].endswith("bad address …"), by_id["2"]
    assert by_id["3"].split()[-1] != "…" and "second" not in "".join(lines)


def test_docs_index_lists_every_guide() -> None:
    """docs/index.md links every page of docs/ (a page it leaves out is one nobody finds)."""
    from test_ux import ROOT

    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    assert {p for p in pages if f"]({p})" not in index} == set()


def test_readme_says_nothing_twice() -> None:
    """No run of eight words appears twice in README.md's prose, nor one of four twice in one
    sentence ("What each figure measures ...: [...] has what each figure measures.")."""
    from test_ux import ROOT

    text_ = re.sub(r"```.*?```", "", (ROOT / "README.md").read_text(encoding="utf-8"), flags=re.S)
    prose = "\n".join(line for line in text_.splitlines() if not line.startswith("|"))
    prose = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", prose)

    def repeats(words: list[str], n: int) -> list[str]:
        seen: dict[tuple[str, ...], int] = {}
        found = []
        for i in range(len(words) - n + 1):
            run_ = tuple(w.lower().strip(".,:;()") for w in words[i : i + n])
            if run_ in seen and i - seen[run_] >= n:
                found.append(" ".join(run_))
            seen.setdefault(run_, i)
        return found

    assert repeats(prose.split(), 8) == []
    sentences = re.split(r"(?<=[.!?])\s+", " ".join(prose.split()))
    assert [r for s in sentences for r in repeats(s.split(), 4)] == []


@pytest.mark.sqlite
def test_the_sdists_own_tests_run_from_it(dist: Path, tmp_path: Path) -> None:
    """The sdist ships its tests and what they read (docs/, scripts/, mkdocs.yml): unpacked,
    tests that read the docs and run scripts/ pass there, on the unpacked code."""
    (sdist,) = dist.glob("cronoq_store-*.tar.gz")
    with tarfile.open(sdist) as archive:
        archive.extractall(tmp_path, filter="data")
    (root,) = tmp_path.glob("cronoq_store-*")
    for needed in ("docs/index.md", "docs/img", "scripts/griffe_reference.py", "mkdocs.yml"):
        assert (root / needed).exists(), needed
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH"}}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "sqlite or not (postgresql or mysql or galera or browser or slow or pooler)",
            "tests/cli/test_first_steps.py::test_docs_index_lists_every_guide",
            "tests/cli/test_first_steps.py::test_cli_md_shows_every_option_of_every_command",
            "tests/docs/test_readme.py::test_every_cli_transcript_is_run",
            "tests/cli/test_ux.py::test_test_servers_in_ci_fails_for_a_missing_server",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert "4 passed" in done.stdout, done.stdout[-3000:]
