"""The stage relaxation: a lower bound that charges the memory a recomputation holds while it
runs (graphs of up to :data:`STAGE_MAX_NODES` nodes).

The step is cut at the first run of each node ``t`` (*cut* ``t``); *stage* ``t`` is the time
between cut ``t - 1`` and cut ``t``, where a schedule may run earlier nodes again. Binary
variables:

* ``R[t, p]``: node ``p`` runs (at least once) in stage ``t``;
* ``x[v, t]``: value ``v`` is on the device while node ``t`` first runs;

and a continuous ``K[v, t]``: ``v`` is on the device all through stage ``t``. Rows:

1. a node's inputs are resident while it first runs (``x[v, t] = 1`` for each input);
2. ``x[v, t] <= x[v, t - 1] + R[t, p(v)]``: resident at cut ``t`` only if it was at cut
   ``t - 1`` or its producer ran in stage ``t`` (values that cannot be made again stay from
   their first run to their last reader; required ones to the end);
3. ``R[t, p] <= x[u, t - 1] + R[t, p(u)]`` for each input ``u`` of ``p``: a rerun finds its
   inputs kept from cut ``t - 1`` or made again in the stage;
4. at cut ``t``: the resident values, ``t``'s outputs and workspace within the room;
5. while ``p`` runs in stage ``t``: its inputs, outputs and workspace and every other value
   resident all through the stage (``K[v, t] >= x[v, t - 1] + x[v, t] - 1 - R[t, p(v)]``:
   kept at both ends and not made again in between) within the room.

Row 5 is the one the cut relaxations of :mod:`remat.solver.bounds` lack: on a random layered
DAG the loss's backward node makes every last-layer gradient at once, so running it again
later holds all of them beside what the stage keeps, and a cheap-looking rerun does not fit.

Every recompute-only schedule whose first runs follow graph order, in any order of
recomputations, gives a 0/1 point of the model (``R``: "runs at least once", so the objective,
the time of the ``R``, is at most the schedule's extra time): the MIP's proven bound (HiGHS's
dual bound, within the deadline) bounds every such plan. It is a relaxation of Checkmate's
MILP (Jain et al. 2020) without its within-stage order and its memory at every event: one
memory row per rerun, with only the values kept all through the stage beside it.

References
----------
P. Jain et al. "Checkmate: Breaking the Memory Wall with Optimal Tensor Rematerialization."
MLSys 2020 (the stage decomposition).
"""

from __future__ import annotations

import math

from remat.ir import Graph
from remat.solver._mip import SparseModel
from remat.solver.deadline import Deadline
from remat.solver.lower_bound import LowerBound, eager_bound, solved_bound

STAGE_MAX_NODES = 64
"""Above this many nodes :func:`stage_bound` is not built (its rows grow as n^2 values)."""


def stage_bound(
    graph: Graph,
    budget_bytes: int,
    *,
    deadline: Deadline | None = None,
    integer: bool = True,
) -> LowerBound | None:
    """The stage relaxation's proven bound (the MIP's dual bound within ``deadline``, or
    with ``integer=False`` its LP value; see the module docstring). ``math.inf`` when it
    proves that no plan fits; None when the graph has more than :data:`STAGE_MAX_NODES`
    nodes or nothing was proven in time."""
    n = graph.num_nodes
    if n == 0 or n > STAGE_MAX_NODES:
        return None
    base = eager_bound(graph).time_s
    room = budget_bytes - graph.static_bytes - graph.input_bytes
    if room < 0:
        return LowerBound("stage", math.inf, "the budget is below what is held")
    for nd in graph.nodes:
        own = sum(graph.value(o).size_bytes for o in nd.outputs if not graph.is_static(o))
        if own + nd.workspace_bytes > room:
            return LowerBound("stage", math.inf, f"node {nd.id!r} alone exceeds the room")
    m = _build(graph, room, deadline)
    if m is None:
        return None
    model, scale_t = m
    if integer:
        model.integer = [not name.startswith("K") for name in model.names]
    how = "MIP bound" if integer else "LP"
    return solved_bound(
        model,
        method="stage",
        base_s=base,
        scale_t=scale_t,
        integer=integer,
        deadline=deadline,
        infeasible="no schedule fits (stage relaxation)",
        detail=f"stage relaxation, {how}",
    )


