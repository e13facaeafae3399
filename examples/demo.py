"""`make demo`: the main job end to end on a small GPT.

1. Trace one training step of the GPT example (``examples/models.py:gpt_demo``) into a costed
   graph, on fake tensors, with times from a measured profile of this CPU.
2. Print its eager (no-remat) peak, then for budgets of 90%, 70% and 50% of the eager
   activation memory every registered solver's status, simulated peak, time overhead and solve
   time, side by side.
3. Run the plan ``auto`` chose at the tightest budget on the real model (op-level executor) and
   print predicted vs measured peak and the gradient check against the unmodified model.

Run with ``python examples/demo.py [MODULE:FUNCTION]`` (what ``make demo`` does).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from remat import solver
from remat.ir import Graph, SolveResult, eager_plan, format_bytes, resolve_budget, simulate
from remat.ir.result import speed_key

FRACTIONS = (0.9, 0.7, 0.5)
SOLVER_TIME_LIMIT_S = 10.0
DEFAULT_SPEC = str(Path(__file__).resolve().parent / "models.py") + ":gpt_demo"


def _row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(
        c.ljust(w) if i == 0 else c.rjust(w)
        for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    )


def solver_table(
    graph: Graph, names: list[str]
) -> tuple[list[str], dict[float, dict[str, SolveResult]]]:
    """One line per (budget, solver): status, simulated peak, overhead, solve seconds."""
    widths = [16, 7, 11, 11, 9, 8]
    lines = [_row(["solver", "budget", "status", "peak", "overhead", "solve s"], widths)]
    lines.append("-" * (sum(widths) + 2 * (len(widths) - 1)))
    results: dict[float, dict[str, SolveResult]] = {}
    for frac in FRACTIONS:
        budget = resolve_budget(graph, frac)
        results[frac] = {}
        for name in names:
            r = solver.get(name)(graph, budget, time_limit_s=SOLVER_TIME_LIMIT_S)
            results[frac][name] = r
            peak = format_bytes(r.peak_bytes) if r.peak_bytes is not None else "-"
            over = f"+{100 * r.overhead:.1f}%" if r.overhead is not None else "-"
            cells = [name, f"{frac:.0%}", r.status, peak, over, f"{r.solve_time_s:.2f}"]
            lines.append(_row(cells, widths))
        lines.append("")
    return lines, results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = argv[0] if argv else DEFAULT_SPEC
    t0 = time.perf_counter()

    from remat.executor import verify
    from remat.tracer import load_spec, trace_capture

    model, inputs, loss_fn = load_spec(spec)
    cap = trace_capture(model, inputs, loss_fn, cost="cpu")
    graph = cap.graph
    n_params = sum(p.numel() for p in model.parameters())
    sim = simulate(graph, eager_plan(graph))
    device = graph.device.name if graph.device else "?"
    print(
        f"traced {spec.rsplit('/', 1)[-1]}: {n_params / 1e6:.2f} M parameters, "
        f"{graph.num_nodes} nodes, {graph.num_values} values in {time.perf_counter() - t0:.1f} s"
    )
    print(f"static (params + grads): {format_bytes(graph.static_bytes)}")
    print(
        f"no-remat peak: {format_bytes(sim.peak_bytes)} "
        f"(activations {format_bytes(sim.peak_dynamic_bytes)}), "
        f"step {1e3 * sim.total_time_s:.1f} ms predicted on {device}"
    )
    print(f"budgets: static + {', '.join(f'{f:.0%}' for f in FRACTIONS)} of the activation peak")
    print()
    names = [n for n in solver.available() if n != "none"]
    lines, results = solver_table(graph, ["none", *names])
    for line in lines:
        print(line)

    tight = min(FRACTIONS)
    chosen_name = (
        "auto"
        if "auto" in results[tight]
        else min(
            (n for n, r in results[tight].items() if r.fits),
            key=lambda n: speed_key(results[tight][n]),
        )
    )
    chosen = results[tight][chosen_name]
    print(f"running the {chosen_name} plan at {tight:.0%} on the real model ...")
    if not chosen.fits:
        print(f"  {chosen_name} found no plan within the budget ({chosen.message})")
        return 1
    report = verify(model, inputs, loss_fn, chosen, capture=cap, repeats=3)
    print(report)
    ok = report.grads_bitwise_equal and report.within_budget and abs(report.dynamic_error) <= 0.05
    print(f"{'OK' if ok else 'MISMATCH'}: done in {time.perf_counter() - t0:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
