"""``auto``: pick solvers by graph shape, size and time limit; return the best plan and bound.

1. The eager plan: when it fits, nothing beats it (every schedule runs every node at least
   once), so the result is ``optimal``.
2. A lower bound valid over the whole recompute-only class at any size
   (:func:`remat.solver.bounds.best_bound`: the knapsack relaxations at cuts of the step, the
   exact model's LP on small graphs), on a tenth of the time.
3. Graphs of up to :data:`MILP_MAX_NODES` nodes: fast heuristics and chain DPs, cheapest
   first (``checkpoint-all``, ``dtr`` with its two scores, Chen's greedy, ``rotor``),
   ``hierarchical`` and ``lp-round``, then the exact MILP
   (``milp``) with the time left, started from the plans found.
4. Larger graphs, where the whole-graph MILP does not fit the time: ``dtr`` with its two
   scores (under a second on 8,000 nodes), ``hierarchical``
   (blocks solved exactly, rotor's DP across them) with all the time but
   :data:`BASELINES_SHARE`, then ``rotor``, ``checkpoint-all`` and Chen's
   greedy with what is left (on a 5,000-node graph they
   take seconds each, and their plans lie in hierarchical's class); on graphs of up to
   :data:`MILP_LAST_NODES` nodes, the MILP after them with the time left, started from
   their plans.
5. With offloading (by default on a device whose profile has a host link with a host memory
   budget, as the datasheet profiles do; ``offload=False`` turns it off): the recompute-only
   methods run first with the shares they have without it; then, before the MILP, ``dtr``
   with its two scores evicting to the host inside its loop where the link hides the round
   trip (Capuchin-style, Peng et al. 2020; :data:`DTR_HOST_SHARE` of the time each), then
   :data:`OFFLOAD_SHARE` of the time for recompute-only plans (``hierarchical``, ``dtr``)
   made for larger budgets and offloaded down to this one where the link hides the copies
   (:func:`remat.solver.offload.combine`; all the time left where no MILP follows), then
   ``hierarchical`` offloading whole blocks in its DP (a quarter of the time at most), then
   ``pofo`` with what is left, all skipped when a plan is already
   within ``gap_tolerance`` of the eager time; on graphs of up to ``poet``'s default
   ``max_nodes`` (16) nodes, then ``poet`` (the exact MILP of recomputation and paging per
   value, Patil et al. 2022) with half the time left, so that on tiny graphs the answer is
   the optimum over poet's class; last, the fastest offloading plans with their prefetches
   issued earlier where the budget has room (:mod:`remat.solver.hoist`,
   :data:`HOIST_SHARE` of the time). On graphs where the MILP runs, it then has that much
   less time.

The result is the fastest plan within the budget among all of them, with the best lower bound
known: the bound of step 2, the MILP's dual bound or the LP value (given only by models
without ``milp``'s optional restrictions, i.e. graphs of up to 32 nodes by default) when it
lies below the plan found, and never less than the eager time; ``gap`` is measured against it.
``optimal`` therefore means: the eager plan fits, or the plan meets a bound proven over the
whole schedule class. With offloading the recompute-only bounds only stop the recompute-only
search early; the answer's bound is :func:`remat.solver.offload.combined_bound` (the
recompute-only bound at the budget plus what the host can hold during the step), and its
message says offloading was on. Plans that offload need an executor with a copy stream (the
op executor; ``executor="checkpoint"`` turns offloading off by default).

Early stop: after every method, when the best plan is within ``gap_tolerance`` (default 1%) of
the best proven bound (step 2's, the eager time, the LP value or a dual bound a method proved),
``auto`` returns it without running the rest (a plan of ``dtr``, which runs first, only within
a quarter of ``gap_tolerance``); the MILP itself stops at that gap. Easy graphs
therefore answer in a second or two, and the time limit is spent only where the gap is open.

When no method fits the budget, the answer is the smallest plan known for the graph (found by
any method at any budget in this process, :mod:`remat.solver.known`), after a short search below
it (:func:`remat.solver.minbudget.squeeze`, a quarter of the time limit at most), with its peak
as ``min_budget_bytes`` and the proven lower bound on any plan's peak as
``min_budget_lower_bytes``.

References
----------
See the solvers it runs: Chen et al. 2016; Herrmann et al. 2019 (rotor); Beaumont et al. 2021
(POFO); Jain et al. 2020 (Checkmate); Kirisame et al. 2021 (DTR); Peng et al. 2020
(Capuchin); Patil et al. 2022 (POET).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace

from pydantic import Field

from remat.ir import Plan, SolverBugError
from remat.ir.result import Progress, SolveResult, best_result, peak_key, speed_key
from remat.solver import known
from remat.solver.base import SolverOptions, info, register
from remat.solver.bounds import best_bound
from remat.solver.deadline import Deadline
from remat.solver.hoist import polish_prefetches
from remat.solver.milp import DEFAULT_TIME_LIMIT_S
from remat.solver.minbudget import squeeze
from remat.solver.offload import combine, combined_bound, has_host_link, offload_pass
from remat.solver.poet import DEFAULT_MAX_NODES as POET_MAX_NODES
from remat.solver.problem import Problem

MILP_MAX_NODES = 600
"""Above this many nodes the whole-graph MILP (and its LP rounding) does not fit a time limit
of a minute (its model grows as the square of the nodes: 1,259 nodes took 149 s); ``auto``
gives the time to ``hierarchical`` instead."""

MILP_LAST_NODES = 1000
"""On graphs above :data:`MILP_MAX_NODES` nodes and up to this many, the MILP still runs last
with the time the other methods left, when their best plan is not within the gap tolerance of
the bound: on graphs that are no chain (a random layered DAG of 759 nodes at 70%, where the
chain methods reach +8.8% over eager) it found +1.2% in 50 s."""

BASELINES_SHARE = 0.2
"""On graphs above :data:`MILP_MAX_NODES` nodes, the share of the time limit kept from
``hierarchical`` for ``rotor``, ``checkpoint-all`` and Chen's greedy, which run after it."""

