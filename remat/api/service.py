"""The service's work behind the routes: graphs, cached results, synchronous solves and jobs.

Routes validate the body and call one method here; everything that touches the disk runs in a
thread and everything that solves runs in a worker process, so the event loop only waits.

Jobs: a job is written to the store before it is answered (202), and its state moves
queued -> running -> done | failed | cancelled in the store. Its queue (:mod:`remat.api.queue`)
hands it to a runner on a lease (:mod:`remat.api.runner`): this server's own pool on SQLite,
``remat worker`` processes on PostgreSQL. A job whose runner died is taken by another once the
lease ran out, unless it already started ``job_max_attempts`` times (it may be what brought the
runner down): that one is failed with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Response

from remat import solver as solvers
from remat.api import options as solver_options
from remat.api.errors import ApiError, field_error
from remat.api.health import StoreHealth
from remat.api.parse import GraphPayload
from remat.api.pool import QueueFull, WorkerCrashed, WorkerPool, WorkerTimeout
from remat.api.queue import JobQueue
from remat.api.schemas import MAX_BYTES, FrontierRequest, GraphRef, JobResponse, SolveRequest
from remat.api.settings import Settings
from remat.api.store import UNFINISHED, JobKind, JobRecord, Store, StoreUnavailable
from remat.api.tasks import DEFAULT_FRONTIER
from remat.ir import RematError, parse_budget

log = logging.getLogger("remat.api")
T = TypeVar("T")


def normalize_budget(spec: int | float | str, loc: list[str | int]) -> int | str:
    """Bytes for absolute budgets, ``"frac:X"`` for fractions (resolved later, with the graph).

    Checks what can be checked without the graph, so a bad budget never reaches a worker.
    """
    try:
        n = parse_budget(spec)
    except ValueError as exc:
        raise field_error(loc, str(exc)) from None
    if isinstance(n, float):
        return f"frac:{n!r}"
    if n > MAX_BYTES:
        raise field_error(loc, f"budget: {n} bytes exceeds the largest budget ({MAX_BYTES})")
    return n


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A validated solve or frontier request, ready to answer from the store, queue or run."""

    kind: JobKind
    graph_id: str
    key: str
    task: dict[str, Any]
    time_limit_s: float


