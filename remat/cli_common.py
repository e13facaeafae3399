"""What the ``remat`` command's subcommands share: reading graphs and budgets, solving locally
with a progress bar, talking to a service, and printing results as aligned tables.

Every user error is a :class:`BadInput` naming the file or flag at fault; :func:`remat.cli.main`
prints it in one line with exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO

from remat.ir import Graph, RematError, SolveResult, format_bytes, parse_budget

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
"""Exit statuses: success; a check failed or no plan fits; bad input."""


class BadInput(Exception):
    """A user error the CLI reports in one line with exit status 2."""


# -- helpers ------------------------------------------------------------------------------------


def read_text(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise BadInput(f"cannot read {path}: {exc.strerror or exc}") from None


def load_graph(path: str) -> Graph:
    """A graph from a JSON file (``-`` for stdin); :class:`BadInput` naming the file."""
    try:
        return Graph.from_json(read_text(path))
    except RematError as exc:
        raise BadInput(f"{path}: {exc}") from None


def budget_arg(text: str, flag: str = "--budget") -> int | float:
    """``--budget`` parsed by :func:`remat.ir.parse_budget` (the one parser): bytes (``12GiB``,
    ``1e9``) or a fraction (``70%``, ``0.7``); ``1`` is refused as ambiguous."""
    try:
        return parse_budget(text)
    except ValueError as exc:
        raise BadInput(f"{flag}: {exc}") from None


def budget_texts(text: str | None) -> list[str] | None:
    """``--budgets 100%,70%,8GiB``: each checked by :func:`remat.ir.parse_budget`, kept as
    written (it labels the frontier's points)."""
    if not text:
        return None
    texts = [t.strip() for t in text.split(",")]
    for t in texts:
        budget_arg(t, "--budgets")
    return texts


def solve_local(
    graph: Graph,
    budget: int | float,
    solver: str | None,
    time_limit_s: float | None,
    bar: Any = None,
) -> SolveResult:
    from remat import solver as solvers

    try:
        if bar is None:
            return solvers.solve(graph, budget, solver=solver, time_limit_s=time_limit_s)
        with bar.ticking("solving", time_limit_s=time_limit_s):
            return solvers.solve(
                graph, budget, solver=solver, time_limit_s=time_limit_s, progress=bar
            )
    except RematError as exc:
        raise BadInput(f"--solver: {exc}") from None


def progress_bar(args: argparse.Namespace, graph: Graph | None = None) -> Any:
    """The progress bar of a command: on stderr when it is a terminal, never with --quiet."""
    from remat.report.progress import ProgressBar

    base = None if graph is None else sum(n.time_s for n in graph.nodes)
    return ProgressBar(args.command, enabled=False if args.quiet else None, baseline_time_s=base)


def service_client(args: argparse.Namespace) -> Any:
    from remat.client import Client

    return Client(args.url, api_key=args.api_key)


def format_pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:+.1f}%"


def format_secs(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.6g} s"


def print_table(rows: list[tuple[str, str]], out: TextIO) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}", file=out)


def result_rows(result: Any) -> list[tuple[str, str]]:
    rows = [
        ("solver", f"{result.solver} ({result.status})"),
        ("budget", f"{format_bytes(result.budget_bytes)} ({result.budget_bytes} bytes)"),
    ]
    if result.peak_bytes is not None:
        rows.append(("peak", f"{format_bytes(result.peak_bytes)} ({result.peak_bytes} bytes)"))
    rows.append(
        (
            "time",
            f"{format_secs(result.total_time_s)} (no remat {format_secs(result.baseline_time_s)}, "
            f"overhead {format_pct(result.overhead)})",
        )
    )
    if result.lower_bound_s is not None:
        rows.append(
            ("bound", f"{format_secs(result.lower_bound_s)} (gap {format_pct(result.gap)})")
        )
    if result.min_budget_bytes is not None:
        rows.append(("smallest budget found", format_bytes(result.min_budget_bytes)))
    if result.min_budget_lower_bytes is not None:
        rows.append(("no plan below (proven)", format_bytes(result.min_budget_lower_bytes)))
    if result.message:
        rows.append(("note", result.message))
    return rows


def cost_arg(sp: argparse.ArgumentParser) -> None:
    """``--cost``: the library's default (``remat.trace``'s ``cost=None``) unless named."""
    sp.add_argument(
        "--cost",
        default=None,
        help="trace cost model: by default remat.trace's (a roofline of the local CPU, measured "
        "once per machine, or the target's datasheet); 'flops' (element-wise ops free), "
        "'measure' (each op timed) or a device profile such as h100",
    )


def plot_file(text: str) -> str:
    """``--plot``: a path ending in .svg or .png (checked before any work)."""
    if Path(text).suffix.lower() not in (".svg", ".png"):
        raise argparse.ArgumentTypeError(f"{text!r}: a plot is written as .svg or .png")
    return text


def write_file(path: str, text: str) -> None:
    try:
        Path(path).write_text(text)
    except OSError as exc:
        raise BadInput(f"cannot write {path}: {exc.strerror or exc}") from None
