"""The `cronoq-store` CLI through click's CliRunner, on every dialect, error paths included.

On PostgreSQL the URL carries a password (the local server trusts, so it is accepted and
ignored), so every assertion that no output contains it is a real one there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sqlite3
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from inspect import signature
from pathlib import Path

import builders
import pytest
from builders import BASE, execute
from click.testing import CliRunner, Result
from sqlalchemy import URL, Engine, create_engine, event, inspect, text, update

from cronoq_store import (
    ById,
    ByKey,
    Dep,
    Fenced,
    InvalidValue,
    RecurringNext,
    RecurringSpec,
    RecurringUpsert,
    SqlStore,
    StatusChanged,
    StoreConfig,
    Submitted,
    TaskId,
    TaskSpec,
    TaskStatus,
    TimeBase,
    migrate,
)
from cronoq_store.cli import main, parse_duration
from cronoq_store.errors import CorruptValue
from cronoq_store.schema import tasks

PASSWORD = "s3cr3t-pw"
OLD = BASE  # November 2023: old enough to prune
TTL = timedelta(seconds=30)


def cli_url(db_url: URL) -> str:
    """The URL the CLI gets: with a password wherever the server accepts one."""
    if db_url.get_backend_name() == "postgresql":
        db_url = db_url.set(password=PASSWORD)
    return db_url.render_as_string(hide_password=False)


SEPARATE_STDERR = {"mix_stderr": False} if "mix_stderr" in signature(CliRunner).parameters else {}
"""stdout and stderr captured apart: click 8.2 always does, 8.1 (the floor) when asked."""


def run(url: str | None, *args: str, code: int | None = 0, input: str | None = None) -> Result:
    """Run the CLI; check the exit status, that it never crashed, and that no password leaked."""
    argv = ([] if url is None else ["--url", url]) + list(args)
    result = CliRunner(**SEPARATE_STDERR).invoke(main, argv, input=input, catch_exceptions=True)
    both = result.stdout + result.stderr
    assert code is None or result.exit_code == code, (argv, both, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    assert "Traceback" not in both
    assert PASSWORD not in both
    return result


def one_error(result: Result) -> str:
    """The single `Error: ...` line a failed command printed on stderr (stdout empty)."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert result.stdout == ""
    return lines[0]


def submit(i: int, pool: str = "a", key: str | None = None, **kw: object) -> Submitted:
    return builders.submit(i, b"p" * i, pool=pool, key=key, **kw)


def done(i: int, st: TaskStatus, message: str | None = None, at: int = 100) -> StatusChanged:
    return builders.status(i, st, message, attempt=2, at=at)


@pytest.fixture
def store_config() -> StoreConfig:
    return StoreConfig(lease_ttl=TTL)


@pytest.fixture
def store(store: SqlStore, dialect: str) -> SqlStore:
    """A migrated store that leads, holding: pool a: 1 succeeded (output), 2 failed (old, key
    "k2", a live task depends on it), 3 queued (key "k3"); pool b: 4 and 5 cancelled (old),
    6 succeeded just now (tenant "[t1]", which is not rich markup); and a recurring schedule."""
    epoch = store.acquire_leadership()
    sched = RecurringSpec(
        name="nightly", template=TaskSpec(payload=b"t", pool="b"), cron="0 3 * * *"
    )
    store.commit(
        epoch,
        OLD,
        [
            submit(1, kind="email", labels={"team": "x"}, tags=frozenset({"urgent"})),
            submit(2, key="k2"),
            submit(4, pool="b"),
            submit(5, pool="b"),
            done(1, TaskStatus.RUNNING, "started"),
            done(1, TaskStatus.SUCCEEDED),
            done(2, TaskStatus.FAILED, "boom"),
            done(4, TaskStatus.CANCELLED),
            done(5, TaskStatus.CANCELLED),
            submit(3, key="k3", deps=(Dep(target=ByKey(key="k2"), on="finish"),)),
            RecurringUpsert(spec=sched),
            RecurringNext(name="nightly", next=10**9, last=TaskId(1)),
        ],
        outputs=[(TaskId(1), b"0123456789")],
    )
    store.commit(
        epoch,
        TimeBase(unix_ns=time.time_ns()),
        [submit(6, pool="b", tenant="[t1]"), done(6, TaskStatus.SUCCEEDED, at=0)],
    )
    return store


