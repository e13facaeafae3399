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
* :func:`closure_bound`: the same cut with recomputation's inputs counted. A producer that
  runs again after ``c`` reads its own inputs then, so each of them is resident at ``c`` or
  made again after ``c`` too (the set of nodes run again is closed under that rule), and
  values that eager PyTorch freed before ``c`` may have to be held across it. Dropping a
  cheap elementwise output only saves memory when its input is held or recomputed as well,
  which the plain knapsack ignores. Solved as an LP over "resident at c" and "runs again
  after c" variables (or a MIP within the time limit, whose proven bound is used); always at
  least the plain knapsack at the same cut (the knapsack is this LP without the closure
  rows). :func:`closure_bounds` takes the forward/backward cut and the cuts where the plain
  knapsack is largest.
* :func:`multicut_bound`: the closure relaxation at many cuts at once, each node's extra run
  paid once across them (an LP; graphs of up to :data:`MULTICUT_MAX_NODES` nodes). Different
  cuts short of room for different values must all be served, where the best single cut
  serves one: on random layered DAGs of 21-24 nodes at 70% it raised the bound from +4.7% to
  +7.9% and from +6.4% to +10.8% over eager.
* :func:`lp_bound`: the LP relaxation of Checkmate's MILP without any of its optional
  restrictions (exact class), where the model is small enough to build and solve in time.

How far below the optimum they lie depends on the family (``benchmarks/bounds.py`` measures
it against the unrestricted MILP). On small chains the best of them is 0.84-0.99 of the
optimum's overhead. On random layered DAGs they are far below it: on a 21-node DAG at 70%
the optimum is +18.2% over eager (proven) and the best bound +7.8%; on a 29-node one the
MILP's dual bound is +12.5% and the best bound again +7.8%. None of them counts the memory a
recomputation needs while it runs (a node that makes several large gradients at once makes
them all again), which is what those optima pay for.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from remat.ir import Graph
from remat.solver._mip import SparseModel
from remat.solver.deadline import Deadline, Expired
from remat.solver.lower_bound import LowerBound as LowerBound
from remat.solver.lower_bound import eager_bound as eager_bound
from remat.solver.lower_bound import solved_bound

LP_BOUND_MAX_NODES = 64
"""Above this many nodes :func:`lp_bound` does not build the exact model (it grows as n^2)."""

MULTICUT_ALL_CUTS_NODES = 64
"""Up to this many nodes :func:`best_bound` places the multi-cut MIP at every node."""

MULTICUT_MAX_NODES = 1000
"""Above this many nodes :func:`best_bound` skips :func:`multicut_bound` (its LP took 1-3 s on
759 nodes and 11 s on 2,002, and raised no bound of those sizes by more than 0.2 points)."""


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
    index: dict[str, int]
    """Value id -> its position in ``values``."""

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
            index={v: i for i, v in enumerate(values)},
        )


def _extra_at(graph: Graph, ix: _CutIndex, c: int, more_room: float = 0.0) -> float:
    """Least extra time (relaxed) forced by the first run of node ``c``, with ``more_room``
    bytes beside the budget's room there; inf if it cannot fit."""
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
    cap = ix.room_bytes + more_room - fixed
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
    graph: Graph,
    budget_bytes: int,
    *,
    max_cuts: int = 96,
    deadline: Deadline | None = None,
    more_room: Sequence[float] | None = None,
) -> LowerBound:
    """The best :func:`cut_bound` over the forward/backward cut and up to ``max_cuts`` cuts
    spread over the step (each is valid, so the largest is). Stops early at ``deadline``.
    ``more_room[c]``: bytes allowed beside the budget at the first run of node ``c`` (what a
    plan that offloads may hold on the host then; :func:`remat.solver.offload.combined_bound`)."""
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
        extra = _extra_at(graph, ix, c, 0.0 if more_room is None else float(more_room[c]))
        if extra > best:
            best, where = extra, c
        if math.isinf(best):
            break
    return LowerBound(
        "cut", base + best, f"knapsack at node {graph.nodes[where].id!r} ({len(cuts)} cuts)"
    )


