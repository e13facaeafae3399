"""Checkmate's exact MILP for rematerialization over the op graph.

The step is split into ``T = num_nodes`` *stages*: stage ``t`` may recompute earlier nodes, in
graph order, and then computes node ``t`` for the first time (the frontier advances by one node
per stage, Checkmate's "frontier-advancing" partial order). Binary variables:

* ``R[t, k]``: node ``k`` runs in stage ``t`` (``R[t, t] = 1``);
* ``S[t, v]``: value ``v`` is on the device when stage ``t`` starts;

and continuous ones: ``F[t, v, k]`` (``v`` is freed right after node ``k`` in stage ``t``, allowed
only when nothing later in the stage reads it and it is not kept into stage ``t + 1``),
``A[t, v]`` (a recomputation allocates ``v``: it was not resident, or was freed earlier in the
stage)
and ``U[t, k]`` (dynamic bytes while node ``k`` of stage ``t`` runs, the recurrence of the paper).
The objective is the sum of node times over all ``R``.

Memory is the simulator's model (``remat.ir.simulate``) without offloading: inputs are always
there, outputs are allocated when a node runs, workspace counts while it runs, a value is freed
after its last read in a stage unless it is kept. The plan extracted from a solution frees
exactly where the model allows, so its simulated peak and time equal the model's figures.

Standard reductions keep the model small and lose no optimal schedule of this class:

* a node whose output is required (the loss) or that has side effects runs exactly once;
* a value produced by a node that cannot run again is kept from its computation to its last
  reader (its ``S`` are constants);
* ``S[t, v]`` exists only up to the last stage in which ``v`` or something recomputed from it can
  still be read, and is one variable across stages in which nothing can make, read or free
  ``v``; a recomputation is only allowed when one of its outputs is read later in the stage or
  kept; a value is only kept into a stage that reads it or keeps it further.

On graphs over 32 nodes, further restrictions shrink the model at the price of exactness over
the whole class (the optimum and the bound are then those of the restricted class):

* ``recompute_backward`` off: backward nodes run once;
* ``recompute_in_forward`` off: only stages of backward nodes recompute;
* lazy recomputation: a node is recomputed only in a stage that reads its output;
* a recompute *window*: stage ``t`` recomputes only nodes of the blocks (``block_key`` of the
  module path) whose values node ``t`` reads, or of the ``window`` blocks before them; the
  window widens (0, 2, 8, all) when the MILP proves it infeasible;
* when the ladder is proven infeasible at every window with ``recompute_backward`` left to
  its default (off), it is run again with backward recomputation on.

HiGHS starts from the first given start plan (``auto`` passes the plans its other solvers
found) or fallback plan (eager, keep nothing, keep the blocks' inputs) that lies in the model's
class; a faster fallback plan outside the class is returned when it beats the MILP's
incumbent. milp runs no other solver.

References
----------
P. Jain, A. Jain, A. Nrusimha, A. Gholami, P. Abbeel, K. Keutzer, I. Stoica, J. E. Gonzalez.
"Checkmate: Breaking the Memory Wall with Optimal Tensor Rematerialization." MLSys 2020.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

from remat.ir import Graph, InvalidPlanError, Plan, keep_plan
from remat.ir.result import Progress, SolveResult, speed_key
from remat.solver._mip import Backend, MipSolution
from remat.solver.base import SolverOptions, register
from remat.solver.bounds import best_bound
from remat.solver.bounds_stage import STAGE_MAX_NODES, stage_schedule
from remat.solver.checkmate import SMALL_GRAPH_NODES, CheckmateModel
from remat.solver.checkmate_plans import replay, start_from_plan
from remat.solver.deadline import Deadline, Expired, judging_s
from remat.solver.milp_index import MilpIndex
from remat.solver.problem import Problem


def fallback_plans(problem: Problem) -> list[Plan]:
    """Cheap plans to fall back on (eager, keep nothing, keep block/articulation cuts)."""
    from remat.ir import block_cuts

    graph = problem.graph
    plans = [problem.eager_plan]
    for keep in (set(), {v for c in block_cuts(graph) for v in c.values}):
        try:
            plans.append(keep_plan(graph, keep))
        except InvalidPlanError:  # a heuristic that does not apply is skipped
            continue
    return plans


DEFAULT_TIME_LIMIT_S = 60.0

RELAXATION_SHARE = 0.1
"""Share of milp's time for the relaxation's bound (graphs up to ``STAGE_MAX_NODES``)."""


@dataclass
class CheckmateRun:
    """A solved model: the model, the back end's answer and, when it has one, the plan."""

    model: CheckmateModel
    solution: MipSolution | None
    plan: Plan | None = None
    bound_s: float | None = None


