"""An asynchronous failover that loses the primary's tail, with a real replica and a real leader.

The replica is stopped while the leader commits (the lag window), the primary crashes, the
replica is started and promoted, and the same leader process reaches it through the multi-host
URL. The commits of the lag window are gone: the test measures how many, and checks that the
leader noticed instead of writing on: none of its old term's commits landed
after the crash, it stepped down with `DatabaseBehind`, and its next recovery reported the gap.
Figures are printed in the terminal summary (`cronoq lossy failover`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from figures import figures
from pgpair import PgPair
from test_replica_failover import pair_leader

from cronoq_store import SqlStore, StoreConfig
from cronoq_store.testing import DriverProcess, check

pytestmark = [pytest.mark.postgresql, pytest.mark.slow]

TTL = 1.0
WAIT = 30.0
"""Bound for what takes a second or two (a promotion, a reconnect, a takeover)."""
LAG_ACKS = 20
"""Batches the leader acknowledges while the replica is stopped: all of them are lost."""

_FIGURES: dict[str, dict[str, Any]] = figures("cronoq lossy failover")


@pytest.fixture
def leader_process(tmp_path: Path) -> Iterator[list[DriverProcess]]:
    started: list[DriverProcess] = []
    yield started
    for p in started:
        p.close()


def test_the_leader_steps_down_on_a_promoted_replica_that_lost_its_commits(
    pg_pair: PgPair, tmp_path: Path, leader_process: list[DriverProcess]
) -> None:
    lossy_round(pg_pair, tmp_path, leader_process)


@pytest.mark.soak
def test_lossy_failover_rounds(
    pg_pair: PgPair, tmp_path: Path, leader_process: list[DriverProcess]
) -> None:
    for n in range(8):
        lossy_round(pg_pair, tmp_path / f"round{n}", leader_process)


def lossy_round(pg_pair: PgPair, tmp_path: Path, leader_process: list[DriverProcess]) -> None:
    """One round: build, lag, crash, promote, check; its figures appended to the summary."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    pair = pg_pair.fresh(sync=False)
    db = pair.create_database(f"cronoq_lossy_{uuid.uuid4().hex[:10]}")
    log = tmp_path / "acks.jsonl"
    leader = pair_leader(pair.multi_url(db), log, tmp_path, ttl=TTL)
    leader_process.append(leader)
    _, lead = leader.wait("leading", timeout=WAIT)
    first_epoch = lead["epoch"]
    leader.wait("ack", timeout=WAIT)
    pair.wait_replayed()

    pair.stop_replica()  # the lag window opens: what is acknowledged now is on the primary only
    lag = leader.mark()
    i = lag
    for _ in range(LAG_ACKS):
        i, _ = leader.wait("ack", start=i, timeout=WAIT)
        i += 1
    pair.crash_primary()
    crashed = time.time()
    lost_acks = [e for e in leader.since(lag, "ack") if e["t"] <= crashed]
    assert len(lost_acks) >= LAG_ACKS

    pair.start_replica()
    promoted_after = pair.promote()
    promoted = time.time()

    # The leader comes back on the promoted replica: it notices the gap (its commit or renewal,
    # or its next take if its lease ran out in the outage) and leads anew, the gap reported.
    after = leader.mark()
    at, relead = leader.wait(
        "leading", start=after, timeout=WAIT, where=lambda e: e.get("lost") is not None
    )
    _, resumed = leader.wait("ack", start=at, timeout=WAIT)
    reported = relead["lost"]
    assert reported["epoch"] == first_epoch
    assert reported["commits"] is not None and reported["commits"] >= len(lost_acks)
    assert relead["epoch"] != first_epoch
    # Not one commit of the old term landed on the database that was behind it.
    old_term_after_crash = [
        e for e in leader.since(0, "ack") if e["epoch"] == first_epoch and e["t"] > crashed
    ]
    assert old_term_after_crash == []
    fenced = [e for e in leader.since(after, "fenced") if "acknowledged commits" in e["message"]]
    notes = [
        e
        for e in leader.since(0, "store_log")
        if "behind" in e["message"] or "gone" in e["message"]
    ]
    assert fenced or notes, leader.tail()
    summary = leader.stop()

    with SqlStore.open(pair.replica_url(db), StoreConfig(migrate=False)) as store:
        report = check(store, log)
    # The loss, measured by content: the lag window's submissions are gone, nothing else is.
    assert report.lost_submissions >= sum(len(e["ids"]) for e in lost_acks)
    assert report.partial == [] and report.fenced_visible == [] and report.unexplained == []
    assert report.inbox_duplicates == []
    _FIGURES[f"round {len(_FIGURES) + 1}"] = {
        "acked_batches": summary["acked_batches"],
        "acked_mutations_checked": report.acked_mutations,
        "lag_window_acked_batches": len(lost_acks),
        "lost_acked_submissions": report.lost_submissions,
        "lost_commits_reported": reported["commits"],
        "promotion_s": round(promoted_after, 3),
        "first_commit_after_promotion_s": round(resumed["t"] - promoted, 3),
        "stepped_down_by": "fence" if fenced else "renewal or take",
    }
