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

The time limit holds as for rotor: the block MILPs get a share of it and stop early (blocks
left without options keep rotor's two), the DP checks the deadline and falls back to a
coarser chain.

References
----------
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

from remat.ir import Graph, InvalidPlanError, Plan
from remat.ir.chain import Chain, CutKind, chain_view
from remat.ir.result import Progress, SolveResult, best_result
from remat.solver.base import register
from remat.solver.blocks import boundary_keep_plan, stage_options
from remat.solver.chain_dp import StageOption, fit_chain_plan, trivial_result
from remat.solver.deadline import Deadline, judging_s
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


@register(
    "hierarchical",
    kind="dag",
    summary="Exact partial saves per block (identical blocks once), rotor DP across (Rockmate)",
    options=RotorOptions,
)
def solve_hierarchical(
    problem: Problem,
    *,
    mem_slots: int = 500,
    cuts: CutKind = "auto",
    max_stages: int | None = None,
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
    start_plans
        Plans to keep when they are faster (``auto`` hands over rotor's, or none); by
        default (None) rotor's DP runs here for one. A Python keyword, not a service option.
    good_enough_s
        Stop trying block sizes once a plan within the budget takes at most this long
        (``auto`` passes its proven bound plus its gap tolerance). A Python keyword too.

    References
    ----------
    X. Zhao et al., "Rockmate: an Efficient, Fast, Automatic and Generic Tool for
    Re-materialization in PyTorch", ICML 2023; its hierarchical successor HiRemate (2024).
    """
    t0 = time.perf_counter()
    triv = trivial_result(problem, NAME, t0)
    if triv is not None:
        return triv
    graph = problem.graph
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
        r = _on_chain(problem, ch, slot, top, share, t0)
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


def _on_chain(
    problem: Problem, ch: Chain, slot: float, top: int, deadline: Deadline, t0: float
) -> SolveResult | None:
    """The best plan of the DP across the blocks of ``ch`` with their partial saves, None
    when the time ran out or the chain has no schedule within the budget."""
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

    got = table_within(ch, slot, top, deadline, options_of=options_of)
    if got is None:
        return None
    ch, table = got
    if not math.isfinite(table.cost[0, ch.num_stages][top]):
        return None

    def refill(upper: int) -> Callable[[int], Plan | None] | None:
        more = table_within(
            ch, slot, upper, deadline.share(0.5, reserve_s=keep_s), options_of=options_of
        )
        return None if more is None else planner(*more)

    keep_s = judging_s(graph.num_nodes)
    try:
        r = fit_chain_plan(
            problem, planner(ch, table), top, solver=NAME, started=t0, deadline=deadline
        )
        return raise_chain_plan(problem, r, top, slot, refill, deadline, solver=NAME, started=t0)
    except InvalidPlanError:  # pragma: no cover - expand builds valid plans
        return None


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
