"""``remat.solve(..., executor="checkpoint")``: a solver's plan brought into the class of plans
that the checkpoint-region executor runs exactly (:mod:`remat.ir.checkpoint_class`)."""

from __future__ import annotations

import time

from remat.ir import Plan, SolveResult
from remat.ir.checkpoint_search import fit
from remat.solver.problem import Problem


def restrict(problem: Problem, result: SolveResult, *, offload: bool = False) -> SolveResult:
    """``result`` brought into the checkpoint class: the best of :func:`fit` seeded with its
    plan, as a result of the same solver (``"<solver>+checkpoint"``), the simulator's figures;
    with ``offload``, blocks offloaded to host memory are candidates too.
    """
    started = time.perf_counter() - (result.solve_time_s or 0.0)
    seeds: list[Plan] = [result.plan] if result.plan is not None else []
    # the class search has what is left of the time limit, and at least 10 s (or the whole
    # limit, when that is shorter): the solver before it may have spent all of it; 10 s
    # without a limit
    limit = problem.time_limit_s
    budget_s = 10.0 if limit is None else max(problem.time_left_s(), min(limit, 10.0))
    found = fit(
        problem.graph, problem.budget_bytes, seeds=seeds, time_budget_s=budget_s, offload=offload
    )
    paths = ", ".join(r.path for r in found.regions) or "none"
    message = f"checkpoint regions: {paths}"
    if found.offloaded:
        message += f"; offloaded blocks: {', '.join(found.offloaded)}"
    return problem.result(
        found.plan, solver=f"{result.solver}+checkpoint", started=started, message=message
    )


__all__ = ["restrict"]
