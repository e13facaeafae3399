"""A running job's ``progress`` holds the solver's latest report (incumbent, bound, gap), the
same figures a terminal's progress bar shows, and remat.Client shows them change."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from service_harness import BOOT, REPO, free_port, wait_for

import remat
from remat.ir import synthetic

REPORTING = REPO / "tests" / "report"  # _reporting_solver: three improving incumbents


@pytest.fixture
def server(tmp_path: Path):  # type: ignore[no-untyped-def]
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPORTING)]),
    }
    cmd = [sys.executable, "-c", BOOT, "serve", "--port", str(port), "--workers", "1"]
    cmd += ["--db", f"sqlite:///{tmp_path / 'remat.db'}", "--plugin", "_reporting_solver"]
    cmd += ["--log-level", "warning"]
    log = (tmp_path / "server.log").open("wb")
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, (tmp_path / "server.log").read_text()
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(url + "/healthz", timeout=2).status_code == 200
        return False

    wait_for(up, timeout_s=90, poll_s=0.1)
    yield url
    proc.terminate()
    proc.wait(30)


def test_a_job_shows_its_incumbent_improve_through_the_client(server: str) -> None:
    with remat.Client(server) as client:
        gid = client.put_graph(synthetic.chain(6))
        job = client.submit(gid, "70%", solver="test-improving", time_limit_s=60)
        seen: list[tuple[float | None, float | None]] = []
        while True:
            j = client.job(job.id)
            p = j.progress
            if p is not None and p.incumbent_overhead is not None:
                figures = (p.incumbent_overhead, p.gap)
                if not seen or seen[-1] != figures:
                    seen.append(figures)
                assert p.solver == "test-improving" and p.phase == "branch and bound"
                assert p.time_limit_s == 60 and p.lower_bound_s is not None
            if j.status in ("done", "failed", "cancelled"):
                break
            time.sleep(0.05)
        assert j.status == "done", j.error
        # At least two different figures while it ran, each better than the one before.
        assert len(seen) >= 2, seen
        overheads = [o for o, _ in seen]
        assert overheads == sorted(overheads, reverse=True)
        assert set(overheads) <= {0.30, 0.20, 0.10}
