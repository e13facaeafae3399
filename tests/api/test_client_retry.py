"""remat.Client takes 429 and 503 with Retry-After as backpressure: it waits and sends again,
a bounded number of times, then reports the refusal; any other error is reported at once."""

from __future__ import annotations

import httpx
import pytest

from remat.client import Client, ServiceError


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
