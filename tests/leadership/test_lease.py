"""The lease row: epochs, takeovers, and expiry on the database's clock.

The lease functions run as each face runs them: on a sync connection, and through an async
engine's `run_sync` (`AsyncSqlStore`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from faces import FACES, transactions
from sqlalchemy import URL, Engine, update

from cronoq_store import lease, migrate
from cronoq_store.schema import leader

SECOND = 1_000_000_000


@pytest.fixture
def migrated(engine: Engine) -> Engine:
    migrate.upgrade(engine)
    return engine


Tx = Callable[[Callable[..., Any]], Any]


@pytest.fixture(params=FACES)
def tx(migrated: Engine, db_url: URL, request: pytest.FixtureRequest) -> Iterator[Tx]:
    """One transaction per call, on the face's engine (sync, or async through `run_sync`)."""
    yield from transactions(str(request.param), db_url)


def _set(engine: Engine, **values: object) -> None:
    with engine.begin() as conn:
        conn.execute(update(leader).where(leader.c.id == 1).values(**values))


def _take(tx: Tx, holder: str) -> int | None:
    return tx(lambda conn: lease.try_take(conn, holder=holder, ttl_ns=10 * SECOND))


def test_epochs_rise_by_one_per_takeover_and_wrap(migrated: Engine, tx: Tx) -> None:
    assert _take(tx, "a") == 1
    assert _take(tx, "b") is None  # held and live

    def renewals(conn: Any) -> tuple[bool, bool]:
        mine = lease.renew(conn, epoch=1, holder="a", ttl_ns=10 * SECOND, acked=0)
        theirs = lease.renew(conn, epoch=0, holder="b", ttl_ns=10 * SECOND, acked=0)
        return mine, theirs

    assert tx(renewals) == (True, False)
    _set(migrated, expires_unix_ns=0)  # expired
    assert _take(tx, "b") == 2
    _set(migrated, epoch=lease.MAX_EPOCH, holder=None)
    assert _take(tx, "c") == 1
    tx(lambda conn: lease.release(conn, holder="c"))
    assert _take(tx, "d") == 2


def test_host_clock_ahead_cannot_steal_a_live_lease(
    migrated: Engine, tx: Tx, dialect: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _set(migrated, epoch=5, holder="live", expires_unix_ns=time.time_ns() + 10 * SECOND)
    real = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real() + 30 * SECOND)
    taken = _take(tx, "skewed")
    if dialect == "sqlite":
        # One host, one clock: SQLite's processes share the host's clock by design.
        assert taken == 6
    else:
        assert taken is None
