"""The embedded store: one SQLite file (WAL mode), created with its tables on first use.

Several servers (and ``remat worker`` processes) may share one file on one machine: a job is
taken by one atomic ``UPDATE ... RETURNING`` under SQLite's write lock, so it runs once, and the
lease (see :mod:`remat.api.store`) hands the jobs of a stopped server to the others. The
statements and most methods are :mod:`remat.api.store_sql`'s, shared with PostgreSQL.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

from remat.api.store import REQUEUED, JobRecord, StoreUnavailable, exhausted
from remat.api.store_sql import NOT_MINE, SCHEMA, WAITING, Cursor, Dialect, SQLStore

# Expired, running and out of attempts: failed before a job is taken (the taking UPDATE below
# cannot branch on them), re-checked per row in case the lease was renewed meanwhile.
_EXHAUSTED = (
    "SELECT {cols} FROM {jobs} WHERE status='running' AND COALESCE(lease_until, 0) < ? "
    "AND attempts >= ?"
)
_FAIL = (
    "UPDATE {jobs} SET status='failed', error=?, holder=NULL, updated_at=? "
    "WHERE id=? AND status='running' AND COALESCE(lease_until, 0) < ?"
)
_TAKE = (
    "UPDATE {jobs} SET message = CASE WHEN status='running' THEN ? ELSE message END, "
    "status='running', attempts=attempts+1, holder=?, lease_until=?, updated_at=? "
    "WHERE id = (SELECT id FROM {jobs} WHERE " + WAITING + " " + NOT_MINE + " {where} "
    "ORDER BY created_at, id LIMIT 1) RETURNING {cols}"
)


class SQLiteStore(SQLStore):
    """One SQLite file; a single connection guarded by a lock (SQLite serialises writers
    anyway, and the statements are short). ``busy_timeout_s``: how long a statement waits for
    another process's write lock before the store reports itself unavailable."""

    # Unprefixed table names: those of the files earlier versions wrote.
    dialect: ClassVar[Dialect] = Dialect(prefix="", real="REAL", mark="?")

    def __init__(self, path: str, busy_timeout_s: float = 5.0) -> None:
        if path != ":memory:":
            Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        with self._sql() as cur:
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
            self._db.executescript(self._q(SCHEMA))
            cur.execute(self._q("PRAGMA table_info({jobs})"))
            have = {r[1] for r in cur.fetchall()}
            for col, kind in (("holder", "TEXT"), ("lease_until", "REAL")):
                if col not in have:  # a file written by an older version
                    cur.execute(
                        self._q("ALTER TABLE {jobs} ADD COLUMN {col} {kind}", col=col, kind=kind)
                    )

    @contextlib.contextmanager
    def _sql(self) -> Iterator[Cursor]:
        with self._lock:
            cur = self._db.cursor()
            try:
                yield cur
            except sqlite3.OperationalError as exc:
                # Locked, read-only, disk full, I/O error: the caller may retry later.
                raise StoreUnavailable(f"the database is unavailable: {exc}") from None
            except sqlite3.DatabaseError as exc:
                raise StoreUnavailable(f"the database failed: {exc}") from None
            finally:
                cur.close()

    def _fail_exhausted(self, cur: Cursor, now: float, max_attempts: int) -> None:
        cur.execute(self._q(_EXHAUSTED), (now, max_attempts))
        for r in cur.fetchall():
            rec = JobRecord(*r)
            cur.execute(self._q(_FAIL), (exhausted(rec, max_attempts), now, rec.id, now))

    def _take(
        self, where: str, args: tuple[object, ...], holder: str, lease_s: float, max_attempts: int
    ) -> JobRecord | None:
        now = time.time()
        with self._sql() as cur:
            cur.execute("BEGIN IMMEDIATE")  # one runner at a time, across processes too
            try:
                self._fail_exhausted(cur, now, max_attempts)
                cur.execute(
                    self._q(_TAKE, where=where),
                    (REQUEUED, holder, now + lease_s, now, now, holder, *args),
                )
                row = cur.fetchone()
                cur.execute("COMMIT")
            except BaseException:
                cur.execute("ROLLBACK")
                raise
        return None if row is None else JobRecord(*row)

    def close(self) -> None:
        with self._lock:
            self._db.close()
