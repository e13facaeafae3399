"""A throwaway PostgreSQL server for the tests, started from the installed server binaries.

Debian's ``postgresql-15`` keeps ``initdb`` and ``postgres`` off PATH (under
``/usr/lib/postgresql/VERSION/bin``), and ``initdb`` refuses to run as root: as root the server
runs as the ``postgres`` user (``runuser``), in a directory that user owns. :func:`find_bin`
says where the binaries are, or why there are none (the tests skip with that reason).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import psycopg
from service_harness import free_port


def find_bin() -> tuple[Path | None, str]:
    """(directory holding initdb and postgres, "") or (None, why not)."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True)
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(on_path)
    if not candidates and shutil.which("dpkg"):
        out = subprocess.run(
            ["dpkg", "-L", "postgresql-15"], capture_output=True, text=True, check=False
        )
        candidates = [line for line in out.stdout.splitlines() if line.endswith("/bin/initdb")]
    for c in candidates:
        d = Path(c).parent
        if (d / "postgres").exists():
            return d, ""
    return (
        None,
        "PostgreSQL server binaries not found (install postgresql-15 or put initdb on PATH)",
    )


class PostgresServer:
    """``initdb`` + ``postgres`` on a free loopback port, trust auth, user ``remat``."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.dir = Path(tempfile.mkdtemp(prefix="remat-pg-"))
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._as: list[str] = []
        if os.geteuid() == 0:
            import pwd

            pw = pwd.getpwnam("postgres")
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]

    def start(self) -> PostgresServer:
        data = self.dir / "data"
        subprocess.run(
            [*self._as, str(self.bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "remat"],
            check=True,
            capture_output=True,
        )
        log = (self.dir / "postgres.log").open("wb")
        cmd = [*self._as, str(self.bindir / "postgres"), "-D", str(data), "-p", str(self.port)]
        cmd += ["-k", str(self.dir), "-h", "127.0.0.1", "-c", "fsync=off"]
        cmd += ["-c", "max_connections=300"]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log)
        end = time.monotonic() + 60
        while True:
            try:
                with psycopg.connect(self.url("postgres"), connect_timeout=2):
                    return self
            except psycopg.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > end:
                    raise RuntimeError(
                        "postgres did not start: " + (self.dir / "postgres.log").read_text()[-2000:]
                    ) from None
                time.sleep(0.2)

    def url(self, db: str) -> str:
        return f"postgresql://remat@127.0.0.1:{self.port}/{db}"

    def new_database(self) -> str:
        """A fresh, empty database's URL."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # The postmaster itself (runuser may not pass signals on): SIGINT, a fast shutdown.
            with contextlib.suppress(OSError, ValueError, IndexError):
                pid = int((self.dir / "data" / "postmaster.pid").read_text().split()[0])
                os.kill(pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
            if self.proc.poll() is None:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