def test_upgrade_current_downgrade(db_url: URL) -> None:
    url = cli_url(db_url)
    if db_url.get_backend_name() == "sqlite":
        Path(db_url.database or "").touch()  # an empty file is an empty SQLite database
    assert run(url, "current").stdout == "none\n"
    unmigrated = run(url, "current", "--check", code=1)
    assert unmigrated.stdout == "none\n" and "not at head" in unmigrated.stderr

    assert run(url, "upgrade").stdout == f"upgraded none -> {migrate.head_revision()}\n"
    assert run(url, "upgrade").stdout == f"at {migrate.head_revision()}: nothing to do\n"
    assert run(url, "current", "--check").stdout == f"{migrate.head_revision()}\n"

    refused = run(url, "downgrade", "base", code=2)
    assert "--yes-destroy-data" in refused.stderr
    engine = create_engine(db_url)
    try:
        assert "cronoq_tasks" in inspect(engine).get_table_names()
        assert run(url, "downgrade", "base", "--yes-destroy-data").stdout == (
            f"downgraded {migrate.head_revision()} -> none\n"
        )
        assert "cronoq_tasks" not in inspect(engine).get_table_names()
    finally:
        engine.dispose()
    assert run(url, "current").stdout == "none\n"
    assert "no cronoq tables in " in one_error(run(url, "status", code=1))


def test_status(db_url: URL, store: SqlStore) -> None:
    url = cli_url(db_url)
    data = json.loads(run(url, "status", "--json").stdout)
    assert data["revision"] == data["head"] == migrate.head_revision()
    assert PASSWORD not in data["database"]
    assert data["dialect"] == {"sqlite": "sqlite", "postgresql": "postgresql"}.get(
        db_url.get_backend_name(), "mysql"
    )
    assert data["lease"]["state"] == "held"
    assert data["lease"]["holder"] == store.holder
    assert data["lease"]["epoch"] == store.epoch == 1
    assert 0 < data["lease"]["expires_in_s"] <= TTL.total_seconds()
    # Live tasks by pool and status; the finished ones as counts (exact below the cap).
    assert data["tasks"] == [{"pool": "a", "status": "queued", "count": 1}]
    hour = dict.fromkeys(["succeeded", "failed", "cancelled", "expired", "skipped"], 0)
    assert data["finished"] == {
        "tasks": 5,
        "accuracy": "exact",
        "last_hour": {**hour, "succeeded": 1},
    }
    assert data["prune_backlog"] == {"tasks": 4, "accuracy": "exact", "retention_s": 3600.0}
    (sched,) = data["recurring"]
    assert sched["name"] == "nightly"
    assert sched["schedule"] == "cron 0 3 * * * (UTC)"
    assert sched["last_task"] == 1
    assert sched["next"] == "2023-11-14T22:13:21.000000Z"  # OLD + 1 s
    assert isinstance(data["size_bytes"], int) and data["size_bytes"] > 0

    out = run(url, "status").stdout
    assert f"held by {store.holder}, epoch 1, expires in" in out
    assert re.search(r"expires in \d+\.\d s \(database clock\)", out)
    assert re.search(r"a\s+queued\s+1", out)
    assert "finished   5 (last hour: succeeded 1); 4 past the retention (3600 s)" in out
    assert "nightly" in out and f"{migrate.head_revision()} (head)" in out
    assert re.search(r"size\s+\d+(\.\d)? (B|KiB|MiB|GiB)", out)


