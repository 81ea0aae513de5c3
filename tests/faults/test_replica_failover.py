"""Failover to a synchronous replica loses nothing acknowledged.

A real leader process (the kit's driver) commits a logged workload and drains the inbox
through the multi-host URL (`target_session_attrs=read-write`) while app processes enqueue
into it; the primary crashes (`stop -m immediate`, or SIGKILL of the postmaster), the
synchronous replica is promoted, and the same leader process resumes committing and draining
without a restart, retrying what the outage made unavailable as an engine would. Afterwards
`cronoq_store.testing.check` holds the database to the log: 0 acknowledged mutations lost,
0 committed enqueues lost, no batch partial.

One round runs in the default suite; `--soak` runs more, both crash kinds alternating.
Figures are printed in the terminal summary.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from builders import wait_until
from drills import enqueuer
from figures import figures
from pgpair import PgPair

from cronoq_store import SqlStore, StoreConfig
from cronoq_store.testing import DriverProcess, check

pytestmark = pytest.mark.postgresql

TTL = 5.0
"""The leader's lease TTL: longer than a promotion, so it keeps its lease through one."""
ACKED_BEFORE = 300
"""Acknowledged mutations before the crash."""
ACKED_AFTER = 64
"""Acknowledged mutations after the promotion, before the round ends."""
APPS = 2
_FIGURES: dict[str, Any] = figures("cronoq replica failover figures")


def _acked(p: DriverProcess, start: int = 0) -> int:
    return sum(int(e.get("n", 0)) for e in p.since(start, "ack"))


def pair_leader(url: str, log: Path, tmp: Path, ttl: float = TTL) -> DriverProcess:
    """The leader process on a pair: a driver whose lease lasts `ttl` s, renewed four times."""
    return DriverProcess(
        url,
        log,
        name="leader",
        ttl=ttl,
        renew=ttl / 4,
        poll=0.05,
        batch=16,
        gap=0.01,
        duration=600,
        stderr_path=tmp / "leader.stderr",
    )


def _round(pair: PgPair, tmp: Path, kill: bool) -> dict[str, Any]:
    """One round on a fresh synchronous pair: its figures."""
    pair.fresh(sync=True)
    db = pair.create_database(f"cronoq_fo_{uuid.uuid4().hex[:10]}")
    SqlStore.open(pair.primary_url(db)).close()  # migrated before anyone starts
    url = pair.multi_url(db)
    log = tmp / f"acks-{db}.jsonl"
    leader = pair_leader(url, log, tmp)
    apps = [
        enqueuer(url, log, tmp / f"app{i}-{db}.stderr", name=f"app{i}", seed=i) for i in range(APPS)
    ]
    try:
        _, lead = leader.wait("leading", timeout=30)
        for app in apps:
            app.wait("started")
        wait_until(lambda: _acked(leader) >= ACKED_BEFORE, "acked before the crash", 60, 0.02)
        mark = leader.mark()
        crashed = time.time()
        pair.crash_primary(kill=kill)
        pair.promote()
        promoted = pair.promoted_at
        assert promoted is not None
        # The same process resumes, under the same lease if the outage was shorter than it.
        # (An ack after `mark` but before the promotion is a commit that landed on the old
        # primary as it went down.)
        _, first = leader.wait("ack", start=mark, timeout=60, where=lambda e: e["t"] >= promoted)
        wait_until(lambda: _acked(leader, mark) >= ACKED_AFTER, "acknowledged after", 60, 0.02)
        app_summaries = [app.stop() for app in apps]
        # The same leader drains what the apps committed, on the new primary.
        with SqlStore.open(url, StoreConfig(migrate=False)) as reader:
            wait_until(lambda: reader.read_inbox(limit=1) == [], "inbox drained", 60, 0.02)
            leader.wait("ack", start=leader.mark())
        leader_summary = leader.stop()
        assert leader_summary["errors"] == [], leader_summary["errors"]
    finally:
        for app in apps:
            app.close()
        leader.close()
    with SqlStore.open(url, StoreConfig(migrate=False)) as reader:
        report = check(reader, log)
    assert report.ok, json.dumps(report.as_dict(), indent=1)
    assert report.lost == [] and report.partial == []
    assert report.inbox_lost == [] and report.inbox_duplicates == []
    assert report.enqueued_committed > 0
    return {
        "crash": "sigkill" if kill else "stop -m immediate",
        "acked_mutations": report.acked_mutations,
        "acked_mutations_lost": len(report.lost),
        "enqueues_committed": report.enqueued_committed,
        "enqueues_lost": len(report.inbox_lost),
        "enqueues_unknown": report.enqueued_unknown,
        "same_epoch": first["epoch"] == lead["epoch"],
        "crash_to_promoted_s": round(promoted - crashed, 3),
        "promoted_to_first_commit_ms": round((first["t"] - promoted) * 1000, 1),
        "commits_unavailable": leader_summary.get("unavailable", 0),
        "failed_app_transactions": sum(s["failed"] for s in app_summaries),
    }


def _rounds(pg_pair: PgPair, tmp: Path, rounds: int) -> None:
    began = time.monotonic()
    results = [_round(pg_pair, tmp, kill=r % 2 == 1) for r in range(rounds)]
    _FIGURES["postgresql pair"] = {
        "rounds": rounds,
        "acked_mutations": sum(r["acked_mutations"] for r in results),
        "acked_mutations_lost": sum(r["acked_mutations_lost"] for r in results),
        "enqueues_committed": sum(r["enqueues_committed"] for r in results),
        "enqueues_lost": sum(r["enqueues_lost"] for r in results),
        "promoted_to_first_commit_ms": [r["promoted_to_first_commit_ms"] for r in results],
        "crash_to_promoted_s": [r["crash_to_promoted_s"] for r in results],
        "same_epoch": [r["same_epoch"] for r in results],
        "seconds": round(time.monotonic() - began, 1),
    }
    for r in results:
        print(json.dumps(r, sort_keys=True))


def test_sync_failover_loses_nothing(pg_pair: PgPair, tmp_path: Path) -> None:
    _rounds(pg_pair, tmp_path, rounds=1)


@pytest.mark.soak
@pytest.mark.timeout(1800)
def test_sync_failover_loses_nothing_soak(pg_pair: PgPair, tmp_path: Path) -> None:
    _rounds(pg_pair, tmp_path, rounds=10)
