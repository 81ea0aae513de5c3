"""Test databases: a real SQLite file, a real PostgreSQL and a real MariaDB/MySQL.

Every test that takes `db_url` (or `engine`) runs once per dialect, on a database created for it
with a unique name and dropped afterwards. A server that cannot be reached skips its tests with
the reason, except when `CRONOQ_REQUIRE_DIALECTS` (or CI) is set: then it is a failure.

Servers: `CRONOQ_TEST_POSTGRESQL_URL` (default postgres@127.0.0.1:5432) and
`CRONOQ_TEST_MYSQL_URL` (default root@127.0.0.1:3306), read in tests/servers.py, which a test
imports what it needs from (no test imports this file). The replica tests build a PostgreSQL
primary and streaming replica of their own beside it (`pg_pair`, tests/pgpair.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from builders import no_connection_left
from drills import POLL, RENEW, TTL, Spawn, starting
from figures import FIGURES
from hypothesis import settings
from pgpair import PgPair, PgPairError
from servers import (
    DIALECTS,
    SERVER_CHANGES,
    SERVER_ENV,
    SERVER_URLS,
    UNREACHABLE,
    new_database,
    required,
)
from sqlalchemy import URL, Engine, create_engine, make_url

from cronoq_store import SqlStore, StoreConfig

# Hypothesis checks outcomes here, never speed: its per-example deadline (200 ms) is a
# wall-clock assertion that a loaded CI machine fails at random (one did, in test_fold).
settings.register_profile("cronoq", deadline=None)
settings.load_profile("cronoq")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--soak", action="store_true", help="run the long soak tests too")


def pytest_configure(config: pytest.Config) -> None:
    copy = os.environ.get("CRONOQ_MUTANT_COPY")
    if copy:  # scripts/mutants: the tests must run against the mutated copy, nothing else
        import cronoq_store

        imported = Path(cronoq_store.__file__).resolve()
        if not imported.is_relative_to(Path(copy).resolve()):
            pytest.exit(f"cronoq_store imported from {imported}, not the copy in {copy}", 3)
    for dialect in DIALECTS:
        config.addinivalue_line("markers", f"{dialect}: runs on {dialect}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--soak"):
        return
    skip = pytest.mark.skip(reason="soak test: run with --soak")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for title, (figs, path) in FIGURES.items():
        if not figs:
            continue
        terminalreporter.section(title)
        for key, fig in sorted(figs.items()):
            terminalreporter.write_line(f"{key}: {json.dumps(fig, sort_keys=True)}")
        if path is not None:
            path.write_text(json.dumps(figs, indent=2, sort_keys=True) + "\n")
            terminalreporter.write_line(f"(written to {path})")
    for change in SERVER_CHANGES:
        terminalreporter.write_line(f"cronoq tests changed a server they did not start: {change}")
    if UNREACHABLE and not required():
        # A laptop without a server: its tests were skipped, which a green run must not hide.
        terminalreporter.section("DIALECTS NOT TESTED", sep="!", red=True, bold=True)
        for dialect, why in sorted(UNREACHABLE.items()):
            terminalreporter.write_line(
                f"{dialect}: every {dialect} test was skipped: server unreachable at "
                f"{make_url(SERVER_URLS[dialect])!r} ({why}); install it, or point "
                f"{SERVER_ENV[dialect]} at one",
                red=True,
                bold=True,
            )


@pytest.fixture(scope="session")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package built once per run as a user's `python -m build` builds it: the sdist, then
    the wheel from that sdist (so the wheel proves the sdist is complete). Its folder holds
    both; the tests about what ships read them rather than build again."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("dist")
    build = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out)],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert build.returncode == 0, build.stderr
    return out


@pytest.fixture(params=[pytest.param(d, marks=getattr(pytest.mark, d)) for d in DIALECTS])
def dialect(request: pytest.FixtureRequest) -> str:
    """The dialect under test: sqlite, postgresql or mysql (MariaDB here)."""
    return str(request.param)


@pytest.fixture
def db_url(dialect: str, tmp_path: Path) -> Iterator[URL]:
    """The URL of a new, empty database of the dialect under test."""
    yield from new_database(dialect, tmp_path)


@pytest.fixture
def engine(db_url: URL) -> Iterator[Engine]:
    """A plain engine on the new database; no connection may be left checked out."""
    eng = create_engine(db_url)
    try:
        yield eng
        assert eng.pool.checkedout() == 0, "a test left a connection checked out"
    finally:
        eng.dispose()


@pytest.fixture
def empty_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`tmp_path`, made the working directory, with no `CRONOQ_DATABASE_URL` set: where a
    command or an example finds no database but the one it is given."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CRONOQ_DATABASE_URL", raising=False)
    return tmp_path


@pytest.fixture
def cleanup() -> Iterator[list[Callable[[], None]]]:
    """What closes the stores a test opened, run last-opened first."""
    done: list[Callable[[], None]] = []
    yield done
    for close in reversed(done):
        close()


@pytest.fixture
def store_config() -> StoreConfig:
    """The config `store` opens with; a module overrides this fixture to open with another."""
    return StoreConfig(lease_ttl=timedelta(seconds=5))


@pytest.fixture
def store(db_url: URL, store_config: StoreConfig) -> Iterator[SqlStore]:
    """A migrated store on the new database (not leading); no connection may be left checked
    out. A module that needs it to hold something overrides this fixture, taking it."""
    with SqlStore.open(db_url, store_config) as s:
        yield s
        no_connection_left(s, s.engine)


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawn]:
    """Start driver processes (`drills.starting`) on the drills' timings (`drills.TTL`...);
    all are killed and reaped afterwards."""
    with starting(tmp_path, ttl=TTL, renew=RENEW, poll=POLL, duration=1800, control=True) as s:
        yield s


@pytest.fixture(scope="session")
def pg_pair() -> Iterator[PgPair]:
    """A PostgreSQL primary with a streaming replica of our own (tests/pgpair.py), built
    synchronous once per session and dropped at its end; `pg_pair.fresh(sync=...)` rebuilds it
    after a test crashed, stopped or promoted something. Where it cannot be built the test
    skips, except under `CRONOQ_REQUIRE_DIALECTS` (or CI): there it fails."""
    why = PgPair.unavailable()
    if why is not None:
        if required():
            pytest.fail(f"no PostgreSQL primary/replica pair: {why}", pytrace=False)
        pytest.skip(f"no PostgreSQL primary/replica pair: {why}")
    pair = PgPair()
    try:
        pair.build(sync=True)
    except PgPairError as exc:
        pair.destroy()
        if required():
            pytest.fail(f"could not build the PostgreSQL pair: {exc}", pytrace=False)
        pytest.skip(f"could not build the PostgreSQL pair: {exc}")
    try:
        yield pair
    finally:
        pair.destroy()
