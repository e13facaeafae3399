"""Whether the store can be written, probed in the background so ``/healthz`` never waits.

A write probe runs once a second in a thread of its own; ``/healthz`` answers from the latest
outcome at once, however busy the store or the server's threads are. A probe that fails, or
does not answer within ``store_timeout_s`` + 1 s, marks the store unavailable until one
succeeds again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor

from remat.api.store import Store, StoreUnavailable

PROBE_EVERY_S = 1.0


class StoreHealth:
    def __init__(self, store: Store, timeout_s: float) -> None:
        self.store = store
        self.timeout_s = timeout_s
        self.ok = True
        self.message = ""
        self.checked_at = 0.0
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="remat-health")
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.probe()
        self._task = asyncio.create_task(self._loop(), name="remat-store-health")

    async def probe(self) -> None:
        fut: Future[None] = self._thread.submit(self.store.ping)
        try:
            await asyncio.wait_for(asyncio.wrap_future(fut), self.timeout_s + 1)
            self.ok, self.message = True, ""
        except StoreUnavailable as exc:
            self.ok, self.message = False, str(exc)
        except TimeoutError:
            self.ok, self.message = False, "the store did not answer a write in time"
        self.checked_at = time.time()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(PROBE_EVERY_S)
            await self.probe()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._thread.shutdown(wait=False, cancel_futures=True)
