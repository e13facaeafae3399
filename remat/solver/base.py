"""The solver interface and the registry.

Every solver is a function ``solve(problem, **options) -> SolveResult`` registered under a
name; :class:`~remat.solver.problem.Problem` carries the graph, the budget and what follows from
them. A solver returns a plan; its figures in the result are always the simulator's, never the
solver's own estimate. A budget the method cannot reach is a result with
``status="infeasible"`` and ``min_budget_bytes`` (the smallest budget it found to work), not an
exception.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from remat.ir import Graph, Plan, SolverUnavailableError, simulate
from remat.ir.result import SolveResult, Status
from remat.solver.problem import Problem, baseline_time_s, result_from_simulation

SolverKind = Literal["baseline", "chain", "dag", "meta"]

__all__ = [
    "Problem",
    "SolveResult",
    "Solver",
    "SolverInfo",
    "Status",
    "available",
    "baseline_time_s",
    "default_solver",
    "get",
    "info",
    "register",
    "result_from_plan",
]


class Solver(Protocol):
    """What :func:`get` returns: a solver called with a graph and a budget in bytes."""

    def __call__(
        self, graph: Graph, budget_bytes: int, *, time_limit_s: float | None = None, **options: Any
    ) -> SolveResult: ...


SolverFn = Callable[..., SolveResult]
"""A registered solver function: ``fn(problem: Problem, **options) -> SolveResult``."""

INTERNAL_OPTIONS = frozenset({"start_plans"})
"""Keyword parameters a solver accepts from Python (``auto``) but that are not user options."""


@dataclass(frozen=True)
class SolverInfo:
    """A registered solver: its function, what it models, and the options it accepts."""

    name: str
    fn: SolverFn
    kind: SolverKind
    exact: bool
    summary: str
    options: tuple[str, ...]

    def check_options(self, options: dict[str, Any]) -> None:
        """Raise ValueError naming the first option this solver does not accept."""
        unknown = sorted(set(options) - set(self.options) - INTERNAL_OPTIONS)
        if unknown:
            known = ", ".join(self.options) or "none"
            raise ValueError(
                f"solver {self.name!r} has no option {unknown[0]!r} (its options: {known})"
            )

    def run(self, problem: Problem, **options: Any) -> SolveResult:
        """Check ``options``, then solve ``problem``."""
        self.check_options(options)
        return self.fn(problem, **options)


_REGISTRY: dict[str, SolverInfo] = {}


def register(
    name: str, *, kind: SolverKind, exact: bool = False, summary: str = ""
) -> Callable[[SolverFn], SolverFn]:
    """Register ``fn(problem, **options) -> SolveResult`` under ``name`` (decorator); its
    keyword-only parameters are its options."""

    def deco(fn: SolverFn) -> SolverFn:
        if name in _REGISTRY:
            raise ValueError(f"solver {name!r} is registered twice")
        params = inspect.signature(fn).parameters
        opts = tuple(
            p
            for p, spec in params.items()
            if spec.kind is inspect.Parameter.KEYWORD_ONLY and p not in INTERNAL_OPTIONS
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


DEFAULT_SOLVER = "auto"
FALLBACK_SOLVER = "chen-greedy"


def default_solver() -> str:
    """The solver used when none is named: ``auto`` when it is registered, else
    ``chen-greedy`` (the one place that decides it)."""
    return DEFAULT_SOLVER if DEFAULT_SOLVER in available() else FALLBACK_SOLVER


def get(name: str) -> Solver:
    """The solver registered as ``name`` as a call on a graph and a budget in bytes; the
    options are checked before any work, then the :class:`Problem` is built."""
    si = info(name)

    def run(
        graph: Graph,
        budget_bytes: int,
        *,
        time_limit_s: float | None = None,
        **options: Any,
    ) -> SolveResult:
        si.check_options(options)
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be an integer >= 0, got {budget_bytes!r}")
        return si.fn(Problem.build(graph, budget_bytes, time_limit_s=time_limit_s), **options)

    run.__name__ = f"solve_{name.replace('-', '_')}"
    run.__doc__ = si.fn.__doc__
    return run


# -- helpers for solver authors -------------------------------------------------------------------


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
    """Simulate ``plan`` and wrap the simulator's figures in a :class:`SolveResult` (for code
    without a :class:`Problem`; solvers use :meth:`Problem.result`)."""
    sim = simulate(graph, plan, host_bandwidth_bytes_per_s=host_bandwidth_bytes_per_s)
    return result_from_simulation(
        graph,
        budget_bytes,
        plan,
        sim,
        solver=solver,
        started=started,
        status=status,
        lower_bound_s=lower_bound_s,
        message=message,
        record=host_bandwidth_bytes_per_s is None,
    )
