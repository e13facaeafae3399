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
from remat.ir.budget import BudgetSpec
from remat.ir.result import PlanFigures, Progress, SolveResult
from remat.solver import (  # noqa: F401  (importing a solver module registers it)
    auto,
    baselines,
    dtr,
    hierarchical,
    lp_round,
    milp,
    offload,
    poet,
    pofo,
    revolve,
    rotor,
)
from remat.solver.base import (
    InvalidOptionError,
    Solver,
    SolverInfo,
    SolverOptions,
    available,
    default_solver,
    get,
    info,
    register,
)
from remat.solver.frontier import Frontier, frontier
from remat.solver.listing import PROGRESS_OPTION, solver_listing, user_options
from remat.solver.problem import Problem, ProgressCallback

__all__ = [
    "PROGRESS_OPTION",
    "Frontier",
    "InvalidOptionError",
    "PlanFigures",
    "Problem",
    "Progress",
    "SolveResult",
    "Solver",
    "SolverInfo",
    "SolverOptions",
    "available",
    "baselines",
    "default_solver",
    "frontier",
    "get",
    "info",
    "register",
    "solve",
    "solver_listing",
    "user_options",
]


def solve(
    graph: Graph,
    budget: BudgetSpec,
    *,
    solver: str | None = None,
    time_limit_s: float | None = None,
    progress: ProgressCallback | None = None,
    executor: str | None = None,
    **options: Any,
) -> SolveResult:
    """Solve ``graph`` under ``budget`` (bytes, ``"12GiB"``, ``"70%"`` or a fraction of the
    eager dynamic peak; see :func:`remat.ir.resolve_budget`) with the named solver.

    The budget is parsed once and the :class:`Problem` built once, after the options were
    checked. ``progress`` receives :class:`Progress` reports from solvers that make them. The
    default solver is :func:`default_solver` (``auto`` when it is registered). With
    ``executor="checkpoint"`` the plan is one that ``remat.apply(..., mode="checkpoint")`` runs
    exactly (:mod:`remat.ir.checkpoint_class`, seeded with the solver's plan). That class
    offloads whole blocks' saved tensors: its search does so where the graph's device profile
    has a host link (or with ``offload=True``; ``offload=False`` turns it off), while the
    solver that seeds it plans without offloading unless ``offload`` is given.

    ``executor`` defaults to ``"op"``, and to ``"checkpoint"`` on a graph sharded with FSDP2
    (:mod:`remat.ir.shard`), the only one that runs there: the op-level executor calls ATen ops
    on the parameters itself, where FSDP2's module hooks, which gather them, never run. There
    the solver plans on the graph without the parameter-window rule (same bytes, same times),
    and its plan seeds the checkpoint class, whose regions recompute inside their unit's
    window; the result is judged on the sharded graph itself.
    """
    fsdp = graph.sharding is not None and graph.sharding.strategy == "fsdp2"
    if executor is None:
        executor = "checkpoint" if fsdp else "op"
    if executor not in ("op", "checkpoint"):
        raise ValueError(f"executor must be 'op' or 'checkpoint', got {executor!r}")
    if fsdp and executor == "op":
        raise ValueError(
            "executor: 'op' cannot run under FSDP2 (it calls ATen ops on the parameters, which "
            "FSDP2's module hooks gather only around module calls); use executor='checkpoint'"
        )
    si = info(solver or default_solver())
    given = options.get("offload")
    if executor == "checkpoint" and "offload" in options:
        if given is not None and not isinstance(given, bool):
            raise InvalidOptionError(
                f"option 'offload' must be true, false or null, got {given!r}",
                solver=si.name,
                option="offload",
            )
        if "offload" not in si.options:  # the class search's own option
            options = {k: v for k, v in options.items() if k != "offload"}
    checked = si.check_options(options)
    if executor == "checkpoint" and "offload" in checked and "offload" not in options:
        # the seed's offloads are op-level: by default the class search offloads blocks instead
        checked = {**checked, "offload": False}
    problem = Problem.build(graph, budget, time_limit_s=time_limit_s, on_progress=progress)
    if fsdp:
        relaxed = graph.model_copy(update={"sharding": None})
        inner = Problem.build(relaxed, problem.budget_bytes, time_limit_s=time_limit_s,
                              on_progress=progress)  # fmt: skip
        result = si.solve(inner, checked)
    else:
        result = si.solve(problem, checked)
    if executor == "checkpoint":
        from remat.solver.checkpoint import restrict
        from remat.solver.offload import has_host_link

        offload = has_host_link(graph) if given is None else given
        result = restrict(problem, result, offload=offload)
    return result.with_graph(graph)
