"""schemathesis's own runner (``st run``) against a live server, with and without API keys,
over all its phases with all its checks: it must report no failure.

Slow (minutes: ``make test-all``); the CI suite has the short, derandomised version in
test_fuzz.py. The hook in st_hooks.py makes generated graphs consistent for positive cases (the
references between ids that JSON Schema cannot state); nothing else is excused.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from service_harness import BOOT, HERE, REPO, free_port, wait_for

KEY = "st-key-1"


@pytest.mark.slow
@pytest.mark.parametrize("keys", [False, True], ids=["no-keys", "keys"])
def test_st_run_reports_no_failure(tmp_path: Path, keys: bool) -> None:
    # A plain server: the harness's one loads test solvers that crash on purpose.
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE)]),
        "SCHEMATHESIS_HOOKS": "st_hooks",
    }
    serve = [sys.executable, "-c", BOOT, "serve", "--port", str(port), "--workers", "2"]
    serve += ["--db", f"sqlite:///{tmp_path / 'remat.db'}", "--log-level", "warning"]
    log = (tmp_path / "server.log").open("wb")
    server_env = {**env, **({"REMAT_API_KEYS": KEY} if keys else {})}
    proc = subprocess.Popen(serve, env=server_env, cwd=tmp_path, stdout=log, stderr=log)
    try:
        wait_for(lambda: _up(url), timeout_s=120, poll_s=0.2)
        cmd = [str(Path(sys.executable).parent / "st"), "run", url + "/openapi.json"]
        cmd += ["--checks", "all", "--phases", "examples,coverage,fuzzing,stateful"]
        cmd += ["--seed", "1", "--workers", "1", "--max-examples", "30", "--no-color"]
        if keys:
            cmd += ["-H", f"X-API-Key: {KEY}"]
        out = subprocess.run(
            cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=1800
        )
    finally:
        proc.terminate()
        proc.wait(30)
    tail = (out.stdout + out.stderr)[-6000:]
    assert out.returncode == 0, tail
    assert "passed" in tail, tail


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
