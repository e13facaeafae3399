"""Where the service keeps graphs, cached results and jobs, behind one small interface.

:class:`Store` is the interface; :class:`MemoryStore` (nothing persists),
:class:`~remat.api.store_sqlite.SQLiteStore` (the default, one file created on first use) and
:class:`~remat.api.store_pg.PostgresStore` (several machines) implement it, and
:func:`remat.api.store_factory.open_store` picks one from a database URL (this module imports
neither concrete store, so the stores can import it).

Every method is synchronous and thread-safe; the service calls them from worker threads so the
event loop never waits on the disk. Payloads (graph JSON, results, progress) are stored as JSON
text and never re-parsed here. A store that cannot be reached or written raises
:class:`StoreUnavailable` (the service answers 503 with ``Retry-After``), never the driver's own
error.

Ownership: graphs and jobs belong to an *owner* (a digest of the API key, or ``""`` when the
service runs without keys); lookups by another owner find nothing. Cached results are keyed by a
digest of the whole request, owner included, so one caller's results never answer another's.

Jobs and leases: a runner takes a job with :meth:`Store.claim_job` (the oldest one waiting) or
:meth:`Store.take_job` (one named by the queue engine). Taking sets it ``running`` with the
runner's ``holder`` id and a lease that the runner renews (:meth:`Store.renew_lease`) while it
works. A job whose lease ran out (its runner died with its machine, process or server) is taken
again by the next runner, unless it has started ``max_attempts`` times already: then it is
failed with the reason. Only the holder can finish a job (:meth:`Store.finish_job`), so a job
completes once even when a runner thought lost comes back.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Literal, Protocol

from remat.ir import RematError

JobStatus = Literal["queued", "running", "done", "failed", "cancelled"]
JobKind = Literal["solve", "frontier"]
UNFINISHED: tuple[JobStatus, ...] = ("queued", "running")

REQUEUED = "re-queued after a server restart or a lost worker (its lease ran out while running)"


class StoreUnavailable(RematError):
    """The database cannot be reached or written just now (the request may be retried)."""


@dataclass(frozen=True)
class JobRecord:
    """One job as stored. ``request`` is the normalised request JSON the worker runs;
    ``holder`` and ``lease_until`` (epoch seconds) name the runner that has it while it runs."""

    id: str
    owner: str
    kind: JobKind
    status: JobStatus
    graph_id: str
    request: str
    request_key: str
    created_at: float
    updated_at: float
    attempts: int = 0
    progress: str | None = None
    result: str | None = None
    error: str | None = None
    message: str = ""
    holder: str | None = None
    lease_until: float | None = None


class Store(Protocol):
    """The persistence interface of the service."""

    def put_graph(self, owner: str, graph_id: str, graph_json: str, summary_json: str) -> bool:
        """Store a graph; False when this owner already has it (nothing changes)."""
        ...

    def graph_summary(self, owner: str, graph_id: str) -> str | None: ...

    def graph_json(self, owner: str, graph_id: str) -> str | None: ...

    def cached(self, request_key: str) -> str | None: ...

    def put_cached(self, request_key: str, result_json: str) -> None: ...

    def create_job(self, job: JobRecord) -> bool:
        """Write a new job; False when a job with its id exists (nothing changes): a request
        sent again with its ``Idempotency-Key`` names the job it made the first time."""
        ...

    def job(self, job_id: str, owner: str | None = None) -> JobRecord | None:
        """The job, or None; with ``owner`` given, only that owner's job."""
        ...

    def jobs(self, owner: str, limit: int = 100) -> list[JobRecord]:
        """This owner's jobs, newest first."""
        ...

    def update_job(
        self, job_id: str, *, only_if: tuple[JobStatus, ...] | None = None, **fields: object
    ) -> bool:
        """Set fields of a job (status, attempts, progress, result, error, message); with
        ``only_if``, only when its status is one of those. True when a row changed."""
        ...

    def unfinished_jobs(self) -> list[JobRecord]:
        """Jobs queued or running, oldest first."""
        ...

    def count_queued(self) -> int:
        """Jobs waiting for a runner (queued, or running on a lease that ran out)."""
        ...

    def claim_job(self, holder: str, lease_s: float, max_attempts: int) -> JobRecord | None:
        """Take the oldest job waiting (see the module docstring), or None."""
        ...

    def take_job(
        self, job_id: str, holder: str, lease_s: float, max_attempts: int
    ) -> JobRecord | None:
        """Take this job if it waits; None when it is finished, held on a live lease, or was
        just failed for having used up its attempts."""
        ...

    def renew_lease(self, job_id: str, holder: str, lease_s: float) -> bool:
        """Extend the lease; False when the job is no longer this holder's to run (cancelled,
        or taken over after the lease ran out)."""
        ...

    def finish_job(self, job_id: str, holder: str, **fields: object) -> bool:
        """Write a running job's outcome (status, result, error, message), only if ``holder``
        still has it. True when it did."""
        ...

    def release_job(self, job_id: str, holder: str, message: str) -> bool:
        """Give a running job back to the queue without using up an attempt (orderly
        shutdown)."""
        ...

    def expire_lease(self, job_id: str, holder: str) -> bool:
        """End ``holder``'s lease now (it is known dead), so the job can be taken at once."""
        ...

    def ping(self) -> None:
        """Write to the store; raise :class:`StoreUnavailable` when it cannot."""
        ...

    def close(self) -> None: ...


_UPDATABLE = frozenset({"status", "attempts", "progress", "result", "error", "message"})


def check_fields(fields: dict[str, object]) -> None:
    bad = sorted(set(fields) - _UPDATABLE)
    if bad:
        raise ValueError(f"job field {bad[0]!r} cannot be updated")