WindowSpec = int | Literal["auto", "all"]

MAX_WINDOW_BLOCKS = 10**6
MAX_THREADS = 1024

Window = Annotated[int, Field(ge=0, le=MAX_WINDOW_BLOCKS)] | Literal["auto", "all"]
"""A validated :data:`WindowSpec` (an option of ``milp`` and ``lp-round``)."""


def run_is_exact(
    graph: Graph,
    recompute_backward: bool | None,
    recompute_in_forward: bool | None,
    window: WindowSpec,
) -> bool:
    """Whether the model these options build carries none of the optional restrictions (its
    optimum and bound then hold over the whole class), as :attr:`CheckmateModel.exact`."""
    small = graph.num_nodes <= SMALL_GRAPH_NODES
    rb = small if recompute_backward is None else recompute_backward
    rf = small if recompute_in_forward is None else recompute_in_forward
    return rb and rf and small and window_ladder(graph, window) == [None]


def window_ladder(
    graph: Graph, window: WindowSpec, *, restricted: bool = False
) -> list[int | None]:
    """The recompute windows to try in turn: a fixed one, or (``"auto"``) 0, 2 and 8 blocks
    and then any block for graphs over 32 nodes (or ``restricted``), widening only when a
    window is infeasible."""
    small = graph.num_nodes <= SMALL_GRAPH_NODES and not restricted
    if window == "all" or (window == "auto" and small):
        return [None]
    if window == "auto":
        return [0, 2, 8, None]
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be 'auto', 'all' or an integer >= 0, got {window!r}")
    return [window]


def run_checkmate(
    graph: Graph,
    budget_bytes: int,
    *,
    time_limit_s: float | None = None,
    deadline: Deadline | None = None,
    backend: Backend = "highs",
    relax: bool = False,
    recompute_backward: bool | None = None,
    recompute_in_forward: bool | None = None,
    window: WindowSpec = "auto",
    threads: int | None = None,
    hints: list[Plan] | None = None,
    on_incumbent: Callable[[float, float | None], None] | None = None,
    rel_gap: float = 1e-6,
    known_bound_s: float | None = None,
    restricted: bool = False,
) -> CheckmateRun:
    """Build and solve the model (``hints``: plans to start the MIP from, the first one in the
    model's class is used); ``solution`` is None when the budget is below the peak that
    any plan needs. A window that proves infeasible is widened (see :func:`window_ladder`). A
    MILP plan that overshoots the budget by solver tolerance (a few bytes) is solved again with
    a relative margin of 10^-6.

    Everything runs against ``deadline`` (default: ``time_limit_s`` from now): building the
    model and the MIP start check it, HiGHS gets the time left and polls it. When it passes
    before any model is solved, :class:`~remat.solver.deadline.Expired` is raised.
    ``on_incumbent(time_s, bound_s)`` hears of each improving MILP solution (seconds).
    ``known_bound_s``: a lower bound proven otherwise (:func:`remat.solver.bounds.best_bound`);
    HiGHS stops once its incumbent is within ``rel_gap`` of it. ``restricted``: the defaults
    of graphs over :data:`SMALL_GRAPH_NODES` nodes (lazy, windowed, backward nodes once) at
    any size, for a quick incumbent.

    When ``recompute_backward`` is left to its default and that default (off, on graphs over
    32 nodes) is proven infeasible at every window, the ladder is run again with backward
    recomputation on."""
    dl = deadline if deadline is not None else Deadline.after(time_limit_s)
    small = graph.num_nodes <= SMALL_GRAPH_NODES and not restricted
    rb = small if recompute_backward is None else recompute_backward
    rf = small if recompute_in_forward is None else recompute_in_forward
    run = _run_ladder(
        graph, budget_bytes, dl, rb, rf, window, hints, relax,
        backend, threads, on_incumbent, rel_gap, known_bound_s, restricted,
    )  # fmt: skip
    if (
        recompute_backward is None
        and not rb
        and run.solution is not None
        and run.solution.status == "infeasible"
        and dl.left_s() > 0.1
    ):
        # Backward nodes running once is a default restriction, not the user's: where the
        # whole window ladder proves it infeasible (a random layered DAG of 46 nodes at 70%),
        # widen it as the ladder widens windows, with the hints again (a DTR plan reruns
        # backward nodes).
        try:
            wide = _run_ladder(
                graph, budget_bytes, dl, True, rf, window, hints, relax,
                backend, threads, on_incumbent, rel_gap, known_bound_s, restricted,
            )  # fmt: skip
        except Expired:
            return run
        if wide.solution is not None:
            return wide
    return run


