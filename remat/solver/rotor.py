"""``rotor``: optimal persistent checkpointing on heterogeneous chains.

Works on the chain view of a graph (:func:`remat.ir.chain.chain_view`), fills rotor's dynamic
program (:func:`remat.solver.chain_dp.rotor_table`) and expands its chain schedule back to an
op-level plan (:func:`remat.ir.chain.expand`); the simulator judges that plan. The chain model
is an estimate of the op-level memory (stages are summarised by a few byte counts), so the
expanded plan is checked and, when it overshoots the budget, the memory planned for is lowered
until it fits (:func:`remat.solver.chain_dp.fit_chain_plan`); when the plan leaves much of the
budget unused, the DP is filled again for more memory and the largest memory whose plan still
fits is kept (:func:`raise_chain_plan`).

The time limit holds: a chain whose DP would fill more than
:data:`~remat.solver.chain_dp.WORK_LIMIT` cells (counted before filling,
:func:`~remat.solver.chain_dp.dp_cells`) has its stages merged in equal groups (:func:`dp_chain`),
the DP only fills the memory up to the budget, checks the deadline per sub-chain end and, when
its share runs out, is filled again on a chain with half the stages; time is kept for expanding
and simulating the plan.

References
----------
J. Herrmann, O. Beaumont, L. Eyraud-Dubois, J. Hermann, A. Joly, A. Shilova. "Optimal
checkpointing for heterogeneous chains: how to train deep neural networks with limited
memory." arXiv:1911.13214, 2019 (the rotor dynamic program).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable

import numpy as np
from pydantic import Field

from remat.ir import Graph, InvalidPlanError, Plan
from remat.ir.chain import Chain, ChainOp, CutKind, chain_of_cuts, chain_view, expand
from remat.ir.cuts import Cut
from remat.ir.result import SolveResult, best_result, speed_key
from remat.solver.base import SolverOptions, register
from remat.solver.chain_dp import (
    WORK_LIMIT,
    ChainArrays,
    RotorTable,
    StageOption,
    dp_cells,
    fit_chain_plan,
    min_chain_slots,
    rotor_table,
    trivial_result,
)
from remat.solver.deadline import Deadline, Expired, judging_s
from remat.solver.problem import Problem

MAX_MEM_SLOTS = 4000
"""The DP holds (stages + 1)^2 * (mem_slots + 1) costs and choices (12 bytes each)."""
MAX_STAGES = 1000

SLACK_SHARE = 0.02
"""A fitting chain plan whose simulated peak leaves more than this share of the room unused is
searched upward (:func:`raise_chain_plan`): the chain model is cautious, so the DP is filled
again for more memory than the budget and the largest memory whose plan still fits is kept."""

RAISE_PROBES = 5
"""Plans :func:`raise_chain_plan` expands and simulates at most (a bisection)."""


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
        description="Merge stages down to this many (default: as the DP's counted work allows).",
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
    peak; the DP is O(L^3 * mem_slots), vectorised over memory and split points, and fills
    identical sub-chains once (O(L^2 * mem_slots) on a chain of repeated layers).

    Parameters
    ----------
    mem_slots
        Memory discretisation (more slots: finer, slower).
    cuts
        Which cuts make the chain (see :func:`remat.ir.chain.chain_view`).
    max_stages
        Merge stages down to this many (default: in equal groups, as few as keep the DP's
        counted work within a second or two, :func:`dp_chain`).

    References
    ----------
    J. Herrmann, O. Beaumont, L. Eyraud-Dubois, J. Hermann, A. Joly, A. Shilova, "Optimal
    checkpointing for heterogeneous chains: how to train deep neural networks with limited
    memory", arXiv:1911.13214, 2019.
    """
    return rotor_within(
        problem,
        Deadline(problem.deadline),
        mem_slots=mem_slots,
        cuts=cuts,
        max_stages=max_stages,
    )


