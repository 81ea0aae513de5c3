"""A small commit that nothing but the store would see runs in the driver's own transaction
(`face.transactions._Driven`), past SQLAlchemy's; whoever listens to the engine's transaction
events still sees every commit's (SQLAlchemy's transaction then), and either way the
connection a leader keeps is left with no transaction open."""

from __future__ import annotations

from typing import Any

from builders import BASE, submit
from sqlalchemy import URL, event

from cronoq_store import ById, SqlStore, StatusChanged, TaskId, TaskStatus


def test_listeners_of_the_engine_see_every_commit(db_url: URL) -> None:
    seen: list[str] = []

    def on(name: str) -> Any:
        return lambda *_args: seen.append(name)

    with SqlStore.open(db_url) as store:
        epoch = store.acquire_leadership()
        store.commit(epoch, BASE, [submit(1)])  # unwatched: the driver's own transaction
        assert seen == []
        listeners = [(name, on(name)) for name in ("begin", "commit")]
        for name, fn in listeners:
            event.listen(store.engine, name, fn)
        store.commit(epoch, BASE, [submit(2)])
        change = StatusChanged(id=TaskId(2), status=TaskStatus.RUNNING, attempt=1, at=5)
        store.commit(epoch, BASE, [change])
        assert seen == ["begin", "commit", "begin", "commit"]
        for name, fn in listeners:
            event.remove(store.engine, name, fn)
        store.commit(epoch, BASE, [submit(3)])
        assert len(seen) == 4
        held = store._drop_held()
        assert held is not None and not held.in_transaction()
        held.close()
        assert all(store.get_task(ById(id=TaskId(i))) is not None for i in (1, 2, 3))