def exhausted(rec: JobRecord, max_attempts: int) -> str:
    """The error of a job whose runner was lost on its last allowed attempt."""
    return (
        f"interrupted by a server restart or a lost worker while running (attempt "
        f"{rec.attempts} of job_max_attempts={max_attempts}); not run again"
    )


class MemoryStore:
    """Everything in dictionaries: for tests and throwaway servers (``memory://``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._graphs: dict[tuple[str, str], tuple[str, str]] = {}
        self._cache: dict[str, str] = {}
        self._jobs: dict[str, JobRecord] = {}

    def put_graph(self, owner: str, graph_id: str, graph_json: str, summary_json: str) -> bool:
        with self._lock:
            if (owner, graph_id) in self._graphs:
                return False
            self._graphs[owner, graph_id] = (graph_json, summary_json)
            return True

    def graph_summary(self, owner: str, graph_id: str) -> str | None:
        with self._lock:
            row = self._graphs.get((owner, graph_id))
        return None if row is None else row[1]

    def graph_json(self, owner: str, graph_id: str) -> str | None:
        with self._lock:
            row = self._graphs.get((owner, graph_id))
        return None if row is None else row[0]

    def cached(self, request_key: str) -> str | None:
        with self._lock:
            return self._cache.get(request_key)

    def put_cached(self, request_key: str, result_json: str) -> None:
        with self._lock:
            self._cache[request_key] = result_json

    def create_job(self, job: JobRecord) -> bool:
        with self._lock:
            if job.id in self._jobs:
                return False
            self._jobs[job.id] = job
            return True

    def job(self, job_id: str, owner: str | None = None) -> JobRecord | None:
        with self._lock:
            j = self._jobs.get(job_id)
        if j is None or (owner is not None and j.owner != owner):
            return None
        return j

    def jobs(self, owner: str, limit: int = 100) -> list[JobRecord]:
        with self._lock:
            mine = [j for j in self._jobs.values() if j.owner == owner]
        mine.sort(key=lambda j: (j.created_at, j.id), reverse=True)
        return mine[:limit]

    def _set(self, j: JobRecord, **fields: object) -> None:
        self._jobs[j.id] = dataclasses.replace(j, updated_at=time.time(), **fields)  # type: ignore[arg-type]

    def update_job(
        self, job_id: str, *, only_if: tuple[JobStatus, ...] | None = None, **fields: object
    ) -> bool:
        check_fields(fields)
        with self._lock:
            j = self._jobs.get(job_id)
            if j is None or (only_if is not None and j.status not in only_if):
                return False
            self._set(j, **fields)
            return True

    def unfinished_jobs(self) -> list[JobRecord]:
        with self._lock:
            rows = [j for j in self._jobs.values() if j.status in UNFINISHED]
        return sorted(rows, key=lambda j: (j.created_at, j.id))

    @staticmethod
    def _waiting(j: JobRecord, now: float) -> bool:
        return j.status == "queued" or (
            j.status == "running" and (j.lease_until is None or j.lease_until < now)
        )

    def count_queued(self) -> int:
        now = time.time()
        with self._lock:
            return sum(1 for j in self._jobs.values() if self._waiting(j, now))

    def _take(self, j: JobRecord, holder: str, lease_s: float, max_attempts: int) -> bool:
        now = time.time()
        if not self._waiting(j, now) or j.holder == holder:
            return False
        if j.status == "running":
            if j.attempts >= max_attempts:
                self._set(j, status="failed", error=exhausted(j, max_attempts), holder=None)
                return False
            message = REQUEUED
        else:
            message = j.message
        self._set(
            j,
            status="running",
            attempts=j.attempts + 1,
            holder=holder,
            lease_until=now + lease_s,
            message=message,
        )
        return True

    def claim_job(self, holder: str, lease_s: float, max_attempts: int) -> JobRecord | None:
        with self._lock:
            for j in sorted(self._jobs.values(), key=lambda j: (j.created_at, j.id)):
                if self._take(j, holder, lease_s, max_attempts):
                    return self._jobs[j.id]
        return None

    def take_job(
        self, job_id: str, holder: str, lease_s: float, max_attempts: int
    ) -> JobRecord | None:
        with self._lock:
            j = self._jobs.get(job_id)
            if j is not None and self._take(j, holder, lease_s, max_attempts):
                return self._jobs[job_id]
        return None

    def renew_lease(self, job_id: str, holder: str, lease_s: float) -> bool:
        with self._lock:
            j = self._jobs.get(job_id)
            if j is None or j.status != "running" or j.holder != holder:
                return False
            self._jobs[job_id] = dataclasses.replace(j, lease_until=time.time() + lease_s)
            return True

    def finish_job(self, job_id: str, holder: str, **fields: object) -> bool:
        check_fields(fields)
        with self._lock:
            j = self._jobs.get(job_id)
            if j is None or j.status != "running" or j.holder != holder:
                return False
            self._set(j, holder=None, lease_until=None, **fields)
            return True

    def release_job(self, job_id: str, holder: str, message: str) -> bool:
        with self._lock:
            j = self._jobs.get(job_id)
            if j is None or j.status != "running" or j.holder != holder:
                return False
            self._set(
                j,
                status="queued",
                attempts=max(0, j.attempts - 1),
                holder=None,
                lease_until=None,
                message=message,
            )
            return True

    def expire_lease(self, job_id: str, holder: str) -> bool:
        with self._lock:
            j = self._jobs.get(job_id)
            if j is None or j.status != "running" or j.holder != holder:
                return False
            self._jobs[job_id] = dataclasses.replace(j, lease_until=0.0)
            return True

    def ping(self) -> None:
        pass

    def close(self) -> None:
        pass
