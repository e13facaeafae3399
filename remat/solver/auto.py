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
from collections.abc import Callable

from remat.ir import Graph
from remat.solver.base import SolveResult, baseline_time_s, get, register, result_from_plan

MILP_MAX_NODES = 2000
"""Above this many nodes ``auto`` runs the LP rounding instead of the MILP."""


@register("auto", kind="meta", summary="Best of heuristics, chain DPs and the MILP within time")
def solve_auto(
    graph: Graph,
    budget_bytes: int,
    *,
    time_limit_s: float | None = None,
    offload: bool = False,
) -> SolveResult:
    """Run the solvers that suit the graph within ``time_limit_s`` (default 60 s) and return
    the best plan found with the best lower bound known (see the module docstring).

    Parameters
    ----------
    offload
        Also try ``pofo`` (offloading to host memory), whose plans move data over the host
        link and need an executor that supports it.
    """
    t0 = time.perf_counter()
    limit = 60.0 if time_limit_s is None else time_limit_s

    def left() -> float:
        return limit - (time.perf_counter() - t0)

    base = baseline_time_s(graph)
    eager = get("none")(graph, budget_bytes)
    if eager.status != "infeasible":
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
    quick = ["chen-greedy", "checkpoint-all", "rotor"] + (["pofo"] if offload else [])
    if graph.num_nodes <= MILP_MAX_NODES:
        quick.append("lp-round")  # fast, and its roundings reach outside the MILP's window
    for name in quick:
        if left() <= 0 and len(results) > 1:
            break
        share = max(0.1, min(left(), 0.25 * limit))
        results.append(_run(get(name), graph, budget_bytes, share))
    exact = "milp" if graph.num_nodes <= MILP_MAX_NODES else "lp-round"
    if left() > 0.2:
        results.append(_run(get(exact), graph, budget_bytes, max(0.1, left())))
    fitting = [r for r in results if r.status in ("optimal", "feasible") and r.plan is not None]
    if not fitting:
        # the smallest peak any method reached is the smallest budget known to work
        with_peak = [r for r in results if r.plan is not None and r.peak_bytes is not None]
        low = min(with_peak, key=lambda r: r.peak_bytes or 0)
        return low.model_copy(
            update={
                "solver": "auto",
                "status": "infeasible",
                "min_budget_bytes": low.peak_bytes,
                "message": f"no method fits the budget; smallest peak from {low.solver}",
                "solve_time_s": time.perf_counter() - t0,
            }
        )
    best = min(fitting, key=lambda r: (r.total_time_s or 0.0, r.peak_bytes or 0))
    assert best.plan is not None and best.total_time_s is not None
    bounds = [base] + [
        r.lower_bound_s
        for r in results
        if r.lower_bound_s is not None and r.lower_bound_s <= best.total_time_s * (1 + 1e-9)
    ]
    lb = max(bounds)
    proven = best.total_time_s <= lb * (1 + 1e-9)
    res = result_from_plan(
        graph,
        budget_bytes,
        best.plan,
        solver="auto",
        started=t0,
        status="optimal" if proven else "feasible",
        lower_bound_s=lb,
        message=f"best plan from {best.solver}; tried {', '.join(r.solver for r in results)}",
    )
    return res


def _run(
    fn: Callable[..., SolveResult], graph: Graph, budget_bytes: int, time_limit_s: float
) -> SolveResult:
    return fn(graph, budget_bytes, time_limit_s=time_limit_s)
