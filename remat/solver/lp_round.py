"""``lp-round``: Checkmate's two-phase LP rounding, for graphs too large for the exact MILP.

Phase 1 solves the LP relaxation of Checkmate's model (:mod:`remat.solver.milp`); its value is
a lower bound on the time of any schedule of the model's class. Phase 2 rounds the relaxed
keep decisions ``S[t, v]`` (deterministically at thresholds, and by randomized rounding with a
fixed seed) and completes each rounding into a schedule: every stage recomputes, from what is
resident, exactly the values its node needs; frees are then placed as early as possible. Each
candidate is simulated; the fastest one within the budget wins. When no rounding fits, the LP
is solved again for a smaller budget (Checkmate's budget search).

References
----------
P. Jain et al. "Checkmate: Breaking the Memory Wall with Optimal Tensor Rematerialization."
MLSys 2020 (Section 5, two-phase rounding).
"""

from __future__ import annotations

import random
import time

import numpy as np
from pydantic import Field

from remat.ir import Plan, Step
from remat.ir.chain import plan_from_steps
from remat.ir.result import SolveResult, best_result
from remat.solver.base import SolverOptions, register
from remat.solver.checkmate import CheckmateModel, is_var
from remat.solver.deadline import Deadline, Expired, judging_s
from remat.solver.milp import (
    DEFAULT_TIME_LIMIT_S,
    Window,
    WindowSpec,
    fallback_plans,
    run_checkmate,
)
from remat.solver.milp_index import MilpIndex
from remat.solver.problem import Problem


def schedule_from_keep(ix: MilpIndex, keep: dict[tuple[int, str], bool]) -> Plan:
    """Phase 2: the plan that keeps ``v`` into stage ``t`` where ``keep[t, v]`` and recomputes
    what each stage's node needs from what is resident.

    Values whose producer cannot run again are always kept until their last reader.
    """
    g = ix.graph
    n = g.num_nodes
    resident: set[str] = set()
    steps: list[Step] = []

    def fixed(v: str) -> bool:
        return not ix.rerun[ix.producer[v]] or v in ix.required

    def bring(values: list[str], t: int) -> None:
        todo: set[int] = set()
        stack = [v for v in values if v not in resident]
        while stack:
            v = stack.pop()
            p = ix.producer[v]
            if p in todo:
                continue
            if not ix.rerun[p] or p >= t:
                raise AssertionError(f"value {v!r} cannot be recomputed in stage {t}")
            todo.add(p)
            stack.extend(x for x in ix.ins[p] if x not in resident)
        for p in sorted(todo):
            steps.append(Step(op="compute", id=g.nodes[p].id))
            resident.update(ix.outs[p])

    for t in range(n):
        bring(list(ix.ins[t]), t)
        steps.append(Step(op="compute", id=g.nodes[t].id))
        resident.update(ix.outs[t])
        # drop what is not kept into the next stage (the free itself is placed later)
        for v in list(resident):
            if fixed(v):
                continue
            if not keep.get((t + 1, v), False):
                resident.discard(v)
    return plan_from_steps(g, steps)


def _keep_sets(
    cm: CheckmateModel, x: np.ndarray, *, thresholds: tuple[float, ...], samples: int, seed: int
) -> list[dict[tuple[int, str], bool]]:
    rng = random.Random(seed)
    refs = list(cm.vars.S.items())
    vals = {key: (float(x[r[0]]) if is_var(r) else r[1]) for key, r in refs}
    out = [{k: v >= th - 1e-9 for k, v in vals.items()} for th in thresholds]
    for _ in range(samples):
        out.append({k: rng.random() < v for k, v in vals.items()})
    return out


MAX_SAMPLES = 1000


class LpRoundOptions(SolverOptions):
    """Options of ``lp-round``."""

    samples: int = Field(
        8, ge=0, le=MAX_SAMPLES, description="Randomized roundings per LP solve (each simulated)."
    )
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Seed of the randomized rounding.")
    window: Window = Field("auto", description="As for milp: blocks a stage may recompute.")


@register(
    "lp-round",
    kind="dag",
    summary="Checkmate's two-phase LP relaxation with rounding",
    options=LpRoundOptions,
)
def solve_lp_round(
    problem: Problem,
    *,
    samples: int = 8,
    seed: int = 0,
    window: WindowSpec = "auto",
) -> SolveResult:
    """Checkmate's LP relaxation, rounded (thresholds and ``samples`` random roundings).

    Parameters
    ----------
    samples
        Randomized roundings per LP solve (in addition to the thresholds 0.1 ... 0.9).
    seed
        Seed of the randomized rounding (results are reproducible).
    window
        As for ``milp``: which nodes a stage may recompute.

    Notes
    -----
    ``lower_bound_s`` is the LP value for the requested budget: a lower bound on the time of
    any schedule of Checkmate's class, given only when the model carries none of ``milp``'s
    optional restrictions (and left out when a plan found beats it).

    References
    ----------
    P. Jain et al., "Checkmate: Breaking the Memory Wall with Optimal Tensor
    Rematerialization", MLSys 2020.
    """
    t0 = time.perf_counter()
    graph, budget_bytes = problem.graph, problem.budget_bytes
    limit = problem.time_left_or(DEFAULT_TIME_LIMIT_S)
    if graph.num_nodes == 0:
        return problem.result(Plan(), solver="lp-round", started=t0, lower_bound_s=0.0)
    thresholds = (0.5, 0.1, 0.25, 0.75, 0.9, 0.99)
    judged: list[SolveResult] = []
    bound: float | None = None
    deadline = Deadline.after(limit)
    # keep time to judge the roundings: one plan's build and simulation each
    lp_deadline = deadline.share(0.7, reserve_s=judging_s(graph.num_nodes))
    for shrink in (1.0, 0.9, 0.75, 0.6, 0.45):
        if judged and lp_deadline.expired():
            break
        # Checkmate's budget search: less room for the LP when no rounding fits
        b = budget_bytes - int(problem.room_bytes * (1 - shrink))
        try:
            run = run_checkmate(graph, b, deadline=lp_deadline, relax=True, window=window)
        except Expired:
            break
        sol = run.solution
        if sol is None or sol.values is None:
            break
        if shrink == 1.0 and run.model.exact:
            bound = run.bound_s  # the LP of a restricted model bounds that class only
        for keep in _keep_sets(
            run.model, sol.values, thresholds=thresholds, samples=samples, seed=seed
        ):
            if judged and deadline.expired():
                break
            plan = schedule_from_keep(run.model.index, keep)
            judged.append(problem.result(plan, solver="lp-round", started=t0))
        if any(r.fits for r in judged):
            break
    if not judged:
        res = problem.best_of(fallback_plans(problem), solver="lp-round", started=t0)
        if not res.fits:
            return problem.no_plan(
                solver="lp-round",
                started=t0,
                min_budget_bytes=res.min_budget_bytes,
                message="the LP relaxation is infeasible for this budget",
            )
        return res
    best = best_result(judged)
    assert best is not None
    res = best.model_copy(update={"solve_time_s": time.perf_counter() - t0})
    if not res.fits or res.plan is None or res.figures is None:
        return res
    if bound is not None and bound > res.figures.total_time_s * (1 + 1e-9):
        # The LP bounds the model's class; a rounding that recomputes deeper than the model's
        # window can lie outside it and beat it: then it proves nothing here.
        bound = None
    return problem.result(
        res.plan,
        solver="lp-round",
        started=t0,
        lower_bound_s=bound,
        message=f"best of {len(judged)} roundings",
    )
