"""One class per database, chosen once per engine: `dialects.dialect_of` and `class_of`.

What the store asks of a database is asked of the one instance its engine keeps, so it must
be the same object whichever handle (engine, connection, SQLAlchemy's dialect) asks; each URL
and driver must get its database's class; and a driver's capabilities (pipelines, COPY,
arrays) belong to the engine's driver, not to the database alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import Engine, create_engine, make_url
from sqlalchemy.engine.default import DefaultDialect
from sqlalchemy.ext.asyncio import create_async_engine

from cronoq_store import dialects
from cronoq_store.dialects import (
    Bounds,
    DefaultImpl,
    MySQLImpl,
    PostgresqlImpl,
    SQLiteImpl,
    class_of,
    dialect_of,
)
from cronoq_store.durability import classify

SYNC_URLS = {
    "sqlite+pysqlite:///:memory:": SQLiteImpl,
    "postgresql+psycopg://u@127.0.0.1:1/db": PostgresqlImpl,
    "mysql+pymysql://u@127.0.0.1:1/db": MySQLImpl,
    "mariadb+pymysql://u@127.0.0.1:1/db": MySQLImpl,
}
ASYNC_URLS = {
    "sqlite+aiosqlite:///:memory:": SQLiteImpl,
    "postgresql+psycopg_async://u@127.0.0.1:1/db": PostgresqlImpl,
    "mysql+asyncmy://u@127.0.0.1:1/db": MySQLImpl,
}
# Per driver: (pipelined, copies, binds_arrays). Only sync psycopg pipelines and COPYs;
# psycopg, sync or asyncio, binds an IN list as one array.
CAPABILITIES = {
    "sqlite+pysqlite:///:memory:": (False, False, False),
    "sqlite+aiosqlite:///:memory:": (False, False, False),
    "postgresql+psycopg://u@127.0.0.1:1/db": (True, True, True),
    "postgresql+psycopg_async://u@127.0.0.1:1/db": (False, False, True),
    "mysql+pymysql://u@127.0.0.1:1/db": (False, False, False),
    "mysql+asyncmy://u@127.0.0.1:1/db": (False, False, False),
}


def _engine(url: str) -> Engine:
    """An engine on `url` that has not connected (the sync face of an asyncio one)."""
    if url in ASYNC_URLS:
        return create_async_engine(url).sync_engine
    return create_engine(url)


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.dispose()


@pytest.mark.parametrize("url", [*SYNC_URLS, *ASYNC_URLS])
def test_each_url_gets_its_database_class(url: str, engines: list[Engine]) -> None:
    expected = {**SYNC_URLS, **ASYNC_URLS}[url]
    engine = _engine(url)
    engines.append(engine)
    assert class_of(make_url(url)) is expected
    assert type(dialect_of(engine)) is expected
    assert dialect_of(engine).dialect is engine.dialect


@pytest.mark.parametrize(
    ("backend", "expected"),
    [
        ("sqlite", SQLiteImpl),
        ("postgresql", PostgresqlImpl),
        ("mysql", MySQLImpl),
        ("mariadb", MySQLImpl),
    ],
)
def test_class_of_a_backend_name(backend: str, expected: type[DefaultImpl]) -> None:
    assert class_of(backend) is expected
    assert expected.name == ("mysql" if backend == "mariadb" else backend)


def test_an_unknown_database_gets_the_default_class() -> None:
    """No subclass speaks for it: the default's generic behaviour, never another database's."""
    assert class_of("oracle") is DefaultImpl
    assert class_of(make_url("oracle://u@h/db")) is DefaultImpl
    oracle = DefaultDialect()
    oracle.name = "oracle"
    impl = dialect_of(oracle)
    assert dialect_of(oracle) is impl
    assert type(impl) is DefaultImpl
    assert (impl.pipelined, impl.copies, impl.binds_arrays) == (False, False, False)
    assert impl.streaming_cursor(object()) is None
    assert impl.interrupter(object()) is None
    assert not impl.bounds_idle()
    with pytest.raises(NotImplementedError):
        impl.copy_rows(object(), "COPY t FROM STDIN", [], lambda row: row)
    durability = classify("oracle", {"fsync": "off"})
    assert durability.safe
    assert durability.acknowledged == "unknown for this dialect"


def test_one_instance_per_engine(engines: list[Engine]) -> None:
    """The engine, its connections and its SQLAlchemy dialect all reach the same instance;
    another engine on the same URL has its own."""
    first = create_engine("sqlite+pysqlite:///:memory:")
    second = create_engine("sqlite+pysqlite:///:memory:")
    engines.extend([first, second])
    impl = dialect_of(first)
    assert dialect_of(first) is impl
    assert dialect_of(first.dialect) is impl
    with first.connect() as conn:
        assert dialect_of(conn) is impl
    with first.connect() as conn:
        assert dialect_of(conn) is impl
    assert dialect_of(second) is not impl
    assert type(dialect_of(second)) is SQLiteImpl


@pytest.mark.parametrize("url", list(CAPABILITIES))
def test_driver_capabilities_per_engine(url: str, engines: list[Engine]) -> None:
    engine = _engine(url)
    engines.append(engine)
    impl = dialect_of(engine)
    assert (impl.pipelined, impl.copies, impl.binds_arrays) == CAPABILITIES[url]


@pytest.mark.parametrize("url", list(CAPABILITIES))
def test_driver_hooks_only_for_sync_drivers(url: str, engines: list[Engine]) -> None:
    """`testing.statements` hooks the sync drivers' classes; an asyncio driver has none."""
    engine = _engine(url)
    engines.append(engine)
    hooked = dialect_of(engine).hook_cursors(engine, lambda cls: cls)
    assert hooked == (url not in ASYNC_URLS)


