"""``hierarchical``: exact partial saves inside blocks, rotor's DP across them.

The step is decomposed into blocks: the stages of its chain view (module boundaries or
articulation points of the forward graph, :func:`remat.ir.chain.chain_view`), merged in equal
groups down to what the DP can fill in time (:func:`remat.solver.rotor.dp_chain`). For each
block, a small exact MILP (:mod:`remat.solver.blocks`) gives the frontier of *partial saves*:
which of its activations to keep through the rest of the step and which of its forward nodes
to run again before its backward, for a few caps on the kept bytes; structurally identical
blocks (a canonical hash, names ignored) are solved once. Rotor's dynamic program across the
blocks then chooses, per sub-chain and memory, to checkpoint a block boundary, keep all of a
block, or take one of its partial saves
(:func:`remat.solver.chain_dp.rotor_table` with ``options``). The chain schedule is expanded
to one op-level plan and judged by the simulator; as for rotor, the memory planned for is
lowered until the expanded plan fits, and raised above the budget while it still fits where the
cautious model left much of the budget unused (:func:`remat.solver.rotor.raise_chain_plan`).
Rotor's plans lie in this DP's class, so on the chain model it is never worse than rotor;
rotor's own plan and the plan that keeps every block boundary with the best partial saves that
fit (:func:`remat.solver.blocks.boundary_keep_plan`) are candidates too, so the simulator's
verdict on the cautious chain model costs nothing.

With offloading (by default on a device whose profile states a host link with a host memory
budget, as for ``poet``, ``dtr`` and ``auto``; ``offload=False`` turns it off), the DP across
blocks has POFO's option too (:data:`remat.solver.chain_dp.OFFLOAD`): run a block's forward
keeping all its activations, copy them to the host while the rest of the chain runs, and
prefetch them for its backward (issued one backward step early,
:func:`remat.solver.pofo.early_prefetch`). The block then holds none of its activations on the
device meanwhile; the copies overlap compute and the DP charges the slower of the rest of the
chain and the block's round trip on the link (its slower direction and latency). It is one
more way to run a block, beside keeping all, a partial save, or a checkpoint at its input.
Since the DP prices each block's copies alone, the link's time across blocks is charged by
what may be offloaded at all: only the earliest blocks whose activations together fit in what
the link moves during the forward pass (:func:`remat.solver.offload.link_reach_bytes`, and
half of it: one DP each, :data:`LINK_SHARES`) and in the host budget (:func:`host_blocks`);
so the host budget holds by construction. Without that cap the DP offloaded every block, the
copies queued on the link, and its expanded plans stalled or overshot the budget (a 7B Llama
in bf16 at 30%: +14.7% with no offload left, +9.3% with the cap). Hierarchical's
recompute-only plans for larger budgets, offloaded value by value down to the budget where the
simulator shows no added time (:func:`remat.solver.offload.combine`), are candidates too.

The time limit holds as for rotor: the block MILPs get a share of it and stop early (blocks
left without options keep rotor's two), the DP checks the deadline and falls back to a
coarser chain.

References
----------
O. Beaumont, L. Eyraud-Dubois, A. Shilova. "Efficient Combination of Rematerialization and
Offloading for Training DNNs." NeurIPS 2021 (POFO: the offload option of the DP).

X. Zhao, T. Le Hellard, L. Eyraud-Dubois, J. Gusak, O. Beaumont. "Rockmate: an Efficient,
Fast, Automatic and Generic Tool for Re-materialization in PyTorch." ICML 2023.

HiRemate, the hierarchical successor of Rockmate by the same group (2024): nested blocks,
each solved exactly for a frontier of (memory, time) options, combined across levels.

J. Herrmann, O. Beaumont, L. Eyraud-Dubois, J. Hermann, A. Joly, A. Shilova. "Optimal
checkpointing for heterogeneous chains." arXiv:1911.13214, 2019 (the DP across blocks).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
from pydantic import Field

from remat.ir import Graph, InvalidPlanError, Plan
from remat.ir.chain import Chain, CutKind, chain_view
from remat.ir.result import Progress, SolveResult, best_result
from remat.solver.base import register
from remat.solver.blocks import boundary_keep_plan, stage_options
from remat.solver.chain_dp import StageOption, fit_chain_plan, trivial_result
from remat.solver.deadline import Deadline, judging_s
from remat.solver.offload import combine as combine_plans
from remat.solver.offload import has_host_link, link_reach_bytes
from remat.solver.pofo import copy_times, early_prefetch
from remat.solver.problem import Problem
from remat.solver.rotor import (
    RotorOptions,
    dp_chain,
    memory_slots,
    planner,
    raise_chain_plan,
    rotor_within,
    table_within,
)


class HierarchicalOptions(RotorOptions):
    """Options of ``hierarchical``: rotor's, and whether the DP across blocks offloads."""

    offload: bool | None = Field(
        None,
        description="Let the DP across blocks offload a block's activations to the host during "
        "the forward and prefetch them for its backward, and offload its plans for larger "
        "budgets down to this one (default: when the device profile has a host link with a "
        "host memory budget, as for auto, dtr and poet; false: recompute only).",
    )
    combine: bool = Field(
        True,
        description="With offloading, also its recompute-only plans for larger budgets, "
        "offloaded down to the budget where the link hides the copies.",
    )


