"""Column capacity and fidelity on every dialect: big values, long keys, int64 extremes."""

from __future__ import annotations

import os
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, func, insert, select, text, update
from sqlalchemy.exc import IntegrityError, OperationalError

from cronoq_store import codec, migrate
from cronoq_store.errors import InvalidValue
from cronoq_store.model import INT64_MAX, INT64_MIN, FixedStart, TaskSpec, TimeBase
from cronoq_store.schema import tasks

MIB16 = 16 * 1024 * 1024
BASE = TimeBase(unix_ns=0)
MYSQL_URL = os.environ.get("CRONOQ_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/")
MYSQL_PACKET = 64 * 1024 * 1024


@pytest.fixture(scope="session")
def mysql_packet() -> None:
    """Raise MariaDB's max_allowed_packet (16 MiB by default) before the engine connects.

    A 16 MiB blob plus its statement does not fit the default; new connections pick up the
    global value. An unreachable server is left to the `engine` fixture to report.
    """
    admin = create_engine(MYSQL_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f"SET GLOBAL max_allowed_packet = {MYSQL_PACKET}"))
    except OperationalError:
        if os.environ.get("CRONOQ_REQUIRE_DIALECTS") or os.environ.get("CI"):
            raise
    finally:
        admin.dispose()


@pytest.fixture
def db(mysql_packet: None, engine: Engine) -> Engine:
    migrate.upgrade(engine)
    return engine


def row(task_id: int, spec: TaskSpec, **extra: Any) -> dict[str, Any]:
    values = codec.spec_columns(BASE, spec)
    values.update(
        id=task_id,
        seq=task_id,
        arrival_unix_ns=0,
        live_key=values["key"],
        status="queued",
        terminal=False,
        attempt=0,
        updated_unix_ns=0,
    )
    values.update(extra)
    return values


def put(engine: Engine, *rows: dict[str, Any]) -> None:
    with engine.begin() as conn:
        for values in rows:
            conn.execute(insert(tasks).values(**values))


def get(engine: Engine, task_id: int) -> Any:
    with engine.connect() as conn:
        return conn.execute(select(tasks).where(tasks.c.id == task_id)).mappings().one()


def test_16mib_payload_and_output(db: Engine) -> None:
    payload = bytes(range(256)) * (MIB16 // 256)
    output = b"\x00\xff" * (MIB16 // 2)
    put(db, row(1, TaskSpec(payload=payload)))
    # Separate statements: escaped, both blobs in one INSERT exceed a 64 MiB MariaDB packet.
    with db.begin() as conn:
        conn.execute(update(tasks).where(tasks.c.id == 1).values(output=output))
    got = get(db, 1)
    assert bytes(got["payload"]) == payload
    assert bytes(got["output"]) == output


def test_16mib_labels(db: Engine) -> None:
    labels = {"big": "é" * (MIB16 // 2), "small": "x"}
    cols = row(1, TaskSpec(payload=b"", labels=labels))
    assert len(cols["labels"]) >= MIB16 // 2
    put(db, cols)
    got = get(db, 1)
    assert got["labels"] == cols["labels"]
    assert codec.spec_from_columns(BASE, got).labels == labels


def test_longest_key(db: Engine) -> None:
    key = ("é🙂k" * codec.KEY_MAX)[: codec.KEY_MAX]
    assert len(key) == codec.KEY_MAX
    put(db, row(1, TaskSpec(payload=b"", key=key)))
    got = get(db, 1)
    assert got["key"] == key
    assert got["live_key"] == key
    assert codec.spec_from_columns(BASE, got).key == key


def test_key_too_long_refused() -> None:
    with pytest.raises(InvalidValue, match=r"TaskSpec\.key"):
        codec.bounded("TaskSpec.key", "k" * (codec.KEY_MAX + 1), codec.KEY_MAX)


def test_int64_extremes(db: Engine) -> None:
    spec_max = TaskSpec(
        payload=b"",
        deadline=INT64_MAX,
        fixed_start=FixedStart(at=INT64_MIN, tolerance_ns=INT64_MAX),
        duration_hint_ns=INT64_MAX,
        timeout_ns=INT64_MAX,
    )
    spec_min = TaskSpec(payload=b"", deadline=INT64_MIN, fixed_start=FixedStart(at=INT64_MAX))
    put(
        db,
        row(INT64_MIN, spec_max, seq=INT64_MIN, arrival_unix_ns=INT64_MAX, updated_unix_ns=0),
        row(INT64_MAX, spec_min, seq=INT64_MAX, arrival_unix_ns=INT64_MIN, updated_unix_ns=-1),
    )
    low, high = get(db, INT64_MIN), get(db, INT64_MAX)
    assert (low["id"], low["seq"], low["arrival_unix_ns"]) == (INT64_MIN, INT64_MIN, INT64_MAX)
    assert (high["id"], high["seq"], high["arrival_unix_ns"]) == (INT64_MAX, INT64_MAX, INT64_MIN)
    assert codec.spec_from_columns(BASE, low) == spec_max
    assert codec.spec_from_columns(BASE, high) == spec_min
    with db.connect() as conn:
        ids = conn.execute(select(tasks.c.id).order_by(tasks.c.id)).scalars().all()
    assert ids == [INT64_MIN, INT64_MAX]


def test_keys_compare_exactly(db: Engine) -> None:
    put(
        db,
        *(row(i, TaskSpec(payload=b"", key=k)) for i, k in enumerate(("a", "a ", "A"), start=1)),
    )
    with db.connect() as conn:
        found = conn.execute(select(tasks.c.id).where(tasks.c.key == "a")).scalars().all()
        live = conn.execute(
            select(func.count()).select_from(tasks).where(tasks.c.live_key.is_not(None))
        ).scalar_one()
        keys = {k for (k,) in conn.execute(select(tasks.c.live_key))}
    assert found == [1]
    assert live == 3
    assert keys == {"a", "a ", "A"}


def test_duplicate_live_key_refused(db: Engine) -> None:
    put(db, row(1, TaskSpec(payload=b"", key="dup")))
    with pytest.raises(IntegrityError):
        put(db, row(2, TaskSpec(payload=b"", key="dup")))
    # A finished task (live_key NULL) may share the key.
    put(db, row(3, TaskSpec(payload=b"", key="dup"), live_key=None, terminal=True))


def test_unclean_strings_come_back_replaced(db: Engine) -> None:
    dirty = "a\x00b\ud800c\udfff"
    spec = TaskSpec(payload=b"", kind=dirty, labels={dirty: dirty}, tags=frozenset({dirty}))
    put(db, row(1, spec))
    got = codec.spec_from_columns(BASE, get(db, 1))
    cleaned = "a\ufffdb\ufffdc\ufffd"
    assert got.kind == cleaned
    assert got.labels == {cleaned: cleaned}
    assert got.tags == {cleaned}
