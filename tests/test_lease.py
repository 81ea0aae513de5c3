"""The lease row: epochs, takeovers, and expiry on the database's clock."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import Engine, update

from cronoq_store import lease, migrate
from cronoq_store.schema import leader

SECOND = 1_000_000_000


@pytest.fixture
def migrated(engine: Engine) -> Engine:
    migrate.upgrade(engine)
    return engine


def _set(engine: Engine, **values: object) -> None:
    with engine.begin() as conn:
        conn.execute(update(leader).where(leader.c.id == 1).values(**values))


def _take(engine: Engine, holder: str) -> int | None:
    with engine.begin() as conn:
        return lease.try_take(conn, holder=holder, ttl_ns=10 * SECOND)


def test_epochs_rise_by_one_per_takeover_and_wrap(migrated: Engine) -> None:
    assert _take(migrated, "a") == 1
    assert _take(migrated, "b") is None  # held and live
    with migrated.begin() as conn:
        assert lease.renew(conn, epoch=1, holder="a", ttl_ns=10 * SECOND)
        assert not lease.renew(conn, epoch=1, holder="b", ttl_ns=10 * SECOND)
    _set(migrated, expires_unix_ns=0)  # expired
    assert _take(migrated, "b") == 2
    _set(migrated, epoch=lease.MAX_EPOCH, holder=None)
    assert _take(migrated, "c") == 1
    with migrated.begin() as conn:
        lease.release(conn, holder="c")
    assert _take(migrated, "d") == 2


def test_host_clock_ahead_cannot_steal_a_live_lease(
    migrated: Engine, dialect: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _set(migrated, epoch=5, holder="live", expires_unix_ns=time.time_ns() + 10 * SECOND)
    real = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real() + 30 * SECOND)
    taken = _take(migrated, "skewed")
    if dialect == "sqlite":
        # One host, one clock: SQLite's processes share the host's clock by design.
        assert taken == 6
    else:
        assert taken is None
