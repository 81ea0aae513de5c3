"""`StoreConfig(migrate=False)` checks the schema: a database at a revision this build does not
know, behind it, or never migrated is refused with `SchemaError` and nothing written, on every
dialect, from the sync and the asyncio store alike."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy import URL, Engine, inspect, select, text

from cronoq_store import SchemaError, SqlStore, StoreConfig, migrate
from cronoq_store.aio import AsyncSqlStore
from cronoq_store.schema import leader


def _snapshot(engine: Engine) -> dict[str, Any]:
    """Every table, the version rows and the leader row: what a refused open must not change."""
    names = sorted(inspect(engine).get_table_names())
    snap: dict[str, Any] = {"tables": names}
    with engine.connect() as conn:
        if migrate.VERSION_TABLE in names:
            snap["version"] = conn.execute(
                text(f"SELECT version_num FROM {migrate.VERSION_TABLE}")
            ).all()
        if leader.name in names:
            snap["leader"] = conn.execute(text(f"SELECT * FROM {leader.name}")).all()
    return snap


def _refused(db_url: URL, engine: Engine, match: str) -> None:
    before = _snapshot(engine)
    with pytest.raises(SchemaError, match=match):
        SqlStore.open(db_url, StoreConfig(migrate=False))

    async def open_async() -> None:
        store = await AsyncSqlStore.open(db_url, StoreConfig(migrate=False))
        await store.close()  # not reached when refused

    with pytest.raises(SchemaError, match=match):
        asyncio.run(open_async())
    assert _snapshot(engine) == before


def test_unknown_revision_is_refused(db_url: URL, engine: Engine) -> None:
    migrate.upgrade(engine)
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {migrate.VERSION_TABLE} SET version_num = '9999_future'"))
    _refused(db_url, engine, "'9999_future', which this build of cronoq-store does not know")


def test_behind_head_is_refused(db_url: URL, engine: Engine) -> None:
    migrate.upgrade(engine, "0001_initial")
    _refused(db_url, engine, f"behind this build's '{migrate.head_revision()}'")


def test_never_migrated_is_refused(db_url: URL, engine: Engine) -> None:
    _refused(db_url, engine, "no cronoq schema")
    assert not [t for t in inspect(engine).get_table_names() if t.startswith("cronoq")]


def test_at_head_opens_and_leads(db_url: URL, engine: Engine) -> None:
    migrate.upgrade(engine)
    with SqlStore.open(db_url, StoreConfig(migrate=False)) as store:
        assert store.acquire_leadership() == 1
        store.release_leadership()
    with engine.connect() as conn:
        assert conn.execute(select(leader.c.epoch)).scalar_one() == 1
