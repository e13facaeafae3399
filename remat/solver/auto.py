"""``auto``: pick solvers by graph shape, size and time limit; return the best plan and bound.

1. The eager plan: when it fits, nothing beats it (every schedule runs every node at least
   once), so the result is ``optimal``.
2. Fast heuristics and chain DPs (Chen's greedy, ``checkpoint-all``, ``rotor``, ``lp-round``;
   ``pofo`` when offloading is allowed), each a fraction of a second to a few seconds.
3. With the time left: the exact MILP (``milp``) when the graph is small enough for it, else the
   LP rounding (``lp-round``).

The result is the fastest plan within the budget among all of them, with the best lower bound
known: the MILP's dual bound or the LP value (given only by models without ``milp``'s optional
restrictions, i.e. graphs of up to 12 nodes by default) when it lies below the plan found, and
never less than the eager time, which bounds every schedule. ``optimal`` therefore means: the
eager plan fits, or the plan meets a bound proven over Checkmate's whole schedule class.
Plans that offload (``pofo``) are only tried with ``offload=True``, since they need an executor
with a copy stream.

References
----------
See the solvers it runs: Chen et al. 2016; Herrmann et al. 2019 (rotor); Beaumont et al. 2021
(POFO); Jain et al. 2020 (Checkmate).
"""

from __future__ import annotations

import time

from pydantic import Field

from remat.ir import Plan
from remat.ir.result import Progress, SolveResult, best_result, speed_key
from remat.solver.base import SolverOptions, info, register
from remat.solver.milp import DEFAULT_TIME_LIMIT_S
from remat.solver.problem import Problem

MILP_MAX_NODES = 2000
"""Above this many nodes ``auto`` runs the LP rounding instead of the MILP."""


class AutoOptions(SolverOptions):
    """Options of ``auto``."""

    offload: bool = Field(False, description="Also try pofo (plans that offload to the host).")


@register(
    "auto",
    kind="meta",
    summary="Best of heuristics, chain DPs and the MILP within time",
    options=AutoOptions,
)
def solve_auto(problem: Problem, *, offload: bool = False) -> SolveResult:
    """Run the solvers that suit the graph within the time limit (default 60 s) and return
    the best plan found with the best lower bound known (see the module docstring).

    Each solver runs at most once, on the same problem (one eager simulation); ``milp`` starts
    from the plans the others found (``start_plans``). The result's ``solver`` is ``"auto"``;
    its message names the solver whose plan won and those tried.

    Parameters
    ----------
    offload
        Also try ``pofo`` (offloading to host memory), whose plans move data over the host
        link and need an executor that supports it.
    """
    t0 = time.perf_counter()
    if problem.time_limit_s is None:
        problem = problem.with_time_limit(DEFAULT_TIME_LIMIT_S)
    limit = problem.time_limit_s
    assert limit is not None
    graph = problem.graph
    base = problem.baseline_time_s
    eager = info("none").run(problem)
    if eager.fits:
        return eager.model_copy(
            update={
                "solver": "auto",
                "status": "optimal",
                "lower_bound_s": base,
                "gap": 0.0,
                "message": "the eager schedule fits: nothing is recomputed",
                "solve_time_s": time.perf_counter() - t0,
            }
        )
    results: list[SolveResult] = [eager]

    def run(name: str, time_limit_s: float, **options: object) -> SolveResult:
        r = info(name).run(problem.with_time_limit(time_limit_s), **options)
        results.append(r)
        best = best_result(results)
        fitting = best is not None and best.fits
        problem.report(
            Progress(
                solver="auto",
                phase=f"ran {name}",
                elapsed_s=time.perf_counter() - t0,
                time_limit_s=limit,
                incumbent_overhead=best.overhead if best is not None and fitting else None,
                incumbent_peak_bytes=best.peak_bytes if best is not None and fitting else None,
                message=f"best so far from {best.solver}" if best is not None and fitting else None,
            )
        )
        return r

    quick = ["chen-greedy", "checkpoint-all", "rotor"] + (["pofo"] if offload else [])
    if graph.num_nodes <= MILP_MAX_NODES:
        quick.append("lp-round")  # fast, and its roundings reach outside the MILP's window
    for name in quick:
        if problem.time_left_s() <= 0 and len(results) > 1:
            break
        share = max(0.1, min(problem.time_left_s(), 0.25 * limit))
        if name == "pofo":
            # pofo keeps rotor's plan when it is faster: hand it the one rotor made
            run(name, share, start_plans=_plans(results, fitting_only=False, only="rotor"))
        else:
            run(name, share)
    if graph.num_nodes <= MILP_MAX_NODES and problem.time_left_s() > 0.2:
        run("milp", max(0.1, problem.time_left_s()), start_plans=_plans(results))
    best = best_result(results)
    assert best is not None
    if not best.fits:
        # the smallest peak any method reached is the smallest budget known to work
        return best.model_copy(
            update={
                "solver": "auto",
                "status": "infeasible",
                "min_budget_bytes": best.peak_bytes,
                "message": f"no method fits the budget; smallest peak from {best.solver}",
                "solve_time_s": time.perf_counter() - t0,
            }
        )
    assert best.plan is not None and best.figures is not None
    best_time = best.figures.total_time_s
    bounds = [base] + [
        r.lower_bound_s
        for r in results
        if r.lower_bound_s is not None and r.lower_bound_s <= best_time * (1 + 1e-9)
    ]
    lb = max(bounds)
    proven = best_time <= lb * (1 + 1e-9)
    gap = max(0.0, best_time / lb - 1) if lb > 0 else None
    tried = ", ".join(r.solver for r in results)
    return best.model_copy(
        update={
            "solver": "auto",
            "status": "optimal" if proven else "feasible",
            "lower_bound_s": lb,
            "gap": gap,
            "message": f"best plan from {best.solver}; tried {tried}",
            "solve_time_s": time.perf_counter() - t0,
        }
    )


def _plans(
    results: list[SolveResult], *, fitting_only: bool = True, only: str | None = None
) -> list[Plan]:
    """The plans of ``results``, fastest first (those within the budget only, by default)."""
    chosen = [
        r
        for r in results
        if r.plan is not None
        and (r.fits or not fitting_only)
        and (only is None or r.solver == only)
    ]
    return [r.plan for r in sorted(chosen, key=speed_key) if r.plan is not None]
