"""An app's `enqueue` in its own transaction costs the app no round trip of its own.

Counted, never timed: on PostgreSQL by a proxy that counts the client's Sync and Query
messages (`test_round_trips.SyncCounter`: each waits for its ReadyForQuery), on MariaDB by
the server's own count of statements (`Questions`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import URL, Connection, create_engine
from test_round_trips import SyncCounter

from cronoq_store import SqlStore, TaskSpec, enqueue, enqueue_many

SPEC = TaskSpec(payload=b"x" * 100, kind="job")
WARM = 6
"""Transactions run before counting: psycopg prepares a statement on its fifth use."""


def _app_insert(conn: Connection) -> None:
    conn.exec_driver_sql("INSERT INTO app_rows (v) VALUES (1)")


def _counts(
    conn: Connection, count: Callable[[], int], bodies: dict[str, Callable[[Connection], Any]]
) -> dict[str, list[int]]:
    """Round trips of each body's transaction (begin, body, commit), three times each."""
    conn.exec_driver_sql(
        "CREATE TABLE app_rows (id INTEGER PRIMARY KEY AUTO_INCREMENT, v INT)"
        if conn.dialect.name == "mysql"
        else "CREATE TABLE app_rows (id serial PRIMARY KEY, v int)"
    )
    conn.commit()
    found: dict[str, list[int]] = {}
    for name, body in bodies.items():
        for _ in range(WARM):
            conn.begin()
            body(conn)
            conn.commit()
        found[name] = []
        for _ in range(3):
            before = count()
            conn.begin()
            body(conn)
            conn.commit()
            found[name].append(count() - before)
    return found


BODIES: dict[str, Callable[[Connection], Any]] = {
    "app": _app_insert,
    "enqueue": lambda conn: enqueue(conn, SPEC),
    "enqueue, then app": lambda conn: (enqueue(conn, SPEC), _app_insert(conn)),
    "enqueue_many, then app": lambda conn: (enqueue_many(conn, [SPEC] * 3), _app_insert(conn)),
}


def test_an_enqueue_that_opens_the_transaction_rides_its_begin(dialect: str, db_url: URL) -> None:
    """PostgreSQL: psycopg sends its BEGIN as a round trip of its own; an enqueue that opens
    the app's transaction sends it in the same flight as its INSERT, so the app's
    BEGIN/INSERT/COMMIT with an enqueue (or an enqueue_many) costs what it costs without
    (3), and a transaction of an enqueue alone 2."""
    if dialect != "postgresql":
        pytest.skip("psycopg's BEGIN: PostgreSQL")
    SqlStore.open(db_url).close()  # the tables
    proxy = SyncCounter(db_url.host or "127.0.0.1", db_url.port or 5432)
    url = db_url.set(host="127.0.0.1", port=proxy.port).update_query_dict(
        {"sslmode": "disable", "gssencmode": "disable"}
    )
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            counts = _counts(conn, lambda: proxy.syncs, BODIES)
    finally:
        engine.dispose()
        proxy.close()
    assert counts == {
        "app": [3, 3, 3],
        "enqueue": [2, 2, 2],
        "enqueue, then app": [3, 3, 3],
        "enqueue_many, then app": [3, 3, 3],
    }


def test_an_enqueue_is_one_statement_on_mariadb(dialect: str, db_url: URL) -> None:
    """MariaDB: an enqueue is its INSERT alone (the id comes with its answer), counted by
    the server: the transaction of an enqueue costs what the app's own INSERT + COMMIT
    does."""
    if dialect != "mysql":
        pytest.skip("the server's Questions: MariaDB")
    SqlStore.open(db_url).close()
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:

            def questions() -> int:
                """The session's statements so far, on the driver's cursor (no SQLAlchemy
                transaction begins), this SHOW not counted."""
                cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
                cursor.execute("SHOW SESSION STATUS LIKE 'Questions'")
                seen = int(cursor.fetchone()[1]) - 1
                cursor.close()
                return seen

            counts = _counts(conn, questions, BODIES)
    finally:
        engine.dispose()
    # INSERT, COMMIT and one SHOW: an enqueue is one statement, as the app's INSERT is
    assert counts == {
        "app": [3, 3, 3],
        "enqueue": [3, 3, 3],
        "enqueue, then app": [4, 4, 4],
        "enqueue_many, then app": [4, 4, 4],
    }


