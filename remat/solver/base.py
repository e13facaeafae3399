"""The solver interface, its result type and the registry.

Every solver is a function ``solve(graph, budget_bytes, *, time_limit_s=None, **options) ->
SolveResult`` registered under a name. A solver returns a plan; its figures in the result are
always the simulator's, never the solver's own estimate. A budget the method cannot reach is a
result with ``status="infeasible"`` and ``min_budget_bytes`` (the smallest budget it found to
work), not an exception.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict

from remat.ir import Graph, Plan, SolverUnavailableError, simulate
from remat.ir.plans import eager_plan

Status = Literal["optimal", "feasible", "infeasible", "timeout"]
SolverKind = Literal["baseline", "chain", "dag", "meta"]


class SolveResult(BaseModel):
    """What every solver returns. Times in seconds, memory in bytes (static + dynamic).

    ``peak_bytes`` and the times are the simulator's figures for ``plan``. ``baseline_time_s``
    is the time of the eager schedule (no recomputation) and ``overhead`` the relative extra
    time over it. ``lower_bound_s`` is a proven lower bound on the time of any plan within the
    budget when the method proves one, and ``gap`` is ``total_time_s / lower_bound_s - 1``.
    For ``infeasible``, ``min_budget_bytes`` is the smallest budget the method found to work
    and ``plan`` (if any) is the plan that reaches it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    solver: str
    status: Status
    budget_bytes: int
    plan: Plan | None = None
    peak_bytes: int | None = None
    static_bytes: int = 0
    peak_dynamic_bytes: int | None = None
    total_time_s: float | None = None
    compute_time_s: float | None = None
    recompute_time_s: float | None = None
    recompute_flops: int | None = None
    stall_time_s: float | None = None
    transfer_time_s: float | None = None
    offload_bytes: int | None = None
    baseline_time_s: float
    overhead: float | None = None
    lower_bound_s: float | None = None
    gap: float | None = None
    min_budget_bytes: int | None = None
    solve_time_s: float = 0.0
    message: str = ""

    @property
    def fits(self) -> bool:
        """A plan exists and its simulated peak is within the budget."""
        return self.status in ("optimal", "feasible") and self.plan is not None


class Solver(Protocol):
    def __call__(
        self, graph: Graph, budget_bytes: int, *, time_limit_s: float | None = None, **options: Any
    ) -> SolveResult: ...


@dataclass(frozen=True)
class SolverInfo:
    """A registered solver: its function, what it models, and the options it accepts."""

    name: str
    fn: Solver
    kind: SolverKind
    exact: bool
    summary: str
    options: tuple[str, ...]


_REGISTRY: dict[str, SolverInfo] = {}


def register(
    name: str, *, kind: SolverKind, exact: bool = False, summary: str = ""
) -> Callable[[Callable[..., SolveResult]], Callable[..., SolveResult]]:
    """Register a solver function under ``name`` (decorator)."""

    def deco(fn: Callable[..., SolveResult]) -> Callable[..., SolveResult]:
        if name in _REGISTRY:
            raise ValueError(f"solver {name!r} is registered twice")
        params = inspect.signature(fn).parameters
        opts = tuple(
            p
            for p, spec in params.items()
            if spec.kind is inspect.Parameter.KEYWORD_ONLY and p != "time_limit_s"
        )
        doc = summary or (fn.__doc__ or "").strip().splitlines()[0]
        _REGISTRY[name] = SolverInfo(name, fn, kind, exact, doc, opts)
        return fn

    return deco


def _ensure_loaded() -> None:
    # Solver modules register themselves on import; importing the package imports them all.
    import remat.solver  # noqa: F401


def available() -> list[str]:
    """Names of the registered solvers, sorted."""
    _ensure_loaded()
    return sorted(_REGISTRY)


def info(name: str) -> SolverInfo:
    _ensure_loaded()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise SolverUnavailableError(
            f"unknown solver {name!r}; available: {', '.join(sorted(_REGISTRY))}"
        ) from None