def test_tasks_and_show(db_url: URL, store: SqlStore) -> None:
    url = cli_url(db_url)

    def ids(*args: str) -> list[int]:
        page = json.loads(run(url, "tasks", "--json", *args).stdout)
        return [t["id"] for t in page["tasks"]]

    assert ids() == [1, 2, 3, 4, 5, 6]
    assert ids("--pool", "b") == [4, 5, 6]
    assert ids("--pool", "a", "--pool", "b", "--status", "succeeded") == [1, 6]
    assert ids("--status", "QUEUED") == [3]
    assert ids("--key", "k2") == [2]
    assert ids("--tenant", "[t1]") == [6]
    assert re.search(
        r"^\s*6\s+b\s+succeeded\s+2\s+\[t1\]",
        run(url, "tasks", "--after", "5").stdout,
        flags=re.MULTILINE,
    )
    assert ids("--pool", "nope") == []
    page = json.loads(run(url, "tasks", "--json", "--limit", "2").stdout)
    assert [t["id"] for t in page["tasks"]] == [1, 2] and page["next_after"] == 2
    assert ids("--after", "2", "--limit", "2") == [3, 4]
    last = json.loads(run(url, "tasks", "--json", "--after", "4", "--limit", "5").stdout)
    assert [t["id"] for t in last["tasks"]] == [5, 6] and last["next_after"] is None
    first = json.loads(run(url, "tasks", "--json", "--limit", "1").stdout)["tasks"][0]
    assert first["status"] == "succeeded" and first["terminal"] is True
    assert (first["kind"], first["attempt"], first["output_size"]) == ("email", 2, 10)
    assert first["message"] == "started"
    assert first["updated"] == "2023-11-14T22:13:20.000000Z"

    table = run(url, "tasks", "--limit", "2").stdout
    assert re.search(r"^\s*2\s+k2\s+a\s+failed", table, flags=re.MULTILINE)
    assert "more: --after 2" in table
    assert run(url, "tasks", "--key", "none-such").stdout == "no tasks match\n"
    assert "Invalid value for '--status'" in run(url, "tasks", "--status", "bogus", code=2).stderr

    one = json.loads(run(url, "show", "1", "--json").stdout)
    assert one["status"] == "succeeded" and one["message"] == "started"
    assert (one["attempt"], one["output_size"], one["payload_size"]) == (2, 10, 1)
    assert one["spec"]["labels"] == {"team": "x"} and one["spec"]["tags"] == ["urgent"]
    three = json.loads(run(url, "show", "k3", "--json").stdout)
    assert three["id"] == 3 and three["status"] == "queued" and three["output_size"] is None
    assert three["spec"]["deps"] == [{"id": None, "key": "k2", "on": "finish"}]

    text_out = run(url, "show", "2").stdout
    assert re.search(r"^status\s+failed$", text_out, flags=re.MULTILINE)
    assert re.search(r"^message\s+boom$", text_out, flags=re.MULTILINE)
    assert re.search(r"^output\s+-$", text_out, flags=re.MULTILINE)
    assert "no task with id 99" in one_error(run(url, "show", "99", code=1))
    assert "no task with key '1'" in one_error(run(url, "show", "--by-key", "1", code=1))


def test_prune(db_url: URL, store: SqlStore) -> None:
    url = cli_url(db_url)
    # Old and finished: 1, 4, 5 (2 is old too, but live task 3 depends on its key).
    assert run(url, "prune", "--older-than", "1d", "--dry-run").stdout.startswith(
        "would delete 3 finished tasks updated before "
    )
    assert store.get_task(ById(id=TaskId(1))) is not None
    pruned = run(url, "prune", "--older-than", "1d", "--batch-size", "2")
    assert pruned.stdout.startswith("deleted 3 finished tasks updated before ")
    assert "3/3" in pruned.stderr  # the progress bar, on stderr
    remaining = json.loads(run(url, "tasks", "--json").stdout)["tasks"]
    assert [t["id"] for t in remaining] == [2, 3, 6]
    again = json.loads(run(url, "prune", "--older-than", "1h30m", "--json").stdout)
    assert again["count"] == 0 and again["dry_run"] is False
    assert "not a duration" in run(url, "prune", "--older-than", "7", code=2).stderr


