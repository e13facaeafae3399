"""Baseline schedules: what users get without remat, or by hand.

* ``none``: no recomputation, every value freed after its last use (eager PyTorch).
* ``checkpoint-all``: keep only the inputs of the model's blocks, recompute each block once in
  the backward pass (``torch.utils.checkpoint`` around every block).
* ``sqrt``: Chen et al.'s sqrt(n) segmentation: a checkpoint every ceil(sqrt(n)) blocks.
* ``chen-greedy``: Chen et al.'s budget-driven greedy: walk the forward pass, checkpoint at a
  block boundary once the activations since the last checkpoint exceed a threshold ``b``, and
  sweep ``b`` for the fastest plan within the budget.

References
----------
T. Chen, B. Xu, C. Zhang, C. Guestrin. "Training Deep Nets with Sublinear Memory Cost."
arXiv:1604.06174, 2016.
"""

from __future__ import annotations

import math
import time

from pydantic import Field

from remat.ir import Graph, block_cuts, keep_plan
from remat.ir.cuts import Cut, articulation_cuts
from remat.ir.result import SolveResult, best_result
from remat.solver.base import NoOptions, SolverOptions, register
from remat.solver.problem import Problem


def _keep_from(cuts: list[Cut]) -> set[str]:
    return {v for c in cuts for v in c.values}


@register(
    "none",
    kind="baseline",
    summary="No recomputation: eager PyTorch, values freed after last use",
    options=NoOptions,
)
def solve_none(problem: Problem) -> SolveResult:
    """No recomputation: every node once in order, each value freed after its last use."""
    t0 = time.perf_counter()
    return problem.result(problem.eager_plan, solver="none", started=t0)


@register(
    "checkpoint-all",
    kind="baseline",
    summary="Keep block inputs only; recompute each block once",
    options=NoOptions,
)
def solve_checkpoint_all(problem: Problem) -> SolveResult:
    """Keep each block's inputs only; recompute every block once during the backward pass."""
    t0 = time.perf_counter()
    plan = keep_plan(problem.graph, _keep_from(block_cuts(problem.graph)))
    return problem.result(plan, solver="checkpoint-all", started=t0)


@register(
    "sqrt",
    kind="baseline",
    summary="Chen et al. 2016: a checkpoint every sqrt(n) blocks",
    options=NoOptions,
)
def solve_sqrt(problem: Problem) -> SolveResult:
    """Chen et al. (2016) sqrt(n) checkpointing: segments of ceil(sqrt(n)) blocks.

    References
    ----------
    T. Chen et al., "Training Deep Nets with Sublinear Memory Cost", arXiv:1604.06174, 2016.
    """
    t0 = time.perf_counter()
    cuts = block_cuts(problem.graph)
    k = max(1, math.ceil(math.sqrt(len(cuts) + 1)))
    chosen = [c for i, c in enumerate(cuts) if (i + 1) % k == 0]
    plan = keep_plan(problem.graph, _keep_from(chosen))
    return problem.result(plan, solver="sqrt", started=t0)


def greedy_cuts(graph: Graph, threshold_bytes: int, candidates: list[Cut]) -> list[Cut]:
    """Chen et al.'s Algorithm 2: checkpoint at the first candidate cut after the saved bytes
    accumulated since the last checkpoint exceed ``threshold_bytes``."""
    saved_after: dict[int, int] = {}
    for i, n in enumerate(graph.nodes):
        if n.phase != "forward":
            continue
        saved_after[i] = sum(
            graph.value(o).size_bytes
            for o in n.outputs
            if not graph.is_static(o) and any(c.phase == "backward" for c in graph.consumers_of(o))
        )
    by_pos = {c.position: c for c in candidates}
    chosen: list[Cut] = []
    acc = 0
    for i in sorted(saved_after):
        acc += saved_after[i]
        if acc > threshold_bytes and i in by_pos:
            chosen.append(by_pos[i])
            acc = 0
    return chosen


MAX_THRESHOLDS = 1000


class ChenGreedyOptions(SolverOptions):
    """Options of ``chen-greedy``."""

    num_thresholds: int = Field(
        24,
        ge=1,
        le=MAX_THRESHOLDS,
        description="Thresholds swept; each costs one plan and one simulation.",
    )


@register(
    "chen-greedy",
    kind="baseline",
    summary="Chen et al. 2016: budget-driven greedy segments",
    options=ChenGreedyOptions,
)
def solve_chen_greedy(problem: Problem, *, num_thresholds: int = 24) -> SolveResult:
    """Chen et al. (2016) greedy checkpointing, with the threshold swept for the budget.

    For each threshold ``b`` in a geometric sweep between the smallest and the total saved
    bytes, checkpoint greedily (:func:`greedy_cuts`) and simulate; return the fastest plan
    within the budget, or the one with the smallest peak (``infeasible``).

    Parameters
    ----------
    num_thresholds
        Number of thresholds swept (more finds a better plan, each costs one simulation).

    References
    ----------
    T. Chen et al., "Training Deep Nets with Sublinear Memory Cost", arXiv:1604.06174, 2016.
    """
    t0 = time.perf_counter()
    graph = problem.graph
    by_pos = {c.position: c for c in (*block_cuts(graph), *articulation_cuts(graph))}
    candidates = [by_pos[p] for p in sorted(by_pos)]
    total = sum(v.size_bytes for v in graph.values if v.kind == "activation") or 1
    lo = max(1, min((c.size_bytes for c in candidates), default=1))
    # an infinite threshold: no checkpoint at all (its simulation is the problem's own)
    judged = [problem.result(problem.eager_plan, solver="chen-greedy", started=t0)]
    seen: set[tuple[int, ...]] = set()
    for k in range(num_thresholds):
        if problem.expired():  # each threshold costs a plan and a simulation: judge as we go
            break
        b = lo * (total / lo) ** (k / max(1, num_thresholds - 1))
        chosen = greedy_cuts(graph, int(b), candidates)
        key = tuple(c.position for c in chosen)
        if key in seen:
            continue
        seen.add(key)
        plan = keep_plan(graph, _keep_from(chosen))
        judged.append(problem.result(plan, solver="chen-greedy", started=t0))
    best = best_result(judged)
    assert best is not None
    return best.model_copy(update={"solve_time_s": time.perf_counter() - t0})