def get(name: str) -> Solver:
    """The solver registered as ``name``, with its options checked before it runs."""
    si = info(name)

    def run(
        graph: Graph, budget_bytes: int, *, time_limit_s: float | None = None, **options: Any
    ) -> SolveResult:
        unknown = sorted(set(options) - set(si.options))
        if unknown:
            known = ", ".join(si.options) or "none"
            raise ValueError(f"solver {name!r} has no option {unknown[0]!r} (its options: {known})")
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be an integer >= 0, got {budget_bytes!r}")
        if time_limit_s is not None and not (time_limit_s > 0 and math.isfinite(time_limit_s)):
            raise ValueError(f"time_limit_s must be a positive number, got {time_limit_s!r}")
        return si.fn(graph, budget_bytes, time_limit_s=time_limit_s, **options)

    run.__name__ = f"solve_{name.replace('-', '_')}"
    run.__doc__ = si.fn.__doc__
    return run


# -- helpers for solver authors -------------------------------------------------------------------


def baseline_time_s(graph: Graph) -> float:
    """Time of the eager schedule: every node once, nothing recomputed or moved."""
    return sum(n.time_s for n in graph.nodes)


def result_from_plan(
    graph: Graph,
    budget_bytes: int,
    plan: Plan,
    *,
    solver: str,
    started: float,
    status: Status | None = None,
    lower_bound_s: float | None = None,
    message: str = "",
    host_bandwidth_bytes_per_s: float | None = None,
) -> SolveResult:
    """Simulate ``plan`` and wrap the simulator's figures in a :class:`SolveResult`.

    ``status`` defaults to ``feasible``; a plan whose simulated peak exceeds the budget is
    reported ``infeasible`` with ``min_budget_bytes`` set to its peak, whatever was asked.
    """
    sim = simulate(graph, plan, host_bandwidth_bytes_per_s=host_bandwidth_bytes_per_s)
    base = baseline_time_s(graph)
    st: Status = status or "feasible"
    min_budget = None
    if sim.peak_bytes > budget_bytes:
        st = "infeasible"
        min_budget = sim.peak_bytes
    gap = None
    if lower_bound_s is not None and lower_bound_s > 0 and st != "infeasible":
        gap = max(0.0, sim.total_time_s / lower_bound_s - 1)
    return SolveResult(
        solver=solver,
        status=st,
        budget_bytes=budget_bytes,
        plan=plan,
        peak_bytes=sim.peak_bytes,
        static_bytes=sim.static_bytes,
        peak_dynamic_bytes=sim.peak_dynamic_bytes,
        total_time_s=sim.total_time_s,
        compute_time_s=sim.compute_time_s,
        recompute_time_s=sim.recompute_time_s,
        recompute_flops=sim.recompute_flops,
        stall_time_s=sim.stall_time_s,
        transfer_time_s=sim.transfer_time_s,
        offload_bytes=sim.offload_bytes,
        baseline_time_s=base,
        overhead=(sim.total_time_s / base - 1) if base > 0 else 0.0,
        lower_bound_s=lower_bound_s,
        gap=gap,
        min_budget_bytes=min_budget,
        solve_time_s=time.perf_counter() - started,
        message=message,
    )


def infeasible_result(
    graph: Graph,
    budget_bytes: int,
    *,
    solver: str,
    started: float,
    min_budget_bytes: int | None,
    message: str,
    status: Status = "infeasible",
) -> SolveResult:
    """A result without a plan: the method proved no plan fits, or ran out of time first."""
    return SolveResult(
        solver=solver,
        status=status,
        budget_bytes=budget_bytes,
        baseline_time_s=baseline_time_s(graph),
        min_budget_bytes=min_budget_bytes,
        solve_time_s=time.perf_counter() - started,
        message=message,
    )


def best_of(
    graph: Graph, budget_bytes: int, plans: list[Plan], *, solver: str, started: float
) -> SolveResult:
    """Simulate candidate plans; the fastest within budget wins, else the smallest peak
    (reported infeasible, with that peak as ``min_budget_bytes``)."""
    if not plans:
        plans = [eager_plan(graph)]
    results = [
        result_from_plan(graph, budget_bytes, p, solver=solver, started=started) for p in plans
    ]
    fitting = [r for r in results if r.status != "infeasible"]
    if fitting:
        return min(fitting, key=lambda r: (r.total_time_s or 0.0, r.peak_bytes or 0))
    return min(results, key=lambda r: (r.peak_bytes or 0, r.total_time_s or 0.0))
