"""The stage relaxation: a lower bound that charges the memory a recomputation holds while it
runs (graphs of up to :data:`STAGE_MAX_NODES` nodes).

The step is cut at the first run of each node ``t`` (*cut* ``t``); *stage* ``t`` is the time
between cut ``t - 1`` and cut ``t``, where a schedule may run earlier nodes again, in any
order and any number of times. Binary variables:

* ``R[t, p]``: node ``p`` runs (at least once) in stage ``t``; ``R2[t, p]``: at least twice;
* ``x[v, t]``: value ``v`` is on the device while node ``t`` first runs;
* ``O[t, p, q]`` (``p < q``): the last run of ``p`` in stage ``t`` comes before the last run
  of ``q``. A node that does not run in the stage counts as coming before every one that
  does, and those that do not run among themselves in graph order, so ``O`` describes a
  total order of the stage's nodes;

and continuous ``K[v, t]`` (``v`` is on the device all through stage ``t``) and ``H[v, t, p]``
(``v`` is on the device while the last run of ``p`` in stage ``t`` runs). Rows:

1. a node's inputs are resident while it first runs (``x[v, t] = 1`` for each input);
2. ``x[v, t] <= x[v, t - 1] + R[t, p(v)]``: resident at cut ``t`` only if it was at cut
   ``t - 1`` or its producer ran in stage ``t`` (values that cannot be made again stay from
   their first run to their last reader; required ones to the end);
3. ``R[t, p] <= x[u, t - 1] + R[t, p(u)]`` for each input ``u`` of ``p``: a rerun finds its
   inputs kept from cut ``t - 1`` or made again in the stage;
4. at cut ``t``: the resident values, ``t``'s outputs and workspace within the room;
5. while the last run of ``p`` in stage ``t`` runs: its inputs, outputs and workspace and
   every other value held then (``H[v, t, p]``, at least ``K[v, t]``) within the room, where
   ``K[v, t] >= x[v, t - 1] + x[v, t] - 1 - R[t, p(v)]``: kept at both ends and not made
   again in between;
6. ``O`` is an order: ``R[t, q] - R[t, p] <= O[t, p, q] <= 1 + R[t, q] - R[t, p]`` (a node that
   runs comes after one that does not) and no three in a cycle
   (``0 <= O[p, q] + O[q, r] - O[p, r] <= 1``);
7. for two nodes ``a``, ``b`` that may run in stage ``t``, writing ``[a < b]`` for ``a``'s last
   run coming first (``O`` or ``1 - O``):

   * a value ``v`` made by ``b`` and held at cut ``t``:
     ``H[v, t, a] >= R[t, a] + x[v, t] - [a < b] - 1``. After ``b``'s last run nothing makes
     ``v``, so it is on the device from then to cut ``t``; if ``a``'s last run comes later,
     ``v`` is held during it;
   * a value ``v`` read by ``b``: ``H[v, t, a] >= R[t, a] + R[t, b] + [a < b] - E - 2``, with
     ``E`` = ``[a < p(v)]`` and, in a second row, ``E`` = ``[p(v) < b] + R2[t, p(v)]``
     (``E = 0`` when ``p(v)`` does not run in the stage). ``b``'s last run reads ``v``; if
     ``a``'s last run comes before it, ``v`` is on the device all between unless a run of
     ``p(v)`` falls in between, which needs ``p(v)``'s last run after ``a``'s and, when that
     last run is also after ``b``'s, a second run of ``p(v)`` before it;
   * a value ``v`` made by ``b`` and read by ``a`` that was not held at cut ``t - 1``:
     ``R2[t, b] >= R[t, a] + [a < b] - x[v, t - 1] - 1``. ``a``'s last run reads ``v``, made
     by a run of ``b`` before it; if ``b``'s last run comes after ``a``'s, ``b`` ran twice.

Row 5 is the one the cut relaxations of :mod:`remat.solver.bounds` lack: on a random layered
DAG the loss's backward node makes every last-layer gradient at once, so running it again
later holds all of them beside what the stage keeps, and a cheap-looking rerun does not fit.
Rows 6 and 7 (stages with up to :data:`ORDER_MAX_RERUNS` nodes that may run again) charge
what two reruns of one stage hold for each other: without them, two reruns that each fit
beside what the stage keeps all through were allowed together although whichever runs first
leaves its outputs (or needs its inputs) beside the other (on a 20-node random DAG at 70%
they raise the bound from +3.4% to +5.3% over eager, the optimum +6.0%). They are added
lazily: the MIP is solved without them, then again with those of each stage where its point
reruns two or more nodes, until no stage is added. In a stage with at most one rerun they
hold at no cost (the rows of ``K`` imply them), so the last point is an optimum of the whole
model; each solve only adds rows, so the bound proven so far holds for the next one, which
gets it as a floor on the objective, and a deadline keeps the best proven.

Every recompute-only schedule whose first runs follow graph order, in any order of
recomputations, gives a 0/1 point of the model (``R`` and ``R2`` count runs at least once
and twice, so the objective, their time, is at most the schedule's extra time; ``O`` from the
order of the last runs, ``K`` and ``H`` from what is resident): the MIP's proven bound
(HiGHS's dual bound, within the deadline) bounds every such plan. It is a relaxation of
Checkmate's MILP (Jain et al. 2020) without its memory at every event and its fixed order
within a stage (Checkmate runs a stage's recomputations in graph order, once each; this
class does not, so its optimum can lie below Checkmate's: on a 23-node random DAG at 60%
the relaxation's own point is a schedule that fits at +14.2% where Checkmate's optimum is
+18.0%). The order variables are those of the linear ordering problem (Grötschel, Jünger and
Reinelt 1984), with its 3-cycle rows.

References
----------
P. Jain et al. "Checkmate: Breaking the Memory Wall with Optimal Tensor Rematerialization."
MLSys 2020 (the stage decomposition).

M. Grötschel, M. Jünger, G. Reinelt. "A Cutting Plane Algorithm for the Linear Ordering
Problem." Operations Research 32(6), 1984 (order variables and their 3-cycle inequalities).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from remat.ir import Graph, Plan, compute, free
from remat.solver._mip import SparseModel
from remat.solver.deadline import Deadline
from remat.solver.lower_bound import LowerBound, eager_bound, solved_bound

STAGE_MAX_NODES = 64
"""Above this many nodes :func:`stage_bound` is not built (its rows grow as n^2 values)."""

ORDER_MAX_RERUNS = 20
"""Stages where more nodes than this may run again get no order rows (rows 6-7, which grow as
the cube of that number); their reruns are charged only what the stage keeps all through."""


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
    built = _build(graph, room, deadline)
    if built is None:
        return None
    stage, scale_t = built
    model = stage.m
    if not integer:
        return solved_bound(
            model,
            method="stage",
            base_s=base,
            scale_t=scale_t,
            integer=False,
            deadline=deadline,
            infeasible="no schedule fits (stage relaxation)",
            detail="stage relaxation, LP",
        )
    extra, _ = _solve(stage, deadline)
    if extra is None:
        return None
    if math.isinf(extra):
        return LowerBound("stage", math.inf, "no schedule fits (stage relaxation)")
    detail = f"stage relaxation, MIP bound ({len(stage.ordered)} stages ordered)"
    return LowerBound("stage", base + extra * scale_t, detail)


def _solve(stage: _Stage, deadline: Deadline | None) -> tuple[float | None, np.ndarray | None]:
    """Solve the MIP, adding the order rows of each stage where its point reruns two or
    more nodes and solving again until none is added (or ``deadline``). Returns the proven
    extra time (model units; ``math.inf``: infeasible; None: nothing proven) and the point
    when the last solve was optimal: with every stage it reruns two or more nodes in
    ordered, an optimum of the whole model (rows 6 and 7 hold at no cost in a stage with one
    rerun: the rows of ``K`` imply them there)."""
    model = stage.m
    best: float | None = None
    while True:
        model.integer = [name[0] not in "KH" for name in model.names]
        left = None if deadline is None else deadline.left_s()
        if left is not None and left <= 0.05:
            return best, None
        sol = model.solve(time_limit_s=left)
        if sol.status == "infeasible":
            return math.inf, None
        if sol.bound is None or not math.isfinite(sol.bound):
            return best, None
        # the solver's tolerances: shave a millionth off the proven extra time; what is
        # proven holds for the model with more rows too (each point of it is one of this)
        extra = max(0.0, sol.bound) * (1 - 1e-6)
        best = extra if best is None else max(best, extra)
        if sol.status != "optimal" or sol.values is None:
            return best, None
        runs = Counter(t for (t, _), c in stage.R.items() if sol.values[c] > 0.5)
        if not any([stage.order(t) for t, k in runs.items() if k >= 2]):
            return best, sol.values
        floor = [(c, a) for c, a in enumerate(model.cost) if a]
        model.add_row(floor, best, math.inf)


def stage_schedule(
    graph: Graph, budget_bytes: int, *, deadline: Deadline | None = None
) -> Plan | None:
    """The schedule that the relaxation's optimal point describes: each stage's reruns in the
    order of their last runs (``O``), a second run (``R2``) before the first rerun that reads
    the node's outputs ahead of its last, then the stage's node; each value freed after
    its last read before it is made again. Where it fits the budget (:func:`remat.ir.simulate`
    judges it; a point that holds less than a real order does gives a plan that misses an
    input or exceeds the budget), it is a plan of the class at the
    bound's time, so the bound is the class optimum. None when the graph has more than
    :data:`STAGE_MAX_NODES` nodes, nothing fits, or the MIP was not solved in time."""
    n = graph.num_nodes
    room = budget_bytes - graph.static_bytes - graph.input_bytes
    if n == 0 or n > STAGE_MAX_NODES or room < 0:
        return None
    room = int(room * (1 - 1e-6))  # against HiGHS's tolerances (2 bytes over, unshaved)
    built = _build(graph, room, deadline)
    if built is None:
        return None
    stage = built[0]
    _, values = _solve(stage, deadline)
    if values is None:
        return None
    model = stage.m
    on = {name for name, v in zip(model.names, values, strict=True) if v > 0.5}
    order: list[int] = []
    for t in range(n):
        ps = [p for p in range(t) if f"R{t},{p}" in on]
        seq = ps  # graph order where the stage has no order rows
        if t in stage.ordered:
            # O[t, p, q] = 1: p's last run first; the number of nodes after p orders them
            after = {p: sum(1 for q in ps if q != p and _first(on, t, p, q)) for p in ps}
            seq = sorted(ps, key=lambda p: -after[p])
        for p in [p for p in ps if f"R2:{t},{p}" in on]:
            # a second run, before the first rerun that reads p's outputs ahead of its last
            made = set(graph.nodes[p].outputs)
            first = next(
                i for i, q in enumerate(seq) if q == p or made & set(graph.nodes[q].inputs)
            )
            seq.insert(first, p)
        order += [*seq, t]
    keep = set(graph.required) | set(graph.static_ids())
    keep |= {v.id for v in graph.values if v.kind == "input"}
    steps = []
    for i, k in enumerate(order):
        nd = graph.nodes[k]
        steps.append(compute(nd.id))
        for v in dict.fromkeys([*nd.inputs, *nd.outputs]):
            nxt = next(
                (
                    graph.nodes[j]
                    for j in order[i + 1 :]
                    if v in graph.nodes[j].inputs or v in graph.nodes[j].outputs
                ),
                None,
            )  # the next node to read or make v
            if v not in keep and (nxt is None or v not in nxt.inputs):
                steps.append(free(v))
    return Plan.of(steps)


def _first(on: set[str], t: int, p: int, q: int) -> bool:
    """Whether ``p``'s last run in stage ``t`` comes before ``q``'s in the point ``on``."""
    return f"O{t},{p},{q}" in on if p < q else f"O{t},{q},{p}" not in on


def _build(graph: Graph, room: int, deadline: Deadline | None) -> tuple[_Stage, float] | None:
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
    K: dict[int, dict[str, int]] = {t: {} for t in range(n)}
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
        K[t][v] = k
    if deadline is not None and deadline.expired():
        return None
    work = {
        (t, p): sum(size[v] for v in {*ins[p], *outs[p]}) + graph.nodes[p].workspace_bytes
        for t, p in R
    }
    stage = _Stage(
        m,
        X,
        R,
        K,
        ins,
        outs,
        prod,
        [nd.time_s / scale_t for nd in graph.nodes],
        size,
        work,
        room / scale_b,
        scale_b,
    )
    for t, p in R:
        stage.memory_row(t, p)
    return stage, scale_t


Terms = list[tuple[int, float]]
"""Terms of a row: (column, coefficient)."""


@dataclass
class _Stage:
    """The columns rows 6 and 7 read and the ones they add (``H``, ``R2``)."""

    m: SparseModel
    X: dict[tuple[str, int], int]
    R: dict[tuple[int, int], int]
    K: dict[int, dict[str, int]]
    ins: list[tuple[str, ...]]
    outs: list[tuple[str, ...]]
    prod: dict[str, int]
    cost: list[float]
    size: dict[str, int]
    work: dict[tuple[int, int], int]
    """(t, p) -> bytes of ``p``'s inputs, outputs and workspace."""
    room: float
    scale_b: float
    ordered: set[int] = field(default_factory=set)
    """Stages with order rows."""
    H: dict[tuple[int, int], dict[str, int]] = field(default_factory=dict)
    """(t, p) -> value -> column ``H[v, t, p]``."""
    R2: dict[tuple[int, int], int] = field(default_factory=dict)

    def at_cut(self, v: str, t: int) -> tuple[Terms, float] | None:
        """``x[v, t]`` as (terms, constant): its column, the constant 1 when node ``t``
        made ``v`` itself, or None when no point of the model holds ``v`` there."""
        if (v, t) in self.X:
            return [(self.X[(v, t)], 1.0)], 0.0
        if self.prod.get(v) == t:
            return [], 1.0
        return None

    def held(self, v: str, t: int, p: int) -> int:
        """The column ``H[v, t, p]``, at least ``K[v, t]``."""
        cols = self.H.setdefault((t, p), {})
        if v not in cols:
            cols[v] = h = self.m.add_col(f"H{v},{t},{p}", 0, 1)
            if v in self.K[t]:
                self.m.add_row([(h, 1.0), (self.K[t][v], -1.0)], 0.0, math.inf)
        return cols[v]

    def twice(self, t: int, p: int) -> int:
        """The column ``R2[t, p]`` (at most ``R[t, p]``, costing ``p``'s time)."""
        if (t, p) not in self.R2:
            self.R2[(t, p)] = c = self.m.add_col(f"R2:{t},{p}", 0, 1, cost=self.cost[p])
            self.m.add_row([(c, 1.0), (self.R[(t, p)], -1.0)], -math.inf, 0.0)
        return self.R2[(t, p)]

    def at_least(self, col: int, ones: Terms, less: Terms, k: float) -> None:
        """``col >= sum(ones) - sum(less) - k``, one row."""
        terms = [(col, 1.0), *((c, -a) for c, a in ones), *((c, a) for c, a in less)]
        self.m.add_row(terms, -k, math.inf)

    def memory_row(self, t: int, p: int) -> None:
        """Row 5 of ``p``'s last run in stage ``t``: with ``H`` where there is one, else
        ``K`` (a stage's order rows add the row again, with their ``H``)."""
        own = {*self.ins[p], *self.outs[p]}
        charged = {v: k for v, k in self.K[t].items() if v not in own}
        charged.update(self.H.get((t, p), {}))
        terms = [(k, self.size[v] / self.scale_b) for v, k in charged.items()]
        terms.append((self.R[(t, p)], self.work[(t, p)] / self.scale_b))
        self.m.add_row(terms, -math.inf, self.room)

    def order(self, t: int) -> bool:
        """Add rows 6 and 7 of stage ``t`` and its reruns' row 5 again with their ``H``;
        False when the stage has them already or more than :data:`ORDER_MAX_RERUNS` nodes
        that may run again."""
        ps = sorted(p for tt, p in self.R if tt == t)
        if t in self.ordered or len(ps) > ORDER_MAX_RERUNS:
            return False
        self.ordered.add(t)
        self._order_rows(t, ps)
        for p in ps:
            self.memory_row(t, p)
        return True

    def _order_rows(self, t: int, ps: list[int]) -> None:
        """Rows 6 and 7 of stage ``t`` over the nodes ``ps`` that may run in it (module
        docstring)."""
        m, R = self.m, self.R
        # before[(a, b)]: [a < b] as (+terms, -terms, constant)
        before: dict[tuple[int, int], tuple[Terms, Terms, float]] = {}
        col: dict[tuple[int, int], int] = {}  # O[t, p, q]
        for i, p in enumerate(ps):
            for q in ps[i + 1 :]:
                col[(p, q)] = o = m.add_col(f"O{t},{p},{q}", 0, 1)
                # (6) a node that runs comes after one that does not
                m.add_row([(o, 1.0), (R[(t, q)], -1.0), (R[(t, p)], 1.0)], 0.0, 1.0)
                before[(p, q)] = ([(o, 1.0)], [], 0.0)
                before[(q, p)] = ([], [(o, 1.0)], 1.0)
        for i, p in enumerate(ps):  # (6) no three in a cycle
            for j in range(i + 1, len(ps)):
                q = ps[j]
                for r in ps[j + 1 :]:
                    m.add_row(
                        [(col[(p, q)], 1.0), (col[(q, r)], 1.0), (col[(p, r)], -1.0)], 0.0, 1.0
                    )
        for a in ps:
            ra: Terms = [(R[(t, a)], 1.0)]
            own_a = set(self.ins[a]) | set(self.outs[a])
            for b in ps:
                if b == a:
                    continue
                on, off, k = before[(a, b)]
                # (7) made by b, held at cut t: held during a's last run unless b's comes later
                for v in self.outs[b]:
                    now = self.at_cut(v, t)
                    if v not in own_a and now is not None:
                        self.at_least(self.held(v, t, a), ra + now[0] + off, on, 1.0 - now[1] + k)
                # (7) read by b's last run, after a's: held during it unless remade between
                rb_on: Terms = [*ra, (R[(t, b)], 1.0), *on]
                for v in self.ins[b]:
                    if v in own_a:
                        continue
                    h, pv = self.held(v, t, a), self.prod[v]
                    if (a, pv) not in before:  # its producer does not run in the stage
                        self.at_least(h, rb_on, off, 2.0 - k)
                        continue
                    e_on, e_off, e_k = before[(a, pv)]
                    self.at_least(h, rb_on + e_off, off + e_on, 2.0 - k + e_k)
                    e_on, e_off, e_k = before[(pv, b)]
                    twice = [(self.twice(t, pv), 1.0)]
                    self.at_least(h, rb_on + e_off, off + e_on + twice, 2.0 - k + e_k)
                # (7) b makes what a reads, after a: b ran twice unless it was held at t - 1
                for v in self.outs[b]:
                    kept = self.at_cut(v, t - 1)
                    if v in self.ins[a] and kept is not None and kept[0]:
                        self.at_least(self.twice(t, b), ra + on, off + kept[0], 1.0 - k)
