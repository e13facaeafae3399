"""``remat.Client``: the service's verbs from Python.

    client = remat.Client("http://127.0.0.1:8000", api_key=None)
    gid = client.put_graph(graph)                        # stored by content hash
    result = client.solve(gid, budget="12GiB")           # a SolveResult with its plan
    job = client.submit(gid, budget="50%", solver="milp", time_limit_s=600)
    result = client.wait(job.id)                         # or client.cancel(job.id)

Needs ``httpx`` (the ``service`` extra), not torch or FastAPI.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from remat.api.schemas import (
    FrontierResponse,
    FrontierResult,
    GraphSummary,
    JobResponse,
    SolveResponse,
    SolverList,
)
from remat.ir import Graph, RematError, SolveResult

GraphLike = Graph | Mapping[str, Any] | str
"""A :class:`~remat.ir.Graph`, its JSON as a dict, or the id of a graph already stored."""


class ServiceError(RematError):
    """The service refused a request: ``status_code`` and its ``detail`` (message or fields)."""

    def __init__(self, status_code: int, detail: Any) -> None:
        if isinstance(detail, list):
            parts = [
                f"{'.'.join(str(p) for p in d.get('loc', ()))}: {d.get('msg')}" for d in detail
            ]
            text = "; ".join(parts)
        else:
            text = str(detail)
        super().__init__(f"HTTP {status_code}: {text}")
        self.status_code = status_code
        self.detail = detail


class ServiceUnreachable(RematError):
    """No answer from the service: it could not be reached, or the connection failed or timed
    out (the transport error is the exception's ``__cause__``)."""


class JobFailed(RematError):
    """A job ended failed or cancelled; ``job`` is its last state."""

    def __init__(self, job: JobResponse) -> None:
        super().__init__(f"job {job.id} {job.status}: {job.error or job.message}")
        self.job = job


def _retry_after(r: httpx.Response) -> float | None:
    """Seconds to wait before sending again, for a deferred request (429 or 503 with a
    ``Retry-After`` in seconds); None for any other answer."""
    if r.status_code not in (429, 503):
        return None
    try:
        return max(0.0, float(r.headers.get("retry-after", "")))
    except ValueError:
        return None


# A connection that dropped with no answer: the request may be sent again (see Client).
_DROPPED = (httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


def _once() -> dict[str, str]:
    """Headers of one request that may make a job: its own ``Idempotency-Key``."""
    return {"Idempotency-Key": uuid.uuid4().hex}


def _graph_fields(graph: GraphLike) -> dict[str, Any]:
    if isinstance(graph, str):
        return {"graph_id": graph}
    if isinstance(graph, Graph):
        return {"graph": graph.model_dump(mode="json")}
    return {"graph": dict(graph)}


class Client:
    """A client of one remat service.

    Parameters
    ----------
    url
        Base URL, e.g. ``"http://127.0.0.1:8000"``.
    api_key
        Sent as ``Authorization: Bearer KEY`` when given.
    timeout_s
        HTTP timeout of one request (a synchronous solve can take up to the service's
        ``sync_time_limit_s``).
    max_retries
        How often a request the service deferred is sent again: a 429 (queue full) or 503
        (busy, or its store unavailable) with ``Retry-After`` is backpressure, not failure (the
        service did no work for it), so the client waits as long as the header says (at most
        ``max_wait_s`` each time) and tries again; after that the :class:`ServiceError`.
        A connection that dropped before the answer came (refused, reset, closed) is tried
        again as often, after 0.1, 0.2, 0.4 ... s: reads are safe to repeat, graphs are stored
        by content, and every request that may make a job carries an ``Idempotency-Key``, so
        the service answers a repeat with the job the first one made. A cancel is not
        repeated, nor a request that timed out (the service may still be working on it).
    sleep
        How the client waits between tries (tests pass a recorder).
    """

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        *,
        timeout_s: float = 120.0,
        transport: httpx.BaseTransport | None = None,
        max_retries: int = 5,
        max_wait_s: float = 30.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url.rstrip("/")
        self.max_retries = max_retries
        self.max_wait_s = max_wait_s
        self._sleep = sleep
        self._http = httpx.Client(
            base_url=self.url, headers=headers, timeout=timeout_s, transport=transport
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, *, resend: bool = True, **kw: Any) -> httpx.Response:
        for attempt in range(self.max_retries + 1):
            try:
                r = self._http.request(method, path, **kw)
            except _DROPPED as exc:
                if not resend or attempt == self.max_retries:
                    raise ServiceUnreachable(
                        f"no answer from the service at {self._http.base_url}: {exc}"
                    ) from exc
                self._sleep(min(0.1 * 2**attempt, self.max_wait_s))
                continue
            except httpx.TransportError as exc:
                raise ServiceUnreachable(
                    f"no answer from the service at {self._http.base_url}: {exc}"
                ) from exc
            wait = _retry_after(r)
            if wait is None or attempt == self.max_retries:
                break
            self._sleep(min(wait, self.max_wait_s))
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            raise ServiceError(r.status_code, detail)
        return r

    # -- verbs ---------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        data: dict[str, Any] = self._call("GET", "/healthz").json()
        return data

    def solvers(self) -> SolverList:
        return SolverList.model_validate(self._call("GET", "/v1/solvers").json())

    def put_graph(self, graph: Graph | Mapping[str, Any]) -> str:
        """Store a graph; returns its id (the sha256 of its canonical JSON)."""
        body = graph.model_dump(mode="json") if isinstance(graph, Graph) else dict(graph)
        return str(self._call("POST", "/v1/graphs", json=body).json()["id"])

    def graph(self, graph_id: str) -> GraphSummary:
        return GraphSummary.model_validate(self._call("GET", f"/v1/graphs/{graph_id}").json())

    def _solve_body(
        self,
        graph: GraphLike,
        budget: int | float | str,
        solver: str | None,
        time_limit_s: float | None,
        options: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {**_graph_fields(graph), "budget": budget}
        if solver is not None:
            body["solver"] = solver
        if time_limit_s is not None:
            body["time_limit_s"] = time_limit_s
        if options:
            body["options"] = dict(options)
        return body

    def solve_response(
        self,
        graph: GraphLike,
        budget: int | float | str,
        *,
        solver: str | None = None,
        time_limit_s: float | None = None,
        options: Mapping[str, Any] | None = None,
        wait: bool = True,
        poll_s: float = 0.5,
    ) -> SolveResponse | JobResponse:
        """``POST /v1/solve``: the full response (with ``cached``), or the job of a long solve
        when ``wait`` is false."""
        body = self._solve_body(graph, budget, solver, time_limit_s, options)
        r = self._call("POST", "/v1/solve", json=body, headers=_once())
        if r.status_code == 202:
            job = JobResponse.model_validate(r.json())
            if not wait:
                return job
            done = self.wait(job.id, poll_s=poll_s)
            assert isinstance(done, SolveResult)
            return SolveResponse(
                graph_id=job.graph_id, request_key=job.request_key, cached=False, result=done
            )
        return SolveResponse.model_validate(r.json())

    def solve(
        self,
        graph: GraphLike,
        budget: int | float | str,
        *,
        solver: str | None = None,
        time_limit_s: float | None = None,
        options: Mapping[str, Any] | None = None,
        poll_s: float = 0.5,
    ) -> SolveResult:
        """Solve and return the :class:`SolveResult` (waiting for the job of a long solve)."""
        resp = self.solve_response(
            graph, budget, solver=solver, time_limit_s=time_limit_s, options=options, poll_s=poll_s
        )
        assert isinstance(resp, SolveResponse)
        return resp.result

    def submit(
        self,
        graph: GraphLike,
        budget: int | float | str,
        *,
        solver: str | None = None,
        time_limit_s: float | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> JobResponse:
        """``POST /v1/jobs``: run a solve in the background."""
        body = self._solve_body(graph, budget, solver, time_limit_s, options)
        r = self._call("POST", "/v1/jobs", json=body, headers=_once())
        return JobResponse.model_validate(r.json())

    def job(self, job_id: str) -> JobResponse:
        return JobResponse.model_validate(self._call("GET", f"/v1/jobs/{job_id}").json())

    def jobs(self, limit: int = 100) -> list[JobResponse]:
        data = self._call("GET", "/v1/jobs", params={"limit": limit}).json()
        return [JobResponse.model_validate(j) for j in data["jobs"]]

    def cancel(self, job_id: str) -> JobResponse:
        r = self._call("DELETE", f"/v1/jobs/{job_id}", resend=False)
        return JobResponse.model_validate(r.json())

    def wait(
        self, job_id: str, *, timeout_s: float | None = None, poll_s: float = 0.5
    ) -> SolveResult | FrontierResult:
        """Poll a job until it ends; its result, or :class:`JobFailed`.

        Raises
        ------
        JobFailed
            When the job failed or was cancelled.
        TimeoutError
            When ``timeout_s`` passed first.
        """
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            job = self.job(job_id)
            if job.status == "done":
                assert job.result is not None
                return job.result
            if job.status in ("failed", "cancelled"):
                raise JobFailed(job)
            if end is not None and time.monotonic() > end:
                raise TimeoutError(f"job {job_id} still {job.status} after {timeout_s} s")
            time.sleep(poll_s)

    def frontier(
        self,
        graph: GraphLike,
        budgets: list[int | float | str] | None = None,
        *,
        solver: str | None = None,
        time_limit_s: float | None = None,
        options: Mapping[str, Any] | None = None,
        poll_s: float = 0.5,
    ) -> FrontierResult:
        """``POST /v1/frontier``: time and peak at each budget (waits for a long one's job)."""
        body: dict[str, Any] = {**_graph_fields(graph)}
        if budgets is not None:
            body["budgets"] = budgets
        if solver is not None:
            body["solver"] = solver
        if time_limit_s is not None:
            body["time_limit_s"] = time_limit_s
        if options:
            body["options"] = dict(options)
        r = self._call("POST", "/v1/frontier", json=body, headers=_once())
        if r.status_code == 202:
            out = self.wait(JobResponse.model_validate(r.json()).id, poll_s=poll_s)
            assert isinstance(out, FrontierResult)
            return out
        return FrontierResponse.model_validate(r.json()).result
