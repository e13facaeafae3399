"""What a solve returns: the plan, the simulator's figures for it, and how they were found.

These types live in the core (not in :mod:`remat.solver`) so that every part of remat can read
a result: the executor runs its plan, the service stores it, the CLI prints it, without
importing the solvers.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, PrivateAttr, model_validator

from remat.ir.budget import format_bytes
from remat.ir.errors import InfeasibleBudgetError
from remat.ir.graph import Graph
from remat.ir.plan import Plan
from remat.ir.simulate import Simulation

Status = Literal["optimal", "feasible", "infeasible", "timeout"]


class PlanFigures(BaseModel):
    """The simulator's figures for one plan: bytes (static + dynamic) and seconds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    peak_bytes: int
    static_bytes: int
    peak_dynamic_bytes: int
    total_time_s: float
    compute_time_s: float
    recompute_time_s: float
    recompute_flops: int
    stall_time_s: float
    transfer_time_s: float
    offload_bytes: int
    prefetch_bytes: int = 0
    device_to_host_busy_s: float = 0.0
    """Time the link's device-to-host direction is busy (offloads)."""
    host_to_device_busy_s: float = 0.0
    """Time the link's host-to-device direction is busy (prefetches)."""
    host_peak_bytes: int = 0
    """Most host memory the offloaded values hold at once."""

    @classmethod
    def of(cls, sim: Simulation) -> PlanFigures:
        """The figures of a :class:`~remat.ir.Simulation`."""
        return cls(
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
            prefetch_bytes=sim.prefetch_bytes,
            device_to_host_busy_s=sim.device_to_host_busy_s,
            host_to_device_busy_s=sim.host_to_device_busy_s,
            host_peak_bytes=sim.host_peak_bytes,
        )


class _Attached:
    """The graph a result was solved on, for drawing only. Equal to any other: two results
    with the same fields are equal whether or not one knows its graph."""

    __slots__ = ("graph",)

    def __init__(self, graph: Graph | None) -> None:
        self.graph = graph

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Attached)

    __hash__ = None  # type: ignore[assignment]


class _Simulated:
    """The plan and figures a simulation made a result from, held by identity: a copy of the
    result that keeps both keeps them, one that swaps either is no longer vouched for. Equal to
    any other, like :class:`_Attached`."""

    __slots__ = ("figures", "plan")

    def __init__(self, plan: Plan | None = None, figures: PlanFigures | None = None) -> None:
        self.plan = plan
        self.figures = figures

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Simulated)

    __hash__ = None  # type: ignore[assignment]