@register(
    "hierarchical",
    kind="dag",
    summary="Exact partial saves per block (identical blocks once), rotor DP across (Rockmate)",
    options=HierarchicalOptions,
)
def solve_hierarchical(
    problem: Problem,
    *,
    mem_slots: int = 500,
    cuts: CutKind = "auto",
    max_stages: int | None = None,
    offload: bool | None = None,
    combine: bool = True,
    start_plans: Sequence[Plan] | None = None,
    good_enough_s: float | None = None,
) -> SolveResult:
    """Blocks solved exactly for a frontier of partial saves, combined by rotor's DP (see the
    module docstring).

    Parameters
    ----------
    mem_slots, cuts, max_stages
        As for ``rotor``: memory discretisation, which cuts make the blocks, and how many
        blocks at most.
    offload
        Let the DP across blocks offload a block's activations (POFO's option, see the module
        docstring), and take its recompute-only plans for larger budgets offloaded down to
        this one as candidates. None (default): when the graph's device profile has a host
        link with a host memory budget (``graph.device.can_offload``), as for ``auto``,
        ``dtr`` and ``poet``; False: recompute only, exactly the plan without this option.
    combine
        With offloading, also the plans for larger budgets offloaded down to this one
        (:func:`remat.solver.offload.combine`); False: the DP's offloads only.
    start_plans
        Plans to keep when they are faster (``auto`` hands over rotor's, or none); by
        default (None) rotor's DP runs here for one. A Python keyword, not a service option.
    good_enough_s
        Stop trying block sizes once a plan within the budget takes at most this long
        (``auto`` passes its proven bound plus its gap tolerance). A Python keyword too.

    References
    ----------
    O. Beaumont, L. Eyraud-Dubois, A. Shilova, "Efficient Combination of Rematerialization and
    Offloading for Training DNNs", NeurIPS 2021 (the DP's offload option).
    X. Zhao et al., "Rockmate: an Efficient, Fast, Automatic and Generic Tool for
    Re-materialization in PyTorch", ICML 2023; its hierarchical successor HiRemate (2024).
    """
    t0 = time.perf_counter()
    triv = trivial_result(problem, NAME, t0)
    if triv is not None:
        return triv
    graph = problem.graph
    if offload is None:
        offload = has_host_link(graph)
    transfers = _transfers(graph) if offload else []
    deadline = Deadline(problem.deadline)
    keep_s = judging_s(graph.num_nodes, plans=3)
    # rotor's plan first (its own share of the time): the DP below contains it, but the
    # expanded plans can differ, and it is the fallback when time runs out
    if start_plans is None:
        rotor = rotor_within(
            problem,
            deadline.share(0.2, reserve_s=keep_s),
            mem_slots=mem_slots,
            cuts=cuts,
            max_stages=max_stages,
            solver=NAME,
        )
        _report(problem, "rotor across blocks", t0, rotor)
        start_plans = [rotor.plan] if rotor.plan is not None else []
    extra = list(start_plans)
    slot, top = memory_slots(problem, mem_slots)
    if top < 0:
        return _best_extra(problem, extra, t0)
    # Blocks of several sizes: the graph's own stages merged in groups of k. Larger blocks
    # give the block MILPs more to choose from (a partial save across a whole layer), smaller
    # ones give the DP more boundaries; which wins depends on the model and the budget, so
    # each grouping gets a share of the time and the simulator picks.
    groupings = _groupings(graph, cuts) if max_stages is None else (1,)
    results = [problem.result(p, solver=NAME, started=t0) for p in extra]
    tried: set[int] = set()
    kept: list[tuple[Chain, OptionsOf]] = []

    def good_enough() -> bool:
        best = best_result(results)
        best_s = best.total_time_s if best is not None and best.fits else None
        return good_enough_s is not None and best_s is not None and best_s <= good_enough_s

    for i, k in enumerate(groupings):
        if (results and deadline.left_s() < keep_s) or good_enough():
            break
        ch = dp_chain(graph, cuts, slot, top, max_stages=max_stages, every=k)
        if ch.num_stages in tried or (ch.num_stages < 2 and tried):
            continue
        tried.add(ch.num_stages)
        # the first block size may take all the time (it wins most often: on a loaded
        # machine one finished beats several cut short), the others share what is left
        share = deadline.share(1.0 if i == 0 else 1.0 / (len(groupings) - i), reserve_s=keep_s)
        r = _on_chain(problem, ch, slot, top, share, t0, transfers, kept)
        if r is not None:
            results.append(r)
            _report(problem, f"blocks of {k} stage(s): {ch.num_stages} blocks", t0, r)
        if i == 0 and deadline.left_s() > keep_s and not good_enough():
            # every block boundary kept, with the best partial saves that fit: one more
            # candidate, after the first block size (it seldom wins, and costs several
            # simulations of the whole step)
            every_boundary = boundary_keep_plan(
                graph, problem.budget_bytes, deadline=deadline.share(0.2, reserve_s=keep_s)
            )
            if every_boundary is not None:
                results.append(problem.result(every_boundary, solver=NAME, started=t0))
    if offload and combine and deadline.left_s() > keep_s and not good_enough():
        # recompute-only plans of this solver for larger budgets, offloaded value by value
        # down to this one where the simulator shows no added time (what the DP's whole-block
        # copies, each priced alone, miss on a link the forward pass saturates)
        dl = deadline.share(1.0, reserve_s=keep_s)
        for p in _larger_budget_plans(problem, kept, slot, mem_slots, dl, t0):
            results.append(problem.result(p, solver=NAME, started=t0))
            _report(problem, "a plan for a larger budget, offloaded", t0, results[-1])
    best = best_result(results)
    if best is None:
        return _best_extra(problem, extra, t0)
    _report(problem, "done", t0, best)
    return best.model_copy(update={"solve_time_s": time.perf_counter() - t0})


