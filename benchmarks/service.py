"""Service throughput and latency: cached and fresh solves on a 2,000-node graph.

Starts ``remat serve`` on a loopback port with a fresh SQLite file, stores one graph of 2,002
nodes (``random_layered_dag(780)``), then measures ``POST /v1/solve`` by graph id:

* cached: the same request again and again (answered from the store, no solver runs);
* fresh: ``checkpoint-all`` at a budget no earlier request used (each one runs in a worker).

with 1 and 8 concurrent clients (processes, one HTTP connection each), and prints requests per
second and p50/p99 latency. Usage: ``python benchmarks/service.py [--workers N] [--quick]``.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import httpx

from remat.ir import synthetic

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _start(db: str, workers: int | None) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "remat.cli", "serve", "--port", str(port), "--db", db]
    cmd += ["--log-level", "warning", "--max-queue", "1000"]
    if workers:
        cmd += ["--workers", str(workers)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                return proc, url
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("server did not start")


def _client(url: str, chunk: list[dict[str, object]]) -> list[float]:
    lat = []
    with httpx.Client(base_url=url, timeout=300) as h:
        for body in chunk:
            t = time.perf_counter()
            r = h.post("/v1/solve", json=body)
            r.read()
            lat.append(time.perf_counter() - t)
            if r.status_code != 200:
                raise SystemExit(f"HTTP {r.status_code}: {r.text[:300]}")
    return lat


def _run(url: str, bodies: list[dict[str, object]], clients: int) -> tuple[float, list[float]]:
    """Send ``bodies`` from ``clients`` client processes (one connection each): (wall seconds,
    per-request latencies). Processes, not threads, so the clients do not share one GIL."""
    chunks = [bodies[i::clients] for i in range(clients)]
    ctx = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=clients, mp_context=ctx) as ex:
        ex.submit(time.sleep, 0).result()  # processes up before the clock starts
        t0 = time.perf_counter()
        lats = [x for part in ex.map(_client, [url] * clients, chunks) for x in part]
        return time.perf_counter() - t0, lats


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, help="solver worker processes (server default)")
    ap.add_argument("--quick", action="store_true", help="fewer requests")
    args = ap.parse_args()
    n_cached, n_fresh = (100, 16) if args.quick else (400, 48)

    graph = synthetic.random_layered_dag(780)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = _start(f"sqlite:///{tmp}/bench.db", args.workers)
        try:
            health = httpx.get(url + "/healthz").json()
            t = time.perf_counter()
            r = httpx.post(
                url + "/v1/graphs",
                content=graph.to_json(),
                timeout=300,
                headers={"content-type": "application/json"},
            )
            upload_s = time.perf_counter() - t
            r.raise_for_status()
            gid = r.json()["id"]
            budget0 = int(r.json()["no_remat_peak_bytes"])
            print(
                f"graph: {graph.num_nodes} nodes, {graph.num_values} values, "
                f"{len(graph.to_json()) / 1e6:.1f} MB JSON; stored in {upload_s * 1e3:.0f} ms"
            )
            print(f"server: {health['workers']} solver workers, {os.cpu_count()} CPU cores\n")

            cached_body = {"graph_id": gid, "budget": budget0, "solver": "checkpoint-all"}
            _run(url, [cached_body], 1)  # the first one solves and stores
            rows = []
            fresh_i = 0
            for clients in (1, 8):
                wall, lat = _run(url, [cached_body] * n_cached, clients)
                rows.append(("cached solve", clients, len(lat), wall, lat))
                bodies = []
                for _ in range(n_fresh):
                    fresh_i += 1
                    bodies.append(
                        {"graph_id": gid, "budget": budget0 + fresh_i, "solver": "checkpoint-all"}
                    )
                wall, lat = _run(url, bodies, clients)
                rows.append(("fresh checkpoint-all", clients, len(lat), wall, lat))
            print(
                f"{'request':<22} {'clients':>7} {'n':>5} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8}"
            )
            for name, clients, n, wall, lat in rows:
                print(
                    f"{name:<22} {clients:>7} {n:>5} {n / wall:>8.1f} "
                    f"{statistics.median(lat) * 1e3:>8.1f} {_pct(lat, 0.99) * 1e3:>8.1f}"
                )
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
