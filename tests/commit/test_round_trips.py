"""A commit costs the same number of statements whatever its batch size (no statement per row).

Statements are counted at the driver (`cronoq_store.testing.statements`: a subclass of the
driver's cursor), so they are those of the path production runs: the DB-API cursor, and COPY
for PostgreSQL's inserts. A SQLAlchemy listener would see only SQLAlchemy's own executions.
(Not SQLite's `set_trace_callback`: it reports each row of an executemany, as SQLite steps the
statement once per row in the process, where a server takes the batch in one round trip.)
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import URL, event, text

import cronoq_store as cq
from cronoq_store.store import StoreConfig
from cronoq_store.testing.statements import after_statements

BASE = cq.TimeBase(unix_ns=1_700_000_000_000_000_000)


class Statements:
    """The statements this thread sends to the driver on connections it has checked out of
    `store`'s pool: not the keeper's renewals (another thread), nor what a connection runs
    before its checkout (a new connection's settings, an idle one's ping).

    MySQL's per-connection lock-wait setting is sent once for each pooled connection, not per
    commit, so it does not count.
    """

    def __init__(self, store: cq.SqlStore) -> None:
        self.seen: list[str] = []
        self.sql: list[str] = []
        self._mine = threading.local()
        thread = threading.get_ident()

        def checkout(*_args: Any) -> None:  # after the store's own (the ping)
            self._mine.on = threading.get_ident() == thread

        def checkin(*_args: Any) -> None:
            self._mine.on = False

        def hook(_cursor: Any, statement: str) -> None:
            if getattr(self._mine, "on", False) and not statement.startswith("SET SESSION"):
                self.seen.append(" ".join(statement.split()[:3]).upper())
                self.sql.append(statement)

        after_statements(store.engine, hook)
        event.listen(store.engine, "checkout", checkout)
        event.listen(store.engine, "checkin", checkin)

    def of(self, store: cq.SqlStore, *commit_args: Any) -> int:
        """How many statements `store.commit(*commit_args)` sends."""
        self.seen.clear()
        self.sql.clear()
        store.commit(*commit_args)
        return len(self.seen)


STATEMENTS = {"sqlite": (5, 4), "postgresql": (4, 5), "mysql": (4, 3)}
"""Statements a commit of submissions, then one of their transitions, sends to the driver:
SQLite's count has its BEGIN IMMEDIATE, PostgreSQL's (which inserts tasks and dependency rows
in one statement of arrays, no lookup first) its COMMIT, sent
in the last flight; the driver's own commit() is not counted."""


def test_statements_do_not_grow_with_batch_size(dialect: str, db_url: URL) -> None:
    """`STATEMENTS`, at every size. On PostgreSQL they are the same SQL at every size: ids go
    as one array, since psycopg parses a statement of more than 50 parameters anew each
    time."""
    with cq.SqlStore.open(db_url) as store:
        statements = Statements(store)
        epoch = store.acquire_leadership()
        counts = {}
        sql: dict[int, list[str]] = {}
        start = 0
        for size in (10, 200):
            ids = range(start, start + size)
            submits = [
                cq.Submitted(
                    id=cq.TaskId(i),
                    seq=i,
                    arrival=i,
                    spec=cq.TaskSpec(
                        payload=b"x",
                        key=f"k{i}",
                        deps=(cq.Dep(target=cq.ById(id=cq.TaskId(start))),),
                    ),
                )
                for i in ids
            ]
            done = [
                cq.StatusChanged(id=cq.TaskId(i), status=cq.TaskStatus.SUCCEEDED, attempt=1, at=i)
                for i in ids
            ]
            outputs = [(cq.TaskId(i), b"out") for i in ids]
            submitted = statements.of(store, epoch, BASE, submits)
            if dialect == "postgresql":  # the production path: arrays in the flight
                assert 'WITH "NEW" AS' in statements.seen, statements.seen
            submitted_sql = list(statements.sql)
            counts[size] = (submitted, statements.of(store, epoch, BASE, done, outputs))
            sql[size] = submitted_sql + statements.sql
            start += size
        assert counts[10] == counts[200] == STATEMENTS[dialect]
        if dialect == "postgresql":
            assert sql[10] == sql[200]
        store.release_leadership()


def test_a_connection_returned_inside_a_transaction_is_rolled_back(
    dialect: str, db_url: URL
) -> None:
    """A connection handed back to the store's pool in the middle of a transaction (a raw
    DB-API use) is rolled back: nothing it left open reaches the next user of the session."""
    with cq.SqlStore.open(db_url, StoreConfig(pool_size=1)) as store:
        raw = store.engine.raw_connection()
        cursor = raw.cursor()
        if dialect == "sqlite":  # its driver runs in autocommit mode under the store
            cursor.execute("BEGIN")
        cursor.execute("UPDATE cronoq_leader SET holder = 'left-open' WHERE id = 1")
        cursor.close()
        raw.close()  # back to the pool, uncommitted
        with store.engine.connect() as conn:  # the same session (pool_size=1)
            holder = conn.execute(text("SELECT holder FROM cronoq_leader WHERE id = 1")).scalar()
        assert holder is None