def test_prune_is_the_stores_prune(db_url: URL, store: SqlStore) -> None:
    """`cronoq-store prune` takes `SqlStore.prune`'s way: finished tasks an older build left
    without a finish time are stamped and pruned too, and on PostgreSQL the prune vacuums."""
    with store.engine.begin() as conn:  # as release 0.1.0 finishes them (tests/migrations)
        conn.execute(update(tasks).where(tasks.c.id.in_([4, 5])).values(finished_unix_ns=None))
    sent: list[str] = []

    def record(_c: object, _cursor: object, sql: str, *_: object) -> None:
        if sql.lstrip().upper().startswith("VACUUM"):
            sent.append(sql)

    event.listen(Engine, "before_cursor_execute", record)  # the CLI's own engine too
    try:
        pruned = run(cli_url(db_url), "prune", "--older-than", "1d", "--json")
    finally:
        event.remove(Engine, "before_cursor_execute", record)
    assert json.loads(pruned.stdout)["count"] == 3  # 1, 4 and 5; 2 is needed by 3
    assert store.get_task(ById(id=TaskId(4))) is None
    postgresql = db_url.get_backend_name() == "postgresql"
    assert [sql.split()[0].upper() for sql in sent] == (["VACUUM"] if postgresql else []), sent


def test_prune_batch_size_is_checked(db_url: URL, store: SqlStore) -> None:
    """A batch of none would never end the prune's loops: the store refuses it, the CLI too."""
    with pytest.raises(InvalidValue, match="at least 1"):
        store.prune(timedelta(days=1), batch_size=0)
    assert (
        "--batch-size"
        in run(cli_url(db_url), "prune", "--older-than", "1d", "--batch-size", "0", code=2).stderr
    )
    assert store.get_task(ById(id=TaskId(1))) is not None


def test_lease_release(db_url: URL, store: SqlStore) -> None:
    url = cli_url(db_url)
    assert "--force" in run(url, "lease", "release", code=2).stderr
    declined = run(url, "lease", "release", "--force", input="n\n", code=1)
    assert f"held by {store.holder}" in declined.stdout and "Aborted" in declined.stderr
    assert store.is_leader

    released = run(url, "lease", "release", "--force", input="y\n")
    assert f"released the lease of {store.holder} (epoch 1)" in released.stdout
    assert "takes epoch 2" in released.stdout
    with pytest.raises(Fenced):
        store.commit(1, OLD, [submit(7)])
    assert store.get_task(ById(id=TaskId(7))) is None  # the fenced commit wrote nothing
    assert json.loads(run(url, "status", "--json").stdout)["lease"]["state"] == "free"
    assert run(url, "lease", "release", "--force", "--yes").stdout == (
        "the lease is free: nothing to release\n"
    )


def test_schema_too_new_is_refused(db_url: URL) -> None:
    url = cli_url(db_url)
    run(url, "upgrade")
    execute(db_url, "UPDATE cronoq_alembic_version SET version_num = '9999_future'")
    for args in (
        ["status"],
        ["tasks"],
        ["show", "1"],
        ["prune", "--older-than", "1d"],
        ["lease", "release", "--force", "--yes"],
        ["upgrade"],
        ["downgrade", "base", "--yes-destroy-data"],
    ):
        line = one_error(run(url, *args, code=1))
        assert "9999_future" in line and "does not know" in line, (args, line)
    current = run(url, "current", code=1)  # prints the revision, then the error
    assert current.stdout == "9999_future\n" and "does not know" in current.stderr


SERVERS_DOWN = [
    pytest.param(
        f"postgresql+psycopg://postgres:{PASSWORD}@127.0.0.1:1/x", marks=pytest.mark.postgresql
    ),
    pytest.param(f"mysql+pymysql://root:{PASSWORD}@127.0.0.1:1/x", marks=pytest.mark.mysql),
]
EVERY_DB_COMMAND: Sequence[Sequence[str]] = (
    ["upgrade"],
    ["current"],
    ["status"],
    ["tasks"],
    ["show", "k"],
    ["prune", "--older-than", "7d"],
    ["lease", "release", "--force", "--yes"],
    ["downgrade", "base", "--yes-destroy-data"],
)


