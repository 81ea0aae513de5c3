"""Round trips per operation, pinned by count on every dialect (issue 41): what
`cronoq-store bench --rtt` reports, counted, never timed.

Counted by the latency proxy (`cronoq_store.bench.proxy`, no delay) on both servers.
PostgreSQL: the client's Sync and simple Query messages, each answered by one ReadyForQuery it
waits for. MariaDB: the client's command packets (COM_QUERY and the like), each answered
before the next. Not the server's `Questions`: it counts each statement of a multi-statement
packet (measured on MariaDB 10.11: a packet of `SELECT 1; SELECT 2; UPDATE ...` adds 3),
where the store's flights send a commit's statements in one packet (`execution.Flight`,
batched). SQLite has no wire: its statements are pinned by `tests/test_round_trips.py` and
the kit's statement tests.

The lease's and the open's counts are exact (a change either way should be seen and the
table updated); the commit's and the enqueue's are ceilings, their own work elsewhere.
"""

from __future__ import annotations

import json
import socket
import statistics
import threading

import pytest
from click.testing import CliRunner
from sqlalchemy import URL

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
        TRANSITION: 1,  # a guard behind the live UPDATE fails the packet on a revival
        SUBMISSION: 1,
        B100: 3,
        ACQUIRE: 3,
        RELEASE: 1,
        OPEN: 13,
        ENQUEUE: 2,
        RENEWAL: 1,
    },
}
"""Round trips of each operation (`cronoq_store.bench.rtt.OPERATIONS`), per dialect."""


@pytest.fixture
def tally(dialect: str, db_url: URL) -> dict[str, list[int]]:
    """The round trips of each operation, `REPEATS` times each, on a database at head."""
    if dialect == "sqlite":
        pytest.skip("SQLite has no wire: no round trips (its statements: test_round_trips)")
    SqlStore.open(db_url, CONFIG).close()  # migrated, so `open` finds it at head
    with proxied_url(db_url, delay=0) as (url, proxy):
        side = Tally(proxy, 0)
        store_round_trips(url, side, repeats=REPEATS)
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
