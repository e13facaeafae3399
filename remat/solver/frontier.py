"""``frontier``: one graph, many budgets; plans that only get faster as memory grows.

The budgets are solved in increasing order and share their work:

* every plan found (at any budget, infeasible ones included) joins a pool; each budget's answer
  is the fastest pooled plan within it, so a plan found for a smaller budget is there for every
  larger one and the time never rises with the budget;
* the best plan of each budget seeds :func:`remat.solver.fill.fill_budget`, which keeps more
  values while they fit, so a budget with room for a faster plan gets one even when the solver
  returns the same coarse plan for a range of budgets;
* once the eager schedule fits, larger budgets get it without solving (nothing is faster);
* a lower bound the solver proved at a larger budget also holds at every smaller one (less
  memory never makes the optimum faster), so bounds are carried downwards.

References
----------
Jain et al. 2020 (Checkmate) plot the same budget/time curve by solving each budget apart; the
sharing here is the monotonicity of the optimum in the budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from remat.ir import Graph, Plan, resolve_budget, simulate
from remat.ir.budget import BudgetSpec
from remat.ir.simulate import Simulation
from remat.solver import known
from remat.solver.base import SolveResult, get
from remat.solver.fill import fill_budget
from remat.solver.problem import Problem, ProgressCallback

FILL_TIME_S = 4.0
"""Default seconds per budget for :func:`~remat.solver.fill.fill_budget`."""


class Frontier(BaseModel):
    """The answers of :func:`frontier`, one :class:`SolveResult` per requested budget, in the
    order requested. ``min_budget_bytes`` is the smallest peak of any plan known for the graph
    and ``min_budget_lower_bytes`` a proven lower bound on every plan's peak."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    solver: str
    baseline_time_s: float
    eager_peak_bytes: int
    static_bytes: int
    min_budget_bytes: int | None
    min_budget_lower_bytes: int
    results: list[SolveResult]
    solve_time_s: float