def _cut_rows(
    m: SparseModel,
    graph: Graph,
    ix: _CutIndex,
    c: int,
    new_y: Callable[[int], int],
    deadline: Deadline | None,
) -> float | None:
    """Add the closure relaxation's rows at the first run of node ``c`` to ``m``: columns
    ``x`` (a value resident then) and, made by ``new_y``, ``y`` (a node runs again after it);
    every value needed across ``c`` resident or made again, every node run again with its
    inputs resident or made again, the resident ones within the room left beside node
    ``c``'s own working set. Returns that room in bytes (``math.inf`` when the working set
    alone exceeds the room: no plan fits), or None when ``deadline`` passed first."""
    node = graph.nodes[c]
    vindex = ix.index
    inputs = {vindex[x] for x in node.inputs if x in vindex}
    fixed = float(sum(ix.size[i] for i in inputs))
    fixed += sum(
        graph.value(o).size_bytes
        for o in node.outputs
        if not graph.is_static(o) and graph.value(o).kind != "input"
    )
    cap = ix.room_bytes - fixed - node.workspace_bytes
    if cap < 0:
        return math.inf
    x: dict[int, int] = {}  # value -> column (resident at c)
    y: dict[int, int] = {}  # node -> column (runs again after c)
    todo: list[int] = []

    def x_of(v: int) -> int:
        if v not in x:
            x[v] = m.add_col(f"x{v},{c}", 0.0, 1.0)
        return x[v]

    def y_of(p: int) -> int | None:
        if not ix.rerun[p]:
            return None
        if p not in y:
            y[p] = new_y(p)
            todo.append(p)
        return y[p]

    for v in np.flatnonzero((ix.producer < c) & (ix.last_need >= c)).tolist():
        if v in inputs:
            continue
        yp = y_of(int(ix.producer[v]))
        m.add_row([(x_of(v), 1.0)] + ([(yp, 1.0)] if yp is not None else []), 1.0, math.inf)
    while todo:
        if deadline is not None and deadline.expired():
            return None
        p = todo.pop()
        for u_id in graph.nodes[p].inputs:
            u = vindex.get(u_id)
            if u is None or u in inputs:
                continue  # static, a graph input, or resident anyway (read by c)
            yu = y_of(int(ix.producer[u]))
            terms = [(x_of(u), 1.0), (y[p], -1.0)] + ([(yu, 1.0)] if yu is not None else [])
            m.add_row(terms, 0.0, math.inf)
    if x:
        scale_b = max(float(ix.size.max(initial=0.0)), 1.0)
        sizes = [(col, float(ix.size[v]) / scale_b) for v, col in x.items()]
        m.add_row(sizes, -math.inf, cap / scale_b)
    return cap


def closure_bound(
    graph: Graph,
    budget_bytes: int,
    position: int,
    *,
    deadline: Deadline | None = None,
    integer: bool = False,
) -> LowerBound | None:
    """The relaxation at the first run of the node at ``position`` with recomputation's
    inputs counted (see the module docstring): which values are resident then and which
    earlier nodes run again after it, closed under "a node that runs again reads its inputs,
    resident or made again", within the room. Its LP relaxation (or, with ``integer``, the
    MIP's proven bound within the deadline); None when no bound was proven in time."""
    if not 0 <= position < graph.num_nodes:
        raise ValueError(f"position must be in [0, {graph.num_nodes}), got {position}")
    base = eager_bound(graph).time_s
    if budget_bytes < graph.static_bytes + graph.input_bytes:
        return LowerBound("closure", math.inf, "the budget is below what is held")
    ix = _CutIndex.of(graph, budget_bytes)
    node = graph.nodes[position]
    m = SparseModel()
    scale_t = max(float(ix.node_time.max(initial=0.0)), 1e-30)

    def new_y(p: int) -> int:
        return m.add_col(f"y{p}", 0.0, 1.0, integer=integer, cost=ix.node_time[p] / scale_t)

    rows = _cut_rows(m, graph, ix, position, new_y, deadline)
    if rows is None:
        return None
    if math.isinf(rows):
        return LowerBound("closure", math.inf, f"node {node.id!r} alone exceeds the room")
    if m.num_cols == 0:
        return LowerBound("closure", base, f"nothing is needed across node {node.id!r}")
    left = None if deadline is None else deadline.left_s()
    if left is not None and left <= 0.05:
        return None
    sol = m.solve(relax=not integer, time_limit_s=left)
    if sol.status == "infeasible":
        return LowerBound("closure", math.inf, f"nothing fits at node {node.id!r}")
    if sol.bound is None or not math.isfinite(sol.bound):
        return None
    # the solver's tolerances: shave a millionth off the proven extra time
    extra = max(0.0, sol.bound) * scale_t * (1 - 1e-6)
    kind = "MIP bound" if integer else "LP"
    return LowerBound("closure", base + extra, f"{kind} at node {node.id!r}")


