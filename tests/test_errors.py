"""Error mapping: what is worth retrying is StoreUnavailable, and no message carries a password."""

from __future__ import annotations

import sqlite3
from datetime import timedelta
from pathlib import Path

import pytest

from cronoq_store import (
    SqlStore,
    StoreConfig,
    StoreError,
    StoreUnavailable,
    Submitted,
    TaskId,
    TaskSpec,
    TimeBase,
)
from cronoq_store.dialects import redact

SECRET = "s3cr3t-pw"


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql+psycopg://postgres:{SECRET}@127.0.0.1:1/nowhere",
        f"mysql+pymysql://root:{SECRET}@127.0.0.1:1/nowhere",
    ],
)
def test_unreachable_server_is_unavailable_without_password(url: str) -> None:
    with pytest.raises(StoreUnavailable) as info:
        SqlStore.open(url)
    assert SECRET not in str(info.value)
    assert SECRET not in repr(info.value.args)


def test_bad_url_is_store_error() -> None:
    with pytest.raises(StoreError):
        SqlStore.open(f"nosuchdb://u:{SECRET}@h/x")


def test_busy_sqlite_is_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "busy.db"
    config = StoreConfig(busy_timeout=timedelta(milliseconds=100))
    with SqlStore.open(path, config) as store:
        epoch = store.acquire_leadership()
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            with pytest.raises(StoreUnavailable):
                store.commit(
                    epoch,
                    TimeBase(unix_ns=0),
                    [Submitted(id=TaskId(1), seq=1, arrival=1, spec=TaskSpec(payload=b""))],
                )
        finally:
            blocker.rollback()
            blocker.close()
        store.release_leadership()


def test_redact_hides_passwords() -> None:
    assert SECRET not in redact(f"postgresql://u:{SECRET}@h/db failed")
    assert SECRET not in redact(f"connect(password={SECRET}, host=h)")
    assert SECRET not in redact(f"password='{SECRET}'")