BLOCK_NODES = (26, 13, 39, 19)
"""Forward nodes per block that ``hierarchical`` aims at, in this order (the sizes that won
most often on transformers first: about two layers of the synthetic transformer, whose layer
is a few of 500 memory slots at depth, too coarse for partial saves of one layer); the
graph's own stages come last. Blocks are never smaller than the graph's own stages: a traced
Llama layer (about 50 forward nodes) is solved as it is."""


def _groupings(graph: Graph, cuts: CutKind) -> tuple[int, ...]:
    """Group sizes (stages of the graph's own chain per block) for :data:`BLOCK_NODES`, then
    1, without repeats."""
    own = chain_view(graph, cuts=cuts)
    # the median stage: the repeated layers, not the embedding or the loss
    per_stage = max(1.0, float(statistics.median(len(s.forward_nodes) for s in own.stages)))
    ks = [max(1, round(n / per_stage)) for n in BLOCK_NODES] + [1]
    return tuple(dict.fromkeys(ks))


def host_blocks(ch: Chain, host_bytes: int | None) -> list[bool]:
    """Which blocks of ``ch`` the DP may offload: every one when ``host_bytes`` (a cap on
    the bytes offloaded, at most the host budget; None: unbounded) holds all their activations
    at once, else the earliest blocks whose activations fit in it together (an earlier block's
    copy has the most compute to hide under). However many of them a schedule offloads, they
    fit in the cap: each block's activations are on the host at most once, from its forward
    to its backward."""
    if host_bytes is None:
        return [True] * ch.num_stages
    left = host_bytes
    out = []
    for st in ch.stages:
        ok = st.all_bytes <= left
        left -= st.all_bytes if ok else 0
        out.append(ok)
    return out


