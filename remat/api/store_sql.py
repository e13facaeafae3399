"""What the SQLite and PostgreSQL stores share: the tables, the statements, and every method whose
logic does not depend on the database.

Each statement is written once, with ``?`` for a parameter and ``{graphs}``, ``{results}``,
``{jobs}``, ``{health}`` (table names), ``{cols}`` (a job's columns) and ``{real}`` (the float
type) left open; a :class:`Dialect` fills them in for one database. The subclasses,
:class:`~remat.api.store_sqlite.SQLiteStore` and :class:`~remat.api.store_pg.PostgresStore`,
keep only what the databases really do differently: connections, creating the schema, taking a
job under a lock, and translating the driver's errors into
:class:`~remat.api.store.StoreUnavailable`.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

from remat.api.store import JobRecord, JobStatus, check_fields

JOB_FIELDS = tuple(f.name for f in dataclasses.fields(JobRecord))


@dataclasses.dataclass(frozen=True)
class Dialect:
    """How one database spells what the shared statements leave open.

    Parameters
    ----------
    prefix
        Put before every table name: PostgreSQL's tables share a database with procrastinate's,
        SQLite's keep the names that files of earlier versions have.
    real
        The column type of epoch seconds.
    mark
        The driver's parameter marker (sqlite3: ``?``, psycopg: ``%s``).
    """

    prefix: str
    real: str
    mark: str

    def render(self, text: str, **holes: str) -> str:
        """``text`` with its tables, columns, ``holes`` and parameter markers filled in."""
        return _render(self, text, tuple(sorted(holes.items())))


@functools.lru_cache(maxsize=512)
def _render(dialect: Dialect, text: str, holes: tuple[tuple[str, str], ...]) -> str:
    # psycopg reads "%" as the start of a marker; no statement here may hold a literal one.
    assert "%" not in text and all("%" not in v for _, v in holes), text
    p = dialect.prefix
    filled = text.format(
        graphs=f"{p}graphs",
        results=f"{p}results",
        jobs=f"{p}jobs",
        health=f"{p}health",
        cols=", ".join(JOB_FIELDS),
        real=dialect.real,
        **dict(holes),
    )
    return filled.replace("?", dialect.mark)


SCHEMA = """
CREATE TABLE IF NOT EXISTS {graphs} (
    owner TEXT NOT NULL, id TEXT NOT NULL, graph TEXT NOT NULL, summary TEXT NOT NULL,
    created_at {real} NOT NULL, PRIMARY KEY (owner, id));
CREATE TABLE IF NOT EXISTS {results} (
    request_key TEXT PRIMARY KEY, result TEXT NOT NULL, created_at {real} NOT NULL);
CREATE TABLE IF NOT EXISTS {jobs} (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, kind TEXT NOT NULL, status TEXT NOT NULL,
    graph_id TEXT NOT NULL, request TEXT NOT NULL, request_key TEXT NOT NULL,
    created_at {real} NOT NULL, updated_at {real} NOT NULL, attempts INTEGER NOT NULL,
    progress TEXT, result TEXT, error TEXT, message TEXT NOT NULL,
    holder TEXT, lease_until {real});
