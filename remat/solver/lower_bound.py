"""The lower-bound record every relaxation returns (:mod:`remat.solver.bounds`,
:mod:`remat.solver.bounds_stage`), apart from both so neither imports the other."""

from __future__ import annotations

import math
from dataclasses import dataclass

from remat.ir import Graph


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


__all__ = ["LowerBound", "eager_bound"]
