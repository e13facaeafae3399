"""Every schedule optimizer behind one signature, and the registry.

>>> from remat.ir import synthetic
>>> from remat import solver
>>> g = synthetic.chain(8)
>>> r = solver.get("checkpoint-all")(g, 10**12)
>>> r.status
'feasible'
"""

from __future__ import annotations

from typing import Any

from remat.ir import Graph
from remat.ir.budget import BudgetSpec, resolve_budget
from remat.solver import (  # noqa: F401  (importing a solver module registers it)
    auto,
    baselines,
    lp_round,
    milp,
    pofo,
    revolve,
    rotor,
)
from remat.solver.base import (
    Solver,
    SolveResult,
    SolverInfo,
    available,
    get,
    info,
    register,
    result_from_plan,
)

__all__ = [
    "SolveResult",
    "Solver",
    "SolverInfo",
    "available",
    "baselines",
    "get",
    "info",
    "register",
    "result_from_plan",
    "solve",
]

DEFAULT_SOLVER = "auto"


def solve(
    graph: Graph,
    budget: BudgetSpec,
    *,
    solver: str | None = None,
    time_limit_s: float | None = None,
    **options: Any,
) -> SolveResult:
    """Solve ``graph`` under ``budget`` (bytes, ``"12GiB"``, ``"70%"`` or a fraction of the
    eager dynamic peak; see :func:`remat.ir.resolve_budget`) with the named solver.

    The default solver is ``auto`` when it is registered, else ``chen-greedy``.
    """
    name = solver or (DEFAULT_SOLVER if DEFAULT_SOLVER in available() else "chen-greedy")
    return get(name)(graph, resolve_budget(graph, budget), time_limit_s=time_limit_s, **options)
