"""The kit's processes stop on SIGTERM wherever their main thread is.

A Python signal handler runs on the main thread between two bytecodes, also while that thread
holds the lock inside `threading.Event.wait`; a handler that sets that Event then waits for a
lock its own thread holds, forever. Each test here puts the main thread exactly there and sends
the signal: a process that deadlocks misses its bounded exit.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

EXIT_BOUND = 20.0  # seconds; the process needs well under one

# Holds the stop event's lock (where `Event.wait` holds it), signals itself, runs bytecodes
# (where the interpreter calls a Python handler), releases it and waits for the stop.
_IN_THE_WINDOW = """
import os, signal, threading

def in_the_window(stop: threading.Event) -> None:
    with stop._cond:
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100_000):
            pass
    if not stop.wait(10):
        raise SystemExit("the stop event was never set")
"""

_ENQUEUE = """
from cronoq_store.testing import command
from cronoq_store.testing.enqueuer import EnqueuerSummary

def fake_run_enqueuer(url, log, *, stop_event, **_):
    in_the_window(stop_event)
    return EnqueuerSummary(run="fake")

command.run_enqueuer = fake_run_enqueuer
raise SystemExit(command.main(["enqueue", "--url", DB, "--log", LOG]))
"""

_DRIVE = """
from cronoq_store.testing import command

class Driver(command.WorkloadDriver):
    def run(self):
        in_the_window(self.stop_event)
        return self.summary

command.WorkloadDriver = Driver
raise SystemExit(command.main(["drive", "--url", DB, "--log", LOG]))
"""


@pytest.mark.sqlite  # the drive process opens a SQLite store
@pytest.mark.parametrize("body", [_ENQUEUE, _DRIVE], ids=["enqueue", "drive"])
def test_sigterm_while_the_main_thread_holds_the_stop_events_lock(
    body: str, tmp_path: Path
) -> None:
    paths = f"DB = {str(tmp_path / 'k.db')!r}\nLOG = {str(tmp_path / 'k.jsonl')!r}\n"
    script = textwrap.dedent(_IN_THE_WINDOW) + paths + textwrap.dedent(body)
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=EXIT_BOUND
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"no exit within {EXIT_BOUND} s of SIGTERM: the handler deadlocked")
    assert done.returncode == 0, done.stderr
    events = [json.loads(line)["event"] for line in done.stdout.splitlines()]
    assert events[0] == "started" and events[-1] == "exit", done.stdout


@pytest.mark.sqlite
def test_a_missed_exit_reports_where_each_thread_was(tmp_path: Path) -> None:
    """`stop` on a process that does not exit fails with every thread's stack in the error."""
    from cronoq_store.testing import DriverProcess, DriverProcessError, HangPoint

    with DriverProcess(
        tmp_path / "k.db",
        tmp_path / "k.jsonl",
        stderr_path=tmp_path / "k.stderr",
        control_path=tmp_path / "k.control",
    ) as proc:
        proc.wait("ack")
        proc.arm(HangPoint.AFTER_ACK)  # it sleeps there, deaf to SIGTERM, until killed
        proc.wait("hang")
        with pytest.raises(DriverProcessError) as failed:
            proc.stop(timeout=1.0)
    message = str(failed.value)
    assert "no exit event within 1.0 s" in message
    assert "most recent call first" in message and "in _hang" in message, message
