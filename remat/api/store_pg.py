"""The store for several machines: PostgreSQL through psycopg 3 (``postgresql://...``).

The same tables as the SQLite store, plus procrastinate's (the job queue, see
:mod:`remat.api.queue_pg`), created on first use under an advisory lock so that replicas
starting together do not race. Jobs are taken with ``FOR UPDATE SKIP LOCKED``, so runners on
different machines never take the same job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import psycopg_pool

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
_SCHEMA_LOCK = 0x72656D6174  # "remat": serialises schema creation across replicas

_SCHEMA = """
CREATE TABLE IF NOT EXISTS remat_graphs (
    owner TEXT NOT NULL, id TEXT NOT NULL, graph TEXT NOT NULL, summary TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (owner, id));
CREATE TABLE IF NOT EXISTS remat_results (
    request_key TEXT PRIMARY KEY, result TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL);
CREATE TABLE IF NOT EXISTS remat_jobs (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, kind TEXT NOT NULL, status TEXT NOT NULL,
    graph_id TEXT NOT NULL, request TEXT NOT NULL, request_key TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL, updated_at DOUBLE PRECISION NOT NULL,
    attempts INTEGER NOT NULL, progress TEXT, result TEXT, error TEXT, message TEXT NOT NULL,
    holder TEXT, lease_until DOUBLE PRECISION);