OFFLOAD_SHARE = 0.25
"""With offloading, the share of the time limit kept for
:func:`remat.solver.offload.combine` (recompute-only plans for larger budgets, offloaded down
to the budget), which runs after the recompute-only methods; on graphs above
:data:`MILP_LAST_NODES` nodes, where no MILP follows, it has all the time left."""

DTR_HOST_SHARE = 0.15
"""With offloading, the share of the time limit for each of ``dtr``'s two scores evicting to
the host inside its loop (Capuchin-style), which run first among the offloading methods."""

DTR_NEXT_USE = "dtr/next-use"
"""``auto``'s name for its second ``dtr`` run, scored by the distance to the next read."""

DEFAULT_GAP_TOLERANCE = 0.01
"""``auto`` stops once its plan is within 1% of its best proven bound."""

_log = logging.getLogger(__name__)


class AutoOptions(SolverOptions):
    """Options of ``auto``."""

    offload: bool | None = Field(
        None,
        description="Plans that offload to the host too (default: when the graph's device "
        "has a host link with a host memory budget).",
    )
    gap_tolerance: float = Field(
        DEFAULT_GAP_TOLERANCE,
        ge=0.0,
        le=1.0,
        description="Stop once the plan is within this relative gap of the proven bound.",
    )


@register(
    "auto",
    kind="meta",
    summary="Best of heuristics, chain DPs and the MILP within time",
    options=AutoOptions,
)
def solve_auto(
    problem: Problem,
    *,
    offload: bool | None = None,
    gap_tolerance: float = DEFAULT_GAP_TOLERANCE,
) -> SolveResult:
    """Run the solvers that suit the graph within the time limit (default 60 s) and return
    the best plan found with the best lower bound known (see the module docstring).

    Each solver runs at most once, on the same problem (one eager simulation); ``milp`` starts
    from the plans the others found (``start_plans``). The result's ``solver`` is ``"auto"``;
    its message names the solver whose plan won and those tried. A sub-solver whose plan the
    simulator rejects (:class:`~remat.ir.SolverBugError`) is logged and skipped, so a valid
    graph always gets an answer.

    Parameters
    ----------
    offload
        Also make plans that offload to host memory: ``pofo`` and recompute-only plans for
        larger budgets offloaded down to this one (:func:`remat.solver.offload.combine`),
        whose copies need an executor with a copy stream. Default (None): on when the graph's
        device has a host link with a host memory budget (the datasheet profiles), off
        otherwise (the local CPU, graphs without a device). Whatever it finds, the fastest
        simulated plan wins, so offloading never makes the answer slower than the
        recompute-only one; the bound is then :func:`remat.solver.offload.combined_bound`.
    gap_tolerance
        Stop as soon as the best plan is within this relative gap of the best proven lower
        bound (``0``: run every method; ``0.01``: 1%, the default).
    """
    t0 = time.perf_counter()
    if problem.time_limit_s is None:
        problem = problem.with_time_limit(DEFAULT_TIME_LIMIT_S)
    limit = problem.time_limit_s
    assert limit is not None
    graph = problem.graph
    if offload is None:
        offload = has_host_link(graph)
    base = problem.baseline_time_s
    eager = info("none").run(problem)
    if eager.fits:
        return eager.model_copy(
            update={
                "solver": "auto",
                "status": "optimal",
                "lower_bound_s": base,
                "gap": 0.0,
                "message": "the eager schedule fits: nothing is recomputed",
                "solve_time_s": time.perf_counter() - t0,
            }
        )
    results: list[SolveResult] = [eager]
    skipped: list[str] = []

    def relay(p: Progress) -> None:
        # a sub-solver's incumbents reach the caller as auto's progress, named in the phase
        problem.report(
            p.model_copy(
                update={
                    "solver": "auto",
                    "phase": f"{p.solver}: {p.phase}",
                    "elapsed_s": time.perf_counter() - t0,
                    "time_limit_s": limit,
                }
            )
        )

    def run(name: str, time_limit_s: float, **options: object) -> None:
        sub = replace(problem.with_time_limit(time_limit_s), on_progress=relay)
        try:
            r = info(name).run(sub, **options)
        except SolverBugError as exc:
            # one broken method must not cost the caller the answer the others give
            _log.error("auto: skipping solver %r, whose plan is invalid: %s", name, exc)
            skipped.append(name)
            return
        results.append(r)
        best = best_result(results)
        fitting = best is not None and best.fits
        problem.report(
            Progress(
                solver="auto",
                phase=f"ran {name}",
                elapsed_s=time.perf_counter() - t0,
                time_limit_s=limit,
                incumbent_overhead=best.overhead if best is not None and fitting else None,
                incumbent_peak_bytes=best.peak_bytes if best is not None and fitting else None,
                message=f"best so far from {best.solver}" if best is not None and fitting else None,
            )
        )

    # the lower bound first, on a small share: it is cheap at any size (the LP only on small
    # graphs) and valid whatever the recompute-only methods below find (with offloading it
    # only stops their search early; the answer's bound is the combined one, at the end)
    bound = best_bound(graph, problem.budget_bytes, deadline=Deadline(problem.deadline).share(0.1))
    proven = [bound.time_s]

    def close_enough() -> bool:
        best = best_result(results)
        if best is None or not best.fits or best.figures is None:
            return False
        lb = _bound(results, base, proven, below=best.figures.total_time_s)
        # a dtr plan stops the search only within a quarter of the tolerance: dtr runs first
        # because it is cheap, and on the transformers the methods after it come closer
        # (synth192 at 70%: +1.0% for dtr, +0.6% for hierarchical, against a bound of +0.6%)
        tolerance = gap_tolerance / 4 if best.solver == "dtr" else gap_tolerance
        return best.figures.total_time_s <= lb * (1 + tolerance)

    exact_fits = graph.num_nodes <= MILP_MAX_NODES
    # dtr (both scores) first at every size: under a second on 8,000 nodes, and on graphs
    # that are no chain (random layered DAGs, U-Nets) far better than the chain methods
    dtrs = ["dtr", DTR_NEXT_USE]
    if exact_fits:
        quick = [
            "checkpoint-all", *dtrs, "chen-greedy", "rotor", "hierarchical", "lp-round"
        ]  # fmt: skip
    else:
        # the whole-graph MILP does not fit the time: hierarchical first with most of it
        # (blocks solved exactly, rotor's DP across them: rotor's class on the chain's own
        # stages); rotor and the baselines, which take seconds each on such graphs and
        # whose plans lie in its class, with what is left (on a loaded machine rotor first
        # left hierarchical too little to finish one block size)
        quick = [*dtrs, "hierarchical", "rotor", "checkpoint-all", "chen-greedy"]
    stopped = False
    for name in quick:
        if close_enough():
            stopped = True
            break
        if problem.time_left_s() <= 0 and len(results) > 1:
            break
        share = max(0.1, min(problem.time_left_s(), 0.25 * limit))
        if name == "hierarchical":
            if not exact_fits:
                share = max(0.1, problem.time_left_s() - BASELINES_SHARE * limit)
            # it keeps rotor's plan when it is faster (none yet on large graphs), and stops
            # trying block sizes once a plan is within a quarter of the
            # gap tolerance of the bound (its later block sizes are cheap where the first
            # was quick: the budgets near eager)
            run(
                name,
                share,
                start_plans=_plans(results, fitting_only=False, only="rotor"),
                good_enough_s=_bound(results, base, proven) * (1 + gap_tolerance / 4),
                offload=False,  # a recompute-only method here: offloading is its own step
            )
        elif name == DTR_NEXT_USE:
            run("dtr", share, heuristic="next-use", offload=False)
        elif name == "dtr":
            # offloading on top of dtr's plans is auto's own step below (combine)
            run("dtr", share, offload=False)
        else:
            run(name, share)
    stopped = stopped or close_enough()
    if offload and problem.time_left_s() > 0.1 and not _near_eager(results, base, gap_tolerance):
        # dtr evicting to the host inside its loop first (seconds on 8,000 nodes; its own
        # combination is off: the one below is auto's), with both scores: on a random
        # layered DAG of 759 nodes at 30% the paper's gave +90.0% and next-use +25.1%
        for heuristic in ("dtr", "next-use"):
            if problem.time_left_s() <= 0.1 or _near_eager(results, base, gap_tolerance):
                break
            run("dtr", max(0.1, min(problem.time_left_s(), DTR_HOST_SHARE * limit)),
                offload=True, combine=False, heuristic=heuristic)  # fmt: skip
        # its share, or all the time left where no MILP runs after it but the polish's
        # (on dag1000 at 30% the combination took all of it, and the answer was +13.0% where
        # the polished dtr plan is +1.6%)
        left = problem.time_left_s()
        share = (
            left - HOIST_SHARE * limit
            if graph.num_nodes > MILP_LAST_NODES
            else min(left, OFFLOAD_SHARE * limit)
        )
        near = _near_eager(results, base, gap_tolerance)
        if not near:
            _combine(problem, results, max(0.1, share))
        # then hierarchical with whole blocks offloaded in its DP and its own plans for larger
        # budgets offloaded down (from one table, cheaper than the combination's solves): on
        # the 7B Llama bf16 step (60 s) +7.4% / +13.1% at 30% / 15%, where the combination alone
        # gave +7.9% / +13.9%. pofo last: its plans lost to the combination on every model of
        # benchmarks/offload.py, and before it, it took the time the combination needs (7B
        # Llama at 10%: +29.8% with pofo first, +17.1% without); its own combination is off.
        # Both keep rotor's plan when faster (rotor's is handed over).
        for name, opts in (("hierarchical", {"offload": True}), ("pofo", {"combine": False})):
            if near or problem.time_left_s() <= 0.1:
                break
            run(
                name,
                max(0.1, min(problem.time_left_s(), 0.25 * limit)),
                start_plans=_plans(results, fitting_only=False, only="rotor"),
                **opts,
            )
        if graph.num_nodes <= POET_MAX_NODES and problem.time_left_s() > 0.1:
            # the exact MILP of recomputation and paging on tiny graphs (seconds at 16
            # nodes): the combined answer is then the optimum over poet's class, whose plans
            # include Checkmate's; half the time left, the rest for the milp after it
            run("poet", max(0.1, 0.5 * problem.time_left_s()), offload=True)
        if problem.time_left_s() > 0.1 and not _near_eager(results, base, gap_tolerance):
            _hoist(problem, results, max(0.1, min(problem.time_left_s(), HOIST_SHARE * limit)))
    if not stopped and graph.num_nodes <= MILP_LAST_NODES and problem.time_left_s() > 0.2:
        run(
            "milp",
            max(0.1, problem.time_left_s()),
            start_plans=_plans(results),
            gap_tolerance=gap_tolerance,
        )
    tried = ", ".join(r.solver for r in results)
    if skipped:
        tried += f"; skipped {', '.join(skipped)} (invalid plan, logged)"
    device = graph.device.name if graph.device is not None else "no device"
    how = (
        f"; offloading on (the host link of {device}; offload=False turns it off)"
        if offload
        else "; recompute only"
    )
    best = _plain_on_a_tie(results)
    assert best is not None
    if not best.fits:
        return _smallest_known(problem, results, t0, limit, tried + how, offload=offload)
    assert best.plan is not None and best.figures is not None
    best_time = best.figures.total_time_s
    if offload:
        # the recompute-only bounds do not hold for plans that offload: the combined one does
        combined = combined_bound(
            graph,
            problem.budget_bytes,
            upper_s=best_time,
            deadline=Deadline.after(max(0.1, min(problem.time_left_s(), 0.05 * limit))),
        )
        lb = max(base, min(combined, best_time))
    else:
        lb = _bound(results, base, proven, below=best_time)
    is_optimal = best_time <= lb * (1 + 1e-9)
    gap = max(0.0, best_time / lb - 1) if lb > 0 else None
    early = " (within gap_tolerance of its bound: stopped early)" if stopped else ""
    return best.model_copy(
        update={
            "solver": "auto",
            "status": "optimal" if is_optimal else "feasible",
            "lower_bound_s": lb,
            "gap": gap,
            "message": f"best plan from {best.solver}; tried {tried}{early}{how}",
            "solve_time_s": time.perf_counter() - t0,
        }
    )


