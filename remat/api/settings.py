"""Service settings: one frozen object, built from keyword arguments or ``REMAT_*`` variables.

One object is the one source: :func:`remat.api.create_app` builds the store, the worker pool
and the :class:`~remat.api.service.Service` from it, and the routes read their limits from the
service. :func:`get_settings` returns that same object (for code that has only the request).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, model_validator


def _default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def _default_worker_memory() -> int:
    # Half the machine's memory per solver process, at least 1 GiB: one hostile request can
    # no longer take the whole machine, and a real solve still has room.
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 * 2**30
    return max(2**30, total // 2)


class Settings(BaseModel):
    """Limits, storage and access for one service instance.

    Attributes
    ----------
    db_url
        Where jobs, graphs and cached results live: ``sqlite:///path/to.db`` (the default,
        created on first use; several servers on one machine may share it),
        ``sqlite:///:memory:`` or ``memory://`` (nothing persists), or
        ``postgresql://user@host/db`` (several machines: jobs run by ``remat worker``).
    api_keys
        When non-empty, every ``/v1`` route needs one of these keys (``Authorization: Bearer
        KEY`` or ``X-API-Key: KEY``) and a key sees only its own graphs and jobs.
    workers
        Solver worker processes: at most this many solves run at once.
    max_queue
        Solves (jobs or synchronous requests) allowed to wait for a worker; beyond it, 429.
    max_body_bytes
        Largest request body; beyond it, 413.
    max_held_body_bytes
        Most bytes of request bodies the server holds at once (uploads in flight and bodies
        being parsed); a chunk beyond it is answered 503 with ``Retry-After``. 0: four times
        ``max_body_bytes``.
    max_nodes
        Largest graph, in nodes; beyond it, 422.
    max_time_limit_s
        Largest time limit a request may ask for; beyond it, 422.
    sync_time_limit_s
        Solves whose (total) time limit is at most this answer directly; longer ones answer
        202 with a job.
    default_time_limit_s
        Time limit of a solve that names none.
    max_frontier_points
        Most budgets in one frontier request.
    job_max_attempts
        A job interrupted by a restart is re-run until it has started this many times; then
        it is marked failed with the reason.
    kill_grace_s
        A worker still busy this long after its task's time limit is killed and replaced
        (504 for a synchronous solve, a failed job).
    worker_memory_bytes
        Address-space cap of each solver and parser process (``RLIMIT_AS``); a solve that needs
        more fails with a 422 naming this setting instead of taking the machine. 0: no cap.
    max_values
        Largest graph, in values; beyond it, 422 (checked before the graph is validated).
    job_lease_s
        A running job's lease: its runner renews it every third of this; when a runner dies
        (server, ``remat worker`` or machine), another takes the job once the lease ran out.
    cors_origins
        Origins a browser may call the service from (CORS); empty (the default): none.
    parse_workers
        Processes that check and parse large request bodies (off the event loop).
    worker_nice
        How many steps below the server the solver and parser processes run (``nice``): on a
        machine whose cores are all busy, health checks, job polls and cached answers still get
        one first. 0: the same priority.
    store_timeout_s
        How long a store operation may wait (a locked SQLite file, a PostgreSQL connection)
        before the request answers 503 with ``Retry-After``.
    plugins
        Modules imported by the server and every worker before solving: a plugin registers
        extra solvers with ``remat.solver.register``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    db_url: str = "sqlite:///remat.db"
    api_keys: tuple[str, ...] = ()
    workers: int = Field(default_factory=_default_workers, ge=1, le=256)
    max_queue: int = Field(default=64, ge=0)
    max_body_bytes: int = Field(default=64 * 2**20, ge=1)
    max_held_body_bytes: int = Field(default=0, ge=0)
    max_nodes: int = Field(default=100_000, ge=1)
    max_time_limit_s: float = Field(default=3600.0, gt=0)
    sync_time_limit_s: float = Field(default=30.0, gt=0)
    default_time_limit_s: float = Field(default=10.0, gt=0)
    max_frontier_points: int = Field(default=32, ge=1)
    job_max_attempts: int = Field(default=2, ge=1)
    kill_grace_s: float = Field(default=2.0, ge=0)
    plugins: tuple[str, ...] = ()
    worker_memory_bytes: int = Field(default_factory=_default_worker_memory, ge=0)
    max_values: int = Field(default=400_000, ge=1)
    job_lease_s: float = Field(default=15.0, ge=0.5)
    cors_origins: tuple[str, ...] = ()
    store_timeout_s: float = Field(default=5.0, gt=0)
    parse_workers: int = Field(default=2, ge=1, le=64)
    worker_nice: int = Field(default=10, ge=0, le=19)

    @model_validator(mode="after")
    def _held_covers_one_body(self) -> Settings:
        if 0 < self.max_held_body_bytes < self.max_body_bytes:
            raise ValueError(
                f"max_held_body_bytes={self.max_held_body_bytes} is below "
                f"max_body_bytes={self.max_body_bytes}: no body of the largest size could arrive"
            )
        return self

    @property
    def held_body_limit_bytes(self) -> int:
        """``max_held_body_bytes``, or four largest bodies when it is 0."""
        return self.max_held_body_bytes or 4 * self.max_body_bytes

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> Settings:
        """Settings from ``REMAT_DB``, ``REMAT_API_KEYS`` (comma separated), ``REMAT_WORKERS``,
        ``REMAT_MAX_QUEUE``, ``REMAT_MAX_BODY_BYTES``, ``REMAT_MAX_HELD_BODY_BYTES``,
        ``REMAT_MAX_NODES``,
        ``REMAT_MAX_TIME_LIMIT_S``, ``REMAT_SYNC_TIME_LIMIT_S``, ``REMAT_DEFAULT_TIME_LIMIT_S``,
        ``REMAT_PLUGINS``, ``REMAT_CORS_ORIGINS`` (comma separated), ``REMAT_JOB_MAX_ATTEMPTS``,
        ``REMAT_KILL_GRACE_S``, ``REMAT_WORKER_MEMORY_BYTES``, ``REMAT_MAX_VALUES``,
        ``REMAT_JOB_LEASE_S``, ``REMAT_STORE_TIMEOUT_S``, ``REMAT_PARSE_WORKERS``,
        ``REMAT_WORKER_NICE``; keyword
        ``overrides`` that are not None win."""
        env = os.environ if environ is None else environ
        names = {
            "REMAT_DB": "db_url",
            "REMAT_WORKERS": "workers",
            "REMAT_MAX_QUEUE": "max_queue",
            "REMAT_MAX_BODY_BYTES": "max_body_bytes",
            "REMAT_MAX_HELD_BODY_BYTES": "max_held_body_bytes",
            "REMAT_MAX_NODES": "max_nodes",
            "REMAT_MAX_TIME_LIMIT_S": "max_time_limit_s",
            "REMAT_SYNC_TIME_LIMIT_S": "sync_time_limit_s",
            "REMAT_DEFAULT_TIME_LIMIT_S": "default_time_limit_s",
            "REMAT_JOB_MAX_ATTEMPTS": "job_max_attempts",
            "REMAT_KILL_GRACE_S": "kill_grace_s",
            "REMAT_WORKER_MEMORY_BYTES": "worker_memory_bytes",
            "REMAT_MAX_VALUES": "max_values",
            "REMAT_JOB_LEASE_S": "job_lease_s",
            "REMAT_STORE_TIMEOUT_S": "store_timeout_s",
            "REMAT_PARSE_WORKERS": "parse_workers",
            "REMAT_WORKER_NICE": "worker_nice",
        }
        data: dict[str, object] = {f: env[k] for k, f in names.items() if env.get(k)}
        lists = (
            ("REMAT_API_KEYS", "api_keys"),
            ("REMAT_PLUGINS", "plugins"),
            ("REMAT_CORS_ORIGINS", "cors_origins"),
        )
        for var, field in lists:
            if env.get(var):
                data[field] = tuple(p.strip() for p in env[var].split(",") if p.strip())
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(data)


def get_settings(request: Request) -> Settings:
    """The settings of the running app (the service's own)."""
    settings: Settings = request.app.state.service.settings
    return settings
