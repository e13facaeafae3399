"""``remat worker --db URL``: a process that runs jobs and serves no HTTP.

Start any number, on any machines that reach the database. On PostgreSQL it is a procrastinate
worker (see :mod:`remat.api.queue_pg`); on a SQLite file it is the same
:class:`~remat.api.runner.LocalRunner` that ``remat serve`` embeds. Either way it solves in its
own pool of ``workers`` solver processes, each under the memory cap, and stops on SIGTERM or
SIGINT after giving its running jobs back to the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from remat.api.pool import WorkerPool
from remat.api.runner import LocalRunner, new_holder, retry_store, run_job
from remat.api.settings import Settings
from remat.api.store import Store
from remat.api.store_factory import is_postgres, open_store

log = logging.getLogger("remat.api")


def make_pool(settings: Settings, size: int | None = None) -> WorkerPool:
    return WorkerPool(
        settings.workers if size is None else size,
        max_queue=settings.max_queue,
        kill_grace_s=settings.kill_grace_s,
        plugins=settings.plugins,
        memory_bytes=settings.worker_memory_bytes,
        nice=settings.worker_nice,
    )


async def _sqlite(settings: Settings, store: Store, pool: WorkerPool) -> None:
    runner = LocalRunner(store, pool, settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await runner.start()
    log.warning("remat worker %s: taking jobs from %s", runner.holder, settings.db_url)
    try:
        await stop.wait()
    finally:
        await runner.close()


async def _postgres(settings: Settings, store: Store, pool: WorkerPool) -> None:
    from remat.api.queue_pg import TASK, defer, make_app, retry_stalled, wait_for_lease_s

    app = make_app(settings.db_url)
    holder = new_holder()
    lease_s = settings.job_lease_s

    @app.task(name=TASK)
    async def run(job_id: str) -> None:
        for _ in range(4):
            rec = await retry_store(
                store.take_job, job_id, holder, lease_s, settings.job_max_attempts
            )
            if rec is not None:
                try:
                    await run_job(store, pool, settings, rec, holder)
                except asyncio.CancelledError:
                    # This worker is stopping: run_job gave the job back; queue it again.
                    with contextlib.suppress(Exception):
                        await asyncio.shield(defer(app, job_id))
                    raise
                return
            cur = await retry_store(store.job, job_id)
            if cur is None or cur.status != "running":
                return  # finished, cancelled or failed: nothing to do
            # Its old runner's lease has not run out yet (procrastinate noticed the silence
            # first): wait for it, unless that runner is alive and keeps renewing it.
            await asyncio.sleep(wait_for_lease_s(cur.lease_until) + 0.1)

    async with app.open_async():
        stalled = asyncio.create_task(retry_stalled(app, lease_s))
        log.warning("remat worker %s: taking jobs from procrastinate", holder)
        try:
            await app.run_worker_async(
                concurrency=pool.size,
                update_heartbeat_interval=lease_s / 3,
                stalled_worker_timeout=lease_s,
                fetch_job_polling_interval=1.0,
                shutdown_graceful_timeout=0.0,
                delete_jobs="successful",
            )
        finally:
            stalled.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stalled


async def _main(settings: Settings) -> None:
    store = await asyncio.to_thread(open_store, settings.db_url)
    pool = make_pool(settings)
    await pool.start()
    try:
        if is_postgres(settings.db_url):
            await _postgres(settings, store, pool)
        else:
            await _sqlite(settings, store, pool)
    finally:
        await pool.close()
        store.close()


def run_worker(settings: Settings) -> None:
    """Run jobs until SIGTERM/SIGINT (the ``remat worker`` command)."""
    asyncio.run(_main(settings))