LINK_SHARES = (1.0, 0.5)
"""Shares of the link's reach (:func:`remat.solver.offload.link_reach_bytes`, the bytes it
moves during the forward pass) that cap the activations of the blocks the DP may offload: one
offloading DP per share. On transformer(6) (A100) at 40%: +3.7% at the whole reach, +9.9% at
half, +15.9% uncapped; half wins where the compute the copies hide under is shorter."""


def _transfers(graph: Graph) -> list[Callable[[Chain], np.ndarray]]:
    """One :func:`transfer_times` per distinct cap of :data:`LINK_SHARES` (the link's reach
    is at most the host budget, so every cap is too)."""
    reach = link_reach_bytes(graph)
    caps = dict.fromkeys(int(f * reach) for f in LINK_SHARES)
    return [transfer_times(graph, cap) for cap in caps]


def transfer_times(graph: Graph, cap_bytes: int | None) -> Callable[[Chain], np.ndarray]:
    """Per block of a chain, the seconds to copy its activations one way on the graph's host
    link (its slower direction, plus its latency), as pofo prices them; ``inf`` for the
    blocks :func:`host_blocks` leaves on the device for ``cap_bytes`` (None: no cap)."""
    link = graph.link
    bw = min(link.device_to_host_bytes_per_s, link.host_to_device_bytes_per_s)

    def of(ch: Chain) -> np.ndarray:
        times = copy_times(ch, link.latency_s, bw)
        times[~np.array(host_blocks(ch, cap_bytes), dtype=bool)] = math.inf
        return times

    return of


OptionsOf = Callable[[Chain], tuple[tuple[StageOption, ...], ...]]
"""The partial saves of each block of a chain (the block MILPs, solved once per chain)."""


def _on_chain(
    problem: Problem,
    ch: Chain,
    slot: float,
    top: int,
    deadline: Deadline,
    t0: float,
    transfers: Sequence[Callable[[Chain], np.ndarray]] = (),
    kept: list[tuple[Chain, OptionsOf]] | None = None,
) -> SolveResult | None:
    """The best plan of the DP across the blocks of ``ch`` with their partial saves, None
    when the time ran out or the chain has no schedule within the budget. For each of
    ``transfers``, the DP with POFO's offload of a whole block is filled too, after the
    recompute-only one, and the fastest plan wins: the expanded plans of the DPs differ, and
    where the DP's copies do not hide on the simulator's link the recompute-only plan is
    faster. The chain and its block options are appended to ``kept``."""
    graph = problem.graph
    blocks_deadline = deadline.share(0.5)
    solved: dict[tuple[str, ...], tuple[tuple[StageOption, ...], ...]] = {}

    def options_of(c: Chain) -> tuple[tuple[StageOption, ...], ...]:
        key = tuple(st.forward_nodes[0] for st in c.stages if st.forward_nodes)
        if key in solved:  # the DP filled again for more memory: same blocks, same MILPs
            return solved[key]
        so = stage_options(graph, c.stages, deadline=blocks_deadline)
        solved[key] = tuple(
            tuple(
                StageOption(
                    keep_slots=max(0, round((st.all_bytes - o.drop_bytes) / slot)),
                    extra_time_s=o.extra_time_s,
                    rerun_nodes=tuple(st.forward_nodes[k] for k in o.rerun),
                )
                for o in opts
            )
            for st, opts in zip(c.stages, so.options, strict=True)
        )
        return solved[key]

    if kept is not None:
        kept.append((ch, options_of))
    if not transfers:
        return _fit_dp(problem, ch, slot, top, deadline, t0, options_of, None)
    # the recompute-only DP first (it solves the block MILPs), then the offloading ones
    found = [_fit_dp(problem, ch, slot, top, deadline.share(0.6), t0, options_of, None)]
    for i, tr in enumerate(transfers):
        dl = deadline.share(1.0 / (len(transfers) - i))
        found.append(_fit_dp(problem, ch, slot, top, dl, t0, options_of, tr))
    return best_result([r for r in found if r is not None])


