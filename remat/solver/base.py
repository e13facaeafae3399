"""The solver interface and the registry.

Every solver is a function ``solve(problem, **options) -> SolveResult`` registered under a
name; :class:`~remat.solver.problem.Problem` carries the graph, the budget and what follows from
them. A solver returns a plan; its figures in the result are always the simulator's, never the
solver's own estimate. A budget the method cannot reach is a result with
``status="infeasible"`` and ``min_budget_bytes`` (the smallest budget it found to work), not an
exception.

Every call of a registered solver (:func:`get`, ``remat.solve``, ``auto``'s sub-solvers, the
service) goes through :meth:`SolverInfo.solve`, which holds the result to the simulator
(:func:`held_to_simulator`): a plan the simulator rejects, figures it does not find, or a fit
claimed above the budget are the solver's bug, raised as :class:`~remat.ir.SolverBugError`
naming it, never returned.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, ValidationError

from remat.ir import Graph, InvalidPlanError, SolverBugError, SolverUnavailableError
from remat.ir.result import PlanFigures, SolveResult, Status
from remat.solver.problem import Problem, ProgressCallback, baseline_time_s

SolverKind = Literal["baseline", "chain", "dag", "meta"]

__all__ = [
    "InvalidOptionError",
    "NoOptions",
    "Problem",
    "SolveResult",
    "Solver",
    "SolverInfo",
    "SolverOptions",
    "Status",
    "available",
    "baseline_time_s",
    "default_solver",
    "get",
    "held_to_simulator",
    "info",
    "register",
]


class Solver(Protocol):
    """What :func:`get` returns: a solver called with a graph and a budget in bytes."""

    def __call__(
        self,
        graph: Graph,
        budget_bytes: int,
        *,
        time_limit_s: float | None = None,
        progress: ProgressCallback | None = None,
        **options: Any,
    ) -> SolveResult: ...


SolverFn = Callable[..., SolveResult]
"""A registered solver function: ``fn(problem: Problem, **options) -> SolveResult``."""

INTERNAL_OPTIONS = frozenset({"start_plans", "good_enough_s"})
"""Keyword parameters a solver accepts from Python (``auto``) but that are not user options."""


class SolverOptions(BaseModel):
    """Base of every solver's options model, declared beside the solver that reads it.

    Frozen, unknown names refused, strict types: a bool is not an integer nor an integer a
    bool (an integer is accepted for a float). Bounds (``Field(ge=..., le=...)``) keep every
    option within what the solver can do without exhausting memory.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class NoOptions(SolverOptions):
    """The options of a solver that takes none."""


class InvalidOptionError(ValueError):
    """A solver option is unknown, of the wrong type or out of its range; ``option`` names it."""

    def __init__(self, message: str, *, solver: str, option: str) -> None:
        super().__init__(message)
        self.solver = solver
        self.option = option


