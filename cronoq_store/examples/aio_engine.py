"""The engine loop of `engine` on asyncio: the same core (`EngineCore`), an `AsyncSqlStore`,
and attempts as asyncio tasks of `async def` handlers (docs/engine.md, "On asyncio")."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from cronoq_store import Fenced, StoreUnavailable
from cronoq_store.aio import AsyncSqlStore

from .engine import INBOX_BATCH, EngineCore, Stats, Task

log = logging.getLogger(__name__)

AsyncHandler = Callable[[bytes], Awaitable[bytes | None]]
"""One attempt of a task of its kind, awaited: the payload in, the output (or None) out."""


class AsyncEngine(EngineCore):
    """One scheduler engine on an asyncio loop: the thread engine's loop, awaited."""

    def __init__(
        self, store: AsyncSqlStore, handlers: Mapping[str, AsyncHandler], **options: Any
    ) -> None:
        super().__init__(handlers, **options)
        self.store = store
        self.wake = asyncio.Event()
        self.attempts: set[asyncio.Task[None]] = set()

    async def run(self, stop: asyncio.Event, *, lead_timeout: float | None = None) -> Stats:
        """Lead, recover, and step until `stop` is set or leadership is lost; releases the
        lease when stopped. Returns what the term did."""
        lost = asyncio.Event()

        async def on_lost() -> None:  # awaited by the store when leadership ends
            lost.set()
            self.wake.set()

        self.store.on_leadership_lost(on_lost)
        epoch = await self.store.acquire_leadership(timeout=lead_timeout)
        self._begin(epoch)
        self._recover(await self.store.recover(self.base))
        last_prune = time.monotonic()
        while not stop.is_set() and not lost.is_set():
            try:
                await self._step(epoch)
                if time.monotonic() - last_prune > self.prune_every.total_seconds():
                    self.stats.pruned += await self.store.prune(self.retention)
                    last_prune = time.monotonic()
            except Fenced as exc:
                self.stats.lost = f"fenced: {exc}"
                break
            except StoreUnavailable as exc:
                log.warning("commit not known to have landed, retrying: %s", exc)
                await asyncio.sleep(0.1)
                continue
            await self._wait(stop)
        if lost.is_set() and self.stats.lost is None:
            self.stats.lost = "leadership lost"
        if self.attempts:  # running attempts finish; their results are not committed
            await asyncio.wait(self.attempts)
        if self.store.is_leader:
            await self.store.release_leadership()
        return self.stats

    async def _step(self, epoch: int) -> None:
        """As `Engine._step`: gather, commit, and only then start the attempts."""
        now = self.now()
        if not self.pending:
            self._gather(now, await self.store.read_inbox(limit=INBOX_BATCH, base=self.base))
        if self.pending or self.outputs:
            await self.store.commit(epoch, self.base, self.pending, self.outputs)
            self.stats.commits += 1
            self.pending, self.outputs = [], []
        for task in self.to_dispatch:
            attempt = asyncio.create_task(self._attempt(task))
            self.attempts.add(attempt)
            attempt.add_done_callback(self.attempts.discard)
        self.to_dispatch = []

    async def _attempt(self, task: Task) -> None:
        output: bytes | None = None
        error: BaseException | None = None
        try:
            output = await self.handlers[task.spec.kind](task.spec.payload)
        except Exception as exc:
            error = exc
        self._record(task, output, error)
        self.wake.set()

    async def _wait(self, stop: asyncio.Event) -> None:
        """Until an attempt finishes, an inbox item arrives, something comes due, or stop."""
        if self.done:
            return
        wait = self._next_wait()
        if wait <= 0 or stop.is_set():
            return
        self.wake.clear()
        inbox = asyncio.create_task(self.store.wait_inbox(timeout=wait))
        woken = asyncio.create_task(self.wake.wait())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({inbox, woken, stopped}, return_when=asyncio.FIRST_COMPLETED)
        for pending in (woken, stopped):
            pending.cancel()
        await asyncio.wait({inbox})  # the store's wait ends by its timeout at the latest