def rotor_within(
    problem: Problem,
    deadline: Deadline,
    *,
    mem_slots: int = 500,
    cuts: CutKind = "auto",
    max_stages: int | None = None,
    solver: str = "rotor",
) -> SolveResult:
    """``rotor`` against an explicit :class:`Deadline` (whose clock tests may replace); the
    result is labelled ``solver``."""
    t0 = time.perf_counter()
    triv = trivial_result(problem, solver, t0)
    if triv is not None:
        return triv
    graph = problem.graph
    keep_s = judging_s(problem.graph.num_nodes)
    slot, top = memory_slots(problem, mem_slots)
    views = [dp_chain(graph, cuts, slot, top, max_stages=max_stages)]
    if cuts == "auto":
        # both views: the DP's cautious memory model can favour either on a given graph
        other: CutKind = "blocks" if views[0].cut_kind == "articulation" else "articulation"
        alt = dp_chain(graph, other, slot, top, max_stages=max_stages)
        if alt.num_stages > 1:
            views.append(alt)
    results: list[SolveResult] = []
    for i, ch in enumerate(views):
        if results and deadline.left_s() < keep_s:
            break
        share = deadline.share(1.0 if i == len(views) - 1 else 0.6, reserve_s=keep_s)
        r = _rotor_on(problem, ch, mem_slots, t0, share, deadline, solver)
        if r is not None:
            results.append(r)
    best = best_result(results)
    if best is None:
        return problem.no_plan(
            solver=solver,
            started=t0,
            min_budget_bytes=None,
            status="timeout",
            message="the rotor DP found no schedule within the time limit",
        )
    return best


