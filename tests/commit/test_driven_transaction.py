"""A small commit that nothing but the store would see runs in the driver's own transaction
(`face.transactions._Driven`), past SQLAlchemy's; whoever listens to the engine's transaction
events still sees every commit's (SQLAlchemy's transaction then), and either way the
connection a leader keeps is left with no transaction open."""

from __future__ import annotations

from typing import Any

import pytest
from builders import BASE, submit
from sqlalchemy import URL, Connection, Engine, event

from cronoq_store import ById, InvalidValue, SqlStore, StatusChanged, TaskId, TaskStatus, dialects


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


@pytest.mark.parametrize(
    ("where", "name"),
    [("Connection", "begin"), ("Engine", "commit"), ("engine", "rollback")],
)
def test_every_listener_of_a_transaction_takes_sqlalchemys_way(
    db_url: URL, monkeypatch: pytest.MonkeyPatch, where: str, name: str
) -> None:
    """A listener on the classes, or on one event of the engine's, added between two commits
    on the connection a leader keeps: the next commit runs SQLAlchemy's transaction (a
    rolled-back one too), and the one after its removal the driver's own again."""
    seen: list[str] = []
    with SqlStore.open(db_url) as store:
        epoch = store.acquire_leadership()
        store.commit(epoch, BASE, [submit(1)])
        target: Any = {"Connection": Connection, "Engine": Engine, "engine": store.engine}[where]
        if isinstance(target, type):  # the class-level flag a listener sets, put back after
            # (SQLAlchemy 2.0.30's classes have none until then: removed again after)
            flag = getattr(target, "_has_events", False)
            monkeypatch.setattr(target, "_has_events", flag, raising=False)

        def on(*_args: Any) -> None:
            seen.append(name)

        assert driven(store)
        event.listen(target, name, on)
        try:
            assert not driven(store)
            store.commit(epoch, BASE, [submit(2)])
            with pytest.raises(InvalidValue):  # a live key taken twice: rolled back
                store.commit(epoch, BASE, [submit(3, key="same"), submit(4, key="same")])
        finally:
            event.remove(target, name, on)
        assert (
            seen == {"begin": ["begin"] * 2, "commit": ["commit"], "rollback": ["rollback"]}[name]
        )
        store.commit(epoch, BASE, [submit(5)])
        assert len(seen) == {"begin": 2, "commit": 1, "rollback": 1}[name]
        assert driven(store)
        held = store._drop_held()
        assert held is not None and not held.in_transaction()
        held.close()


def driven(store: SqlStore) -> bool:
    """Whether the next commit on the connection `store` keeps runs the driver's own
    transaction (`dialects.Line.driver_begin`)."""
    assert store._held is not None
    return dialects.line_of(store._held[0]).driver_begin() is not None
