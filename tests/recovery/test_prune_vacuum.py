"""A prune's VACUUM on PostgreSQL cleans the indexes only when the prune deleted a fair share of
the table (`repository.prune.INDEX_CLEANUP_SHARE`): that pass reads every index whole, so a
small prune beside a large history leaves its index entries to the next vacuum, and its cost
per pruned task stays flat as the history grows (`cronoq-store bench --history`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import URL, Engine, event, text, update

from cronoq_store import SqlStore, StoreConfig
from cronoq_store.bench import history
from cronoq_store.schema import tasks

HOUR_NS = 3600 * 10**9
OLD = 2000
"""Old finished tasks a prune deletes."""
KEPT = 20_000
"""Finished tasks younger than the prune's cutoff: the history that stays."""


def _vacuums(engine: Engine, store: SqlStore) -> tuple[int, list[str]]:
    """What `store.prune` deleted and the VACUUM statements it sent."""
    sent: list[str] = []

    def record(_c: Any, _cursor: Any, sql: str, *_: Any) -> None:
        if sql.lstrip().upper().startswith("VACUUM"):
            sent.append(sql)

    event.listen(engine, "before_cursor_execute", record)
    try:
        deleted = store.prune(timedelta(hours=3))
    finally:
        event.remove(engine, "before_cursor_execute", record)
    return deleted, sent


@pytest.fixture(params=[None, "cronoq_pruned"], ids=["public", "schema"])
def store(db_url: URL, request: pytest.FixtureRequest) -> Iterator[SqlStore]:
    """A store (in its own schema, or the default one) holding `KEPT` finished tasks an hour
    old and `OLD` ten hours old, the table counted by ANALYZE (as autovacuum does)."""
    with SqlStore.open(db_url, StoreConfig(schema=request.param)) as store:
        now = time.time_ns()
        history.fill(store.engine, 1, KEPT + 1, now - HOUR_NS - KEPT)
        history.fill(store.engine, KEPT + 1, KEPT + OLD + 1, now - 10 * HOUR_NS)
        with store.engine.connect() as conn:
            where = "" if request.param is None else f"{request.param}."
            conn.execute(text(f"ANALYZE {where}cronoq_tasks"))
            conn.commit()
        yield store


@pytest.mark.parametrize("dialect", [pytest.param("postgresql", marks=pytest.mark.postgresql)])
def test_a_small_prune_leaves_index_cleanup_to_the_next_vacuum(store: SqlStore) -> None:
    deleted, sent = _vacuums(store.engine, store)
    assert deleted == OLD
    assert len(sent) == 1 and "INDEX_CLEANUP OFF" in sent[0], sent


@pytest.mark.parametrize("dialect", [pytest.param("postgresql", marks=pytest.mark.postgresql)])
def test_a_large_prune_cleans_the_indexes(store: SqlStore) -> None:
    # Age the history past the cutoff: the prune deletes the whole table.
    with store.engine.begin() as conn:
        older = tasks.c.finished_unix_ns - 10 * HOUR_NS
        conn.execute(update(tasks).values(finished_unix_ns=older))
    deleted, sent = _vacuums(store.engine, store)
    assert deleted == OLD + KEPT
    assert len(sent) == 1 and "INDEX_CLEANUP" not in sent[0], sent
