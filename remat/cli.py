"""The ``remat`` command: trace, solve, check, frontier, solvers, report, serve, worker.

Exit status: 0 success; 1 a check failed (``check``), or no plan fits the budget (``solve``);
2 bad input (a missing or malformed file, a graph that fails validation, an unknown solver, an
unreadable budget) or a service that refused the request. Errors are one line on stderr, never
a traceback. Heavy imports (torch for ``trace``, uvicorn for ``serve``) happen inside the
command that needs them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from remat.cli_common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_OK,
    BadInput,
    budget_arg,
    budget_texts,
    cost_arg,
    format_pct,
    format_secs,
    load_graph,
    plot_file,
    print_table,
    progress_bar,
    read_text,
    result_rows,
    service_client,
    shard_arg,
    sharding_args,
    solve_local,
    write_file,
)
from remat.cli_solvers import cmd_solvers
from remat.ir import (
    Graph,
    RematError,
    SolveResult,
    eager_plan,
    format_bytes,
    simulate,
)
from remat.report.check import cost_model_text

# -- commands -----------------------------------------------------------------------------------


def cmd_solve(args: argparse.Namespace) -> int:
    graph = shard_arg(args, load_graph(args.graph))
    budget = budget_arg(args.budget)
    if args.url:
        with service_client(args) as c:
            result = c.solve(graph, budget, solver=args.solver, time_limit_s=args.time_limit)
    else:
        result = solve_local(graph, budget, args.solver, args.time_limit, progress_bar(args, graph))
    if args.out:
        write_file(args.out, result.model_dump_json(indent=1))
    if args.json:
        print(result.model_dump_json(exclude={"plan"}, indent=1))
    else:
        print(f"remat solve: {args.graph} ({graph.num_nodes} nodes)")
        print_table([*result_rows(result), ("cost model", cost_model_text(graph))], sys.stdout)
        if args.out:
            print(f"  wrote {args.out}")
    return EXIT_OK if result.fits else EXIT_FAILED


def _solver_names(arg: str | None) -> list[str]:
    from remat import solver as solvers

    if not arg:
        return [solvers.default_solver()]
    names = [n.strip() for n in arg.split(",") if n.strip()]
    if not names:
        raise BadInput("--solver: no solver named")
    return names


def _frontier_local(args: argparse.Namespace, graph: Graph, names: list[str]) -> list[Any]:
    """Each solver at each of ``--budgets``, with a progress bar (``frontier``, ``report``)."""
    from remat.report.frontier import DEFAULT_BUDGETS, compute_frontier

    specs = budget_texts(args.budgets)
    bar = progress_bar(args, graph)

    def start(i: int, total: int, name: str, spec: Any) -> None:
        bar.set_step(i + 1, total)
        bar.set_phase(f"{name} at {spec}", time_limit_s=args.time_limit)

    try:
        with bar.ticking("solving"):
            return compute_frontier(
                graph,
                budgets=specs or list(DEFAULT_BUDGETS),
                solvers=names,
                time_limit_s=args.time_limit,
                on_start=start,
                solve_options={"progress": bar},
            )
    except ValueError as exc:
        raise BadInput(f"--budgets: {exc}") from None


def cmd_frontier(args: argparse.Namespace) -> int:
    from remat.report.frontier import FrontierPoint, dump_frontier, frontier_text

    graph = load_graph(args.graph)
    specs = budget_texts(args.budgets)
    names = _solver_names(args.solver)
    if args.url:
        points: list[FrontierPoint] = []
        with service_client(args) as c:
            for name in names:
                fr = c.frontier(graph, specs, solver=name, time_limit_s=args.time_limit)
                points += [
                    FrontierPoint.model_validate(
                        {
                            **p.model_dump(),
                            "budget": str(p.budget),
                            "solver": p.solver or name,
                            "baseline_time_s": fr.baseline_time_s,
                        }
                    )
                    for p in fr.points
                ]
    else:
        points = _frontier_local(args, graph, names)
    if args.plot:
        from remat.report.plots import frontier_figure, save

        save(
            frontier_figure(points, title=f"budget / time frontier: {graph.name or args.graph}"),
            args.plot,
        )
    if args.json:
        print(dump_frontier(points))
        return EXIT_OK
    print(
        f"remat frontier: {args.graph} ({graph.num_nodes} nodes; times priced by the "
        f"{cost_model_text(graph)})"
    )
    print(frontier_text(points))
    if args.plot:
        print(f"  wrote {args.plot}")
    return EXIT_OK


def _target_graph(target: str, cost: str | None, bar: Any = None) -> Graph:
    if target == "-" or target.endswith(".json") or (Path(target).is_file() and ":" not in target):
        return load_graph(target)
    if ":" not in target:
        raise BadInput(f"{target}: not a graph JSON file nor a trace spec such as 'model.py:build'")
    try:
        from remat.tracer import trace_spec
    except ImportError as exc:
        raise BadInput(f"tracing {target} needs torch and remat.tracer ({exc})") from None
    try:
        if bar is None:
            graph: Graph = trace_spec(target, cost=cost)
        else:
            with bar.ticking(f"tracing {target}"):
                graph = trace_spec(target, cost=cost)
    except Exception as exc:  # the user's model code failed: bad input, reported in one line
        raise BadInput(f"cannot trace {target}: {type(exc).__name__}: {exc}") from None
    return graph


def cmd_check(args: argparse.Namespace) -> int:
    from remat.report.check import (
        check_figures,
        compare,
        growth_lines,
        junit_xml,
        read_baseline,
        verdict,
    )

    if args.max_growth < 0 or args.max_overhead_growth < 0:
        raise BadInput("--max-growth and --max-overhead-growth must be >= 0")
    bar = progress_bar(args)
    graph = shard_arg(args, _target_graph(args.target, args.cost, bar))
    bar.baseline_time_s = sum(n.time_s for n in graph.nodes)
    budget = budget_arg(args.budget)
    result = solve_local(graph, budget, args.solver, args.time_limit, bar)
    v = verdict(result, args.max_overhead)
    passed, reason = v.passed, v.reason
    figures = check_figures(graph, result)
    eager_peak = figures.eager_peak_bytes
    small = figures.smallest_budget_bytes
    rows = [
        ("target", args.target),
        ("graph", f"{graph.num_nodes} nodes, static {format_bytes(graph.static_bytes)}"),
        ("cost model", cost_model_text(graph)),
        ("no-remat peak", f"{format_bytes(eager_peak)} ({eager_peak} bytes)"),
        *result_rows(result),
        ("smallest budget", "none found" if small is None else format_bytes(small)),
        ("max overhead", "none" if args.max_overhead is None else format_pct(args.max_overhead)),
    ]
    comparison = None
    if args.baseline:
        try:
            before = read_baseline(read_text(args.baseline), source=args.baseline)
        except ValueError as exc:
            raise BadInput(f"--baseline {exc}") from None
        comparison = compare(
            figures,
            before,
            max_growth=args.max_growth,
            max_overhead_growth_points=args.max_overhead_growth,
        )
        rows += [("baseline", line) for line in comparison.failures + comparison.notes]
        rows += [("grew", line) for line in growth_lines(comparison.grown)]
        if not comparison.passed and passed:
            passed = False
            reason = f"regression against {args.baseline}: " + "; ".join(comparison.failures)
    rows.append(("result", ("PASS: " if passed else "FAIL: ") + reason))
    print(f"remat check: {args.target}")
    print_table(rows, sys.stdout)
    if args.json:
        report = {
            "target": args.target,
            "passed": passed,
            "reason": reason,
            "max_overhead": args.max_overhead,
            "no_remat_peak_bytes": eager_peak,
            "graph": graph.summary(),
            "result": result.model_dump(mode="json", exclude={"plan"}),
            "baseline": figures.to_json(),
        }
        if comparison is not None:
            report["comparison"] = {"against": args.baseline, **comparison.to_json()}
        write_file(args.json, json.dumps(report, indent=1))
    if args.junit:
        write_file(args.junit, junit_xml(args.target, passed, reason, rows, result.solve_time_s))
    return EXIT_OK if passed else EXIT_FAILED


def cmd_trace(args: argparse.Namespace) -> int:
    graph = shard_arg(args, _target_graph(args.spec, args.cost, progress_bar(args)))
    if args.out:
        write_file(args.out, graph.to_json(indent=1))
    s = graph.summary()
    print(f"remat trace: {args.spec}")
    print_table(
        [
            ("nodes", f"{s['num_nodes']} ({s['num_forward_nodes']} forward)"),
            ("values", str(s["num_values"])),
            ("static", format_bytes(s["static_bytes"])),
            ("activations", format_bytes(s["activation_bytes"])),
            ("compute", format_secs(s["compute_time_s"])),
            ("cost model", cost_model_text(graph)),
            *([("wrote", args.out)] if args.out else []),
        ],
        sys.stdout,
    )
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    graph = load_graph(args.graph)
    s = graph.summary()
    eager = simulate(graph, eager_plan(graph))
    rows = [
        ("graph", f"{s['name'] or args.graph}: {s['num_nodes']} nodes, {s['num_values']} values"),
        ("static", format_bytes(s["static_bytes"])),
        ("no-remat peak", f"{format_bytes(eager.peak_bytes)} ({eager.peak_bytes} bytes)"),
        ("no-remat time", format_secs(eager.total_time_s)),
        ("cost model", cost_model_text(graph)),
    ]
    data: dict[str, Any] = {"graph": s, "no_remat_peak_bytes": eager.peak_bytes}
    if args.result:
        try:
            result = SolveResult.model_validate_json(read_text(args.result))
        except ValueError as exc:
            raise BadInput(f"{args.result}: not a solve result: {exc}") from None
        if result.plan is None:
            raise BadInput(f"{args.result}: the result has no plan")
        try:
            sim = simulate(graph, result.plan)
        except RematError as exc:
            raise BadInput(f"{args.result}: its plan does not run on {args.graph}: {exc}") from None
        fates = result.plan.summary(graph)
        recomputed = sum(1 for f in fates.values() if f.recomputed > 0)
        offloaded = sum(1 for f in fates.values() if f.status == "offloaded")
        overhead = sim.total_time_s / eager.total_time_s - 1 if eager.total_time_s else 0.0
        rows += [
            ("solver", f"{result.solver} ({result.status})"),
            (
                "plan peak",
                f"{format_bytes(sim.peak_bytes)} (budget {format_bytes(result.budget_bytes)})",
            ),
            (
                "plan time",
                f"{format_secs(sim.total_time_s)} (overhead {format_pct(overhead)})",
            ),
            ("recomputed", f"{recomputed} values, {format_secs(sim.recompute_time_s)}"),
            ("offloaded", f"{offloaded} values, stalls {format_secs(sim.stall_time_s)}"),
        ]
        data["plan"] = {
            "solver": result.solver,
            "peak_bytes": sim.peak_bytes,
            "total_time_s": sim.total_time_s,
            "recomputed_values": recomputed,
            "offloaded_values": offloaded,
        }
        rows += _write_pictures(args, graph, result)
    elif args.html or args.plot:
        raise BadInput("--html and --plot draw a plan: give it with --result RESULT.json")
    if args.json:
        print(json.dumps(data, indent=1))
    else:
        print(f"remat report: {args.graph}")
        print_table(rows, sys.stdout)
    return EXIT_OK


def _write_pictures(args: argparse.Namespace, graph: Graph, result: Any) -> list[tuple[str, str]]:
    """``--plot`` (the timeline) and ``--html`` (the page) of ``remat report``."""
    wrote: list[tuple[str, str]] = []
    if args.plot:
        from remat.report import timeline
        from remat.report.plots import save, timeline_figure

        save(timeline_figure(timeline(graph, result.plan, result.budget_bytes)), args.plot)
        wrote.append(("wrote", args.plot))
    if args.html:
        from remat.report import load_frontier, render_html

        points = []
        for path in args.frontier or []:
            points += load_frontier(read_text(path), source=path)
        if not args.frontier and args.frontier_solvers:
            points = _frontier_local(args, graph, _solver_names(args.frontier_solvers))
        write_file(args.html, render_html(graph, result, frontier=points))
        wrote.append(("wrote", args.html))
    return wrote


def _service_settings(args: argparse.Namespace, **more: object) -> Any:
    from remat.api import Settings

    try:
        return Settings.from_env(
            None,  # the process's environment
            db_url=args.db,
            workers=args.workers,
            plugins=tuple(args.plugin) if args.plugin else None,
            **more,
        )
    except ValueError as exc:
        raise BadInput(str(exc)) from None


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from remat.api import create_app

    settings = _service_settings(
        args,
        max_queue=args.max_queue,
        api_keys=tuple(args.api_key) if args.api_key else None,
        cors_origins=tuple(args.cors_origin) if args.cors_origin else None,
    )
    try:
        app = create_app(settings)
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    # httptools (C) parses requests: with h11 (pure Python), large uploads keep the event loop
    # busy and /healthz waits behind them.
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        http="httptools",
        # Longer than clients keep an idle connection (httpx: 5 s, uvicorn's default too): with
        # equal timers, under load the server closed a connection just as a client sent on it,
        # and the request failed with a reset (14 of 16 errors of 200 clients, the other 2
        # "disconnected without a response").
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    return EXIT_OK


KEEP_ALIVE_S = 30
"""How long ``remat serve`` keeps an idle connection open for the client's next request."""


