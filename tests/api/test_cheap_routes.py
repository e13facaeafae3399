"""Cheap routes never wait behind large bodies (issue 14, item 2), and the bodies held at once
are capped.

A real ``remat serve`` on loopback receives four large graphs at once. Each upload is held back
before its last chunk, so the server is known to be in the middle of receiving all four when
``/healthz`` is asked; then the last chunks go out, and ``/healthz`` must answer 40 times in a
row while the four are being parsed, before any of them is answered. The order of events is
asserted, never a duration: with the parse on the event loop, 7 health checks got in. (On ``main`` before this test, four such uploads held ``/healthz``
for seconds: the bodies were copied and pickled on the server's event loop and its GIL, and
parsed by a pure-Python HTTP parser.)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
from service_harness import Server

UPLOADS = 4
NODES = 10_000  # 1.5 MiB of JSON each: a second or more of parsing, inside the default limits
CHUNK = 256 * 1024
ENOUGH = 40  # health checks answered in a row while the four are parsed


def _graph_body(nodes: int, name: str) -> bytes:
    node = (
        '{"id":"n%d","name":"n","op":"aten.relu","phase":"forward","inputs":[],'
        '"outputs":["v%d"],"time_s":1e-6}'
    )
    value = '{"id":"v%d","size_bytes":4,"kind":"activation"}'
    return (
        f'{{"schema_version":1,"name":"{name}","nodes":['
        + ",".join(node % (i, i) for i in range(nodes))
        + '],"values":['
        + ",".join(value % i for i in range(nodes))
        + '],"required":[],"static_bytes":0}'
    ).encode()


class _Upload:
    """One upload whose last chunk waits for ``release``."""

    def __init__(self, url: str, body: bytes, release: threading.Event, chunk: int = CHUNK) -> None:
        self.url, self.body, self.release, self.chunk = url, body, release, chunk
        self.almost = threading.Event()  # everything but the last chunk is written
        self.sent = threading.Event()  # the last chunk is written too
        self.response: httpx.Response | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _chunks(self) -> Iterator[bytes]:
        pieces = [self.body[i : i + self.chunk] for i in range(0, len(self.body), self.chunk)]
        yield from pieces[:-1]
        self.almost.set()
        self.release.wait(300)
        yield pieces[-1]
        self.sent.set()  # httpx asks for more only once the last chunk is written

    def _run(self) -> None:
        try:
            headers = {"content-type": "application/json"}
            with httpx.Client(timeout=300) as h:
                self.response = h.post(
                    self.url + "/v1/graphs", content=self._chunks(), headers=headers
                )
        except BaseException as exc:  # reported by the test
            self.error = exc


def test_healthz_answers_while_large_uploads_are_in_flight(fresh_server: Server) -> None:
    s = fresh_server.start()
    release = threading.Event()
    uploads = [_Upload(s.url, _graph_body(NODES, f"big{i}"), release) for i in range(UPLOADS)]
    for u in uploads:
        u.thread.start()
    with httpx.Client(base_url=s.url, timeout=300) as h:
        try:
            for u in uploads:
                assert u.almost.wait(300), u.error
            # All four bodies are partly received by the server and none is complete.
            assert h.get("/healthz").status_code == 200
            assert all(u.response is None for u in uploads)
        finally:
            release.set()
        for u in uploads:
            assert u.sent.wait(300), u.error
        # All four are complete and being parsed: /healthz answers, again and again, before
        # any of them does. (Parsing on the event loop, it got 7 answers in, between parses.)
        polls = 0
        while not any(u.response is not None for u in uploads) and polls < ENOUGH:
            assert h.get("/healthz").status_code == 200
            polls += 1
    for u in uploads:
        u.thread.join(300)
        assert u.error is None, u.error
        assert u.response is not None and u.response.status_code == 201, u.response
    assert polls == ENOUGH, f"only {polls} health checks answered before an upload was"


def _nice(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[16])  # field 19: nice


def test_solver_and_parser_processes_run_below_the_server(server: Server) -> None:
    # On a machine whose cores are busy, the server's event loop (health, polls, cached answers)
    # gets a core before solves and parses do: its workers run worker_nice (10) steps lower.
    assert server.proc is not None
    workers = [
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit()
        and _ppid(int(p.name)) == server.proc.pid
        and b"remat.api.worker" in _cmdline(int(p.name))
    ]
    assert len(workers) >= 2 + 2, workers  # two solver workers, two parsers
    assert {_nice(w) - _nice(server.proc.pid) for w in workers} == {10}


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_bodies_held_at_once_are_capped(fresh_server: Server) -> None:
    # Two uploads held mid-body fill most of max_held_body_bytes; a third body is answered 503
    # with Retry-After (naming the setting) instead of growing the server's memory. Once the
    # two are answered their bytes are counted out, and the third goes through.
    fresh_server.env = {
        "REMAT_MAX_BODY_BYTES": "200000",
        "REMAT_MAX_HELD_BODY_BYTES": "250000",
    }
    s = fresh_server.start()
    release = threading.Event()
    bodies = [_graph_body(700, f"held{i}") for i in range(3)]
    assert all(100_000 < len(b) < 200_000 for b in bodies), [len(b) for b in bodies]
    held = [_Upload(s.url, b, release, chunk=50_000) for b in bodies[:2]]
    for u in held:
        u.thread.start()
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=s.url, timeout=300) as h:
        try:
            for u in held:
                assert u.almost.wait(300), u.error
            r = h.post("/v1/graphs", content=bodies[2], headers=headers)
            assert r.status_code == 503, r.text
            assert "max_held_body_bytes=250000" in r.json()["detail"]
            assert r.headers["retry-after"] == "1"
            assert h.get("/healthz").status_code == 200
        finally:
            release.set()
        for u in held:
            u.thread.join(300)
            assert u.error is None, u.error
            assert u.response is not None and u.response.status_code == 201, u.response
        assert h.post("/v1/graphs", content=bodies[2], headers=headers).status_code == 201
