"""A bounded pool of solver worker processes.

Each worker is a long-lived subprocess (:mod:`remat.api.worker`, which imports the solvers once)
that runs one task at a time, talking to the server over a pipe. The server waits
for a worker's answer in a thread, so the event loop never blocks on a solve, and a worker that
dies (a segfault in a native solver, an out-of-memory kill, ``os._exit``) fails only the task it
was running: the pool notices the closed pipe, raises :class:`WorkerCrashed` for that task and
starts a replacement. Cancelling a task kills its worker the same way, which is the only way to
stop a solver that does not poll for cancellation; a worker still busy ``kill_grace_s`` after
its task's time limit is killed too (:class:`WorkerTimeout`). Each worker caps its own address
space at ``memory_bytes`` (``RLIMIT_AS``), so one request cannot take the machine's memory, and
runs ``nice`` steps below the server, so that on a busy machine the server's event loop (health
checks, polls, cached answers) gets a core before solves and parses do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

log = logging.getLogger("remat.api")

ProgressCallback = Callable[[dict[str, Any]], None]


class WorkerCrashed(Exception):
    """The worker process died while running the task."""

    def __init__(self, exitcode: int | None) -> None:
        super().__init__(f"solver worker crashed (exit code {exitcode}); the task was lost")
        self.exitcode = exitcode


class WorkerTimeout(Exception):
    """The worker overran its task's time limit by more than the grace period and was killed."""