def test_server_and_file() -> None:
    assert not class_of("sqlite").server
    assert class_of("postgresql").server
    assert class_of("mariadb").server


@pytest.mark.parametrize(
    ("mariadb", "version", "expected"),
    [(True, (10, 3, 0), True), (True, (10, 2, 9), False), (False, (8, 0, 36), False)],
)
def test_idle_bound_on_mariadb_10_3_only(
    mariadb: bool, version: tuple[int, ...], expected: bool, engines: list[Engine]
) -> None:
    engine = create_engine("mysql+pymysql://u@127.0.0.1:1/db")
    engines.append(engine)
    engine.dialect.is_mariadb = mariadb
    engine.dialect.server_version_info = version
    assert dialects.idle_bound_supported(engine.dialect) is expected
    assert dialects.idle_bound_supported(create_engine("sqlite://").dialect) is False


def test_postgresql_bounds_deferred_in_one_statement(engines: list[Engine]) -> None:
    """`bound(defer=True)` hands back one SELECT carrying every transaction-local setting."""
    engine = create_engine("postgresql+psycopg://u@127.0.0.1:1/db")
    engines.append(engine)
    impl = dialect_of(engine)
    bounds = Bounds(
        idle=timedelta(seconds=2),
        timeout=timedelta(milliseconds=1500),
        lock=timedelta(milliseconds=500),
    )
    deferred = impl.bound(
        None,  # type: ignore[arg-type]  # deferred: the connection is never used
        bounds,
        defer=True,
    )
    assert deferred is not None
    _stmt, params = deferred
    assert params == {
        "n0": "idle_in_transaction_session_timeout",
        "v0": "2000",
        "n1": "statement_timeout",
        "v1": "1500",
        "n2": "lock_timeout",
        "v2": "500",
    }


@pytest.mark.parametrize(
    ("backend", "async_driver", "sync_drivers"),
    [
        ("sqlite", "aiosqlite", {"pysqlite"}),
        ("postgresql", "psycopg", {"psycopg", "psycopg2"}),
        ("mysql", "asyncmy", {"pymysql"}),
        ("mariadb", "asyncmy", {"pymysql"}),
        ("oracle", None, set()),
    ],
)
def test_each_class_names_its_drivers(
    backend: str, async_driver: str | None, sync_drivers: set[str]
) -> None:
    """The async driver a sync URL is mapped to (`aio.async_url`) is its database class's."""
    impl = class_of(backend)
    assert impl.async_driver == async_driver
    assert impl.sync_drivers == sync_drivers


@pytest.mark.parametrize(
    ("url", "wire", "port", "plaintext"),
    [
        ("sqlite:///x.db", None, None, {}),
        ("postgresql+psycopg://u@h/d", "postgresql", 5432, {"sslmode": "disable"}),
        ("mysql+pymysql://u@h/d", "mysql", 3306, {}),
        ("mariadb+pymysql://u@h/d", "mysql", 3306, {}),
    ],
)
def test_each_class_says_its_wire(
    url: str, wire: str | None, port: int | None, plaintext: dict[str, str]
) -> None:
    """The latency proxy reads a server's protocol, port and plaintext options off its class."""
    impl = class_of(make_url(url))
    assert impl.wire == wire
    assert impl.default_port == port
    assert plaintext.items() <= dict(impl.plaintext_query).items()


def test_each_class_says_its_upkeep_and_plans() -> None:
    """The planner's JSON plan, statistics and checkpoint statements, by database."""
    assert SQLiteImpl.explain_json is None and SQLiteImpl.analyze_sql is None
    assert SQLiteImpl.checkpoint_sql == "PRAGMA wal_checkpoint(TRUNCATE)"
    assert PostgresqlImpl.explain_json == "EXPLAIN (FORMAT JSON)"
    assert PostgresqlImpl.analyze_sql == "VACUUM ANALYZE"
    assert PostgresqlImpl.checkpoint_sql == "CHECKPOINT"
    assert MySQLImpl.explain_json == "EXPLAIN FORMAT=JSON"
    assert MySQLImpl.analyze_sql == "ANALYZE TABLE"
    assert MySQLImpl.checkpoint_sql is None


@pytest.mark.parametrize(
    ("url", "label"),
    [
        ("sqlite://", "sqlite"),
        ("postgresql+psycopg://u@h/d", "postgresql"),
        ("mysql+pymysql://u@h/d", "mysql"),
        ("mariadb+pymysql://u@h/d", "mariadb"),
    ],
)
def test_server_name_calls_mariadb_by_its_name(url: str, label: str) -> None:
    """Labels say MariaDB where MySQL's dialect speaks to it."""
    engine = create_engine(url)
    try:
        assert dialect_of(engine).server_name() == label
    finally:
        engine.dispose()


def test_explain_compiles_with_its_class_prefix() -> None:
    """`operators.Explain` is one compile rule: the class's `explain_json`, or none."""
    from sqlalchemy import select
    from sqlalchemy.dialects import mysql, postgresql, sqlite
    from sqlalchemy.exc import CompileError

    from cronoq_store.repository.operators import Explain
    from cronoq_store.schema import tasks

    explain = Explain(select(tasks.c.id))
    assert str(explain.compile(dialect=postgresql.dialect())).startswith("EXPLAIN (FORMAT JSON) ")
    assert str(explain.compile(dialect=mysql.dialect())).startswith("EXPLAIN FORMAT=JSON SELECT")
    with pytest.raises(CompileError):
        explain.compile(dialect=sqlite.dialect())
