"""Blocks of a chain and their partial saves: the per-block exact problems of ``hierarchical``.

For one stage (block) of a chain, a *partial save* keeps some of its saved activations through
the rest of the chain and makes the others again right before the block's backward, by
running some of its forward nodes a second time (from the block's input, which rotor keeps
resident then, and the activations kept). Choosing which to keep is a small exact MILP:

* ``x_v`` (keep saved value ``v``), ``y_p`` (run forward node ``p`` again);
* every saved value is kept or its producer runs again: ``x_v + y_p(v) >= 1``;
* a node that runs again has its in-block inputs: kept or made again
  (``x_u + y_p(u) >= y_p``; ``y_p(u) >= y_p`` for values the backward does not read);
* nodes that cannot run again (side effects, required or static outputs, inputs from outside
  the block's cut) have ``y_p = 0``;
* kept bytes within a cap; minimise the time of the nodes run again.

Solved for a few caps, it gives the block's frontier of (kept bytes, extra time) options.
Blocks that are structurally identical (same ops, times, sizes and edges in the same order,
names ignored; grouped by networkx's Weisfeiler-Lehman hash and confirmed by an exact
signature) are solved once.

References
----------
X. Zhao, T. Le Hellard, L. Eyraud-Dubois, J. Gusak, O. Beaumont. "Rockmate: an Efficient, Fast,
Automatic and Generic Tool for Re-materialization in PyTorch." ICML 2023 (ILP inside blocks,
rotor across them).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import networkx as nx
import numpy as np

from remat.ir import Graph, InvalidPlanError, Plan, block_cuts, keep_plan, simulate
from remat.ir.chain import Stage
from remat.solver._mip import SparseModel
from remat.solver.deadline import Deadline

CAP_FRACTIONS = (0.0, 0.4, 0.8, 0.2, 0.6, 0.1, 0.3, 0.5, 0.7, 0.9, 0.05, 0.15, 0.25, 0.35)
"""Kept-bytes caps, as fractions of the block's saved bytes, whose optima form the frontier
(keeping everything is rotor's own option); coarse to fine, so that a frontier cut short by
the deadline still spans the range."""

BISECTION_STEPS = 7
"""Halvings of the ranking that :func:`boundary_keep_plan` tries at most."""

ENUMERATE_MAX_NODES = 14
"""Blocks with at most this many forward nodes that may run again get their options by
enumeration (at most 16,384 sets, vectorised) instead of one MILP per cap."""

MAX_PARETO_POINTS = 20_000
"""Above this many Pareto sets a block's options come from its MILP."""

MAX_BLOCK_VALUES = 2000
"""Blocks with more saved values get no partial saves (their MILP would not be small)."""


@dataclass(frozen=True)
class BlockOption:
    """Keep ``keep_bytes`` of the block's saved values (``drop_bytes`` fewer than all); run
    ``rerun`` (positions in the block's forward node list) again before its backward, costing
    ``extra_time_s``."""

    keep_bytes: int
    drop_bytes: int
    extra_time_s: float
    rerun: tuple[int, ...]


@dataclass(frozen=True)
class _Block:
    """A stage in local terms: per forward node, its time, whether it may run again, its
    in-block inputs (local node index, output index) and outputs (size, saved?)."""

    signature: tuple[object, ...]
    time_s: tuple[float, ...]
    can_rerun: tuple[bool, ...]
    local_inputs: tuple[tuple[int, ...], ...]
    """Per node: indices into ``values`` of the in-block values it reads."""
    values: tuple[tuple[int, int, bool], ...]
    """Per in-block value: (producer's local index, size in bytes, saved?)."""


def _block_of(graph: Graph, stage: Stage, static: set[str]) -> _Block:
    saved = set(stage.saved_values)
    cut = set(stage.input_values)
    vindex: dict[str, int] = {}
    values: list[tuple[int, int, bool]] = []
    sig: list[object] = []
    times, rerun, inputs = [], [], []
    for k, nid in enumerate(stage.forward_nodes):
        node = graph.node(nid)
        ins: list[int] = []
        ok = node.recomputable
        refs: list[object] = []
        for x in node.inputs:
            if x in vindex:
                ins.append(vindex[x])
                refs.append(("v", vindex[x]))
            elif x in static or graph.value(x).kind == "input":
                refs.append(("s", graph.value(x).size_bytes))
            elif x in cut:
                refs.append(("c", stage.input_values.index(x)))
            else:
                ok = False  # made outside the block and not resident at its backward
                refs.append(("x", graph.value(x).size_bytes))
        outs: list[object] = []
        for o in node.outputs:
            if o in static or graph.is_required(o):
                ok = False
                outs.append(("s", graph.value(o).size_bytes))
                continue
            vindex[o] = len(values)
            values.append((k, graph.value(o).size_bytes, o in saved))
            outs.append((graph.value(o).size_bytes, o in saved))
        times.append(node.time_s)
        rerun.append(ok)
        inputs.append(tuple(ins))
        sig.append((node.op, node.time_s, node.workspace_bytes, ok, tuple(refs), tuple(outs)))
    return _Block(tuple(sig), tuple(times), tuple(rerun), tuple(inputs), tuple(values))


def _wl_hash(block: _Block) -> str:
    """networkx's Weisfeiler-Lehman hash of the block's dataflow graph (names ignored)."""
    g = nx.DiGraph()
    for k, s in enumerate(block.signature):
        g.add_node(k, label=ascii(s))  # networkx hashes labels as ASCII: op names may not be
    for k, ins in enumerate(block.local_inputs):
        for vi in ins:
            p, size, _ = block.values[vi]
            g.add_edge(p, k, label=str(size))
    with warnings.catch_warnings():  # networkx 3.5 notes that directed hashes changed
        warnings.simplefilter("ignore", UserWarning)
        return str(nx.weisfeiler_lehman_graph_hash(g, node_attr="label", edge_attr="label"))


def _frontier(block: _Block, deadline: Deadline | None) -> tuple[BlockOption, ...]:
    saved = [i for i, (_, _, s) in enumerate(block.values) if s]
    total = sum(block.values[i][1] for i in saved)
    if not saved or total == 0 or len(saved) > MAX_BLOCK_VALUES:
        return ()
    options = _enumerated(block, saved, total)
    if options is None:
        options = _by_milp(block, saved, total, deadline)
    # the frontier: fewer kept bytes only for more time
    out: list[BlockOption] = []
    for o in sorted(options.values(), key=lambda o: (o.keep_bytes, o.extra_time_s)):
        if not out or o.extra_time_s < out[-1].extra_time_s - 1e-15:
            out.append(o)
    return tuple(out)


def _option(
    options: dict[tuple[int, float], BlockOption],
    block: _Block,
    keep: int,
    total: int,
    rerun: tuple[int, ...],
) -> None:
    extra = sum(block.time_s[k] for k in rerun)
    key = (keep, round(extra, 15))
    if keep < total and key not in options:
        options[key] = BlockOption(keep, total - keep, extra, tuple(sorted(rerun)))


def _enumerated(
    block: _Block, saved: list[int], total: int
) -> dict[tuple[int, float], BlockOption] | None:
    """The MILP's optimum at every cap of :data:`CAP_FRACTIONS` without a MILP, where that is
    cheap: by enumerating the sets of nodes run again (at most :data:`ENUMERATE_MAX_NODES`
    may run again) or, where no node's rerun needs another's, by a Pareto dynamic program
    (Nemhauser and Ullmann 1969) over them. None otherwise (the MILP answers).

    Given the set ``Y`` run again, the least kept is forced: every saved value whose producer
    is not in ``Y``; ``Y`` is allowed when each of its nodes' in-block inputs is saved or made
    by a node of ``Y``. So the optimum at a cap is the fastest allowed ``Y`` whose forced keep
    fits it (ties: the smaller keep), the same optimum as the MILP's, found in a millisecond or
    so on the small blocks of chains and U-Nets where a MILP solve costs tens of milliseconds.
    """
    cand = [k for k in range(len(block.time_s)) if block.can_rerun[k]]
    bit = {k: j for j, k in enumerate(cand)}
    need = [0] * len(cand)
    allowed = [True] * len(cand)
    gain = [0] * len(cand)
    for j, k in enumerate(cand):
        for vi in block.local_inputs[k]:
            p, _, is_saved = block.values[vi]
            if p in bit:
                if not is_saved:
                    need[j] |= 1 << bit[p]
            elif not is_saved:
                allowed[j] = False  # its input can neither be kept nor made again
    for i in saved:
        p, size, _ = block.values[i]
        if p in bit:
            gain[bit[p]] += size
    times = [block.time_s[k] for k in cand]
    points: _Points | None
    if len(cand) <= ENUMERATE_MAX_NODES:
        points = _all_sets(need, allowed, gain, times)
    elif not any(need):
        points = _pareto(allowed, gain, times)
    else:
        points = None
    if points is None:
        return None
    keep = total - points[1]
    options: dict[tuple[int, float], BlockOption] = {}
    for frac in CAP_FRACTIONS:
        idx = np.flatnonzero(keep <= frac * total * (1 + 1e-12))
        if idx.size == 0:
            continue
        best = int(idx[np.lexsort((keep[idx], points[2][idx]))[0]])
        chosen = int(points[0][best])
        rerun = tuple(cand[j] for j in range(len(cand)) if chosen >> j & 1)
        _option(options, block, int(keep[best]), total, rerun)
    return options


_Points = tuple[np.ndarray, np.ndarray, np.ndarray]
"""Sets of nodes run again (bit masks), the saved bytes each drops, and its extra time."""


def _all_sets(need: list[int], allowed: list[bool], gain: list[int], times: list[float]) -> _Points:
    """Every allowed set, vectorised (at most 2 ** ENUMERATE_MAX_NODES)."""
    n = len(need)
    masks = np.arange(1 << n, dtype=np.int64)
    bits = ((masks[:, None] >> np.arange(n)) & 1).astype(bool)
    ok = ~(bits & ~np.asarray(allowed, dtype=bool)).any(axis=1)
    for j in range(n):
        ok &= ~bits[:, j] | ((masks & need[j]) == need[j])
    drop = bits.astype(np.int64) @ np.asarray(gain, dtype=np.int64)
    extra = bits @ np.asarray(times, dtype=np.float64)
    return masks[ok], drop[ok], extra[ok]


def _pareto(allowed: list[bool], gain: list[int], times: list[float]) -> _Points | None:
    """The Pareto sets (more bytes dropped only for more time) of independent nodes, adding
    one node at a time; None when the frontier grows past :data:`MAX_PARETO_POINTS` or there
    are more nodes than a bit mask holds."""
    if len(gain) > 62:
        return None
    masks = np.zeros(1, dtype=np.int64)
    drop = np.zeros(1, dtype=np.int64)
    extra = np.zeros(1, dtype=np.float64)
    for j, (ok, g, t) in enumerate(zip(allowed, gain, times, strict=True)):
        if not ok or g == 0:
            continue
        masks = np.concatenate([masks, masks | np.int64(1 << j)])
        drop = np.concatenate([drop, drop + g])
        extra = np.concatenate([extra, extra + t])
        # most dropped first (ties: fastest first); keep a set only when strictly faster than
        # every set that drops at least as much
        order = np.lexsort((extra, -drop))
        masks, drop, extra = masks[order], drop[order], extra[order]
        best_before = np.minimum.accumulate(np.concatenate([[np.inf], extra[:-1]]))
        keep = extra < best_before * (1 - 1e-12)
        masks, drop, extra = masks[keep], drop[keep], extra[keep]
        if masks.size > MAX_PARETO_POINTS:
            return None
    return masks, drop, extra


def _by_milp(
    block: _Block, saved: list[int], total: int, deadline: Deadline | None
) -> dict[tuple[int, float], BlockOption]:
    """The optimum at each cap of :data:`CAP_FRACTIONS` from the block's MILP (module doc)."""
    n = len(block.time_s)
    # times in units of a thousandth of the block's: in seconds (1e-7 s a node) HiGHS's
    # absolute gap tolerance (1e-6) took any plan as optimal
    unit = sum(block.time_s) / 1e3 or 1.0
    m = SparseModel()
    x = {i: m.add_col(f"x{i}", 0, 1, integer=True) for i in saved}
    y = {
        k: m.add_col(f"y{k}", 0, 1, integer=True, cost=block.time_s[k] / unit)
        for k in range(n)
        if block.can_rerun[k]
    }
    for i in saved:
        p = block.values[i][0]
        terms = [(x[i], 1.0)] + ([(y[p], 1.0)] if p in y else [])
        m.add_row(terms, 1.0, math.inf)
    for k, yk in y.items():
        for vi in block.local_inputs[k]:
            p, _, is_saved = block.values[vi]
            terms = [(yk, -1.0)]
            if is_saved:
                terms.append((x[vi], 1.0))
            if p in y:
                terms.append((y[p], 1.0))
            m.add_row(terms, 0.0, math.inf)
    cap_row = m.num_rows
    m.add_row([(x[i], float(block.values[i][1])) for i in saved], -math.inf, float(total))
    options: dict[tuple[int, float], BlockOption] = {}
    for frac in CAP_FRACTIONS:
        if deadline is not None and deadline.expired():
            break
        m.row_hi[cap_row] = frac * total
        left = None if deadline is None else max(0.05, deadline.left_s())
        sol = m.solve(time_limit_s=left)
        if sol.values is None or sol.status != "optimal":
            continue
        keep = sum(block.values[i][1] for i in saved if sol.values[x[i]] > 0.5)
        rerun = tuple(k for k, c in y.items() if sol.values[c] > 0.5)
        _option(options, block, keep, total, rerun)
    return options


@dataclass(frozen=True)
class StageOptions:
    """The partial saves of every stage, and how many distinct blocks were solved."""

    options: tuple[tuple[BlockOption, ...], ...]
    distinct_blocks: int
    complete: bool
    """False when the deadline cut the block MILPs short (later stages got no options)."""


def stage_options(
    graph: Graph, stages: tuple[Stage, ...], *, deadline: Deadline | None = None
) -> StageOptions:
    """The frontier of partial saves of each stage, each distinct block solved once."""
    static = {v.id for v in graph.values if graph.is_static(v.id)}
    solved: dict[str, list[tuple[tuple[object, ...], tuple[BlockOption, ...]]]] = {}
    out: list[tuple[BlockOption, ...]] = []
    complete = True
    for st in stages:
        block = _block_of(graph, st, static)
        h = _wl_hash(block)
        group = solved.setdefault(h, [])
        found = next((opts for sig, opts in group if sig == block.signature), None)
        if found is None:
            if deadline is not None and deadline.expired():
                complete = False
                out.append(())
                continue
            found = _frontier(block, deadline)
            group.append((block.signature, found))
        out.append(found)
    return StageOptions(tuple(out), sum(len(g) for g in solved.values()), complete)


def boundary_keep_plan(
    graph: Graph, budget_bytes: int, *, deadline: Deadline | None = None
) -> Plan | None:
    """Keep every block boundary and, of the other activations the backward reads, the most
    time per byte that fits: a partial save of every block at once, sized by bisection on the
    number kept (each candidate judged by the simulator). None when even the boundaries alone
    do not fit, or the deadline passed first."""
    cut = {v for c in block_cuts(graph) for v in c.values}
    ranked: list[tuple[float, str]] = []
    for v in graph.values:
        p = graph.producer_position(v.id)
        if p is None or v.id in cut or v.kind == "input" or graph.is_static(v.id):
            continue
        node = graph.nodes[p]
        if node.phase != "forward" or not node.recomputable or v.size_bytes == 0:
            continue
        if any(r.phase == "backward" for r in graph.consumers_of(v.id)):
            ranked.append((node.time_s / v.size_bytes, v.id))
    ranked.sort(key=lambda r: -r[0])
    order = [v for _, v in ranked]

    def plan_with(k: int) -> Plan | None:
        try:
            return keep_plan(graph, [*cut, *order[:k]])
        except InvalidPlanError:
            return None

    lo, hi, best = 0, len(order), None
    first = plan_with(0)
    if first is None or simulate(graph, first).peak_bytes > budget_bytes:
        return None
    best = first
    # a few halvings (to 1/128 of the ranking) are enough for a candidate plan; each one
    # builds and simulates a whole plan
    for _ in range(BISECTION_STEPS):
        if lo >= hi or (deadline is not None and deadline.expired()):
            break
        mid = (lo + hi + 1) // 2
        plan = plan_with(mid)
        if plan is not None and simulate(graph, plan).peak_bytes <= budget_bytes:
            lo, best = mid, plan
        else:
            hi = mid - 1
    return best