class SolveResult(BaseModel):
    """What every solver returns. Times in seconds, memory in bytes (static + dynamic).

    ``figures`` are the simulator's figures for ``plan`` and are present exactly when there is
    a plan. ``baseline_time_s`` is the time of the eager schedule (no recomputation) and
    ``overhead`` the relative extra time over it. ``lower_bound_s`` is a proven lower bound on
    the time of any plan within the budget when the method proves one, and ``gap`` is
    ``total_time_s / lower_bound_s - 1``. For ``infeasible``, ``min_budget_bytes`` is the
    smallest budget the method found to work and ``plan`` (if any) is the plan that reaches it
    (``auto`` and :func:`remat.frontier`: the smallest plan any method found for the graph), and
    ``min_budget_lower_bytes`` a proven lower bound on the peak of every plan (static bytes,
    inputs and the largest working set of any single node).
    ``solver`` names the method that made the plan.

    The figures' fields are also readable on the result itself (``result.peak_bytes``), as
    ``None`` when there is no plan.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    solver: str
    status: Status
    budget_bytes: int
    plan: Plan | None = None
    figures: PlanFigures | None = None
    baseline_time_s: float
    overhead: float | None = None
    lower_bound_s: float | None = None
    gap: float | None = None
    min_budget_bytes: int | None = None
    min_budget_lower_bytes: int | None = None
    solve_time_s: float = 0.0
    message: str = ""

    @model_validator(mode="after")
    def _figures_with_plan(self) -> SolveResult:
        if (self.plan is None) != (self.figures is None):
            raise ValueError("a result has figures exactly when it has a plan")
        return self

    _drawn_with: _Attached = PrivateAttr(default_factory=lambda: _Attached(None))
    _simulated: _Simulated = PrivateAttr(default_factory=_Simulated)

    def vouch_simulated(self) -> SolveResult:
        """Record that ``figures`` are the simulator's for ``plan`` (what
        :meth:`remat.solver.Problem.result` does after simulating it). Returns the result
        itself."""
        self._simulated = _Simulated(self.plan, self.figures)
        return self

    @property
    def simulated(self) -> bool:
        """``figures`` are known to be the simulator's for ``plan``: this result, or a copy
        that kept both, was vouched for by :meth:`vouch_simulated`. False for a result built
        otherwise, after a copy that replaced the plan or the figures, and for one read back
        from JSON (these are simulated again by the solve path)."""
        s = self._simulated
        return self.plan is not None and s.plan is self.plan and s.figures is self.figures

    @property
    def fits(self) -> bool:
        """A plan exists and its simulated peak is within the budget."""
        return self.status in ("optimal", "feasible") and self.plan is not None

    def require_fit(self) -> SolveResult:
        """This result, when its plan fits the budget; else raise
        :class:`~remat.ir.InfeasibleBudgetError` carrying ``min_budget_bytes`` (the smallest
        budget the solver found to work, None when it found none, e.g. on a timeout).

        >>> from remat.ir import synthetic
        >>> import remat
        >>> plan = remat.solve(synthetic.chain(4), "100%", solver="none").require_fit().plan
        """
        if self.fits:
            return self
        need = (
            f"; the smallest budget found to work is {self.min_budget_bytes} bytes"
            if self.min_budget_bytes is not None
            else ""
        )
        raise InfeasibleBudgetError(
            f"{self.solver}: no plan fits {self.budget_bytes} bytes ({self.status}){need}"
            + (f": {self.message}" if self.message else ""),
            min_budget_bytes=self.min_budget_bytes,
        )

    @property
    def graph(self) -> Graph | None:
        """The graph the plan was solved on, when this result was solved in this process
        (``remat.solve`` attaches it; a result read back from JSON has none)."""
        return self._drawn_with.graph

    def with_graph(self, graph: Graph) -> SolveResult:
        """Remember the graph the plan is for (not serialised), so that a notebook can draw
        the plan's memory timeline; ``remat.solve`` does this. Returns the result itself."""
        self._drawn_with = _Attached(graph)
        return self

    def _repr_html_(self) -> str:
        """A notebook's view: the one a higher layer registered with :func:`set_html_view`
        (``remat.report`` draws the memory timeline), else the figures as text."""
        if _html_view is None:
            return f"<pre>{html.escape(self.summary_text())}</pre>"
        return _html_view(self, self._drawn_with.graph)

    def summary_text(self) -> str:
        """The result in a few lines of text."""

        def pct(x: float | None) -> str:
            return "n/a" if x is None else f"{x * 100:+.1f}%"

        lines = [f"{self.solver} ({self.status}) at {format_bytes(self.budget_bytes)}"]
        if self.figures is not None:
            f = self.figures
            lines.append(
                f"peak {format_bytes(f.peak_bytes)}, time {f.total_time_s:.4g} s "
                f"(overhead {pct(self.overhead)}), recompute {f.recompute_time_s:.4g} s"
            )
        if self.lower_bound_s is not None:
            lines.append(f"bound {self.lower_bound_s:.4g} s (gap {pct(self.gap)})")
        if self.min_budget_bytes is not None:
            lines.append(f"smallest budget found {format_bytes(self.min_budget_bytes)}")
        if self.message:
            lines.append(self.message)
        return "\n".join(lines)

    # -- shortcuts into ``figures`` (None without a plan) ------------------------------------

    @property
    def peak_bytes(self) -> int | None:
        return None if self.figures is None else self.figures.peak_bytes

    @property
    def static_bytes(self) -> int | None:
        return None if self.figures is None else self.figures.static_bytes

    @property
    def peak_dynamic_bytes(self) -> int | None:
        return None if self.figures is None else self.figures.peak_dynamic_bytes

    @property
    def total_time_s(self) -> float | None:
        return None if self.figures is None else self.figures.total_time_s

    @property
    def compute_time_s(self) -> float | None:
        return None if self.figures is None else self.figures.compute_time_s

    @property
    def recompute_time_s(self) -> float | None:
        return None if self.figures is None else self.figures.recompute_time_s

    @property
    def recompute_flops(self) -> int | None:
        return None if self.figures is None else self.figures.recompute_flops

    @property
    def stall_time_s(self) -> float | None:
        return None if self.figures is None else self.figures.stall_time_s

    @property
    def transfer_time_s(self) -> float | None:
        return None if self.figures is None else self.figures.transfer_time_s

    @property
    def offload_bytes(self) -> int | None:
        return None if self.figures is None else self.figures.offload_bytes

    @property
    def host_peak_bytes(self) -> int | None:
        return None if self.figures is None else self.figures.host_peak_bytes


def speed_key(result: SolveResult) -> tuple[float, int]:
    """Sort key: fastest plan first, then the smaller peak; results without a plan last."""
    f = result.figures
    return (math.inf, 0) if f is None else (f.total_time_s, f.peak_bytes)


def peak_key(result: SolveResult) -> tuple[float, float]:
    """Sort key: smallest peak first, then the faster plan; results without a plan last."""
    f = result.figures
    return (math.inf, math.inf) if f is None else (f.peak_bytes, f.total_time_s)


def best_result(results: Iterable[SolveResult]) -> SolveResult | None:
    """The fastest result that fits; else the one with the smallest peak (the smallest budget
    known to work); else the first result (none has a plan); None for no results."""
    rs = list(results)
    fitting = [r for r in rs if r.fits]
    if fitting:
        return min(fitting, key=speed_key)
    with_plan = [r for r in rs if r.figures is not None]
    if with_plan:
        return min(with_plan, key=peak_key)
    return rs[0] if rs else None


class Progress(BaseModel):
    """Where a running solve stands: its incumbent's overhead and peak, the bound, the gap.

    JSON-serialisable: the service stores the latest as a job's progress.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    solver: str
    phase: str
    elapsed_s: float
    time_limit_s: float | None = None
    incumbent_overhead: float | None = None
    incumbent_peak_bytes: int | None = None
    lower_bound_s: float | None = None
    gap: float | None = None
    message: str | None = None


HtmlView = Callable[[SolveResult, Graph | None], str]
"""A notebook view of a result: the result and the graph it was solved on (None when unknown)."""

_html_view: HtmlView | None = None


def set_html_view(view: HtmlView | None) -> None:
    """Make ``view`` what :meth:`SolveResult._repr_html_` shows (None: the figures as text).

    The core draws nothing itself: :mod:`remat.report`, a layer above, registers its timeline
    view when it is imported (``import remat`` does), so the core never imports it.
    """
    global _html_view
    _html_view = view
