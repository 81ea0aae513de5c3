"""A database that went back in time: the leader notices, steps down, and recovery says so.

An asynchronous failover promotes a replica that misses the primary's last commits: the lease
row is then the one the replica had, still naming the leader under its epoch, so the fence alone
matched and the leader went on writing on top of the gap. Here the same state is made on one
server, on every dialect, by putting the tables back to a snapshot taken a few commits earlier
(what the lagging replica held); tests/dialects/test_replicas.py does it with a real replica.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from builders import BASE, submit
from click.testing import CliRunner
from faces import FACES, open_face
from sqlalchemy import URL, Engine, delete, select, update

import cronoq_store as cq
from cronoq_store.cli import main
from cronoq_store.schema import leader, tasks

QUIET = cq.StoreConfig(lease_ttl=timedelta(seconds=30), lease_renew=timedelta(seconds=10))
LEASE_COLUMNS = ("epoch", "holder", "expires_unix_ns", "next_id", "commit_seq")


def snapshot(engine: Engine) -> dict[str, Any]:
    """The lease row as a replica that stops replaying here would hold it."""
    with engine.connect() as conn:
        row = conn.execute(select(*(leader.c[c] for c in LEASE_COLUMNS))).mappings().one()
    return dict(row)


def roll_back_to(engine: Engine, lease_row: dict[str, Any], keep_below: int) -> None:
    """Make the database what the lagging replica held: the lease row of the snapshot, and no
    task at or above `keep_below` (the ones submitted after it)."""
    with engine.begin() as conn:
        conn.execute(delete(tasks).where(tasks.c.id >= keep_below))
        conn.execute(update(leader).where(leader.c.id == 1).values(**lease_row))


@pytest.mark.parametrize("face", FACES)
def test_a_leader_steps_down_on_a_database_that_lost_its_commits(
    face: str, db_url: URL, engine: Engine, cleanup: list[Callable[[], None]]
) -> None:
    old = open_face(face, db_url, QUIET, cleanup)
    epoch = old.acquire_leadership(timeout=10)
    old.commit(epoch, BASE, [submit(1)])
    replica = snapshot(engine)
    for i in range(2, 6):  # acknowledged, then lost with the failover
        old.commit(epoch, BASE, [submit(i)])
    roll_back_to(engine, replica, keep_below=2)

    with pytest.raises(cq.DatabaseBehind, match="up to 4 acknowledged commits are gone") as caught:
        old.commit(epoch, BASE, [submit(6)])
    assert isinstance(caught.value, cq.Fenced)  # an engine that steps down on Fenced steps down
    assert caught.value.lost.epoch == epoch and caught.value.lost.commits == 4
    assert not old.is_leader
    with engine.connect() as conn:
        stored = set(conn.execute(select(tasks.c.id)).scalars())
        row = conn.execute(select(leader)).mappings().one()
    assert stored == {1}  # the commit that found the gap wrote nothing
    assert row["holder"] is None and row["lost_epoch"] == epoch  # freed, and the gap recorded

    # The standby takes over at once (the lease was freed) and its recovery reports the gap.
    new = open_face(face, db_url, QUIET, cleanup)
    new_epoch = new.acquire_leadership(timeout=5)
    assert new_epoch != epoch
    recovered = new.recover(BASE)
    assert [t.id for t in recovered.tasks] == [1]
    lost = recovered.lost
    assert isinstance(lost, cq.LostCommits)
    assert (lost.epoch, lost.commits) == (epoch, 4)
    assert lost.noticed_unix_ns > BASE.unix_ns
    # ... until the new epoch commits: it has been recovered from.
    new.commit(new_epoch, BASE, [submit(7)])
    assert new.recover(BASE).lost is None


def test_a_renewal_notices_a_database_that_lost_its_commits(db_url: URL, engine: Engine) -> None:
    """A leader that commits nothing after the failover still steps down: its renewal checks."""
    config = cq.StoreConfig(lease_ttl=timedelta(seconds=2), lease_renew=timedelta(milliseconds=100))
    lost = threading.Event()
    with cq.SqlStore.open(db_url, config) as store:
        store.on_leadership_lost(lost.set)
        epoch = store.acquire_leadership(timeout=10)
        store.commit(epoch, BASE, [submit(1)])
        replica = snapshot(engine)
        store.commit(
            epoch,
            BASE,
            [cq.StatusChanged(id=cq.TaskId(1), status=cq.TaskStatus.RUNNING, attempt=1, at=2)],
        )
        roll_back_to(engine, replica, keep_below=2)  # only a status change was lost
        assert lost.wait(10), "the keeper's renewal did not notice the lost commit"
        assert not store.is_leader
        with pytest.raises(cq.Fenced):
            store.commit(epoch, BASE, [submit(2)])
    with cq.SqlStore.open(db_url, config) as standby:
        standby.acquire_leadership(timeout=5)
        gap = standby.recover(BASE).lost
        assert gap is not None and (gap.epoch, gap.commits) == (epoch, 1)


def test_a_database_that_lost_the_take_itself_is_noticed(db_url: URL, engine: Engine) -> None:
    """The replica missed even this leader's take: the row names the epoch before, or (once a
    standby took over on it) the same epoch under another holder; neither is a takeover."""
    with cq.SqlStore.open(db_url, QUIET) as first:
        first.acquire_leadership(timeout=10)
        first.commit(first.epoch or 0, BASE, [submit(1)])
        first.release_leadership()
    replica = snapshot(engine)
    with cq.SqlStore.open(db_url, QUIET) as old, cq.SqlStore.open(db_url, QUIET) as standby:
        epoch = old.acquire_leadership(timeout=10)
        old.commit(epoch, BASE, [submit(2)])
        roll_back_to(engine, replica, keep_below=2)
        # The standby is granted the epoch the lost history had granted already.
        assert standby.acquire_leadership(timeout=5) == epoch
        with pytest.raises(cq.DatabaseBehind, match="lost this leader's own take"):
            old.commit(epoch, BASE, [submit(3)])
        # The standby leads on: the record does not touch its lease.
        standby.commit(epoch, BASE, [submit(4)])
        with engine.connect() as conn:
            assert set(conn.execute(select(tasks.c.id)).scalars()) == {1, 4}


def test_commits_landing_out_of_order_are_no_gap(db_url: URL) -> None:
    """Several threads commit under one epoch: their sequence numbers land in any order, and
    none of them, nor a renewal between them, may read that as a database behind."""
    config = cq.StoreConfig(lease_ttl=timedelta(seconds=10), lease_renew=timedelta(milliseconds=50))
    with cq.SqlStore.open(db_url, config) as store:
        epoch = store.acquire_leadership(timeout=10)
        errors: list[BaseException] = []

        def work(start: int) -> None:
            try:
                for i in range(start, start + 30):
                    store.commit(epoch, BASE, [submit(i)])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(1000 * (n + 1),)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert store.is_leader
        assert store.recover(BASE).lost is None


def test_status_shows_the_gap_and_the_server_role(db_url: URL, engine: Engine) -> None:
    with cq.SqlStore.open(db_url, QUIET) as old:
        epoch = old.acquire_leadership(timeout=10)
        old.commit(epoch, BASE, [submit(1)])
        replica = snapshot(engine)
        old.commit(epoch, BASE, [submit(2)])
        roll_back_to(engine, replica, keep_below=2)
        with pytest.raises(cq.DatabaseBehind):
            old.commit(epoch, BASE, [submit(3)])
    url = db_url.render_as_string(hide_password=False)
    shown = CliRunner().invoke(main, ["--url", url, "status", "--json"])
    assert shown.exit_code == 0, shown.output
    data = json.loads(shown.output)
    assert data["lost_commits"]["epoch"] == epoch and data["lost_commits"]["commits"] == 1
    assert data["lease"]["state"] == "free"
    text = CliRunner().invoke(main, ["--url", url, "status"]).output
    assert f"the leader of epoch {epoch} found up to 1 acknowledged commits missing" in text
    if db_url.get_backend_name() == "postgresql":
        assert data["server"]["role"] == "primary"
        assert data["server"]["synchronous_commit"] == "on"
        assert "server     primary" in text
    else:
        assert "server" not in data


@pytest.mark.parametrize("face", FACES)
def test_an_instance_retaking_its_lease_on_a_database_behind_it_reports_the_gap(
    face: str, db_url: URL, engine: Engine, cleanup: list[Callable[[], None]]
) -> None:
    """The leader lost its lease in the failover's outage (its keeper could not renew), so no
    fence of its own finds the gap; it is its next take that does, before it leads again."""
    store = open_face(face, db_url, QUIET, cleanup)
    epoch = store.acquire_leadership(timeout=10)
    store.commit(epoch, BASE, [submit(1)])
    replica = snapshot(engine)
    store.commit(epoch, BASE, [submit(2)])
    store.commit(epoch, BASE, [submit(3)])
    store.release_leadership()  # as a keeper that could not renew steps down
    roll_back_to(engine, replica, keep_below=2)  # the row names it, under its epoch, again

    again = store.acquire_leadership(timeout=10)
    assert again != epoch
    recovered = store.recover(BASE)
    assert [t.id for t in recovered.tasks] == [1]
    assert recovered.lost is not None
    assert (recovered.lost.epoch, recovered.lost.commits) == (epoch, 2)
    store.commit(again, BASE, [submit(4)])  # builds on the database's history from here
    assert store.recover(BASE).lost is None
