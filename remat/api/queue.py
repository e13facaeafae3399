"""Who runs the jobs a server accepts: its own runner, or the workers behind a queue engine.

A job is always written to the store first; the queue only hands its id to a runner.

* :class:`LocalQueue` (SQLite and memory stores): the server's :class:`~remat.api.runner.
  LocalRunner` takes waiting jobs from the store whenever one of its workers is free. Servers
  and ``remat worker`` processes sharing one SQLite file share its jobs.
* :class:`~remat.api.queue_pg.ProcrastinateQueue` (PostgreSQL): the job id is deferred to
  procrastinate on the same database and ``remat worker`` processes, on any machines, run it.
"""

from __future__ import annotations

from typing import Protocol

from remat.api.pool import WorkerPool
from remat.api.runner import LocalRunner
from remat.api.settings import Settings
from remat.api.store import Store
from remat.api.store_factory import is_postgres


class JobQueue(Protocol):
    @property
    def free(self) -> int:
        """Jobs this server could start right now (admission counts them as not waiting)."""
        ...

    @property
    def local(self) -> bool:
        """True when this server's own pool runs the jobs."""
        ...

    async def start(self) -> None: ...

    async def enqueue(self, job_id: str) -> None:
        """Hand over a job already written to the store (queued)."""
        ...

    def cancel(self, job_id: str) -> None:
        """Stop the job at once if it runs here (the store already says cancelled)."""
        ...

    async def close(self) -> None: ...


class LocalQueue:
    """Jobs run by this server's pool, taken from the store (see :class:`LocalRunner`)."""

    local = True

    def __init__(self, store: Store, pool: WorkerPool, settings: Settings) -> None:
        self.runner = LocalRunner(store, pool, settings)

    @property
    def free(self) -> int:
        return self.runner.free

    async def start(self) -> None:
        await self.runner.start()

    async def enqueue(self, job_id: str) -> None:
        self.runner.poke()

    def cancel(self, job_id: str) -> None:
        self.runner.cancel(job_id)

    async def close(self) -> None:
        await self.runner.close()


def open_queue(settings: Settings, store: Store, pool: WorkerPool) -> JobQueue:
    """The queue for ``settings.db_url``: procrastinate on PostgreSQL, else the local runner."""
    if is_postgres(settings.db_url):
        from remat.api.queue_pg import ProcrastinateQueue

        return ProcrastinateQueue(settings.db_url)
    return LocalQueue(store, pool, settings)
