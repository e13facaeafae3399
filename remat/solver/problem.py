"""The problem object: the facts about one solve, derived once and handed to every solver.

``remat.solve`` (and :func:`remat.solver.get`'s callable) builds one :class:`Problem` per
solve: the budget in bytes, the static and input bytes, the room a schedule may use, the eager
plan and its simulation, the deadline and the progress callback. Solvers read these instead of
deriving them again, and build their results through :meth:`Problem.result`, so that every
figure is the simulator's. ``auto`` hands its sub-solvers the same problem with a shorter
deadline (:meth:`Problem.with_time_limit`), so the eager plan is simulated once per solve.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from remat.ir import Graph, Plan, Simulation, eager_plan, parse_budget, simulate
from remat.ir.budget import BudgetSpec, fraction_bytes
from remat.ir.result import PlanFigures, Progress, SolveResult, Status, best_result
from remat.solver import known

ProgressCallback = Callable[[Progress], None]

_log = logging.getLogger(__name__)


def room_bytes(graph: Graph, budget_bytes: int) -> int:
    """Bytes a schedule may use beyond the static bytes and the caller's inputs (the one
    definition of the room; may be negative when the budget is below them)."""
    return budget_bytes - graph.static_bytes - graph.input_bytes


def baseline_time_s(graph: Graph) -> float:
    """Time of the eager schedule: every node once, nothing recomputed or moved."""
    return sum(n.time_s for n in graph.nodes)


@dataclass(frozen=True)
class Problem:
    """One solve: a graph, a budget and what follows from them, computed once.

    Build with :meth:`build`. ``room_bytes`` is ``budget_bytes - static_bytes - input_bytes``;
    ``eager`` is the simulation of ``eager_plan`` (no recomputation, each value freed after its
    last use); ``deadline`` is a :func:`time.monotonic` instant (None: no time limit).
    """

    graph: Graph
    budget_bytes: int
    static_bytes: int
    input_bytes: int
    room_bytes: int
    eager_plan: Plan
    eager: Simulation
    time_limit_s: float | None = None
    deadline: float | None = None
    on_progress: ProgressCallback | None = field(default=None, compare=False)

    @classmethod
    def build(
        cls,
        graph: Graph,
        budget: BudgetSpec,
        *,
        time_limit_s: float | None = None,
        on_progress: ProgressCallback | None = None,
    ) -> Problem:
        """The problem of solving ``graph`` within ``budget``: bytes (an ``int``, ``"12GiB"``)
        or a fraction of the eager dynamic peak (``0.7``, ``"70%"``), parsed once by
        :func:`remat.ir.parse_budget`; a fraction is resolved against the eager simulation
        built here (see :func:`remat.ir.resolve_budget` for the meaning)."""
        spec = parse_budget(budget)
        if time_limit_s is not None and not (
            not isinstance(time_limit_s, bool) and time_limit_s > 0 and math.isfinite(time_limit_s)
        ):
            raise ValueError(f"time_limit_s must be a positive number, got {time_limit_s!r}")
        plan = eager_plan(graph)
        eager = simulate(graph, plan)
        if isinstance(spec, int):
            budget_bytes = spec
        else:
            budget_bytes = fraction_bytes(graph, spec, eager.peak_dynamic_bytes)
        return cls(
            graph=graph,
            budget_bytes=budget_bytes,
            static_bytes=graph.static_bytes,
            input_bytes=graph.input_bytes,
            room_bytes=room_bytes(graph, budget_bytes),
            eager_plan=plan,
            eager=eager,
            time_limit_s=time_limit_s,
            deadline=None if time_limit_s is None else time.monotonic() + time_limit_s,
            on_progress=on_progress,
        )

    # -- derived problems -------------------------------------------------------------------

    def with_budget(self, budget_bytes: int) -> Problem:
        """The same graph (and eager simulation, deadline, callback) at another budget."""
        return replace(
            self, budget_bytes=budget_bytes, room_bytes=room_bytes(self.graph, budget_bytes)
        )

    def with_time_limit(self, time_limit_s: float | None) -> Problem:
        """The same problem with a deadline ``time_limit_s`` from now, never later than this
        problem's own deadline."""
        if time_limit_s is None:
            return self
        deadline = time.monotonic() + time_limit_s
        if self.deadline is not None:
            deadline = min(deadline, self.deadline)
        return replace(self, time_limit_s=time_limit_s, deadline=deadline)

    # -- time -------------------------------------------------------------------------------

    def time_left_s(self) -> float:
        """Seconds until the deadline (``math.inf`` without one; negative once past it)."""
        return math.inf if self.deadline is None else self.deadline - time.monotonic()

    def time_left_or(self, default_s: float) -> float:
        """Seconds left before the deadline, or ``default_s`` when the solve has no time
        limit (a solver's own default limit, e.g. 60 s for the MILP)."""
        return default_s if self.deadline is None else self.time_left_s()

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def report(self, progress: Progress) -> None:
        """Hand ``progress`` to the callback, if any; a failing callback is logged, never
        raised into the solver."""
        if self.on_progress is None:
            return
        try:
            self.on_progress(progress)
        except Exception:  # a broken progress bar must not break the solve
            _log.exception("progress callback failed")

    # -- figures ----------------------------------------------------------------------------

    @property
    def baseline_time_s(self) -> float:
        """Time of the eager schedule (every node once)."""
        return baseline_time_s(self.graph)

    def simulate(
        self, plan: Plan, *, host_bandwidth_bytes_per_s: float | None = None
    ) -> Simulation:
        """The simulation of ``plan`` (the eager one is not simulated again)."""
        if plan is self.eager_plan or plan == self.eager_plan:  # no transfers: any bandwidth
            return self.eager
        return simulate(self.graph, plan, host_bandwidth_bytes_per_s=host_bandwidth_bytes_per_s)

    # -- results ----------------------------------------------------------------------------

    def result(
        self,
        plan: Plan,
        *,
        solver: str,
        started: float,
        status: Status | None = None,
        lower_bound_s: float | None = None,
        message: str = "",
        host_bandwidth_bytes_per_s: float | None = None,
    ) -> SolveResult:
        """Simulate ``plan`` and wrap the simulator's figures in a :class:`SolveResult`, vouched
        for as the simulator's (:meth:`SolveResult.vouch_simulated`); ``started`` is the
        solver's ``time.perf_counter()``.

        ``status`` defaults to ``feasible``; a plan whose simulated peak exceeds the budget is
        reported ``infeasible`` with ``min_budget_bytes`` set to its peak, whatever was asked,
        and ``min_budget_lower_bytes`` set to the proven lower bound on any plan's peak; so is
        a plan whose offloaded values hold more host memory than the link's
        ``host_memory_bytes`` (no device budget would make it fit: ``min_budget_bytes`` stays
        unset, the message says why). A plan
        simulated at the graph's own host bandwidth is remembered in :mod:`remat.solver.known`,
        so no later answer reports a minimum budget above it.

        Raises
        ------
        InvalidPlanError
            When the simulator rejects ``plan`` (the registry turns this into a
            :class:`~remat.ir.SolverBugError` naming the solver).
        """
        sim = self.simulate(plan, host_bandwidth_bytes_per_s=host_bandwidth_bytes_per_s)
        graph = self.graph
        host_budget = graph.link.host_memory_bytes
        over_host = host_budget is not None and sim.host_peak_bytes > host_budget
        if host_bandwidth_bytes_per_s is None and not over_host:
            known.record(graph, plan, sim.peak_bytes, solver)
        base = self.baseline_time_s
        st: Status = status or "feasible"
        min_budget = None
        if over_host:
            st = "infeasible"
            why = (
                f"its offloaded values hold {sim.host_peak_bytes} bytes of host memory, over "
                f"the host budget of {host_budget} (host_link.host_memory_bytes)"
            )
            message = f"{message}; {why}" if message else why
        elif sim.peak_bytes > self.budget_bytes:
            st = "infeasible"
            min_budget = sim.peak_bytes
        gap = None
        if lower_bound_s is not None and lower_bound_s > 0 and st != "infeasible":
            gap = max(0.0, sim.total_time_s / lower_bound_s - 1)
        return SolveResult(
            solver=solver,
            status=st,
            budget_bytes=self.budget_bytes,
            plan=plan,
            figures=PlanFigures.of(sim),
            baseline_time_s=base,
            overhead=(sim.total_time_s / base - 1) if base > 0 else 0.0,
            lower_bound_s=lower_bound_s,
            gap=gap,
            min_budget_bytes=min_budget,
            min_budget_lower_bytes=known.min_budget_lower_bytes(graph) if min_budget else None,
            solve_time_s=time.perf_counter() - started,
            message=message,
        ).vouch_simulated()

    def no_plan(
        self,
        *,
        solver: str,
        started: float,
        min_budget_bytes: int | None,
        message: str,
        status: Status = "infeasible",
    ) -> SolveResult:
        """A result without a plan: the method proved no plan fits, or ran out of time."""
        return SolveResult(
            solver=solver,
            status=status,
            budget_bytes=self.budget_bytes,
            baseline_time_s=self.baseline_time_s,
            min_budget_bytes=min_budget_bytes,
            min_budget_lower_bytes=known.min_budget_lower_bytes(self.graph),
            solve_time_s=time.perf_counter() - started,
            message=message,
        )

    def best_of(
        self,
        plans: Iterable[Plan],
        *,
        solver: str,
        started: float,
        host_bandwidth_bytes_per_s: float | None = None,
    ) -> SolveResult:
        """Simulate candidate plans; the fastest within budget wins, else the smallest peak
        (reported infeasible, with that peak as ``min_budget_bytes``). No plans: the eager
        one."""
        candidates = list(plans) or [self.eager_plan]
        results = [
            self.result(
                p,
                solver=solver,
                started=started,
                host_bandwidth_bytes_per_s=host_bandwidth_bytes_per_s,
            )
            for p in candidates
        ]
        best = best_result(results)
        assert best is not None
        return best.model_copy(update={"solve_time_s": time.perf_counter() - started})