@dataclass(frozen=True)
class SolverInfo:
    """A registered solver: its function, what it models, and the options it accepts.

    ``options_model`` is the solver's :class:`SolverOptions` (its JSON schema describes the
    options); None only for solvers registered without one (plugins), whose options are then
    checked by name only.
    """

    name: str
    fn: SolverFn
    kind: SolverKind
    exact: bool
    summary: str
    options: tuple[str, ...]
    options_model: type[SolverOptions] | None = None

    def check_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The options validated (types, ranges), ready to pass to the solver; raise
        :class:`InvalidOptionError` naming the first bad one. Internal keywords
        (``start_plans``) pass through unchecked."""
        internal = {k: v for k, v in options.items() if k in INTERNAL_OPTIONS}
        user = {k: v for k, v in options.items() if k not in INTERNAL_OPTIONS}
        unknown = sorted(set(user) - set(self.options))
        if unknown:
            known = ", ".join(self.options) or "none"
            raise InvalidOptionError(
                f"solver {self.name!r} has no option {unknown[0]!r} (its options: {known})",
                solver=self.name,
                option=unknown[0],
            )
        if self.options_model is None:
            return {**user, **internal}
        try:
            parsed = self.options_model.model_validate(user)
        except ValidationError as exc:
            errors = exc.errors()
            opt = str(errors[0]["loc"][0]) if errors[0]["loc"] else "?"
            # a union (e.g. milp's window) reports one message per alternative: join them
            msgs = dict.fromkeys(e["msg"] for e in errors if e["loc"] and e["loc"][0] == opt)
            why = " or ".join(msgs) or errors[0]["msg"]
            raise InvalidOptionError(
                f"solver {self.name!r}: option {opt!r}: {why} (got {user.get(opt)!r})",
                solver=self.name,
                option=opt,
            ) from None
        return {**dict(parsed), **internal}

    def solve(self, problem: Problem, checked: Mapping[str, Any]) -> SolveResult:
        """Solve ``problem`` with options already checked (:meth:`check_options`), the result
        held to the simulator (:func:`held_to_simulator`); the one way every caller runs a
        registered solver.

        Raises
        ------
        SolverBugError
            When the solver's plan is no plan for the graph, or its result misreports it.
        """
        try:
            result = self.fn(problem, **checked)
        except InvalidPlanError as exc:
            # a plan judged inside the solver (Problem.result) and rejected: the solver's bug
            raise SolverBugError(
                f"solver {self.name!r} made a plan the simulator rejects: {exc}",
                solver=self.name,
            ) from exc
        return held_to_simulator(problem, result, self.name)

    def run(self, problem: Problem, **options: Any) -> SolveResult:
        """Check ``options``, then solve ``problem`` (:meth:`solve`)."""
        return self.solve(problem, self.check_options(options))


def held_to_simulator(problem: Problem, result: SolveResult, solver: str) -> SolveResult:
    """``result``, once its plan is known to run and its figures to be the simulator's.

    A result built by :meth:`Problem.result` (or a copy keeping its plan and figures) was
    simulated already and costs nothing here; any other plan (a plugin's own
    :class:`SolveResult`, a copy that swapped the plan) is simulated now.

    Raises
    ------
    SolverBugError
        Naming ``solver``, when the simulator rejects the plan, finds another peak or time than
        the result reports (plans without transfers, whose figures do not depend on the host
        bandwidth), or the result claims to fit a budget its peak exceeds, or a host budget
        its offloaded values exceed.
    """
    if result.plan is None or result.figures is None:
        return result
    if not result.simulated:
        try:
            sim = problem.simulate(result.plan)
        except InvalidPlanError as exc:
            raise SolverBugError(
                f"solver {solver!r} returned a plan the simulator rejects: {exc}", solver=solver
            ) from exc
        moves = any(s.op in ("offload", "prefetch") for s in result.plan.steps)
        got, want = result.figures, PlanFigures.of(sim)
        if not moves and (
            got.peak_bytes != want.peak_bytes
            or not math.isclose(got.total_time_s, want.total_time_s, rel_tol=1e-9, abs_tol=1e-12)
        ):
            raise SolverBugError(
                f"solver {solver!r} reports {got.peak_bytes} bytes and {got.total_time_s:.6g} s "
                f"for its plan; the simulator finds {want.peak_bytes} bytes and "
                f"{want.total_time_s:.6g} s",
                solver=solver,
            )
    if result.fits and result.figures.peak_bytes > result.budget_bytes:
        raise SolverBugError(
            f"solver {solver!r} reports {result.status!r} for a plan peaking at "
            f"{result.figures.peak_bytes} bytes, above the budget of {result.budget_bytes}",
            solver=solver,
        )
    host = problem.graph.link.host_memory_bytes
    if result.fits and host is not None and result.figures.host_peak_bytes > host:
        raise SolverBugError(
            f"solver {solver!r} reports {result.status!r} for a plan holding "
            f"{result.figures.host_peak_bytes} bytes of host memory, above the host budget of "
            f"{host} (host_link.host_memory_bytes)",
            solver=solver,
        )
    return result


_REGISTRY: dict[str, SolverInfo] = {}


def register(
    name: str,
    *,
    kind: SolverKind,
    exact: bool = False,
    summary: str = "",
    options: type[SolverOptions] | None = None,
) -> Callable[[SolverFn], SolverFn]:
    """Register ``fn(problem, **options) -> SolveResult`` under ``name`` (decorator).

    The keyword-only parameters of ``fn`` are its options; ``options`` is their model, whose
    fields must be exactly those parameters with the same defaults (checked here, so the two
    cannot drift apart).
    """

    def deco(fn: SolverFn) -> SolverFn:
        if name in _REGISTRY:
            raise ValueError(f"solver {name!r} is registered twice")
        params = {
            p: spec
            for p, spec in inspect.signature(fn).parameters.items()
            if spec.kind is inspect.Parameter.KEYWORD_ONLY and p not in INTERNAL_OPTIONS
        }
        if options is not None:
            fields = options.model_fields
            if set(fields) != set(params):
                raise ValueError(
                    f"solver {name!r}: options model {options.__name__} has fields "
                    f"{sorted(fields)}, the function takes {sorted(params)}"
                )
            for p, spec in params.items():
                if fields[p].default != spec.default:
                    raise ValueError(
                        f"solver {name!r}: option {p!r} defaults to {spec.default!r} in the "
                        f"function but {fields[p].default!r} in {options.__name__}"
                    )
        # a plugin function may have no docstring: its summary is then empty
        doc = summary or next(iter((fn.__doc__ or "").strip().splitlines()), "")
        _REGISTRY[name] = SolverInfo(name, fn, kind, exact, doc, tuple(params), options)
        return fn

    return deco


def available() -> list[str]:
    """Names of the registered solvers, sorted. The built-in solvers' modules register
    themselves on import, and importing this module first runs ``remat/solver/__init__.py``,
    which imports them all: the registry is full before any caller can ask."""
    return sorted(_REGISTRY)


def info(name: str) -> SolverInfo:
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
    """The solver registered as ``name`` as a call on a graph and a budget in bytes (and
    ``progress``, a callback for its reports); the options are checked before any work, then
    the :class:`Problem` is built."""
    si = info(name)

    def run(
        graph: Graph,
        budget_bytes: int,
        *,
        time_limit_s: float | None = None,
        progress: ProgressCallback | None = None,
        **options: Any,
    ) -> SolveResult:
        checked = si.check_options(options)
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be an integer >= 0, got {budget_bytes!r}")
        problem = Problem.build(
            graph, budget_bytes, time_limit_s=time_limit_s, on_progress=progress
        )
        return si.solve(problem, checked)

    run.__name__ = f"solve_{name.replace('-', '_')}"
    run.__doc__ = si.fn.__doc__
    return run
