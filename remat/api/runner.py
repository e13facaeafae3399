"""Running jobs: take one from the store on a lease, solve it in the worker pool, write it once.

:func:`run_job` is the one way a job runs, whichever queue handed it over: the embedded
:class:`LocalRunner` (SQLite or memory store: it claims the oldest waiting job whenever a pool
worker is free) or the procrastinate worker of :mod:`remat.api.queue_pg` (PostgreSQL).

While a job runs its lease is renewed every ``job_lease_s / 3``; a renewal that finds the job
cancelled (by any server) or taken over stops the solve at once by killing its worker process.
The outcome is written only by the lease holder, retried while the store is unavailable, so a
finished job is never left ``running``; if the store stays down past the lease, another runner
takes the job and runs it again (it still completes once).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import socket
import time
import uuid
from typing import Any

from remat.api.pool import QueueFull, WorkerCrashed, WorkerPool, WorkerTimeout
from remat.api.settings import Settings
from remat.api.store import JobRecord, Store, StoreUnavailable

log = logging.getLogger("remat.api")

SHUTDOWN_MESSAGE = "the server shut down while it ran; re-queued"


def new_holder() -> str:
    """A runner id: machine, process and a random part (pids are reused)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def holder_is_dead(holder: str) -> bool:
    """True when ``holder`` names a process of this machine that no longer runs."""
    host, _, rest = holder.partition(":")
    pid_text = rest.split(":", 1)[0]
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


async def retry_store(fn: Any, *args: Any, give_up_s: float = 600.0, **kwargs: Any) -> Any:
    """Call ``fn`` in a thread until the store answers (backing off to 5 s between tries)."""
    delay = 0.1
    end = time.monotonic() + give_up_s
    while True:
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except StoreUnavailable as exc:
            if time.monotonic() > end:
                raise
            log.warning("store unavailable, retrying in %.1f s: %s", delay, exc)
            await asyncio.sleep(delay)
            delay = min(5.0, delay * 2)


async def run_job(
    store: Store, pool: WorkerPool, settings: Settings, rec: JobRecord, holder: str
) -> bool:
    """Run a job already taken by ``holder``; True when this call wrote its outcome.

    A ``CancelledError`` (the runner is shutting down) gives the job back to the queue without
    using up an attempt.
    """
    lease_s = settings.job_lease_s
    # Counted as waiting for a worker from the start, so a runner never takes more jobs than
    # its pool has workers (taken jobs were accepted earlier: never refused for the queue).
    pool.admit(force=True)
    try:
        task: dict[str, Any] = json.loads(rec.request)
        deadline = float(task.pop("deadline_s"))
        graph = await retry_store(store.graph_json, rec.owner, rec.graph_id)
    except BaseException:
        pool.unadmit()
        raise
    if graph is None:
        pool.unadmit()
        return bool(
            await retry_store(
                store.finish_job,
                rec.id,
                holder,
                status="failed",
                error="its graph is no longer stored",
            )
        )
    task["graph"] = graph
    started = time.monotonic()

    def on_progress(p: dict[str, Any]) -> None:
        p.setdefault("elapsed_s", time.monotonic() - started)
        with contextlib.suppress(StoreUnavailable):  # progress is best effort
            store.update_job(rec.id, progress=json.dumps(p), only_if=("running",))

    solve = asyncio.ensure_future(
        pool.run(task, time_limit_s=deadline, on_progress=on_progress, admitted=True)
    )
    lost = False
    try:
        while True:
            done, _ = await asyncio.wait({solve}, timeout=lease_s / 3)
            if done:
                break
            try:
                mine = await asyncio.to_thread(store.renew_lease, rec.id, holder, lease_s)
            except StoreUnavailable:
                continue  # keep solving; the lease may still hold when the store is back
            if not mine:  # cancelled, or another runner has it: stop the solver now
                lost = True
                solve.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await solve
                return False
        out = solve.result()
    except asyncio.CancelledError:
        if not solve.done():
            solve.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await solve
        if not lost:
            with contextlib.suppress(StoreUnavailable):
                await asyncio.shield(
                    asyncio.to_thread(store.release_job, rec.id, holder, SHUTDOWN_MESSAGE)
                )
        raise
    except (WorkerCrashed, WorkerTimeout, QueueFull) as exc:
        return await _finish(store, rec, holder, status="failed", error=str(exc))
    except Exception as exc:
        log.exception("job %s", rec.id)
        return await _finish(
            store, rec, holder, status="failed", error=f"{type(exc).__name__}: {exc}"
        )
    if "error" in out:
        e = out["error"]
        loc = ".".join(str(p) for p in e["loc"])
        return await _finish(store, rec, holder, status="failed", error=f"{loc}: {e['msg']}")
    if "crash" in out:
        error = f"the solver failed: {out['crash']}"
        return await _finish(store, rec, holder, status="failed", error=error)
    wrote = await _finish(store, rec, holder, status="done", result=out["ok"])
    if wrote and out.get("cacheable"):
        with contextlib.suppress(StoreUnavailable):
            await retry_store(store.put_cached, rec.request_key, out["ok"], give_up_s=30)
    return wrote


