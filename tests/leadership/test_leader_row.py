"""A deleted leader row has a way back, on every dialect.

Without the row (cronoq_leader, id = 1) no instance can lead: every path that needs it (the
leader's next commit or renewal, acquiring, `status`, `lease release --force`) says so and names
the repair, and `cronoq-store upgrade` (or `SqlStore.open` with migration on) restores it with
an id high-water mark above every id still stored.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from inspect import signature

import pytest
from builders import BASE, submit
from click.testing import CliRunner, Result
from sqlalchemy import URL, Engine, delete, select

import cronoq_store as cq
from cronoq_store.cli import main
from cronoq_store.schema import leader

REPAIR = "cronoq-store upgrade"
SEPARATE_STDERR = {"mix_stderr": False} if "mix_stderr" in signature(CliRunner).parameters else {}


@pytest.fixture
def store_config() -> cq.StoreConfig:
    return cq.StoreConfig(lease_ttl=timedelta(seconds=10), lease_renew=timedelta(seconds=5))


def delete_leader_row(engine: Engine) -> None:
    with engine.begin() as conn:
        assert conn.execute(delete(leader)).rowcount == 1


def leader_row(engine: Engine) -> dict[str, object] | None:
    with engine.connect() as conn:
        lease = (leader.c.id, leader.c.epoch, leader.c.holder, leader.c.expires_unix_ns)
        row = conn.execute(select(*lease, leader.c.next_id)).mappings().one_or_none()
    return None if row is None else dict(row)


def assert_names_repair(exc: BaseException) -> None:
    text = str(exc)
    assert "leader row" in text and REPAIR in text, text
    assert "another instance" not in text and "NoResultFound" not in text


def cli(url: URL, *args: str, code: int) -> Result:
    argv = ["--url", url.render_as_string(hide_password=False), *args]
    result = CliRunner(**SEPARATE_STDERR).invoke(main, argv, catch_exceptions=True)
    both = result.stdout + result.stderr
    assert result.exit_code == code, (argv, both, result.exception)
    assert "Traceback" not in both
    return result


def test_commit_after_deletion_names_the_problem(store: cq.SqlStore, engine: Engine) -> None:
    epoch = store.acquire_leadership()
    store.commit(epoch, BASE, [submit(1)])
    delete_leader_row(engine)
    with pytest.raises(cq.LeaderRowMissing) as caught:
        store.commit(epoch, BASE, [submit(2)])
    assert isinstance(caught.value, cq.Fenced) and isinstance(caught.value, cq.SchemaError)
    assert_names_repair(caught.value)
    assert not store.is_leader  # stepped down
    assert store.get_task(cq.ById(id=cq.TaskId(2))) is None


def test_acquire_after_deletion_names_the_problem(db_url: URL, engine: Engine) -> None:
    with cq.SqlStore.open(db_url) as store:
        delete_leader_row(engine)
        with pytest.raises(cq.LeaderRowMissing) as caught:
            store.acquire_leadership(timeout=30)  # fails at once, not after the timeout
        assert_names_repair(caught.value)


def test_renewal_after_deletion_steps_down_saying_why(
    db_url: URL, engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    config = cq.StoreConfig(
        lease_ttl=timedelta(seconds=30), lease_renew=timedelta(milliseconds=100)
    )
    with cq.SqlStore.open(db_url, config) as store, caplog.at_level(logging.ERROR):
        called = threading.Event()  # callbacks run after the loss is logged
        store.acquire_leadership()
        store.on_leadership_lost(called.set)
        delete_leader_row(engine)
        # Well before the 30 s TTL could end it: the first renewal finds the row gone.
        assert called.wait(timeout=20)
        lost = [r.getMessage() for r in caplog.records if "leadership lost" in r.getMessage()]
        assert len(lost) == 1 and "leader row" in lost[0] and REPAIR in lost[0], lost


def test_cli_status_and_lease_release_name_the_problem(db_url: URL, engine: Engine) -> None:
    with cq.SqlStore.open(db_url) as store:
        store.acquire_leadership()
        delete_leader_row(engine)
        store.release_leadership()  # can clear nothing: logs a warning
    for args in (("status",), ("status", "--json"), ("lease", "release", "--force", "--yes")):
        result = cli(db_url, *args, code=1)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
        assert_names_repair(Exception(lines[0]))


def test_upgrade_restores_the_row_above_every_stored_id(
    db_url: URL, engine: Engine, store: cq.SqlStore
) -> None:
    epoch = store.acquire_leadership()
    sched = cq.RecurringSpec(name="s", template=cq.TaskSpec(payload=b"t"), interval_ns=10**9)
    store.commit(
        epoch,
        BASE,
        [submit(i) for i in range(1, 11)]
        + [
            submit(11, deps=(cq.Dep(target=cq.ById(id=cq.TaskId(40))),)),
            cq.RecurringUpsert(spec=sched),
            cq.RecurringNext(name="s", next=5, last=cq.TaskId(30)),
        ],
    )
    # Tasks 5..10 finish and are pruned: the schedule still names 30, a dependency 40.
    store.commit(
        epoch,
        BASE,
        [
            cq.StatusChanged(
                id=cq.TaskId(i), status=cq.TaskStatus.SUCCEEDED, attempt=1, at=0, message=None
            )
            for i in range(5, 11)
        ],
    )
    assert store.prune(timedelta(seconds=1)) == 6
    delete_leader_row(engine)

    result = cli(db_url, "upgrade", code=0)
    assert "restored the missing leader row" in result.stdout and "41" in result.stdout
    assert leader_row(engine) == {
        "id": 1,
        "epoch": 0,
        "holder": None,
        "expires_unix_ns": 0,
        "next_id": 41,
    }
    # The old leader is fenced off (the row names no holder); a new one leads and resumes.
    with pytest.raises(cq.Fenced) as caught:
        store.commit(epoch, BASE, [submit(50)])
    assert not isinstance(caught.value, cq.LeaderRowMissing)
    with cq.SqlStore.open(db_url) as other:
        new_epoch = other.acquire_leadership()
        assert new_epoch == 1
        assert other.recover(BASE).next_id == 41
        other.commit(new_epoch, BASE, [submit(41)])
    # Upgrading again restores nothing.
    assert "restored" not in cli(db_url, "upgrade", code=0).stdout


def test_open_restores_the_row_and_an_empty_store_starts_at_zero(
    db_url: URL, engine: Engine
) -> None:
    with cq.SqlStore.open(db_url):
        pass
    delete_leader_row(engine)
    with cq.SqlStore.open(db_url, cq.StoreConfig(migrate=True)) as store:
        assert leader_row(engine) == {
            "id": 1,
            "epoch": 0,
            "holder": None,
            "expires_unix_ns": 0,
            "next_id": 0,
        }
        assert store.acquire_leadership() == 1
        assert store.recover(BASE).next_id == 0
