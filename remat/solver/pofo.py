"""``pofo``: rotor's checkpointing DP extended with offloading of activations to host memory.

Besides rotor's two options at each sub-chain (checkpoint the input of a later stage, or run a
stage forward keeping all its activations), the DP may run a stage forward, *offload* its
saved activations to the host while the rest of the chain runs, and prefetch them back for its
backward. The copies run on the copy stream at the graph's host bandwidth and overlap compute;
the DP charges ``max(sub-chain time, both copies)``, and the plan issues each prefetch one
backward step early so that it overlaps. The simulator accounts the overlap and the stalls
exactly; as for rotor, the memory the DP plans for is lowered until the expanded plan fits,
and the rotor plan (no transfers) is kept when it is faster.

This is a simplified form of POFO: one offload decision per stage (its saved activations),
no offloading of checkpoints, no bandwidth sharing inside the DP. Since the DP offloads whole
stages and prices each stage's copies alone, it misses what a saturated link still hides (in
bf16 a 7B Llama step's forward moves about 5 GiB); so rotor's plans for larger budgets,
offloaded value by value down to the budget where the simulator shows no added time
(:func:`remat.solver.offload.combine`), are candidates too, and the fastest plan wins.

References
----------
O. Beaumont, L. Eyraud-Dubois, A. Shilova. "Efficient Combination of Rematerialization and
Offloading for Training DNNs." NeurIPS 2021.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np
from pydantic import Field

from remat.ir import Plan
from remat.ir.chain import Chain, ChainOp, CutKind
from remat.ir.result import SolveResult
from remat.solver.base import register
from remat.solver.chain_dp import fit_chain_plan, min_chain_slots, trivial_result
from remat.solver.deadline import Deadline, judging_s
from remat.solver.offload import combine as combine_plans
from remat.solver.problem import Problem
from remat.solver.rotor import (
    RotorOptions,
    dp_chain,
    memory_slots,
    planner,
    rotor_within,
    table_within,
)


def early_prefetch(ops: list[ChainOp]) -> list[ChainOp]:
    """Move each ``prefetch`` before the backward step that precedes it, so the copy overlaps
    that step instead of stalling the backward that needs it."""
    out = list(ops)
    for i in range(len(out)):
        if out[i].kind != "prefetch":
            continue
        j = i - 1
        while j >= 0 and out[j].kind != "backward":
            if out[j].kind == "offload" and out[j].stage == out[i].stage:
                j = -1
                break
            j -= 1
        if j >= 0:
            op = out.pop(i)
            out.insert(j, op)
    return out


def copy_times(ch: Chain, latency_s: float, bytes_per_s: float) -> np.ndarray:
    """Per stage of ``ch``, the seconds to copy its activations one way: ``latency_s`` plus
    its bytes at ``bytes_per_s`` (the DP's ``transfer_of``)."""
    return np.array([latency_s + s.all_bytes / bytes_per_s for s in ch.stages], dtype=np.float64)


class PofoOptions(RotorOptions):
    """Options of ``pofo``: rotor's, and the host link's bandwidth."""

    host_bandwidth_bytes_per_s: float | None = Field(
        None, gt=0, description="Host link bandwidth (default: the graph's device profile)."
    )
    combine: bool = Field(
        True,
        description="Also rotor's plans for larger budgets, offloaded down to the budget "
        "where the link hides the copies (on the graph's own link only).",
    )


@register(
    "pofo",
    kind="chain",
    summary="Rotor plus offloading of activations (POFO)",
    options=PofoOptions,
)
def solve_pofo(
    problem: Problem,
    *,
    mem_slots: int = 500,
    cuts: CutKind = "auto",
    max_stages: int | None = None,
    host_bandwidth_bytes_per_s: float | None = None,
    combine: bool = True,
    start_plans: Sequence[Plan] | None = None,
) -> SolveResult:
    """Checkpointing plus offloading on the graph's chain view (see the module docstring).

    Parameters
    ----------
    mem_slots, cuts, max_stages
        As for ``rotor``.
    host_bandwidth_bytes_per_s
        Bandwidth of the host link for planning and simulation (default: the graph's device
        profile; ``math.inf`` makes transfers free).
    combine
        Also rotor's plans for larger budgets, offloaded down to this one where the link hides
        the copies (:func:`remat.solver.offload.combine`); only on the graph's own link
        (without ``host_bandwidth_bytes_per_s``). ``auto`` turns it off: it combines itself.
    start_plans
        Plans without transfers to keep when they are faster (``auto`` hands over rotor's);
        by default rotor runs here for one. A Python keyword, not a service option.

    References
    ----------
    O. Beaumont, L. Eyraud-Dubois, A. Shilova, "Efficient Combination of Rematerialization and
    Offloading for Training DNNs", NeurIPS 2021.
    """
    graph = problem.graph
    link = graph.link
    # a bandwidth given here prices copies both ways without latency (as the simulator's
    # override does); else the graph's own link, slower direction and latency included
    bw = host_bandwidth_bytes_per_s
    if bw is not None and not bw > 0:
        raise ValueError(f"host_bandwidth_bytes_per_s must be > 0, got {bw}")
    if bw is None:
        dp_bw = min(link.device_to_host_bytes_per_s, link.host_to_device_bytes_per_s)
        latency = link.latency_s
    else:
        dp_bw, latency = bw, 0.0
    t0 = time.perf_counter()
    triv = trivial_result(problem, "pofo", t0)
    if triv is not None:
        return triv
    deadline = Deadline(problem.deadline)
    keep_s = judging_s(problem.graph.num_nodes)
    if start_plans is None:
        rotor = rotor_within(
            problem,
            deadline.share(0.5, reserve_s=keep_s),
            mem_slots=mem_slots,
            cuts=cuts,
            max_stages=max_stages,
        )
        start_plans = [rotor.plan] if rotor.plan is not None else []
    extra = list(start_plans)
    if combine and bw is None:
        # rotor for larger budgets, offloaded down to this one (the link's own figures only)
        def rotor_at(budget_bytes: int, dl: Deadline) -> Plan | None:
            r = rotor_within(
                problem.with_budget(budget_bytes),
                dl.share(0.5),
                mem_slots=mem_slots,
                cuts=cuts,
                max_stages=max_stages,
            )
            return r.plan if r.fits else None

        extra += combine_plans(problem, rotor_at, deadline=deadline.share(0.3, reserve_s=keep_s))
    room = problem.room_bytes
    slot, _ = memory_slots(problem, mem_slots)
    got = table_within(
        dp_chain(graph, cuts, slot, mem_slots, max_stages=max_stages),
        slot,
        mem_slots,
        deadline.share(1.0, reserve_s=keep_s),
        transfer_of=lambda c: copy_times(c, latency, dp_bw),
    )
    if got is None:  # no time for the offloading DP: the start plans are POFO plans too
        if extra:
            return problem.best_of(extra, solver="pofo", started=t0, host_bandwidth_bytes_per_s=bw)
        return problem.no_plan(
            solver="pofo",
            started=t0,
            min_budget_bytes=None,
            status="timeout",
            message="the offloading DP did not finish within the time limit",
        )
    ch, table = got
    root = table.cost[0, ch.num_stages]
    plan_for = planner(ch, table, early_prefetch)
    top = min(mem_slots, int(room // slot)) if room > 0 else -1
    if top >= 0 and not math.isfinite(root[top]):
        low = min_chain_slots(root)
        top = -1 if low is None else low
    if top < 0:
        if extra:
            return problem.best_of(extra, solver="pofo", started=t0, host_bandwidth_bytes_per_s=bw)
        return problem.no_plan(
            solver="pofo",
            started=t0,
            min_budget_bytes=None,
            message="the chain has no schedule at any memory",
        )
    return fit_chain_plan(
        problem,
        plan_for,
        top,
        solver="pofo",
        started=t0,
        deadline=deadline,
        host_bandwidth_bytes_per_s=bw,
        extra_plans=extra,
    )
