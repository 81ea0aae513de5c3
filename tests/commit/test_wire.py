"""`wire`: a flight on psycopg's libpq connection answers as psycopg's cursors would, prepares
each statement once where the store owns the connection, and recovers from a server that
lost its prepared statements."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from builders import BASE
from sqlalchemy import URL, text

from cronoq_store import SqlStore, StoreConfig, TaskId, TaskSpec
from cronoq_store.model import Submitted

pytestmark = pytest.mark.postgresql

FLIGHT: list[tuple[str, Any, bool]] = [
    ("BEGIN", None, False),
    ("CREATE TEMP TABLE t (a int, b bytea, c text) ON COMMIT DROP", None, False),
    (
        "INSERT INTO t VALUES (%(a)s, %(b)s, %(c)s)",
        [{"a": 1, "b": b"\x00x", "c": "%"}, {"a": 2, "b": None, "c": "é"}],
        True,
    ),
    ("UPDATE t SET c = %s WHERE a > %s", ("z", 0), False),
    ("SELECT a, b, c, 'a%%b' FROM t ORDER BY a", None, False),
    ("COMMIT", None, False),
]


@pytest.fixture
def conn(db_url: URL) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(db_url.set(drivername="postgresql").render_as_string(False)) as c:
        yield c


def _by_cursors(conn: psycopg.Connection[Any]) -> list[tuple[int, list[Any]]]:
    out = []
    with conn.cursor() as cur:
        for sql, params, many in FLIGHT[1:-1]:
            if many:
                cur.executemany(sql, params)
            else:
                cur.execute(sql, params)
            out.append((cur.rowcount, cur.fetchall() if cur.description else []))
    conn.rollback()
    return out


@pytest.mark.parametrize("dialect", ["postgresql"], indirect=True)
@pytest.mark.parametrize("prepared", [False, True])
def test_a_flight_answers_as_cursors_do(conn: psycopg.Connection[Any], prepared: bool) -> None:
    """Rowcounts (an executemany's total) and rows, `%%` and both placeholder styles, bytes,
    NULL and text alike; prepared or not, twice over (the second time from the cache)."""
    from cronoq_store import wire

    if prepared:
        wire.prepare_on(conn)
    expected = [(-1, []), *_by_cursors(conn), (-1, [])]
    for _ in range(2):
        assert wire.run(conn, FLIGHT) == expected
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    names = conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()
    conn.rollback()
    # Each statement with parameters, once per set of parameter types (a NULL has its own).
    assert names == ((3,) if prepared else (0,))


@pytest.mark.parametrize("dialect", ["postgresql"], indirect=True)
def test_a_failed_statement_is_named_and_the_rest_skipped(conn: psycopg.Connection[Any]) -> None:
    from cronoq_store import wire

    flight = [
        ("BEGIN", None, False),
        ("CREATE TEMP TABLE u (a int)", None, False),
        ("SELECT 1 / %(zero)s", {"zero": 0}, False),
        ("INSERT INTO u VALUES (1)", None, False),
        ("COMMIT", None, False),
    ]
    with pytest.raises(wire.Failed) as failed:
        wire.run(conn, flight)
    assert failed.value.index == 2
    assert isinstance(failed.value.error, psycopg.errors.DivisionByZero)
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INERROR
    conn.rollback()
    # Nothing of it stayed, and the connection goes on.
    assert conn.execute("SELECT to_regclass('pg_temp.u')").fetchone() == (None,)
    with pytest.raises(wire.Failed) as alone:
        wire.run(conn, [("SELECT no_such_function()", None, False)], pipeline=False)
    assert alone.value.index == 0
    conn.rollback()
    assert wire.run(conn, [("SELECT 7", None, False)], pipeline=False) == [(1, [(7,)])]


@pytest.mark.parametrize("dialect", ["postgresql"], indirect=True)
def test_a_lost_connection_is_closed_for_the_pool(
    conn: psycopg.Connection[Any], db_url: URL
) -> None:
    """A flight whose session the server ends leaves the connection closed (answers unread in
    pipeline mode: nothing could use it), which the pool's disconnect check drops."""
    from cronoq_store import wire

    pid = conn.info.backend_pid
    with psycopg.connect(db_url.set(drivername="postgresql").render_as_string(False)) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    with pytest.raises(psycopg.OperationalError):
        wire.run(conn, [("BEGIN", None, False), ("SELECT 1", None, False)])
    assert conn.closed


@pytest.mark.parametrize("dialect", ["postgresql"], indirect=True)
@pytest.mark.parametrize("how", ["DISCARD ALL", "psycopg's ROLLBACK"])
def test_statements_lost_by_the_server_are_prepared_again(db_url: URL, how: str) -> None:
    """A store's commits prepare their statements once per connection. Where the server lost
    them (psycopg deallocates every prepared statement after a ROLLBACK when it had prepared
    any of its own; a DISCARD ALL), the next commit's flight fails before it wrote anything,
    and is sent once more: every commit lands, each statement prepared again."""
    config = StoreConfig(pool_size=1, lease_ttl=timedelta(minutes=1))
    with SqlStore.open(db_url, config) as store:
        epoch = store.acquire_leadership()

        def submit(i: int) -> None:
            task = Submitted(id=TaskId(i), seq=i, arrival=i, spec=TaskSpec(payload=b"x"))
            store.commit(epoch, BASE, [task])

        def prepared() -> set[str]:
            """The texts of the statements the store prepared on its connection (by text: a
            statement prepared again may get another name)."""
            with store.engine.connect() as c:
                sql = text("SELECT name, statement FROM pg_prepared_statements")
                return {s for n, s in c.execute(sql) if n.startswith("cronoq_")}

        leases = prepared()  # the take's own flight
        submit(1)
        submit(2)
        ours = prepared() - leases
        assert len(ours) >= 3
        with store.engine.connect() as c:  # the pool's one connection: the commits' own
            if how == "DISCARD ALL":
                c.commit()
                c.connection.driver_connection.autocommit = True  # type: ignore[union-attr]
                c.exec_driver_sql("DISCARD ALL")
                c.connection.driver_connection.autocommit = False  # type: ignore[union-attr]
            else:
                for _ in range(6):  # psycopg prepares it on the 5th execution
                    c.execute(text("SELECT count(*) FROM cronoq_tasks"))
                c.rollback()  # psycopg: DEALLOCATE ALL
        assert not prepared()
        for i in range(3, 6):
            submit(i)
        assert prepared() == ours
        with store.engine.connect() as c:
            stored = c.execute(text("SELECT id FROM cronoq_tasks ORDER BY id")).scalars().all()
        store.release_leadership()
    assert stored == [1, 2, 3, 4, 5]
