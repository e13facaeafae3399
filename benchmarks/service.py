"""Service throughput and latency, one machine against several, and hostile requests.

Two set-ups, each started fresh on loopback ports:

* ``sqlite``: one ``remat serve`` on a SQLite file (``--workers 2``), which runs its own jobs;
* ``postgres``: a PostgreSQL server started here (as the tests do), two ``remat serve``
  replicas and three ``remat worker`` processes (``--workers 1`` each); clients alternate
  between the replicas.

For 50 and 200 concurrent clients (asyncio connections spread over 4 client processes), each
client repeats: a cached solve (answered from the store), then a fresh job (``checkpoint-all``
at a budget no one used) that it polls until done. A prober asks ``/healthz`` every 50 ms
meanwhile. Printed per set-up and client count: requests/s, p50/p99 latency, ``/healthz`` p99,
errors (non-2xx answers, failed jobs and transport failures, each kind listed) and deferrals (a
429 or 503 with ``Retry-After``, sent again after the wait as ``remat.Client`` does: backpressure,
not failure), and resends (a connection that dropped before its answer, sent again with the same
``Idempotency-Key`` as ``remat.Client`` does, so the service makes one job of it).

Then the hostile cases of issue 14 against the SQLite server, each with its answer and time: a
16 MiB body of 10^6 nodes, four of them at once (with ``/healthz``'s worst latency meanwhile),
a 100 MB body, a ``text/plain`` post from a foreign origin, and solver options out of range.

Usage: ``python benchmarks/service.py [--quick] [--only sqlite|postgres]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from remat.ir import synthetic

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "api"))


# A connection that dropped with no answer (as remat.Client resends them).
DROPPED = (httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "REMAT_MAX_QUEUE": "100000"}
    cmd = [sys.executable, "-m", "remat.cli", *args, "--log-level", "warning"]
    out = log.open("wb")
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=out)


def _serve(db: str, workers: int, tmp: Path, name: str) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    proc = _spawn(["serve", "--port", str(port), "--db", db, "--workers", str(workers)], tmp / name)
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                return proc, url
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}: {(tmp / name).read_text()}")
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("server did not start")


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _clients(
    urls: list[str], gid: str, budget0: int, n: int, rounds: int, first: int
) -> dict[str, Any]:
    lat: list[float] = []
    errors = deferred = resent = 0
    kinds: dict[str, int] = {}  # what each error was: a status, a job's end, a transport error
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)

    async def post(h: httpx.AsyncClient, url: str, body: dict[str, Any]) -> httpx.Response:
        """A POST as remat.Client sends it: with its own Idempotency-Key, sent again (the same
        key) when the connection drops before the answer."""
        nonlocal resent
        headers = {"Idempotency-Key": uuid.uuid4().hex}
        for attempt in range(6):
            try:
                return await h.post(url, json=body, headers=headers)
            except DROPPED:
                if attempt == 5:
                    raise
                resent += 1
                await asyncio.sleep(0.1 * 2**attempt)
        raise AssertionError("unreachable")

    async def one(i: int, h: httpx.AsyncClient) -> None:
        nonlocal errors, deferred
        url = urls[i % len(urls)]
        cached = {"graph_id": gid, "budget": budget0, "solver": "checkpoint-all"}
        for r in range(rounds):
            for body, path in ((cached, "/v1/solve"), (None, "/v1/jobs")):
                if body is None:
                    body = {
                        "graph_id": gid,
                        "budget": budget0 + first + i * rounds + r + 1,
                        "solver": "checkpoint-all",
                    }
                t = time.perf_counter()
                kind = ""
                try:
                    resp = await post(h, url + path, body)
                    while resp.status_code in (429, 503) and "retry-after" in resp.headers:
                        # backpressure, as remat.Client takes it: wait, send again
                        deferred += 1
                        await asyncio.sleep(float(resp.headers["retry-after"]))
                        resp = await post(h, url + path, body)
                    ok = resp.status_code in (200, 202)
                    if not ok:
                        kind = f"{path} {resp.status_code}: {resp.text[:120]}"
                    if ok and resp.status_code == 202:
                        job = resp.json()["id"]
                        while True:
                            j = await h.get(f"{url}/v1/jobs/{job}")
                            if j.status_code != 200:
                                ok, kind = False, f"GET job {j.status_code}: {j.text[:120]}"
                                break
                            state = j.json().get("status")
                            if state not in ("queued", "running"):
                                ok = state == "done"
                                if not ok:
                                    kind = f"job {state}: {str(j.json().get('error'))[:120]}"
                                break
                            await asyncio.sleep(0.05)
                except httpx.HTTPError as exc:
                    ok, kind = False, f"{path} {type(exc).__name__}: {str(exc)[:80]}"
                lat.append(time.perf_counter() - t)
                errors += not ok
                if kind:
                    kinds[kind] = kinds.get(kind, 0) + 1

    async with httpx.AsyncClient(timeout=600, limits=limits) as h:
        await asyncio.gather(*(one(i, h) for i in range(n)))
    return {"lat": lat, "errors": errors, "deferred": deferred, "resent": resent, "kinds": kinds}


def _client_proc(args: tuple[list[str], str, int, int, int, int]) -> dict[str, Any]:
    return asyncio.run(_clients(*args))


async def _probe(url: str, stop: asyncio.Event, out: list[float]) -> None:
    async with httpx.AsyncClient(timeout=60) as h:
        while not stop.is_set():
            t = time.perf_counter()
            with contextlib.suppress(httpx.HTTPError):
                await h.get(url + "/healthz")
            out.append(time.perf_counter() - t)
            await asyncio.sleep(0.05)


def _load(
    urls: list[str], gid: str, budget0: int, clients: int, rounds: int, first: int
) -> dict[str, Any]:
    procs = 4
    shares = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    offsets = [first + sum(shares[:i]) * rounds for i in range(procs)]
    health: list[float] = []

    async def run() -> list[dict[str, Any]]:
        stop = asyncio.Event()
        prober = asyncio.create_task(_probe(urls[0], stop, health))
        loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=procs, mp_context=ctx) as ex:
            futs = [
                loop.run_in_executor(ex, _client_proc, (urls, gid, budget0, k, rounds, off))
                for k, off in zip(shares, offsets, strict=True)
                if k
            ]
            parts = await asyncio.gather(*futs)
        stop.set()
        await prober
        return list(parts)

    t0 = time.perf_counter()
    parts = asyncio.run(run())
    wall = time.perf_counter() - t0
    lat = [x for p in parts for x in p["lat"]]
    return {
        "n": len(lat),
        "rps": len(lat) / wall,
        "p50": statistics.median(lat),
        "p99": _pct(lat, 0.99),
        "health_p99": _pct(health, 0.99),
        "errors": sum(p["errors"] for p in parts),
        "deferred": sum(p["deferred"] for p in parts),
        "resent": sum(p["resent"] for p in parts),
        "kinds": _sum_counts(p["kinds"] for p in parts),
    }


def _post_four(url: str, body: bytes) -> list[int | str]:
    """Four posts of ``body`` at once: each answer's status, or the transport error's name."""

    async def run() -> list[Any]:
        headers = {"content-type": "application/json"}
        async with httpx.AsyncClient(timeout=300) as h:
            return await asyncio.gather(
                *(h.post(url + "/v1/graphs", content=body, headers=headers) for _ in range(4)),
                return_exceptions=True,
            )

    rs = asyncio.run(run())
    return [r.status_code if isinstance(r, httpx.Response) else type(r).__name__ for r in rs]


def _sum_counts(counts: Any) -> dict[str, int]:
    total: dict[str, int] = {}
    for c in counts:
        for k, n in c.items():
            total[k] = total.get(k, 0) + n
    return total


def _store_graph(url: str) -> tuple[str, int]:
    graph = synthetic.random_layered_dag(200)
    r = httpx.post(
        url + "/v1/graphs",
        content=graph.to_json(),
        timeout=300,
        headers={"content-type": "application/json"},
    )
    r.raise_for_status()
    return r.json()["id"], int(r.json()["no_remat_peak_bytes"])


def _big_body(nodes: int) -> bytes:
    node = (
        '{"id":"n%d","name":"n","op":"aten.relu","phase":"forward","inputs":[],'
        '"outputs":["v%d"],"time_s":1e-6}'
    )
    value = '{"id":"v%d","size_bytes":4,"kind":"activation"}'
    return (
        '{"schema_version":1,"name":"big","nodes":['
        + ",".join(node % (i, i) for i in range(nodes))
        + '],"values":['
        + ",".join(value % i for i in range(nodes))
        + '],"required":[],"static_bytes":0}'
    ).encode()


def _hostile(url: str, gid: str) -> list[tuple[str, str, float]]:
    rows: list[tuple[str, str, float]] = []
    json_h = {"content-type": "application/json"}

    def timed(name: str, fn: Any) -> None:
        t = time.perf_counter()
        try:
            r = fn()
            what = f"{r.status_code} {str(r.json().get('detail'))[:70]}"
        except httpx.HTTPError as exc:
            what = f"{type(exc).__name__}"
        rows.append((name, what, time.perf_counter() - t))

    big = _big_body(10**6)
    timed(
        f"{len(big) / 2**20:.0f} MiB body, 10^6 nodes",
        lambda: httpx.post(url + "/v1/graphs", content=big, headers=json_h, timeout=300),
    )

    health: list[float] = []

    async def four() -> list[int | str]:
        # The uploads run in a process of their own: on this process's event loop, writing
        # 620 MiB would delay the prober's own requests, and /healthz would look slow.
        stop = asyncio.Event()
        prober = asyncio.create_task(_probe(url, stop, health))
        loop = asyncio.get_running_loop()
        with ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("fork")
        ) as ex:
            codes = await loop.run_in_executor(ex, _post_four, url, big)
        stop.set()
        await prober
        return codes

    t = time.perf_counter()
    codes = asyncio.run(four())
    rows.append(
        (
            "four such bodies at once",
            f"{codes}; /healthz p99 {_pct(health, 0.99) * 1e3:.0f} ms, worst "
            f"{max(health) * 1e3:.0f} ms",
            time.perf_counter() - t,
        )
    )
    huge = b"[" + b"0," * (50 * 2**20) + b"0]"
    timed(
        "100 MB body",
        lambda: httpx.post(url + "/v1/graphs", content=huge, headers=json_h, timeout=300),
    )
    body = json.dumps({"graph_id": gid, "budget": "90%"})
    timed(
        "text/plain post, foreign Origin",
        lambda: httpx.post(
            url + "/v1/jobs",
            content=body,
            headers={"content-type": "text/plain", "origin": "https://evil.example"},
        ),
    )
    for solver, options in (
        ("lp-round", {"samples": 10**6}),
        ("milp", {"threads": 10**6}),
        ("rotor", {"mem_slots": 10**9}),
        ("chen-greedy", {"num_thresholds": "x"}),
        ("milp", {"recompute_backward": "yes"}),
    ):
        req = {
            "graph_id": gid,
            "budget": "60%",
            "solver": solver,
            "options": options,
            "time_limit_s": 20,
        }
        timed(
            f"{solver} {options}",
            lambda req=req: httpx.post(url + "/v1/solve", json=req, timeout=300),
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one round per client")
    ap.add_argument("--only", choices=("sqlite", "postgres"))
    ap.add_argument("--clients", default="50,200")
    ap.add_argument("--no-hostile", action="store_true")
    ap.add_argument(
        "--keep-logs", metavar="DIR", help="write the servers' and workers' logs to DIR, kept"
    )
    args = ap.parse_args()
    rounds = 1 if args.quick else 3
    counts = [int(c) for c in args.clients.split(",")]
    table: list[tuple[str, int, dict[str, Any]]] = []
    hostile: list[tuple[str, str, float]] = []
    keep = contextlib.nullcontext(args.keep_logs) if args.keep_logs else None
    with keep or tempfile.TemporaryDirectory() as tmp_text:
        tmp = Path(tmp_text)
        tmp.mkdir(parents=True, exist_ok=True)
        if args.only in (None, "sqlite"):
            proc, url = _serve(f"sqlite:///{tmp}/bench.db", 2, tmp, "sqlite.log")
            try:
                gid, budget0 = _store_graph(url)
                first = 0
                for n in counts:
                    table.append(
                        ("sqlite, 1 server", n, _load([url], gid, budget0, n, rounds, first))
                    )
                    first += n * rounds
                if not args.no_hostile:
                    hostile = _hostile(url, gid)
            finally:
                proc.terminate()
                proc.wait(60)
        if args.only in (None, "postgres"):
            from postgres import PostgresServer, find_bin

            bindir, why = find_bin()
            if bindir is None:
                print(f"postgres: skipped ({why})")
            else:
                pg = PostgresServer(bindir).start()
                db = pg.new_database()
                procs: list[subprocess.Popen[bytes]] = []
                try:
                    urls = []
                    for i in range(2):
                        p, u = _serve(db, 1, tmp, f"serve{i}.log")
                        procs.append(p)
                        urls.append(u)
                    for i in range(3):
                        procs.append(
                            _spawn(["worker", "--db", db, "--workers", "1"], tmp / f"w{i}")
                        )
                    gid, budget0 = _store_graph(urls[0])
                    first = 0
                    for n in counts:
                        name = "postgres, 2 replicas + 3 workers"
                        table.append((name, n, _load(urls, gid, budget0, n, rounds, first)))
                        first += n * rounds
                finally:
                    for p in procs:
                        p.terminate()
                    for p in procs:
                        p.wait(60)
                    pg.stop()
    print(
        f"\n{os.cpu_count()} CPU cores; each client, {rounds} times: a cached solve, then a "
        "fresh job polled to done"
    )
    print(
        f"{'set-up':<34} {'clients':>7} {'n':>6} {'req/s':>7} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'healthz p99':>11} {'errors':>6} {'deferred':>8} {'resent':>6}"
    )
    for name, n, r in table:
        print(
            f"{name:<34} {n:>7} {r['n']:>6} {r['rps']:>7.1f} {r['p50'] * 1e3:>8.0f} "
            f"{r['p99'] * 1e3:>8.0f} {r['health_p99'] * 1e3:>9.0f}ms {r['errors']:>6} "
            f"{r['deferred']:>8} {r['resent']:>6}"
        )
        for kind, count in sorted(r["kinds"].items(), key=lambda kv: -kv[1]):
            print(f"    {count:>5} x {kind}")
    if hostile:
        print(f"\n{'hostile request (sqlite server)':<44} {'s':>6}  answer")
        for name, what, secs in hostile:
            print(f"{name:<44} {secs:>6.2f}  {what}")


if __name__ == "__main__":
    main()