class Service:
    """Graphs, results and jobs over one store and one worker pool.

    ``settings`` is the one source of limits and behaviour: the routes read it through the
    service, and so do recovery and the jobs (:func:`remat.api.settings.get_settings` returns
    this same object).
    """

    def __init__(
        self,
        settings: Settings,
        store: Store,
        pool: WorkerPool,
        queue: JobQueue,
        parser: WorkerPool,
    ) -> None:
        self.settings = settings
        self.store = store
        self.pool = pool
        self.queue = queue
        self.parser = parser
        self.health = StoreHealth(store, settings.store_timeout_s)

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.gather(self.pool.start(), self.parser.start())
        await self.health.start()
        await self.queue.start()

    async def close(self) -> None:
        await self.queue.close()
        await self.health.close()
        await asyncio.gather(self.pool.close(), self.parser.close())
        self.store.close()

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """A store call in a thread; :class:`StoreUnavailable` becomes the service's 503."""
        return await asyncio.to_thread(fn, *args)

    # -- graphs --------------------------------------------------------------------------------

    async def put_graph(self, owner: str, g: GraphPayload) -> tuple[dict[str, Any], bool]:
        """Store a parsed graph for ``owner``: (summary, created)."""
        created = await self.call(self.store.put_graph, owner, g.id, g.text, json.dumps(g.summary))
        return g.summary, created

    async def graph_summary(self, owner: str, graph_id: str) -> dict[str, Any]:
        text = await self.call(self.store.graph_summary, owner, graph_id)
        if text is None:
            raise ApiError(404, f"graph_id {graph_id!r}: no such graph")
        summary: dict[str, Any] = json.loads(text)
        return summary

    async def _graph_of(
        self, owner: str, ref: GraphRef, inline: GraphPayload | None
    ) -> tuple[str, str]:
        """(graph id, canonical JSON) of an inline or stored graph; inline ones are stored."""
        if inline is not None:
            await self.put_graph(owner, inline)
            return inline.id, inline.text
        assert ref.graph_id is not None
        gid = ref.graph_id
        text = await self.call(self.store.graph_json, owner, gid)
        if text is None:
            raise ApiError(
                404,
                [{"loc": ["body", "graph_id"], "msg": f"no graph {gid!r}", "type": "not_found"}],
            )
        return gid, text

    # -- requests ------------------------------------------------------------------------------

    def _solver(self, name: str | None, given: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """The solver's name and its options, checked (a whole-number float for an integer
        option becomes the integer: :func:`remat.api.options.whole_numbers`)."""
        chosen = name or solvers.default_solver()
        try:
            si = solvers.info(chosen)
        except RematError as exc:
            raise field_error(["body", "solver"], str(exc), "unknown_solver") from None
        for opt in given:
            if opt not in solvers.user_options(si):
                known = ", ".join(solvers.user_options(si)) or "none"
                raise field_error(
                    ["body", "options", opt],
                    f"solver {chosen!r} has no option {opt!r} (its options: {known})",
                )
        # Types from the solver's signature, then the solver's own check (its bounds), here
        # in the server before any work.
        options = solver_options.whole_numbers(chosen, given)
        solver_options.check(chosen, options)
        try:
            si.check_options(options)
        except ValueError as exc:
            named = getattr(exc, "option", None)
            loc: list[str | int] = ["body", "options", *([named] if named else [])]
            raise field_error(loc, str(exc), "invalid_option") from None
        return chosen, options

    def _time_limit(self, given: float | None, default: float) -> float:
        settings = self.settings
        t = default if given is None else given
        if t > settings.max_time_limit_s:
            raise field_error(
                ["body", "time_limit_s"],
                f"time_limit_s={t:g} exceeds the limit max_time_limit_s="
                f"{settings.max_time_limit_s:g}",
                "limit.max_time_limit_s",
            )
        return t

    @staticmethod
    def _key(owner: str, kind: str, graph_id: str, params: dict[str, Any]) -> str:
        # The owner is part of the key: one caller's results never answer another's request.
        head = {"owner": owner, "kind": kind, "graph": graph_id}
        text = json.dumps({**head, **params}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    async def prepare_solve(
        self, owner: str, req: SolveRequest, inline: GraphPayload | None
    ) -> Prepared:
        """Validate a solve request (``inline``: its graph, parsed, if it came inline)."""
        settings = self.settings
        budget = normalize_budget(req.budget, ["body", "budget"])
        name, options = self._solver(req.solver, req.options)
        t = self._time_limit(req.time_limit_s, settings.default_time_limit_s)
        gid, text = await self._graph_of(owner, req, inline)
        params = {"budget": budget, "solver": name, "time_limit_s": t, "options": options}
        task = {"kind": "solve", **params, "budget": req.budget, "graph": text, "graph_id": gid}
        return Prepared("solve", gid, self._key(owner, "solve", gid, params), task, t)

    async def prepare_frontier(
        self, owner: str, req: FrontierRequest, inline: GraphPayload | None
    ) -> Prepared:
        """Validate a frontier request (its time limit is the total over its budgets)."""
        settings = self.settings
        specs = req.budgets if req.budgets is not None else list(DEFAULT_FRONTIER)
        if not specs:
            raise field_error(["body", "budgets"], "budgets: give at least one budget")
        if len(specs) > settings.max_frontier_points:
            raise field_error(
                ["body", "budgets"],
                f"{len(specs)} budgets exceed the limit max_frontier_points="
                f"{settings.max_frontier_points}",
                "limit.max_frontier_points",
            )
        norm = [normalize_budget(s, ["body", "budgets", i]) for i, s in enumerate(specs)]
        name, options = self._solver(req.solver, req.options)
        per_point = min(settings.default_time_limit_s, settings.sync_time_limit_s / len(specs))
        t = self._time_limit(req.time_limit_s, per_point)
        gid, text = await self._graph_of(owner, req, inline)
        params = {"budgets": norm, "solver": name, "time_limit_s": t, "options": options}
        task = {"kind": "frontier", **params, "budgets": specs, "graph": text, "graph_id": gid}
        key = self._key(owner, "frontier", gid, params)
        return Prepared("frontier", gid, key, task, t * len(specs))

    # -- running -------------------------------------------------------------------------------

    async def cached(self, key: str) -> str | None:
        return await self.call(self.store.cached, key)

    async def answer(
        self, owner: str, p: Prepared, *, as_job: bool, idempotency_key: str | None = None
    ) -> Response:
        """The one way a prepared request is answered: from the store when the same request
        was solved before (``cached: true``); as a job (202 with ``Location``) when ``as_job``
        or when its time limit is above ``sync_time_limit_s``; otherwise solved now.
        ``idempotency_key``: see :meth:`submit`."""
        if not as_job:
            hit = await self.cached(p.key)
            if hit is not None:
                return wrap(p.graph_id, p.key, True, hit)
        if as_job or p.time_limit_s > self.settings.sync_time_limit_s:
            rec = await self.submit(owner, p, idempotency_key)
            response = job_json(rec)
            response.status_code = 202
            response.headers["Location"] = f"/v1/jobs/{rec.id}"
            return response
        return wrap(p.graph_id, p.key, False, await self.run_now(p.task, p.key, p.time_limit_s))

    async def _check_queue(self, waiting_here: int) -> None:
        """429 when more solves wait than ``max_queue`` allows: ``waiting_here`` in this
        server's pool plus, when this server runs the jobs, the jobs waiting in the store."""
        queued = await self.call(self.store.count_queued) if self.queue.local else 0
        if waiting_here + queued >= self.settings.max_queue + self.queue.free:
            raise ApiError(
                429,
                str(QueueFull(self.settings.max_queue)),
                {"Retry-After": "1"},
            )

    async def run_now(self, task: dict[str, Any], key: str, time_limit_s: float) -> str:
        """Run a task in the pool and wait: the result JSON (cached for next time)."""
        await self._check_queue(self.pool.waiting)
        try:
            out = await self.pool.run(task, time_limit_s=time_limit_s)
        except QueueFull as exc:
            raise ApiError(429, str(exc), {"Retry-After": "1"}) from None
        except WorkerCrashed as exc:
            raise ApiError(500, str(exc)) from None
        except WorkerTimeout as exc:
            raise ApiError(504, str(exc)) from None
        if "error" in out:
            raise ApiError(422, [out["error"]])
        if "crash" in out:
            raise ApiError(500, f"the solver failed: {out['crash']}")
        text: str = out["ok"]
        await self._remember(key, out)
        return text

    async def _remember(self, key: str, out: dict[str, Any]) -> None:
        # The worker decides from the result's status: a solve that ran out of time may do
        # better on another try, so it is not cached.
        if out.get("cacheable"):
            await self.call(self.store.put_cached, key, out["ok"])

    async def submit(
        self, owner: str, p: Prepared, idempotency_key: str | None = None
    ) -> JobRecord:
        """Accept a job (written before it is answered); 429 when the queue is full.

        With an ``idempotency_key`` (the ``Idempotency-Key`` header) the job's id is derived
        from it and the owner, so the same request sent again (a client whose connection
        dropped before the answer came) gets the job the first one made, never a second; the
        key sent with another request is refused (422)."""
        now = time.time()
        key = p.key
        job_id = (
            uuid.uuid4().hex if idempotency_key is None else keyed_job_id(owner, idempotency_key)
        )
        if idempotency_key is not None:
            old = await self.call(self.store.job, job_id, owner)
            if old is not None:
                return _same_request(old, key, idempotency_key)
        stored = {k: v for k, v in p.task.items() if k != "graph"}  # the store has the graph
        stored["deadline_s"] = p.time_limit_s
        rec = JobRecord(
            id=job_id,
            owner=owner,
            kind=p.kind,
            status="queued",
            graph_id=p.graph_id,
            request=json.dumps(stored),
            request_key=key,
            created_at=now,
            updated_at=now,
        )
        hit = await self.cached(key)
        if hit is not None:
            rec = dataclasses.replace(
                rec, status="done", result=hit, message="answered from the store"
            )
            return await self._create(rec, key, idempotency_key)
        await self._check_queue(0)
        created = await self._create(rec, key, idempotency_key)
        if created is not rec:
            return created  # the same request, sent again while the first was answered
        try:
            await self.queue.enqueue(rec.id)
        except StoreUnavailable:
            # Never leave a job that no runner will see: it is failed, and the caller told.
            with contextlib.suppress(StoreUnavailable):
                await self.call(self._fail_unqueued, rec.id)
            raise
        return rec

    async def _create(self, rec: JobRecord, key: str, idempotency_key: str | None) -> JobRecord:
        """Write ``rec``; when its keyed id exists already (the same request, racing), the job
        stored under it."""
        if await self.call(self.store.create_job, rec):
            return rec
        old = await self.call(self.store.job, rec.id, rec.owner)
        if old is None or idempotency_key is None:
            raise ApiError(500, f"job id {rec.id!r} exists already")
        return _same_request(old, key, idempotency_key)

    def _fail_unqueued(self, job_id: str) -> None:
        self.store.update_job(
            job_id, status="failed", error="the job queue was unavailable", only_if=("queued",)
        )

    async def job(self, owner: str, job_id: str) -> JobRecord:
        rec = await self.call(self.store.job, job_id, owner)
        if rec is None:
            raise ApiError(404, f"job_id {job_id!r}: no such job")
        return rec

    async def jobs(self, owner: str, limit: int) -> list[JobRecord]:
        return await self.call(self.store.jobs, owner, limit)

    async def cancel(self, owner: str, job_id: str) -> JobRecord:
        """Cancel a job; the runner that has it (on any server or worker) stops it at its next
        lease renewal, this server's own at once."""
        rec = await self.job(owner, job_id)
        if rec.status not in UNFINISHED:
            raise ApiError(409, f"job {job_id!r} is already {rec.status}; nothing to cancel")
        changed = await self.call(self._mark_cancelled, job_id)
        if not changed:
            rec = await self.job(owner, job_id)
            raise ApiError(409, f"job {job_id!r} is already {rec.status}; nothing to cancel")
        self.queue.cancel(job_id)
        return await self.job(owner, job_id)

    def _mark_cancelled(self, job_id: str) -> bool:
        return self.store.update_job(
            job_id, status="cancelled", message="cancelled by the caller", only_if=UNFINISHED
        )


def wrap(graph_id: str, key: str, cached: bool, result_json: str) -> Response:
    """The response body around a stored result, without parsing it again."""
    head = f'{{"graph_id":"{graph_id}","request_key":"{key}","cached":{str(cached).lower()},'
    return Response(head + f'"result":{result_json}}}', media_type="application/json")


def _job_head(rec: JobRecord) -> dict[str, Any]:
    """A stored job's fields of ``JobResponse`` other than its progress and result."""
    return {
        "id": rec.id,
        "kind": rec.kind,
        "status": rec.status,
        "graph_id": rec.graph_id,
        "request_key": rec.request_key,
        "created_at": rec.created_at,
        "updated_at": rec.updated_at,
        "attempts": rec.attempts,
        "message": rec.message,
        "error": rec.error,
    }


def keyed_job_id(owner: str, idempotency_key: str) -> str:
    """The id of the job an owner's ``Idempotency-Key`` names (32 hex digits, as a random
    job id)."""
    return hashlib.sha256(f"{owner}\0{idempotency_key}".encode()).hexdigest()[:32]


def _same_request(old: JobRecord, key: str, idempotency_key: str) -> JobRecord:
    if old.request_key != key:
        raise field_error(
            ["header", "Idempotency-Key"],
            f"Idempotency-Key {idempotency_key!r} was sent with another request (job "
            f"{old.id}); send a new key with each new request",
        )
    return old


def job_json(rec: JobRecord) -> Response:
    """A stored job as its ``JobResponse`` JSON, with progress and result spliced in as stored
    (never parsed again: a poll stays cheap whatever the size of the plan it carries)."""
    text = json.dumps(_job_head(rec))[:-1]
    text += f',"progress":{rec.progress or "null"},"result":{rec.result or "null"}}}'
    return Response(text, media_type="application/json")


def job_response(rec: JobRecord, *, full: bool = True) -> JobResponse:
    """The API form of a stored job; without ``full``, no result and no plan in the progress."""
    progress: Any = None
    result: Any = None
    if rec.progress:
        progress = json.loads(rec.progress)
        if not full:
            progress.pop("best", None)
    if full and rec.result:
        result = json.loads(rec.result)
    return JobResponse.model_validate({**_job_head(rec), "progress": progress, "result": result})
