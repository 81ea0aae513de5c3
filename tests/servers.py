"""The test servers: where they are, a fresh database on one, and what the tests changed there.

Servers: `CRONOQ_TEST_POSTGRESQL_URL` (default postgres@127.0.0.1:5432) and
`CRONOQ_TEST_MYSQL_URL` (default root@127.0.0.1:3306). A server that cannot be reached skips its
tests with the reason, except when `required()` (`CRONOQ_REQUIRE_DIALECTS` or CI): then it is a
failure. conftest.py's fixtures stand on these; a test that needs a database of its own beside
the fixtures' one imports them from here (never from conftest).
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import URL, Connection, Engine, create_engine, make_url, text
from sqlalchemy.exc import OperationalError

SERVER_URLS = {
    "postgresql": os.environ.get(
        "CRONOQ_TEST_POSTGRESQL_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    ),
    "mysql": os.environ.get("CRONOQ_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/"),
}
SERVER_ENV = {"postgresql": "CRONOQ_TEST_POSTGRESQL_URL", "mysql": "CRONOQ_TEST_MYSQL_URL"}
DIALECTS = ("sqlite", "postgresql", "mysql")
MYSQL_PACKET = 64 * 1024 * 1024


def required() -> bool:
    """Whether every dialect must run (`CRONOQ_REQUIRE_DIALECTS` or CI): a server or cluster
    that is not there fails the test instead of skipping it."""
    return bool(os.environ.get("CRONOQ_REQUIRE_DIALECTS") or os.environ.get("CI"))


UNREACHABLE: dict[str, str] = {}
"""The servers found down this run, with why (said at the end of the run)."""
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


def admin_engine(dialect: str) -> Engine:
    """An engine on the server's maintenance database, or skip/fail when it is down."""
    if dialect in UNREACHABLE:
        _unavailable(dialect, UNREACHABLE[dialect])
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
        UNREACHABLE[dialect] = str(exc.orig).strip().splitlines()[0]
        _unavailable(dialect, UNREACHABLE[dialect])
    return engine


def _unavailable(dialect: str, why: str) -> None:
    message = f"{dialect} server unreachable at {make_url(SERVER_URLS[dialect])!r}: {why}"
    if required():
        pytest.fail(f"{message} (all dialects are required here)", pytrace=False)
    pytest.skip(message)


def new_database(dialect: str, tmp_path: Path) -> Iterator[URL]:
    """A fresh database of `dialect`, dropped afterwards (a file under `tmp_path` for SQLite)."""
    if dialect == "sqlite":
        yield make_url(f"sqlite:///{tmp_path / 'cronoq.db'}")
        return
    admin = admin_engine(dialect)
    charset = " CHARACTER SET utf8mb4" if dialect == "mysql" else ""
    try:
        with created(admin, dialect, "cronoq_test", charset) as name:
            yield make_url(SERVER_URLS[dialect]).set(database=name)
    finally:
        admin.dispose()


@contextlib.contextmanager
def created(admin: Engine, dialect: str, prefix: str, options: str = "") -> Iterator[str]:
    """A database of a fresh name (`prefix` and 12 hex digits) on `admin`'s server, created with
    `options`, and dropped afterwards: forced on PostgreSQL, so that a connection a failed test
    left open does not keep it."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f"CREATE DATABASE {name}{options}"))
        yield name
    finally:
        force = " WITH (FORCE)" if dialect == "postgresql" else ""
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {name}{force}"))


def free_port() -> int:
    """A loopback TCP port free now, for a server a test starts of its own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
