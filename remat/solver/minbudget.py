"""The smallest budget that works: search below the smallest plan known, down to a proven bound.

When no method fits a budget, the answer a user needs is how much memory does fit. The smallest
peak of any plan found for the graph (:mod:`remat.solver.known`) is an upper bound on it and
:func:`~remat.solver.known.min_budget_lower_bytes` a lower one; :func:`squeeze` bisects between
them, asking budget-driven methods (Chen's greedy, then Checkmate's LP rounding) for a plan
within the midpoint. A plan found lowers the upper end to its own peak; a miss raises the lower
end of the search (not of the bound: a heuristic's miss proves nothing), so the search always
ends with a real plan and never reports less than one it holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from remat.ir import Graph
from remat.solver import known
from remat.solver.base import get

METHODS: tuple[str, ...] = ("chen-greedy", "lp-round")
"""Tried at each midpoint, in order (cheap first)."""


def squeeze(
    graph: Graph,
    budget_bytes: int,
    *,
    time_limit_s: float,
    methods: Sequence[str] = METHODS,
    clock: Callable[[], float] = time.perf_counter,
    rel_tol: float = 0.005,
) -> known.KnownPlan | None:
    """Look for a plan with a smaller peak than the smallest known, down to ``budget_bytes``
    (or the proven lower bound, if higher); return the smallest known afterwards.

    Stops when the interval is within ``rel_tol`` of its upper end or the time is spent.
    Every plan the methods find is recorded in :mod:`remat.solver.known` as they return.
    """
    deadline = clock() + time_limit_s
    best = known.smallest(graph)
    if best is None:
        return None
    lo = max(budget_bytes, known.min_budget_lower_bytes(graph))
    hi = best.peak_bytes
    while hi - lo > max(1.0, rel_tol * hi):
        left = deadline - clock()
        if left <= 0:
            break
        mid = (lo + hi) // 2
        found = False
        for name in methods:
            left = deadline - clock()
            if left <= 0:
                break
            r = get(name)(graph, mid, time_limit_s=max(0.1, left / 2))
            if r.peak_bytes is not None and r.plan is not None and r.peak_bytes < hi:
                hi = r.peak_bytes
            if r.fits:
                found = True
                break
        if not found:
            lo = mid + 1
    return known.smallest(graph)
