"""Searching the checkpoint class (:mod:`remat.ir.checkpoint_class`) for a plan under a budget.

:func:`fit` is what ``remat.solve(..., executor="checkpoint")`` runs: candidate sets of
checkpoint regions (whole or selective) and of offloaded blocks, each written as a plan by
:func:`~remat.ir.checkpoint_class.checkpoint_plan` and judged by the simulator.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from remat.ir.checkpoint_class import (
    Region,
    admissible,
    blocks,
    checkpoint_plan,
    offloadable,
    offloads_of,
    region,
    regions_of,
)
from remat.ir.graph import Graph
from remat.ir.plan import Plan
from remat.ir.simulate import Simulation, simulate


@dataclass(frozen=True)
class Fit:
    """A plan of the class and its simulation."""

    plan: Plan
    simulation: Simulation
    regions: tuple[Region, ...]
    offloaded: tuple[str, ...] = ()
    """Blocks whose saved tensors go to host memory."""


def _densities(graph: Graph, r: Region) -> dict[str, float]:
    """Seconds of recomputation a node of region ``r`` saves per byte it holds when saved: its
    time over the bytes of its outputs that the backward pass reads (the ones the policy
    caches). Nodes whose outputs the backward does not read hold nothing when saved (``inf``)."""
    bwd_reads = graph.memo("checkpoint_class.bwd_reads", lambda: frozenset(
        x for n in graph.backward_nodes for x in n.inputs
    ))  # fmt: skip
    out: dict[str, float] = {}
    for nid in r.nodes:
        if nid in r.save:
            continue
        n = graph.node(nid)
        held = sum(graph.value(o).size_bytes for o in n.outputs if o in bwd_reads)
        out[nid] = math.inf if held == 0 else n.time_s / held
    return out


def fit(
    graph: Graph,
    budget_bytes: int,
    *,
    seeds: Iterable[Plan] = (),
    host_bandwidth_bytes_per_s: float | None = None,
    time_budget_s: float = 10.0,
    offload: bool = False,
) -> Fit:
    """The fastest plan of the class found within ``budget_bytes`` (or the smallest peak).

    Candidates, each judged by the simulator:

    1. the projections of ``seeds`` (other solvers' plans);
    2. a greedy search over whole regions: starting from no region, add the block whose
       region (every node recomputed that may be) lowers the simulated peak the most per
       second of recomputation, until the plan fits;
    3. selective regions: the nodes of every block ranked together by the recomputation time
       their saving spares per byte it holds (:func:`_densities`; in a tie, the later block
       first), and each plan saving a prefix of that ranking (a block none of whose values
       the backward reads is recomputed gets no region). The longest prefix that fits is
       found by bisection, then the few after it are tried, as peaks are not quite monotone
       in the prefix: the greedy knapsack by value density (as in selective activation
       checkpointing by op cost, Korthikanti et al. 2022), with the simulator as the judge.
       Then, block by block from the last (whose activations are held the shortest), its
       next densest node is saved too where the plan still fits and gets faster, until a
       pass changes nothing.

    4. with ``offload``: offloaded blocks (:func:`_offloading`) in place of the best plan's
       regions, where the host link hides the copies.

    Candidate 3 runs first: its bisection to the end (a simulation per halving), the rest
    within ``time_budget_s``; candidate 2 then stops when the budget is spent, provided a plan
    that fits is in hand (it always runs to a fit otherwise). With ``offload`` those get 60%
    of ``time_budget_s``, and candidate 4, last, what is left, at least 40% of it.
    """
    bw = host_bandwidth_bytes_per_s
    started = time.monotonic()

    def judge(regs: list[Region], off: Sequence[str] = ()) -> Fit:
        p = checkpoint_plan(graph, regs, off)
        sim = simulate(graph, p, host_bandwidth_bytes_per_s=bw)
        return Fit(p, sim, tuple(regs), tuple(off))

    def better(a: Fit, b: Fit | None) -> bool:
        if b is None:
            return True
        fa, fb = a.simulation.peak_bytes <= budget_bytes, b.simulation.peak_bytes <= budget_bytes
        if fa != fb:
            return fa
        if fa:
            return a.simulation.total_time_s < b.simulation.total_time_s
        return a.simulation.peak_bytes < b.simulation.peak_bytes

    best: Fit | None = None
    for s in seeds:
        cand = judge(regions_of(graph, s), offloads_of(graph, s) if offload else ())
        if better(cand, best):
            best = cand
    chosen: list[Region] = []
    current = judge(chosen)
    if best is None or better(current, best):
        best = current
    if current.simulation.peak_bytes <= budget_bytes:
        return best  # eager fits: nothing is faster
    options: Mapping[str, Region] = {
        path: region(graph, path) for path in blocks(graph) if admissible(graph, path)
    }
    options = {p: r for p, r in options.items() if set(r.nodes) - r.save}
    # with offloading, the region searches get 60% of the time and the offloading the rest
    deadline = started + time_budget_s * (0.6 if offload else 1.0)
    found = _selective(graph, budget_bytes, judge, better, options, deadline)
    if found is not None and better(found, best):
        best = found
    fits = best.simulation.peak_bytes <= budget_bytes
    while current.simulation.peak_bytes > budget_bytes and options:
        if fits and time.monotonic() > deadline:
            break  # a plan that fits is in hand; the greedy's next rounds are out of time
        scored: list[tuple[float, str, Fit]] = []
        for path, r in options.items():
            if fits and scored and time.monotonic() > deadline:
                break  # out of time: the round's best so far
            cand = judge([*chosen, r])
            gain = current.simulation.peak_bytes - cand.simulation.peak_bytes
            cost = max(cand.simulation.total_time_s - current.simulation.total_time_s, 1e-12)
            scored.append((gain / cost, path, cand))
        score, path, cand = max(scored, key=lambda t: t[0])
        if score <= 0:
            # No single block lowers the peak: take the one that recomputes the most.
            path, cand = min(
                ((p, f) for _, p, f in scored), key=lambda t: t[1].simulation.peak_bytes
            )
        chosen.append(options.pop(path))
        current = cand
        if better(current, best):
            best = current
    if offload:
        # what is left, and at least 40% of the time (the selective bisection may overrun)
        until = max(started + time_budget_s, time.monotonic() + 0.4 * time_budget_s)
        best = _offloading(graph, budget_bytes, judge, better, best, until)
    return best


def _offloading(
    graph: Graph,
    budget_bytes: int,
    judge: Callable[[list[Region], Sequence[str]], Fit],
    better: Callable[[Fit, Fit | None], bool],
    base: Fit,
    deadline: float,
) -> Fit:
    """Candidate 4 of :func:`fit`: blocks offloaded instead of recomputed.

    An offloaded block costs no recomputation where the link keeps up with the forward (and
    the prefetches with the backward); it holds its saved tensors while their copies are in
    flight and from its backward's start. Starting from ``base``'s regions, a prefix of the
    blocks in forward order is offloaded (their regions dropped): the earliest blocks' copies
    have the longest to finish, and their tensors come back last. Every block first; where that
    does not fit, the longest prefix that fits is found by bisection (peaks grow with it, not
    quite monotonically, so the few after it are tried too), for the blocks in order and for
    every other block first (copies of one block overlapping the compute of the next); then,
    block by block in forward order, each block's choice is flipped (offloaded, or back to
    ``base``'s) where the plan still fits and gets faster, until a pass changes nothing (POFO,
    Beaumont et al. 2021, offloads a chain's stages the same way, by a DP; here the simulator
    judges).
    """
    cands = [path for path in blocks(graph) if offloadable(graph, path) and admissible(graph, path)]
    if not cands:
        return base
    base_regions = {r.path: r for r in base.regions}
    best = base

    def with_offloaded(off: Sequence[str]) -> Fit:
        gone = set(off)
        return judge([r for p, r in base_regions.items() if p not in gone], sorted(gone))

    orders = [cands, cands[::2] + cands[1::2]]
    best_off: list[str] = list(base.offloaded)
    every = with_offloaded(cands)  # all of them first: where the link keeps up, the best
    if better(every, best):
        best, best_off = every, list(cands)
    for order in orders:
        lo, hi = 0, len(order)
        if every.simulation.peak_bytes <= budget_bytes:
            break  # no prefix is faster than all of them where the copies hide
        while lo < hi:
            mid = (lo + hi + 1) // 2
            cand = with_offloaded(order[:mid])
            if cand.simulation.peak_bytes <= budget_bytes:
                lo = mid
                if better(cand, best):
                    best, best_off = cand, list(order[:mid])
            else:
                hi = mid - 1
            if time.monotonic() > deadline and best is not base:
                break
        for n in range(lo + 1, min(lo + 4, len(order) + 1)):
            if time.monotonic() > deadline:
                break
            cand = with_offloaded(order[:n])
            if better(cand, best):
                best, best_off = cand, list(order[:n])
    changed = True
    while changed:
        changed = False
        # additions first (where the link has room, each spares a region's recomputation),
        # then take-backs
        for path in [p for p in cands if p not in best_off] + list(best_off):
            if time.monotonic() > deadline:
                return best
            trial = [p for p in best_off if p != path] if path in best_off else [*best_off, path]
            cand = with_offloaded(trial)
            if better(cand, best):
                best, best_off, changed = cand, trial, True
    return best


def _selective(
    graph: Graph,
    budget_bytes: int,
    judge: Callable[[list[Region]], Fit],
    better: Callable[[Fit, Fit | None], bool],
    options: Mapping[str, Region],
    deadline: float,
) -> Fit | None:
    """Candidate 3 of :func:`fit`: save a prefix of every block's nodes ranked by density."""
    dens = {path: _densities(graph, r) for path, r in options.items()}
    paths = list(options)  # graph order (blocks() lists them by first forward node)
    ranked = sorted(
        (
            (-d, -k, -graph.node(nid).time_s, path, nid)
            for k, path in enumerate(paths)
            for nid, d in dens[path].items()
            if d != math.inf
        ),
    )  # densest first; in a tie, the later block first
    order = [(path, nid) for *_, path, nid in ranked]
    finite = {path: {nid for nid, d in dens[path].items() if d != math.inf} for path in paths}

    def judge_saved(saved: Mapping[str, set[str]]) -> Fit:
        regs = []
        for path in paths:
            if finite[path] and saved[path] >= finite[path]:
                continue  # every value its backward reads is kept: no region
            r = options[path]
            regs.append(Region(r.path, r.nodes, frozenset(r.save | saved[path])))
        return judge(regs)

    def prefix_of(n: int) -> dict[str, set[str]]:
        saved: dict[str, set[str]] = {path: set() for path in paths}
        for path, nid in order[:n]:
            saved[path].add(nid)
        return saved

    best_saved = prefix_of(0)
    best = judge_saved(best_saved)
    if best.simulation.peak_bytes > budget_bytes:
        return best
    lo, hi = 0, len(order)  # the longest prefix that fits, by bisection (peaks grow with it)
    while lo < hi:  # a few dozen simulations at most: always run to the end
        mid = (lo + hi + 1) // 2
        saved = prefix_of(mid)
        cand = judge_saved(saved)
        if cand.simulation.peak_bytes <= budget_bytes:
            lo = mid
            if better(cand, best):
                best, best_saved = cand, saved
        else:
            hi = mid - 1
    # peaks are not quite monotone in the prefix: a few longer ones may still fit
    for n in range(lo + 1, min(lo + 9, len(order) + 1)):
        if time.monotonic() > deadline:
            break
        saved = prefix_of(n)
        cand = judge_saved(saved)
        if better(cand, best):
            best, best_saved = cand, saved
    # then block by block, from the last (its activations are held the shortest), its next
    # densest node saved too while the plan still fits and gets faster
    own = {path: [nid for path_, nid in order if path_ == path] for path in paths}
    changed = True
    while changed:
        changed = False
        for path in reversed(paths):
            if time.monotonic() > deadline:
                return best
            rest = [nid for nid in own[path] if nid not in best_saved[path]]
            if not rest:
                continue
            trial = {**best_saved, path: best_saved[path] | {rest[0]}}
            cand = judge_saved(trial)
            if better(cand, best):
                best, best_saved, changed = cand, trial, True
    return best


__all__ = ["Fit", "fit"]
