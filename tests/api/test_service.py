"""The service end to end: a real ``remat serve`` process, driven through ``remat.Client``."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from service_harness import Server, wait_for

from remat import solver as solvers
from remat.client import Client, JobFailed, ServiceError
from remat.ir import Graph, eager_plan, resolve_budget, simulate, synthetic


@pytest.fixture
def client(server: Server) -> Client:
    with Client(server.url) as c:
        yield c  # type: ignore[misc]


def test_health_and_solvers(client: Client) -> None:
    h = client.health()
    assert h["status"] == "ok" and h["workers"] == 2
    listed = {s.name: s for s in client.solvers().solvers}
    # Exactly what a fresh interpreter's registry holds, plus the test plugin's solvers (this
    # process may have registered others for its own tests).
    fresh = subprocess.run(
        [sys.executable, "-c", "import remat.solver as s; print(','.join(s.available()))"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    ).stdout.strip()
    plugin = {"test-sleep", "test-crash", "test-bug", "test-count", "test-hog", "test-overrun"}
    assert set(listed) == {*fresh.split(","), *plugin}
    assert listed["test-sleep"].options == ["sleep_s"]  # "progress" is not the client's to set


def test_round_trip_matches_local_solve(client: Client, small_graph: Graph) -> None:
    gid = client.put_graph(small_graph)
    assert gid == small_graph.content_hash()
    assert client.put_graph(small_graph) == gid  # same content, same id
    summary = client.graph(gid)
    assert summary.num_nodes == small_graph.num_nodes
    assert summary.static_bytes == small_graph.static_bytes
    assert summary.no_remat_peak_bytes == simulate(small_graph, eager_plan(small_graph)).peak_bytes

    budget = "70%"
    first = client.solve_response(gid, budget, solver="checkpoint-all")
    local = solvers.get("checkpoint-all")(small_graph, resolve_budget(small_graph, budget))
    assert not first.cached
    r = first.result
    assert r.plan == local.plan
    assert (r.peak_bytes, r.total_time_s, r.budget_bytes) == (
        local.peak_bytes,
        local.total_time_s,
        local.budget_bytes,
    )
    # The simulator, here, agrees with the figures the service sent.
    assert r.plan is not None and simulate(small_graph, r.plan).peak_bytes == r.peak_bytes

    again = client.solve_response(gid, budget, solver="checkpoint-all")
    assert again.cached and again.result == first.result
    # Inline graph: same graph id, same request key, answered from the store.
    inline = client.solve_response(small_graph, budget, solver="checkpoint-all")
    assert inline.cached and inline.graph_id == gid and inline.request_key == first.request_key


def test_default_solver_and_frontier(client: Client, small_graph: Graph) -> None:
    r = client.solve(small_graph, 10**12)
    assert r.solver == client.solvers().default and r.fits
    fr = client.frontier(small_graph, ["100%", 0.5, 85_000_000], solver="checkpoint-all")
    assert [p.budget_bytes for p in fr.points] == [
        resolve_budget(small_graph, b) for b in ("100%", 0.5, 85_000_000)
    ]
    assert fr.eager_peak_bytes == simulate(small_graph, eager_plan(small_graph)).peak_bytes
    # remat.frontier: never slower than the solver alone, within the budget
    local = solvers.get("checkpoint-all")(small_graph, 85_000_000)
    p = fr.points[2]
    assert p.status == local.status and p.peak_bytes is not None and p.peak_bytes <= 85_000_000
    assert p.total_time_s is not None and p.total_time_s <= (local.total_time_s or 0.0)
    assert fr.points[0].total_time_s <= p.total_time_s <= (fr.points[1].total_time_s or 0.0)


def test_long_time_limit_answers_with_a_job(client: Client, small_graph: Graph) -> None:
    resp = client.solve_response(
        small_graph,
        "90%",
        solver="test-sleep",
        time_limit_s=120,
        options={"sleep_s": 0.2},
        wait=False,
    )
    assert resp.status in ("queued", "running")  # a JobResponse: 202
    done = client.wait(resp.id, timeout_s=60, poll_s=0.05)
    assert done.solver == "test-sleep" and done.fits
    job = client.job(resp.id)
    assert job.status == "done" and job.attempts == 1
    assert resp.id in {j.id for j in client.jobs()}


def test_cancel_a_running_job(client: Client, small_graph: Graph) -> None:
    job = client.submit(
        small_graph, "90%", solver="test-sleep", options={"sleep_s": 300}, time_limit_s=600
    )

    def running_with_bound() -> bool:
        j = client.job(job.id)
        return j.status == "running" and j.progress is not None and j.progress.gap is not None

    # The best plan so far, with its bound and gap, while the solver still runs.
    wait_for(running_with_bound)
    progress = client.job(job.id).progress
    assert progress is not None and progress.best is not None and progress.best.plan is not None
    assert progress.best.solver == "test-sleep" and progress.best.total_time_s is not None
    assert progress.lower_bound_s == pytest.approx(0.9 * progress.best.total_time_s)
    cancelled = client.cancel(job.id)
    assert cancelled.status == "cancelled"
    with pytest.raises(ServiceError) as e:
        client.cancel(job.id)
    assert e.value.status_code == 409
    with pytest.raises(JobFailed):
        client.wait(job.id, timeout_s=5)
    # The killed worker is replaced: the pool serves again at full size.
    wait_for(lambda: client.health()["busy_workers"] == 0)
    assert client.solve(small_graph, 10**12, solver="none").fits
    assert client.job(job.id).status == "cancelled"


def test_a_crashing_solver_fails_only_its_request(client: Client, small_graph: Graph) -> None:
    with pytest.raises(ServiceError) as e:
        client.solve(small_graph, "90%", solver="test-crash")
    assert e.value.status_code == 500 and "crashed" in str(e.value)
    job = client.submit(small_graph, "80%", solver="test-crash")
    with pytest.raises(JobFailed) as jf:
        client.wait(job.id, timeout_s=60, poll_s=0.05)
    assert "crashed" in (jf.value.job.error or "")
    assert client.health()["status"] == "ok"
    assert client.solve(small_graph, "90%", solver="checkpoint-all").fits


def test_a_solver_bug_is_a_failed_solve_not_bad_options(client: Client, small_graph: Graph) -> None:
    # A ValueError raised inside a solver, after its options were accepted, is the solver's
    # fault: 500 naming the solver and the error, never a 422 blaming body.options.
    with pytest.raises(ServiceError) as e:
        client.solve(small_graph, "90%", solver="test-bug")
    assert e.value.status_code == 500
    assert "'test-bug' raised ValueError: index 7 out of range" in str(e.value)
    assert "options" not in str(e.value)
    job = client.submit(small_graph, "80%", solver="test-bug")
    with pytest.raises(JobFailed) as jf:
        client.wait(job.id, timeout_s=60, poll_s=0.05)
    assert "'test-bug' raised ValueError" in (jf.value.job.error or "")
    assert client.health()["status"] == "ok"


def test_fifty_concurrent_solves_none_lost(server: Server) -> None:
    g = synthetic.chain(12)
    with Client(server.url) as c:
        gid = c.put_graph(g)
    base = resolve_budget(g, "90%")
    budgets = [base + i for i in range(50)]  # distinct requests: none answered from the store

    def one(b: int) -> tuple[int, int]:
        with httpx.Client(base_url=server.url, timeout=120) as h:
            r = h.post("/v1/solve", json={"graph_id": gid, "budget": b, "solver": "sqrt"})
            return r.status_code, (
                r.json()["result"]["budget_bytes"] if r.status_code == 200 else -1
            )

    with ThreadPoolExecutor(max_workers=50) as ex:
        out = list(ex.map(one, budgets))
    assert [s for s, _ in out] == [200] * 50
    assert [b for _, b in out] == budgets


def test_request_errors_name_the_field(server: Server, small_graph: Graph) -> None:
    h = httpx.Client(base_url=server.url, timeout=60)
    gid = h.post("/v1/graphs", json=small_graph.model_dump(mode="json")).json()["id"]

    def fields(r: httpx.Response) -> list[str]:
        return [".".join(str(p) for p in d["loc"]) for d in r.json()["detail"]]

    r = h.post("/v1/solve", json={"graph_id": "0" * 64, "budget": 1})
    assert r.status_code == 404 and fields(r) == ["body.graph_id"]
    r = h.get(f"/v1/graphs/{'0' * 64}")
    assert r.status_code == 404 and "graph_id" in r.json()["detail"]
    r = h.get("/v1/jobs/nope")
    assert r.status_code == 404 and "job_id" in r.json()["detail"]
    r = h.post("/v1/solve", json={"graph_id": gid, "budget": -1})
    assert r.status_code == 422 and fields(r) == ["body.budget"]
    r = h.post("/v1/solve", json={"graph_id": gid, "budget": "12 parsecs"})
    assert r.status_code == 422 and fields(r) == ["body.budget"]
    r = h.post("/v1/solve", json={"graph_id": gid, "budget": 10**40})
    assert r.status_code == 422 and fields(r) == ["body.budget"]
    r = h.post("/v1/solve", json={"graph_id": gid, "budget": 1, "solver": "no-such"})
    assert r.status_code == 422 and fields(r) == ["body.solver"]
    r = h.post(
        "/v1/solve",
        json={"graph_id": gid, "budget": 1, "solver": "none", "options": {"colour": "red"}},
    )
    assert r.status_code == 422 and fields(r) == ["body.options.colour"]
    r = h.post(
        "/v1/solve",
        json={"graph_id": gid, "budget": 1, "solver": "test-sleep", "options": {"progress": 1}},
    )
    assert r.status_code == 422 and fields(r) == ["body.options.progress"]
    r = h.post("/v1/solve", json={"graph_id": gid, "budget": 1, "time_limit_s": -3})
    assert r.status_code == 422 and fields(r) == ["body.time_limit_s"]
    r = h.post(
        "/v1/solve", content=b'{"graph_id": "ab', headers={"content-type": "application/json"}
    )
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "json_invalid"

    bad = small_graph.model_dump(mode="json")
    bad["nodes"][1]["inputs"] = [bad["nodes"][3]["outputs"][0]]  # a cycle
    r = h.post("/v1/solve", json={"graph": bad, "budget": 1})
    assert r.status_code == 422 and fields(r) == ["body.graph"]
    assert "cycle" in r.json()["detail"][0]["msg"] and repr(bad["nodes"][1]["id"]) in r.text

    huge = small_graph.model_dump(mode="json")
    huge["values"][2]["size_bytes"] = 10**30
    r = h.post("/v1/graphs", json=huge)
    assert r.status_code == 422 and fields(r) == ["body.values.2.size_bytes"]
    r = h.post("/v1/solve", json={"graph": huge, "budget": 1})
    assert r.status_code == 422 and fields(r) == ["body.graph.values.2.size_bytes"]

    wrong = small_graph.model_dump(mode="json")
    wrong["nodes"][0]["time_s"] = "fast"
    r = h.post("/v1/graphs", json=wrong)
    assert r.status_code == 422 and fields(r)[0] == "body.nodes.0.time_s"
    h.close()


def test_cli_lists_the_services_solvers(server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    from remat.cli import main

    assert main(["solvers", "--json", "--url", server.url]) == 0
    remote = json.loads(capsys.readouterr().out)
    assert main(["solvers", "--json"]) == 0
    local = json.loads(capsys.readouterr().out)
    # the test server also loads the test plugin's solvers; every built-in is listed the same
    by_name = {e["name"]: e for e in remote["solvers"]}
    assert remote["default"] == local["default"]
    assert all(by_name[e["name"]] == e for e in local["solvers"])
    assert "hierarchical" in by_name


def test_cli_solves_on_the_service(server: Server, small_graph: Graph, tmp_path: Path) -> None:
    from remat.cli import main

    f = tmp_path / "g.json"
    f.write_text(small_graph.to_json())
    out = tmp_path / "r.json"
    argv = ["solve", str(f), "--budget", "90%", "--solver", "checkpoint-all", "--url", server.url]
    assert main([*argv, "--out", str(out)]) == 0
    from remat.solver.base import SolveResult

    r = SolveResult.model_validate_json(out.read_text())
    assert (
        r.peak_bytes
        == solvers.get("checkpoint-all")(small_graph, resolve_budget(small_graph, "90%")).peak_bytes
    )
    assert main([*argv[:-2], "--solver", "no-such", "--url", server.url]) == 2
