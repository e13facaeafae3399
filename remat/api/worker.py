"""A solver worker: ``python -m remat.api.worker READ_FD WRITE_FD MEMORY NICE [PLUGIN...]``.

Started by :class:`remat.api.pool.WorkerPool` as a plain subprocess (not a multiprocessing
child, so it never re-imports the server's main module). It reads task dicts from one pipe and
writes ``("progress", dict)`` and ``("done", dict)`` messages to the other, one task at a time,
until the server closes the pipe. ``MEMORY`` (bytes, 0 for none) caps its address space once
the solvers are imported; a task that runs out of it answers an error naming
``worker_memory_bytes`` and the worker keeps serving. ``NICE`` lowers its CPU priority by that
many steps (``worker_nice``), before any thread starts (Linux keeps a niceness per thread).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any


def _exit_with_parent(parent_pid: int) -> None:
    # A server killed with SIGKILL cannot stop its workers; a worker busy in a long solve would
    # not notice the closed pipe until the solve ends, so it watches its parent instead.
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(0)


def _cap_memory(memory_bytes: int) -> None:
    if memory_bytes <= 0:
        return
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = memory_bytes if hard == resource.RLIM_INFINITY else min(memory_bytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))


def _out_of_memory(memory_bytes: int) -> dict[str, Any]:
    return {
        "error": {
            "loc": ["body"],
            "msg": f"the solve needed more memory than the limit worker_memory_bytes="
            f"{memory_bytes}",
            "type": "limit.worker_memory_bytes",
        }
    }


def serve(
    rx: Connection, tx: Connection, plugins: list[str], memory_bytes: int = 0, nice: int = 0
) -> None:
    """Run tasks from ``rx`` until it closes, answering on ``tx``."""
    if nice > 0:
        with contextlib.suppress(OSError):
            os.nice(nice)
    # The server handles Ctrl-C and stops its workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    from remat.api.tasks import run_task

    for name in plugins:
        importlib.import_module(name)
    _cap_memory(memory_bytes)

    def progress(p: dict[str, Any]) -> None:
        tx.send(("progress", p))

    tx.send(("ready", {}))
    while True:
        try:
            task = rx.recv()
            n = task.pop("body_chunks", None)
            # a raw body follows, chunk by chunk (remat.api.pool)
            chunks = None if n is None else [rx.recv_bytes() for _ in range(n)]
        except (EOFError, OSError):
            return  # the server went away
        try:
            if chunks is not None:
                task["body"] = b"".join(chunks)
                chunks = None
            out: dict[str, Any] = run_task(task, progress)
        except MemoryError:
            out = _out_of_memory(memory_bytes)
        except Exception as exc:  # a solver bug: report it and keep serving
            out = {"crash": f"{type(exc).__name__}: {exc}"}
        try:
            tx.send(("done", out))
        except OSError:
            return


if __name__ == "__main__":
    serve(
        Connection(int(sys.argv[1]), writable=False),
        Connection(int(sys.argv[2]), readable=False),
        sys.argv[5:],
        int(sys.argv[3]),
        int(sys.argv[4]),
    )