def frontier(
    graph: Graph,
    budgets: Sequence[BudgetSpec],
    *,
    solver: str = "auto",
    time_limit_s: float | None = None,
    fill_time_s: float = FILL_TIME_S,
    on_point: Callable[[int], None] | None = None,
    progress: ProgressCallback | None = None,
    **options: Any,
) -> Frontier:
    """Solve ``graph`` at each of ``budgets`` (bytes, ``"12GiB"``, ``"70%"``, fractions).

    Parameters
    ----------
    solver
        The registered solver run at each budget (default ``auto``).
    time_limit_s
        Per budget, passed to the solver.
    fill_time_s
        Seconds per budget spent growing the best plan's keep set into the room left (0: off).
    on_point
        Called with the number of distinct budgets answered so far, after each one.
    progress
        Receives the solver's :class:`remat.ir.Progress` reports at every budget.
    options
        The solver's options.

    Raises
    ------
    ValueError
        Naming ``budgets[i]`` when a budget does not parse, or the option the solver rejects.
    """
    t0 = time.perf_counter()
    run = get(solver)
    reporting: dict[str, Any] = {} if progress is None else {"progress": progress}
    if not (fill_time_s >= 0):
        raise ValueError(f"fill_time_s must be >= 0, got {fill_time_s!r}")
    resolved: list[int] = []
    for i, spec in enumerate(budgets):
        try:
            resolved.append(resolve_budget(graph, spec))
        except ValueError as exc:
            raise ValueError(f"budgets[{i}]: {exc}") from None
    # the eager simulation once; each budget's answers are judged through its problem
    at = Problem.build(graph, 0).with_budget
    eager = at(0).eager_plan
    eager_sim = at(0).eager
    base = eager_sim.total_time_s
    pool: dict[tuple[tuple[str, str], ...], tuple[Plan, Simulation, str]] = {}

    def add(plan: Plan, sim: Simulation, origin: str) -> None:
        key = tuple((s.op, s.id) for s in plan.steps)
        pool.setdefault(key, (plan, sim, origin))

    mem = known.smallest(graph)
    if mem is not None:
        add(mem.plan, simulate(graph, mem.plan), mem.solver)
    if fill_time_s > 0 and eager_sim.peak_bytes > min(resolved, default=eager_sim.peak_bytes):
        # A keep-set seed for the fill: chain DPs' plans free and recompute in ways a keep set
        # cannot copy, and the solver may return only those.
        seed = get("checkpoint-all")(graph, eager_sim.peak_bytes)
        if seed.plan is not None:
            add(seed.plan, simulate(graph, seed.plan), "checkpoint-all")

    answers: dict[int, SolveResult] = {}
    bounds: dict[int, float] = {}
    for done, b in enumerate(sorted(set(resolved)), start=1):
        if on_point is not None and done > 1:
            on_point(done - 1)
        started = time.perf_counter()
        if eager_sim.peak_bytes <= b:
            answers[b] = at(b).result(
                eager,
                solver=solver,
                started=started,
                status="optimal",
                lower_bound_s=base,
                message="the eager schedule fits: nothing is recomputed",
            )
            continue
        r = run(graph, b, time_limit_s=time_limit_s, **reporting, **options)
        if r.plan is not None:
            add(r.plan, simulate(graph, r.plan), r.solver)
        if r.lower_bound_s is not None:
            bounds[b] = r.lower_bound_s
        fitting = [(p, s, o) for p, s, o in pool.values() if s.peak_bytes <= b]
        if fitting and fill_time_s > 0:
            seeds = [p for p, _, _ in sorted(fitting, key=lambda f: f[1].total_time_s)[:3]]
            grown = fill_budget(graph, b, seeds, time_limit_s=fill_time_s)
            if grown is not None:
                add(grown[0], grown[1], "fill")
                fitting.append((grown[0], grown[1], "fill"))
        if not fitting:
            answers[b] = r
            continue
        plan, _, origin = min(fitting, key=lambda f: (f[1].total_time_s, f[1].peak_bytes))
        if r.plan is not None and r.status != "infeasible" and r.plan.steps == plan.steps:
            answers[b] = r  # the solver's own answer is the best known
            continue
        answers[b] = (
            at(b)
            .result(
                plan,
                solver=solver,
                started=started,
                message=f"best plan known for this budget, from {origin}"
                + (f" (the solver's: {r.message})" if r.message else ""),
            )
            .model_copy(update={"solve_time_s": time.perf_counter() - started + r.solve_time_s})
        )

    if on_point is not None and answers:
        on_point(len(answers))
    # A bound the solver proved at a larger budget holds at every smaller one; carry the best
    # down (only solver-proven bounds: a point without one keeps none, as the solver gave).
    carried: dict[int, float] = {}
    best_bound: float | None = None
    for b in sorted(answers, reverse=True):
        if b in bounds:
            best_bound = bounds[b] if best_bound is None else max(best_bound, bounds[b])
        if best_bound is not None:
            carried[b] = max(best_bound, base)
    for b, lb in carried.items():
        ans = answers[b]
        if ans.total_time_s is None or ans.status == "infeasible":
            continue
        if lb > ans.total_time_s * (1 + 1e-9):
            continue  # a bound of a narrower class than this plan's: not comparable
        proven = ans.total_time_s <= lb * (1 + 1e-9)
        answers[b] = ans.model_copy(
            update={
                "lower_bound_s": lb,
                "gap": max(0.0, ans.total_time_s / lb - 1) if lb > 0 else None,
                "status": "optimal" if proven else ans.status,
            }
        )
    low = known.smallest(graph)
    low_peak = low.peak_bytes if low is not None else None
    answers = {b: _with_min_budget(at(b), a, low) for b, a in answers.items()}
    return Frontier(
        solver=solver,
        baseline_time_s=base,
        eager_peak_bytes=eager_sim.peak_bytes,
        static_bytes=graph.static_bytes,
        min_budget_bytes=low_peak,
        min_budget_lower_bytes=known.min_budget_lower_bytes(graph),
        results=[answers[b] for b in resolved],
        solve_time_s=time.perf_counter() - t0,
    )


def _with_min_budget(problem: Problem, r: SolveResult, low: known.KnownPlan | None) -> SolveResult:
    """An infeasible answer reports the smallest plan known (and carries it as its plan)."""
    if r.status != "infeasible" or low is None:
        return r
    if r.min_budget_bytes is not None and r.min_budget_bytes <= low.peak_bytes:
        return r
    better = problem.result(low.plan, solver=r.solver, started=time.perf_counter())
    return better.model_copy(
        update={
            "status": "infeasible",
            "min_budget_bytes": low.peak_bytes,
            "solve_time_s": r.solve_time_s,
            "message": f"no plan fits; the smallest known peaks at {low.peak_bytes} bytes "
            f"(from {low.solver})",
        }
    )
