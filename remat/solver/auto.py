"""``auto``: pick solvers by graph shape, size and time limit; return the best plan and bound.

1. The eager plan: when it fits, nothing beats it (every schedule runs every node at least
   once), so the result is ``optimal``.
2. Fast heuristics and chain DPs, cheapest first (``checkpoint-all``, Chen's greedy, ``rotor``;
   ``pofo`` when offloading is allowed; ``lp-round``), each a fraction of a second to a few
   seconds.
3. With the time left: the exact MILP (``milp``) when the graph is small enough for it, else the
   LP rounding (``lp-round``).

Early stop: after every method, when the best plan is within ``gap_tolerance`` (default 1%) of
the best proven bound, ``auto`` returns it without running the rest; the MILP itself stops at
that gap. The bounds available on ``main`` today are the eager time (every schedule runs every
node once), the LP value of small graphs and the MILP's dual bound, so the early stop fires when
a plan is within 1% of eager or on small graphs; tighter bounds would make it fire more often.

When no method fits the budget, the answer is the smallest plan known for the graph (found by
any method at any budget in this process, :mod:`remat.solver.known`), after a short search below
it (:func:`remat.solver.minbudget.squeeze`, a quarter of the time limit at most), with its peak
as ``min_budget_bytes`` and the proven lower bound on any plan's peak as
``min_budget_lower_bytes``.

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

import math
import time

from remat.ir import Plan
from remat.ir.result import SolveResult, best_result, speed_key
from remat.solver import known
from remat.solver.base import info, register
from remat.solver.minbudget import squeeze
from remat.solver.problem import Problem

MILP_MAX_NODES = 2000
"""Above this many nodes ``auto`` runs the LP rounding instead of the MILP."""

DEFAULT_TIME_LIMIT_S = 60.0


DEFAULT_GAP_TOLERANCE = 0.01


@register("auto", kind="meta", summary="Best of heuristics, chain DPs and the MILP within time")
def solve_auto(
    problem: Problem,
    *,
    offload: bool = False,
    gap_tolerance: float = DEFAULT_GAP_TOLERANCE,
) -> SolveResult:
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
    gap_tolerance
        Stop as soon as the best plan is within this relative gap of the best proven lower
        bound (``0``: run every method; ``0.01``: 1%, the default).
    """
    t0 = time.perf_counter()
    if isinstance(gap_tolerance, bool) or not (
        isinstance(gap_tolerance, (int, float)) and 0.0 <= gap_tolerance <= 1.0
    ):
        raise ValueError(f"gap_tolerance must be a number in [0, 1], got {gap_tolerance!r}")
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
        return r

    def close_enough() -> bool:
        best = best_result(results)
        if best is None or not best.fits or best.figures is None:
            return False
        return best.figures.total_time_s <= _bound(results, base) * (1 + gap_tolerance)

    quick = ["checkpoint-all", "chen-greedy", "rotor"] + (["pofo"] if offload else [])
    if graph.num_nodes <= MILP_MAX_NODES:
        quick.append("lp-round")  # fast, and its roundings reach outside the MILP's window
    stopped = False
    for name in quick:
        if close_enough():
            stopped = True
            break
        if problem.time_left_s() <= 0 and len(results) > 1:
            break
        share = max(0.1, min(problem.time_left_s(), 0.25 * limit))
        if name == "pofo":
            # pofo keeps rotor's plan when it is faster: hand it the one rotor made
            run(name, share, start_plans=_plans(results, fitting_only=False, only="rotor"))
        else:
            run(name, share)
    if not stopped and close_enough():
        stopped = True
    if not stopped and graph.num_nodes <= MILP_MAX_NODES and problem.time_left_s() > 0.2:
        run(
            "milp",
            max(0.1, problem.time_left_s()),
            start_plans=_plans(results),
            gap_tolerance=gap_tolerance,
        )
    tried = ", ".join(r.solver for r in results)
    best = best_result(results)
    assert best is not None
    if not best.fits:
        return _smallest_known(problem, results, t0, limit, tried)
    assert best.plan is not None and best.figures is not None
    best_time = best.figures.total_time_s
    lb = _bound(results, base, below=best_time)
    proven = best_time <= lb * (1 + 1e-9)
    gap = max(0.0, best_time / lb - 1) if lb > 0 else None
    early = " (within gap_tolerance of its bound: stopped early)" if stopped else ""
    return best.model_copy(
        update={
            "solver": "auto",
            "status": "optimal" if proven else "feasible",
            "lower_bound_s": lb,
            "gap": gap,
            "message": f"best plan from {best.solver}; tried {tried}{early}",
            "solve_time_s": time.perf_counter() - t0,
        }
    )


def _bound(results: list[SolveResult], base: float, below: float | None = None) -> float:
    """The best proven lower bound on the time of any plan within the budget: the eager time
    and the bounds the methods proved (those above ``below``, a plan's time, are bounds of a
    narrower class than that plan's and are left out)."""
    if below is None:
        fitting = [r.total_time_s for r in results if r.fits and r.total_time_s is not None]
        below = min(fitting, default=math.inf)
    return max(
        [base]
        + [
            r.lower_bound_s
            for r in results
            if r.lower_bound_s is not None and r.lower_bound_s <= below * (1 + 1e-9)
        ]
    )


def _smallest_known(
    problem: Problem,
    results: list[SolveResult],
    t0: float,
    limit: float,
    tried: str,
) -> SolveResult:
    """No method fits: the smallest plan known for the graph, after a short search below it."""
    graph = problem.graph
    share = min(max(0.0, problem.time_left_s()), 0.25 * limit)
    if share > 0.2:
        squeeze(graph, problem.budget_bytes, time_limit_s=share)
    low = known.smallest(graph)
    best = best_result(results)
    assert best is not None
    if low is not None and (best.peak_bytes is None or low.peak_bytes < best.peak_bytes):
        best = problem.result(low.plan, solver=low.solver, started=t0)
    lower = known.min_budget_lower_bytes(graph)
    return best.model_copy(
        update={
            "solver": "auto",
            "status": "infeasible",
            "min_budget_bytes": best.peak_bytes,
            "min_budget_lower_bytes": lower,
            "message": f"no method fits the budget; smallest plan known from {best.solver} "
            f"(tried {tried}); no plan can peak below {lower} bytes",
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