def closure_bounds(
    graph: Graph,
    budget_bytes: int,
    *,
    max_cuts: int = 3,
    deadline: Deadline | None = None,
    integer: bool = False,
    more_room: Sequence[float] | None = None,
) -> LowerBound | None:
    """The best :func:`closure_bound` over the forward/backward cut and the cuts where the
    plain knapsack (:func:`cut_bound`) is largest, up to ``max_cuts`` of them, before
    ``deadline``; None when none was proven. ``more_room`` as in :func:`cut_bounds`."""
    n = graph.num_nodes
    if n == 0:
        return None
    ix = _CutIndex.of(graph, budget_bytes)

    def room(c: int) -> int:
        return 0 if more_room is None else int(more_room[c])

    first_bwd = next((i for i, nd in enumerate(graph.nodes) if nd.phase == "backward"), n - 1)
    spread = np.linspace(0, n - 1, num=min(n, 48)).round().astype(int)
    ranked = sorted(
        dict.fromkeys(int(c) for c in spread if c != first_bwd),
        key=lambda c: -_extra_at(graph, ix, c, room(c)),
    )
    best: LowerBound | None = None
    for c in [first_bwd, *ranked][: max(1, max_cuts)]:
        if deadline is not None and deadline.expired():
            break
        b = closure_bound(graph, budget_bytes + room(c), c, deadline=deadline, integer=integer)
        if b is not None and (best is None or b.time_s > best.time_s):
            best = b
        if best is not None and math.isinf(best.time_s):
            break
    return best


