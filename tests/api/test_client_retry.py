"""remat.Client takes 429 and 503 with Retry-After as backpressure: it waits and sends again,
a bounded number of times, then reports the refusal; any other error is reported at once."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from remat.client import Client, ServiceError, ServiceUnreachable


def _client(answers: list[httpx.Response], waits: list[float], **kw: object) -> Client:
    calls = iter(answers)

    def handler(request: httpx.Request) -> httpx.Response:
        return next(calls)

    return Client("http://svc", transport=httpx.MockTransport(handler), sleep=waits.append, **kw)  # type: ignore[arg-type]


HEALTH = {"status": "ok", "version": "x", "workers": 1, "busy_workers": 0, "queued": 0}


def test_deferred_requests_are_sent_again_after_retry_after() -> None:
    waits: list[float] = []
    answers = [
        httpx.Response(503, headers={"Retry-After": "1"}, json={"detail": "busy"}),
        httpx.Response(429, headers={"Retry-After": "2"}, json={"detail": "queue full"}),
        httpx.Response(200, json=HEALTH),
    ]
    assert _client(answers, waits).health()["status"] == "ok"
    assert waits == [1.0, 2.0]


def test_retries_are_bounded_and_waits_capped() -> None:
    waits: list[float] = []
    busy = [httpx.Response(503, headers={"Retry-After": "120"}, json={"detail": "busy"})] * 3
    with pytest.raises(ServiceError, match="HTTP 503: busy"):
        _client(busy, waits, max_retries=2, max_wait_s=5.0).health()
    assert waits == [5.0, 5.0]


def test_other_errors_and_refusals_without_retry_after_are_not_retried() -> None:
    for answer in (
        httpx.Response(503, json={"detail": "no header"}),
        httpx.Response(422, json={"detail": "bad"}),
        httpx.Response(500, json={"detail": "crash"}),
    ):
        waits: list[float] = []
        with pytest.raises(ServiceError):
            _client([answer], waits).health()
        assert waits == []


def test_a_dropped_connection_is_sent_again_for_reads_not_for_cancels() -> None:
    waits: list[float] = []
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.method)
        if len(calls) <= 2:
            raise httpx.ReadError("connection reset by peer", request=request)
        return httpx.Response(200, json=HEALTH)

    c = Client("http://svc", transport=httpx.MockTransport(handler), sleep=waits.append)
    assert c.health()["status"] == "ok"
    assert waits == [0.1, 0.2] and calls == ["GET"] * 3
    calls.clear()

    def reset(request: httpx.Request) -> httpx.Response:
        calls.append(request.method)
        raise httpx.ReadError("connection reset by peer", request=request)

    c = Client("http://svc", transport=httpx.MockTransport(reset), sleep=waits.append)
    with pytest.raises(ServiceUnreachable):
        c.cancel("j" * 32)
    assert calls == ["DELETE"]  # a cancel is never repeated


class _AnswerLost(httpx.BaseTransport):
    """Passes requests to the real server; the first answer to ``POST /v1/jobs`` is lost
    after the server made the job (the connection resets as the answer comes back)."""

    def __init__(self) -> None:
        self.real = httpx.HTTPTransport()
        self.lost = 0
        self.keys: list[str | None] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.real.handle_request(request)
        if request.method == "POST" and request.url.path == "/v1/jobs":
            self.keys.append(request.headers.get("Idempotency-Key"))
            if not self.lost:
                response.read()
                self.lost += 1
                raise httpx.ReadError("connection reset by peer", request=request)
        return response


def test_a_job_whose_answer_was_lost_is_made_once(server: Any, small_graph: Any) -> None:
    transport = _AnswerLost()
    with Client(server.url, transport=transport, sleep=lambda s: None) as c:
        gid = c.put_graph(small_graph)
        job = c.submit(gid, budget="71%", solver="checkpoint-all")
        assert transport.lost == 1 and len(transport.keys) == 2
        assert transport.keys[0] is not None and transport.keys[0] == transport.keys[1]
        mine = [j for j in c.jobs(limit=1000) if j.request_key == job.request_key]
        assert [j.id for j in mine] == [job.id]  # one job, not two
        c.wait(job.id, poll_s=0.05)
    # The same key sent with another request is refused, naming the header.
    body = {"graph_id": gid, "budget": "72%", "solver": "checkpoint-all"}
    headers = {"Idempotency-Key": transport.keys[0] or ""}
    r = httpx.post(server.url + "/v1/jobs", json=body, headers=headers, timeout=30)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["header", "Idempotency-Key"]
    r = httpx.post(server.url + "/v1/jobs", json=body, headers={"Idempotency-Key": "a b"})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["header", "Idempotency-Key"]
