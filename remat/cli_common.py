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


# -- sharding -----------------------------------------------------------------------------------


def sharding_args(sp: argparse.ArgumentParser) -> None:
    """``--world-size`` and the FSDP2/DDP options of :class:`remat.ir.sharding.ShardingSpec`."""
    g = sp.add_argument_group("sharded training (the step of one rank)")
    g.add_argument("--world-size", type=int, metavar="N", help="ranks of the data-parallel group")
    g.add_argument(
        "--fsdp-units",
        metavar="PATHS",
        help="FSDP2: comma-separated module paths passed to fully_shard besides the root; "
        "'*' matches one path component (e.g. 'model.layers.*')",
    )
    g.add_argument("--ddp", action="store_true", help="DistributedDataParallel instead of FSDP2")
    g.add_argument(
        "--no-reshard-after-forward",
        action="store_true",
        help="FSDP2: keep gathered parameters from forward to backward",
    )
    g.add_argument("--param-dtype", metavar="DTYPE", help="FSDP2 mixed precision, e.g. bfloat16")
    g.add_argument("--reduce-dtype", metavar="DTYPE", help="FSDP2 reduce-scatter dtype")
    g.add_argument(
        "--gradient-as-bucket-view", action="store_true", help="DDP: gradients are bucket views"
    )


def _units(text: str, graph: Graph) -> tuple[str, ...]:
    import fnmatch

    modules: set[str] = set()
    for n in graph.nodes:
        parts = n.module.split(".") if n.module else []
        modules.update(".".join(parts[: k + 1]) for k in range(len(parts)))
    out: list[str] = []
    for pat in (p.strip() for p in text.split(",")):
        if not pat:
            continue
        if "*" not in pat:
            out.append(pat)
            continue
        depth = pat.count(".")
        hits = sorted(
            (m for m in modules if m.count(".") == depth and fnmatch.fnmatchcase(m, pat)),
            key=lambda m: [int(x) if x.isdigit() else x for x in m.split(".")],
        )
        if not hits:
            raise BadInput(f"--fsdp-units: {pat!r} matches no module of the graph")
        out.extend(h for h in hits if h not in out)
    return tuple(out)


def shard_arg(args: argparse.Namespace, graph: Graph) -> Graph:
    """``graph`` as one rank's step when ``--world-size`` is given (else unchanged).

    Raises
    ------
    BadInput
        Naming the flag at fault.
    """
    import pydantic

    from remat.ir.shard import shard_graph
    from remat.ir.sharding import ShardingSpec

    world = getattr(args, "world_size", None)
    others = ("fsdp_units", "param_dtype", "reduce_dtype")
    if world is None:
        named = [o for o in others if getattr(args, o, None)]
        named += [o for o in ("ddp", "no_reshard_after_forward") if getattr(args, o, False)]
        if named:
            raise BadInput(f"--{named[0].replace('_', '-')} needs --world-size")
        return graph
    if graph.sharding is not None:
        raise BadInput("--world-size: the graph is sharded already (its JSON has 'sharding')")
    fields: dict[str, Any] = {"world_size": world, "strategy": "ddp" if args.ddp else "fsdp2"}
    if args.fsdp_units:
        fields["units"] = _units(args.fsdp_units, graph)
    for name in ("param_dtype", "reduce_dtype"):
        if getattr(args, name):
            fields[name] = getattr(args, name)
    fields["reshard_after_forward"] = not args.no_reshard_after_forward
    fields["gradient_as_bucket_view"] = args.gradient_as_bucket_view
    flag = {"units": "--fsdp-units", "world_size": "--world-size", "strategy": "--ddp"}
    try:
        spec = ShardingSpec.model_validate(fields)
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        name = str(err["loc"][0]) if err["loc"] else "world_size"
        if not err["loc"] and "units" in err["msg"]:
            name = "units"
        raise BadInput(f"{flag.get(name, '--' + name.replace('_', '-'))}: {err['msg']}") from None
    try:
        return shard_graph(graph, spec)
    except ValueError as exc:
        # shard_graph's messages start with what is at fault: a unit, or the step's sizes.
        where = "--fsdp-units" if str(exc).startswith("units:") else "--world-size"
        raise BadInput(f"{where}: {exc}") from None