async def _finish(store: Store, rec: JobRecord, holder: str, **fields: Any) -> bool:
    try:
        return bool(await retry_store(store.finish_job, rec.id, holder, **fields))
    except StoreUnavailable:
        log.error("job %s: its outcome could not be written; its lease will run out", rec.id)
        return False


class LocalRunner:
    """Claims waiting jobs from the store whenever a worker of ``pool`` is free.

    Used by ``remat serve`` on SQLite or memory stores and by ``remat worker`` on SQLite: any
    number of them may share one SQLite file. :meth:`poke` wakes it when a job is submitted
    here; jobs submitted elsewhere are seen within ``poll_s``.
    """

    def __init__(
        self, store: Store, pool: WorkerPool, settings: Settings, *, poll_s: float = 0.5
    ) -> None:
        self.store = store
        self.pool = pool
        self.settings = settings
        self.poll_s = poll_s
        self.holder = new_holder()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._running: dict[str, asyncio.Task[bool]] = {}

    @property
    def free(self) -> int:
        return max(0, self.pool.size - self.pool.busy - self.pool.waiting)

    async def start(self) -> None:
        """Take over the jobs of dead runners of this machine at once (their leases need not
        run out), take the first jobs, then keep taking them in the background."""
        for rec in await retry_store(self.store.unfinished_jobs, give_up_s=30):
            if rec.status == "running" and rec.holder and holder_is_dead(rec.holder):
                await retry_store(self.store.expire_lease, rec.id, rec.holder, give_up_s=30)
        await self._take()
        self._loop_task = asyncio.create_task(self._loop(), name="remat-runner")

    def poke(self) -> None:
        self._wake.set()

    def cancel(self, job_id: str) -> None:
        """Stop a job this runner runs now (others notice the cancel at their next renewal)."""
        t = self._running.get(job_id)
        if t is not None:
            t.cancel()

    async def _loop(self) -> None:
        while True:
            await self._take()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_s)
            self._wake.clear()

    async def _take(self) -> None:
        s = self.settings
        while self.free > 0:
            try:
                rec = await asyncio.to_thread(
                    self.store.claim_job, self.holder, s.job_lease_s, s.job_max_attempts
                )
            except StoreUnavailable as exc:
                log.warning("cannot take jobs: %s", exc)
                break
            if rec is None:
                break
            t = asyncio.create_task(
                run_job(self.store, self.pool, s, rec, self.holder), name=f"job-{rec.id}"
            )
            self._running[rec.id] = t
            t.add_done_callback(functools.partial(self._done, rec.id))
            await asyncio.sleep(0)  # let it reach the pool before counting free workers

    def _done(self, job_id: str, t: asyncio.Task[bool]) -> None:
        self._running.pop(job_id, None)
        if not t.cancelled() and t.exception() is not None:
            log.error("job runner failed: %r", t.exception())
        self._wake.set()  # a worker is free again

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        tasks = list(self._running.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
