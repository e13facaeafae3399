"""Offloading on top of any plan: the gaps where a value could wait on the host, the post-pass
that moves values there while the simulator shows no added time, the baselines people use
without a planner, and a lower bound for plans that offload.

The key fact: a value saved in the forward pass and read again only in the backward pass sits
idle on the device for most of the step; copying it to the host after its last forward read
and back before its first backward read costs nothing while the host link is idle. The
post-pass (:func:`offload_pass`) takes a plan, finds for each value its longest idle gap
(:func:`value_gaps`), and, at the plan's peak, offloads the largest values whose gap hides the
round trip, keeping only batches the simulator shows add no time (Capuchin's rule of swapping
where the transfer hides under compute, applied to a fixed plan; Peng et al. 2020). Applied to
a recompute-only plan made for a *larger* budget, it trades recomputation for copies
(:func:`combine`, used by ``auto``).

References
----------
X. Peng, X. Shi, H. Dai, H. Jin, W. Ma, Q. Xiong, F. Yang, X. Qian. "Capuchin: Tensor-based GPU
Memory Management for Deep Learning." ASPLOS 2020.

O. Beaumont, L. Eyraud-Dubois, A. Shilova. "Efficient Combination of Rematerialization and
Offloading for Training DNNs." NeurIPS 2021.

J. Ren, S. Rajbhandari, R. Y. Aminabadi, O. Ruwase, S. Yang, M. Zhang, D. Li, Y. He.
"ZeRO-Offload: Democratizing Billion-Scale Model Training." USENIX ATC 2021 (DeepSpeed's CPU
activation checkpointing).
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from remat.ir import Graph, Plan, Simulation, block_cuts, keep_plan, simulate
from remat.ir.device_profile import HostLink
from remat.ir.plan import Step, step_maker
from remat.ir.result import SolveResult
from remat.solver.base import NoOptions, register
from remat.solver.bounds import best_bound, closure_bounds, cut_bounds
from remat.solver.deadline import Deadline
from remat.solver.problem import Problem

MAX_MISSES = 4
"""The post-pass stops after this many values in a row, each tried alone, added time: the link
is then saturated where the peak is (each try costs a simulation)."""

PREFETCH_LEAD = 2.0
"""A prefetch is issued this many times its own copy time (latency included) of compute ahead
of the read that needs it: the slack covers prefetches queued before it on the same stream."""


@dataclass(frozen=True)
class Gap:
    """The longest stretch of a plan in which a value stays on the device unread.

    ``after`` is the index of the step (its producing compute or a read) after which it could
    be offloaded, ``before`` the index of the compute that reads it next, before which it must
    be back; ``span_s`` the compute time of the steps strictly between."""

    value: str
    after: int
    before: int
    size_bytes: int
    span_s: float

    def covers(self, step: int) -> bool:
        """Whether the value could be off the device during step ``step`` of the plan."""
        return self.after < step < self.before


def round_trip_s(link: HostLink, size_bytes: int) -> float:
    """Time of one offload and one prefetch of ``size_bytes`` on ``link``, latency included."""
    return (
        2 * link.latency_s
        + size_bytes / link.device_to_host_bytes_per_s
        + size_bytes / link.host_to_device_bytes_per_s
    )


def _compute_clock(graph: Graph, plan: Plan) -> list[float]:
    """``clock[i]``: the compute time of the plan's steps before step ``i`` (one entry more
    than the steps)."""
    node = graph.node_map()
    clock = [0.0]
    for s in plan.steps:
        clock.append(clock[-1] + (node[s.id].time_s if s.op == "compute" else 0.0))
    return clock


def value_gaps(graph: Graph, plan: Plan) -> list[Gap]:
    """Each offloadable value's longest gap in ``plan`` (see :class:`Gap`), by compute time.

    Offloadable: produced by the step (not static, not an input the caller holds) and never
    moved by ``plan`` already. A gap never spans a compute of the value's producer (a
    recomputation would write the value while it is on the host) nor a ``free`` of it.
    """
    node = graph.node_map()
    static = graph.static_ids()
    size = graph.size_map()
    inputs = {v.id for v in graph.values if v.kind == "input"}
    clock = _compute_clock(graph, plan)
    moved = {s.id for s in plan.steps if s.op in ("offload", "prefetch")}
    last: dict[str, int] = {}
    best: dict[str, Gap] = {}
    for i, s in enumerate(plan.steps):
        if s.op == "compute":
            n = node[s.id]
            for x in n.inputs:
                j = last.get(x)
                if j is not None:
                    span = clock[i] - clock[j + 1]
                    g = best.get(x)
                    if i > j + 1 and (g is None or span > g.span_s):
                        best[x] = Gap(x, j, i, size[x], span)
                    last[x] = i
            for o in n.outputs:
                if o not in static and o not in inputs:
                    last[o] = i
        elif s.op == "free":
            last.pop(s.id, None)
    return [g for v, g in best.items() if v not in moved]


def with_offloads(
    graph: Graph, plan: Plan, gaps: Iterable[Gap], *, lead: float = PREFETCH_LEAD
) -> tuple[Plan, list[int]]:
    """``plan`` with each gap's value offloaded after ``gap.after`` and prefetched ahead of
    ``gap.before`` by ``lead`` times its copy time of compute (never before its offload).

    Returns the plan and, per step of it, the index of the step of ``plan`` it stands at (an
    inserted copy: the step it was inserted next to)."""
    link = graph.link
    make = step_maker(graph)
    clock = _compute_clock(graph, plan)
    after: dict[int, list[Step]] = {}
    before: dict[int, list[Step]] = {}
    for g in sorted(gaps, key=lambda g: (g.after, g.value)):
        after.setdefault(g.after, []).append(make("offload", g.value))
        need = lead * link.prefetch_s(g.size_bytes)
        # the latest step p with at least `need` of compute from p up to the read
        p = bisect.bisect_right(clock, clock[g.before] - need) - 1
        p = min(max(p, g.after + 1), g.before)
        before.setdefault(p, []).append(make("prefetch", g.value))
    steps: list[Step] = []
    origin: list[int] = []
    for i, s in enumerate(plan.steps):
        for x in before.get(i, ()):
            steps.append(x)
            origin.append(i)
        steps.append(s)
        origin.append(i)
        for x in after.get(i, ()):
            steps.append(x)
            origin.append(i)
    return Plan(steps=tuple(steps)), origin


def _fits_host(graph: Graph, sim: Simulation) -> bool:
    budget = graph.link.host_memory_bytes
    return budget is None or sim.host_peak_bytes <= budget


def offload_pass(
    graph: Graph,
    plan: Plan,
    *,
    target_bytes: int | None = None,
    max_time_s: float | None = None,
    deadline: Deadline | None = None,
    sim: Simulation | None = None,
) -> tuple[Plan, Simulation]:
    """Offload values of ``plan`` while the simulator shows no added time (see the module
    docstring), until its peak is at most ``target_bytes`` (None: as low as it goes).

    At the peak step, the values whose gap covers it and hides their round trip on the host
    link are taken largest first, as many as the peak is over the target; a batch is kept when
    the simulated time stays within ``max_time_s`` (default: the plan's own time: no added
    stall) and the host peak within the link's host budget, else halved (a single value that
    adds time is dropped). Among values of one size, the one whose gap starts first goes
    first (its copy is done soonest). Ends when the target is met, no value covers the peak,
    after :data:`MAX_MISSES` values in a row are dropped, or at ``deadline``.

    Returns the plan and its simulation (``plan`` itself when nothing was offloaded).
    """
    base = sim if sim is not None else simulate(graph, plan)
    allowed = (base.total_time_s if max_time_s is None else max_time_s) * (1 + 1e-9) + 1e-12
    link = graph.link
    target = -1 if target_bytes is None else target_bytes
    gaps = [g for g in value_gaps(graph, plan) if g.span_s >= round_trip_s(link, g.size_bytes)]
    chosen: list[Gap] = []
    dropped: set[str] = set()
    best_plan, best_sim, origin = plan, base, list(range(len(plan.steps)))
    misses = 0
    while best_sim.peak_bytes > target and best_sim.peak_step >= 0 and misses < MAX_MISSES:
        if deadline is not None and deadline.expired():
            break
        at = origin[best_sim.peak_step]
        taken = {g.value for g in chosen} | dropped
        cover = sorted(
            (g for g in gaps if g.value not in taken and g.covers(at)),
            key=lambda g: (-g.size_bytes, g.after, g.value),
        )
        if not cover:
            break
        need = best_sim.peak_bytes - target if target >= 0 else math.inf
        k, got = 0, 0
        while k < len(cover) and got < need:
            got += cover[k].size_bytes
            k += 1
        batch = cover[:k]
        while batch:
            p, o = with_offloads(graph, plan, [*chosen, *batch])
            s = simulate(graph, p)
            if (
                s.total_time_s <= allowed
                and _fits_host(graph, s)
                and s.peak_bytes <= best_sim.peak_bytes
            ):
                chosen += batch
                best_plan, best_sim, origin = p, s, o
                misses = 0
                break
            if len(batch) == 1:
                dropped.add(batch[0].value)
                misses += 1
                break
            batch = batch[: len(batch) // 2]
            if deadline is not None and deadline.expired():
                break
    return best_plan, best_sim


LINK_REACH = (1.0, 0.8, 0.6, 1.25, 0.4, 0.2)
"""The shares of the link's reach (the bytes it moves device to host during the forward pass)
:func:`combine` tries as the memory offloading takes off, the likeliest first."""

REFINE_POINTS = 24
"""After the shares of :data:`LINK_REACH`, :func:`combine` tries this many extras evenly
spaced below the smallest that missed the budget (above the largest that reached it, if
any), largest first; a plan no faster than the fastest that reached the budget is not
offloaded (the post-pass adds no time, so it cannot win). Then it bisects between the fastest
one's extra and the miss above it (:data:`REFINE_STEPS`). Near the recompute-only floor the
post-pass takes off far less than a fifth of the reach: on a random layered DAG of 254 nodes
at 40% (A100 link) every share missed with DTR's next-use plans, and the grid found +23.7%
over eager (DTR evicting to the host: +29.7% and +48.1% with its two scores). What the
post-pass takes off varies from one plan to the next, so a bisection alone stalls where a
grid does not."""

REFINE_STEPS = 3
"""Bisection steps of :func:`combine` after its grid (see :data:`REFINE_POINTS`)."""


def has_host_link(graph: Graph) -> bool:
    """Whether the graph's device profile states a host link with a host memory budget: the
    rule the solvers that offload (``auto``, ``dtr``, ``hierarchical``, ``poet``) do so by
    default on (the local CPU's profile has no link)."""
    return graph.device is not None and graph.device.can_offload


def link_reach_bytes(graph: Graph) -> int:
    """Bytes the device-to-host link moves during the forward pass's compute time (capped by
    the host budget): about what offloading can take off a peak at the start of the backward
    pass without delaying it."""
    link = graph.link
    fwd = sum(n.time_s for n in graph.nodes if n.phase == "forward")
    reach = link.device_to_host_bytes_per_s * fwd
    if link.host_memory_bytes is not None:
        reach = min(reach, link.host_memory_bytes)
    return int(reach)


def combine(
    problem: Problem,
    recompute_plan_at: Callable[[int, Deadline], Plan | None],
    *,
    deadline: Deadline,
    reach: Sequence[float] = LINK_REACH,
) -> list[Plan]:
    """Recompute-only plans made for larger budgets, offloaded down to the problem's budget.

    For each share ``f`` of :func:`link_reach_bytes` (in order), ``recompute_plan_at(budget +
    f * reach, deadline)`` plans for that larger budget (the eager plan, without a call, once
    the budget reaches the eager peak), and :func:`offload_pass` offloads it down to the
    problem's budget with no added time. Then a finer search below the smallest extra that
    missed (:data:`REFINE_POINTS`, :data:`REFINE_STEPS`): a plan for more memory recomputes
    less, and the largest extra the post-pass can still take off is where the best plan of
    this kind usually lies. Returns the plans that reach the budget (the caller simulates
    them again in its results). Stops at ``deadline``.
    """
    graph = problem.graph
    budget = problem.budget_bytes
    eager_peak = problem.eager.peak_bytes
    full = link_reach_bytes(graph)
    out: list[Plan] = []
    reached: dict[int, bool] = {}
    fastest: list[tuple[float, int]] = []  # (time, extra) of the plans that reached it

    def attempt(at: int, *, prune: bool = False) -> None:
        reached[at] = False
        if at >= eager_peak:
            plan: Plan | None = problem.eager_plan
            base: Simulation | None = problem.eager
        else:
            plan = recompute_plan_at(at, deadline)
            base = None if plan is None else simulate(graph, plan)
        if plan is None or base is None:
            return
        if prune and fastest and base.total_time_s >= min(fastest)[0]:
            return  # the post-pass adds no time: this plan cannot beat one already found
        p, s = offload_pass(graph, plan, target_bytes=budget, deadline=deadline, sim=base)
        if s.peak_bytes <= budget and _fits_host(graph, s):
            out.append(p)
            reached[at] = True
            fastest.append((s.total_time_s, at))

    for f in reach:
        if deadline.expired():
            break
        at = min(eager_peak, budget + int(f * full))
        if at > budget and at not in reached:
            attempt(at)
    # a grid below the smallest extra that missed, largest first; then a bisection between
    # the fastest plan's extra and the miss above it (what the post-pass takes off is not
    # monotone in the extra: this is a search, it claims nothing)
    lo = max((at for at, ok in reached.items() if ok), default=budget)
    hi = min((at for at, ok in reached.items() if not ok and at > lo), default=None)
    if hi is None:
        return out
    for k in range(REFINE_POINTS, 0, -1):
        at = lo + (hi - lo) * k // (REFINE_POINTS + 1)
        if deadline.expired():
            return out
        if at not in reached and at > lo:
            attempt(at, prune=True)
    if not fastest:
        return out
    lo = min(fastest)[1]
    hi = min((at for at, ok in reached.items() if not ok and at > lo), default=None)
    for _ in range(REFINE_STEPS):
        if hi is None or deadline.expired() or hi - lo <= max(1, full // 200):
            break
        mid = (lo + hi) // 2
        attempt(mid)
        lo, hi = (mid, hi) if reached[mid] else (lo, mid)
    return out


def host_room_at(graph: Graph, upper_s: float) -> np.ndarray:
    """Per node position ``c``: the most bytes a plan of time at most ``upper_s`` can hold
    only on the host, and still need, when node ``c`` first runs (see :func:`combined_bound`).
    """
    link = graph.link
    t = np.asarray([nd.time_s for nd in graph.nodes], dtype=np.float64)
    before = np.cumsum(t) - t  # every node before c ran at least once by then
    after = float(t.sum()) - before  # c and every node after it run at least once after
    d2h, h2d = link.device_to_host_bytes_per_s, link.host_to_device_bytes_per_s
    lo, hi = before, np.maximum(before, upper_s - after)
    # the start e of node c lies in [lo, hi]; by then at most d2h * e bytes went out, and
    # what is still needed comes back within upper_s - e: the worst e makes them equal
    e = np.clip(h2d * upper_s / (d2h + h2d), lo, hi)
    room = np.minimum(d2h * e, h2d * np.maximum(0.0, upper_s - e))
    # no plan that fast reaches node c: nothing held. Up to rounding only: a plan of the eager
    # time (offloads that add nothing) has upper_s equal to the sum, which the simulator and
    # these cumulative sums round differently, and zeroing the room there made the bound the
    # recompute-only one, above that very plan (7B Llama fp32 on h200 at 30%: +13.3% for a
    # +0.0% plan)
    slack = 1e-9 * max(upper_s, float(t.sum()))
    room[upper_s - after < before - slack] = 0.0
    if link.host_memory_bytes is not None:
        room = np.minimum(room, float(link.host_memory_bytes))
    out: np.ndarray = np.floor(room)
    return out


def combined_bound(graph: Graph, budget_bytes: int, *, upper_s: float | None = None,
                   deadline: Deadline | None = None) -> float:  # fmt: skip
    """A lower bound on the time of the fastest plan within ``budget_bytes`` that may also
    offload, given ``upper_s``, the time of any plan known within the budget (None: none).

    Proof. Take a plan P (offloads allowed) of time T. Drop its offload and prefetch steps:
    each value stays on the device instead, so the result P' is a valid recompute-only plan
    with the same computes, of time at most T (its compute time; no copies, no stalls). At
    every step P' holds P's device bytes plus the values P then holds only on the host; those
    are at most the host budget H and at most the bytes the device-to-host link moved by then,
    ``bw * T``. So P' fits ``budget + min(H, bw * T)`` and, by the recompute-only bound ``L``
    of :func:`~remat.solver.bounds.best_bound` (non-increasing in the budget),
    ``T >= L(budget + min(H, bw * T))``. The fastest plan has ``T <= upper_s``, hence
    ``T >= L(budget + min(H, bw * upper_s))``; without ``upper_s``, ``T >= L(budget + H)``,
    and with neither bounded, only the eager bound (every node once) holds.

    Sharper at each cut (the first run of node ``c``, the cuts of
    :func:`~remat.solver.bounds.cut_bounds` and :func:`~remat.solver.bounds.closure_bounds`):
    node ``c`` starts at a time ``e`` no earlier than the nodes before it take (each ran at
    least once) and no later than ``T`` less the time of ``c`` and the nodes after it (each
    still runs at least once). The values P holds only on the host then and reads later were
    copied out by ``e`` (at most ``bw_out * e`` bytes) and must come back after it (at most
    ``bw_in * (T - e)``), and the cut's relaxation counts them resident in P'. So the cut is
    relaxed with ``max_e min(H, bw_out * e, bw_in * (T - e))`` more bytes
    (:func:`host_room_at`), far less than ``bw * T`` where the backward is long: at the
    forward/backward cut, the link has had only the forward pass (and the plan's slack) to
    move values out.

    Returns the bound in seconds (``math.inf``: no plan fits the budget even with offloading).
    """
    link = graph.link
    room: list[float] = []
    if link.host_memory_bytes is not None:
        room.append(float(link.host_memory_bytes))
    if upper_s is not None and math.isfinite(upper_s):
        room.append(link.device_to_host_bytes_per_s * upper_s)
    if not room:
        return best_bound(graph, budget_bytes, offload=True).time_s
    extra = min(room)
    whole = deadline.share(0.5) if deadline is not None else None
    bound = best_bound(graph, budget_bytes + int(extra), deadline=whole).time_s
    if upper_s is None or not math.isfinite(upper_s) or graph.num_nodes == 0:
        return bound
    at = host_room_at(graph, upper_s).tolist()
    quarter = deadline.share(0.25) if deadline is not None else None
    bound = max(bound, cut_bounds(graph, budget_bytes, deadline=quarter, more_room=at).time_s)
    closure = closure_bounds(graph, budget_bytes, deadline=deadline, more_room=at)
    if closure is not None:
        bound = max(bound, closure.time_s)
    return bound


# -- baselines ------------------------------------------------------------------------------


def _saved_gaps(graph: Graph, plan: Plan, values: set[str] | None = None) -> list[Gap]:
    """The gaps of ``plan`` that run from the forward pass to the backward pass, of ``values``
    (default: every value)."""
    node = graph.node_map()
    out = []
    for g in value_gaps(graph, plan):
        if values is not None and g.value not in values:
            continue
        first = node[plan.steps[g.before].id]
        last = node[plan.steps[g.after].id]
        if first.phase == "backward" and last.phase != "backward":
            out.append(g)
    return out


@register(
    "offload-all",
    kind="baseline",
    summary="Every saved activation to the host (torch save_on_cpu, torchtune)",
    options=NoOptions,
)
def solve_offload_all(problem: Problem) -> SolveResult:
    """No recomputation; every value saved for the backward pass is offloaded after its last
    forward read and prefetched ahead of its first backward read, as
    ``torch.autograd.graph.save_on_cpu`` (with torchtune's ``OffloadActivations`` streams:
    copies beside compute) does."""
    t0 = time.perf_counter()
    graph = problem.graph
    plan, _ = with_offloads(graph, problem.eager_plan, _saved_gaps(graph, problem.eager_plan))
    return problem.result(plan, solver="offload-all", started=t0)


@register(
    "offload-checkpoints",
    kind="baseline",
    summary="Checkpoint every block, its inputs on the host (DeepSpeed CPU checkpointing)",
    options=NoOptions,
)
def solve_offload_checkpoints(problem: Problem) -> SolveResult:
    """``checkpoint-all`` (keep each block's inputs, recompute each block once), with the kept
    block inputs offloaded between the forward and the backward pass, as DeepSpeed's activation
    checkpointing with ``cpu_checkpointing`` does.

    References
    ----------
    J. Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training", USENIX ATC 2021.
    """
    t0 = time.perf_counter()
    graph = problem.graph
    kept = {v for c in block_cuts(graph) for v in c.values}
    base = keep_plan(graph, kept)
    plan, _ = with_offloads(graph, base, _saved_gaps(graph, base, kept))
    return problem.result(plan, solver="offload-checkpoints", started=t0)
