"""MariaDB's multi-statement packets (`execution.Flight`, batched; `MySQLImpl.send_batch`): a
commit's fence and writes go in one packet, and a fence that matches nothing stops the writes
behind it on the server, so a deposed leader's commit writes nothing."""

from __future__ import annotations

from typing import Any

import pymysql.connections
import pytest
from builders import BASE, submit
from sqlalchemy import Engine, select, update

from cronoq_store import ById, Fenced, SqlStore, StatusChanged, StoreError, TaskId, TaskStatus
from cronoq_store.schema import leader, tasks

pytestmark = pytest.mark.mysql


@pytest.fixture
def dialect() -> str:
    return "mysql"


@pytest.fixture
def packets(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The text of every COM_QUERY packet PyMySQL sends while the test runs."""
    sent: list[str] = []
    original = pymysql.connections.Connection._execute_command

    def recorded(self: Any, command: int, sql: Any) -> Any:
        if command == 3:  # COM_QUERY
            sent.append(sql.decode(errors="replace") if isinstance(sql, bytes) else str(sql))
        return original(self, command, sql)

    monkeypatch.setattr(pymysql.connections.Connection, "_execute_command", recorded)
    return sent


def transactions(packets: list[str]) -> list[str]:
    """`packets` but a new connection's own (PyMySQL's, as it connects)."""
    return [p for p in packets if not p.startswith(("SET NAMES", "SET AUTOCOMMIT"))]


def stored(engine: Engine) -> dict[int, str]:
    with engine.connect() as conn:
        return {int(i): str(s) for i, s in conn.execute(select(tasks.c.id, tasks.c.status))}


@pytest.mark.parametrize("transition", [False, True])
def test_a_fenced_commit_writes_nothing(
    db_url: Any, engine: Engine, packets: list[str], transition: bool
) -> None:
    """After a takeover the old leader's commit goes as one packet, fence first (a batch-1
    submission with its COMMIT behind; a transition and a new task up to the transition,
    whose answer the rest waits for); the fence matches nothing and SIGNALs, so the server
    runs none of the statements behind it: `Fenced`, nothing written, and the connection
    serves on."""
    with SqlStore.open(db_url) as old:
        epoch = old.acquire_leadership()
        old.commit(epoch, BASE, [submit(1)])
        with engine.begin() as conn:  # another instance takes over (the old one paused)
            conn.execute(
                update(leader).where(leader.c.id == 1).values(epoch=epoch + 1, holder="other")
            )
        packets.clear()
        change = StatusChanged(id=TaskId(1), status=TaskStatus.RUNNING, attempt=1, at=5)
        with pytest.raises(Fenced):
            old.commit(epoch, BASE, [change, submit(2)] if transition else [submit(2)])
        [carrier] = [p for p in packets if "BEGIN NOT ATOMIC" in p]
        behind = carrier.split("END IF; END", 1)[1]
        assert "cronoq_tasks" in behind  # the writes rode behind the fence
        assert transition or behind.endswith("COMMIT")
        assert stored(engine) == {1: "queued"}
        assert old.get_task(ById(id=TaskId(1))) is not None  # the connection is fine


def test_a_failed_write_in_a_packet_leaves_nothing_behind(db_url: Any, engine: Engine) -> None:
    """A write that fails inside the packet (a live key in use) stops the packet: the
    commit raises, its writes are rolled back, and the next commit lands."""
    with SqlStore.open(db_url) as store:
        epoch = store.acquire_leadership()
        store.commit(epoch, BASE, [submit(1, key="k")])
        with pytest.raises(StoreError):
            store.commit(epoch, BASE, [submit(2, key="k")])
        store.commit(epoch, BASE, [submit(3)])
        assert stored(engine) == {1: "queued", 3: "queued"}


def test_a_commit_and_a_renewal_send_their_commit_in_the_packet(
    db_url: Any, packets: list[str]
) -> None:
    """The COMMIT rides in the last packet and the driver's own `commit()` sends nothing
    more: a renewal is one packet, a release one."""
    with SqlStore.open(db_url) as store:
        epoch = store.acquire_leadership()
        store.commit(epoch, BASE, [submit(1)])
        packets.clear()
        assert store._renew(epoch)
        [renewal] = transactions(packets)
        assert renewal.startswith(("UPDATE", "SET SESSION")) and renewal.endswith("COMMIT")
        packets.clear()
        store.release_leadership()
        [release] = transactions(packets)
        assert release.startswith(("UPDATE", "SET SESSION")) and release.endswith("COMMIT")
