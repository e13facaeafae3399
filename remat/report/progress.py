"""A one-line progress bar for long work on a terminal, fed by a solve's progress callback.

    bar = ProgressBar("solve")          # draws on stderr only when it is a terminal
    with bar.ticking("solving", time_limit_s=60):
        result = remat.solve(graph, "50%", time_limit_s=60, progress=bar)

The line shows the phase, the time elapsed against the limit (as a bar when there is a limit),
the incumbent's overhead and peak, the bound and the gap, redrawn in place with ``\\r``. It is
cleared when the work ends, so the command's own output follows on a clean line. When the
stream is not a terminal, or with ``enabled=False`` (``--quiet``), nothing is written at all.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TextIO

from remat.ir import format_bytes

if TYPE_CHECKING:
    from remat.ir import Progress

BAR_WIDTH = 20
TICK_S = 0.25
"""How often :meth:`ProgressBar.ticking` redraws the elapsed time between reports."""
_SPIN = "|/-\\"


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


class ProgressBar:
    """Draws the latest :class:`~remat.ir.Progress` on one terminal line.

    Parameters
    ----------
    label
        The command (``"solve"``, ``"frontier"``), shown first.
    stream
        Where to draw; default ``sys.stderr`` (stdout stays clean for ``--json``).
    enabled
        ``None``: draw only when ``stream`` is a terminal. ``False``: never (``--quiet``).
    baseline_time_s
        The eager step's time, to show the bound as an overhead like the incumbent's.
    """

    def __init__(
        self,
        label: str,
        *,
        stream: TextIO | None = None,
        enabled: bool | None = None,
        baseline_time_s: float | None = None,
    ) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self.baseline_time_s = baseline_time_s
        self._lock = threading.Lock()
        self._latest: Progress | None = None
        self._phase = ""
        self._started = time.monotonic()
        self._time_limit_s: float | None = None
        self._step: tuple[int, int] | None = None
        self._drawn = 0
        self._frames = 0

    # -- feeding ----------------------------------------------------------------------------

    def __call__(self, progress: Progress) -> None:
        """The progress callback: remember ``progress`` and redraw (never raises)."""
        with self._lock:
            self._latest = progress
            if progress.time_limit_s is not None:
                self._time_limit_s = progress.time_limit_s
        self.draw()

    def set_phase(self, phase: str, *, time_limit_s: float | None = None) -> None:
        """A phase of the command's own (``tracing``, ``solving``); restarts the clock."""
        with self._lock:
            self._phase = phase
            self._started = time.monotonic()
            self._time_limit_s = time_limit_s
            self._latest = None
        self.draw()

    def set_step(self, done: int, total: int) -> None:
        """Where a command of several solves stands (``frontier``: point 3 of 8)."""
        with self._lock:
            self._step = (done, total)
        self.draw()

    @contextmanager
    def ticking(self, phase: str, *, time_limit_s: float | None = None) -> Iterator[ProgressBar]:
        """Within the block, redraw every :data:`TICK_S` so the elapsed time moves even when no
        report arrives; clear the line at the end."""
        self.set_phase(phase, time_limit_s=time_limit_s)
        stop = threading.Event()
        t: threading.Thread | None = None
        if self.enabled:

            def tick() -> None:
                while not stop.wait(TICK_S):
                    self.draw()

            t = threading.Thread(target=tick, name="remat-progress", daemon=True)
            t.start()
        try:
            yield self
        finally:
            stop.set()
            if t is not None:
                t.join()
            self.clear()

    # -- drawing ----------------------------------------------------------------------------

    def line(self) -> str:
        """The text of the bar as it stands now (also when drawing is disabled)."""
        with self._lock:
            p = self._latest
            phase = self._phase
            limit = self._time_limit_s
            step = self._step
            elapsed = time.monotonic() - self._started
        parts = [f"remat {self.label}"]
        if step is not None:
            parts.append(f"[{step[0]}/{step[1]}]")
        if p is not None:
            parts.append(p.solver)
            phase = p.phase
            elapsed = max(elapsed, p.elapsed_s)
        if phase:
            parts.append(phase)
        if limit:
            done = min(1.0, elapsed / limit)
            fill = round(done * BAR_WIDTH)
            parts.append("[" + "#" * fill + "." * (BAR_WIDTH - fill) + "]")
            parts.append(f"{elapsed:.1f}/{limit:.0f} s")
        else:
            parts.append(f"{_SPIN[self._frames % len(_SPIN)]} {elapsed:.1f} s")
        if p is not None:
            if p.incumbent_overhead is not None:
                parts.append(f"incumbent {_pct(p.incumbent_overhead)}")
            if p.incumbent_peak_bytes is not None:
                parts.append(f"peak {format_bytes(p.incumbent_peak_bytes)}")
            if p.lower_bound_s is not None:
                if self.baseline_time_s:
                    parts.append(f"bound {_pct(p.lower_bound_s / self.baseline_time_s - 1)}")
                else:
                    parts.append(f"bound {p.lower_bound_s:.4g} s")
            if p.gap is not None:
                parts.append(f"gap {p.gap * 100:.1f}%")
            if p.message:
                parts.append(p.message)
        return "  ".join(parts)

    def draw(self) -> None:
        """Redraw the line in place; a failing stream turns the bar off instead of raising."""
        if not self.enabled:
            return
        try:
            width = max(20, shutil.get_terminal_size((100, 24)).columns - 1)
            text = self.line()[:width]
            with self._lock:
                self._frames += 1
                pad = " " * max(0, self._drawn - len(text))
                self._drawn = len(text)
                self.stream.write("\r" + text + pad)
                self.stream.flush()
        except (OSError, ValueError):
            self.enabled = False

    def clear(self) -> None:
        """Erase the line (the command's output follows on a clean line)."""
        if not self.enabled or not self._drawn:
            return
        try:
            with self._lock:
                self.stream.write("\r" + " " * self._drawn + "\r")
                self.stream.flush()
                self._drawn = 0
        except (OSError, ValueError):
            self.enabled = False
