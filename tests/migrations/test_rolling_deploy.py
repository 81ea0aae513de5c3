"""A rolling deploy, two builds side by side (issue 37, item 3), on every dialect: a leader of
the previous release (0.1.0, built from git history by scripts/previous-release) leads and
commits; this build migrates the database under it; a standby of this build waits; the old
leader exits and the standby takes over. Nothing the old leader acknowledged is lost, the schema
ends at this build's head, and what the old build finished after the upgrade (without a finish
time) is recovered, queried and pruned like anything else."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from builders import BASE, status, wait_until
from figures import figures
from sqlalchemy import URL, create_engine, func, select

from cronoq_store import ById, SqlStore, StoreConfig, TaskId, TaskStatus, migrate
from cronoq_store.schema import tasks

# Real processes, as the failover rounds: the range-end runs leave it out.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
LEADER = Path(__file__).resolve().parents[1] / "rolling_leader.py"
_FIGURES: dict[str, dict[str, object]] = figures("cronoq rolling deploy (0.1.0 leader, this build)")


@pytest.fixture(scope="module")
def previous_release() -> Iterator[Path]:
    """The previous release's source folder; removed after the module."""
    script = REPO / "scripts" / "previous-release"
    done = subprocess.run([script, "setup"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        why = done.stderr.strip() or done.stdout.strip()
        if os.environ.get("CI") or os.environ.get("CRONOQ_REQUIRE_DIALECTS"):
            pytest.fail(f"scripts/previous-release setup failed: {why}")
        pytest.skip(f"no previous release to run: {why}")
    try:
        yield Path(done.stdout.strip().splitlines()[-1])
    finally:
        subprocess.run([script, "clean"], check=False)


class OldLeader:
    """The previous release's leader process, and what it said."""

    def __init__(self, source: Path, url: str, workdir: Path) -> None:
        self.stop_file = workdir / "stop"
        self.stderr_file = workdir / "old-leader.stderr"
        env = os.environ | {"PYTHONPATH": str(source)}
        with self.stderr_file.open("wb") as stderr:
            self.proc = subprocess.Popen(  # cwd away from this tree: its package must not shadow
                [sys.executable, str(LEADER), url, str(self.stop_file)],
                cwd=workdir,
                env=env,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        self.lines: list[str] = []
        self.acked: list[int] = []
        self.at: list[float] = []  # when each ack was read (monotonic)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.strip())
            if line.startswith("acked "):
                self.at.append(time.monotonic())
                self.acked.append(int(line.split()[1]))

    def said(self, prefix: str) -> str | None:
        return next((line for line in self.lines if line.startswith(prefix)), None)

    def stop(self, timeout: float) -> int:
        self.stop_file.touch()
        code = self.proc.wait(timeout)
        self._reader.join(timeout)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def _stderr(old: OldLeader) -> str:
    return old.stderr_file.read_text(errors="replace")[-2000:]


def test_rolling_deploy_from_the_previous_release(
    previous_release: Path, db_url: URL, tmp_path: Path
) -> None:
    url = db_url.render_as_string(hide_password=False)
    old = OldLeader(previous_release, url, tmp_path)
    engine = create_engine(db_url)
    try:
        wait_until(lambda: old.said("ready") or old.proc.poll() is not None, "old leader", 60)
        assert old.said("ready") == "ready 0.1.0 0004_commit_seq", (old.lines, _stderr(old))
        wait_until(lambda: len(old.acked) >= 20 or old.proc.poll() is not None, "old commits", 60)

        # This build migrates the database under the old leader, which keeps committing.
        began, before = time.monotonic(), len(old.acked)
        migrate.upgrade(engine)
        ended, upgraded_at = time.monotonic(), len(old.acked)
        assert migrate.current_revision(engine) == migrate.head_revision()
        wait_until(
            lambda: len(old.acked) >= upgraded_at + 30 or old.proc.poll() is not None,
            "old commits after the upgrade",
            60,
        )
        assert old.said("error") is None, old.lines[-3:]
        gaps = [b - a for a, b in zip(old.at, old.at[1:], strict=False) if b > began and a < ended]
        _FIGURES[db_url.get_backend_name()] = {
            "upgrade_s": round(ended - began, 3),
            "old_commits_during_upgrade": upgraded_at - before,
            "old_worst_gap_during_upgrade_s": round(max(gaps, default=0.0), 3),
            # Commits of the old leader that failed (a deadlock with the migration on MariaDB,
            # say) and were tried again: nothing acknowledged is lost either way.
            "old_commit_retries": sum(line.startswith("retry") for line in old.lines),
        }

        # A standby of this build waits for the lease; the old leader exits and it takes over.
        config = StoreConfig(retention=timedelta(days=3650))  # the kit's times are in 2023
        with SqlStore.open(db_url, config) as new:
            taken: list[int] = []
            standby = threading.Thread(
                target=lambda: taken.append(new.acquire_leadership(timeout=60)), daemon=True
            )
            standby.start()
            time.sleep(0.2)  # the standby polls while the old leader still commits
            assert old.stop(timeout=60) == 0, (old.lines[-3:], _stderr(old))
            assert old.lines[-1] == "bye" and old.said("error") is None
            standby.join(60)
            assert taken, "the standby never took over"
            epoch = taken[0]

            acked = old.acked
            assert len(acked) >= upgraded_at + 30
            finished, live = set(acked[:-1]), {acked[-1]}
            with engine.connect() as conn:
                unstamped = conn.execute(
                    select(func.count()).where(
                        tasks.c.terminal == True,  # noqa: E712
                        tasks.c.finished_unix_ns.is_(None),
                    )
                ).scalar_one()
            # What the old build finished on the new schema: no finish time. At least 29 of
            # the 30 commits after the upgrade finished a task.
            assert unstamped >= 29

            # Recovered: every acknowledged task, live or finished.
            recovered = new.recover(BASE)
            assert {t.id for t in recovered.tasks} == live
            assert {t.id for t in recovered.terminal} == finished
            # Queried.
            last_finished = new.get_task(ById(id=TaskId(acked[-2])))
            assert last_finished is not None and last_finished.status is TaskStatus.SUCCEEDED
            assert len(new.list_finished(limit=len(acked) + 10)) == len(finished)
            # The new leader commits on, and finishes the old leader's live task.
            new.commit(epoch, BASE, [status(acked[-1], at=10**6)])
            # Pruned: everything finished, whoever finished it.
            assert new.prune(timedelta(0)) == len(acked)
            _FIGURES[db_url.get_backend_name()] |= {
                "old_commits": len(acked),
                "old_commits_after_upgrade": len(acked) - upgraded_at,
                "old_rows_without_finish_time": unstamped,
            }
            with engine.connect() as conn:
                assert conn.execute(select(func.count()).select_from(tasks)).scalar_one() == 0
        assert migrate.current_revision(engine) == migrate.head_revision()
    finally:
        old.kill()
        engine.dispose()
