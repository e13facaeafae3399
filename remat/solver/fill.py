"""Spend the memory a plan leaves unused: keep more forward values while they fit the budget.

A plan found for a smaller budget (or by a method whose class is coarse, such as a chain DP's
per-stage choices) often peaks well below a larger budget. :func:`fill_budget` turns it into a
keep set (the forward values it computes once) and grows that set greedily, most recompute time
saved per byte first, judging every candidate with :func:`remat.ir.keep_plan` and the
simulator, so a budget with room for a faster plan gets one. This is the greedy knapsack over
saved activations that PyTorch's memory-budget partitioner solves exactly (Chen et al. 2016
describe the keep-set schedules; the ordering is by value density as in a fractional
knapsack); here each step is checked against the exact simulated peak rather than a sum of
sizes, since freed and recomputed values overlap in time.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable

from remat.ir import Graph, InvalidPlanError, Plan, keep_plan, simulate
from remat.ir.simulate import Simulation

MAX_SINGLE_TRIES = 64
"""After the bulk step, at most this many candidates are tried one by one."""


def kept_values(graph: Graph, plan: Plan) -> set[str]:
    """Forward values whose producer ``plan`` computes exactly once (it never recomputes them)."""
    counts = Counter(s.id for s in plan.steps if s.op == "compute")
    return {
        o
        for n in graph.nodes
        if n.phase == "forward" and counts.get(n.id, 0) == 1
        for o in n.outputs
    }


def _candidates(graph: Graph, keep: set[str]) -> list[str]:
    """Dropped forward values, most producer time per byte first."""
    cands: list[tuple[float, str]] = []
    for n in graph.nodes:
        if n.phase != "forward" or not n.recomputable:
            continue
        for o in n.outputs:
            v = graph.value(o)
            if o in keep or graph.is_static(o) or graph.is_required(o) or v.kind == "input":
                continue
            if not graph.consumers_of(o):
                continue
            cands.append((n.time_s / max(1, v.size_bytes), o))
    cands.sort(key=lambda c: (-c[0], c[1]))
    return [o for _, o in cands]


def fill_budget(
    graph: Graph,
    budget_bytes: int,
    seeds: Iterable[Plan],
    *,
    time_limit_s: float = 2.0,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[Plan, Simulation] | None:
    """The fastest keep-set plan within ``budget_bytes`` grown from ``seeds``, or None.

    Each seed's keep set (:func:`kept_values`) is rebuilt with :func:`keep_plan`; when that fits,
    candidates are added in order of density: first the longest prefix that fits (bisection),
    then single values, while the plan gets faster and its share of ``time_limit_s`` lasts
    (the seeds share the time left equally). ``clock`` is injectable for tests.
    """
    deadline = clock() + time_limit_s
    size = {v.id: v.size_bytes for v in graph.values}
    best: tuple[Plan, Simulation] | None = None

    def judge(keep: set[str]) -> tuple[Plan, Simulation] | None:
        try:
            plan = keep_plan(graph, keep)
            sim = simulate(graph, plan)
        except InvalidPlanError:
            return None
        return (plan, sim) if sim.peak_bytes <= budget_bytes else None

    todo = list(seeds)
    for k, seed in enumerate(todo):
        now = clock()
        if k and now > deadline:
            break  # the first seed's own keep plan is always judged
        stop = now + (deadline - now) / (len(todo) - k)  # the time left, shared by seeds left
        keep = kept_values(graph, seed)
        cur = judge(keep)
        if cur is None:
            continue
        cands = _candidates(graph, keep)
        # Bulk: the longest prefix of the ranking that fits (the peak grows with the prefix,
        # though not strictly, so bisection finds a fitting prefix, not always the longest).
        lo, hi = 0, len(cands)
        while lo < hi and clock() <= stop:
            mid = (lo + hi + 1) // 2
            got = judge(keep | set(cands[:mid]))
            if got is not None and got[1].total_time_s <= cur[1].total_time_s:
                lo = mid
                cur = got
            else:
                hi = mid - 1
        keep |= set(cands[:lo])
        tried = 0
        for v in cands[lo:]:
            if clock() > stop or tried >= MAX_SINGLE_TRIES:
                break
            if size[v] > budget_bytes - cur[1].peak_bytes:
                continue  # keeping it longer adds its bytes at the peak's step: no room
            tried += 1
            got = judge(keep | {v})
            if got is not None and got[1].total_time_s < cur[1].total_time_s:
                keep.add(v)
                cur = got
        if best is None or cur[1].total_time_s < best[1].total_time_s:
            best = cur
    return best
