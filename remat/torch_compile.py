"""``remat.backend`` and ``remat.compile``: torch.compile planned by remat.

    model = torch.compile(model, backend=remat.backend(budget="12GiB"))
    model = remat.compile(model, budget="12GiB")          # the same, dynamic=False

The backend (:class:`remat.executor.compile.RematBackend`) lives in the executor; this module
joins it to the solvers (which the executor does not import): the named solver's plan on each
joint graph's IR seeds the search in the partitioner's class, and runs as the compiled graphs
where no saved set of that class fits (the plan recomputes only: the graphs have no copy stream).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, cast

from remat.ir import Graph, InfeasibleBudgetError, Plan
from remat.ir.budget import BudgetSpec


def _seed(solver: str) -> Callable[[Graph, int, float], Plan | None] | None:
    if solver == "greedy":
        return None
    from remat.solver import available, solve

    if solver not in available():
        raise ValueError(f"solver: unknown solver {solver!r}; use 'greedy' or one of {available()}")

    from remat.solver.base import info

    # The compiled graphs have no copy stream: plans recompute only.
    options: dict[str, Any] = {"offload": False} if "offload" in info(solver).options else {}

    def seed(graph: Graph, budget_bytes: int, time_limit_s: float) -> Plan | None:
        try:
            return solve(
                graph, budget_bytes, solver=solver, time_limit_s=time_limit_s, **options
            ).plan
        except InfeasibleBudgetError:
            return None

    return seed


def backend(
    budget: BudgetSpec,
    *,
    solver: str = "auto",
    time_limit_s: float = 30.0,
    compiler: Any = "inductor",
    cost: str = "cpu",
    exact_random: bool = True,
    op_level: str = "below-class",
) -> Any:
    """A torch.compile backend whose partitions remat plans under ``budget``.

    Parameters
    ----------
    budget
        Device bytes for the step (``"12GiB"``, an int) shared by its graphs, or a share of
        each graph's uncompiled need (``"70%"``).
    solver
        A registered remat solver whose plan seeds the class search, or ``"greedy"`` for the
        class search alone.
    time_limit_s
        Seconds per graph for the solver and the search.
    compiler
        ``"inductor"``, ``"aot_eager"`` or a callable compiling the forward and backward graphs.
    op_level
        Where no saved set of the partitioner's class fits (``"below-class"``), or always
        (``"prefer"``), run the solver's op-level plan itself; ``"never"``: the class only.

    Notes
    -----
    See :class:`remat.executor.compile.RematBackend` for graph breaks and dynamic shapes.
    """
    from remat.executor.compile import RematBackend

    return RematBackend(
        budget,
        solver=solver,
        seed=_seed(solver),
        time_limit_s=time_limit_s,
        compiler=compiler,
        cost=cost,
        exact_random=exact_random,
        op_level=op_level,
    )


def compile(
    model: Any,
    budget: BudgetSpec,
    *,
    solver: str = "auto",
    time_limit_s: float = 30.0,
    compiler: Any = "inductor",
    cost: str = "cpu",
    exact_random: bool = True,
    op_level: str = "below-class",
    **compile_kwargs: Any,
) -> Any:
    """``torch.compile(model, backend=remat.backend(budget, ...), dynamic=False)``. The
    backend (with its per-graph plans) is the result's ``remat_backend`` attribute."""
    import torch

    be = backend(
        budget,
        solver=solver,
        time_limit_s=time_limit_s,
        compiler=compiler,
        cost=cost,
        exact_random=exact_random,
        op_level=op_level,
    )
    compile_kwargs.setdefault("dynamic", False)
    compiled = torch.compile(model, backend=be, **compile_kwargs)
    with contextlib.suppress(AttributeError, TypeError):
        cast(Any, compiled).remat_backend = be
    return compiled
