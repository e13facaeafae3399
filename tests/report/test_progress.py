"""The progress bar: what one line shows, and that it is drawn on a terminal only (a pty here),
never off one or with --quiet."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from remat.ir import Progress, synthetic
from remat.report.progress import ProgressBar

HERE = Path(__file__).resolve().parent


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_line_shows_phase_elapsed_incumbent_bound_and_gap() -> None:
    out = Tty()
    bar = ProgressBar("solve", stream=out, baseline_time_s=2.0)
    bar.set_phase("solving", time_limit_s=60)
    bar(
        Progress(
            solver="milp",
            phase="branch and bound",
            elapsed_s=30.0,
            time_limit_s=60,
            incumbent_overhead=0.082,
            incumbent_peak_bytes=3 * 2**30,
            lower_bound_s=2.1,
            gap=0.031,
        )
    )
    line = bar.line()
    assert line.startswith("remat solve  milp  branch and bound  [##########..........]  30.")
    assert "/60 s" in line and "incumbent +8.2%" in line and "peak 3.00 GiB" in line
    assert "bound +5.0%" in line and "gap 3.1%" in line  # 2.1 s over a 2.0 s eager step
    assert out.getvalue().startswith("\r") and line[:40] in out.getvalue()
    bar.clear()
    assert out.getvalue().endswith("\r") and out.getvalue().rstrip("\r").endswith(" ")
    # A frontier's step and a bound in seconds without the eager time.
    bar = ProgressBar("frontier", stream=Tty())
    bar.set_step(3, 8)
    bar(Progress(solver="rotor", phase="dp", elapsed_s=0.5, lower_bound_s=1.5))
    assert bar.line().startswith("remat frontier  [3/8]  rotor  dp  ")
    assert "bound 1.5 s" in bar.line()


def test_nothing_is_written_off_a_terminal_or_when_quiet() -> None:
    for bar in (
        ProgressBar("solve", stream=io.StringIO()),
        ProgressBar("solve", stream=Tty(), enabled=False),
    ):
        with bar.ticking("solving", time_limit_s=1):
            bar(Progress(solver="x", phase="y", elapsed_s=0.1, incumbent_overhead=0.5))
        assert bar.stream.getvalue() == ""  # type: ignore[attr-defined]


def run_on_a_terminal(args: list[str], tmp_path: Path) -> tuple[int, str, str]:
    """Run ``remat ARGS`` with stderr on a pty (stdout a pipe); the solver of the progress
    tests is registered first."""
    g = tmp_path / "g.json"
    g.write_text(synthetic.chain(6).to_json())
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); import _reporting_solver; "
        "from remat.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *[a.replace("{g}", str(g)) for a in args]],
        stdout=subprocess.PIPE,
        stderr=slave,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    stdout = proc.stdout.read() if proc.stdout else ""
    return proc.wait(timeout=120), stdout, b"".join(chunks).decode(errors="replace")


@pytest.mark.parametrize("command", ["solve", "check"])
def test_a_terminal_sees_the_incumbent_improve(tmp_path: Path, command: str) -> None:
    args = [command, "{g}", "--budget", "70%", "--solver", "test-improving", "--time-limit", "30"]
    code, stdout, tty = run_on_a_terminal(args, tmp_path)
    assert code == 0, (stdout, tty)
    frames = [f for f in tty.split("\r") if f.strip()]
    for overhead in ("+30.0%", "+20.0%", "+10.0%"):
        assert any(
            "test-improving  branch and bound" in f and f"incumbent {overhead}" in f for f in frames
        ), frames
    assert any("/30 s" in f and "gap" in f and "bound" in f for f in frames)
    assert tty.endswith("\r") and tty.rstrip("\r").split("\r")[-1].strip() == ""  # cleared
    assert "\r" not in stdout  # the bar never reaches stdout
    # --quiet: the same command draws nothing on the terminal.
    code, stdout, tty = run_on_a_terminal([*args, "--quiet"], tmp_path)
    assert code == 0 and "incumbent" not in tty and "\r" not in tty


def test_trace_and_frontier_draw_their_phase(tmp_path: Path) -> None:
    code, _, tty = run_on_a_terminal(
        ["frontier", "{g}", "--budgets", "100%,70%", "--solver", "test-improving"], tmp_path
    )
    assert code == 0
    assert "[1/2]  test-improving" in tty and "[2/2]  test-improving" in tty
    assert "incumbent +10.0%" in tty
    spec = str(HERE.parent.parent / "examples" / "models.py") + ":build_mlp"
    code, _, tty = run_on_a_terminal(["trace", spec, "--out", str(tmp_path / "t.json")], tmp_path)
    assert code == 0 and f"remat trace  tracing {spec}" in tty


def test_off_a_terminal_stderr_stays_empty(tmp_path: Path) -> None:
    g = tmp_path / "g.json"
    g.write_text(synthetic.chain(6).to_json())
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); import _reporting_solver; "
        "from remat.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "solve",
            str(g),
            "--budget",
            "70%",
            "--solver",
            "test-improving",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stderr == ""
