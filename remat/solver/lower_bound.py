"""The lower-bound record every relaxation returns (:mod:`remat.solver.bounds`,
:mod:`remat.solver.bounds_stage`), apart from both so neither imports the other."""

from __future__ import annotations

import math
from dataclasses import dataclass

from remat.ir import Graph
from remat.solver._mip import SparseModel
from remat.solver.deadline import Deadline


@dataclass(frozen=True)
class LowerBound:
    """A lower bound ``time_s`` on the total time of any plan of the class within the budget
    (``math.inf``: no plan fits); ``method`` names how it was proven."""

    method: str
    time_s: float
    detail: str = ""

    @property
    def proves_infeasible(self) -> bool:
        return math.isinf(self.time_s)


def eager_bound(graph: Graph) -> LowerBound:
    """Every node runs at least once."""
    return LowerBound("eager", sum(n.time_s for n in graph.nodes), "every node runs once")


def solved_bound(
    model: SparseModel,
    *,
    method: str,
    base_s: float,
    scale_t: float,
    integer: bool,
    deadline: Deadline | None,
    infeasible: str,
    detail: str,
) -> LowerBound | None:
    """Solve a relaxation whose objective is the extra time over ``base_s`` (in units of
    ``scale_t`` seconds): as an LP, or with ``integer`` for HiGHS's proven MIP bound. None
    when the deadline leaves no time or no finite bound came back; ``infeasible`` and
    ``detail`` describe the bound found."""
    left = None if deadline is None else deadline.left_s()
    if left is not None and left <= 0.05:
        return None
    sol = model.solve(relax=not integer, time_limit_s=left)
    if sol.status == "infeasible":
        return LowerBound(method, math.inf, infeasible)
    if sol.bound is None or not math.isfinite(sol.bound):
        return None
    # the solver's tolerances: shave a millionth off the proven extra time
    extra = max(0.0, sol.bound) * scale_t * (1 - 1e-6)
    return LowerBound(method, base_s + extra, detail)


__all__ = ["LowerBound", "eager_bound", "solved_bound"]
