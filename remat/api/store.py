"""Where the service keeps graphs, cached results and jobs, behind one small interface.

:class:`Store` is the interface; :class:`SQLiteStore` (the default, one file created on first
use) and :class:`MemoryStore` (nothing persists) implement it, and :func:`open_store` picks one
from a database URL. Another database needs only another class with these methods.

Every method is synchronous and thread-safe; the service calls them from worker threads so the
event loop never waits on the disk. Payloads (graph JSON, results, progress) are stored as JSON
text and never re-parsed here.

Ownership: graphs and jobs belong to an *owner* (a digest of the API key, or ``""`` when the
service runs without keys); lookups by another owner find nothing. Cached results are keyed by a
digest of the whole request, which includes the graph's content hash, so only a caller who holds
the graph can reach its results.
"""

from __future__ import annotations

import dataclasses
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

JobStatus = Literal["queued", "running", "done", "failed", "cancelled"]
JobKind = Literal["solve", "frontier"]
UNFINISHED: tuple[JobStatus, ...] = ("queued", "running")


@dataclass(frozen=True)
class JobRecord:
    """One job as stored. ``request`` is the normalised request JSON the worker runs."""

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


class Store(Protocol):
    """The persistence interface of the service."""

    def put_graph(self, owner: str, graph_id: str, graph_json: str, summary_json: str) -> bool:
        """Store a graph; False when this owner already has it (nothing changes)."""
        ...

    def graph_summary(self, owner: str, graph_id: str) -> str | None: ...

    def graph_json(self, owner: str, graph_id: str) -> str | None: ...

    def cached(self, request_key: str) -> str | None: ...

    def put_cached(self, request_key: str, result_json: str) -> None: ...

    def create_job(self, job: JobRecord) -> None: ...

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
        """Jobs queued or running, oldest first (what a restart must take care of)."""
        ...

    def close(self) -> None: ...


_JOB_FIELDS = tuple(f.name for f in dataclasses.fields(JobRecord))
_UPDATABLE = frozenset({"status", "attempts", "progress", "result", "error", "message"})


def _check_fields(fields: dict[str, object]) -> None:
    bad = sorted(set(fields) - _UPDATABLE)
    if bad:
        raise ValueError(f"job field {bad[0]!r} cannot be updated")


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

    def create_job(self, job: JobRecord) -> None:
        with self._lock:
            if job.id in self._jobs:
                raise ValueError(f"job {job.id!r} exists")
            self._jobs[job.id] = job

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

    def update_job(
        self, job_id: str, *, only_if: tuple[JobStatus, ...] | None = None, **fields: object
    ) -> bool:
        _check_fields(fields)
        with self._lock:
            j = self._jobs.get(job_id)
            if j is None or (only_if is not None and j.status not in only_if):
                return False
            self._jobs[job_id] = dataclasses.replace(j, updated_at=time.time(), **fields)  # type: ignore[arg-type]
            return True

    def unfinished_jobs(self) -> list[JobRecord]:
        with self._lock:
            rows = [j for j in self._jobs.values() if j.status in UNFINISHED]
        return sorted(rows, key=lambda j: (j.created_at, j.id))

    def close(self) -> None:
        pass


_SCHEMA = """
CREATE TABLE IF NOT EXISTS graphs (
    owner TEXT NOT NULL, id TEXT NOT NULL, graph TEXT NOT NULL, summary TEXT NOT NULL,
    created_at REAL NOT NULL, PRIMARY KEY (owner, id));
CREATE TABLE IF NOT EXISTS results (
    request_key TEXT PRIMARY KEY, result TEXT NOT NULL, created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, kind TEXT NOT NULL, status TEXT NOT NULL,
    graph_id TEXT NOT NULL, request TEXT NOT NULL, request_key TEXT NOT NULL,
    created_at REAL NOT NULL, updated_at REAL NOT NULL, attempts INTEGER NOT NULL,
    progress TEXT, result TEXT, error TEXT, message TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS jobs_owner ON jobs (owner, created_at);
CREATE INDEX IF NOT EXISTS jobs_status ON jobs (status);
"""