def _run_ladder(
    graph: Graph,
    budget_bytes: int,
    dl: Deadline,
    rb: bool,
    rf: bool,
    window: WindowSpec,
    hints: list[Plan] | None,
    relax: bool,
    backend: Backend,
    threads: int | None,
    on_incumbent: Callable[[float, float | None], None] | None,
    rel_gap: float,
    known_bound_s: float | None = None,
    restricted: bool = False,
) -> CheckmateRun:
    """:func:`run_checkmate` for one ``recompute_backward`` setting: the window ladder."""
    run: CheckmateRun | None = None
    ladder = window_ladder(graph, window, restricted=restricted)
    lazy = restricted or graph.num_nodes > SMALL_GRAPH_NODES
    index = MilpIndex.of(graph, recompute_backward=rb)
    for w in ladder:
        for margin in (0.0, 1e-6):
            if run is not None and dl.left_s() < 0.1:
                return run
            try:
                cm = CheckmateModel.build(
                    graph,
                    budget_bytes,
                    recompute_backward=rb,
                    recompute_in_forward=rf,
                    margin=margin,
                    lazy=lazy,
                    window=w,
                    index=index,
                    deadline=dl,
                )
            except Expired:
                if run is None:
                    raise
                return run
            if budget_bytes < cm.lower_bound_peak():
                return CheckmateRun(cm, None)
            start = None
            try:
                for h in hints or []:
                    start = start_from_plan(cm, h, deadline=dl)
                    if start is not None:
                        break
            except Expired:
                start = None  # no time to translate a start: HiGHS finds its own
            unit = cm.time_unit_s
            best_s = [math.inf]  # the incumbent's time, for the stop rule below

            def report(
                obj: float, bound: float | None, unit: float = unit, best_s: list[float] = best_s
            ) -> None:
                best_s[0] = min(best_s[0], obj * unit)
                if on_incumbent is not None:
                    on_incumbent(obj * unit, None if bound is None else bound * unit)

            def stop(best_s: list[float] = best_s) -> bool:
                # an incumbent that meets a bound proven outside the MILP is optimal too
                met = known_bound_s is not None and best_s[0] <= known_bound_s * (1 + rel_gap)
                return met or (dl.at is not None and dl.expired())

            left = dl.left_s()
            sol = cm.model.solve(
                backend=backend,
                relax=relax,
                time_limit_s=None if math.isinf(left) else max(0.1, left),
                threads=threads,
                start=start,
                on_incumbent=report,
                stop=None if dl.at is None and known_bound_s is None else stop,
                rel_gap=rel_gap,
            )
            bound = None if sol.bound is None else sol.bound * cm.time_unit_s
            run = CheckmateRun(cm, sol, None, bound)
            if sol.status == "infeasible":
                break  # widen the window
            if relax or sol.values is None:
                return run
            plan, peak, _ = replay(cm, sol.values)
            if peak <= budget_bytes:
                run.plan = plan
                return run
        else:
            assert run is not None
            return run
    assert run is not None
    return run