def _build(graph: Graph, room: int, deadline: Deadline | None) -> tuple[SparseModel, float] | None:
    """The model's columns and rows (module docstring), or None when ``deadline`` passed."""
    n = graph.num_nodes
    static = graph.static_ids()
    dyn = {
        v.id for v in graph.values if v.id not in static and v.kind != "input"
    }  # made by the step and held on the device
    size = {v.id: v.size_bytes for v in graph.values}
    required = set(graph.required)
    ins = [tuple(dict.fromkeys(x for x in nd.inputs if x in dyn)) for nd in graph.nodes]
    outs = [tuple(o for o in nd.outputs if o in dyn) for nd in graph.nodes]
    prod = {o: i for i, os in enumerate(outs) for o in os}
    readers: dict[str, list[int]] = {v: [] for v in prod}
    for i, xs in enumerate(ins):
        for x in xs:
            if x in readers:
                readers[x].append(i)
    rerun = [
        nd.recomputable and bool(outs[i]) and not any(o in required for o in outs[i])
        for i, nd in enumerate(graph.nodes)
    ]
    # the last cut at which a value, or a value made again from it, can still be read
    need_end: dict[str, int] = {}
    for i in reversed(range(n)):
        for v in outs[i]:
            end = n if v in required else max(readers[v], default=i)
            for k in readers[v]:
                if rerun[k]:
                    end = max([end, *(need_end[w] for w in outs[k])])
            need_end[v] = end
    m = SparseModel()
    scale_t = max(max(nd.time_s for nd in graph.nodes), 1e-30)
    scale_b = float(max(max(size.values(), default=1), 1))
    R: dict[tuple[int, int], int] = {}
    for t in range(n):
        for p in range(t):
            if rerun[p] and any(need_end[w] >= t for w in outs[p]):
                R[(t, p)] = m.add_col(f"R{t},{p}", 0, 1, cost=graph.nodes[p].time_s / scale_t)
    X: dict[tuple[str, int], int] = {}
    for v, p in prod.items():
        for t in range(p + 1, min(need_end[v], n - 1) + 1):
            X[(v, t)] = m.add_col(f"x{v},{t}", 0, 1)
    # (1) inputs resident while a node first runs; required values resident at the end
    for v, p in prod.items():
        for r in readers[v]:
            if r > p:
                m.add_row([(X[(v, r)], 1.0)], 1.0, math.inf)
        if v in required and p < n - 1:
            m.add_row([(X[(v, n - 1)], 1.0)], 1.0, math.inf)
    # (2) resident at cut t only if resident at cut t - 1 or made again in stage t
    for v, p in prod.items():
        for t in range(p + 2, min(need_end[v], n - 1) + 1):
            terms = [(X[(v, t)], 1.0), (X[(v, t - 1)], -1.0)]
            if (t, p) in R:
                terms.append((R[(t, p)], -1.0))
            m.add_row(terms, -math.inf, 0.0)
    if deadline is not None and deadline.expired():
        return None
    # (3) a rerun's inputs: kept from cut t - 1 or made again earlier in the stage
    for (t, p), c in R.items():
        for u in ins[p]:
            pu = prod[u]
            if pu == t - 1:
                continue  # made by node t - 1 itself, just before the stage
            terms = [(c, 1.0)]
            if (u, t - 1) in X:
                terms.append((X[(u, t - 1)], -1.0))
            if (t, pu) in R:
                terms.append((R[(t, pu)], -1.0))
            m.add_row(terms, -math.inf, 0.0)
    # (4) memory at each cut
    at_cut: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    for (v, t), c in X.items():
        at_cut[t].append((c, size[v] / scale_b))
    for t in range(n):
        fixed = sum(size[o] for o in outs[t]) + graph.nodes[t].workspace_bytes
        if at_cut[t]:
            m.add_row(at_cut[t], -math.inf, (room - fixed) / scale_b)
    if deadline is not None and deadline.expired():
        return None
    # (5) memory while a rerun runs: what the stage keeps all through, beside its own values
    K: dict[int, list[tuple[str, int]]] = {t: [] for t in range(n)}
    for (v, t), c in X.items():
        p = prod[v]
        if (v, t - 1) not in X and t - 1 != p:
            continue
        k = m.add_col(f"K{v},{t}", 0, 1)
        terms = [(c, 1.0), (k, -1.0)]
        hi = 0.0
        if (v, t - 1) in X:
            terms.append((X[(v, t - 1)], 1.0))
            hi = 1.0
        if (t, p) in R:
            terms.append((R[(t, p)], -1.0))
        m.add_row(terms, -math.inf, hi)
        K[t].append((v, k))
    for (t, p), c in R.items():
        own = set(ins[p]) | set(outs[p])
        held = sum(size[v] for v in own) + graph.nodes[p].workspace_bytes
        terms = [(k, size[v] / scale_b) for v, k in K[t] if v not in own]
        terms.append((c, held / scale_b))
        m.add_row(terms, -math.inf, room / scale_b)
    return m, scale_t