CREATE INDEX IF NOT EXISTS {jobs}_owner ON {jobs} (owner, created_at);
CREATE INDEX IF NOT EXISTS {jobs}_status ON {jobs} (status);
CREATE TABLE IF NOT EXISTS {health} (id INTEGER PRIMARY KEY, at {real} NOT NULL);
"""

# A job waits when it is queued, or running on a lease that ran out (its runner is gone).
WAITING = "(status = 'queued' OR (status = 'running' AND COALESCE(lease_until, 0) < ?))"
# A runner whose own lease ran out (the store was down) still runs that job: not taken twice.
NOT_MINE = "AND COALESCE(holder, '') != ?"
# The rest of the WHERE clause of take_job (claim_job adds nothing).
THIS_JOB = "AND id=?"
# Only a running job's holder may touch it.
HELD = "WHERE id=? AND status='running' AND holder=?"

# ON CONFLICT needs SQLite 3.24 (RETURNING, used to take jobs, needs 3.35 anyway).
_PUT_GRAPH = "INSERT INTO {graphs} VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING"
_GRAPH_FIELD = "SELECT {field} FROM {graphs} WHERE owner=? AND id=?"
_CACHED = "SELECT result FROM {results} WHERE request_key=?"
_PUT_CACHED = (
    "INSERT INTO {results} VALUES (?, ?, ?) ON CONFLICT (request_key) "
    "DO UPDATE SET result = excluded.result, created_at = excluded.created_at"
)
_CREATE_JOB = "INSERT INTO {jobs} ({cols}) VALUES ({marks}) ON CONFLICT (id) DO NOTHING"
_SELECT_JOBS = "SELECT {cols} FROM {jobs} {where}"
_UPDATE_JOB = "UPDATE {jobs} SET {sets}updated_at=? WHERE id=?"
_ONLY_IF = " AND status IN ({marks})"
_COUNT_WAITING = "SELECT COUNT(*) FROM {jobs} WHERE " + WAITING
_RENEW = "UPDATE {jobs} SET lease_until=? " + HELD
_FINISH = "UPDATE {jobs} SET {sets}holder=NULL, lease_until=NULL, updated_at=? " + HELD
# CASE rather than MAX (SQLite) or GREATEST (PostgreSQL): one spelling that both read.
_RELEASE = (
    "UPDATE {jobs} SET status='queued', "
    "attempts=CASE WHEN attempts > 0 THEN attempts - 1 ELSE 0 END, holder=NULL, "
    "lease_until=NULL, message=?, updated_at=? " + HELD
)
_EXPIRE = "UPDATE {jobs} SET lease_until=0 " + HELD
_PING = "INSERT INTO {health} VALUES (1, ?) ON CONFLICT (id) DO UPDATE SET at = excluded.at"


def marks(n: int) -> str:
    """``n`` parameter markers, comma-separated."""
    return ", ".join("?" for _ in range(n))


def setters(fields: dict[str, object]) -> str:
    """``a=?, b=?, `` for the fields set (each already checked by ``check_fields``)."""
    return "".join(f"{k}=?, " for k in fields)


class Cursor(Protocol):
    """The part of a DB-API cursor the stores use (sqlite3's and psycopg's both fit)."""

    @property
    def rowcount(self) -> int: ...

    def execute(self, sql: str, args: Sequence[Any] = (), /) -> object: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


class SQLStore(abc.ABC):
    """The :class:`~remat.api.store.Store` methods over SQL, for any :class:`Dialect`.

    A subclass sets :attr:`dialect` and provides :meth:`_sql` (a cursor, driver errors
    translated), :meth:`_take` (taking one job under the database's own locking) and
    :meth:`close`.
    """

    dialect: ClassVar[Dialect]

    @abc.abstractmethod
    def _sql(self) -> contextlib.AbstractContextManager[Cursor]:
        """A cursor for one statement or a few; the driver's errors leave it as
        :class:`~remat.api.store.StoreUnavailable`."""

    @abc.abstractmethod
    def _take(
        self, where: str, args: tuple[object, ...], holder: str, lease_s: float, max_attempts: int
    ) -> JobRecord | None:
        """Take the oldest waiting job that also matches ``where`` (``""`` or
        :data:`THIS_JOB`, with ``args``), failing the exhausted ones met on the way."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def _q(self, text: str, **holes: str) -> str:
        return self.dialect.render(text, **holes)

    def _one(self, sql: str, args: tuple[object, ...], **holes: str) -> tuple[Any, ...] | None:
        with self._sql() as cur:
            cur.execute(self._q(sql, **holes), args)
            row: tuple[Any, ...] | None = cur.fetchone()
        return row

    def _rowcount(self, sql: str, args: tuple[object, ...], **holes: str) -> int:
        with self._sql() as cur:
            cur.execute(self._q(sql, **holes), args)
            return cur.rowcount

    def _rows(self, where: str, args: tuple[object, ...]) -> list[JobRecord]:
        with self._sql() as cur:
            cur.execute(self._q(_SELECT_JOBS, where=where), args)
            rows = cur.fetchall()
        return [JobRecord(*r) for r in rows]

    def put_graph(self, owner: str, graph_id: str, graph_json: str, summary_json: str) -> bool:
        args = (owner, graph_id, graph_json, summary_json, time.time())
        return self._rowcount(_PUT_GRAPH, args) == 1

    def graph_summary(self, owner: str, graph_id: str) -> str | None:
        row = self._one(_GRAPH_FIELD, (owner, graph_id), field="summary")
        return None if row is None else str(row[0])

    def graph_json(self, owner: str, graph_id: str) -> str | None:
        row = self._one(_GRAPH_FIELD, (owner, graph_id), field="graph")
        return None if row is None else str(row[0])

    def cached(self, request_key: str) -> str | None:
        row = self._one(_CACHED, (request_key,))
        return None if row is None else str(row[0])

    def put_cached(self, request_key: str, result_json: str) -> None:
        self._rowcount(_PUT_CACHED, (request_key, result_json, time.time()))

    def create_job(self, job: JobRecord) -> bool:
        args = tuple(getattr(job, f) for f in JOB_FIELDS)
        return self._rowcount(_CREATE_JOB, args, marks=marks(len(JOB_FIELDS))) == 1

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
        args: tuple[object, ...] = (*fields.values(), time.time(), job_id)
        if only_if is None:
            return self._rowcount(_UPDATE_JOB, args, sets=setters(fields)) == 1
        if not only_if:
            return False  # no status allowed: nothing can change ("IN ()" is not PostgreSQL)
        sql = _UPDATE_JOB + _ONLY_IF
        n = self._rowcount(sql, (*args, *only_if), sets=setters(fields), marks=marks(len(only_if)))
        return n == 1

    def unfinished_jobs(self) -> list[JobRecord]:
        return self._rows("WHERE status IN ('queued', 'running') ORDER BY created_at, id", ())

    def count_queued(self) -> int:
        row = self._one(_COUNT_WAITING, (time.time(),))
        return 0 if row is None else int(row[0])

    def claim_job(self, holder: str, lease_s: float, max_attempts: int) -> JobRecord | None:
        return self._take("", (), holder, lease_s, max_attempts)

    def take_job(
        self, job_id: str, holder: str, lease_s: float, max_attempts: int
    ) -> JobRecord | None:
        return self._take(THIS_JOB, (job_id,), holder, lease_s, max_attempts)

    def renew_lease(self, job_id: str, holder: str, lease_s: float) -> bool:
        return self._rowcount(_RENEW, (time.time() + lease_s, job_id, holder)) == 1

    def finish_job(self, job_id: str, holder: str, **fields: object) -> bool:
        check_fields(fields)
        args = (*fields.values(), time.time(), job_id, holder)
        return self._rowcount(_FINISH, args, sets=setters(fields)) == 1

    def release_job(self, job_id: str, holder: str, message: str) -> bool:
        return self._rowcount(_RELEASE, (message, time.time(), job_id, holder)) == 1

    def expire_lease(self, job_id: str, holder: str) -> bool:
        return self._rowcount(_EXPIRE, (job_id, holder)) == 1

    def ping(self) -> None:
        self._rowcount(_PING, (time.time(),))
