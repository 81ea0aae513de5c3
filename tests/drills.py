"""What the process drills share (`faults/test_failover.py`, `dialects/test_pooler.py`,
`dialects/test_galera.py`): driver processes started and always reaped (conftest.py's `spawn`
on the drills' timings), which of them leads, and the first standby to take over once the
leader is gone."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import URL

from cronoq_store.testing import DriverProcess, enqueuer_argv

__all__ = [
    "EVENT_TIMEOUT",
    "POLL",
    "RENEW",
    "TAKEOVER_BOUND",
    "TTL",
    "Driver",
    "Event",
    "Spawn",
    "enqueuer",
    "first_to_lead",
    "roles",
    "starting",
]

TTL = float(os.environ.get("CRONOQ_FAILOVER_TTL", "1.0"))
"""Lease TTL of the drivers, seconds: short, so that rounds are cheap."""
RENEW = TTL / 4
POLL = 0.05
"""Standby poll (lock_poll), seconds."""
TAKEOVER_BOUND = TTL + POLL + 1.0
"""A standby must lead within this long after the leader stopped or died."""
EVENT_TIMEOUT = 20.0
"""Upper bound for anything that should happen within a second or two (start-up included)."""

Driver = DriverProcess
Spawn = Callable[..., Driver]
Event = dict[str, Any]


@contextlib.contextmanager
def starting(
    tmp_path: Path, *, ttl: float, renew: float, poll: float, duration: float, control: bool
) -> Iterator[Spawn]:
    """`start(name, url, log, *extra)`: a driver process with these timings (its stderr, and
    with `control` its hang-point file, under `tmp_path`); all are reaped on the way out."""
    started: list[Driver] = []

    def start(name: str, url: URL | str, log: Path, *extra: str) -> Driver:
        driver = DriverProcess(
            url if isinstance(url, str) else url.render_as_string(hide_password=False),
            log,
            name=name,
            ttl=ttl,
            renew=renew,
            poll=poll,
            batch=16,
            gap=0.01,
            duration=duration,  # a bound only: --exit-with-parent ends orphans
            extra=extra,
            stderr_path=tmp_path / f"{name}.stderr",
            control_path=tmp_path / f"{name}.control" if control else None,
            umask=0o022,
        )
        started.append(driver)
        return driver

    try:
        yield start
    finally:
        for driver in started:
            driver.close()


def enqueuer(url: str, log: Path, stderr_path: Path, *, name: str, seed: int) -> Driver:
    """An app process that enqueues (and rolls a quarter of its transactions back) beside the
    drivers, logging what it committed to `log` for `check`."""
    return DriverProcess(
        url,
        log,
        name=name,
        argv=enqueuer_argv(url, log, rollback=0.25, seed=seed),
        stderr_path=stderr_path,
    )


def state(p: Driver) -> str:
    """ "leading" once it committed in its current term; else "standby", "starting", "lost"...

    A loss reported after its "standby" event (the keeper's report racing the fenced commit)
    belongs to the previous term.
    """
    now, acked, lost = "starting", False, False
    for e in list(p.events):
        name = e.get("event")
        if name in ("standby", "leading"):
            now, acked, lost = name, False, False
        elif name == "ack":
            acked = True
        elif name == "leadership_lost":
            lost = True
        elif name == "eof":
            now = "exited"
    if now == "leading":
        return "lost" if lost else ("leading" if acked else "taking over")
    return now


def roles(procs: list[Driver], timeout: float = EVENT_TIMEOUT) -> tuple[Driver, list[Driver]]:
    """The one process that leads (and has committed), once one other stands by.

    Waiting for this at the start of every round keeps the rounds right when a leader stepped
    down on its own (a renewal that could not finish within the TTL on a loaded machine).
    """
    deadline = time.monotonic() + timeout
    while True:
        states = [state(p) for p in procs]
        if states.count("leading") == 1 and "standby" in states:
            leader = procs[states.index("leading")]
            return leader, [p for p in procs if p is not leader]
        assert time.monotonic() < deadline, f"no clear leader within {timeout} s: {states}"
        time.sleep(0.01)


def first_to_lead(
    standbys: Sequence[Driver], marks: Sequence[int], within: float
) -> tuple[Driver, Event]:
    """The first of `standbys` to report "leading" after its mark, and that event; fails when
    none does within `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        assert time.monotonic() < deadline, "no standby took over"
        winners = [
            (s, e) for s, m in zip(standbys, marks, strict=True) for e in s.since(m, "leading")
        ]
        if winners:
            return winners[0]
        time.sleep(0.01)
