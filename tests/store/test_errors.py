"""Error mapping: what is worth retrying is StoreUnavailable, no message carries a password, and
no error the store raises carries task data (payloads, labels) anywhere in its chain."""

from __future__ import annotations

import asyncio
import sqlite3
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import URL, create_engine

import cronoq_store as cq
from cronoq_store.aio import AsyncSqlStore
from cronoq_store.dialects import redact

SECRET = "s3cr3t-pw"
PRIVATE = "private-7f3e-data"
"""Stands for personal data in a payload or label: no error the store raises may show it."""


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql+psycopg://postgres:{SECRET}@127.0.0.1:1/nowhere",
        f"mysql+pymysql://root:{SECRET}@127.0.0.1:1/nowhere",
    ],
)
def test_unreachable_server_is_unavailable_without_password(url: str) -> None:
    with pytest.raises(cq.StoreUnavailable) as info:
        cq.SqlStore.open(url)
    assert SECRET not in str(info.value)
    assert SECRET not in repr(info.value.args)


def test_bad_url_is_store_error() -> None:
    with pytest.raises(cq.StoreError):
        cq.SqlStore.open(f"nosuchdb://u:{SECRET}@h/x")


def test_busy_sqlite_is_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "busy.db"
    config = cq.StoreConfig(busy_timeout=timedelta(milliseconds=100))
    with cq.SqlStore.open(path, config) as store:
        epoch = store.acquire_leadership()
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            with pytest.raises(cq.StoreUnavailable):
                store.commit(
                    epoch,
                    cq.TimeBase(unix_ns=0),
                    [
                        cq.Submitted(
                            id=cq.TaskId(1), seq=1, arrival=1, spec=cq.TaskSpec(payload=b"")
                        )
                    ],
                )
        finally:
            blocker.rollback()
            blocker.close()
        store.release_leadership()


def test_redact_hides_passwords() -> None:
    assert SECRET not in redact(f"postgresql://u:{SECRET}@h/db failed")
    assert SECRET not in redact(f"connect(password={SECRET}, host=h)")
    assert SECRET not in redact(f"password='{SECRET}'")


def private_task(i: int, key: str) -> cq.Submitted:
    spec = cq.TaskSpec(payload=f"{PRIVATE} #{i}".encode(), key=key, labels={"owner": PRIVATE})
    return cq.Submitted(id=cq.TaskId(i), seq=i, arrival=i, spec=spec)


def shown(exc: BaseException) -> str:
    """Everything a traceback of `exc` prints (`log.exception`, an uncaught error): its whole
    chain, causes and contexts alike."""
    return "".join(traceback.format_exception(exc))


@pytest.fixture(params=["store's engine", "app's engine"])
def open_store(request: pytest.FixtureRequest, db_url: URL) -> Iterator[Callable[[], cq.SqlStore]]:
    """A store on an engine `SqlStore.open` made, or on an app's engine that shows parameters:
    the store's errors must be clean either way."""
    engines = []

    def open_() -> cq.SqlStore:
        if request.param == "store's engine":
            return cq.SqlStore.open(db_url)
        engine = create_engine(db_url, hide_parameters=False)
        engines.append(engine)
        store = cq.SqlStore(engine)
        store.migrate()
        return store

    yield open_
    for engine in engines:
        engine.dispose()


def test_a_key_conflict_shows_no_task_data(open_store: Callable[[], cq.SqlStore]) -> None:
    with open_store() as store:
        epoch = store.acquire_leadership(timeout=10)
        base = cq.TimeBase(unix_ns=1_700_000_000_000_000_000)
        store.commit(epoch, base, [private_task(1, key="in-use")])
        # One new row (a single INSERT), then several (PostgreSQL: COPY; elsewhere executemany).
        for batch in ([private_task(2, "in-use")], [private_task(i, f"k{i}") for i in (2, 3)]):
            conflicting = [*batch[:-1], private_task(batch[-1].id, "in-use")]
            with pytest.raises(cq.StoreError, match="conflicts") as info:
                store.commit(epoch, base, conflicting)
            assert PRIVATE not in shown(info.value)
            assert "in-use" in str(info.value) or "UNIQUE" in str(info.value)


def test_engines_the_store_creates_hide_parameters(tmp_path: Path) -> None:
    with cq.SqlStore.open(tmp_path / "sync.db") as store:
        assert store.engine.hide_parameters

    async def main() -> None:
        async with await AsyncSqlStore.open(tmp_path / "async.db") as store:
            assert store.engine.sync_engine.hide_parameters

    asyncio.run(main())


@pytest.mark.sqlite
@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://bob:p@ssW0rd@127.0.0.1:5999/app",
        "mysql+pymysql://bob:p@ss@W0rd@127.0.0.1:5999/app",
    ],
)
def test_a_password_holding_an_unencoded_at_is_refused_unseen(url: str) -> None:
    """SQLAlchemy would cut the password at its first '@' and take the rest for the host,
    which the driver then prints; both faces refuse the URL before connecting, unseen."""
    from cronoq_store.errors import InvalidValue

    with pytest.raises(InvalidValue) as sync_error:
        cq.SqlStore.open(url)
    with pytest.raises(InvalidValue) as async_error:
        asyncio.run(AsyncSqlStore.open(url))
    for error in (sync_error.value, async_error.value):
        text = "".join(traceback.format_exception(error))
        assert "W0rd" not in text and "%40" in str(error)