QUICK_NODES = 12
"""Up to this many nodes the exact model finds its first plan quickly; above, ``milp`` runs the
restricted ladder first for one (:func:`_quick_incumbent`)."""

QUICK_SHARE = 0.3
"""Share of the time left for :func:`_quick_incumbent`."""


def _quick_incumbent(
    problem: Problem,
    deadline: Deadline,
    hints: list[Plan],
    known_s: float | None,
    backend: Backend,
    threads: int | None,
) -> Plan | None:
    """A plan from the restricted ladder (lazy, windowed) on :data:`QUICK_SHARE` of the time,
    or None when it finds none in time."""
    try:
        run = run_checkmate(
            problem.graph,
            problem.budget_bytes,
            deadline=deadline.share(QUICK_SHARE),
            backend=backend,
            threads=threads,
            hints=hints,
            known_bound_s=known_s,
            restricted=True,
        )
    except Expired:
        return None
    return run.plan


class MilpOptions(SolverOptions):
    """Options of ``milp`` (``start_plans`` is a Python keyword, not an option)."""

    backend: Backend = Field("highs", description="'highs' (highspy) or 'cbc' (pulp).")
    recompute_backward: bool | None = Field(
        None, description="May backward nodes run again (default: graphs up to 32 nodes)."
    )
    recompute_in_forward: bool | None = Field(
        None, description="May forward stages recompute (default: graphs up to 32 nodes)."
    )
    window: Window = Field("auto", description="Blocks a stage may recompute ('auto', 'all', n).")
    threads: int | None = Field(None, ge=1, le=MAX_THREADS, description="MILP solver threads.")
    gap_tolerance: float = Field(
        1e-6,
        ge=0.0,
        le=1.0,
        description="Stop once the incumbent is within this relative gap of the bound.",
    )