def multicut_bound(
    graph: Graph,
    budget_bytes: int,
    *,
    max_cuts: int = 24,
    deadline: Deadline | None = None,
    integer: bool = False,
) -> LowerBound | None:
    """The closure relaxation at several cuts at once, paying each node's extra run once.

    At each cut ``c`` the rows are :func:`closure_bound`'s, on variables of that cut:
    ``x[v, c]`` (``v`` resident when ``c`` first runs) and ``y[p, c]`` (``p`` runs again
    after it). A node that runs again after any cut runs again at least once, so
    ``w[p] >= y[p, c]`` for every cut and the objective is the time of the ``w``. Each cut
    alone is its closure bound; together they are at least the largest of them, and more
    where different cuts are short of room for different values: a value dropped to make
    room at an early cut and another at a late one are both paid for, where the best single
    cut pays for one. The cuts are the forward/backward cut and those where the plain
    knapsack (:func:`cut_bound`) is largest. Its LP relaxation, or with ``integer`` the MIP's
    proven (dual) bound within ``deadline``: every variable is 0/1 in a real schedule, and
    the integral knapsacks at the cuts lift the bound far above the LP's (a 21-node random
    DAG at 70%: +17.4% against the LP's +7.8%, the optimum +18.2%). None when nothing was
    proven before ``deadline``.
    """
    n = graph.num_nodes
    if n == 0:
        return None
    base = eager_bound(graph).time_s
    if budget_bytes < graph.static_bytes + graph.input_bytes:
        return LowerBound("multicut", math.inf, "the budget is below what is held")
    ix = _CutIndex.of(graph, budget_bytes)
    first_bwd = next((i for i, nd in enumerate(graph.nodes) if nd.phase == "backward"), n - 1)
    spread = np.linspace(0, n - 1, num=min(n, 4 * max_cuts)).round().astype(int)
    scored = [(c, _extra_at(graph, ix, c)) for c in dict.fromkeys(int(c) for c in spread)]
    if any(math.isinf(e) for _, e in scored) or math.isinf(_extra_at(graph, ix, first_bwd)):
        return LowerBound("multicut", math.inf, "a cut alone exceeds the room")
    ranked = [c for c, e in sorted(scored, key=lambda ce: -ce[1]) if e > 0 and c != first_bwd]
    cuts = [first_bwd, *ranked[: max(0, max_cuts - 1)]]
    m = SparseModel()
    scale_t = max(float(ix.node_time.max(initial=0.0)), 1e-30)
    w: dict[int, int] = {}  # node -> column (runs again after some cut)

    def w_of(p: int) -> int:
        if p not in w:
            w[p] = m.add_col(f"w{p}", 0.0, 1.0, cost=ix.node_time[p] / scale_t)
        return w[p]

    for c in sorted(cuts):
        if deadline is not None and deadline.expired():
            return None

        def new_y(p: int, c: int = c) -> int:
            y = m.add_col(f"y{p},{c}", 0.0, 1.0)
            m.add_row([(w_of(p), 1.0), (y, -1.0)], 0.0, math.inf)  # w[p] >= y[p, c]
            return y

        rows = _cut_rows(m, graph, ix, c, new_y, deadline)
        if rows is None:
            return None
        if math.isinf(rows):
            return LowerBound(
                "multicut", math.inf, f"node {graph.nodes[c].id!r} alone exceeds the room"
            )
    if not w:
        return LowerBound("multicut", base, "nothing needs to run again")
    if integer:
        m.integer = [True] * m.num_cols  # every column is a 0/1 decision of a real schedule
    kind = "MIP bound" if integer else "LP"
    return solved_bound(
        m,
        method="multicut",
        base_s=base,
        scale_t=scale_t,
        integer=integer,
        deadline=deadline,
        infeasible="the cuts' rows are infeasible",
        detail=f"{kind} over {len(cuts)} cuts",
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
    """The largest of the bounds above that fit before ``deadline``: the knapsacks at cuts on
    a quarter of the time, then the closure relaxations, the multi-cut LP (graphs of up to
    :data:`MULTICUT_MAX_NODES` nodes), then (small graphs) the exact LP.
    With ``offload`` (plans may move values to the host) only the eager bound holds."""
    bounds = [eager_bound(graph)]
    if not offload:
        quarter = None if deadline is None else deadline.share(0.25)
        bounds.append(cut_bounds(graph, budget_bytes, deadline=quarter))
        closure = closure_bounds(graph, budget_bytes, deadline=deadline)
        if closure is not None:
            bounds.append(closure)
        bounds.extend(_mip_bounds(graph, budget_bytes, deadline))
        if lp:
            b = lp_bound(graph, budget_bytes, deadline=deadline)
            if b is not None:
                bounds.append(b)
    return max(bounds, key=lambda b: b.time_s)


def _mip_bounds(graph: Graph, budget_bytes: int, deadline: Deadline | None) -> list[LowerBound]:
    """The integral relaxations :func:`best_bound` adds: the stage relaxation
    (:mod:`remat.solver.bounds_stage`, small graphs) and the multi-cut MIP at every cut
    (graphs of up to :data:`MULTICUT_ALL_CUTS_NODES` nodes) or at the default ones, each on
    half the time left; the multi-cut LP where the MIP proved nothing in time."""
    from remat.solver.bounds_stage import stage_bound

    out: list[LowerBound] = []
    n = graph.num_nodes
    half = None if deadline is None else deadline.share(0.5)
    stage = stage_bound(graph, budget_bytes, deadline=half)
    if stage is not None:
        out.append(stage)
        if stage.proves_infeasible:
            return out
    if n > MULTICUT_MAX_NODES:
        return out
    cuts = n if n <= MULTICUT_ALL_CUTS_NODES else 24
    half = None if deadline is None else deadline.share(0.5)
    multi = multicut_bound(graph, budget_bytes, max_cuts=cuts, deadline=half, integer=True)
    if multi is None:
        multi = multicut_bound(graph, budget_bytes, max_cuts=cuts, deadline=deadline)
    if multi is not None:
        out.append(multi)
    return out