def _plain_on_a_tie(results: list[SolveResult]) -> SolveResult | None:
    """:func:`best_result`, except that a plan that moves nothing to the host wins over one that
    does when it is as fast: the copies would buy nothing (on a U-Net of 298 nodes at 30%, a
    recompute-only plan offloaded down from a larger budget tied with dtr's at +11.5% and won
    on its smaller peak)."""
    best = best_result(results)
    if best is None or not best.fits or not best.offload_bytes:
        return best
    plain = [r for r in results if r.fits and not r.offload_bytes]
    if not plain:
        return best
    fastest = min(plain, key=speed_key)
    t, t_best = fastest.total_time_s, best.total_time_s
    return fastest if t is not None and t_best is not None and t <= t_best * (1 + 1e-9) else best


def _near_eager(results: list[SolveResult], base: float, gap_tolerance: float) -> bool:
    """The best plan is within ``gap_tolerance`` of the eager time, the bound every plan obeys,
    offloading or not: nothing is left for offloading to win."""
    best = best_result(results)
    t = best.total_time_s if best is not None and best.fits else None
    return t is not None and t <= base * (1 + gap_tolerance)


HOISTED = "+hoisted"
"""The suffix ``auto`` gives plans whose prefetches :func:`_hoist` issued earlier."""

