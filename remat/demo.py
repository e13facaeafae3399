"""`make demo`: plan a transformer training step under shrinking memory budgets.

Builds a GPT-style step graph, prints its eager (no-remat) peak, then for budgets of 90%, 70%
and 50% of the eager activation memory prints each registered solver's status, simulated peak
and time overhead. Run with ``python -m remat.demo``.
"""

from __future__ import annotations

import sys
import time

from remat import solver
from remat.ir import Graph, eager_plan, format_bytes, resolve_budget, simulate
from remat.ir.synthetic import transformer

FRACTIONS = (0.9, 0.7, 0.5)
SOLVER_TIME_LIMIT_S = 30.0


def _row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(
        c.ljust(w) if i == 0 else c.rjust(w)
        for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    )


def solver_table(graph: Graph, names: list[str]) -> list[str]:
    """One line per (budget, solver): status, simulated peak, overhead, solve seconds."""
    widths = [16, 8, 12, 12, 10, 9]
    lines = [_row(["solver", "budget", "status", "peak", "overhead", "solve s"], widths)]
    lines.append("-" * (sum(widths) + 2 * (len(widths) - 1)))
    for frac in FRACTIONS:
        budget = resolve_budget(graph, frac)
        for name in names:
            r = solver.get(name)(graph, budget, time_limit_s=SOLVER_TIME_LIMIT_S)
            peak = format_bytes(r.peak_bytes) if r.peak_bytes is not None else "-"
            over = f"+{100 * r.overhead:.1f}%" if r.overhead is not None else "-"
            lines.append(
                _row([name, f"{frac:.0%}", r.status, peak, over, f"{r.solve_time_s:.2f}"], widths)
            )
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()
    graph = transformer(12)
    sim = simulate(graph, eager_plan(graph))
    print(f"graph: {graph.name}: {graph.num_nodes} nodes, {graph.num_values} values")
    print(f"static (params + grads): {format_bytes(graph.static_bytes)}")
    print(
        f"no-remat peak: {format_bytes(sim.peak_bytes)} "
        f"(activations {format_bytes(sim.peak_dynamic_bytes)}), "
        f"step {1e3 * sim.total_time_s:.1f} ms on {graph.device.name if graph.device else '?'}"
    )
    print(f"budgets: static + {', '.join(f'{f:.0%}' for f in FRACTIONS)} of the activation peak")
    print()
    names = [n for n in solver.available() if n != "none"]
    for line in solver_table(graph, ["none", *names]):
        print(line)
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
