"""Lower bounds on the time of every recompute-only schedule within a budget, at any size.

The class bounded is the one every remat schedule lies in and the exact MILP optimises over:
plans that compute each node for the first time in graph order (recomputations anywhere),
without offloading. Each bound is a :class:`LowerBound`; ``math.inf`` proves that no plan of
the class fits.

* :func:`eager_bound`: every node runs at least once.
* :func:`cut_bound`: a relaxation at a cut of the step. When node ``c`` first runs, every
  dynamic value made before ``c`` and still needed at or after ``c`` (read by a node at or
  after ``c``, or required at the end) is either resident, or its producer must run again
  after ``c``. The resident ones, ``c``'s own inputs and outputs and its workspace must fit
  the room (budget less static bytes and inputs). Choosing which producers to keep is a
  knapsack over the room; its LP relaxation (the greedy fractional knapsack, exact for the
  relaxation) bounds the extra time from below. At the forward/backward cut this is the
  knapsack of the issue; :func:`cut_bounds` takes the best over a spread of cuts.
* :func:`lp_bound`: the LP relaxation of Checkmate's MILP without any of its optional
  restrictions (exact class), where the model is small enough to build and solve in time.

Every bound is tested to lie at or below the exact optimum on random small graphs (the MILP
and the exhaustive oracle of the tests).

References
----------
P. Jain et al. "Checkmate: Breaking the Memory Wall with Optimal Tensor Rematerialization."
MLSys 2020 (the MILP whose relaxation :func:`lp_bound` solves).

G. B. Dantzig. "Discrete-variable extremum problems." Operations Research 5(2), 1957 (the
fractional knapsack's greedy solution).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from remat.ir import Graph
from remat.solver.deadline import Deadline, Expired

LP_BOUND_MAX_NODES = 64
"""Above this many nodes :func:`lp_bound` does not build the exact model (it grows as n^2)."""


@dataclass(frozen=True)
class LowerBound:
    """A lower bound ``time_s`` on the total time of any plan of the class within the budget
    (``math.inf``: no plan fits); ``method`` names how it was proven."""

    method: str
    time_s: float
    detail: str = ""

    @property
    def proves_infeasible(self) -> bool:
        return math.isinf(self.time_s)


def eager_bound(graph: Graph) -> LowerBound:
    """Every node runs at least once."""
    return LowerBound("eager", sum(n.time_s for n in graph.nodes), "every node runs once")


@dataclass(frozen=True)
class _CutIndex:
    """Per dynamic value: producer position, the last position that needs it, size; per node:
    time and whether it may run again."""

    values: tuple[str, ...]
    producer: np.ndarray
    last_need: np.ndarray
    size: np.ndarray
    node_time: np.ndarray
    rerun: np.ndarray
    room_bytes: int

    @classmethod
    def of(cls, graph: Graph, budget_bytes: int) -> _CutIndex:
        n = graph.num_nodes
        values, prod, last, size = [], [], [], []
        for v in graph.values:
            p = graph.producer_position(v.id)
            if p is None or v.kind == "input" or graph.is_static(v.id):
                continue
            readers = graph.consumer_positions(v.id)
            end = n if graph.is_required(v.id) else max(readers, default=p)
            values.append(v.id)
            prod.append(p)
            last.append(end)
            size.append(v.size_bytes)
        room = budget_bytes - graph.static_bytes - graph.input_bytes
        return cls(
            values=tuple(values),
            producer=np.asarray(prod, dtype=np.int64),
            last_need=np.asarray(last, dtype=np.int64),
            size=np.asarray(size, dtype=np.float64),
            node_time=np.asarray([nd.time_s for nd in graph.nodes], dtype=np.float64),
            rerun=np.asarray([nd.recomputable for nd in graph.nodes], dtype=bool),
            room_bytes=room,
        )


def _extra_at(graph: Graph, ix: _CutIndex, c: int) -> float:
    """Least extra time (relaxed) forced by the first run of node ``c``; inf if it cannot fit."""
    node = graph.nodes[c]
    live = (ix.producer < c) & (ix.last_need >= c)
    vid = np.flatnonzero(live)
    n = graph.num_nodes
    inputs = set(node.inputs)
    forced_v = np.asarray([ix.values[i] in inputs for i in vid], dtype=bool)
    prod = ix.producer[vid]
    forced_v |= ~ix.rerun[prod]
    fixed = float(ix.size[vid][forced_v].sum())
    dyn_out = sum(
        graph.value(o).size_bytes
        for o in node.outputs
        if not graph.is_static(o) and graph.value(o).kind != "input"
    )
    fixed += dyn_out + node.workspace_bytes
    cap = ix.room_bytes - fixed
    if cap < 0:
        return math.inf
    # items: producers with needed outputs that are not forced; weight = their bytes
    free_p = prod[~forced_v]
    w = np.bincount(free_p, weights=ix.size[vid][~forced_v], minlength=n)
    items = np.flatnonzero(w > 0)
    if len(items) == 0:
        return 0.0
    weight = w[items]
    value = ix.node_time[items]
    total = float(value.sum())
    order = np.argsort(-(value / weight), kind="stable")
    cw = np.cumsum(weight[order])
    cv = np.cumsum(value[order])
    k = int(np.searchsorted(cw, cap, side="right"))  # items 0..k-1 fit whole
    kept = float(cv[k - 1]) if k > 0 else 0.0
    if k < len(order):
        room_left = cap - (float(cw[k - 1]) if k > 0 else 0.0)
        kept += float(value[order[k]]) * room_left / float(weight[order[k]])
    return max(0.0, total - kept)


def cut_bound(graph: Graph, budget_bytes: int, position: int) -> LowerBound:
    """The knapsack relaxation at the first run of the node at ``position`` (see the module
    docstring)."""
    if not 0 <= position < graph.num_nodes:
        raise ValueError(f"position must be in [0, {graph.num_nodes}), got {position}")
    ix = _CutIndex.of(graph, budget_bytes)
    extra = _extra_at(graph, ix, position)
    base = eager_bound(graph).time_s
    return LowerBound("cut", base + extra, f"knapsack at node {graph.nodes[position].id!r}")


def cut_bounds(
    graph: Graph, budget_bytes: int, *, max_cuts: int = 96, deadline: Deadline | None = None
) -> LowerBound:
    """The best :func:`cut_bound` over the forward/backward cut and up to ``max_cuts`` cuts
    spread over the step (each is valid, so the largest is). Stops early at ``deadline``."""
    n = graph.num_nodes
    base = eager_bound(graph).time_s
    if n == 0 or budget_bytes < graph.static_bytes + graph.input_bytes:
        return LowerBound("cut", math.inf if n else base, "the budget is below what is held")
    ix = _CutIndex.of(graph, budget_bytes)
    first_bwd = next((i for i, nd in enumerate(graph.nodes) if nd.phase == "backward"), n - 1)
    spread = np.linspace(0, n - 1, num=min(n, max(1, max_cuts))).round().astype(int)
    cuts = [first_bwd, *dict.fromkeys(int(c) for c in spread if c != first_bwd)]
    best, where = 0.0, first_bwd
    for c in cuts:
        if deadline is not None and deadline.expired() and c != first_bwd:
            break
        extra = _extra_at(graph, ix, c)
        if extra > best:
            best, where = extra, c
        if math.isinf(best):
            break
    return LowerBound(
        "cut", base + best, f"knapsack at node {graph.nodes[where].id!r} ({len(cuts)} cuts)"
    )


def lp_bound(
    graph: Graph, budget_bytes: int, *, deadline: Deadline | None = None
) -> LowerBound | None:
    """The LP relaxation of Checkmate's exact model (no optional restriction), or None when
    the graph has more than :data:`LP_BOUND_MAX_NODES` nodes, the LP did not finish before
    ``deadline``, or it has no proven value."""
    from remat.solver.checkmate import CheckmateModel

    if graph.num_nodes > LP_BOUND_MAX_NODES or graph.num_nodes == 0:
        return None
    if budget_bytes < graph.static_bytes + graph.input_bytes:
        return LowerBound("lp", math.inf, "the budget is below what is held")
    left = math.inf if deadline is None else deadline.left_s()
    if left <= 0.05:
        return None
    try:
        cm = CheckmateModel.build(
            graph,
            budget_bytes,
            recompute_backward=True,
            recompute_in_forward=True,
            lazy=False,
            window=None,
            deadline=deadline,
        )
    except Expired:
        return None
    if budget_bytes < cm.lower_bound_peak():
        return LowerBound("lp", math.inf, "a node needs more than the budget")
    sol = cm.model.solve(relax=True, time_limit_s=None if math.isinf(left) else max(0.05, left))
    if sol.status == "infeasible":
        return LowerBound("lp", math.inf, "the LP relaxation is infeasible")
    if sol.status != "optimal" or sol.bound is None:
        return None
    return LowerBound("lp", sol.bound * cm.time_unit_s, "LP relaxation of the exact MILP")


def best_bound(
    graph: Graph,
    budget_bytes: int,
    *,
    deadline: Deadline | None = None,
    offload: bool = False,
    lp: bool = True,
) -> LowerBound:
    """The largest of the bounds above that fit before ``deadline``. With ``offload`` (plans
    may move values to the host) only the eager bound holds."""
    bounds = [eager_bound(graph)]
    if not offload:
        bounds.append(cut_bounds(graph, budget_bytes, deadline=deadline))
        if lp:
            b = lp_bound(graph, budget_bytes, deadline=deadline)
            if b is not None:
                bounds.append(b)
    return max(bounds, key=lambda b: b.time_s)