HOIST_SHARE = 0.1
"""With offloading, the share of the time limit for :func:`_hoist`."""

HOIST_PLANS = 3
"""How many of the fastest offloading plans :func:`_hoist` polishes."""


def _hoist(problem: Problem, results: list[SolveResult], time_s: float) -> None:
    """The fastest :data:`HOIST_PLANS` plans that offload and fit, with their prefetches issued
    earlier where the budget has room (:func:`remat.solver.hoist.polish_prefetches`), added to
    ``results`` when faster."""
    t0 = time.perf_counter()
    deadline = Deadline.after(time_s)
    moving = [
        r
        for r in results
        if r.fits and r.plan is not None and any(s.op == "prefetch" for s in r.plan.steps)
    ]
    for r in sorted(moving, key=speed_key)[:HOIST_PLANS]:
        if deadline.expired():
            break
        assert r.plan is not None and r.figures is not None
        plan, sim = polish_prefetches(
            problem.graph, r.plan, budget_bytes=problem.budget_bytes, deadline=deadline
        )
        if plan is not r.plan and sim.total_time_s < r.figures.total_time_s:
            results.append(problem.result(plan, solver=f"{r.solver}{HOISTED}", started=t0))


COMBINED = "recompute+offload"
"""The name ``auto`` gives plans of :func:`remat.solver.offload.combine`."""


