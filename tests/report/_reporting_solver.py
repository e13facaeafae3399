"""A solver for the progress tests only: reports three improving incumbents, then answers like
checkpoint-all. Imported by the tests that need it (the contract suite never sees it)."""

from __future__ import annotations

import time

from remat.ir import Progress, SolveResult, block_cuts, keep_plan
from remat.solver import Problem
from remat.solver.base import register

INCUMBENTS = (0.30, 0.20, 0.10)
"""Overheads reported in turn, with a bound 5 points below each and the gap between."""


@register("test-improving", kind="dag", summary="Test only: three improving incumbents")
def solve_improving(problem: Problem, *, step_s: float = 0.4) -> SolveResult:
    t0 = time.perf_counter()
    base = problem.baseline_time_s
    for overhead in INCUMBENTS:
        problem.report(
            Progress(
                solver="test-improving",
                phase="branch and bound",
                elapsed_s=time.perf_counter() - t0,
                time_limit_s=problem.time_limit_s,
                incumbent_overhead=overhead,
                incumbent_peak_bytes=problem.budget_bytes,
                lower_bound_s=base * (1 + overhead - 0.05),
                gap=(1 + overhead) / (1 + overhead - 0.05) - 1,
            )
        )
        time.sleep(step_s)
    plan = keep_plan(problem.graph, {v for c in block_cuts(problem.graph) for v in c.values})
    return problem.result(plan, solver="test-improving", started=t0)