def test_a_committed_transaction_costs_no_rollback_on_return(dialect: str, db_url: URL) -> None:
    """PyMySQL sends ROLLBACK whether or not a transaction is open, so the pool's rollback of
    a connection coming back after a COMMIT was a fifth of a batch-1 commit's round trips.
    Counted by the server, in the one session the store's pool holds."""
    if dialect != "mysql":
        pytest.skip("psycopg and sqlite3 send nothing to roll back what is not open")
    config = StoreConfig(pool_size=1, lease_ttl=timedelta(minutes=1))
    with cq.SqlStore.open(db_url, config) as store:
        epoch = store.acquire_leadership()

        def rollbacks() -> int:
            with store.engine.connect() as conn:
                status = "SHOW SESSION STATUS LIKE 'Com_rollback'"
                return int(conn.exec_driver_sql(status).one()[1])

        before = rollbacks()
        for i in range(5):
            store.commit(
                epoch,
                BASE,
                [cq.Submitted(id=cq.TaskId(i), seq=i, arrival=i, spec=cq.TaskSpec(payload=b"x"))],
            )
        assert rollbacks() - before == 1  # the SHOW's own: SQLAlchemy ends its transaction
        store.release_leadership()


class SyncCounter:
    """A TCP proxy in front of PostgreSQL that counts the client's Sync and simple Query
    messages (every connection through it): each is answered by one ReadyForQuery, which
    the client waits for: a round trip. Connect without TLS (`sslmode=disable`)."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.syncs = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, frontend: bool) -> None:
        buffer = b""
        startup = True
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
                if not frontend:
                    continue
                buffer += data
                while True:
                    if startup:  # untyped: an SSL or GSS request, then the startup message
                        if len(buffer) < 8:
                            break
                        length, code = struct.unpack("!ii", buffer[:8])
                        startup = code in (80877103, 80877104)
                    elif len(buffer) < 5:
                        break
                    else:
                        kind, length = buffer[:1], struct.unpack("!i", buffer[1:5])[0] + 1
                        if len(buffer) >= length and kind in (b"S", b"Q"):
                            with self._lock:
                                self.syncs += 1
                    if len(buffer) < length:
                        break
                    buffer = buffer[length:]
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.listener.close()


@contextlib.contextmanager
def _through_counter(dialect: str, db_url: URL) -> Iterator[tuple[cq.SqlStore, SyncCounter]]:
    """A store (one pooled connection) whose every message to PostgreSQL passes the proxy."""
    if dialect != "postgresql":
        pytest.skip("psycopg's pipeline mode: PostgreSQL only")
    proxy = SyncCounter(db_url.host or "127.0.0.1", db_url.port or 5432)
    url = db_url.set(host="127.0.0.1", port=proxy.port).update_query_dict(
        {"sslmode": "disable", "gssencmode": "disable"}
    )
    config = StoreConfig(pool_size=1, lease_ttl=timedelta(minutes=1))
    try:
        with cq.SqlStore.open(url, config) as store:
            yield store, proxy
    finally:
        proxy.close()


def test_a_batch1_commit_of_a_new_task_is_one_round_trip(dialect: str, db_url: URL) -> None:
    """On PostgreSQL the transaction's bounds, the fence, the task with its dependency rows
    and the COMMIT leave in one pipelined flight: one round trip per commit (a fenced one
    still writes nothing: `test_lease`). Counted by a proxy between the store and the
    server, over commits back to back (no ping: the connection was used a moment ago)."""
    with _through_counter(dialect, db_url) as (store, proxy):
        epoch = store.acquire_leadership()
        spec = cq.TaskSpec(payload=b"x", deps=(cq.Dep(target=cq.ById(id=cq.TaskId(0))),))
        store.commit(epoch, BASE, [cq.Submitted(id=cq.TaskId(0), seq=0, arrival=0, spec=spec)])
        before = proxy.syncs
        for i in range(1, 6):
            store.commit(epoch, BASE, [cq.Submitted(id=cq.TaskId(i), seq=i, arrival=i, spec=spec)])
        round_trips = proxy.syncs - before
        store.release_leadership()
    assert round_trips == 5


def test_a_batch1_transition_costs_its_answers_and_no_more(dialect: str, db_url: URL) -> None:
    """A live transition waits for no answer (a guard behind its UPDATE fails the flight on
    a revival: `test_one_flight`), so on PostgreSQL the BEGIN with the bounds, the fence,
    the UPDATE and the COMMIT are one flight (the BEGIN is no round trip of its own:
    psycopg's would be); a finished task's dependency rows go with that COMMIT, not on
    their own. Counted by the
    proxy, as above, after one transition of each kind (a statement is prepared on its
    connection's first use of it)."""
    spec = cq.TaskSpec(payload=b"x", deps=(cq.Dep(target=cq.ById(id=cq.TaskId(0))),))
    counts: dict[cq.TaskStatus, list[int]] = {
        cq.TaskStatus.RUNNING: [],
        cq.TaskStatus.SUCCEEDED: [],
    }
    with _through_counter(dialect, db_url) as (store, proxy):
        epoch = store.acquire_leadership()
        subs = [cq.Submitted(id=cq.TaskId(i), seq=i, arrival=i, spec=spec) for i in range(1, 5)]
        store.commit(epoch, BASE, subs)
        for status, out in ((cq.TaskStatus.RUNNING, ()), (cq.TaskStatus.SUCCEEDED, (b"done",))):
            store.commit(
                epoch, BASE, [cq.StatusChanged(id=cq.TaskId(4), status=status, attempt=1, at=9)]
            )
            for i in range(1, 4):
                before = proxy.syncs
                store.commit(
                    epoch,
                    BASE,
                    [cq.StatusChanged(id=cq.TaskId(i), status=status, attempt=1, at=10)],
                    [(cq.TaskId(i), o) for o in out],
                )
                counts[status].append(proxy.syncs - before)
        with store.engine.connect() as conn:
            deps = conn.execute(text("SELECT count(*) FROM cronoq_task_deps")).scalar_one()
        store.release_leadership()
    assert counts == {cq.TaskStatus.RUNNING: [1, 1, 1], cq.TaskStatus.SUCCEEDED: [1, 1, 1]}
    assert deps == 0  # the finished tasks' dependency rows went with their COMMIT