def _combine(problem: Problem, results: list[SolveResult], time_s: float) -> None:
    """Recompute-only plans (``hierarchical``, ``dtr``) for larger budgets, offloaded down to
    the budget (:func:`remat.solver.offload.combine`), added to ``results``."""
    t0 = time.perf_counter()
    deadline = Deadline.after(time_s)
    # hierarchical is skipped at budgets no larger than one where it found no plan (its class
    # has a floor: rotor's smallest schedule of the chain), and once dtr's plans were faster
    # at two budgets while its own never were: each call costs time (1.2 s on a random
    # layered DAG of 759 nodes, where it lost at every budget and combine's search calls it a
    # dozen times), which dtr's sub-second plans need
    hierarchical_missed = [-1]
    hierarchical_record = {"won": 0, "lost": 0}

    def plan_at(budget_bytes: int, dl: Deadline) -> Plan | None:
        found: list[SolveResult] = []
        # dtr first on a small share (it takes under a second on 8,000 nodes), with both
        # scores (near the recompute-only floor next-use's plans recompute far less: a random
        # layered DAG of 759 nodes, 30% plus a tenth of the link's reach: +33.6% against
        # +77.7%), hierarchical with the rest: on short limits it falls back to rotor's plan,
        # which on a 70B Llama step did not fit at all where 4 s gave +2.0%
        for name, opts, part in (
            ("dtr", {"offload": False}, 0.25),
            ("dtr", {"offload": False, "heuristic": "next-use"}, 0.25),
            ("hierarchical", {"offload": False}, 1.0),
        ):
            left = dl.left_s()
            if left <= 0:
                break
            if name == "hierarchical" and (
                budget_bytes <= hierarchical_missed[0]
                or (hierarchical_record["lost"] >= 2 and not hierarchical_record["won"])
            ):
                continue
            # at another budget: its incumbents are not auto's, so they are not relayed
            sub = replace(
                problem.with_budget(budget_bytes).with_time_limit(max(0.1, part * left)),
                on_progress=None,
            )
            try:
                found.append(info(name).run(sub, **opts))
            except SolverBugError as exc:
                _log.error("auto: skipping solver %r, whose plan is invalid: %s", name, exc)
                continue
        best = best_result(found)
        if len(found) == 3:  # hierarchical ran, after both dtr scores
            h = found[-1]
            if not h.fits:
                hierarchical_missed[0] = max(hierarchical_missed[0], budget_bytes)
            hierarchical_record["won" if best is h else "lost"] += 1
        return best.plan if best is not None and best.fits else None

    for plan in combine(problem, plan_at, deadline=deadline):
        results.append(problem.result(plan, solver=COMBINED, started=t0))