def cmd_worker(args: argparse.Namespace) -> int:
    import logging

    from remat.api.jobs_worker import run_worker

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    run_worker(_service_settings(args))  # returns on SIGTERM or Ctrl-C
    return EXIT_OK


# -- parser -------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="remat",
        description="Fit neural-network training into device memory.",
        epilog="Exit status: 0 ok, 1 check failed / no plan fits, 2 bad input.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def solver_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--solver", help="solver name (default: auto); see GET /v1/solvers")
        sp.add_argument("--time-limit", type=float, metavar="S", help="solver time limit (s)")

    def quiet_arg(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "-q", "--quiet", action="store_true", help="no progress bar (none off a terminal)"
        )

    def remote_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--url", help="solve on a remat service instead of locally")
        sp.add_argument("--api-key", help="API key for --url")

    sp = sub.add_parser("solve", help="solve a graph at a budget")
    sp.add_argument("graph", metavar="GRAPH.json")
    sp.add_argument("--budget", required=True, help="e.g. 8GiB, 70%%, 0.7 or bytes")
    solver_args(sp)
    sp.add_argument("--out", metavar="RESULT.json", help="write the result with its plan")
    sp.add_argument("--json", action="store_true", help="print the result (without plan) as JSON")
    sharding_args(sp)
    quiet_arg(sp)
    remote_args(sp)
    sp.set_defaults(fn=cmd_solve)

    sp = sub.add_parser("frontier", help="time and peak at several budgets")
    sp.add_argument("graph", metavar="GRAPH.json")
    sp.add_argument("--budgets", help="comma separated, e.g. 100%%,50%%,8GiB (default 100%%..10%%)")
    solver_args(sp)
    sp.add_argument("--json", action="store_true")
    sp.add_argument(
        "--plot",
        type=plot_file,
        metavar="FRONTIER.svg",
        help="write the frontier plot (.svg/.png)",
    )
    quiet_arg(sp)
    remote_args(sp)
    sp.set_defaults(fn=cmd_frontier)

    sp = sub.add_parser("check", help="exit 1 unless a plan fits the budget (for CI)")
    sp.add_argument(
        "target", help="GRAPH.json, or a trace spec such as examples/models.py:build_gpt"
    )
    sp.add_argument("--budget", required=True)
    sp.add_argument(
        "--max-overhead", type=float, metavar="FRAC", help="fail above this extra time, e.g. 0.25"
    )
    solver_args(sp)
    cost_arg(sp)
    sp.add_argument("--json", metavar="PATH", help="write a JSON report (a later --baseline)")
    sp.add_argument("--junit", metavar="PATH", help="write a JUnit XML report")
    sp.add_argument(
        "--baseline", metavar="PREVIOUS.json", help="fail on growth against a previous --json"
    )
    sp.add_argument(
        "--max-growth",
        type=float,
        default=0.05,
        metavar="FRAC",
        help="allowed growth of the smallest budget over --baseline (default 0.05: 5%%)",
    )
    sp.add_argument(
        "--max-overhead-growth",
        type=float,
        default=5.0,
        metavar="POINTS",
        help="allowed growth of the overhead at the budget, in percentage points (default 5)",
    )
    sharding_args(sp)
    quiet_arg(sp)
    sp.set_defaults(fn=cmd_check)

    sp = sub.add_parser("solvers", help="list the solvers, or one solver's options")
    sp.add_argument("name", nargs="?", metavar="NAME", help="show this solver's options")
    sp.add_argument("--json", action="store_true", help="print as JSON (as GET /v1/solvers)")
    sp.add_argument("--plugin", action="append", help="module registering extra solvers")
    remote_args(sp)
    sp.set_defaults(fn=cmd_solvers)

    sp = sub.add_parser("trace", help="trace a model into a graph (needs torch)")
    sp.add_argument("spec", help="e.g. examples/models.py:build_gpt or package.module:function")
    cost_arg(sp)
    sp.add_argument("--out", metavar="GRAPH.json")
    sharding_args(sp)
    quiet_arg(sp)
    sp.set_defaults(fn=cmd_trace)

    sp = sub.add_parser("report", help="summarise a graph and, optionally, a result's plan")
    sp.add_argument("graph", metavar="GRAPH.json")
    sp.add_argument("--result", metavar="RESULT.json", help="a result written by solve --out")
    sp.add_argument("--json", action="store_true")
    sp.add_argument("--html", metavar="PAGE.html", help="write a self-contained HTML report")
    sp.add_argument(
        "--plot",
        type=plot_file,
        metavar="TIMELINE.svg",
        help="write the memory timeline (.svg/.png)",
    )
    sp.add_argument(
        "--frontier",
        action="append",
        metavar="FRONTIER.json",
        help="frontier points from `remat frontier --json` for the page (repeatable)",
    )
    sp.add_argument(
        "--frontier-solvers",
        default="checkpoint-all,chen-greedy,rotor",
        metavar="NAMES",
        help="without --frontier: solvers the page's frontier runs ('' for none)",
    )
    sp.add_argument("--budgets", help="budgets of that frontier (default 100%%..10%%)")
    sp.add_argument("--time-limit", type=float, metavar="S", help="time limit of each solve")
    quiet_arg(sp)
    sp.set_defaults(fn=cmd_report)

    sp = sub.add_parser("serve", help="run the HTTP service")
    sp.add_argument("--host", default="127.0.0.1")
    sp.add_argument("--port", type=int, default=8000)
    sp.add_argument("--db", help="database URL (default sqlite:///remat.db, env REMAT_DB)")
    sp.add_argument("--workers", type=int, help="solver worker processes")
    sp.add_argument("--max-queue", type=int, help="solves allowed to wait for a worker")
    sp.add_argument("--api-key", action="append", help="require this key (repeatable)")
    sp.add_argument("--plugin", action="append", help="module registering extra solvers")
    sp.add_argument(
        "--cors-origin", action="append", help="allow browser calls from this origin (repeatable)"
    )
    sp.add_argument("--log-level", default="info")
    sp.set_defaults(fn=cmd_serve)

    sp = sub.add_parser("worker", help="run jobs from the database (no HTTP); start any number")
    sp.add_argument(
        "--db", help="postgresql://... or the sqlite:///PATH that servers share (env REMAT_DB)"
    )
    sp.add_argument("--workers", type=int, help="solver processes: jobs run at once")
    sp.add_argument("--plugin", action="append", help="module registering extra solvers")
    sp.add_argument("--log-level", default="warning")
    sp.set_defaults(fn=cmd_worker)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``remat`` command; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        code: int = args.fn(args)
        return code
    except BadInput as exc:
        print(f"remat {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (RematError, ValueError) as exc:
        print(f"remat {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as exc:
        print(f"remat {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
