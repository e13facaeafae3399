"""Solver benchmark: every solver on the synthetic families at 90/70/50/30 % budgets.

For each family (chain of 64 stages, 12-layer transformer op graph, U-Net, random layered DAG of
200 nodes) and budget (a fraction of the no-remat activation memory, ``resolve_budget``), prints
each solver's status, time overhead over ``none``, solve seconds, and the gap of its plan to the
best lower bound known for that case (the largest bound any solver proved that lies below every
plan found, and at least the eager time, which bounds every schedule).

Usage::

    .venv/bin/python benchmarks/solvers.py [--time-limit 60] [--families chain,transformer]
        [--solvers milp,rotor] [--fractions 0.9,0.5]
"""

from __future__ import annotations

import argparse
import sys
import time

from remat import solver
from remat.ir import resolve_budget, synthetic
from remat.ir.result import best_result

FAMILIES = {
    "chain64": lambda: synthetic.chain(64),
    "transformer12": lambda: synthetic.transformer(12),
    "unet4": lambda: synthetic.unet(4),
    "random-dag200": lambda: synthetic.random_layered_dag(200),
}
SOLVERS = (
    "none",
    "checkpoint-all",
    "sqrt",
    "chen-greedy",
    "revolve",
    "rotor",
    "pofo",
    "lp-round",
    "milp",
    "auto",
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds per solve")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--solvers", default=",".join(SOLVERS))
    ap.add_argument("--fractions", default="0.9,0.7,0.5,0.3")
    args = ap.parse_args(argv)
    names = [s for s in args.solvers.split(",") if s]
    for n in names:
        solver.info(n)  # unknown names fail here, before any work
    fractions = [float(f) for f in args.fractions.split(",")]
    header = f"{'family':<14} {'budget':>6}  {'solver':<14} {'status':<10} "
    header += f"{'overhead':>9} {'solve_s':>8} {'gap':>8}"
    print(header)
    print("-" * len(header))
    t_all = time.perf_counter()
    for fam in args.families.split(","):
        g = FAMILIES[fam]()
        for frac in fractions:
            budget = resolve_budget(g, frac)
            rows = []
            for n in names:
                t0 = time.perf_counter()
                r = solver.get(n)(g, budget, time_limit_s=args.time_limit)
                rows.append((n, r, time.perf_counter() - t0))
            best = best_result(r for _, r, _ in rows)
            best_time = best.total_time_s if best is not None and best.fits else None
            lbs = [rows[0][1].baseline_time_s]
            for _, r, _ in rows:
                lb = r.lower_bound_s
                if lb is not None and (best_time is None or lb <= best_time * (1 + 1e-9)):
                    lbs.append(lb)
            best_lb = max(lbs)
            for n, r, secs in rows:
                if r.fits and r.figures is not None and r.overhead is not None:
                    over = f"{100 * r.overhead:8.2f}%"
                    rel = max(0.0, r.figures.total_time_s / best_lb - 1)  # float noise below lb
                    gap = f"{100 * rel:7.2f}%"
                else:
                    over, gap = f"{'-':>9}", f"{'-':>8}"
                print(f"{fam:<14} {frac:>6.0%}  {n:<14} {r.status:<10} {over} {secs:8.2f} {gap}")
            sys.stdout.flush()
    print(f"total {time.perf_counter() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
