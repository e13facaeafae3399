"""A job accepted is never lost: kill the server mid-job, start it again on the same database."""

from __future__ import annotations

from service_harness import Server, wait_for

from remat.client import Client
from remat.ir import Graph


def _start_job_and_kill(server: Server, graph: Graph, sleep_s: float) -> str:
    server.start()
    with Client(server.url) as c:
        job = c.submit(
            graph, "90%", solver="test-sleep", options={"sleep_s": sleep_s}, time_limit_s=600
        )
        wait_for(lambda: c.job(job.id).status == "running")
    server.kill()  # SIGKILL: no shutdown code runs
    return job.id


def test_running_job_is_rerun_after_a_restart(fresh_server: Server, small_graph: Graph) -> None:
    job_id = _start_job_and_kill(fresh_server, small_graph, sleep_s=1.0)
    fresh_server.start()
    with Client(fresh_server.url) as c:
        result = c.wait(job_id, timeout_s=120, poll_s=0.05)
        job = c.job(job_id)
    assert job.status == "done" and job.attempts == 2
    assert "re-queued after a server restart" in job.message
    assert result.solver == "test-sleep" and result.fits


def test_job_out_of_attempts_is_failed_with_the_reason(
    fresh_server: Server, small_graph: Graph
) -> None:
    fresh_server.env = {"REMAT_JOB_MAX_ATTEMPTS": "1"}
    job_id = _start_job_and_kill(fresh_server, small_graph, sleep_s=300)
    fresh_server.start()
    with Client(fresh_server.url) as c:
        job = c.job(job_id)
        assert job.status == "failed"
        assert "server restart" in (job.error or "") and "job_max_attempts=1" in (job.error or "")
        # The server itself is fine and serves new work.
        assert c.solve(small_graph, "90%", solver="checkpoint-all").fits


def test_orderly_shutdown_requeues_without_using_an_attempt(
    fresh_server: Server, small_graph: Graph
) -> None:
    fresh_server.env = {"REMAT_JOB_MAX_ATTEMPTS": "1"}
    fresh_server.start()
    with Client(fresh_server.url) as c:
        job = c.submit(
            small_graph, "90%", solver="test-sleep", options={"sleep_s": 1.0}, time_limit_s=600
        )
        wait_for(lambda: c.job(job.id).status == "running")
    fresh_server.stop()  # SIGTERM: the lifespan's shutdown runs
    fresh_server.start()
    with Client(fresh_server.url) as c:
        c.wait(job.id, timeout_s=120, poll_s=0.05)
        assert c.job(job.id).attempts == 1  # with one attempt allowed, it still ran to the end
