"""``poet``: one exact MILP deciding, per value, recomputation *and* paging to host memory.

The integrated rematerialization-and-paging formulation of POET (Patil et al. 2022) over
Checkmate's stages (:mod:`remat.solver.milp`): stage ``t`` may recompute earlier nodes, then
computes node ``t`` for the first time; at the boundary before each stage, values may be
offloaded to the host (POET's page-out ``M_out``) and prefetched back (page-in ``M_in``).
POET's ``S_RAM`` / ``S_SSD`` are ``K`` (on the device, ``S = K - O + P`` readable) and the
offload issued earlier (the host copy, kept until the end). The model is in
:mod:`remat.solver.poet_model`; where POET sums the copies' time into the runtime of a device
without copy engines, here the link has a copy stream per direction beside the compute stream,
as the simulator (:mod:`remat.ir.simulate`) models it:

* each direction runs its copies in plan order, each taking the link's latency plus its size
  over that direction's bandwidth: ``X[t]`` / ``Y[t]``, the stream free after boundary ``t``,
  is at least the stream before plus the boundary's copies, and at least the end of the stage
  that last computed an offloaded value (or the end of the offload of a prefetched one) plus
  the boundary's copies;
* an offloaded value holds its device bytes until its copy is done: it counts as held (not
  readable) until ``L`` releases it, allowed before stage ``u`` only if the copy ends by the
  stall-free compute time before ``u`` (the simulator's compute clock is never earlier, so the
  release has happened there too);
* a prefetched value occupies the device from the boundary where it is issued; the stage
  after that boundary starts only once the host-to-device stream is done (the stall);
* the host copies stay within the link's ``host_memory_bytes``;
* the objective is the step's end: the last of the three streams, i.e. compute time plus
  stalls (plus a copy that outlasts the compute), with a tiny cost per copy as a tie-break.

Every time in the model is at least the simulator's for the plan read back (the streams' times
are the least solution of these inequalities), and every byte counted at least as long; the
plan is simulated and the simulator's figures are reported, within the budget or not returned.

Class (what the optimum is over): Checkmate's (first runs in graph order, each stage's
recomputations in graph order, each node at most once per stage), plus at most one offload and
one prefetch per value, issued at stage boundaries, an offloaded value not recomputed while its
copy is in flight, a host copy kept to the end, releases seen only at stage boundaries. Without
a host link in the graph's device profile (or ``offload=False``), it is Checkmate's MILP.

References
----------
S. G. Patil, P. Jain, P. Dutta, I. Stoica, J. E. Gonzalez. "POET: Training Neural Networks on
Tiny Devices with Integrated Rematerialization and Paging." ICML 2022.

P. Jain et al. "Checkmate: Breaking the Memory Wall with Optimal Tensor Rematerialization."
MLSys 2020.
"""

from __future__ import annotations

import time

from pydantic import Field

from remat.ir import GraphTooLargeError, InvalidPlanError, Plan, simulate
from remat.ir.result import SolveResult
from remat.solver._mip import Backend
from remat.solver.base import SolverOptions, register
from remat.solver.bounds import best_bound
from remat.solver.deadline import Deadline
from remat.solver.milp import MAX_THREADS, fallback_plans
from remat.solver.offload import combined_bound, has_host_link
from remat.solver.poet_model import build, read_plan
from remat.solver.problem import Problem

DEFAULT_MAX_NODES = 16
"""Graphs up to this many nodes are solved by default (the model has O(n^2) binaries per
value: about 1,500 at 16 nodes, solved in seconds)."""

MAX_NODES_LIMIT = 40
DEFAULT_TIME_LIMIT_S = 60.0


class PoetOptions(SolverOptions):
    """Options of ``poet``."""

    offload: bool | None = Field(
        None,
        description="Decide paging too (default: when the device profile has a host link with a "
        "host memory budget, as for auto and dtr).",
    )
    max_nodes: int = Field(
        DEFAULT_MAX_NODES,
        ge=1,
        le=MAX_NODES_LIMIT,
        description="Largest graph to solve; larger ones are refused.",
    )
    backend: Backend = Field("highs", description="'highs' (highspy) or 'cbc' (pulp).")
    threads: int | None = Field(None, ge=1, le=MAX_THREADS, description="MILP solver threads.")


