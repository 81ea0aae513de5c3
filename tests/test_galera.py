"""The store on a three-node MariaDB Galera cluster of its own (issue 27).

`scripts/galera` builds the cluster once for this module (own data directories under /tmp, own
ports, the nodes run as the mysql user; the shared server on 3306 is never touched) and removes
it afterwards, also when a test fails. Here:

- opens of one fresh database on all three nodes at once all succeed (several trials), leaving
  one schema at the head revision: `GET_LOCK` holds on one node only, so the migration lock on
  Galera is a row of its own that certification makes cluster-wide;
- a leader on node 1 SIGKILLed: a standby on node 2 takes over within the TTL plus a poll;
- node 1's server SIGKILLed under a connected leader: a standby on node 2 takes over once Galera
  has evicted the node (`evs.suspect_timeout`, 5 s) and the lease expired; no acknowledged id is
  lost.

Figures go to the terminal summary of test_failover.py (under "galera"). A cluster that cannot
be built skips with the reason, or fails where all dialects are required (CI).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import _required
from sqlalchemy import URL, create_engine, inspect, make_url, text
from test_failover import (  # the figures and their terminal summary are shared
    _figures,
    _seconds,
    _summary,  # noqa: F401  (autouse: registers the summary plugin for this module too)
    spawn,  # noqa: F401  (fixture)
)

from cronoq_store import migrate

pytestmark = pytest.mark.galera

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "galera"
BASE_PORT = int(os.environ.get("CRONOQ_GALERA_PORT", "13306"))
GCOMM_PORT = int(os.environ.get("CRONOQ_GALERA_GCOMM_PORT", "14567"))
SUSPECT_S = 5.0
"""Galera's default `evs.suspect_timeout`: how long the others wait before evicting a node."""
OPEN_TRIALS = 4
FIG = "galera"


@dataclass
class Cluster:
    """The running cluster: its directory (for the script) and the nodes' server URLs."""

    directory: Path
    urls: list[URL]

    def script(self, *args: str, timeout: float = 180.0) -> None:
        env = dict(os.environ, CRONOQ_GALERA_DIR=str(self.directory))
        subprocess.run([str(SCRIPT), *args], env=env, check=True, timeout=timeout)

    def pid(self, node: int) -> int:
        return int((self.directory / f"node{node}" / "mysqld.pid").read_text().strip())


def _unavailable(why: str) -> None:
    message = f"no Galera cluster: {why}"
    if _required():
        pytest.fail(f"{message} (all dialects are required here)", pytrace=False)
    pytest.skip(message)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT of a last run is fine
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """Three nodes, built and started once for the module, removed afterwards."""
    ports = [BASE_PORT + i for i in range(3)]
    ports += [GCOMM_PORT + 10 * i + j for i in range(3) for j in range(3)]
    busy = [p for p in ports if not _port_free(p)]
    if busy:
        _unavailable(f"ports in use: {busy} (set CRONOQ_GALERA_PORT / CRONOQ_GALERA_GCOMM_PORT)")
    if os.geteuid() != 0 and shutil.which("sudo") is None:
        _unavailable("the nodes run as the mysql user: run as root or with sudo")
    # Under /tmp itself: the mysql user must reach it (pytest's own tmp directories are 0700).
    directory = Path(tempfile.mkdtemp(prefix="cronoq-galera-", dir="/tmp")) / "cluster"
    directory.parent.chmod(0o755)
    env = dict(
        os.environ,
        CRONOQ_GALERA_DIR=str(directory),
        CRONOQ_GALERA_PORT=str(BASE_PORT),
        CRONOQ_GALERA_GCOMM_PORT=str(GCOMM_PORT),
    )
    began = time.monotonic()
    try:
        up = subprocess.run(
            [str(SCRIPT), "up"], env=env, capture_output=True, text=True, timeout=300
        )
        if up.returncode != 0:
            _unavailable(f"scripts/galera up failed:\n{up.stderr[-3000:]}")
        _figures(FIG)["cluster_start_s"] = round(time.monotonic() - began, 1)
        yield Cluster(
            directory,
            [make_url(f"mysql+pymysql://root@127.0.0.1:{p}/") for p in ports[:3]],
        )
    finally:
        subprocess.run([str(SCRIPT), "clean"], env=env, timeout=120, check=False)
        shutil.rmtree(directory.parent, ignore_errors=True)


@pytest.fixture
def database(cluster: Cluster) -> Iterator[list[URL]]:
    """A fresh database (created on node 1, replicated), its URL on each node; dropped after."""
    cluster.script("start")  # a node a test killed rejoins first
    name = f"cronoq_galera_{uuid.uuid4().hex[:12]}"
    admin = create_engine(cluster.urls[0], isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f"CREATE DATABASE {name} CHARACTER SET utf8mb4"))
        yield [u.set(database=name) for u in cluster.urls]
    finally:
        cluster.script("start")
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {name}"))
        admin.dispose()


# 1. A first open on several nodes at once.

_OPENER = """
import json, sys, time
from cronoq_store import SqlStore
url, start = sys.argv[1], float(sys.argv[2])
while time.time() < start:
    pass
try:
    SqlStore.open(url).close()
    print(json.dumps({"ok": True}))
except Exception as exc:
    print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))
"""


def _open_at_once(urls: list[URL]) -> list[dict[str, Any]]:
    """`SqlStore.open` of each URL in a process of its own, all released at the same instant."""
    start = time.time() + 1.5  # after every interpreter has imported the package
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _OPENER, u.render_as_string(hide_password=False), str(start)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for u in urls
    ]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_first_open_on_three_nodes_at_once(cluster: Cluster) -> None:
    began = time.monotonic()
    failures: list[str] = []
    for trial in range(OPEN_TRIALS):
        name = f"cronoq_galera_open_{uuid.uuid4().hex[:8]}"
        admin = create_engine(cluster.urls[0], isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                conn.execute(text(f"CREATE DATABASE {name} CHARACTER SET utf8mb4"))
            urls = [u.set(database=name) for u in cluster.urls]
            results = _open_at_once(urls)
            failures += [f"trial {trial}: {r['error']}" for r in results if not r["ok"]]
            for url in urls:  # every node sees one schema at the head, its lease row included
                engine = create_engine(url)
                try:
                    assert migrate.current_revision(engine) == migrate.head_revision()
                    names = set(inspect(engine).get_table_names())
                    assert {"cronoq_tasks", "cronoq_leader", "cronoq_inbox"} <= names
                    with engine.connect() as conn:
                        assert (
                            conn.execute(text("SELECT COUNT(*) FROM cronoq_leader")).scalar() == 1
                        )
                finally:
                    engine.dispose()
        finally:
            with admin.connect() as conn:
                conn.execute(text(f"DROP DATABASE IF EXISTS {name}"))
            admin.dispose()
    fig = _figures(FIG)
    fig["concurrent_first_opens"] = OPEN_TRIALS * 3
    fig["concurrent_first_opens_failed"] = len(failures)
    _seconds(FIG, f"first_open x{OPEN_TRIALS}", began)
    assert failures == []