class QueueFull(Exception):
    """More tasks are waiting than ``max_queue`` allows."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"too many solves waiting: the queue is full (max_queue={limit})")
        self.limit = limit


class _Worker:
    """One worker subprocess and its two pipes."""

    def __init__(self, plugins: tuple[str, ...], memory_bytes: int, nice: int = 0) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "remat.api.worker",
                    str(to_child_r),
                    str(from_child_w),
                    str(memory_bytes),
                    str(nice),
                    *plugins,
                ],
                pass_fds=(to_child_r, from_child_w),
                stdin=subprocess.DEVNULL,
            )
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self.tx = Connection(to_child_w, readable=False)
        self.rx = Connection(from_child_r, writable=False)
        self.dead = False

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Block until the worker has imported the solvers (or raise :class:`WorkerCrashed`)."""
        try:
            if self.rx.poll(timeout_s):
                kind, _ = self.rx.recv()
                if kind == "ready":
                    return
        except (EOFError, OSError):
            pass
        self.kill()
        raise WorkerCrashed(self.proc.poll())

    def execute(
        self,
        task: dict[str, Any],
        deadline_s: float | None,
        on_progress: ProgressCallback | None,
        on_start: Callable[[], None] | None,
    ) -> dict[str, Any]:
        """Send the task and wait for its answer (runs in a thread)."""
        if on_start is not None:
            on_start()
        try:
            body = task.get("body")
            if isinstance(body, list):
                # A raw body as the server received it, chunk by chunk: written to the pipe as
                # bytes, never pickled or joined here (either would copy it all while holding
                # the GIL, and the event loop would wait for it).
                self.tx.send({**task, "body": None, "body_chunks": len(body)})
                for chunk in body:
                    self.tx.send_bytes(chunk)
            else:
                self.tx.send(task)
        except OSError:
            self.dead = True
            raise WorkerCrashed(self.proc.poll()) from None
        end = None if deadline_s is None else time.monotonic() + deadline_s
        while True:
            wait = 1.0 if end is None else min(1.0, end - time.monotonic())
            if wait <= 0:
                self.kill()
                raise WorkerTimeout(
                    "the solver ran past its time limit and the grace period and was stopped"
                )
            if self.rx.poll(wait):
                try:
                    kind, payload = self.rx.recv()
                except (EOFError, OSError):
                    self.dead = True
                    raise WorkerCrashed(self._exitcode()) from None
                if kind == "progress":
                    if on_progress is not None:
                        with contextlib.suppress(Exception):
                            on_progress(payload)
                    continue
                result: dict[str, Any] = payload
                return result
            if self.proc.poll() is not None:
                self.dead = True
                raise WorkerCrashed(self.proc.returncode)

    def _exitcode(self) -> int | None:
        try:
            return self.proc.wait(5)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        self.dead = True
        with contextlib.suppress(Exception):
            self.proc.kill()
        for c in (self.tx, self.rx):
            with contextlib.suppress(Exception):
                c.close()

    def reap(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.wait(5)


class WorkerPool:
    """``size`` worker processes; at most ``max_queue`` tasks wait for one.

    Use :meth:`admit` when a task is accepted (it raises :class:`QueueFull` beyond the limit)
    and then ``await`` :meth:`run` with ``admitted=True``; or call :meth:`run` alone, which
    admits the task itself.
    """

    def __init__(
        self,
        size: int,
        *,
        max_queue: int,
        kill_grace_s: float = 2.0,
        plugins: tuple[str, ...] = (),
        memory_bytes: int = 0,
        nice: int = 0,
    ) -> None:
        self.size = size
        self.memory_bytes = memory_bytes
        self.nice = nice
        self.max_queue = max_queue
        self.kill_grace_s = kill_grace_s
        self.plugins = plugins
        self.waiting = 0
        self.busy = 0
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._all: set[_Worker] = set()
        self._threads = ThreadPoolExecutor(max_workers=size + 4, thread_name_prefix="remat-pool")
        self._closed = False
        self._background: set[asyncio.Task[None]] = set()

    def _spawn(self) -> _Worker:
        w = _Worker(self.plugins, self.memory_bytes, self.nice)
        self._all.add(w)
        try:
            w.wait_ready()
        except WorkerCrashed:
            self._all.discard(w)
            raise
        return w

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        workers = await asyncio.gather(
            *(loop.run_in_executor(self._threads, self._spawn) for _ in range(self.size))
        )
        for w in workers:
            self._idle.put_nowait(w)

    async def _replace(self, old: _Worker) -> None:
        self._all.discard(old)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._threads, old.reap)
        for attempt in range(3):
            if self._closed:
                return
            try:
                self._idle.put_nowait(await loop.run_in_executor(self._threads, self._spawn))
                return
            except WorkerCrashed as exc:
                log.error("could not start a solver worker (try %d of 3): %s", attempt + 1, exc)
                await asyncio.sleep(1.0)
        log.error("running with one solver worker fewer")
        self.size -= 1

    def _release(self, w: _Worker) -> None:
        if w.dead:
            t = asyncio.get_running_loop().create_task(self._replace(w))
            self._background.add(t)
            t.add_done_callback(self._background.discard)
        else:
            self._idle.put_nowait(w)

    def admit(self, *, force: bool = False) -> None:
        """Count one more waiting task, or raise :class:`QueueFull` (never with ``force``: for
        work accepted earlier, such as jobs recovered after a restart)."""
        if not force and self.waiting >= self.max_queue + max(0, self.size - self.busy):
            raise QueueFull(self.max_queue)
        self.waiting += 1

    def unadmit(self) -> None:
        """Undo :meth:`admit` for a task that will not :meth:`run` after all."""
        self.waiting -= 1

    async def run(
        self,
        task: dict[str, Any],
        *,
        time_limit_s: float | None = None,
        on_progress: ProgressCallback | None = None,
        on_start: Callable[[], None] | None = None,
        admitted: bool = False,
    ) -> dict[str, Any]:
        """Run ``task`` in a worker and return its answer (``{"ok": ...}`` or ``{"error": ...}``).

        ``on_start`` and ``on_progress`` are called from a pool thread, not the event loop.

        Raises
        ------
        QueueFull
            When not ``admitted`` and the queue is full.
        WorkerCrashed, WorkerTimeout
            When the worker died or overran; the pool has already started a replacement.
        """
        if not admitted:
            self.admit()
        try:
            worker = await self._idle.get()
        finally:
            self.waiting -= 1
        self.busy += 1
        deadline = None if time_limit_s is None else time_limit_s + self.kill_grace_s
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(
                self._threads, worker.execute, task, deadline, on_progress, on_start
            )
        except asyncio.CancelledError:
            worker.kill()
            raise
        finally:
            self.busy -= 1
            self._release(worker)

    async def close(self) -> None:
        self._closed = True
        for w in list(self._all):
            w.kill()
        loop = asyncio.get_running_loop()
        for w in list(self._all):
            await loop.run_in_executor(self._threads, w.reap)
        self._all.clear()
        self._threads.shutdown(wait=False, cancel_futures=True)