class SQLiteStore:
    """One SQLite file (WAL mode), created with its tables on first use.

    A single connection guarded by a lock: SQLite serialises writers anyway, and the service's
    statements are short (a row in, a row out).
    """

    def __init__(self, path: str) -> None:
        if path != ":memory:":
            Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA busy_timeout=5000")
            self._db.executescript(_SCHEMA)

    def _one(self, sql: str, args: tuple[object, ...]) -> tuple[object, ...] | None:
        with self._lock:
            row: tuple[object, ...] | None = self._db.execute(sql, args).fetchone()
        return row

    def put_graph(self, owner: str, graph_id: str, graph_json: str, summary_json: str) -> bool:
        with self._lock:
            cur = self._db.execute(
                "INSERT OR IGNORE INTO graphs VALUES (?, ?, ?, ?, ?)",
                (owner, graph_id, graph_json, summary_json, time.time()),
            )
        return cur.rowcount == 1

    def graph_summary(self, owner: str, graph_id: str) -> str | None:
        row = self._one("SELECT summary FROM graphs WHERE owner=? AND id=?", (owner, graph_id))
        return None if row is None else str(row[0])

    def graph_json(self, owner: str, graph_id: str) -> str | None:
        row = self._one("SELECT graph FROM graphs WHERE owner=? AND id=?", (owner, graph_id))
        return None if row is None else str(row[0])

    def cached(self, request_key: str) -> str | None:
        row = self._one("SELECT result FROM results WHERE request_key=?", (request_key,))
        return None if row is None else str(row[0])

    def put_cached(self, request_key: str, result_json: str) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO results VALUES (?, ?, ?)",
                (request_key, result_json, time.time()),
            )

    def create_job(self, job: JobRecord) -> None:
        marks = ", ".join("?" for _ in _JOB_FIELDS)
        cols = ", ".join(_JOB_FIELDS)
        with self._lock:
            self._db.execute(
                f"INSERT INTO jobs ({cols}) VALUES ({marks})",
                tuple(getattr(job, f) for f in _JOB_FIELDS),
            )

    def _rows(self, sql: str, args: tuple[object, ...]) -> list[JobRecord]:
        cols = ", ".join(_JOB_FIELDS)
        with self._lock:
            rows = self._db.execute(f"SELECT {cols} FROM jobs {sql}", args).fetchall()
        return [JobRecord(*r) for r in rows]

    def job(self, job_id: str, owner: str | None = None) -> JobRecord | None:
        if owner is None:
            rows = self._rows("WHERE id=?", (job_id,))
        else:
            rows = self._rows("WHERE id=? AND owner=?", (job_id, owner))
        return rows[0] if rows else None

    def jobs(self, owner: str, limit: int = 100) -> list[JobRecord]:
        return self._rows("WHERE owner=? ORDER BY created_at DESC, id DESC LIMIT ?", (owner, limit))

    def update_job(
        self, job_id: str, *, only_if: tuple[JobStatus, ...] | None = None, **fields: object
    ) -> bool:
        _check_fields(fields)
        sets = ", ".join(f"{k}=?" for k in fields)
        args: list[object] = [*fields.values(), time.time(), job_id]
        sql = f"UPDATE jobs SET {sets}{', ' if sets else ''}updated_at=? WHERE id=?"
        if only_if is not None:
            sql += f" AND status IN ({', '.join('?' for _ in only_if)})"
            args.extend(only_if)
        with self._lock:
            cur = self._db.execute(sql, tuple(args))
        return cur.rowcount == 1

    def unfinished_jobs(self) -> list[JobRecord]:
        return self._rows("WHERE status IN ('queued', 'running') ORDER BY created_at, id", ())

    def close(self) -> None:
        with self._lock:
            self._db.close()


def open_store(url: str) -> Store:
    """The store a database URL names.

    ``sqlite:///relative/path.db``, ``sqlite:////absolute/path.db``, ``sqlite:///:memory:``,
    a bare file path (SQLite), or ``memory://``.

    Raises
    ------
    ValueError
        Naming ``db_url`` when the scheme is not one of those.
    """
    if url == "memory://":
        return MemoryStore()
    if url.startswith("sqlite://"):
        path = url[len("sqlite://") :]
        if not path.startswith("/") or path == "/":
            raise ValueError(f"db_url: expected sqlite:///PATH, got {url!r}")
        return SQLiteStore(path[1:] if path != "/:memory:" else ":memory:")
    if "://" in url:
        scheme = url.split("://", 1)[0]
        raise ValueError(
            f"db_url: no store for scheme {scheme!r} (supported: sqlite:///PATH, memory://)"
        )
    return SQLiteStore(url)
