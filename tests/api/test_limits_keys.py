"""Limits (413 / 422 / 429, each naming its setting) and API keys with per-key isolation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from service_harness import Server, wait_for

from remat.client import Client, ServiceError
from remat.ir import Graph, synthetic

ALICE, BOB = "alice-key-1", "bob-key-2"


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = {
        "REMAT_API_KEYS": f"{ALICE},{BOB}",
        "REMAT_MAX_BODY_BYTES": "200000",
        "REMAT_MAX_NODES": "60",
        "REMAT_MAX_TIME_LIMIT_S": "1000",
        "REMAT_SYNC_TIME_LIMIT_S": "5",
        "REMAT_MAX_QUEUE": "1",
    }
    s = Server(Path(tmp_path_factory.mktemp("limited")), env=env, workers=1).start()
    yield s
    s.stop()


def test_keys_are_required_except_for_health(limited: Server, small_graph: Graph) -> None:
    assert httpx.get(limited.url + "/healthz").status_code == 200
    for method, path in [("GET", "/v1/solvers"), ("GET", "/v1/jobs"), ("POST", "/v1/graphs")]:
        r = httpx.request(method, limited.url + path, json={})
        assert r.status_code == 401 and "API key" in r.json()["detail"]
    r = httpx.get(limited.url + "/v1/jobs", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and "invalid" in r.json()["detail"]
    r = httpx.get(limited.url + "/v1/jobs", headers={"X-API-Key": BOB})
    assert r.status_code == 200


def test_a_key_sees_only_its_own_graphs_and_jobs(limited: Server, small_graph: Graph) -> None:
    with Client(limited.url, api_key=ALICE) as alice, Client(limited.url, api_key=BOB) as bob:
        gid = alice.put_graph(small_graph)
        assert alice.graph(gid).num_nodes == small_graph.num_nodes
        with pytest.raises(ServiceError) as e:
            bob.graph(gid)
        assert e.value.status_code == 404
        with pytest.raises(ServiceError) as e:
            bob.solve(gid, "90%")
        assert e.value.status_code == 404 and "graph_id" in str(e.value)

        job = alice.submit(gid, "90%", solver="checkpoint-all")
        alice.wait(job.id, timeout_s=60, poll_s=0.05)
        assert job.id in {j.id for j in alice.jobs()}
        assert job.id not in {j.id for j in bob.jobs()}
        for call in (bob.job, bob.cancel):
            with pytest.raises(ServiceError) as e:
                call(job.id)
            assert e.value.status_code == 404
        # Bob posting the same graph gets the same id, now his own.
        assert bob.put_graph(small_graph) == gid
        assert bob.graph(gid).created is False


def test_body_size_limit_is_413(limited: Server) -> None:
    # Just over the limit.
    big = synthetic.chain(200).to_json()[:230_000]
    r = httpx.post(
        limited.url + "/v1/graphs",
        content=big,
        headers={"content-type": "application/json", "X-API-Key": ALICE},
    )
    assert r.status_code == 413 and "max_body_bytes=200000" in r.json()["detail"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 50_000):
            yield big[i : i + 50_000].encode()

    r = httpx.post(
        limited.url + "/v1/graphs",
        content=chunks(),
        headers={"content-type": "application/json", "X-API-Key": ALICE},
    )
    assert r.status_code == 413 and "max_body_bytes" in r.json()["detail"]


def test_many_oversized_bodies_at_once_each_get_their_413(limited: Server) -> None:
    """Bodies far over the limit, four at once, declared or chunked: each client reads its 413
    (the server read the rest before answering), none sees its connection reset."""
    import asyncio

    body = b"[" + b"0," * 2_500_000 + b"0]"  # 5 MB, 25 times max_body_bytes

    def chunked() -> object:
        async def gen():  # type: ignore[no-untyped-def]
            for i in range(0, len(body), 1 << 20):
                yield body[i : i + (1 << 20)]

        return gen()

    async def four(content: object) -> list[object]:
        headers = {"content-type": "application/json", "X-API-Key": ALICE}
        async with httpx.AsyncClient(base_url=limited.url, timeout=120) as h:
            return await asyncio.gather(
                *(h.post("/v1/graphs", content=content() if callable(content) else content,
                         headers=headers) for _ in range(4)),
                return_exceptions=True,
            )  # fmt: skip

    for content in (body, chunked):
        answers = asyncio.run(four(content))
        assert [getattr(a, "status_code", repr(a)) for a in answers] == [413] * 4


def test_node_and_time_limits_are_422(limited: Server) -> None:
    h = httpx.Client(base_url=limited.url, headers={"X-API-Key": ALICE}, timeout=60)
    g = synthetic.chain(16)  # 66 nodes > 60
    r = h.post("/v1/graphs", json=g.model_dump(mode="json"))
    assert r.status_code == 422 and "max_nodes=60" in r.text
    assert r.json()["detail"][0]["loc"] == ["body", "nodes"]
    small = synthetic.chain(4).model_dump(mode="json")
    r = h.post("/v1/solve", json={"graph": small, "budget": 1, "time_limit_s": 5000})
    assert r.status_code == 422 and "max_time_limit_s=1000" in r.text
    assert r.json()["detail"][0]["loc"] == ["body", "time_limit_s"]
    h.close()


def test_full_queue_is_429_and_accepted_jobs_still_run(limited: Server) -> None:
    g = synthetic.chain(4)
    with Client(limited.url, api_key=ALICE) as c:
        gid = c.put_graph(g)
        slow = c.submit(gid, "90%", solver="test-sleep", options={"sleep_s": 300}, time_limit_s=600)
        wait_for(lambda: c.job(slow.id).status == "running")
        queued = c.submit(gid, "95%", solver="checkpoint-all")  # waits: the only worker is busy
        with pytest.raises(ServiceError) as e:
            c.submit(gid, "85%", solver="checkpoint-all")
        assert e.value.status_code == 429 and "max_queue=1" in str(e.value)
        with pytest.raises(ServiceError) as e:
            c.solve(gid, "80%", solver="checkpoint-all")
        assert e.value.status_code == 429
        c.cancel(slow.id)
        assert c.wait(queued.id, timeout_s=60, poll_s=0.05).fits
