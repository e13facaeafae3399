"""remat's search among the partitions AOT autograd can express (saved sets), under bytes.

:func:`search_partition` minimises the simulated step time of a saved set
(:class:`~remat.executor.compile.partition.PartitionModel`) under a budget in bytes. Every
candidate is judged by the simulator's figures on the backward order the partitioner makes
(:meth:`~remat.executor.compile.partition.PartitionModel.figures`), never by a proxy.

1. Save everything the backward reads (no recomputation): optimal when it fits.
2. Starts: the saved sets of a parametric minimum cut (for a price per byte saved ``lam``, the
   set minimising ``lam * saved bytes + recomputation seconds`` among those from which the
   backward can recompute what it reads, a closure problem solved exactly as a minimum s-t cut:
   Picard 1976; the min-cut view of recomputation is torch's partitioner's, Ansel et al. 2024,
   which cuts on bytes alone), at prices from "save everything" to "save the fewest bytes";
   everything the backward reads; the outputs of compute-bound ops only (cheap pointwise ops
   recomputed, as torch's partitioner prefers); nothing saved; the sets that drop the values with
   the most bytes per second of recomputation (a knapsack's ratio order, at several depths); and
   the seeds (the values a remat solver's plan keeps across the forward/backward boundary).
3. From each start (those that fit first, then the fastest), a descent to the budget: every
   move that saves or stops saving one value alive at (or recomputed around) the simulated peak
   is judged, and the one with the largest peak reduction per second of added time is taken
   (Chen et al. 2016's budget-driven greedy, with Checkmate's (Jain et al. 2020) simulated peak
   as the judge).
4. The fastest few that fit are improved locally until no move helps or the deadline: save a
   value whose recomputation costs most while the peak still fits; or save one and stop saving
   another (a swap) when the pair fits and is faster.

The deadline applies after a floor of judged sets (``_MIN_EVALS``). The fastest fitting set of
all is returned, else the lowest peak seen; no optimality is claimed
(there is no exact solver for this class here).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import networkx as nx

from remat.executor.compile.partition import Figures, Partition, PartitionModel

_RATIO_DEPTHS = (0.25, 0.5, 0.75)
_IMPROVED = 3
_MOVES = 16
_MIN_EVALS = 600
"""Saved sets judged before the deadline applies (about 3 s on an idle CPU for 300 nodes)."""
"""Moves judged per step: the largest values to stop saving, the slowest to save."""


class _Search:
    def __init__(
        self,
        model: PartitionModel,
        budget_bytes: int,
        deadline: float,
    ) -> None:
        self.model = model
        self.budget = budget_bytes
        self.deadline = deadline
        self.free = set(model.candidates)
        self.cache: dict[frozenset[str], Figures] = {}

    def late(self) -> bool:
        # The deadline binds only after a floor of work, so that a loaded machine still gets
        # the starts and their first descents (and the same answer as an idle one there).
        return len(self.cache) >= _MIN_EVALS and time.monotonic() > self.deadline

    def fits(self, f: Figures) -> bool:
        return f.peak_bytes <= self.budget

    def ev(self, saved: Iterable[str]) -> Figures:
        key = frozenset(set(saved) & self.free)
        got = self.cache.get(key)
        if got is None:
            got = self.model.figures(key)
            self.cache[key] = got
            self.cache.setdefault(got.saved, got)
        return got

    def _add_candidates(self, f: Figures) -> list[str]:
        """Unsaved values whose producer the backward recomputes (saving one shortens it)."""
        m = self.model
        return [
            o
            for nid in f.recomputed
            for o in m.node[nid].outputs
            if o in self.free and o not in f.saved
        ]

    def descend(self, f: Figures) -> Figures:
        """Moves with the best peak reduction per second until the peak fits."""
        tabu: set[str] = set()
        plateau = 0
        while not self.fits(f) and not self.late():
            m = self.model
            drops = sorted(
                (v for v in f.saved & self.free if v in f.live_at_peak and v not in tabu),
                key=lambda v: -m.size[v],
            )[:_MOVES]
            adds = sorted(
                {v for v in self._add_candidates(f) if v not in tabu},
                key=lambda v: -m.node[m.producer[v]].time_s,
            )[:_MOVES]
            best: tuple[float, Figures] | None = None
            fallback: tuple[tuple[int, float], str, Figures] | None = None
            for v, trial in [(v, self.ev(f.saved - {v})) for v in drops] + [
                (v, self.ev(f.saved | {v})) for v in adds
            ]:
                gain = f.peak_bytes - trial.peak_bytes
                if gain > 0:
                    dt = trial.total_time_s - f.total_time_s
                    score = gain / dt if dt > 1e-15 else gain * 1e15
                    if best is None or score > best[0]:
                        best = (score, trial)
                elif fallback is None or (trial.peak_bytes, trial.total_time_s) < fallback[0]:
                    fallback = ((trial.peak_bytes, trial.total_time_s), v, trial)
                if self.late():
                    break
            if best is not None:
                f, plateau = best[1], 0
                continue
            # No single move lowers the peak: take the least harmful one (the peak may move
            # to where the next move helps), a few times at most.
            if fallback is None or plateau >= 4:
                break
            plateau += 1
            tabu.add(fallback[1])
            f = fallback[2]
        return f

    def improve(self, f: Figures) -> Figures:
        """Save values (alone or swapped for another) while the peak fits and time drops."""
        m = self.model
        improved = True
        while improved and not self.late():
            improved = False
            adds = sorted(
                set(self._add_candidates(f)),
                key=lambda v: -m.node[m.producer[v]].time_s,
            )
            for u in adds:
                trial = self.ev(f.saved | {u})
                if self.fits(trial) and trial.total_time_s < f.total_time_s:
                    f, improved = trial, True
                    break
            if improved:
                continue
            best: Figures | None = None
            for u in adds[:_MOVES]:
                if self.late():
                    break
                grown = self.ev(f.saved | {u})
                if grown.total_time_s >= f.total_time_s:
                    continue
                drops = sorted(
                    grown.saved & self.free & grown.live_at_peak, key=lambda v: -m.size[v]
                )
                for v in drops[:_MOVES]:
                    if v == u:
                        continue
                    trial = self.ev(grown.saved - {v})
                    if (
                        self.fits(trial)
                        and trial.total_time_s < f.total_time_s
                        and (best is None or trial.total_time_s < best.total_time_s)
                    ):
                        best = trial
            if best is not None:
                f, improved = best, True
        return f


def _compute_bound(model: PartitionModel) -> set[str]:
    """Values the backward reads whose producer takes longer than moving its inputs and
    outputs would (flops dominate: matmuls, attention), i.e. the ones worth keeping."""
    out: set[str] = set()
    for v in model.read_by_backward:
        node = model.node[model.producer[v]]
        if node.flops > 8 * sum(model.size.get(x, 0) for x in (*node.inputs, *node.outputs)):
            out.add(v)
    return out


class _MinCut:
    """The parametric minimum cut (module docstring) of one graph, at any price per byte.

    Vertices: ``("n", p)`` for each forward node (on the sink side iff the backward recomputes
    it, at the cost of its time), ``("i", v)``/``("o", v)`` for each forward value (``o`` on the
    sink side iff the backward has ``v``; ``i`` on the source side as well iff ``v`` is saved,
    at ``price * bytes``). An infinite arc ``x -> y`` says "y on the sink side needs x there".
    """

    def __init__(self, model: PartitionModel) -> None:
        self.model = model
        values = model.forward_values
        g = nx.DiGraph()
        for nid in model.forward:
            n = model.node[nid]
            if n.recomputable:
                g.add_edge("s", ("n", n.id), capacity=n.time_s)
            else:
                g.add_edge("s", ("n", n.id))  # no capacity: infinite, never recomputed
            for u in n.inputs:
                if u in values:
                    g.add_edge(("o", u), ("n", n.id))
            for v in n.outputs:
                g.add_edge(("n", n.id), ("i", v))
                g.add_edge(("i", v), ("o", v), capacity=0.0)
        for v in model.read_by_backward:
            g.add_edge(("o", v), "t")
        self.g = g
        total_bytes = sum(model.size[v] for v in model.read_by_backward) or 1
        total_time = sum(model.node[n].time_s for n in model.forward) or 1e-9
        self.base_price = total_time / total_bytes
        """Seconds per byte: the forward's time over the bytes the backward reads."""

    def saved(self, price: float) -> set[str]:
        m, g = self.model, self.g
        for v in m.forward_values:
            g[("i", v)][("o", v)]["capacity"] = price * m.size[v]
        _, (source_side, _sink) = nx.minimum_cut(g, "s", "t")
        return {
            v for v in m.forward_values if ("i", v) in source_side and ("o", v) not in source_side
        }


