"""Start and stop a real ``remat serve`` process for the service tests and the benchmark.

The server runs with torch made unimportable (``sys.modules["torch"] = None``), so every test
against it also shows that the service needs no torch. Its solver workers load
``remat_test_plugin`` (slow and crashing solvers the tests need).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

BOOT = (
    "import sys; sys.modules['torch'] = None; "
    "from remat.cli import main; sys.exit(main(sys.argv[1:]))"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Server:
    """One ``remat serve`` subprocess; restartable on the same database (``db``: a URL,
    default a SQLite file in ``tmp``)."""

    command = "serve"

    def __init__(
        self,
        tmp: Path,
        *,
        env: dict[str, str] | None = None,
        workers: int = 2,
        db: str | None = None,
        name: str = "server",
    ) -> None:
        self.tmp = tmp
        self.db = db or f"sqlite:///{tmp / 'remat.db'}"
        self.name = name
        self.env = env or {}
        self.workers = workers
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 90.0, *, wait: bool = True) -> Server:
        """Start the process; a server is waited for until it answers ``/healthz`` unless
        ``wait`` is False (then :meth:`wait_up`: several processes boot side by side)."""
        self.port = free_port()
        self.starts += 1
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE)]),
            # Short leases: a job of a killed server or worker is taken over in seconds.
            "REMAT_JOB_LEASE_S": "2",
            **self.env,
        }
        log = (self.tmp / f"{self.name}-{self.starts}.log").open("wb")
        cmd = [sys.executable, "-c", BOOT, self.command, "--db", self.db]
        cmd += ["--workers", str(self.workers), "--plugin", "remat_test_plugin"]
        cmd += ["--log-level", "warning"]
        if self.command == "serve":
            cmd += ["--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, env=env, cwd=self.tmp, stdout=log, stderr=log)
        if self.command != "serve" or not wait:
            return self
        return self.wait_up(timeout_s)

    def wait_up(self, timeout_s: float = 90.0) -> Server:
        """Wait until the started server answers ``/healthz``."""
        assert self.proc is not None
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server did not come up: {self.log()}")

    def log(self) -> str:
        return (self.tmp / f"{self.name}-{self.starts}.log").read_text()[-4000:]

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs, as in a crash or an OOM kill."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)


class Worker(Server):
    """One ``remat worker`` subprocess (no HTTP): runs jobs from ``db``."""

    command = "worker"


def wait_for(fn: Callable[[], T], timeout_s: float = 60.0, poll_s: float = 0.05) -> T:
    """Poll ``fn()`` until it returns something truthy (no wall-clock assertion: a generous
    timeout only guards against a hang)."""
    end = time.monotonic() + timeout_s
    while True:
        out = fn()
        if out:
            return out
        if time.monotonic() > end:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(poll_s)
