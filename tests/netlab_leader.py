"""The leader of the network drills (tests/faults/test_netlab.py), run inside the lab's namespace.

    python tests/netlab_leader.py URL [async]

It opens the store at URL (lease_ttl 3 s, lease_renew 1 s, commit_timeout 2 s; with `async`
an `AsyncSqlStore` on an event loop of its own thread, whose longest stall counts as the
process's too), leads, and then obeys one command a line on stdin, answering with one JSON
line an event on stdout (times
on the system-wide monotonic clock, which the test shares):

    commit     one commit of a new task: {"ev": "ack"|"err", ...}
    loop       commits back to back, from a thread, until leadership is lost
    acquire    acquire_leadership(timeout=1): {"ev": "acquire", "took": s, "ok": bool}
    report     {"ev": "report", "stall": the longest gap of a 20 ms ticker, "acked": [...]},
               then exits

and on its own: {"ev": "acquired"} once it leads, {"ev": "lost", "t": ...} when leadership is
lost. Task ids are 1, 2, 3, ... in commit order.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from datetime import timedelta
from typing import Any

from builders import BASE  # this file's directory is first on sys.path

from cronoq_store import Fenced, SqlStore, StoreConfig, Submitted, TaskId, TaskSpec
from cronoq_store.aio import AsyncSqlStore

CONFIG = StoreConfig(
    lease_ttl=timedelta(seconds=3),
    lease_renew=timedelta(seconds=1),
    commit_timeout=timedelta(seconds=2),
    lock_poll=timedelta(milliseconds=200),
    migrate=False,
)

_out = threading.Lock()


def say(**event: Any) -> None:
    with _out:
        sys.stdout.write(json.dumps(event) + "\n")
        sys.stdout.flush()


class Ticker:
    """The longest any thread of this process stood still: a thread that ticks every 20 ms
    sees each stall of the interpreter (a call that holds the GIL) as a gap."""

    def __init__(self) -> None:
        self.stall = 0.0
        threading.Thread(target=self._tick, daemon=True).start()

    def _tick(self) -> None:
        last = time.monotonic()
        while True:
            time.sleep(0.02)
            now = time.monotonic()
            self.stall = max(self.stall, now - last - 0.02)
            last = now


class AsyncFace:
    """`AsyncSqlStore` behind blocking calls, on an event loop of its own thread, whose
    longest stall (a 20 ms ticker task) is watched too."""

    def __init__(self, url: str, ticker: Ticker) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.store: AsyncSqlStore = self.call(lambda: AsyncSqlStore.open(url, CONFIG))
        self.call(lambda: self._start_ticker(ticker))

    async def _start_ticker(self, ticker: Ticker) -> None:
        async def tick() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.02)
                now = time.monotonic()
                ticker.stall = max(ticker.stall, now - last - 0.02)
                last = now

        self._tick = asyncio.ensure_future(tick())

    def call(self, make: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
        return asyncio.run_coroutine_threadsafe(make(), self.loop).result()

    def on_leadership_lost(self, callback: Callable[[], None]) -> None:
        self.store.on_leadership_lost(callback)

    def acquire_leadership(self, timeout: float) -> int:
        return int(self.call(lambda: self.store.acquire_leadership(timeout=timeout)))

    def commit(self, epoch: int, base: Any, batch: Any) -> None:
        self.call(lambda: self.store.commit(epoch, base, batch))

    @property
    def is_leader(self) -> bool:
        return self.store.is_leader


def main() -> None:
    ticker = Ticker()
    store: Any
    if sys.argv[2:] == ["async"]:
        store = AsyncFace(sys.argv[1], ticker)
    else:
        store = SqlStore.open(sys.argv[1], CONFIG)
    store.on_leadership_lost(lambda: say(ev="lost", t=time.monotonic()))
    epoch = store.acquire_leadership(timeout=10)
    say(ev="acquired", epoch=epoch, t=time.monotonic())
    acked: list[int] = []
    next_id = iter(range(1, 1 << 30))
    spec = TaskSpec(payload=b"drill")

    def commit() -> bool:
        n = next(next_id)
        start = time.monotonic()
        try:
            store.commit(epoch, BASE, [Submitted(id=TaskId(n), seq=n, arrival=n, spec=spec)])
        except Fenced as exc:
            say(ev="err", id=n, start=start, end=time.monotonic(), type="Fenced", msg=str(exc))
            return False
        except Exception as exc:
            say(ev="err", id=n, start=start, end=time.monotonic(), type=type(exc).__name__,
                msg=str(exc))  # fmt: skip
            return store.is_leader
        acked.append(n)
        say(ev="ack", id=n, start=start, end=time.monotonic())
        return True

    def loop() -> None:
        while commit():
            pass

    for line in sys.stdin:
        command = line.strip()
        if command == "commit":
            commit()
        elif command == "loop":
            threading.Thread(target=loop, daemon=True).start()
        elif command == "acquire":
            start = time.monotonic()
            try:
                store.acquire_leadership(timeout=1)
                ok = True
            except Exception:
                ok = False
            say(ev="acquire", took=time.monotonic() - start, ok=ok)
        elif command == "report":
            say(ev="report", stall=ticker.stall, acked=acked)
            break
    # No close: a release would wait on the cut link; the process just ends.


if __name__ == "__main__":
    main()
