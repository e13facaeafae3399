"""The budget/time frontier: the overhead each solver reaches at each budget, with its bound.

``remat frontier --json`` writes a list of :class:`FrontierPoint`; ``remat report --frontier``
reads it back, or the report computes one with :func:`compute_frontier`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from remat.ir import Graph, RematError, resolve_budget
from remat.ir.budget import BudgetSpec

DEFAULT_BUDGETS: tuple[str, ...] = ("100%", "80%", "60%", "50%", "40%", "30%", "20%", "10%")
QUICK_SOLVERS: tuple[str, ...] = ("checkpoint-all", "chen-greedy", "rotor")
"""Solvers that answer in well under a second on graphs of a few thousand nodes: the default
frontier of ``remat report`` (a slow exact solver at eight budgets would take minutes)."""


class FrontierPoint(BaseModel):
    """One solver at one budget. Bytes are device bytes in all (static + dynamic)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    solver: str
    budget: str
    """The budget as it was asked for (``"50%"``, ``"12GiB"``)."""
    budget_bytes: int
    status: str
    peak_bytes: int | None = None
    total_time_s: float | None = None
    overhead: float | None = None
    baseline_time_s: float | None = None
    lower_bound_s: float | None = None
    gap: float | None = None
    min_budget_bytes: int | None = None
    solve_time_s: float = 0.0

    @property
    def fits(self) -> bool:
        return self.status in ("optimal", "feasible") and self.overhead is not None

    @property
    def bound_overhead(self) -> float | None:
        """The proven lower bound as an overhead over the eager time, where there is one."""
        if self.lower_bound_s is None or not self.baseline_time_s:
            return None
        return max(0.0, self.lower_bound_s / self.baseline_time_s - 1)


_POINTS = TypeAdapter(list[FrontierPoint])


def point_from_result(budget: BudgetSpec, result: Any) -> FrontierPoint:
    """A frontier point from a :class:`~remat.solver.SolveResult`."""
    return FrontierPoint(
        solver=result.solver,
        budget=str(budget),
        budget_bytes=result.budget_bytes,
        status=result.status,
        peak_bytes=result.peak_bytes,
        total_time_s=result.total_time_s,
        overhead=result.overhead,
        baseline_time_s=result.baseline_time_s,
        lower_bound_s=result.lower_bound_s,
        gap=result.gap,
        min_budget_bytes=result.min_budget_bytes,
        solve_time_s=result.solve_time_s,
    )


def compute_frontier(
    graph: Graph,
    *,
    budgets: Sequence[BudgetSpec] = DEFAULT_BUDGETS,
    solvers: Sequence[str] = QUICK_SOLVERS,
    time_limit_s: float | None = None,
    on_point: Callable[[int, int, FrontierPoint], None] | None = None,
    on_start: Callable[[int, int, str, BudgetSpec], None] | None = None,
    solve_options: dict[str, Any] | None = None,
) -> list[FrontierPoint]:
    """Solve ``graph`` with each solver at each budget (one :func:`remat.frontier` per solver).

    A solver that does not apply to the graph (a chain method on a DAG it cannot view as a
    chain) contributes an ``error`` point with its message instead of stopping the frontier.
    ``on_start(index, total, solver, budget)`` is called before each solver's frontier and
    ``on_point(done, total, point)`` after each point. ``solve_options`` go to every
    :func:`remat.frontier` call (the solver's options, or ``progress``: a callback).

    Raises
    ------
    ValueError
        When a budget cannot be read; naming it.
    """
    from remat import solver as registry

    resolved = [(b, resolve_budget(graph, b)) for b in budgets]
    for name in solvers:
        registry.info(name)  # an unknown name fails before any work, naming it
    total = len(resolved) * len(solvers)
    points: list[FrontierPoint] = []
    for name in solvers:
        # One remat.frontier per solver: budgets share their plans, so the time never rises
        # with the budget and spare room is spent (see remat.solver.frontier).
        # budgets are solved in increasing order of bytes, each distinct one once
        order = sorted({b for _, b in resolved})
        spec_of = {b: spec for spec, b in reversed(resolved)}

        def next_budget(
            done: int, name: str = name, order: list[int] = order, spec_of: Any = spec_of
        ) -> None:
            if on_start is not None and done < len(order):
                on_start(len(points) + done, total, name, spec_of[order[done]])

        next_budget(0)
        try:
            fr = registry.frontier(
                graph,
                [b for _, b in resolved],
                solver=name,
                time_limit_s=time_limit_s,
                on_point=next_budget,
                **(solve_options or {}),
            )
            row = [
                point_from_result(spec, r)
                for (spec, _), r in zip(resolved, fr.results, strict=True)
            ]
        except (RematError, ValueError) as exc:
            row = [
                FrontierPoint(
                    solver=name, budget=str(spec), budget_bytes=budget_bytes, status=f"error: {exc}"
                )
                for spec, budget_bytes in resolved
            ]
        for point in row:
            points.append(point)
            if on_point is not None:
                on_point(len(points), total, point)
    return points


def dump_frontier(points: Sequence[FrontierPoint]) -> str:
    """The JSON list ``remat frontier --json`` prints."""
    return json.dumps([p.model_dump(mode="json") for p in points], indent=1)


def load_frontier(text: str, *, source: str = "frontier") -> list[FrontierPoint]:
    """Points from ``remat frontier --json`` output; a ``ValueError`` naming ``source``."""
    try:
        return _POINTS.validate_json(text)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"{source}: not a frontier list ({loc}: {first['msg']})") from None


def frontier_text(points: Sequence[FrontierPoint]) -> str:
    """The table ``remat frontier`` prints: one line per solver and budget."""
    from remat.ir import format_bytes

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{x * 100:+.1f}%"

    lines = [
        f"  {'solver':>14} {'budget':>10} {'bytes':>14} {'status':>10} {'peak':>12} "
        f"{'time':>12} {'overhead':>9}"
    ]
    for p in points:
        pk = "-" if p.peak_bytes is None else format_bytes(p.peak_bytes)
        t = "n/a" if p.total_time_s is None else f"{p.total_time_s:.6g} s"
        lines.append(
            f"  {p.solver:>14} {p.budget:>10} {p.budget_bytes:>14} {p.status:>10} {pk:>12} "
            f"{t:>12} {pct(p.overhead):>9}"
        )
    return "\n".join(lines)
