"""Test databases: a real SQLite file, a real PostgreSQL and a real MariaDB/MySQL.

Every test that takes `db_url` (or `engine`) runs once per dialect, on a database created for it
with a unique name and dropped afterwards. A server that cannot be reached skips its tests with
the reason, except when `CRONOQ_REQUIRE_DIALECTS` (or CI) is set: then it is a failure.

Servers: `CRONOQ_TEST_POSTGRESQL_URL` (default postgres@127.0.0.1:5432) and
`CRONOQ_TEST_MYSQL_URL` (default root@127.0.0.1:3306). The replica tests build a PostgreSQL
primary and streaming replica of their own beside it (`pg_pair`, tests/pgpair.py).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from builders import wait_until
from hypothesis import settings
from pgpair import PgPair, PgPairError
from sqlalchemy import URL, Connection, Engine, create_engine, make_url, text
from sqlalchemy.exc import OperationalError

from cronoq_store import SqlStore, StoreConfig

SERVER_URLS = {
    "postgresql": os.environ.get(
        "CRONOQ_TEST_POSTGRESQL_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    ),
    "mysql": os.environ.get("CRONOQ_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/"),
}
SERVER_ENV = {"postgresql": "CRONOQ_TEST_POSTGRESQL_URL", "mysql": "CRONOQ_TEST_MYSQL_URL"}
DIALECTS = ("sqlite", "postgresql", "mysql")
MYSQL_PACKET = 64 * 1024 * 1024

# Hypothesis checks outcomes here, never speed: its per-example deadline (200 ms) is a
# wall-clock assertion that a loaded CI machine fails at random (one did, in test_fold).
settings.register_profile("cronoq", deadline=None)
settings.load_profile("cronoq")


def _required() -> bool:
    return bool(os.environ.get("CRONOQ_REQUIRE_DIALECTS") or os.environ.get("CI"))


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


_unreachable: dict[str, str] = {}
SERVER_CHANGES: list[str] = []
"""What the tests changed on a server they did not start (printed at the end of the run)."""


def raise_mysql_packet(conn: Connection, want: int) -> str | None:
    """Raise the server's global max_allowed_packet to `want` if it is lower (never lower it);
    what was changed, "from -> to", or None."""
    have = int(conn.execute(text("SELECT @@GLOBAL.max_allowed_packet")).scalar_one())
    if have >= want:
        return None
    conn.execute(text(f"SET GLOBAL max_allowed_packet = {int(want)}"))
    return f"SET GLOBAL max_allowed_packet {have} -> {want} (until the server restarts)"


FIGURES: dict[str, tuple[dict[str, Any], Path | None]] = {}
"""Figures the fault tests gather, by section title: shown at the end of the run, and written
as JSON to the path beside them (when there is one)."""


def figures(title: str, path: Path | None = None) -> dict[str, Any]:
    """The figures of section `title`, one line a key in the run's summary; a test module adds
    to them as it goes, and they are written to `path` (as JSON) at the end of the run."""
    return FIGURES.setdefault(title, ({}, path))[0]


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
    if _unreachable and not _required():
        # A laptop without a server: its tests were skipped, which a green run must not hide.
        terminalreporter.section("DIALECTS NOT TESTED", sep="!", red=True, bold=True)
        for dialect, why in sorted(_unreachable.items()):
            terminalreporter.write_line(
                f"{dialect}: every {dialect} test was skipped: server unreachable at "
                f"{make_url(SERVER_URLS[dialect])!r} ({why}); install it, or point "
                f"{SERVER_ENV[dialect]} at one",
                red=True,
                bold=True,
            )


def _admin_engine(dialect: str) -> Engine:
    """An engine on the server's maintenance database, or skip/fail when it is down."""
    if dialect in _unreachable:
        _unavailable(dialect, _unreachable[dialect])
    engine = create_engine(SERVER_URLS[dialect], isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
            if dialect == "mysql":
                # 16 MiB payloads plus their statement exceed MariaDB's default 16 MiB packet.
                changed = raise_mysql_packet(conn, MYSQL_PACKET)
                if changed:
                    SERVER_CHANGES.append(f"{make_url(SERVER_URLS[dialect])!r}: {changed}")
    except OperationalError as exc:
        engine.dispose()
        _unreachable[dialect] = str(exc.orig).strip().splitlines()[0]
        _unavailable(dialect, _unreachable[dialect])
    return engine


def _unavailable(dialect: str, why: str) -> None:
    message = f"{dialect} server unreachable at {make_url(SERVER_URLS[dialect])!r}: {why}"
    if _required():
        pytest.fail(f"{message} (all dialects are required here)", pytrace=False)
    pytest.skip(message)


def new_database(dialect: str, tmp_path: Path) -> Iterator[URL]:
    """A fresh database of `dialect`, dropped afterwards (a file under `tmp_path` for SQLite)."""
    if dialect == "sqlite":
        yield make_url(f"sqlite:///{tmp_path / 'cronoq.db'}")
        return
    admin = _admin_engine(dialect)
    name = f"cronoq_test_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as conn:
            if dialect == "mysql":
                conn.execute(text(f"CREATE DATABASE {name} CHARACTER SET utf8mb4"))
            else:
                conn.execute(text(f"CREATE DATABASE {name}"))
        yield make_url(SERVER_URLS[dialect]).set(database=name)
    finally:
        with admin.connect() as conn:
            if dialect == "postgresql":
                conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            else:
                conn.execute(text(f"DROP DATABASE IF EXISTS {name}"))
        admin.dispose()


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


def no_connection_left(store: Any, engine: Engine) -> None:
    """Fail when a connection stays checked out of `store`'s pool (`engine`'s) once it stopped
    leading (a leader keeps one for its commits): one its keeper holds for a renewal is back
    within moments; one a test or the store leaked never is."""
    store.release_leadership()
    pool: Any = engine.pool
    wait_until(lambda: pool.checkedout() == 0, "every connection back in the pool", 10)


@pytest.fixture(scope="session")
def pg_pair() -> Iterator[PgPair]:
    """A PostgreSQL primary with a streaming replica of our own (tests/pgpair.py), built
    synchronous once per session and dropped at its end; `pg_pair.fresh(sync=...)` rebuilds it
    after a test crashed, stopped or promoted something. Where it cannot be built the test
    skips, except under `CRONOQ_REQUIRE_DIALECTS` (or CI): there it fails."""
    why = PgPair.unavailable()
    if why is not None:
        if _required():
            pytest.fail(f"no PostgreSQL primary/replica pair: {why}", pytrace=False)
        pytest.skip(f"no PostgreSQL primary/replica pair: {why}")
    pair = PgPair()
    try:
        pair.build(sync=True)
    except PgPairError as exc:
        pair.destroy()
        if _required():
            pytest.fail(f"could not build the PostgreSQL pair: {exc}", pytrace=False)
        pytest.skip(f"could not build the PostgreSQL pair: {exc}")
    try:
        yield pair
    finally:
        pair.destroy()