def _fit_dp(
    problem: Problem,
    ch: Chain,
    slot: float,
    top: int,
    deadline: Deadline,
    t0: float,
    options_of: OptionsOf,
    transfer_of: Callable[[Chain], np.ndarray] | None,
) -> SolveResult | None:
    """One DP across the blocks of ``ch`` (offloading with ``transfer_of``), its plan fitted
    to the budget and raised where the chain model left room."""
    got = table_within(ch, slot, top, deadline, transfer_of=transfer_of, options_of=options_of)
    if got is None:
        return None
    ch, table = got
    if not math.isfinite(table.cost[0, ch.num_stages][top]):
        return None
    reorder = None if transfer_of is None else early_prefetch  # the copies one step early

    def refill(upper: int) -> Callable[[int], Plan | None] | None:
        more = table_within(
            ch,
            slot,
            upper,
            deadline.share(0.5, reserve_s=keep_s),
            transfer_of=transfer_of,
            options_of=options_of,
        )
        return None if more is None else planner(*more, reorder)

    keep_s = judging_s(problem.graph.num_nodes)
    try:
        r = fit_chain_plan(
            problem, planner(ch, table, reorder), top, solver=NAME, started=t0, deadline=deadline
        )
        return raise_chain_plan(problem, r, top, slot, refill, deadline, solver=NAME, started=t0)
    except InvalidPlanError:  # pragma: no cover - expand builds valid plans
        return None


def _larger_budget_plans(
    problem: Problem,
    kept: list[tuple[Chain, OptionsOf]],
    slot: float,
    mem_slots: int,
    deadline: Deadline,
    t0: float,
) -> list[Plan]:
    """:func:`remat.solver.offload.combine` on this solver's recompute-only plans for larger
    budgets: the first block size's DP (its block MILPs already solved) filled once up to
    ``mem_slots`` (the eager peak), its plan at each larger budget fitted there and offloaded
    down to the problem's budget where the link hides the copies."""
    if not kept:
        return []
    ch, options_of = kept[0]
    filled: list[Callable[[int], Plan | None]] = []

    def plan_at(budget_bytes: int, dl: Deadline) -> Plan | None:
        if not filled:
            got = table_within(ch, slot, mem_slots, dl, options_of=options_of)
            if got is None:
                return None
            filled.append(planner(*got))
        at = problem.with_budget(budget_bytes)
        top = min(mem_slots, int(at.room_bytes // slot)) if at.room_bytes > 0 else -1
        if top < 0:
            return None
        r = fit_chain_plan(at, filled[0], top, solver=NAME, started=t0, deadline=dl)
        return r.plan if r.fits else None

    return combine_plans(problem, plan_at, deadline=deadline)


NAME = "hierarchical"


def _report(problem: Problem, phase: str, t0: float, r: SolveResult) -> None:
    problem.report(
        Progress(
            solver=NAME,
            phase=phase,
            elapsed_s=time.perf_counter() - t0,
            time_limit_s=problem.time_limit_s,
            incumbent_overhead=r.overhead if r.fits else None,
            incumbent_peak_bytes=r.peak_bytes if r.fits else None,
            message=f"best plan so far: {r.status}",
        )
    )


def _best_extra(problem: Problem, plans: list[Plan], t0: float) -> SolveResult:
    if not plans:
        return problem.no_plan(
            solver=NAME,
            started=t0,
            min_budget_bytes=None,
            message="the chain has no schedule within the budget",
        )
    return problem.best_of(plans, solver=NAME, started=t0)
