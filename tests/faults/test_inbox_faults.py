"""Exactly once from inbox to task, under real process faults, on every dialect.

App processes (`python -m cronoq_store.testing enqueue`) enqueue 1-3 tasks per transaction and
roll a quarter of their transactions back, while leader processes (`... drive`, which drain the
inbox as an engine would) are SIGKILLed or SIGSTOPped and standbys take over. At the end
`cronoq_store.testing.check` holds every committed enqueue to exactly one task or one drop,
none from a rolled-back transaction, none twice and none lost, besides its usual checks.

Figures per dialect are printed in the terminal summary and written to
`$CRONOQ_INBOX_FAULTS_SUMMARY` (default /tmp/cronoq_inbox_faults_summary.json).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from builders import wait_until
from drills import TAKEOVER_BOUND, Spawn, enqueuer, roles
from figures import figures, rounds
from sqlalchemy import URL
from test_failover import reader

from cronoq_store.testing import check
from cronoq_store.testing.config import HangPoint

__all__ = ["reader"]  # a fixture, shared with test_failover

SUMMARY_PATH = Path(
    os.environ.get("CRONOQ_INBOX_FAULTS_SUMMARY", "/tmp/cronoq_inbox_faults_summary.json")
)
APPS = 3
DRAIN_TIMEOUT = 60.0
_FIGURES: dict[str, dict[str, Any]] = figures("cronoq inbox fault figures", SUMMARY_PATH)


def _rounds(
    dialect: str, db_url: URL, tmp_path: Path, spawn: Spawn, reader: Any, rounds: int
) -> None:
    began = time.monotonic()
    log = tmp_path / "acks.jsonl"
    url = db_url.render_as_string(hide_password=False)
    # Watching COMMITs: a kill lands between a commit and what follows it (AFTER_TX_COMMIT).
    procs = [spawn(f"d{i}", db_url, log, "--watch-statements") for i in range(2)]
    everyone = list(procs)
    roles(procs)  # migrated, one leads: the apps may start
    apps = [
        enqueuer(url, log, tmp_path / f"app{i}.stderr", name=f"app{i}", seed=i) for i in range(APPS)
    ]
    faults = {"sigkill": 0, "sigkill_after_tx_commit": 0, "sigstop": 0}
    try:
        for app in apps:
            app.wait("started")
        for r in range(rounds):
            leader, standbys = roles(procs)
            leader.wait("ack", start=leader.mark(), where=lambda e: e.get("inbox", 0) > 0)
            marks = [s.mark() for s in standbys]
            if r % 4 == 2:
                # Right after a COMMIT of a commit, before anything follows it: were the
                # inbox rows deleted in a transaction of their own, they would stay behind.
                mark = leader.mark()
                leader.arm(HangPoint.AFTER_TX_COMMIT)
                leader.wait("hang", start=mark, where=lambda e: e["point"] == "after-tx-commit")
                leader.kill()
                faults["sigkill_after_tx_commit"] += 1
            elif r % 2 == 0:
                leader.kill()
                faults["sigkill"] += 1
            else:
                # SIGSTOP where it holds no connection (a process stopped inside a SQLite
                # write transaction would hold every writer, apps included, until resumed).
                mark = leader.mark()
                leader.signal(signal.SIGUSR1)
                leader.wait("pausing", start=mark)
                leader.wait_stopped()
                faults["sigstop"] += 1
            deadline = time.monotonic() + TAKEOVER_BOUND + 10
            while not any(s.since(m, "leading") for s, m in zip(standbys, marks, strict=True)):
                assert time.monotonic() < deadline, "no standby took over"
                time.sleep(0.01)
            if r % 2 == 0:
                leader.close()
                procs = [p for p in procs if p is not leader] + [
                    spawn(f"d{len(everyone)}", db_url, log, "--watch-statements")
                ]
                everyone.append(procs[-1])
            else:
                time.sleep(0.2)
                leader.signal(signal.SIGCONT)  # it finds itself fenced and stands by
        summaries = [app.stop() for app in apps]
        assert all(s["errors"] == [] for s in summaries)
        # The leader drains what the apps left.
        wait_until(lambda: reader.read_inbox(limit=1) == [], "inbox drained", DRAIN_TIMEOUT, 0.05)
        leader, _ = roles(procs)
        leader.wait("ack", start=leader.mark())
        for d in procs:
            assert d.stop()["errors"] == []
    finally:
        for app in apps:
            app.close()
    report = check(reader, log)
    assert report.ok, json.dumps(report.as_dict(), indent=1)
    assert report.enqueued_committed > 0 and report.enqueued_rolled_back > 0
    assert report.inbox_waiting == 0
    # Every committed enqueue was consumed once; unknown outcomes (a commit that raised) at
    # most once, which check() already holds.
    assert report.inbox_tasks + report.inbox_drops >= report.enqueued_committed
    fig = _FIGURES.setdefault(dialect, {})
    fig.update(
        {
            "rounds": rounds,
            "faults": faults,
            "app_transactions": sum(s["transactions"] for s in summaries),
            "enqueues_committed": report.enqueued_committed,
            "enqueues_rolled_back": report.enqueued_rolled_back,
            "enqueues_unknown": report.enqueued_unknown,
            "tasks_made": report.inbox_tasks,
            "dropped_live_key": report.inbox_drops,
            "duplicates": len(report.inbox_duplicates),
            "lost": len(report.inbox_lost),
            "from_rolled_back": len(report.inbox_from_rolled_back),
            "failed_app_commits": sum(s["failed"] for s in summaries),
            "acked_batches": report.acked_batches,
            "fenced_batches": report.fenced_batches,
            "seconds": round(time.monotonic() - began, 1),
        }
    )


@pytest.mark.parametrize("rounds", rounds(4, 40))
def test_inbox_exactly_once_under_faults(
    dialect: str, db_url: URL, tmp_path: Path, spawn: Spawn, reader: Any, rounds: int
) -> None:
    _rounds(dialect, db_url, tmp_path, spawn, reader, rounds)