def _bound(
    results: list[SolveResult], base: float, proven: list[float], *, below: float = math.inf
) -> float:
    """The best proven lower bound on the time of any plan within the budget: the eager time,
    the whole-class bounds in ``proven`` and the bounds the methods proved. A bound above
    ``below`` (the plan's time) is of a narrower class than that plan's: the methods' are left
    out, the whole-class ones are capped at it."""
    return max(
        [base]
        + [min(p, below) for p in proven]
        + [
            r.lower_bound_s
            for r in results
            if r.lower_bound_s is not None and r.lower_bound_s <= below * (1 + 1e-9)
        ]
    )


def _smallest_known(
    problem: Problem,
    results: list[SolveResult],
    t0: float,
    limit: float,
    tried: str,
    *,
    offload: bool = False,
) -> SolveResult:
    """No method fits: the smallest plan known for the graph, after a short search below it;
    with ``offload``, that plan offloaded down to the budget when the link can take it there
    (then it fits, and is the answer)."""
    graph = problem.graph
    share = min(max(0.0, problem.time_left_s()), 0.25 * limit)
    if share > 0.2:
        squeeze(graph, problem.budget_bytes, time_limit_s=share)
    low = known.smallest(graph, offload=offload)
    best = best_result(results)
    assert best is not None
    if low is not None and (best.peak_bytes is None or low.peak_bytes < best.peak_bytes):
        best = problem.result(low.plan, solver=low.solver, started=t0)
        if best.fits:
            # the search below, or an earlier solve of this graph, found one within the budget
            return best.model_copy(
                update={
                    "solver": "auto",
                    "status": "feasible",
                    "lower_bound_s": None,
                    "message": f"no method fit the budget in its time; the smallest plan known "
                    f"for the graph, from {low.solver}, fits it (tried {tried})",
                    "solve_time_s": time.perf_counter() - t0,
                }
            )
    if offload and best.plan is not None:
        # at least a twentieth of the limit, past it if need be (within the tolerance every
        # solver has): the search before may have spent all of it
        plan, _ = offload_pass(
            graph,
            best.plan,
            target_bytes=problem.budget_bytes,
            deadline=Deadline.after(max(0.05 * limit, min(problem.time_left_s(), 0.1 * limit))),
        )
        moved = problem.result(plan, solver=f"{best.solver}+offload", started=t0)
        if moved.fits:
            return moved.model_copy(
                update={
                    "solver": "auto",
                    "lower_bound_s": None,
                    "message": f"no recompute-only plan fits; the smallest known, from "
                    f"{best.solver}, offloaded to the host (tried {tried})",
                    "solve_time_s": time.perf_counter() - t0,
                }
            )
        if peak_key(moved) < peak_key(best):
            best = moved
    lower = known.min_budget_lower_bytes(graph)
    return best.model_copy(
        update={
            "solver": "auto",
            "status": "infeasible",
            "min_budget_bytes": best.peak_bytes,
            "min_budget_lower_bytes": lower,
            "message": f"no method fits the budget; smallest plan known from {best.solver} "
            f"(tried {tried}); no plan can peak below {lower} bytes",
            "solve_time_s": time.perf_counter() - t0,
        }
    )


def _plans(
    results: list[SolveResult], *, fitting_only: bool = True, only: str | None = None
) -> list[Plan]:
    """The plans of ``results``, fastest first (those within the budget only, by default)."""
    chosen = [
        r
        for r in results
        if r.plan is not None
        and (r.fits or not fitting_only)
        and (only is None or r.solver == only)
    ]
    return [r.plan for r in sorted(chosen, key=speed_key) if r.plan is not None]
