"""The exception hierarchy shared by every part of remat.

Core code raises these; the service maps them to HTTP status codes and the CLI to exit codes.
"""

from __future__ import annotations


class RematError(Exception):
    """Base class of every error remat raises on purpose."""


class GraphValidationError(RematError, ValueError):
    """A graph is malformed; the message names the offending node or value id (or field)."""


class InvalidPlanError(RematError, ValueError):
    """A plan cannot run on its graph; the message names the step index and the id at fault."""

    def __init__(self, message: str, *, step: int | None = None) -> None:
        super().__init__(message)
        self.step = step


class InfeasibleBudgetError(RematError, ValueError):
    """No schedule fits the budget. ``min_budget_bytes`` is the smallest budget found to work.

    Solvers return an ``infeasible`` result rather than raising; ``SolveResult.require_fit()``
    raises this for callers that want an exception."""

    def __init__(self, message: str, *, min_budget_bytes: int | None = None) -> None:
        super().__init__(message)
        self.min_budget_bytes = min_budget_bytes


class SolverBugError(RematError, RuntimeError):
    """A solver returned a plan the simulator rejects, or figures the simulator does not find
    for it, on a graph and budget it accepted: a bug in that solver, never the caller's fault.
    ``solver`` names it; ``remat.solve``'s ``auto`` skips such a sub-solver (and logs it), and
    the service answers 500."""

    def __init__(self, message: str, *, solver: str) -> None:
        super().__init__(message)
        self.solver = solver


class GraphTooLargeError(RematError, ValueError):
    """The graph is past the size a solver takes (an exact MILP's node limit); ``option``
    names the solver option that sets the limit. A request error, not a solver bug: the service
    answers 422."""

    def __init__(self, message: str, *, solver: str, option: str) -> None:
        super().__init__(message)
        self.solver = solver
        self.option = option


class SolverUnavailableError(RematError, LookupError):
    """The named solver is not registered, or its backend (e.g. HiGHS) is not installed."""
