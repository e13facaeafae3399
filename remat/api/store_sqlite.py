"""The embedded store: one SQLite file (WAL mode), created with its tables on first use.

Several servers (and ``remat worker`` processes) may share one file on one machine: a job is
taken by one atomic ``UPDATE ... RETURNING`` under SQLite's write lock, so it runs once, and the
lease (see :mod:`remat.api.store`) hands the jobs of a stopped server to the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from remat.api.store import (
    REQUEUED,
    JobRecord,
    JobStatus,
    StoreUnavailable,
    check_fields,
    exhausted,
)

_JOB_FIELDS = tuple(f.name for f in dataclasses.fields(JobRecord))
_COLS = ", ".join(_JOB_FIELDS)

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
    progress TEXT, result TEXT, error TEXT, message TEXT NOT NULL,
    holder TEXT, lease_until REAL);
CREATE INDEX IF NOT EXISTS jobs_owner ON jobs (owner, created_at);
CREATE INDEX IF NOT EXISTS jobs_status ON jobs (status);
CREATE TABLE IF NOT EXISTS health (id INTEGER PRIMARY KEY, at REAL NOT NULL);
"""

# A job waits when it is queued, or running on a lease that ran out (its runner is gone).
_WAITING = "(status = 'queued' OR (status = 'running' AND COALESCE(lease_until, 0) < ?))"
# A runner whose own lease ran out (the store was down) still runs that job: not taken twice.
_NOT_MINE = "AND COALESCE(holder, '') != ?"