@register(
    "milp",
    kind="dag",
    exact=True,
    summary="Checkmate's exact MILP (Jain et al. 2020)",
    options=MilpOptions,
)
def solve_milp(
    problem: Problem,
    *,
    backend: Backend = "highs",
    recompute_backward: bool | None = None,
    recompute_in_forward: bool | None = None,
    window: WindowSpec = "auto",
    threads: int | None = None,
    gap_tolerance: float = 1e-6,
    start_plans: Sequence[Plan] | None = None,
) -> SolveResult:
    """Checkmate's MILP over the op graph, solved with HiGHS (default) or CBC.

    The problem's time limit (default 60 s) bounds the MILP solver. When it stops early the
    result is ``feasible`` with the best plan found (or the best fallback plan) and the
    solver's proven lower bound in ``lower_bound_s``.

    Parameters
    ----------
    backend
        ``"highs"`` (HiGHS through highspy) or ``"cbc"`` (CBC through pulp).
    recompute_backward
        Whether backward nodes may run again (default: only for graphs up to 32 nodes).
    recompute_in_forward
        Whether stages of forward nodes may recompute (default: only for graphs up to 12
        nodes).
    window
        Which nodes a stage may recompute: those of the blocks (``remat.ir.block_key``) whose
        values the stage's node reads and of ``window`` blocks before them; ``"all"`` for any
        node; ``"auto"`` (default) tries 0, 2, 8 blocks, then all, widening only when the
        MILP proves a window infeasible (graphs up to 32 nodes: all).
    threads
        Threads for the MILP solver.
    gap_tolerance
        The MILP solver stops once its incumbent is within this relative gap of its bound
        (default 10^-6: proven optimal; ``auto`` passes its own ``gap_tolerance``).
    start_plans
        Plans to start the MIP from, fastest first (``auto`` hands over those its other
        solvers found; a Python keyword, not a service option). The first one in the
        model's class seeds HiGHS; a start plan is returned only as the MILP's incumbent.

    Notes
    -----
    The plan returned is the MILP's incumbent, one of milp's own fallback plans (eager, keep
    nothing, keep the blocks' inputs) or the stage relaxation's own schedule
    (:func:`remat.solver.bounds_stage.stage_schedule`, on graphs of up to 64 nodes), never
    another solver's plan; the message says which. ``lower_bound_s`` is the stage
    relaxation's bound (:func:`remat.solver.bounds.best_bound`, computed first on a tenth of
    the time), proven over every recompute-only schedule whose first runs follow graph order,
    recomputations in any order and any number of times. ``status="optimal"`` only when the
    plan meets it (HiGHS is stopped once its incumbent does); otherwise ``feasible``.
    HiGHS's own optimum and dual bound hold over Checkmate's class only (first runs in graph
    order, each stage's recomputations in graph order, each node at most once per stage),
    which a plan outside it can beat (a 10-node DAG at 60%: Checkmate's proven optimum
    +18.0%, the stage relaxation's schedule +14.2%): the message tells them and they are never
    claimed, nor are a restricted class's. Likewise where HiGHS proves that no schedule of its
    class fits: the stage relaxation's schedule or a fallback plan is returned where one fits,
    and otherwise the message says which class was ruled out. See the module docstring for the
    formulation.

    References
    ----------
    P. Jain et al., "Checkmate: Breaking the Memory Wall with Optimal Tensor
    Rematerialization", MLSys 2020.
    """
    t0 = time.perf_counter()
    graph, budget_bytes = problem.graph, problem.budget_bytes
    deadline = (
        Deadline(problem.deadline)
        if problem.deadline is not None
        else Deadline.after(DEFAULT_TIME_LIMIT_S)
    )
    if graph.num_nodes == 0:
        return problem.result(
            Plan(),
            solver="milp",
            started=t0,
            status="optimal",
            lower_bound_s=0.0,
        )
    fb = problem.best_of(fallback_plans(problem), solver="milp", started=t0)
    hints = list(start_plans or []) + ([fb.plan] if fb.fits and fb.plan is not None else [])
    base = problem.baseline_time_s
    exact_class = run_is_exact(graph, recompute_backward, recompute_in_forward, window)
    # a bound over every recompute-only schedule, proven apart from the MILP (cheap on the
    # graphs the stage relaxation takes): it stops HiGHS once met and backs the answer's
    # bound, the restricted class's runs included
    relaxed = (
        best_bound(graph, budget_bytes, deadline=deadline.share(RELAXATION_SHARE), lp=False)
        if graph.num_nodes <= STAGE_MAX_NODES
        else None
    )
    if relaxed is not None and relaxed.proves_infeasible:
        fits = fb.fits and fb.plan is not None
        if not fits:
            return problem.no_plan(
                solver="milp",
                started=t0,
                min_budget_bytes=fb.min_budget_bytes,
                message=f"no schedule fits the budget ({relaxed.method} relaxation: "
                f"{relaxed.detail})",
            )
    known_s = None if relaxed is None or relaxed.proves_infeasible else relaxed.time_s

    def stage_plan(share: float) -> SolveResult | None:
        """The stage relaxation's own schedule, solved on ``share`` of the time left, where it
        fits: it may leave Checkmate's class (a stage's reruns out of graph order, or twice),
        where it can beat the MILP's optimum or fit where no plan of that class does; at the
        bound's time it is optimal over every schedule."""
        if graph.num_nodes > STAGE_MAX_NODES:
            return None
        sp = stage_schedule(graph, budget_bytes, deadline=deadline.share(share))
        if sp is None:
            return None
        try:
            cand = problem.result(sp, solver="milp", started=t0, status="feasible")
        except InvalidPlanError:
            return None
        return cand if cand.fits else None

    staged = stage_plan(RELAXATION_SHARE) if known_s is not None else None
    if (
        staged is not None
        and known_s is not None
        and (staged.total_time_s or 0.0) <= known_s * (1 + 1e-6)
    ):
        return staged.model_copy(
            update={
                "status": "optimal",
                "lower_bound_s": known_s,
                "gap": 0.0,
                "message": "the stage relaxation's own schedule meets its bound: "
                "optimal over every schedule",
                "solve_time_s": time.perf_counter() - t0,
            }
        )

    def claim(res: SolveResult, message: str) -> SolveResult:
        """``res`` (a plan that fits) with the bound proven over every schedule (the
        relaxation's, capped at the plan): "optimal" only where the plan meets it."""
        t = res.total_time_s or 0.0
        lb = None if known_s is None else min(known_s, t)
        return res.model_copy(
            update={
                "status": "optimal" if lb is not None and t <= lb * (1 + 1e-6) else "feasible",
                "lower_bound_s": lb,
                "gap": None if lb is None or lb <= 0 else max(0.0, t / lb - 1),
                "message": message,
                "solve_time_s": time.perf_counter() - t0,
            }
        )

    def outside_class() -> tuple[SolveResult, str] | None:
        """The faster of the fallback plan and the stage relaxation's schedule, where they fit
        (plans outside the MILP's class; the fallback on a tie), and which it is."""
        fits = [
            (r, which)
            for r, which in ((fb, "a fallback plan"), (staged, "the stage relaxation's schedule"))
            if r is not None and r.fits and r.plan is not None
        ]
        return min(fits, key=lambda c: c[0].total_time_s or 0.0) if fits else None

    def incumbent(time_s: float, bound_s: float | None) -> None:
        if problem.on_progress is None:
            return
        lb = known_s  # HiGHS's dual bound holds over Checkmate's class only
        problem.report(
            Progress(
                solver="milp",
                phase="search",
                elapsed_s=time.perf_counter() - t0,
                time_limit_s=problem.time_limit_s,
                incumbent_overhead=time_s / base - 1 if base > 0 else 0.0,
                lower_bound_s=lb,
                gap=max(0.0, time_s / lb - 1) if lb and lb > 0 else None,
                message="MILP incumbent",
            )
        )

    quick = None
    if exact_class and graph.num_nodes > QUICK_NODES:
        # the exact model is slow to find a first plan (a 29-node DAG at 60%: none in 20 s):
        # the restricted ladder first, on a share of the time; its plan lies in the exact
        # class and seeds it, and where it meets the relaxation's bound it is the answer
        quick = _quick_incumbent(problem, deadline, hints, known_s, backend, threads)
        if quick is not None:
            hints = [quick, *hints]
    if (
        quick is not None
        and known_s is not None
        and problem.simulate(quick).total_time_s <= known_s * (1 + 1e-6)
    ):
        return problem.result(
            quick,
            solver="milp",
            started=t0,
            status="optimal",
            lower_bound_s=known_s,
            message="the restricted MILP's plan meets the relaxation's bound "
            f"({relaxed.method if relaxed else ''}): optimal over every schedule",
        )
    try:
        run = run_checkmate(
            graph,
            budget_bytes,
            # what is left after reading the solution back and judging it
            deadline=deadline.share(1.0, reserve_s=judging_s(graph.num_nodes)),
            backend=backend,
            recompute_backward=recompute_backward,
            recompute_in_forward=recompute_in_forward,
            window=window,
            threads=threads,
            hints=hints,
            on_incumbent=incumbent,
            rel_gap=max(1e-6, gap_tolerance),
            known_bound_s=known_s,
        )
    except Expired:
        if fb.fits:
            return fb.model_copy(
                update={
                    "message": "no time to build the MILP; fallback plan",
                    "solve_time_s": time.perf_counter() - t0,
                }
            )
        return problem.no_plan(
            solver="milp",
            started=t0,
            min_budget_bytes=fb.min_budget_bytes,
            status="timeout",
            message="the MILP could not be built within the time limit",
        )
    sol = run.solution
    if sol is None or sol.status == "infeasible":
        # The model's class is narrower than the stage relaxation's schedule's or a fallback's
        # (a stage's reruns in graph order, once each; restrictions): the faster one that fits,
        # the relaxation's schedule solved again on the time HiGHS left where it had none.
        if staged is None and sol is not None and deadline.left_s() > 0.5:
            staged = stage_plan(1.0)
        pick = outside_class()
        if pick is not None:
            return claim(pick[0], f"the MILP found no schedule of its class; {pick[1]}")
        w = run.model.window
        cls = "Checkmate's class" if run.model.exact else "the MILP's restricted class"
        why = (
            "the budget is below what the largest node needs"
            if sol is None
            else f"the MILP proved that no schedule of {cls} fits the budget (a stage's "
            "recomputations in graph order, once each; schedules outside it are not ruled out)"
            if w is None
            else f"the MILP proved that no schedule recomputing within {w} block(s) fits the "
            "budget (wider windows were not tried)"
        )
        return problem.no_plan(
            solver="milp",
            started=t0,
            min_budget_bytes=max(run.model.lower_bound_peak(), fb.min_budget_bytes or 0),
            message=f"{why} ({budget_bytes} bytes)",
        )
    info = f"{run.model.model.num_integer} binaries, {run.model.model.num_rows} rows"
    if known_s is not None:
        info += f"; {relaxed.method if relaxed else ''} relaxation bound {known_s:.6g} s"
    fb_time = fb.total_time_s if fb.fits else None
    exact = run.model.exact
    if not exact:
        # Restrictions are on: the solver's optimum and bound hold for the restricted class
        # only, which other plans can beat. Say so, and claim neither (the relaxation's bound,
        # proven over every schedule, still holds).
        how = "proven optimal" if sol.status == "optimal" else "best found"
        cls_bound = "-" if run.bound_s is None else f"{run.bound_s:.6g} s"
        info += f"; {how} within the restricted class (class bound {cls_bound}), not overall"

    if exact and run.bound_s is not None:
        # Checkmate's class runs a stage's recomputations in graph order, each once: a plan
        # outside it can beat its optimum (the stage relaxation's schedule on a 10-node DAG
        # at 60%: +14.2% against its proven +18.0%), so its optimum and dual bound are told,
        # never claimed
        how = "proven optimal" if sol.status == "optimal" else "dual bound"
        info += f"; {how} within Checkmate's class (class bound {run.bound_s:.6g} s)"

    if run.plan is not None:
        res = problem.result(
            run.plan,
            solver="milp",
            started=t0,
            status="feasible",
            message=f"{info}; {sol.message}" if sol.message else info,
        )
        if staged is not None and speed_key(staged) < speed_key(res):
            res = staged.model_copy(
                update={"message": f"the stage relaxation's schedule beats the MILP's ({info})"}
            )
        if res.status != "infeasible":  # the simulator's verdict stands
            res = claim(res, res.message)
        if fb_time is None or speed_key(res)[0] <= fb_time:
            return res
    # No incumbent in time, or a plan outside the model's class is faster.
    pick = outside_class()
    if pick is None:
        return problem.no_plan(
            solver="milp",
            started=t0,
            min_budget_bytes=fb.min_budget_bytes,
            status="timeout",
            message=f"the MILP found no schedule within the time limit ({info})",
        )
    return claim(pick[0], f"{pick[1]} beats the MILP's incumbent ({info})")
