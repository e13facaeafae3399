"""The registry as its clients see it: ``GET /v1/solvers`` and ``remat solvers`` list the same.

A solver's ``progress`` option is the callback through which it reports incumbents; it is
wired by the caller (the frontier, the service's job runner), never set by a user, so listings
leave it out.
"""

from __future__ import annotations

from typing import Any

from remat.solver.base import SolverInfo, available, default_solver, info

PROGRESS_OPTION = "progress"
"""The option through which a solver reports its progress (a callback, not a user setting)."""


def user_options(si: SolverInfo) -> list[str]:
    """The options of ``si`` a user may set (every option but :data:`PROGRESS_OPTION`)."""
    return [o for o in si.options if o != PROGRESS_OPTION]


def solver_listing() -> dict[str, Any]:
    """Every registered solver (plugins included) with its kind, exactness, summary and user
    options, and the default: ``{"default": name, "solvers": [{"name", "kind", "exact",
    "summary", "options"}, ...]}``, the body of ``GET /v1/solvers``."""
    return {
        "default": default_solver(),
        "solvers": [
            {
                "name": si.name,
                "kind": si.kind,
                "exact": si.exact,
                "summary": si.summary,
                "options": user_options(si),
            }
            for si in map(info, available())
        ],
    }