class SQLiteStore:
    """One SQLite file; a single connection guarded by a lock (SQLite serialises writers
    anyway, and the statements are short). ``busy_timeout_s``: how long a statement waits for
    another process's write lock before the store reports itself unavailable."""

    def __init__(self, path: str, busy_timeout_s: float = 5.0) -> None:
        if path != ":memory:":
            Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        with self._sql() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
            db.executescript(_SCHEMA)
            have = {r[1] for r in db.execute("PRAGMA table_info(jobs)")}
            for col, kind in (("holder", "TEXT"), ("lease_until", "REAL")):
                if col not in have:  # a file written by an older version
                    db.execute(f"ALTER TABLE jobs ADD COLUMN {col} {kind}")

    @contextlib.contextmanager
    def _sql(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                yield self._db
            except sqlite3.OperationalError as exc:
                # Locked, read-only, disk full, I/O error: the caller may retry later.
                raise StoreUnavailable(f"the database is unavailable: {exc}") from None
            except sqlite3.DatabaseError as exc:
                raise StoreUnavailable(f"the database failed: {exc}") from None

    def _one(self, sql: str, args: tuple[object, ...]) -> tuple[object, ...] | None:
        with self._sql() as db:
            row: tuple[object, ...] | None = db.execute(sql, args).fetchone()
        return row

    def _rowcount(self, sql: str, args: tuple[object, ...]) -> int:
        with self._sql() as db:
            return db.execute(sql, args).rowcount

    def put_graph(self, owner: str, graph_id: str, graph_json: str, summary_json: str) -> bool:
        return (
            self._rowcount(
                "INSERT OR IGNORE INTO graphs VALUES (?, ?, ?, ?, ?)",
                (owner, graph_id, graph_json, summary_json, time.time()),
            )
            == 1
        )

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
        self._rowcount(
            "INSERT OR REPLACE INTO results VALUES (?, ?, ?)",
            (request_key, result_json, time.time()),
        )

    def create_job(self, job: JobRecord) -> None:
        marks = ", ".join("?" for _ in _JOB_FIELDS)
        self._rowcount(
            f"INSERT INTO jobs ({_COLS}) VALUES ({marks})",
            tuple(getattr(job, f) for f in _JOB_FIELDS),
        )

    def _rows(self, sql: str, args: tuple[object, ...]) -> list[JobRecord]:
        with self._sql() as db:
            rows = db.execute(f"SELECT {_COLS} FROM jobs {sql}", args).fetchall()
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
        check_fields(fields)
        sets = ", ".join(f"{k}=?" for k in fields)
        args: list[object] = [*fields.values(), time.time(), job_id]
        sql = f"UPDATE jobs SET {sets}{', ' if sets else ''}updated_at=? WHERE id=?"
        if only_if is not None:
            sql += f" AND status IN ({', '.join('?' for _ in only_if)})"
            args.extend(only_if)
        return self._rowcount(sql, tuple(args)) == 1

    def unfinished_jobs(self) -> list[JobRecord]:
        return self._rows("WHERE status IN ('queued', 'running') ORDER BY created_at, id", ())

    def count_queued(self) -> int:
        row = self._one(f"SELECT COUNT(*) FROM jobs WHERE {_WAITING}", (time.time(),))
        return 0 if row is None else int(row[0])  # type: ignore[call-overload]

    def _fail_exhausted(self, db: sqlite3.Connection, now: float, max_attempts: int) -> None:
        rows = db.execute(
            f"SELECT {_COLS} FROM jobs WHERE status='running' AND COALESCE(lease_until, 0) < ? "
            "AND attempts >= ?",
            (now, max_attempts),
        ).fetchall()
        for r in rows:
            rec = JobRecord(*r)
            db.execute(
                "UPDATE jobs SET status='failed', error=?, holder=NULL, updated_at=? "
                "WHERE id=? AND status='running' AND COALESCE(lease_until, 0) < ?",
                (exhausted(rec, max_attempts), now, rec.id, now),
            )

    def _take(
        self, where: str, args: tuple[object, ...], holder: str, lease_s: float, max_attempts: int
    ) -> JobRecord | None:
        now = time.time()
        with self._sql() as db:
            db.execute("BEGIN IMMEDIATE")  # one runner at a time, across processes too
            try:
                self._fail_exhausted(db, now, max_attempts)
                row = db.execute(
                    f"UPDATE jobs SET message = CASE WHEN status='running' THEN ? ELSE message "
                    "END, status='running', attempts=attempts+1, holder=?, lease_until=?, "
                    f"updated_at=? WHERE id = (SELECT id FROM jobs WHERE {_WAITING} {_NOT_MINE} "
                    f"{where} ORDER BY created_at, id LIMIT 1) RETURNING {_COLS}",
                    (REQUEUED, holder, now + lease_s, now, now, holder, *args),
                ).fetchone()
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return None if row is None else JobRecord(*row)

    def claim_job(self, holder: str, lease_s: float, max_attempts: int) -> JobRecord | None:
        return self._take("", (), holder, lease_s, max_attempts)

    def take_job(
        self, job_id: str, holder: str, lease_s: float, max_attempts: int
    ) -> JobRecord | None:
        return self._take("AND id=?", (job_id,), holder, lease_s, max_attempts)

    def renew_lease(self, job_id: str, holder: str, lease_s: float) -> bool:
        return (
            self._rowcount(
                "UPDATE jobs SET lease_until=? WHERE id=? AND status='running' AND holder=?",
                (time.time() + lease_s, job_id, holder),
            )
            == 1
        )

    def finish_job(self, job_id: str, holder: str, **fields: object) -> bool:
        check_fields(fields)
        sets = "".join(f"{k}=?, " for k in fields)
        return (
            self._rowcount(
                f"UPDATE jobs SET {sets}holder=NULL, lease_until=NULL, updated_at=? "
                "WHERE id=? AND status='running' AND holder=?",
                (*fields.values(), time.time(), job_id, holder),
            )
            == 1
        )

    def release_job(self, job_id: str, holder: str, message: str) -> bool:
        return (
            self._rowcount(
                "UPDATE jobs SET status='queued', attempts=MAX(0, attempts-1), holder=NULL, "
                "lease_until=NULL, message=?, updated_at=? "
                "WHERE id=? AND status='running' AND holder=?",
                (message, time.time(), job_id, holder),
            )
            == 1
        )

    def expire_lease(self, job_id: str, holder: str) -> bool:
        return (
            self._rowcount(
                "UPDATE jobs SET lease_until=0 WHERE id=? AND status='running' AND holder=?",
                (job_id, holder),
            )
            == 1
        )

    def ping(self) -> None:
        self._rowcount("INSERT OR REPLACE INTO health VALUES (1, ?)", (time.time(),))

    def close(self) -> None:
        with self._lock:
            self._db.close()