@pytest.mark.parametrize("isolation", ["SERIALIZABLE", "REPEATABLE READ"])
def test_an_opening_enqueue_keeps_the_apps_isolation_level(
    dialect: str, db_url: URL, isolation: str
) -> None:
    """An app engine with its own isolation level: the enqueue that opens the transaction
    leaves the BEGIN to psycopg, which carries that level (a plain BEGIN would not)."""
    if dialect != "postgresql":
        pytest.skip("psycopg's BEGIN: PostgreSQL")
    SqlStore.open(db_url).close()
    engine = create_engine(db_url, isolation_level=isolation)
    try:
        with engine.connect() as conn:
            conn.begin()
            enqueue(conn, SPEC)
            level = conn.exec_driver_sql("SHOW transaction_isolation").scalar_one()
            conn.commit()
    finally:
        engine.dispose()
    assert level == isolation.lower()


def test_an_enqueue_on_an_engine_is_one_round_trip(dialect: str, db_url: URL) -> None:
    """PostgreSQL: an enqueue given an `Engine` (no transaction of the app's) is one
    autocommit statement, atomic by itself: one round trip, as a peer's job is, where BEGIN,
    INSERT, COMMIT took three."""
    if dialect != "postgresql":
        pytest.skip("psycopg's autocommit: PostgreSQL")
    SqlStore.open(db_url).close()
    proxy = SyncCounter(db_url.host or "127.0.0.1", db_url.port or 5432)
    url = db_url.set(host="127.0.0.1", port=proxy.port).update_query_dict(
        {"sslmode": "disable", "gssencmode": "disable"}
    )
    engine = create_engine(url, pool_size=1)
    specs = [SPEC] * 3
    calls: dict[str, Callable[[], Any]] = {
        "enqueue": lambda: enqueue(engine, SPEC),
        "enqueue_many": lambda: enqueue_many(engine, specs),
        "enqueue, not notifying": lambda: enqueue(engine, SPEC, notify=False),
    }
    found: dict[str, list[int]] = {}
    try:
        for name, call in calls.items():
            for _ in range(WARM):
                call()
            found[name] = []
            for _ in range(3):
                before = proxy.syncs
                call()
                found[name].append(proxy.syncs - before)
    finally:
        engine.dispose()
        proxy.close()
    assert found == {name: [1, 1, 1] for name in calls}


def test_an_enqueue_on_an_engine_prepares_anew_what_the_server_lost(
    dialect: str, db_url: URL
) -> None:
    """PostgreSQL: an enqueue on an `Engine` prepares its INSERT on the pooled connection;
    where the server has since dropped it (an app's DEALLOCATE ALL, psycopg's after a
    rollback), the statement, which ran nowhere, is prepared and sent again."""
    if dialect != "postgresql":
        pytest.skip("prepared statements: PostgreSQL")
    SqlStore.open(db_url).close()
    engine = create_engine(db_url, pool_size=1)
    try:
        first = enqueue(engine, SPEC)
        many = enqueue_many(engine, [SPEC] * 2)
        with engine.connect() as conn:
            conn.exec_driver_sql("DEALLOCATE ALL")
            conn.commit()
        again = enqueue(engine, SPEC)
        more = enqueue_many(engine, [SPEC] * 2)
    finally:
        engine.dispose()
    with SqlStore.open(db_url) as store:
        assert [i.inbox_id for i in store.read_inbox()] == [first, *many, again, *more]
