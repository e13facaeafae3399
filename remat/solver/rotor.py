"""``rotor``: optimal persistent checkpointing on heterogeneous chains.

Works on the chain view of a graph (:func:`remat.ir.chain.chain_view`), fills rotor's dynamic
program (:func:`remat.solver.chain_dp.rotor_table`) and expands its chain schedule back to an
op-level plan (:func:`remat.ir.chain.expand`); the simulator judges that plan. The chain model
is an estimate of the op-level memory (stages are summarised by a few byte counts), so the
expanded plan is checked and, when it overshoots the budget, the memory planned for is lowered
until it fits (:func:`remat.solver.chain_dp.fit_chain_plan`).

References
----------
J. Herrmann, O. Beaumont, L. Eyraud-Dubois, J. Hermann, A. Joly, A. Shilova. "Optimal
checkpointing for heterogeneous chains: how to train deep neural networks with limited
memory." arXiv:1911.13214, 2019 (the rotor dynamic program).
"""

from __future__ import annotations

import math
import time

from pydantic import Field

from remat.ir import InvalidPlanError, Plan
from remat.ir.chain import Chain, CutKind, chain_view, expand
from remat.ir.result import SolveResult, best_result
from remat.solver.base import SolverOptions, register
from remat.solver.chain_dp import (
    ChainArrays,
    fit_chain_plan,
    min_chain_slots,
    rotor_table,
    trivial_result,
)
from remat.solver.problem import Problem

MAX_MEM_SLOTS = 4000
"""The DP holds (stages + 1)^2 * (mem_slots + 1) costs and choices (12 bytes each)."""
MAX_STAGES = 1000


class RotorOptions(SolverOptions):
    """Options of ``rotor`` (and of ``pofo``, which adds its own)."""

    mem_slots: int = Field(
        500, ge=1, le=MAX_MEM_SLOTS, description="Memory discretisation: finer is slower."
    )
    cuts: CutKind = Field("auto", description="Which cuts make the chain (chain_view).")
    max_stages: int | None = Field(
        None,
        ge=1,
        le=MAX_STAGES,
        description="Merge stages down to this many (the DP is cubic in the stages).",
    )


@register(
    "rotor",
    kind="chain",
    summary="Optimal checkpointing DP on heterogeneous chains (rotor)",
    options=RotorOptions,
)
def solve_rotor(
    problem: Problem,
    *,
    mem_slots: int = 500,
    cuts: CutKind = "auto",
    max_stages: int | None = None,
) -> SolveResult:
    """Rotor's dynamic program for persistent checkpointing on the graph's chain view.

    Memory is discretised into ``mem_slots`` slots of the larger of the budget and the eager
    peak; the DP is O(L^3 * mem_slots) and vectorised over memory and split points.

    Parameters
    ----------
    mem_slots
        Memory discretisation (more slots: finer, slower).
    cuts
        Which cuts make the chain (see :func:`remat.ir.chain.chain_view`).
    max_stages
        Merge stages down to this many (the DP is cubic in the number of stages).

    References
    ----------
    J. Herrmann, O. Beaumont, L. Eyraud-Dubois, J. Hermann, A. Joly, A. Shilova, "Optimal
    checkpointing for heterogeneous chains: how to train deep neural networks with limited
    memory", arXiv:1911.13214, 2019.
    """
    t0 = time.perf_counter()
    triv = trivial_result(problem, "rotor", t0)
    if triv is not None:
        return triv
    graph = problem.graph
    views = [chain_view(graph, cuts=cuts, max_stages=max_stages)]
    if cuts == "auto":
        # both views: the DP's cautious memory model can favour either on a given graph
        other: CutKind = "blocks" if views[0].cut_kind == "articulation" else "articulation"
        alt = chain_view(graph, cuts=other, max_stages=max_stages)
        if alt.num_stages > 1:
            views.append(alt)
    best = best_result(_rotor_on(problem, ch, mem_slots, t0) for ch in views)
    assert best is not None
    return best


def _rotor_on(problem: Problem, ch: Chain, mem_slots: int, t0: float) -> SolveResult:
    room = problem.room_bytes
    scale = max(room, problem.eager.peak_dynamic_bytes, 1)
    slot = scale / mem_slots
    table = rotor_table(ChainArrays.of(ch, slot), mem_slots)
    L = ch.num_stages
    root = table.cost[0, L]
    top = min(mem_slots, int(room // slot)) if room > 0 else -1

    def plan_for(m: int) -> Plan | None:
        if m < 0 or not math.isfinite(root[m]):
            return None
        return expand(ch, table.schedule(m))

    if top < 0 or not math.isfinite(root[max(top, 0)]):
        low = min_chain_slots(root)
        if low is None:
            return problem.no_plan(
                solver="rotor",
                started=t0,
                min_budget_bytes=None,
                message="the chain has no schedule at any memory",
            )
        plan = plan_for(low)
        assert plan is not None
        r = problem.result(plan, solver="rotor", started=t0)
        if r.fits:  # the chain model was pessimistic: it fits after all
            return r
        return r.model_copy(update={"message": "budget below the chain's smallest schedule"})
    try:
        return fit_chain_plan(problem, plan_for, top, solver="rotor", started=t0)
    except InvalidPlanError as exc:  # pragma: no cover - expand builds valid plans
        return problem.no_plan(
            solver="rotor",
            started=t0,
            min_budget_bytes=None,
            message=f"chain expansion failed: {exc}",
        )