@register(
    "poet",
    kind="dag",
    exact=True,
    summary="Recompute and offload per value, one MILP (POET, Patil et al. 2022)",
    options=PoetOptions,
)
def solve_poet(
    problem: Problem,
    *,
    offload: bool | None = None,
    max_nodes: int = DEFAULT_MAX_NODES,
    backend: Backend = "highs",
    threads: int | None = None,
) -> SolveResult:
    """POET's MILP of recomputation and paging per value, on HiGHS (default) or CBC.

    The problem's time limit (default 60 s) bounds the MILP solver; stopped early, the result
    is the best plan found (or one of milp's fallback plans), ``feasible``.

    Parameters
    ----------
    offload
        Whether values may go to the host (default: when the graph's device profile has a host
        link; without one the model is Checkmate's, recompute only).
    max_nodes
        Largest graph solved (default 16, at most 40); a larger one raises
        :class:`~remat.ir.errors.GraphTooLargeError`.
    backend
        ``"highs"`` (HiGHS through highspy) or ``"cbc"`` (CBC through pulp).
    threads
        Threads for the MILP solver.

    Notes
    -----
    ``status="optimal"`` only when the simulated time meets a proven lower bound (the combined
    bound of :func:`remat.solver.offload.combined_bound` with offloading, else
    :func:`remat.solver.bounds.best_bound`): the MILP's own optimum is over its class with
    copies timed no earlier than the simulator times them, not a bound over every plan. The
    message gives the MILP's status and its model time beside the simulated one.

    Raises
    ------
    GraphTooLargeError
        When the graph has more than ``max_nodes`` nodes (a 422 from the service).

    References
    ----------
    S. G. Patil et al., "POET: Training Neural Networks on Tiny Devices with Integrated
    Rematerialization and Paging", ICML 2022.
    """
    t0 = time.perf_counter()
    graph, budget = problem.graph, problem.budget_bytes
    if graph.num_nodes > max_nodes:
        raise GraphTooLargeError(
            f"poet: the graph has {graph.num_nodes} nodes, over max_nodes={max_nodes} "
            f"(raise the option max_nodes, up to {MAX_NODES_LIMIT}, or use milp)",
            solver="poet",
            option="max_nodes",
        )
    deadline = (
        Deadline(problem.deadline)
        if problem.deadline is not None
        else Deadline.after(DEFAULT_TIME_LIMIT_S)
    )
    if graph.num_nodes == 0:
        return problem.result(Plan(), solver="poet", started=t0, status="optimal",
                              lower_bound_s=0.0)  # fmt: skip
    paging = has_host_link(graph) if offload is None else offload
    fb = problem.best_of(fallback_plans(problem), solver="poet", started=t0)
    plan: Plan | None = None
    info = ""
    for margin in (0.0, 1e-6):
        pm = build(graph, budget, offload=paging, margin=margin)
        left = deadline.left_s()
        sol = pm.model.solve(
            backend=backend, time_limit_s=max(0.1, left), threads=threads, rel_gap=1e-6
        )
        info = f"{pm.model.num_integer} binaries, {pm.model.num_rows} rows; MILP {sol.status}"
        if sol.objective is not None:
            info += f", model time {sol.objective * pm.time_unit_s:.6g} s"
        if sol.values is None:
            break
        candidate = read_plan(pm, sol.values)
        try:
            sim = simulate(graph, candidate)
        except InvalidPlanError as exc:  # the model's bug: never returned, said
            info += f"; its plan is invalid ({exc})"
            break
        host = graph.link.host_memory_bytes
        if sim.peak_bytes <= budget and (host is None or sim.host_peak_bytes <= host):
            plan = candidate
            break
        if deadline.left_s() < 0.1:
            break
    if plan is None:
        if fb.fits:
            return fb.model_copy(update={"message": f"fallback plan ({info})",
                                         "solve_time_s": time.perf_counter() - t0})  # fmt: skip
        return problem.no_plan(
            solver="poet",
            started=t0,
            min_budget_bytes=fb.min_budget_bytes,
            status="infeasible" if "infeasible" in info else "timeout",
            message=f"no plan within the budget ({info})",
        )
    res = problem.result(plan, solver="poet", started=t0)
    if fb.fits and (fb.total_time_s or 0.0) < (res.total_time_s or 0.0):
        res, info = fb, f"a fallback plan beats the MILP's ({info})"
    t = res.total_time_s or 0.0
    sub = deadline.share(0.5)
    bound = (
        combined_bound(graph, budget, upper_s=t, deadline=sub)
        if paging
        else best_bound(graph, budget, deadline=sub, lp=False).time_s
    )
    bound = min(bound, t)
    moved = res.figures.offload_bytes if res.figures is not None else 0
    return res.model_copy(
        update={
            "status": "optimal" if t <= bound * (1 + 1e-6) else "feasible",
            "lower_bound_s": bound,
            "gap": max(0.0, t / bound - 1) if bound > 0 else None,
            "message": f"{info}; simulated {t:.6g} s, {moved} bytes offloaded",
            "solve_time_s": time.perf_counter() - t0,
        }
    )