CREATE INDEX IF NOT EXISTS remat_jobs_owner ON remat_jobs (owner, created_at);
CREATE INDEX IF NOT EXISTS remat_jobs_status ON remat_jobs (status);
CREATE TABLE IF NOT EXISTS remat_health (id INTEGER PRIMARY KEY, at DOUBLE PRECISION NOT NULL);
"""

_WAITING = "(status = 'queued' OR (status = 'running' AND COALESCE(lease_until, 0) < %s))"
# A runner whose own lease ran out (the store was down) still runs that job: not taken twice.
_NOT_MINE = "AND COALESCE(holder, '') != %s"


def _redact(url: str) -> str:
    # Never echo a password: postgresql://user:secret@host/db -> postgresql://user@host/db
    head, sep, tail = url.partition("@")
    if not sep:
        return url
    scheme, _, cred = head.partition("://")
    return f"{scheme}://{cred.split(':', 1)[0]}@{tail}"


class PostgresStore:
    """A pool of psycopg connections to one PostgreSQL database.

    Raises
    ------
    StoreUnavailable
        Naming ``db_url`` (password left out) when the server cannot be reached at start.
    """

    def __init__(self, url: str, *, max_connections: int = 8, timeout_s: float = 10.0) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._pool = psycopg_pool.ConnectionPool(
            url,
            min_size=1,
            max_size=max_connections,
            timeout=timeout_s,
            kwargs={"autocommit": True, "connect_timeout": max(1, int(timeout_s))},
            open=False,
        )
        try:
            self._pool.open(wait=True, timeout=timeout_s)
        except psycopg_pool.PoolTimeout:
            self._pool.close()
            raise StoreUnavailable(
                f"db_url: cannot connect to {_redact(url)} within {timeout_s:g} s"
            ) from None
        with self._sql() as cur:
            cur.execute("SELECT pg_advisory_lock(%s)", (_SCHEMA_LOCK,))
            try:
                cur.execute(_SCHEMA)
                cur.execute("SELECT to_regclass('procrastinate_jobs') IS NOT NULL")
                row = cur.fetchone()
                if not (row and row[0]):
                    from procrastinate.schema import SchemaManager

                    cur.execute(SchemaManager.get_schema())
            finally:
                cur.execute("SELECT pg_advisory_unlock(%s)", (_SCHEMA_LOCK,))

    @contextlib.contextmanager
    def _sql(self) -> Iterator[psycopg.Cursor[Any]]:
        try:
            with self._pool.connection() as conn, conn.cursor() as cur:
                yield cur
        except (psycopg.OperationalError, psycopg_pool.PoolTimeout) as exc:
            raise StoreUnavailable(f"the database is unavailable: {exc}") from None

    @contextlib.contextmanager
    def _tx(self) -> Iterator[psycopg.Cursor[Any]]:
        try:
            with self._pool.connection() as conn, conn.transaction(), conn.cursor() as cur:
                yield cur
        except (psycopg.OperationalError, psycopg_pool.PoolTimeout) as exc:
            raise StoreUnavailable(f"the database is unavailable: {exc}") from None

    def _one(self, sql: str, args: tuple[object, ...]) -> tuple[Any, ...] | None:
        with self._sql() as cur:
            cur.execute(sql, args)
            row: tuple[Any, ...] | None = cur.fetchone()
        return row

    def _rowcount(self, sql: str, args: tuple[object, ...]) -> int:
        with self._sql() as cur:
            cur.execute(sql, args)
            return cur.rowcount

    def put_graph(self, owner: str, graph_id: str, graph_json: str, summary_json: str) -> bool:
        n = self._rowcount(
            "INSERT INTO remat_graphs VALUES (%s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
            (owner, graph_id, graph_json, summary_json, time.time()),
        )
        return n == 1

    def graph_summary(self, owner: str, graph_id: str) -> str | None:
        row = self._one(
            "SELECT summary FROM remat_graphs WHERE owner=%s AND id=%s", (owner, graph_id)
        )
        return None if row is None else str(row[0])

    def graph_json(self, owner: str, graph_id: str) -> str | None:
        row = self._one(
            "SELECT graph FROM remat_graphs WHERE owner=%s AND id=%s", (owner, graph_id)
        )
        return None if row is None else str(row[0])

    def cached(self, request_key: str) -> str | None:
        row = self._one("SELECT result FROM remat_results WHERE request_key=%s", (request_key,))
        return None if row is None else str(row[0])

    def put_cached(self, request_key: str, result_json: str) -> None:
        self._rowcount(
            "INSERT INTO remat_results VALUES (%s, %s, %s) ON CONFLICT (request_key) "
            "DO UPDATE SET result = EXCLUDED.result, created_at = EXCLUDED.created_at",
            (request_key, result_json, time.time()),
        )

    def create_job(self, job: JobRecord) -> None:
        marks = ", ".join("%s" for _ in _JOB_FIELDS)
        self._rowcount(
            f"INSERT INTO remat_jobs ({_COLS}) VALUES ({marks})",
            tuple(getattr(job, f) for f in _JOB_FIELDS),
        )

    def _rows(self, sql: str, args: tuple[object, ...]) -> list[JobRecord]:
        with self._sql() as cur:
            cur.execute(f"SELECT {_COLS} FROM remat_jobs {sql}", args)
            rows = cur.fetchall()
        return [JobRecord(*r) for r in rows]

    def job(self, job_id: str, owner: str | None = None) -> JobRecord | None:
        if owner is None:
            rows = self._rows("WHERE id=%s", (job_id,))
        else:
            rows = self._rows("WHERE id=%s AND owner=%s", (job_id, owner))
        return rows[0] if rows else None

    def jobs(self, owner: str, limit: int = 100) -> list[JobRecord]:
        return self._rows(
            "WHERE owner=%s ORDER BY created_at DESC, id DESC LIMIT %s", (owner, limit)
        )

    def update_job(
        self, job_id: str, *, only_if: tuple[JobStatus, ...] | None = None, **fields: object
    ) -> bool:
        check_fields(fields)
        sets = "".join(f"{k}=%s, " for k in fields)
        args: list[object] = [*fields.values(), time.time(), job_id]
        sql = f"UPDATE remat_jobs SET {sets}updated_at=%s WHERE id=%s"
        if only_if is not None:
            sql += " AND status = ANY(%s)"
            args.append(list(only_if))
        return self._rowcount(sql, tuple(args)) == 1

    def unfinished_jobs(self) -> list[JobRecord]:
        return self._rows("WHERE status IN ('queued', 'running') ORDER BY created_at, id", ())

    def count_queued(self) -> int:
        row = self._one(f"SELECT COUNT(*) FROM remat_jobs WHERE {_WAITING}", (time.time(),))
        return 0 if row is None else int(row[0])

    def _take(
        self, where: str, args: tuple[object, ...], holder: str, lease_s: float, max_attempts: int
    ) -> JobRecord | None:
        now = time.time()
        with self._tx() as cur:
            while True:
                cur.execute(
                    f"SELECT {_COLS} FROM remat_jobs WHERE {_WAITING} {_NOT_MINE} {where} "
                    "ORDER BY created_at, id LIMIT 1 FOR UPDATE SKIP LOCKED",
                    (now, holder, *args),
                )
                row = cur.fetchone()
                if row is None:
                    return None
                rec = JobRecord(*row)
                if rec.status == "running" and rec.attempts >= max_attempts:
                    cur.execute(
                        "UPDATE remat_jobs SET status='failed', error=%s, holder=NULL, "
                        "updated_at=%s WHERE id=%s",
                        (exhausted(rec, max_attempts), now, rec.id),
                    )
                    if where:
                        return None
                    continue
                message = REQUEUED if rec.status == "running" else rec.message
                cur.execute(
                    "UPDATE remat_jobs SET status='running', attempts=attempts+1, holder=%s, "
                    f"lease_until=%s, message=%s, updated_at=%s WHERE id=%s RETURNING {_COLS}",
                    (holder, now + lease_s, message, now, rec.id),
                )
                out = cur.fetchone()
                return None if out is None else JobRecord(*out)

    def claim_job(self, holder: str, lease_s: float, max_attempts: int) -> JobRecord | None:
        return self._take("", (), holder, lease_s, max_attempts)

    def take_job(
        self, job_id: str, holder: str, lease_s: float, max_attempts: int
    ) -> JobRecord | None:
        return self._take("AND id=%s", (job_id,), holder, lease_s, max_attempts)

    def renew_lease(self, job_id: str, holder: str, lease_s: float) -> bool:
        n = self._rowcount(
            "UPDATE remat_jobs SET lease_until=%s WHERE id=%s AND status='running' AND holder=%s",
            (time.time() + lease_s, job_id, holder),
        )
        return n == 1

    def finish_job(self, job_id: str, holder: str, **fields: object) -> bool:
        check_fields(fields)
        sets = "".join(f"{k}=%s, " for k in fields)
        n = self._rowcount(
            f"UPDATE remat_jobs SET {sets}holder=NULL, lease_until=NULL, updated_at=%s "
            "WHERE id=%s AND status='running' AND holder=%s",
            (*fields.values(), time.time(), job_id, holder),
        )
        return n == 1

    def release_job(self, job_id: str, holder: str, message: str) -> bool:
        n = self._rowcount(
            "UPDATE remat_jobs SET status='queued', attempts=GREATEST(0, attempts-1), "
            "holder=NULL, lease_until=NULL, message=%s, updated_at=%s "
            "WHERE id=%s AND status='running' AND holder=%s",
            (message, time.time(), job_id, holder),
        )
        return n == 1

    def expire_lease(self, job_id: str, holder: str) -> bool:
        n = self._rowcount(
            "UPDATE remat_jobs SET lease_until=0 WHERE id=%s AND status='running' AND holder=%s",
            (job_id, holder),
        )
        return n == 1

    def ping(self) -> None:
        self._rowcount(
            "INSERT INTO remat_health VALUES (1, %s) ON CONFLICT (id) DO UPDATE SET at = "
            "EXCLUDED.at",
            (time.time(),),
        )

    def close(self) -> None:
        self._pool.close()