def memory_slots(problem: Problem, mem_slots: int) -> tuple[float, int]:
    """The slot size (bytes) for ``mem_slots`` slots over the larger of the room and the eager
    peak, and the most slots the budget leaves (-1 when it leaves no room)."""
    room = problem.room_bytes
    slot = max(room, problem.eager.peak_dynamic_bytes, 1) / mem_slots
    return slot, (min(mem_slots, int(room // slot)) if room > 0 else -1)


def dp_chain(
    graph: Graph,
    cuts: CutKind,
    slot_bytes: float,
    num_slots: int,
    *,
    max_stages: int | None = None,
    work: float = WORK_LIMIT,
    every: int = 1,
) -> Chain:
    """The chain the DP runs on: with ``max_stages``, :func:`chain_view`'s; otherwise the
    graph's own chain with its stages merged in groups of ``k``, for the smallest ``k`` (at
    least ``every``) whose DP over ``num_slots`` slots fills at most ``work`` cells
    (:func:`dp_cells`, counted before filling). Merging in equal groups keeps a chain of
    repeated layers one of repeated stages, whose sub-chains the DP fills once (evenly spaced
    merging would not)."""
    if max_stages is not None:
        return chain_view(graph, cuts=cuts, max_stages=max_stages)
    while True:
        ch = chain_view(graph, cuts=cuts, every=every)
        if ch.num_stages > MAX_STAGES:
            every = math.ceil(every * ch.num_stages / MAX_STAGES)
            continue
        if ch.num_stages <= 2:
            return ch
        cells = dp_cells(ChainArrays.of(ch, slot_bytes), max(num_slots, 1))
        if cells <= work:
            return ch
        # the work grows with the square of the stages on a chain of repeated layers
        every = max(every + 1, math.floor(every * math.sqrt(cells / work)))


def coarser(ch: Chain) -> Chain:
    """``ch`` with every other cut kept: stages merged in pairs."""
    graph = ch.graph
    cuts = [
        Cut(graph.node_position(st.forward_nodes[-1]), nxt.input_values, nxt.input_bytes)
        for st, nxt in itertools.pairwise(ch.stages)
    ]
    return chain_of_cuts(graph, cuts[1::2], ch.cut_kind)


def table_within(
    ch: Chain,
    slot_bytes: float,
    num_slots: int,
    deadline: Deadline,
    transfer_of: Callable[[Chain], np.ndarray] | None = None,
    options_of: Callable[[Chain], tuple[tuple[StageOption, ...], ...] | None] | None = None,
) -> tuple[Chain, RotorTable] | None:
    """The rotor table of ``ch`` or, when its share of the deadline passes while it is
    filled, of the same graph's chain with half the stages (:func:`coarser`), again and again;
    None once a two-stage chain fails. Each attempt but the last possible one gets half the
    time left, so that a coarser one can still finish. ``transfer_of`` gives POFO's per-stage
    copy times for a chain, ``options_of`` the partial saves of its stages."""
    while True:
        arr = ChainArrays.of(ch, slot_bytes)
        tr = None if transfer_of is None else transfer_of(ch)
        attempt = deadline if ch.num_stages <= 2 else deadline.share(0.5)
        try:
            opts = None if options_of is None else options_of(ch)
            return ch, rotor_table(arr, num_slots, tr, deadline=attempt, options=opts)
        except Expired:
            if ch.num_stages <= 2 or deadline.expired():
                return None
            ch = coarser(ch)


def _rotor_on(
    problem: Problem,
    ch: Chain,
    mem_slots: int,
    t0: float,
    dp_deadline: Deadline,
    deadline: Deadline,
    solver: str,
) -> SolveResult | None:
    slot, top = memory_slots(problem, mem_slots)
    # the DP only needs m <= top; the whole range only when top has no schedule
    got = table_within(ch, slot, max(top, 0), dp_deadline)
    if got is not None and not math.isfinite(got[1].cost[0, got[0].num_stages][max(top, 0)]):
        got = table_within(ch, slot, mem_slots, dp_deadline)
    if got is None:
        return None
    ch, table = got
    root = table.cost[0, ch.num_stages]
    plan_for = planner(ch, table)
    if top < 0 or not math.isfinite(root[max(top, 0)]):
        low = min_chain_slots(root)
        if low is None:
            return problem.no_plan(
                solver=solver,
                started=t0,
                min_budget_bytes=None,
                message="the chain has no schedule at any memory",
            )
        plan = plan_for(low)
        assert plan is not None
        r = problem.result(plan, solver=solver, started=t0)
        if r.fits:  # the chain model was pessimistic: it fits after all
            return r
        return r.model_copy(update={"message": "budget below the chain's smallest schedule"})
    try:
        r = fit_chain_plan(problem, plan_for, top, solver=solver, started=t0, deadline=deadline)
    except InvalidPlanError as exc:  # pragma: no cover - expand builds valid plans
        return problem.no_plan(
            solver=solver,
            started=t0,
            min_budget_bytes=None,
            message=f"chain expansion failed: {exc}",
        )

    def refill(upper: int) -> Callable[[int], Plan | None] | None:
        more = table_within(ch, slot, upper, deadline.share(0.5, reserve_s=judging_s(n_nodes)))
        return None if more is None else planner(*more)

    n_nodes = problem.graph.num_nodes
    return raise_chain_plan(problem, r, top, slot, refill, deadline, solver=solver, started=t0)


def planner(
    ch: Chain,
    table: RotorTable,
    reorder: Callable[[list[ChainOp]], list[ChainOp]] | None = None,
) -> Callable[[int], Plan | None]:
    """``plan_for(m)``: the expanded schedule of ``table`` at ``m`` slots (None where the chain
    has none), its ops passed through ``reorder`` first when given (pofo's
    :func:`~remat.solver.pofo.early_prefetch`)."""
    root = table.cost[0, ch.num_stages]

    def plan_for(m: int) -> Plan | None:
        if m < 0 or m >= len(root) or not math.isfinite(root[m]):
            return None
        ops = table.schedule(m)
        return expand(ch, ops if reorder is None else reorder(ops))

    return plan_for


def raise_chain_plan(
    problem: Problem,
    fitted: SolveResult,
    top: int,
    slot_bytes: float,
    refill: Callable[[int], Callable[[int], Plan | None] | None],
    deadline: Deadline,
    *,
    solver: str,
    started: float,
) -> SolveResult:
    """``fitted`` (the plan for ``top`` slots or fewer), or a faster one planned for more: when
    its simulated peak leaves more than :data:`SLACK_SHARE` of the room unused, the chain
    model was cautious there, so ``refill(upper)`` fills the DP again up to ``upper`` slots (twice
    the unused bytes above ``top``) and a bisection over ``top..upper`` keeps the largest memory
    whose expanded plan the simulator finds within the budget, in :data:`RAISE_PROBES` plans at
    most. The fastest of all that fit is returned."""
    if not fitted.fits or fitted.figures is None or top < 0:
        return fitted
    slack = problem.budget_bytes - fitted.figures.peak_bytes
    if slack <= SLACK_SHARE * max(problem.room_bytes, 1):
        return fitted
    if deadline.left_s() < judging_s(problem.graph.num_nodes, plans=3):
        return fitted  # no time for a refill and a few plans
    upper = top + max(1, math.ceil(2 * slack / slot_bytes))
    plan_for = refill(upper)
    if plan_for is None:
        return fitted
    best = fitted
    lo, hi = top, upper
    for _ in range(RAISE_PROBES):
        if lo >= hi or deadline.expired():
            break
        mid = (lo + hi + 1) // 2
        try:
            plan = plan_for(mid)
        except InvalidPlanError:  # the chain does not describe the graph (as fit_chain_plan)
            break
        if plan is None:
            hi = mid - 1
            continue
        r = problem.result(plan, solver=solver, started=started)
        if r.fits:
            lo = mid
            if speed_key(r) < speed_key(best):
                best = r
        else:
            hi = mid - 1
    return best.model_copy(update={"solve_time_s": time.perf_counter() - started})
