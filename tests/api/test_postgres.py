"""Several machines' worth on one: PostgreSQL, two ``remat serve`` replicas, three ``remat
worker`` processes, one of them killed with SIGKILL mid-solve; every job done exactly once.

The PostgreSQL server is started by the suite itself (see ``postgres.py``); the test skips only
where no PostgreSQL server binaries are installed.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from service_harness import Server, Worker, wait_for
from test_hardening import runs

from remat.client import Client
from remat.ir import resolve_budget, synthetic


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()


JOBS = 12  # 0.8 s each over five runners (a worker in each replica, three workers): all busy


def test_two_replicas_three_workers_one_killed(pg_url: str, tmp_path: Path) -> None:
    log = tmp_path / "runs.log"
    env = {"REMAT_TEST_RUN_LOG": str(log), "REMAT_PARSE_WORKERS": "1"}
    replicas = [Server(tmp_path, env=env, workers=1, db=pg_url, name=f"serve{i}") for i in range(2)]
    workers = [Worker(tmp_path, env=env, workers=1, db=pg_url, name=f"worker{i}") for i in range(3)]
    try:
        for p in (*replicas, *workers):
            p.start(wait=False)  # the five boot side by side
        for r in replicas:
            r.wait_up()
        g = synthetic.chain(4)
        base = resolve_budget(g, "90%")
        with Client(replicas[0].url) as c0, Client(replicas[1].url) as c1:
            gid = c0.put_graph(g)
            assert c1.graph(gid).num_nodes == g.num_nodes  # replicas share the store
            jobs = [
                (c0, c1)[i % 2]
                .submit(gid, base + i, solver="test-count", options={"sleep_s": 0.8})
                .id
                for i in range(JOBS)
            ]

            # Kill, with SIGKILL, the worker whose solver has just started a job.
            by_pid = {w.proc.pid: w for w in workers if w.proc is not None}

            def victim() -> tuple[Worker, int] | None:
                for line in reversed(log.read_text().splitlines() if log.exists() else []):
                    what, budget, pid = line.split()
                    if what == "start" and _alive(int(pid)):
                        w = by_pid.get(_parent(int(pid)))
                        if w is not None:
                            return w, int(budget)
                return None

            killed, killed_budget = wait_for(victim, timeout_s=120, poll_s=0.02)
            killed.kill()

            for job_id in jobs:
                c0.wait(job_id, timeout_s=300, poll_s=0.2)
            done = [c1.job(j) for j in jobs]
            assert all(j.status == "done" for j in done)
            starts, ends = runs(log)
            assert sorted(ends) == [base + i for i in range(JOBS)]  # none lost
            assert set(ends.values()) == {1}, ends  # each completed exactly once
            assert starts[killed_budget] == 2  # the killed one ran again, elsewhere
            assert sum(starts.values()) == JOBS + 1  # and nothing else ran twice
            rerun = next(
                j for j in done if j.result is not None and j.result.budget_bytes == killed_budget
            )
            assert rerun.attempts == 2

            # Cancel reaches the job on whichever worker runs it.
            slow = c1.submit(gid, base + 100, solver="test-count", options={"sleep_s": 300})
            wait_for(lambda: runs(log)[0][base + 100] == 1, timeout_s=120)
            pid = next(
                int(line.split()[2])
                for line in log.read_text().splitlines()
                if line.startswith(f"start {base + 100} ")
            )
            assert c0.cancel(slow.id).status == "cancelled"
            wait_for(lambda: not _alive(pid), timeout_s=60)
            assert c1.job(slow.id).status == "cancelled"
    finally:
        for p in (*replicas, *workers):
            if p.proc is not None and p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        for p in (*replicas, *workers):
            p.stop()
