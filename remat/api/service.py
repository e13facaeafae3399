"""The service's work behind the routes: graphs, cached results, synchronous solves and jobs.

Routes validate the body and call one method here; everything that touches the disk runs in a
thread and everything that solves runs in the worker pool, so the event loop only waits.

Jobs: a job is written to the store before it is answered (202), and its state moves
queued -> running -> done | failed | cancelled in the store. At start-up, jobs left queued or
running by a previous process are re-run, unless one was already started ``job_max_attempts``
times (it may be what brought the server down): that one is marked failed with the reason.
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
from typing import Any

from fastapi import Response
from fastapi.responses import JSONResponse

from remat import solver as solvers
from remat.api.errors import ApiError, field_error
from remat.api.pool import QueueFull, WorkerCrashed, WorkerPool, WorkerTimeout
from remat.api.schemas import (
    MAX_BYTES,
    FrontierRequest,
    GraphRef,
    JobResponse,
    SolveRequest,
    check_magnitudes,
)
from remat.api.settings import Settings
from remat.api.store import UNFINISHED, JobKind, JobRecord, Store
from remat.api.tasks import DEFAULT_FRONTIER, PROGRESS_OPTION
from remat.ir import Graph, RematError, eager_plan, parse_budget, simulate

log = logging.getLogger("remat.api")


def graph_summary(graph: Graph) -> dict[str, Any]:
    """The stored summary of a graph, with the no-remat (eager) peak."""
    s = graph.summary()
    s["no_remat_peak_bytes"] = simulate(graph, eager_plan(graph)).peak_bytes
    return s


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

    def __init__(self, settings: Settings, store: Store, pool: WorkerPool) -> None:
        self.settings = settings
        self.store = store
        self.pool = pool
        self._jobs: dict[str, asyncio.Task[None]] = {}
        self._cancelling: set[str] = set()

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        await self.pool.start()
        await self.recover()

    async def close(self) -> None:
        tasks = list(self._jobs.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self.pool.close()
        self.store.close()

    async def recover(self) -> None:
        """Take care of jobs a previous process left queued or running."""
        limit = self.settings.job_max_attempts
        for rec in await asyncio.to_thread(self.store.unfinished_jobs):
            if rec.status == "running" and rec.attempts >= limit:
                await asyncio.to_thread(
                    self.store.update_job,
                    rec.id,
                    status="failed",
                    error=(
                        f"interrupted by a server restart while running (attempt {rec.attempts}"
                        f" of job_max_attempts={limit}); not run again"
                    ),
                    only_if=UNFINISHED,
                )
                continue
            await asyncio.to_thread(
                self.store.update_job,
                rec.id,
                status="queued",
                message=f"re-queued after a server restart (was {rec.status})",
            )
            self.pool.admit(force=True)  # accepted jobs are never refused for the queue limit
            self._spawn_job(rec.id)

    # -- graphs --------------------------------------------------------------------------------

    async def put_graph(
        self, owner: str, graph: Graph, at: tuple[str, ...] = ("body",)
    ) -> tuple[str, dict[str, Any], bool]:
        """Store ``graph`` for ``owner``: (id, summary, created). ``at`` is the graph's path in
        the request, for error messages."""
        self._check_graph(graph, at)
        text = await asyncio.to_thread(graph.canonical_json)
        gid = hashlib.sha256(text.encode()).hexdigest()
        old = await asyncio.to_thread(self.store.graph_summary, owner, gid)
        if old is not None:
            summary: dict[str, Any] = json.loads(old)
            return gid, summary, False
        summary = await asyncio.to_thread(graph_summary, graph)
        created = await asyncio.to_thread(
            self.store.put_graph, owner, gid, text, json.dumps(summary)
        )
        return gid, summary, created

    async def graph_summary(self, owner: str, graph_id: str) -> dict[str, Any]:
        text = await asyncio.to_thread(self.store.graph_summary, owner, graph_id)
        if text is None:
            raise ApiError(404, f"graph_id {graph_id!r}: no such graph")
        summary: dict[str, Any] = json.loads(text)
        return summary

    def _check_graph(self, graph: Graph, at: tuple[str, ...]) -> None:
        settings = self.settings
        if graph.num_nodes > settings.max_nodes:
            raise ApiError(
                422,
                [
                    {
                        "loc": [*at, "nodes"],
                        "msg": f"the graph has {graph.num_nodes} nodes, more than the limit "
                        f"max_nodes={settings.max_nodes}",
                        "type": "limit.max_nodes",
                    }
                ],
            )
        errs = check_magnitudes(graph, at)
        if errs:
            raise ApiError(422, [e.model_dump() for e in errs])

    async def _graph_of(self, owner: str, ref: GraphRef) -> tuple[str, str]:
        """(graph id, canonical JSON) of an inline or stored graph; inline ones are stored."""
        if ref.graph is not None:
            gid, _, _ = await self.put_graph(owner, ref.graph, ("body", "graph"))
        else:
            assert ref.graph_id is not None
            gid = ref.graph_id
        text = await asyncio.to_thread(self.store.graph_json, owner, gid)
        if text is None:
            raise ApiError(
                404,
                [{"loc": ["body", "graph_id"], "msg": f"no graph {gid!r}", "type": "not_found"}],
            )
        return gid, text

    # -- requests ------------------------------------------------------------------------------

    def _solver(self, name: str | None, options: dict[str, Any]) -> str:
        chosen = name or solvers.default_solver()
        try:
            si = solvers.info(chosen)
        except RematError as exc:
            raise field_error(["body", "solver"], str(exc), "unknown_solver") from None
        for opt in options:
            if opt not in si.options or opt == PROGRESS_OPTION:
                known = ", ".join(si.options) or "none"
                raise field_error(
                    ["body", "options", opt],
                    f"solver {chosen!r} has no option {opt!r} (its options: {known})",
                )
        return chosen

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

    async def prepare_solve(self, owner: str, req: SolveRequest) -> Prepared:
        """Validate a solve request."""
        settings = self.settings
        budget = normalize_budget(req.budget, ["body", "budget"])
        name = self._solver(req.solver, req.options)
        t = self._time_limit(req.time_limit_s, settings.default_time_limit_s)
        gid, text = await self._graph_of(owner, req)
        params = {"budget": budget, "solver": name, "time_limit_s": t, "options": req.options}
        task = {"kind": "solve", **params, "budget": req.budget, "graph": text, "graph_id": gid}
        return Prepared("solve", gid, self._key(owner, "solve", gid, params), task, t)

    async def prepare_frontier(self, owner: str, req: FrontierRequest) -> Prepared:
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
        name = self._solver(req.solver, req.options)
        per_point = min(settings.default_time_limit_s, settings.sync_time_limit_s / len(specs))
        t = self._time_limit(req.time_limit_s, per_point)
        gid, text = await self._graph_of(owner, req)
        params = {"budgets": norm, "solver": name, "time_limit_s": t, "options": req.options}
        task = {"kind": "frontier", **params, "budgets": specs, "graph": text, "graph_id": gid}
        key = self._key(owner, "frontier", gid, params)
        return Prepared("frontier", gid, key, task, t * len(specs))

    # -- running -------------------------------------------------------------------------------

    async def cached(self, key: str) -> str | None:
        return await asyncio.to_thread(self.store.cached, key)

    async def answer(self, owner: str, p: Prepared, *, as_job: bool) -> Response:
        """The one way a prepared request is answered: from the store when the same request
        was solved before (``cached: true``); as a job (202 with ``Location``) when ``as_job``
        or when its time limit is above ``sync_time_limit_s``; otherwise solved now."""
        if not as_job:
            hit = await self.cached(p.key)
            if hit is not None:
                return wrap(p.graph_id, p.key, True, hit)
        if as_job or p.time_limit_s > self.settings.sync_time_limit_s:
            rec = await self.submit(owner, p)
            return JSONResponse(
                job_response(rec).model_dump(mode="json"),
                status_code=202,
                headers={"Location": f"/v1/jobs/{rec.id}"},
            )
        return wrap(p.graph_id, p.key, False, await self.run_now(p.task, p.key, p.time_limit_s))

    async def run_now(self, task: dict[str, Any], key: str, time_limit_s: float) -> str:
        """Run a task in the pool and wait: the result JSON (cached for next time)."""
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
            await asyncio.to_thread(self.store.put_cached, key, out["ok"])

    async def submit(self, owner: str, p: Prepared) -> JobRecord:
        """Accept a job (written before it is answered); 429 when the queue is full."""
        now = time.time()
        key = p.key
        stored = {k: v for k, v in p.task.items() if k != "graph"}  # the store has the graph
        stored["deadline_s"] = p.time_limit_s
        rec = JobRecord(
            id=uuid.uuid4().hex,
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
            await asyncio.to_thread(self.store.create_job, rec)
            return rec
        try:
            self.pool.admit()
        except QueueFull as exc:
            raise ApiError(429, str(exc), {"Retry-After": "1"}) from None
        try:
            await asyncio.to_thread(self.store.create_job, rec)
        except BaseException:
            self.pool.unadmit()
            raise
        self._spawn_job(rec.id)
        return rec

    def _spawn_job(self, job_id: str) -> None:
        t = asyncio.get_running_loop().create_task(self._run_job(job_id), name=f"job-{job_id}")
        self._jobs[job_id] = t
        t.add_done_callback(lambda _: self._jobs.pop(job_id, None))

    async def _finish(self, job_id: str, **fields: Any) -> None:
        await asyncio.to_thread(self.store.update_job, job_id, only_if=UNFINISHED, **fields)

    async def _run_job(self, job_id: str) -> None:
        admitted = True
        prev_attempts: int | None = None
        try:
            rec = await asyncio.to_thread(self.store.job, job_id)
            assert rec is not None
            task: dict[str, Any] = json.loads(rec.request)
            deadline = float(task.pop("deadline_s"))
            graph = await asyncio.to_thread(self.store.graph_json, rec.owner, rec.graph_id)
            if graph is None:
                self.pool.unadmit()
                admitted = False
                await self._finish(job_id, status="failed", error="its graph is no longer stored")
                return
            task["graph"] = graph
            prev_attempts = rec.attempts
            attempt = rec.attempts + 1
            started = time.monotonic()
            store = self.store

            def on_start() -> None:
                store.update_job(job_id, status="running", attempts=attempt, only_if=("queued",))

            def on_progress(p: dict[str, Any]) -> None:
                p.setdefault("elapsed_s", time.monotonic() - started)
                store.update_job(job_id, progress=json.dumps(p), only_if=("running",))

            admitted = False  # pool.run takes the admission over from here
            out = await self.pool.run(
                task,
                time_limit_s=deadline,
                on_progress=on_progress,
                on_start=on_start,
                admitted=True,
            )
        except asyncio.CancelledError:
            if admitted:
                self.pool.unadmit()
            if job_id in self._cancelling:
                self._cancelling.discard(job_id)
                return
            if prev_attempts is not None:
                # An orderly shutdown is not the job's fault: it goes back to the queue without
                # using up an attempt, and the next start runs it.
                self.store.update_job(
                    job_id,
                    status="queued",
                    attempts=prev_attempts,
                    message="the server shut down while it ran; re-queued",
                    only_if=("running",),
                )
            raise
        except WorkerCrashed as exc:
            await self._finish(job_id, status="failed", error=str(exc))
            return
        except WorkerTimeout as exc:
            await self._finish(job_id, status="failed", error=str(exc))
            return
        except Exception as exc:
            log.exception("job %s", job_id)
            await self._finish(job_id, status="failed", error=f"{type(exc).__name__}: {exc}")
            return
        if "error" in out:
            e = out["error"]
            loc = ".".join(str(p) for p in e["loc"])
            await self._finish(job_id, status="failed", error=f"{loc}: {e['msg']}")
        elif "crash" in out:
            await self._finish(job_id, status="failed", error=f"the solver failed: {out['crash']}")
        else:
            await self._finish(job_id, status="done", result=out["ok"])
            await self._remember(rec.request_key, out)

    async def job(self, owner: str, job_id: str) -> JobRecord:
        rec = await asyncio.to_thread(self.store.job, job_id, owner)
        if rec is None:
            raise ApiError(404, f"job_id {job_id!r}: no such job")
        return rec

    async def jobs(self, owner: str, limit: int) -> list[JobRecord]:
        return await asyncio.to_thread(self.store.jobs, owner, limit)

    async def cancel(self, owner: str, job_id: str) -> JobRecord:
        rec = await self.job(owner, job_id)
        if rec.status not in UNFINISHED:
            raise ApiError(409, f"job {job_id!r} is already {rec.status}; nothing to cancel")
        self._cancelling.add(job_id)
        changed = await asyncio.to_thread(
            self.store.update_job,
            job_id,
            status="cancelled",
            message="cancelled by the caller",
            only_if=UNFINISHED,
        )
        t = self._jobs.get(job_id)
        if changed and t is not None:
            t.cancel()
        else:
            self._cancelling.discard(job_id)
        return await self.job(owner, job_id)


def wrap(graph_id: str, key: str, cached: bool, result_json: str) -> Response:
    """The response body around a stored result, without parsing it again."""
    head = f'{{"graph_id":"{graph_id}","request_key":"{key}","cached":{str(cached).lower()},'
    return Response(head + f'"result":{result_json}}}', media_type="application/json")


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
    return JobResponse.model_validate(
        {
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
            "progress": progress,
            "result": result,
        }
    )