def _min_cut_starts(
    search: _Search, cut: _MinCut, num_prices: int = 15, bisections: int = 6
) -> list[set[str]]:
    """Minimum-cut saved sets at prices from ``base / 128`` to ``base * 128`` (a factor of
    two apart), then bisected (in log price) between the two prices whose sets' simulated peaks
    bracket the budget: the sets nearest the budget from both sides."""
    exps = [k - num_prices // 2 for k in range(num_prices)]
    sets = {e: cut.saved(cut.base_price * 2.0**e) for e in exps}
    fits = {e: search.fits(search.ev(x)) for e, x in sets.items()}
    out = list(sets.values())
    # A higher price saves fewer bytes: the lowest fitting price and the one below it.
    fitting = [e for e in exps if fits[e]]
    if fitting and fitting[0] != exps[0] and not search.late():
        lo, hi = float(fitting[0] - 1), float(fitting[0])
        for _ in range(bisections):
            mid = (lo + hi) / 2
            x = cut.saved(cut.base_price * 2.0**mid)
            out.append(x)
            if search.fits(search.ev(x)):
                hi = mid
            else:
                lo = mid
    return out


def _ratio_starts(model: PartitionModel) -> list[set[str]]:
    """Everything the backward reads less the values with the most bytes per second of
    recomputation (their producer's time), at several depths."""
    every = list(model.read_by_backward)
    by_ratio = sorted(
        every,
        key=lambda v: -model.size[v] / max(model.node[model.producer[v]].time_s, 1e-12),
    )
    return [set(every) - set(by_ratio[: int(d * len(by_ratio))]) for d in _RATIO_DEPTHS]


def search_partition(
    model: PartitionModel,
    budget_bytes: int,
    *,
    seeds: Sequence[Iterable[str]] = (),
    time_limit_s: float = 30.0,
) -> tuple[Partition, Partition]:
    """Search the class for the fastest partition within ``budget_bytes`` (module docstring).

    Returns
    -------
    (best, lowest)
        ``best``: the fastest partition found within the budget, or the lowest-peak one when
        none fits; ``lowest``: the lowest-peak partition seen (for infeasibility reports).
    """
    s = _Search(model, budget_bytes, time.monotonic() + time_limit_s)
    every = set(model.read_by_backward)
    full = s.ev(every)
    if s.fits(full):
        part = model.partition(full.saved)
        return part, part
    starts = [*_min_cut_starts(s, _MinCut(model)), *(set(x) for x in seeds)]
    starts += [every, _compute_bound(model), set(), *_ratio_starts(model)]
    figs = {f.saved: f for f in (s.ev(x) for x in starts)}.values()
    # Fitting starts first (fastest first), then those nearest the budget (the shortest
    # descents); the few fastest that fit are improved.
    order = sorted(
        figs, key=lambda f: (not s.fits(f), f.total_time_s if s.fits(f) else f.peak_bytes)
    )
    descended: dict[frozenset[str], Figures] = {}
    for f in order:
        if s.late():
            break
        d = s.descend(f)
        descended[d.saved] = d
    fast = sorted((d for d in descended.values() if s.fits(d)), key=lambda d: d.total_time_s)
    for f in fast[:_IMPROVED]:
        if s.late():
            break
        s.improve(f)
    seen = list(s.cache.values())
    fitting = [f for f in seen if s.fits(f)]
    lowest = min(seen, key=lambda f: (f.peak_bytes, f.total_time_s))
    best = min(fitting, key=lambda f: (f.total_time_s, f.peak_bytes)) if fitting else lowest
    best_part = model.partition(best.saved)
    low_part = best_part if best is lowest else model.partition(lowest.saved)
    return best_part, low_part
