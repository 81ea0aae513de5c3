"""Round trips per operation, pinned by count on every dialect (issue 41): what
`cronoq-store bench --rtt` reports, counted, never timed.

PostgreSQL: counted by the latency proxy (`cronoq_store.bench.proxy`, no delay), the client's
Sync and simple Query messages, each answered by one ReadyForQuery it waits for. MariaDB: by
the server, its session `Questions` counter on every connection the operation used. SQLite
has no wire: its statements are pinned by `tests/test_round_trips.py` and the kit's
statement tests.

The lease's and the open's counts are exact (a change either way should be seen and the
table updated); the commit's and the enqueue's are ceilings, their own work elsewhere.
"""

from __future__ import annotations

import json
import socket
import statistics
import threading
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import URL, event
from sqlalchemy.pool import Pool

from cronoq_store import SqlStore
from cronoq_store.bench import bench
from cronoq_store.bench.proxy import Proxy, proxied_url
from cronoq_store.bench.rtt import CONFIG, OPERATIONS, Tally, store_round_trips

(TRANSITION, SUBMISSION, B100, ACQUIRE, RELEASE, OPEN, ENQUEUE, RENEWAL) = OPERATIONS

REPEATS = 5
"""Runs of each operation; the median is pinned. A connection's first runs of a statement
cost one more now and then (psycopg prepares it on its fifth, MySQL's lock bound is set once
per session): the steady state is what a running store pays."""

EXACT = (ACQUIRE, RELEASE, OPEN, RENEWAL)
"""Operations pinned exactly; the others at most their figure."""

ROUND_TRIPS: dict[str, dict[str, int]] = {
    "postgresql": {
        TRANSITION: 1,
        SUBMISSION: 1,
        B100: 1,
        ACQUIRE: 2,
        RELEASE: 1,
        OPEN: 8,
        ENQUEUE: 2,  # the app's BEGIN rides with the INSERT; its COMMIT
        RENEWAL: 1,
    },
    "mysql": {
        TRANSITION: 3,
        SUBMISSION: 3,
        B100: 4,
        ACQUIRE: 10,
        RELEASE: 2,
        OPEN: 14,
        ENQUEUE: 2,
        RENEWAL: 2,
    },
}
"""Round trips of each operation (`cronoq_store.bench.rtt.OPERATIONS`), per dialect."""


class Questions:
    """MariaDB's own count of the statements clients sent (`Questions`), summed over every
    session the pool opened since `start`; the reads of it are taken off."""

    def __init__(self) -> None:
        self.connections: list[Any] = []
        self.last: dict[int, int] = {}
        self.reads: dict[int, int] = {}

    def connected(self, dbapi_conn: Any, _record: Any) -> None:
        self.connections.append(dbapi_conn)

    @property
    def count(self) -> int:
        for conn in self.connections:
            if not conn.open:
                continue  # closed: its last reading stands
            key = id(conn)
            with conn.cursor() as cursor:
                cursor.execute("SHOW SESSION STATUS LIKE 'Questions'")
                questions = int(cursor.fetchone()[1])
            self.reads[key] = self.reads.get(key, 0) + 1
            self.last[key] = questions - self.reads[key]  # each SHOW counts itself
        return sum(self.last.values())


@pytest.fixture
def tally(dialect: str, db_url: URL) -> dict[str, list[int]]:
    """The round trips of each operation, `REPEATS` times each, on a database at head."""
    if dialect == "sqlite":
        pytest.skip("SQLite has no wire: no round trips (its statements: test_round_trips)")
    SqlStore.open(db_url, CONFIG).close()  # migrated, so `open` finds it at head
    if dialect == "postgresql":
        with proxied_url(db_url, delay=0) as (url, proxy):
            side = Tally(proxy, 0)
            store_round_trips(url, side, repeats=REPEATS)
    else:
        questions = Questions()
        event.listen(Pool, "connect", questions.connected)
        try:
            side = Tally(questions, 0)
            store_round_trips(db_url, side, repeats=REPEATS)
        finally:
            event.remove(Pool, "connect", questions.connected)
    return side.counts


def test_round_trips_per_operation(dialect: str, tally: dict[str, list[int]]) -> None:
    """Each operation costs `ROUND_TRIPS` (exactly for `EXACT`, at most for the others), in
    the median of its runs."""
    pinned = ROUND_TRIPS[dialect]
    seen = {op: statistics.median(tally[op]) for op in OPERATIONS}
    wrong = [
        op
        for op in OPERATIONS
        if (seen[op] != pinned[op] if op in EXACT else seen[op] > pinned[op])
    ]
    assert not wrong, f"round trips {seen} ({tally}), pinned {pinned}"


def test_the_proxy_delivers_every_chunk_in_order_both_ways() -> None:
    """Chunks held for the delay leave in the order they came, whatever their sizes: an echo
    server behind the proxy hands back exactly what was sent."""
    server = socket.create_server(("127.0.0.1", 0))

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(4096):
                conn.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    sent = b"".join(bytes([i % 251]) * (1 + i * 37 % 3000) for i in range(300))
    with Proxy(server.getsockname(), delay=0.002) as proxy:
        client = socket.create_connection(("127.0.0.1", proxy.port))
        with client:
            for start in range(0, len(sent), 1000):
                client.sendall(sent[start : start + 1000])
            client.shutdown(socket.SHUT_WR)
            received = b""
            while data := client.recv(65536):
                received += data
        assert proxy.connections == 1
    server.close()
    assert received == sent


def test_bench_rtt_reports_every_operation_beside_the_raw_driver(dialect: str, db_url: URL) -> None:
    """`cronoq-store bench --rtt MS`: each operation's round trips, the store's and the raw
    driver's (a hand-written client of the same work; the app's enqueue its own BEGIN,
    INSERT, COMMIT), from a run behind the proxy."""
    if dialect == "sqlite":
        pytest.skip("SQLite has no wire: --rtt skips it")
    url = db_url.render_as_string(hide_password=False)
    result = CliRunner().invoke(bench, ["--url", url, "--rtt", "1", "--runs", "1", "--json"])
    assert result.exit_code == 0, result.output
    [measured] = json.loads(result.stdout)
    figures = {f["operation"]: f for f in measured["figures"]}
    assert list(figures) == list(OPERATIONS)
    assert figures[SUBMISSION]["raw"] == (1 if dialect == "postgresql" else 2)
    assert figures[ENQUEUE]["raw"] == (3 if dialect == "postgresql" else 2)
    assert all(f["store"] >= 1 and f["store_rtts"] > 0 for f in figures.values())
