"""Jobs on PostgreSQL: procrastinate carries job ids from ``remat serve`` to ``remat worker``.

Why procrastinate: it is a maintained queue engine that lives in the same PostgreSQL database as
the store (no second service to run, back up or secure), takes jobs with ``FOR UPDATE SKIP
LOCKED`` and LISTEN/NOTIFY, and records a heartbeat per worker, so the jobs of a worker that
stopped heartbeating (killed, its machine gone) can be found and handed to another worker
(:func:`retry_stalled`). The job's own state (request, progress, result, lease) stays in the
store's ``remat_jobs`` table, where every replica reads it; the remat lease decides who may
write a job's outcome, so a job completes once even if procrastinate hands it out twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import procrastinate

from remat.api.store import StoreUnavailable

log = logging.getLogger("remat.api")

TASK = "remat.run_job"


def make_app(url: str) -> procrastinate.App:
    """A procrastinate app on the database ``url`` (not opened)."""
    return procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=url))


async def defer(app: procrastinate.App, job_id: str) -> None:
    try:
        await app.configure_task(TASK).defer_async(job_id=job_id)
    except Exception as exc:  # the driver's errors: connection refused, pool timeout, ...
        raise StoreUnavailable(f"the job queue is unavailable: {exc}") from None


class ProcrastinateQueue:
    """The server side: defers job ids; ``remat worker`` processes run them."""

    local = False
    free = 0

    def __init__(self, url: str) -> None:
        self.app = make_app(url)

    async def start(self) -> None:
        await self.app.open_async()

    async def enqueue(self, job_id: str) -> None:
        await defer(self.app, job_id)

    def cancel(self, job_id: str) -> None:
        pass  # the worker running it sees the cancel at its next lease renewal

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.app.close_async()


async def retry_stalled(app: procrastinate.App, lease_s: float) -> None:
    """Forever: hand the jobs of workers silent for ``lease_s`` back to the queue."""
    while True:
        await asyncio.sleep(max(0.2, lease_s / 2))
        try:
            stalled = await app.job_manager.get_stalled_jobs(
                seconds_since_heartbeat=lease_s, task_name=TASK
            )
        except Exception as exc:
            log.warning("cannot look for stalled jobs: %s", exc)
            continue
        for job in stalled:
            try:
                await app.job_manager.retry_job(job)
                log.warning("job %s: its worker stopped; handed to another", job.id)
            except Exception:  # another worker retried it first
                pass


def wait_for_lease_s(lease_until: float | None, now: float | None = None) -> float:
    """How long to wait before a job held on ``lease_until`` can be taken."""
    if lease_until is None:
        return 0.0
    return max(0.0, lease_until - (time.time() if now is None else now))
