"""``auto``: pick solvers by graph shape, size and time limit; return the best plan and bound.

1. The eager plan: when it fits, nothing beats it (every schedule runs every node at least
   once), so the result is ``optimal``.
2. A lower bound valid over the whole recompute-only class at any size
   (:func:`remat.solver.bounds.best_bound`: the knapsack relaxations at cuts of the step, the
   exact model's LP on small graphs), on a tenth of the time.
3. Fast heuristics and chain DPs (Chen's greedy, ``checkpoint-all``, ``rotor``; ``pofo`` when
   offloading is allowed), each a fraction of a second to a few seconds.
4. Graphs of up to :data:`MILP_MAX_NODES` nodes: ``hierarchical`` and ``lp-round``, then the
   exact MILP (``milp``) with the time left, started from the plans found. Larger graphs, where
   the whole-graph MILP does not fit the time: ``hierarchical`` with the time left (blocks
   solved exactly, rotor's DP across them).

The result is the fastest plan within the budget among all of them, with the best lower bound
known: the bound of step 2, the MILP's dual bound or the LP value (given only by models
without ``milp``'s optional restrictions, i.e. graphs of up to 12 nodes by default) when it
lies below the plan found, and never less than the eager time; ``gap`` is measured against it.
``optimal`` therefore means: the eager plan fits, or the plan meets a bound proven over the
whole schedule class. Plans that offload (``pofo``) are only tried with ``offload=True``, since
they need an executor with a copy stream (and then only the eager bound holds).

References
----------
See the solvers it runs: Chen et al. 2016; Herrmann et al. 2019 (rotor); Beaumont et al. 2021
(POFO); Jain et al. 2020 (Checkmate).
"""

from __future__ import annotations

import time
from dataclasses import replace

from pydantic import Field

from remat.ir import Plan
from remat.ir.result import Progress, SolveResult, best_result, speed_key
from remat.solver.base import SolverOptions, info, register
from remat.solver.bounds import best_bound
from remat.solver.deadline import Deadline
from remat.solver.milp import DEFAULT_TIME_LIMIT_S
from remat.solver.problem import Problem

MILP_MAX_NODES = 600
"""Above this many nodes the whole-graph MILP (and its LP rounding) does not fit a time limit
of a minute (its model grows as the square of the nodes: 1,259 nodes took 149 s); ``auto``
gives the time to ``hierarchical`` instead."""


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

    def relay(p: Progress) -> None:
        # a sub-solver's incumbents reach the caller as auto's progress, named in the phase
        problem.report(
            p.model_copy(
                update={
                    "solver": "auto",
                    "phase": f"{p.solver}: {p.phase}",
                    "elapsed_s": time.perf_counter() - t0,
                    "time_limit_s": limit,
                }
            )
        )

    def run(name: str, time_limit_s: float, **options: object) -> SolveResult:
        sub = replace(problem.with_time_limit(time_limit_s), on_progress=relay)
        r = info(name).run(sub, **options)
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

    # the lower bound first, on a small share: it is cheap at any size (the LP only on small
    # graphs) and valid whatever the methods below find
    bound = best_bound(
        graph,
        problem.budget_bytes,
        deadline=Deadline(problem.deadline).share(0.1),
        offload=offload,
    )
    exact_fits = graph.num_nodes <= MILP_MAX_NODES
    quick = ["chen-greedy", "checkpoint-all", "rotor"] + (["pofo"] if offload else [])
    if exact_fits:
        quick += ["hierarchical", "lp-round"]  # lp-round's roundings reach outside the window
    for name in quick:
        if problem.time_left_s() <= 0 and len(results) > 1:
            break
        share = max(0.1, min(problem.time_left_s(), 0.25 * limit))
        if name in ("pofo", "hierarchical"):
            # both keep rotor's plan when it is faster: hand them the one rotor made
            run(name, share, start_plans=_plans(results, fitting_only=False, only="rotor"))
        else:
            run(name, share)
    if exact_fits and problem.time_left_s() > 0.2:
        run("milp", max(0.1, problem.time_left_s()), start_plans=_plans(results))
    elif not exact_fits and problem.time_left_s() > 0.2:
        # the whole-graph MILP does not fit the time: blocks solved exactly, DP across them
        rotor_plans = _plans(results, fitting_only=False, only="rotor")
        run("hierarchical", max(0.1, problem.time_left_s()), start_plans=rotor_plans)
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
    bounds = [base, min(bound.time_s, best_time)] + [
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
