"""The primary/replica pair the replica and failover tests stand on (tests/pgpair.py) does what
they rely on: the replica replays the primary, a stopped async replica lets the primary go on
and catches up, a crashed primary's replica is promoted and reached through the multi-host URL.
"""

from __future__ import annotations

import uuid

import pytest
from pgpair import PgPair
from sqlalchemy import create_engine, text
from sqlalchemy.exc import DBAPIError

pytestmark = pytest.mark.postgresql


def _db() -> str:
    return f"cronoq_pair_{uuid.uuid4().hex[:10]}"


def _port(url: str) -> int:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(text("SELECT inet_server_port()")).scalar_one())
    finally:
        engine.dispose()


@pytest.mark.parametrize("kill", [False, True], ids=["stop-immediate", "sigkill"])
def test_sync_pair_replicates_and_promotes(pg_pair: PgPair, kill: bool) -> None:
    pair = pg_pair.fresh(sync=True)
    db = pair.create_database(_db())
    primary = create_engine(pair.primary_url(db))
    replica = create_engine(pair.replica_url(db))
    try:
        with primary.begin() as conn:
            conn.execute(text("CREATE TABLE t (x int)"))
            conn.execute(text("INSERT INTO t VALUES (1), (2)"))
        # Synchronous: the commit returned once the standby had flushed it; replayed soon after.
        pair.wait_replayed()
        with replica.connect() as conn:
            assert conn.execute(text("SELECT sum(x) FROM t")).scalar_one() == 3
            assert conn.execute(text("SELECT pg_is_in_recovery()")).scalar_one() is True
            with pytest.raises(DBAPIError, match="read-only transaction"):
                conn.execute(text("INSERT INTO t VALUES (3)"))
        assert _port(pair.multi_url(db)) == pair.primary_port

        pair.crash_primary(kill=kill)
        took = pair.promote()
        assert took < 30
        assert _port(pair.multi_url(db)) == pair.replica_port
        multi = create_engine(pair.multi_url(db))
        try:
            with multi.begin() as conn:
                conn.execute(text("INSERT INTO t VALUES (3)"))
                assert conn.execute(text("SELECT sum(x) FROM t")).scalar_one() == 6
        finally:
            multi.dispose()
    finally:
        primary.dispose()
        replica.dispose()


def test_async_replica_stopped_then_catches_up(pg_pair: PgPair) -> None:
    pair = pg_pair.fresh(sync=False)
    db = pair.create_database(_db())
    primary = create_engine(pair.primary_url(db))
    try:
        with primary.begin() as conn:
            conn.execute(text("CREATE TABLE t (x int)"))
        pair.stop_replica()
        with primary.begin() as conn:  # asynchronous: the primary does not wait for it
            conn.execute(text("INSERT INTO t SELECT generate_series(1, 100)"))
        pair.start_replica()
        pair.wait_replayed()
        replica = create_engine(pair.replica_url(db))
        try:
            with replica.connect() as conn:
                assert conn.execute(text("SELECT count(*) FROM t")).scalar_one() == 100
        finally:
            replica.dispose()
    finally:
        primary.dispose()
