"""Enqueuers: apps writing into the inbox in transactions of their own, rolling some back on
purpose and logging every outcome for `check` (`run_enqueuer`, or a process: `enqueuer_argv`).
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

from sqlalchemy import Engine, create_engine, make_url
from sqlalchemy import exc as sa_exc

from ..dialects import class_of, connect_options, parse_url
from ..errors import StoreUnavailable
from ..inbox import enqueue_many
from ..model import (
    TaskSpec,
)
from .acklog import AckLog
from .base import Emit, digest


@dataclass(slots=True, kw_only=True)
class EnqueuerSummary:
    """What an enqueuer did, printed as the `exit` event of a process."""

    run: str
    transactions: int = 0
    committed: int = 0
    """Items whose transaction committed."""
    rolled_back: int = 0
    """Items whose transaction was rolled back on purpose."""
    failed: int = 0
    """Transactions whose commit raised (their items' fate is unknown)."""
    errors: list[str] = field(default_factory=list)


def app_engine(url: str | os.PathLike[str]) -> Engine:
    """An app's own engine, set up as docs/embedding.md tells apps to (SQLite: busy timeout;
    PostgreSQL behind a transaction pooler: `?prepare_threshold=` in the URL becomes
    `connect_args={"prepare_threshold": None}`, as docs/deploying.md shows)."""
    target = os.fspath(url)
    parsed = parse_url(target) if "://" in target else make_url(f"sqlite:///{target}")
    if not class_of(parsed).server:  # a file: its writers wait on each other
        return create_engine(parsed, connect_args={"timeout": 30})
    parsed, connect_args = connect_options(parsed)
    return create_engine(parsed, connect_args=connect_args)


def run_enqueuer(
    url: str | os.PathLike[str],
    log_path: str | os.PathLike[str],
    *,
    rollback: float = 0.25,
    most: int = 3,
    keyed: float = 0.1,
    gap: float = 0.005,
    seed: int | None = None,
    stop_event: threading.Event | None = None,
    duration: float | None = None,
    emit: Emit | None = None,
) -> EnqueuerSummary:
    """Enqueue 1..`most` tasks per transaction until stopped, rolling back a `rollback` share
    of the transactions on purpose, logging every outcome to the shared log for `check`."""
    rng = random.Random(seed)
    stop = stop_event or threading.Event()
    summary = EnqueuerSummary(run=uuid.uuid4().hex[:12])
    deadline = None if duration is None else time.monotonic() + duration
    engine = app_engine(url)
    try:
        with AckLog(log_path) as ack_log:
            while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
                specs = [
                    TaskSpec(
                        payload=f"{summary.run}:{summary.transactions}:{n}".encode(),
                        kind="inbox",
                        key=f"ek{rng.randrange(4)}" if rng.random() < keyed else None,
                    )
                    for n in range(rng.randint(1, most))
                ]
                undo = rng.random() < rollback
                head = {"run": summary.run, "digests": [digest(s) for s in specs]}
                summary.transactions += 1
                try:
                    with engine.connect() as conn:
                        txn = conn.begin()
                        ids = enqueue_many(conn, specs)
                        ack_log.append(
                            {"type": "enqueue_intent", "inbox_ids": ids, **head}, sync=False
                        )
                        kind = "enqueue_rollback" if undo else "enqueue_ack"
                        if undo:
                            txn.rollback()
                        else:
                            txn.commit()
                    ack_log.append({"type": kind, "inbox_ids": ids, **head}, sync=True)
                    if undo:
                        summary.rolled_back += len(ids)
                    else:
                        summary.committed += len(ids)
                except (sa_exc.DBAPIError, StoreUnavailable) as exc:
                    # The app's own COMMIT raises the driver's error; `enqueue_many`, the
                    # store's (a connection cut mid-enqueue, a failover): either is a failed
                    # transaction an app retries, never the end of it.
                    summary.failed += 1
                    if emit is not None:
                        why = exc.orig if isinstance(exc, sa_exc.DBAPIError) else exc
                        emit({"event": "enqueue_failed", "message": str(why)[:300]})
                    stop.wait(0.05)
                    continue
                stop.wait(gap)
    finally:
        engine.dispose()
    return summary


def enqueuer_argv(
    url: str | os.PathLike[str],
    log_path: str | os.PathLike[str],
    *,
    rollback: float = 0.25,
    keyed: float = 0.1,
    seed: int | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The command of an enqueuer process (for `DriverProcess(argv=...)`)."""
    cmd = [python, "-m", "cronoq_store.testing", "enqueue", "--url", os.fspath(url)]
    cmd += ["--log", os.fspath(log_path), "--rollback", str(rollback), "--keyed", str(keyed)]
    cmd += ["--exit-with-parent"]
    return cmd + ([] if seed is None else ["--seed", str(seed)])
