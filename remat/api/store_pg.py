"""The store for several machines: PostgreSQL through psycopg 3 (``postgresql://...``).

The same tables and statements as the SQLite store (:mod:`remat.api.store_sql`), with a
``remat_`` prefix, plus procrastinate's (the job queue, see :mod:`remat.api.queue_pg`), created
on first use under an advisory lock so that replicas starting together do not race. Jobs are
taken with ``FOR UPDATE SKIP LOCKED``, so runners on different machines never take the same job.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import psycopg
import psycopg_pool

from remat.api.store import REQUEUED, JobRecord, StoreUnavailable, exhausted
from remat.api.store_sql import NOT_MINE, SCHEMA, WAITING, Dialect, SQLStore

_SCHEMA_LOCK = 0x72656D6174  # "remat": serialises schema creation across replicas

# The oldest waiting job no other transaction has locked; it stays locked until the commit.
_NEXT = (
    "SELECT {cols} FROM {jobs} WHERE " + WAITING + " " + NOT_MINE + " {where} "
    "ORDER BY created_at, id LIMIT 1 FOR UPDATE SKIP LOCKED"
)
_FAIL = "UPDATE {jobs} SET status='failed', error=?, holder=NULL, updated_at=? WHERE id=?"
_TAKE = (
    "UPDATE {jobs} SET status='running', attempts=attempts+1, holder=?, lease_until=?, "
    "message=?, updated_at=? WHERE id=? RETURNING {cols}"
)


def _redact(url: str) -> str:
    # Never echo a password: postgresql://user:secret@host/db -> postgresql://user@host/db
    head, sep, tail = url.partition("@")
    if not sep:
        return url
    scheme, _, cred = head.partition("://")
    return f"{scheme}://{cred.split(':', 1)[0]}@{tail}"


class PostgresStore(SQLStore):
    """A pool of psycopg connections to one PostgreSQL database.

    Raises
    ------
    StoreUnavailable
        Naming ``db_url`` (password left out) when the server cannot be reached at start.
    """

    # Prefixed: the tables share the database with procrastinate's.
    dialect: ClassVar[Dialect] = Dialect(prefix="remat_", real="DOUBLE PRECISION", mark="%s")

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
                cur.execute(self._q(SCHEMA))
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

    def _take(
        self, where: str, args: tuple[object, ...], holder: str, lease_s: float, max_attempts: int
    ) -> JobRecord | None:
        now = time.time()
        with self._tx() as cur:
            while True:
                cur.execute(self._q(_NEXT, where=where), (now, holder, *args))
                row = cur.fetchone()
                if row is None:
                    return None
                rec = JobRecord(*row)
                if rec.status == "running" and rec.attempts >= max_attempts:
                    cur.execute(self._q(_FAIL), (exhausted(rec, max_attempts), now, rec.id))
                    if where:
                        return None
                    continue
                message = REQUEUED if rec.status == "running" else rec.message
                cur.execute(self._q(_TAKE), (holder, now + lease_s, message, now, rec.id))
                out = cur.fetchone()
                return None if out is None else JobRecord(*out)

    def close(self) -> None:
        self._pool.close()
