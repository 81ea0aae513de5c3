"""`DriverProcess`: a driver (or an enqueuer) in a process of its own, for tests and demos; a
thread reads its JSON events, signals steer it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .config import HangPoint


def _private_file(path: Path) -> int:
    """`path` opened for writing, emptied and 0600 whatever the umask, also if it existed: a
    driver's stderr may quote task data."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    return fd


class DriverProcessError(AssertionError):
    """A driver process did not report what was awaited in time, or exited first."""


class DriverProcess:
    """A `python -m cronoq_store.testing drive` process, its JSON events read by a thread.

    `wait` blocks (bounded) until an event arrives; `signal`, `kill`, `stop` and `close`
    control the process; `close` always reaps it.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        log_path: str | os.PathLike[str],
        *,
        name: str = "driver",
        ttl: float = 1.0,
        renew: float | None = None,
        poll: float | None = None,
        batch: int = 16,
        gap: float = 0.01,
        duration: float | None = 300.0,
        extra: Sequence[str] = (),
        stderr_path: str | os.PathLike[str] | None = None,
        control_path: str | os.PathLike[str] | None = None,
        python: str = sys.executable,
        umask: int = -1,
        argv: Sequence[str] | None = None,
    ) -> None:
        """`control_path`: a file through which `arm` names the hang point; `argv`: another
        command of this module to run instead of `drive` (an enqueuer: `enqueuer_argv`)."""
        self.name = name
        """Names the process in messages."""
        self.control_path = None if control_path is None else Path(control_path)
        """The file `arm` writes the hang point to, if any."""
        cmd = [python, "-m", "cronoq_store.testing", "drive", "--url", os.fspath(url)]
        cmd += ["--log", os.fspath(log_path), "--ttl", str(ttl), "--batch", str(batch)]
        cmd += ["--gap", str(gap), "--exit-with-parent"]
        if renew is not None:
            cmd += ["--renew", str(renew)]
        if poll is not None:
            cmd += ["--poll", str(poll)]
        if duration is not None:
            cmd += ["--duration", str(duration)]
        if self.control_path is not None:
            cmd += ["--control", str(self.control_path)]
        cmd += list(extra)
        if argv is not None:
            cmd = list(argv)
        self.events: list[dict[str, Any]] = []
        """Every event the process printed so far, in order."""
        self.stderr_path = None if stderr_path is None else Path(stderr_path)
        """Where the process's stderr goes (0600), if anywhere."""
        self._cond = threading.Condition()
        err = None if self.stderr_path is None else _private_file(self.stderr_path)
        try:
            self.proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=err if err is not None else subprocess.DEVNULL,
                umask=umask,
            )
            """The process itself."""
        finally:
            if err is not None:
                os.close(err)
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        """The process id."""
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                ev = {"event": "garbage", "line": line.decode(errors="replace")}
            if not isinstance(ev, dict):
                ev = {"event": "garbage", "line": repr(ev)}
            with self._cond:
                self.events.append(ev)
                self._cond.notify_all()
        with self._cond:
            self.events.append({"event": "eof", "t": time.time()})
            self._cond.notify_all()

    def mark(self) -> int:
        """The index the next event will have (to wait for events after now).

        Returns:
            The index of the next event.
        """
        with self._cond:
            return len(self.events)

    def wait(
        self,
        name: str,
        *,
        start: int = 0,
        timeout: float = 20.0,
        where: Callable[[dict[str, Any]], bool] | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """The first event `name` at or after index `start` (that satisfies `where`).

        Args:
            name: The event name.
            start: The first event index to look at.
            timeout: Seconds to wait at most.
            where: A test the event must pass; any event named `name` when None.

        Returns:
            The event's index and the event.

        Raises:
            DriverProcessError: No such event within `timeout`, or the process exited first.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            i = start
            while True:
                while i < len(self.events):
                    ev = self.events[i]
                    if ev.get("event") == name and (where is None or where(ev)):
                        return i, ev
                    if ev.get("event") == "eof" and name != "eof":
                        raise DriverProcessError(
                            f"{self.name} exited while waiting for {name}: {self.tail()}"
                        )
                    i += 1
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DriverProcessError(
                        f"{self.name}: no {name} event within {timeout} s: {self.tail()}"
                    )
                self._cond.wait(left)

    def since(self, start: int, name: str) -> list[dict[str, Any]]:
        """Events `name` from index `start` on.

        Args:
            start: The first event index to look at.
            name: The event name.

        Returns:
            The matching events, in order.
        """
        with self._cond:
            return [e for e in self.events[start:] if e.get("event") == name]

    def tail(self) -> str:
        """The last events and the end of stderr, for error messages.

        Returns:
            A few lines of text.
        """
        with self._cond:
            events = [json.dumps(e)[:300] for e in self.events[-8:]]
        err = ""
        if self.stderr_path is not None and self.stderr_path.exists():
            err = self.stderr_path.read_text(errors="replace")[-2000:]
        return "\n  events: " + "\n    ".join(events) + "\n  stderr: " + err

    def state(self) -> str:
        """The process state letter from /proc ("T" while stopped; "?" if unknown).

        Returns:
            The state letter.
        """
        try:
            stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        except OSError:
            return "?"
        return stat.rsplit(")", 1)[1].split()[0]

    def wait_stopped(self, timeout: float = 5.0) -> None:
        """Wait until the process is stopped (after it reported `pausing`).

        Args:
            timeout: Seconds to wait at most.

        Raises:
            DriverProcessError: It was not stopped within `timeout`.
        """
        deadline = time.monotonic() + timeout
        while self.state() != "T":
            if time.monotonic() > deadline:
                raise DriverProcessError(f"{self.name} did not stop within {timeout} s")
            time.sleep(0.005)

    def signal(self, sig: signal.Signals) -> None:
        """Send `sig` to the process.

        Args:
            sig: The signal number.
        """
        self.proc.send_signal(sig)

    def arm(self, point: HangPoint) -> None:
        """Make it hang at `point` the next time it gets there (needs `control_path`).

        Args:
            point: The hang point.

        Raises:
            ValueError: It was started without `control_path`.
        """
        if self.control_path is None:
            raise ValueError("arm needs a DriverProcess started with control_path")
        self.control_path.write_text(point.value)
        self.proc.send_signal(signal.SIGUSR2)

    def kill(self) -> float:
        """SIGKILL it and reap it; the wall-clock time the signal was sent.

        Returns:
            The wall-clock time (`time.time()`) the signal was sent.
        """
        t = time.time()
        self.proc.kill()
        self.proc.wait(10)
        return t

    def stop(self, timeout: float = 20.0) -> dict[str, Any]:
        """Stop it gracefully (SIGTERM: it releases the lease) and return its exit summary.

        Waits for it to have started first: before that, SIGTERM would just end it.

        Args:
            timeout: Seconds to wait for it to exit.

        Returns:
            Its exit summary event.

        Raises:
            DriverProcessError: It did not exit within `timeout` (its threads' stacks in
                the message).
        """
        self.wait("started", timeout=timeout)
        self.proc.send_signal(signal.SIGCONT)
        self.proc.send_signal(signal.SIGTERM)
        try:
            _, ev = self.wait("exit", timeout=timeout)
        except DriverProcessError as exc:
            raise DriverProcessError(f"{exc}\n  where it was:{self._stacks()}") from None
        self.proc.wait(timeout)
        return ev

    def _stacks(self, bound: float = 5.0) -> str:
        """Every thread's stack of a process that still runs (SIGQUIT: the kit's processes
        dump them to stderr), for the error of a missed exit."""
        if self.proc.poll() is not None or self.stderr_path is None:
            return " (exited, or no stderr file)"
        start = self.stderr_path.stat().st_size
        self.proc.send_signal(signal.SIGQUIT)
        deadline = time.monotonic() + bound
        text = ""
        while time.monotonic() < deadline:
            time.sleep(0.1)
            with self.stderr_path.open("rb") as f:
                f.seek(start)
                now = f.read().decode(errors="replace")
            if "most recent call first" in now and now == text:
                break  # the dump has stopped growing
            text = now
        return "\n" + text[-6000:]

    def close(self) -> None:
        """Kill it if it still runs, reap it, and close its pipe."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)
        self._reader.join(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> DriverProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
