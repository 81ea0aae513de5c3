"""The test set-up says what it changes on a MariaDB server it did not start.

Both raise the global max_allowed_packet only above what it is (higher is harmless to anyone
else sharing the server) and put it back afterwards.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from builders import captured
from servers import SERVER_URLS, raise_mysql_packet
from sqlalchemy import Connection, create_engine, text

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.mysql


@pytest.fixture
def server() -> Iterator[tuple[Connection, int]]:
    """An autocommit connection to the MariaDB server and its packet size, restored after."""
    engine = create_engine(SERVER_URLS["mysql"], isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            have = int(conn.execute(text("SELECT @@GLOBAL.max_allowed_packet")).scalar_one())
            try:
                yield conn, have
            finally:
                conn.execute(text(f"SET GLOBAL max_allowed_packet = {have}"))
    finally:
        engine.dispose()


def _packet(conn: Connection) -> int:
    return int(conn.execute(text("SELECT @@GLOBAL.max_allowed_packet")).scalar_one())


def test_conftest_says_what_it_changed_and_never_lowers(server: tuple[Connection, int]) -> None:
    conn, have = server
    want = have + 1024
    assert raise_mysql_packet(conn, want) == (
        f"SET GLOBAL max_allowed_packet {have} -> {want} (until the server restarts)"
    )
    assert _packet(conn) == want
    assert raise_mysql_packet(conn, want) is None  # nothing to change: nothing said
    assert raise_mysql_packet(conn, have) is None  # never lowered
    assert _packet(conn) == want


@pytest.mark.skipif(shutil.which("mysql") is None, reason="needs the mysql client")
def test_test_servers_script_says_what_it_changed(server: tuple[Connection, int]) -> None:
    conn, have = server
    want = have + 2048
    env = {**os.environ, "CRONOQ_MYSQL_PACKET": str(want)}
    run = captured(
        [str(ROOT / "scripts" / "test-servers")],
        env=env,
        timeout=120,
        check=True,
    )
    assert (
        "test-servers: changed a MariaDB server this script did not start (127.0.0.1:3306): "
        f"SET GLOBAL max_allowed_packet {have} -> {want} (until it restarts)"
    ) in run.stdout, run.stdout + run.stderr
    assert _packet(conn) == want
    again = captured(
        [str(ROOT / "scripts" / "test-servers")],
        env=env,
        timeout=120,
        check=True,
    )
    assert "max_allowed_packet" not in again.stdout  # already enough: nothing changed or said
