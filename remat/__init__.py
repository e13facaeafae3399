"""remat: fit neural-network training into device memory.

    graph = remat.trace(model, inputs, loss_fn)   # a costed graph of one training step
    result = remat.solve(graph, budget="12GiB")    # the cheapest keep/recompute/offload plan
    step = remat.apply(model, result)              # run it, same gradients
    torch.compile(model, backend=remat.backend(budget="12GiB"))   # or inside torch.compile

Only the torch-free parts are imported eagerly; ``trace`` and ``apply`` load torch on first use.
"""

from __future__ import annotations

from typing import Any

import remat.report  # noqa: F401  (gives results their notebook view; no matplotlib until drawn)
from remat._version import __version__
from remat.ir import (
    Graph,
    GraphValidationError,
    InfeasibleBudgetError,
    InvalidPlanError,
    Plan,
    PlanFigures,
    Progress,
    RematError,
    SolveResult,
    SolverUnavailableError,
    simulate,
)
from remat.solver import Frontier, frontier, solve

__all__ = [
    "Client",
    "Frontier",
    "Graph",
    "GraphValidationError",
    "InfeasibleBudgetError",
    "InvalidPlanError",
    "Plan",
    "PlanFigures",
    "Progress",
    "RematError",
    "SolveResult",
    "SolverBugError",
    "SolverUnavailableError",
    "__version__",
    "frontier",
    "simulate",
    "solve",
]


def __getattr__(name: str) -> Any:
    # torch-backed entry points load lazily so that `import remat` works without torch.
    if name == "Client":
        from remat.client import Client

        return Client
    if name == "trace":
        from remat.tracer import trace

        return trace
    if name in ("apply", "compile_step", "verify"):
        import remat.executor as ex

        return getattr(ex, name)
    if name in ("enable", "disable"):
        # model = remat.enable(model, budget="12GiB"): planned at its first training call
        import remat.enabling as en

        return getattr(en, name)
    if name in ("backend", "compile"):
        # torch.compile(model, backend=remat.backend(budget="12GiB")), remat.compile(model, ...)
        import remat.torch_compile as tc

        return getattr(tc, name)
    raise AttributeError(f"module 'remat' has no attribute {name!r}")
