"""The command line: `python -m cronoq_store.testing drive|check|enqueue` (see the package's
docstring for the events and signals).
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path

from ..errors import StoreError
from ..store import SqlStore, StoreConfig
from . import __doc__ as kit_doc  # the help text: the kit's overview
from .base import Event
from .checker import check
from .config import DriverConfig, HangPoint
from .driver import WorkloadDriver
from .enqueuer import run_enqueuer


def _emit_stdout(event: Event) -> None:
    sys.stdout.write(json.dumps(event, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def _store_config(args: argparse.Namespace) -> StoreConfig:
    ttl = timedelta(seconds=args.ttl)
    renew = timedelta(seconds=args.renew) if args.renew else ttl / 3
    poll = timedelta(seconds=args.poll) if args.poll else min(ttl / 10, timedelta(seconds=0.5))
    return StoreConfig(
        lease_ttl=ttl,
        lease_renew=renew,
        lock_poll=poll,
        transaction_pooler=args.transaction_pooler,
    )


def _handle_signals(
    stop_event: threading.Event,
    handlers: Mapping[signal.Signals, Callable[[], None]],
    *,
    exit_with_parent: bool,
) -> None:
    """SIGTERM and SIGINT set `stop_event`, the other signals call their handler, all on a
    thread of their own; with `exit_with_parent`, so does the parent's exit.

    A Python signal handler runs on the main thread between any two bytecodes, also while that
    thread holds the lock inside `Event.wait`: setting the Event there waits on its own thread
    forever (a stopped enqueuer once never exited). So the interpreter's C handler only writes
    the signal's number to a socket (`signal.set_wakeup_fd`) and a thread acts on it.
    """
    actions = {signal.SIGTERM: stop_event.set, signal.SIGINT: stop_event.set, **handlers}
    receiver, sender = socket.socketpair()
    sender.setblocking(False)
    signal.set_wakeup_fd(sender.fileno(), warn_on_full_buffer=False)
    for signum in actions:
        signal.signal(signum, lambda _sig, _frame: None)  # the wake-up byte is the signal

    def dispatch() -> None:
        with receiver, sender:  # the sender lives as long as the thread reading it
            while True:
                for signum in receiver.recv(64):
                    action = actions.get(signal.Signals(signum))
                    if action is not None:
                        action()

    threading.Thread(target=dispatch, daemon=True, name="signals").start()
    if exit_with_parent:
        parent = os.getppid()

        def watch() -> None:
            while not stop_event.wait(0.5):
                if os.getppid() != parent:
                    stop_event.set()

        threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def _drive(args: argparse.Namespace) -> int:
    config = DriverConfig(
        batch=args.batch,
        gap=args.gap,
        duration=args.duration,
        max_batches=args.max_batches,
        turn_batches=args.turn_batches,
        rest=args.rest,
        seed=args.seed,
        hang_at=HangPoint(args.hang_at) if args.hang_at else None,
        watch_statements=args.watch_statements,
    )
    # Signals are handled from the start: a SIGTERM while the store opens stops cleanly too.
    stop_event = threading.Event()
    drivers: list[WorkloadDriver] = []

    def pause() -> None:
        for driver in drivers:
            driver.request_pause()

    def arm() -> None:
        point = None
        if args.control:
            try:
                point = HangPoint(Path(args.control).read_text().strip())
            except (OSError, ValueError):
                point = None
        for driver in drivers:
            try:
                driver.arm_hang(point)
            except ValueError as exc:
                sys.stderr.write(f"cannot arm: {exc}\n")

    _handle_signals(
        stop_event,
        {signal.SIGUSR1: pause, signal.SIGUSR2: arm},
        exit_with_parent=args.exit_with_parent,
    )
    with SqlStore.open(args.url, _store_config(args)) as store:
        driver = WorkloadDriver(store, args.log, config, emit=_emit_stdout, stop_event=stop_event)
        drivers.append(driver)
        driver.emit({"event": "started", "holder": store.holder})
        try:
            driver.run()
        except StoreError:
            _emit_stdout({"event": "exit", **dataclasses.asdict(driver.summary)})
            return 2
    _emit_stdout({"event": "exit", **dataclasses.asdict(driver.summary)})
    return 0


def _enqueue(args: argparse.Namespace) -> int:
    stop_event = threading.Event()
    _handle_signals(stop_event, {}, exit_with_parent=args.exit_with_parent)
    _emit_stdout({"event": "started", "t": time.time()})
    summary = run_enqueuer(
        args.url,
        args.log,
        rollback=args.rollback,
        keyed=args.keyed,
        seed=args.seed,
        stop_event=stop_event,
        duration=args.duration,
        emit=_emit_stdout,
    )
    _emit_stdout({"event": "exit", **dataclasses.asdict(summary)})
    return 0


def _check(args: argparse.Namespace) -> int:
    with SqlStore.open(args.url, StoreConfig(migrate=False)) as store:
        report = check(store, args.log)
    _emit_stdout(report.as_dict())
    return 0 if report.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m cronoq_store.testing drive|check ...`.

    Args:
        argv: The arguments; `sys.argv[1:]` when None.

    Returns:
        The exit status: 0 when the run (or the check) succeeded.
    """
    parser = argparse.ArgumentParser(prog="python -m cronoq_store.testing", description=kit_doc)
    sub = parser.add_subparsers(dest="command", required=True)
    drive = sub.add_parser("drive", help="lead (or stand by) and commit a logged workload")
    check_p = sub.add_parser("check", help="compare a database with a workload log")
    enq = sub.add_parser("enqueue", help="enqueue into the inbox in transactions, logged")
    for p in (drive, check_p, enq):
        p.add_argument("--url", required=True, help="database URL or SQLite file path")
        p.add_argument("--log", required=True, help="the shared JSON-lines log")
    drive.add_argument("--ttl", type=float, default=10.0, help="lease TTL, seconds")
    drive.add_argument("--renew", type=float, default=None, help="lease renewal, seconds")
    drive.add_argument("--poll", type=float, default=None, help="standby poll, seconds")
    drive.add_argument("--batch", type=int, default=20, help="mutations per commit")
    drive.add_argument("--gap", type=float, default=0.0, help="seconds between commits")
    drive.add_argument("--duration", type=float, default=None, help="stop after, seconds")
    drive.add_argument("--max-batches", type=int, default=None)
    drive.add_argument("--turn-batches", type=int, default=None, help="release after N per term")
    drive.add_argument("--rest", type=float, default=0.2, help="rest after a release, seconds")
    drive.add_argument("--seed", type=int, default=None)
    drive.add_argument("--hang-at", choices=[p.value for p in HangPoint], default=None)
    drive.add_argument(
        "--control",
        default=None,
        help="file naming the hang point that SIGUSR2 arms (else --hang-at)",
    )
    drive.add_argument("--exit-with-parent", action="store_true")
    drive.add_argument(
        "--transaction-pooler",
        action="store_true",
        help="StoreConfig(transaction_pooler=True): the URL leads through a transaction pooler",
    )
    drive.add_argument(
        "--watch-statements",
        action="store_true",
        help=(
            "watch the engine's statements and COMMITs (the stop-in-* and after-tx-commit "
            "hang points need it)"
        ),
    )
    enq.add_argument("--rollback", type=float, default=0.25, help="share rolled back")
    enq.add_argument("--keyed", type=float, default=0.1, help="share with a key (may clash)")
    enq.add_argument("--seed", type=int, default=None)
    enq.add_argument("--duration", type=float, default=None, help="stop after, seconds")
    enq.add_argument("--exit-with-parent", action="store_true")
    drive.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    # A process that misses its exit tells where every thread is (`DriverProcess.stop`).
    faulthandler.register(signal.SIGQUIT, all_threads=True)
    if args.command == "drive":
        logging.basicConfig(level=args.log_level, stream=sys.stderr)
        return _drive(args)
    if args.command == "enqueue":
        return _enqueue(args)
    return _check(args)