@pytest.mark.parametrize("url", SERVERS_DOWN)
def test_unreachable_server(url: str) -> None:
    for args in EVERY_DB_COMMAND:
        line = one_error(run(url, *args, code=1))
        assert line.startswith("Error: database unavailable (") and "127.0.0.1:1/x" in line
        assert "***" in line  # the URL is shown, its password masked


@pytest.mark.sqlite
@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("nonsense://x", "bad database URL"),
        (f"postgresql+psycopg://u:{PASSWORD}@h:notaport/db", "bad database URL"),
        (f"postgresql+nodriver://u:{PASSWORD}@h/db", "bad database URL"),
        (":memory:", "invalid SQLite path"),
    ],
)
def test_bad_url(url: str, why: str) -> None:
    assert why in one_error(run(url, "status", code=1))


@pytest.mark.sqlite
def test_missing_sqlite_file_is_not_created(
    empty_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for args in (["status"], ["current"], ["tasks"]):
        assert "no SQLite database at cronoq.db" in one_error(run(None, *args, code=1))
    assert not (empty_dir / "cronoq.db").exists()
    monkeypatch.setenv("CRONOQ_DATABASE_URL", str(empty_dir / "env.db"))
    run(None, "upgrade")  # the URL comes from the environment
    assert (empty_dir / "env.db").exists()
    assert "--schema is for PostgreSQL" in run(None, "--schema", "x", "status", code=2).stderr


@pytest.mark.parametrize("dialect", [pytest.param("sqlite", marks=pytest.mark.sqlite)])
def test_sqlite_reads_do_not_wait_for_the_writer(db_url: URL, store: SqlStore) -> None:
    """`status`, `tasks`, `show`, `current` read beside a writer that holds the write lock."""
    writer = sqlite3.connect(db_url.database or "", isolation_level=None)
    try:
        writer.execute("BEGIN IMMEDIATE")
        # The writer holds the write lock throughout: a read that needed it would fail
        # ("database is locked") once the busy timeout ran out, not merely be slow.
        url = cli_url(db_url)
        assert json.loads(run(url, "status", "--json").stdout)["lease"]["epoch"] == 1
        assert json.loads(run(url, "tasks", "--json").stdout)["tasks"][0]["id"] == 1
        assert "succeeded" in run(url, "show", "1").stdout
        assert run(url, "current").stdout == f"{migrate.head_revision()}\n"
        writer.execute("ROLLBACK")
    finally:
        writer.close()


@pytest.mark.parametrize("dialect", [pytest.param("postgresql", marks=pytest.mark.postgresql)])
def test_postgresql_schema(db_url: URL) -> None:
    url = cli_url(db_url)
    run(url, "--schema", "cronoq", "upgrade")
    engine = create_engine(db_url)
    try:
        assert "cronoq_tasks" in inspect(engine).get_table_names(schema="cronoq")
        assert "cronoq_tasks" not in inspect(engine).get_table_names()
    finally:
        engine.dispose()
    status = json.loads(run(url, "--schema", "cronoq", "status", "--json").stdout)
    assert status["revision"] == migrate.head_revision() and status["tasks"] == []
    line = one_error(run(url, "status", code=1))  # not in public
    assert "no cronoq tables in PostgreSQL schema 'public'" in line


@pytest.mark.sqlite
def test_history_and_help() -> None:
    out = run(None, "history").stdout
    assert f"-> {migrate.head_revision()} (head) [online, writers " in out and "<base> -> " in out
    assert "Run the failover demo" in run(None, "demo", "--help").stdout
    assert "demo runs on a SQLite file" in run("postgresql+psycopg://h/db", "demo", code=2).stderr
    listed = run(None, "--help").stdout
    for name in ("upgrade", "current", "history", "status", "tasks", "show", "prune", "lease"):
        assert re.search(rf"^\s+{name}\s", listed, flags=re.MULTILINE), name
    if importlib.util.find_spec("cronoq_store.bench") is not None:  # registered lazily
        assert re.search(r"^\s+bench\s", listed, flags=re.MULTILINE)
        assert "Usage: main bench" in run(None, "bench", "--help").stdout


@pytest.mark.parametrize(
    ("text_", "seconds"),
    [("30s", 30), ("15m", 900), ("2h", 7200), ("7d", 604800), ("1w", 604800), ("1h30m", 5400)],
)
def test_parse_duration(text_: str, seconds: int) -> None:
    assert parse_duration(text_) == timedelta(seconds=seconds)


@pytest.mark.parametrize("bad", ["", "7", "7x", "d", "-1d", "1.5h"])
def test_parse_duration_refuses(bad: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(bad)


def test_unusable_schema_is_a_usage_error() -> None:
    """Refused before connecting, so no server is needed."""
    error = run("postgresql+psycopg://h/db", "--schema", "a.b", "upgrade", code=2).stderr
    assert "Invalid value for '--schema'" in error and "contains '.'" in error


# No traceback for any input; no part of a password ever.


def test_out_of_range_input_is_one_line_never_a_traceback(db_url: URL, store: SqlStore) -> None:
    url = cli_url(db_url)
    huge = "99999999999999999999"
    assert "no task with id 99999999999999999999" in one_error(run(url, "show", huge, code=1))
    assert "no task with id -9999" in one_error(run(url, "show", "--", f"-{huge}", code=1))
    assert run(url, "tasks", "--after", huge).stdout == "no tasks match\n"
    everything = json.loads(run(url, "tasks", "--json", "--after", f"-{huge}").stdout)
    assert [t["id"] for t in everything["tasks"]] == [1, 2, 3, 4, 5, 6]
    for age in ("800000d", "1000000000d", f"{huge}d", f"{huge}w"):
        out = run(url, "prune", "--older-than", age, "--dry-run").stdout
        assert out.startswith("would delete 0 finished tasks updated before 1970-01-01"), (age, out)
    assert parse_duration(f"{huge}d") == timedelta.max


def test_a_poisoned_schedule_never_prints_a_traceback(db_url: URL, store: SqlStore) -> None:
    """A schedule spec nested 2,000 levels deep: `status` shows it as undecodable, or fails
    with one line; either way no traceback, on every dialect."""
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE cronoq_recurring SET spec = :s"), {"s": "[" * 2000})
    result = run(cli_url(db_url), "status", code=None)
    if result.exit_code == 0:
        assert "undecodable" in result.stdout
    else:
        assert result.exit_code == 1 and "nightly" not in one_error(result)


def test_any_error_of_any_command_is_one_line(
    db_url: URL, store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever a command raises (a store error, or a bug no check foresaw) ends in one line
    on stderr and status 1."""
    url = cli_url(db_url)
    from cronoq_store import inspection

    def corrupt(*_args: object) -> None:
        raise CorruptValue("schedule 'nightly': JSON nested deeper than 64 levels")

    monkeypatch.setattr(inspection, "schedule", corrupt)
    line = one_error(run(url, "status", code=1))
    assert "nested deeper than 64 levels" in line and line.startswith("Error: failed (")

    def bug(*_args: object) -> None:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(inspection, "task_detail", bug)
    line = one_error(run(url, "show", "1", code=1))
    assert "internal error (RecursionError" in line


MALFORMED_PASSWORDS = [
    ("postgresql+psycopg://bob:p@ssW0rd@127.0.0.1:5999/app", ("p@ssW0rd", "ssW0rd")),
    ("mysql+pymysql://bob:p@ss@W0rd@127.0.0.1:5999/app", ("ss@W0rd", "W0rd", "p@ss")),
    ("postgresql+psycopg://bob@127.0.0.1:5999/app?password=hunter2", ("hunter2",)),
    ("postgresql+psycopg://bob@127.0.0.1:5999/app?sslmode=disable&password=hun)ter2", ("hun",)),
    ("mysql+pymysql://bob@127.0.0.1:5999/app?passwd=hunter2", ("hunter2",)),
    ("postgres://bob:hunter2@127.0.0.1:5999/app", ("hunter2",)),
    ("mysql://bob:hunter2@127.0.0.1:5999/app", ("hunter2",)),
    ("postgresql+psycopg://bob:hunter2@127.0.0.1:5999", ("hunter2",)),
]


@pytest.mark.sqlite
@pytest.mark.parametrize(("url", "secrets"), MALFORMED_PASSWORDS)
def test_no_part_of_a_password_is_ever_printed(url: str, secrets: tuple[str, ...]) -> None:
    for args in EVERY_DB_COMMAND:
        result = run(url, *args, code=1)
        line = one_error(result)
        for secret in secrets:
            assert secret not in line, (args, line)
        if "password=" in url or "passwd=" in url:
            assert "password=***" in line or "passwd=***" in line, line
            assert re.search(r"\(\S+\): ", line), line  # the message is whole, ')' kept


@pytest.mark.sqlite
@pytest.mark.parametrize(
    ("url", "advice"),
    [
        (
            "postgres://bob@db.example/app",
            "write postgresql+psycopg://bob@db.example/app "
            "(pip install 'cronoq-store[postgresql]')",
        ),
        (
            "mysql://bob@db.example/app",
            "write mysql+pymysql://bob@db.example/app (pip install 'cronoq-store[mysql]')",
        ),
    ],
)
def test_a_url_without_its_driver_says_what_to_install_and_write(url: str, advice: str) -> None:
    line = one_error(run(url, "status", code=1))
    assert advice in line
    assert "Can't load plugin" not in line  # SQLAlchemy's text says less than the advice


@pytest.mark.sqlite
def test_version() -> None:
    from importlib.metadata import version

    assert run(None, "--version").stdout == f"cronoq-store, version {version('cronoq-store')}\n"


@pytest.mark.parametrize("dialect", [pytest.param("mysql", marks=pytest.mark.mysql)])
def test_mysql_schema_names_a_database_upgrade_creates(db_url: URL) -> None:
    """MySQL's --schema is a database: other commands say it is missing and what to run;
    `upgrade` creates it, as PostgreSQL's first migration creates its schema."""
    url = cli_url(db_url)
    schema = f"{db_url.database}_s"
    line = one_error(run(url, "--schema", schema, "status", code=1))
    assert f"no database {schema!r} on this server" in line
    assert f"--schema {schema} upgrade` creates it" in line and "`cronoq-store --url " in line
    try:
        assert run(url, "--schema", schema, "upgrade").stdout.startswith("upgraded none -> ")
        status = json.loads(run(url, "--schema", schema, "status", "--json").stdout)
        assert status["revision"] == migrate.head_revision()
        assert run(url, "--schema", schema, "current").stdout == f"{migrate.head_revision()}\n"
    finally:
        execute(db_url, f"DROP DATABASE IF EXISTS {schema}")


def test_current_prints_an_unknown_revision(db_url: URL) -> None:
    url = cli_url(db_url)
    run(url, "upgrade")
    execute(db_url, "UPDATE cronoq_alembic_version SET version_num = '0777_later'")
    result = run(url, "current", code=1)
    assert result.stdout == "0777_later\n"
    assert "'0777_later', which this build of cronoq-store does not know" in result.stderr
    assert "cronoq-store history" in result.stderr


@pytest.mark.sqlite
def test_a_closed_pipe_ends_quietly(db_url: URL, store: SqlStore) -> None:
    """`cronoq-store tasks | head -1`: the reader goes away; no traceback, nothing on stderr."""
    with SqlStore.open(db_url, StoreConfig(migrate=False)) as other:
        del other  # (the fixture's store leads; add rows through it)
    epoch = store.epoch
    assert epoch is not None
    store.commit(epoch, OLD, [submit(i) for i in range(10, 3000)])
    cli = [sys.executable, "-m", "cronoq_store.cli", "--url", cli_url(db_url)]
    for args in (["tasks", "--limit", "5000"], ["tasks", "--json", "--limit", "5000"]):
        proc = subprocess.Popen(
            [*cli, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_no_color()
        )
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.readline()
        proc.stdout.close()  # as `head -1` does
        err = proc.stderr.read()
        proc.stderr.close()
        code = proc.wait(60)
        assert err == b"", err.decode()
        assert code in (0, 1)


def _no_color() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CRONOQ_DATABASE_URL", "COLUMNS")}
    return {**env, "NO_COLOR": "1"}
