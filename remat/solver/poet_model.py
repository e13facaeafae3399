"""The MILP of ``poet``: Checkmate's stages with POET's paging decisions per value, the host
link's two copy streams and the stalls they cause (the solver and the formulation's write-up
are :mod:`remat.solver.poet`).

:func:`build` makes the model of one graph and budget; :func:`read_plan` turns a 0/1 solution
into a plan of remat steps. Variables per stage ``t`` (frontier node ``t``) and dynamic value
``v`` (made by node ``p``):

* ``R[t, k]``: node ``k`` runs in stage ``t`` (``R[t, t] = 1``);
* ``K[t, v]``: ``v`` is on the device when stage ``t - 1`` ends (after its frees);
* ``O[t, v]`` / ``P[t, v]``: an offload / a prefetch of ``v`` is issued at the boundary before
  stage ``t``; ``L[t, v]``: the offload copy of ``v`` is done, its device bytes released,
  before stage ``t`` starts; ``F[t, v, k]``: ``v`` is freed right after node ``k`` in stage
  ``t``; ``A[t, v]``: a recomputation allocates ``v``;
* times (continuous): ``B[t]`` / ``E[t]`` when stage ``t``'s computes start / end on the
  compute stream, ``X[t]`` / ``Y[t]`` when the device-to-host / host-to-device stream is free
  after the boundary's copies, ``Z`` the step's end.

Readable in stage ``t``: ``S = K - O + P``; held: ``S + Q`` with ``Q = sum(O up to t) - L``
(copies in flight hold their bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from remat.ir import Graph, Plan, Step
from remat.ir.device_profile import HostLink
from remat.solver._mip import SparseModel
from remat.solver.milp_index import MilpIndex
from remat.solver.problem import room_bytes

Term = tuple[int, float]
COPY_COST = 1e-6
"""Objective weight of one copy, relative to the eager step's time: of two plans equally fast,
the one that moves less."""


@dataclass
class PoetModel:
    """The MILP and its variables (columns of ``model``), built by :func:`build`."""

    index: MilpIndex
    link: HostLink
    offload: bool
    model: SparseModel = field(default_factory=SparseModel)
    R: dict[tuple[int, int], int] = field(default_factory=dict)
    K: dict[tuple[int, str], int] = field(default_factory=dict)
    O: dict[tuple[int, str], int] = field(default_factory=dict)  # noqa: E741
    P: dict[tuple[int, str], int] = field(default_factory=dict)
    L: dict[tuple[int, str], int] = field(default_factory=dict)
    F: dict[tuple[int, str, int], int] = field(default_factory=dict)
    events: list[list[int]] = field(default_factory=list)
    time_unit_s: float = 1.0
    byte_unit: float = 1.0

    @property
    def graph(self) -> Graph:
        return self.index.graph

    # -- linear expressions: lists of (column, coefficient) plus a constant -------------------

    def r(self, t: int, k: int) -> tuple[list[Term], float]:
        if k == t:
            return [], 1.0
        c = self.R.get((t, k))
        return ([(c, 1.0)], 0.0) if c is not None else ([], 0.0)

    def kept(self, t: int, v: str) -> tuple[list[Term], float]:
        """``K[t, v]``: a constant 1 for required values once made, 0 past the last stage."""
        ix = self.index
        if v in ix.required and t > ix.producer[v]:
            return [], 1.0
        c = self.K.get((t, v))
        return ([(c, 1.0)], 0.0) if c is not None else ([], 0.0)

    def readable(self, t: int, v: str) -> tuple[list[Term], float]:
        terms, const = self.kept(t, v)
        terms = list(terms)
        if (t, v) in self.O:
            terms.append((self.O[(t, v)], -1.0))
        if (t, v) in self.P:
            terms.append((self.P[(t, v)], 1.0))
        return terms, const

    def in_flight(self, t: int, v: str) -> list[Term]:
        """``Q[t, v]``: the offloads issued up to ``t`` less the release by ``t``."""
        terms = [(c, 1.0) for (a, w), c in self.O.items() if w == v and a <= t]
        if (t, v) in self.L:
            terms.append((self.L[(t, v)], -1.0))
        return terms


def _le(m: SparseModel, lhs: list[tuple[list[Term], float]], rhs: list[tuple[list[Term], float]],
        slack: float = 0.0) -> None:  # fmt: skip
    """sum(lhs) <= sum(rhs) + slack over expressions."""
    terms: list[Term] = []
    const = 0.0
    for ts, c in lhs:
        terms += ts
        const += c
    for ts, c in rhs:
        terms += [(col, -a) for col, a in ts]
        const -= c
    if terms:
        m.add_row(terms, -math.inf, slack - const)
    elif const > slack + 1e-9:
        raise AssertionError("a constant row of the paging MILP is violated")


def offloadable(ix: MilpIndex) -> list[str]:
    """Values that may go to the host: made by the step, not required, read after their
    producer, of some size."""
    return [
        v
        for v, p in ix.producer.items()
        if v not in ix.required and ix.size[v] > 0 and ix.last_read[v] > p + 1
    ]


def build(graph: Graph, budget_bytes: int, *, offload: bool, margin: float = 0.0) -> PoetModel:
    """The MILP of ``graph`` under ``budget_bytes`` (``offload=False``: recompute only)."""
    ix = MilpIndex.of(graph, recompute_backward=True)
    link = graph.link
    pm = PoetModel(ix, link, offload)
    m = pm.model
    n = ix.num_nodes
    nodes = graph.nodes
    base = sum(nd.time_s for nd in nodes)
    tu = pm.time_unit_s = base / 1e3 if base > 0 else 1.0
    bu = pm.byte_unit = max(1.0, (budget_bytes - graph.static_bytes) / 1e6)
    values = list(ix.producer)
    moved = offloadable(ix) if offload else []

    def d2h(v: str) -> float:
        return link.offload_s(ix.size[v]) / tu

    def h2d(v: str) -> float:
        return link.prefetch_s(ix.size[v]) / tu

    # -- columns ----------------------------------------------------------------------------
    for t in range(n):
        ev = [k for k in range(t) if ix.rerun[k]]
        for k in ev:
            pm.R[(t, k)] = m.add_col(f"R[{t},{k}]", 0, 1, integer=True)
        pm.events.append([*ev, t])
    for v in values:
        p = ix.producer[v]
        if v in ix.required:
            continue
        for t in range(p + 1, n):
            pm.K[(t, v)] = m.add_col(f"K[{t},{v}]", 0, 1, integer=True)
    copy_cost = COPY_COST * 1e3
    for v in moved:
        p = ix.producer[v]
        for t in range(p + 1, ix.last_read[v] + 1):
            pm.O[(t, v)] = m.add_col(f"O[{t},{v}]", 0, 1, integer=True, cost=copy_cost)
        for t in range(p + 2, ix.last_read[v] + 1):
            pm.P[(t, v)] = m.add_col(f"P[{t},{v}]", 0, 1, integer=True, cost=copy_cost)
        for t in range(p + 1, n):
            pm.L[(t, v)] = m.add_col(f"L[{t},{v}]", 0, 1, integer=True)
    B = [m.add_col(f"B[{t}]", 0, math.inf) for t in range(n)]
    E = [m.add_col(f"E[{t}]", 0, math.inf) for t in range(n)]
    X = [m.add_col(f"X[{t}]", 0, math.inf) for t in range(n)]
    Y = [m.add_col(f"Y[{t}]", 0, math.inf) for t in range(n)]
    Z = m.add_col("Z", 0, math.inf, cost=1.0)
    big = (n + 1) * base / tu + sum(d2h(v) + h2d(v) for v in moved) + 1.0

    # -- paging: at most one round trip per value, in order (POET's M_out, M_in) -------------
    for v in moved:
        outs = [c for (a, w), c in pm.O.items() if w == v]
        ins = {a: c for (a, w), c in pm.P.items() if w == v}
        m.add_row([(c, 1.0) for c in outs], -math.inf, 1.0)
        m.add_row([(c, 1.0) for c in ins.values()], -math.inf, 1.0)
        for t, c in ins.items():
            # a prefetch follows an offload issued earlier, of a value not on the device
            m.add_row([(c, 1.0)] + [(pm.O[(a, v)], -1.0) for a in range(t) if (a, v) in pm.O],
                      -math.inf, 0.0)  # fmt: skip
            _le(m, [([(c, 1.0)], 0.0), pm.kept(t, v)], [], 1.0)
        for (a, w), c in pm.O.items():
            if w == v:
                _le(m, [([(c, 1.0)], 0.0)], [pm.kept(a, v)])  # only what is on the device
        for t in range(ix.producer[v] + 1, n):
            lt = pm.L[(t, v)]
            # released only after an offload issued by then, and for good
            m.add_row([(lt, 1.0)] + [(pm.O[(a, v)], -1.0) for a in range(t + 1) if (a, v) in pm.O],
                      -math.inf, 0.0)  # fmt: skip
            if (t - 1, v) in pm.L:
                m.add_row([(pm.L[(t - 1, v)], 1.0), (lt, -1.0)], -math.inf, 0.0)

    # -- residency (Checkmate's families with paging) ----------------------------------------
    for t in range(n):
        ev = pm.events[t]
        for k in ev:
            for x in ix.ins[k]:
                # (1) read only what is readable or recomputed before in the stage
                rhs = [pm.readable(t, x)]
                p = ix.producer[x]
                if p in ev and p < k:
                    rhs.append(pm.r(t, p))
                _le(m, [pm.r(t, k)], rhs)
            if k < t:
                for w in ix.outs[k]:
                    # no recomputation over a copy in flight (the simulator refuses it)
                    q = pm.in_flight(t, w)
                    if q:
                        _le(m, [pm.r(t, k), (q, 0.0)], [], 1.0)
    for v in values:
        p = ix.producer[v]
        if v in ix.required:
            continue
        for t in range(p + 1, n):
            # (2) kept into t + 1 only if readable in t or (re)computed in t
            _le(m, [pm.kept(t + 1, v)], [pm.readable(t, v), pm.r(t, p)])
            # (3) readable in t only if read in t or kept further (else it would never be freed)
            readers = [pm.r(t, j) for j in ix.consumers[v] if j in pm.events[t]]
            if p in pm.events[t]:
                readers.append(pm.r(t, p))
            _le(m, [pm.readable(t, v)], [pm.kept(t + 1, v), *readers])

    # -- memory: Checkmate's recurrence per event, copies in flight held ----------------------
    room = room_bytes(graph, budget_bytes) / bu
    room -= margin * abs(room)
    A: dict[tuple[int, str], int] = {}
    for t in range(n):
        ev = pm.events[t]
        held: list[Term] = []
        held_const = 0.0
        for v in values:
            if ix.producer[v] >= t:
                continue
            ts, one = pm.readable(t, v)
            held += [(col, coef * ix.size[v] / bu) for col, coef in ts + pm.in_flight(t, v)]
            held_const += one * ix.size[v] / bu
        u_terms, u_const = held, held_const
        for k in ev:
            alloc: list[Term] = []
            alloc_const = 0.0
            for w in ix.outs[k]:
                if k == t:
                    alloc_const += ix.size[w] / bu
                    continue
                acol = A[(t, w)] = m.add_col(f"A[{t},{w}]", 0, 1)
                alloc.append((acol, ix.size[w] / bu))
                # A >= R - S + (freed earlier in the stage)
                ts, one = pm.readable(t, w)
                rows = [(acol, 1.0), (pm.R[(t, k)], -1.0), *ts]
                rows += [(pm.F[(t, w, j)], -1.0) for j in ev if j < k and (t, w, j) in pm.F]
                m.add_row(rows, -one, math.inf)
            rk, rk_c = pm.r(t, k)
            ws = nodes[k].workspace_bytes / bu
            cap = u_terms + alloc + [(col, coef * ws) for col, coef in rk]
            m.add_row(cap, -math.inf, room - u_const - alloc_const - rk_c * ws)
            u_terms = u_terms + alloc
            u_const += alloc_const
            for v in dict.fromkeys([*ix.ins[k], *ix.outs[k]]):
                if v in ix.required:
                    continue
                f = _free_column(pm, t, v, k)
                u_terms = [*u_terms, (f, -ix.size[v] / bu)]

    # -- time: compute stream, copy streams, stalls -------------------------------------------
    overlaps = link.overlaps_compute
    for t in range(n):
        work = [(c, nodes[k].time_s / tu) for (s, k), c in pm.R.items() if s == t]
        # E[t] = B[t] + compute of stage t
        m.add_row([(E[t], 1.0), (B[t], -1.0)] + [(c, -a) for c, a in work],
                  nodes[t].time_s / tu, nodes[t].time_s / tu)  # fmt: skip
        if t:
            m.add_row([(B[t], 1.0), (E[t - 1], -1.0)], 0.0, math.inf)
            m.add_row([(X[t], 1.0), (X[t - 1], -1.0)]
                      + [(c, -d2h(v)) for (a, v), c in pm.O.items() if a == t],
                      0.0, math.inf)  # fmt: skip
            m.add_row([(Y[t], 1.0), (Y[t - 1], -1.0)]
                      + [(c, -h2d(v)) for (a, v), c in pm.P.items() if a == t],
                      0.0, math.inf)  # fmt: skip
        m.add_row([(Z, 1.0), (E[t], -1.0)], 0.0, math.inf)
        m.add_row([(Z, 1.0), (X[t], -1.0)], 0.0, math.inf)
        m.add_row([(Z, 1.0), (Y[t], -1.0)], 0.0, math.inf)
    for (a, v), o in pm.O.items():
        batch = [(c, -d2h(w)) for (b, w), c in pm.O.items() if b == a]
        p = ix.producer[v]
        # an offload starts once its value is made: after the stage of its last computation
        for s in [p, *(s for (s, k) in pm.R if k == p and s < a)]:
            rs, rc = pm.r(s, p)
            m.add_row([(X[a], 1.0), (E[s], -1.0), *batch, (o, -big)] + [(c, -big) for c, _ in rs],
                      -big * (2 - rc), math.inf)  # fmt: skip
        if not overlaps:  # the copies hold the compute stream
            m.add_row([(X[a], 1.0), (E[a - 1], -1.0), *batch], 0.0, math.inf)
            m.add_row([(B[a], 1.0), (X[a], -1.0)], 0.0, math.inf)
        # released before stage u (u = a too: the copy may end before the boundary) only once
        # it is done by the compute before u (the stall-free clock: the simulator's compute
        # stream is never earlier, and it observes the release at the boundary's own steps)
        for u in range(a, n):
            if (u, v) not in pm.L:
                continue
            clock = [(c, -nodes[k].time_s / tu) for (s, k), c in pm.R.items() if s < u]
            m.add_row([(X[a], 1.0), *clock, (o, big), (pm.L[(u, v)], big)],
                      -math.inf, 2 * big + sum(nodes[s].time_s for s in range(u)) / tu)  # fmt: skip
        for (t, w), pc in pm.P.items():
            if w != v or t <= a:
                continue
            pb = [(c, -h2d(x)) for (b, x), c in pm.P.items() if b == t]
            # a prefetch starts once the host copy is complete
            m.add_row([(Y[t], 1.0), (X[a], -1.0), *pb, (o, -big), (pc, -big)],
                      -2 * big, math.inf)  # fmt: skip
    for t in sorted({t for t, _ in pm.P if t}):
        # a prefetch starts once the compute stream reaches its boundary (its device buffer
        # is allocated there), so the stage's batch ends no earlier than that plus its copies
        batch = [(c, -h2d(x)) for (b, x), c in pm.P.items() if b == t]
        m.add_row([(Y[t], 1.0), (E[t - 1], -1.0), *batch], 0.0, math.inf)
    for (t, _v), pc in pm.P.items():
        # the stage waits for its prefetches (all of the stream's so far)
        m.add_row([(B[t], 1.0), (Y[t], -1.0), (pc, -big)], -big, math.inf)
        if not overlaps:
            m.add_row([(Y[t], 1.0), (X[t], -1.0)]
                      + [(c, -h2d(x)) for (b, x), c in pm.P.items() if b == t],
                      0.0, math.inf)  # fmt: skip

    # -- host memory: a host copy is held from its offload to the end ------------------------
    host = link.host_memory_bytes
    if host is not None and pm.O:
        for t in range(n):
            terms = [(c, ix.size[v] / bu) for (a, v), c in pm.O.items() if a <= t]
            if terms:
                m.add_row(terms, -math.inf, host / bu)
    return pm


def _free_column(pm: PoetModel, t: int, v: str, k: int) -> int:
    """``F[t, v, k]`` and its rows (Checkmate's blockers, with a kept value's offload among
    them through ``K``)."""
    m, ix = pm.model, pm.index
    ev = pm.events[t]
    f = pm.F[(t, v, k)] = m.add_col(f"F[{t},{v},{k}]", 0, 1)
    _le(m, [([(f, 1.0)], 0.0)], [pm.r(t, k)])
    hard, soft, rp = blockers(pm, t, v, k, ev)
    for b in hard:
        _le(m, [([(f, 1.0)], 0.0), b], [], 1.0)
    for b in soft:  # F <= 1 - b + R[t, p]
        _le(m, [([(f, 1.0)], 0.0), b], [rp], 1.0)
    # a value in flight or on the host only is never freed
    ts, c = pm.readable(t, v)
    p = ix.producer[v]
    made = [pm.r(t, p)] if p in ev and p <= k else []
    _le(m, [([(f, 1.0)], 0.0)], [(ts, c), *made])
    return f


def blockers(
    pm: PoetModel, t: int, v: str, k: int, ev: list[int]
) -> tuple[
    list[tuple[list[Term], float]], list[tuple[list[Term], float]], tuple[list[Term], float]
]:
    """What keeps ``v`` from being freed right after ``k`` in stage ``t`` (as Checkmate's)."""
    ix = pm.index
    p = ix.producer[v]
    later = [j for j in ix.consumers[v] if j in ev and j > k]
    if not (p in ev and p > k):
        return [pm.kept(t + 1, v), *(pm.r(t, j) for j in later)], [], ([], 0.0)
    hard = [pm.r(t, j) for j in later if j < p]
    soft = [pm.kept(t + 1, v), *(pm.r(t, j) for j in later if j > p)]
    return hard, soft, pm.r(t, p)


def read_plan(pm: PoetModel, x: np.ndarray) -> Plan:
    """The plan of a 0/1 solution: per stage its offloads, its prefetches, then its computes
    in graph order, each value freed right after the node where the model frees it."""
    g, ix = pm.graph, pm.index

    def val(e: tuple[list[Term], float]) -> int:
        ts, c = e
        return round(c + sum(a * float(x[col]) for col, a in ts))

    steps: list[Step] = []
    for t in range(ix.num_nodes):
        for (a, v), c in pm.O.items():
            if a == t and round(float(x[c])):
                steps.append(Step(op="offload", id=v))
        for (a, v), c in pm.P.items():
            if a == t and round(float(x[c])):
                steps.append(Step(op="prefetch", id=v))
        ev = [k for k in pm.events[t] if val(pm.r(t, k))]
        resident = {v for v in ix.producer if ix.producer[v] < t and val(pm.readable(t, v))}
        for k in ev:
            steps.append(Step(op="compute", id=g.nodes[k].id))
            resident.update(ix.outs[k])
            for v in dict.fromkeys([*ix.ins[k], *ix.outs[k]]):
                if v in ix.required or v not in resident:
                    continue
                hard, soft, rp = blockers(pm, t, v, k, pm.events[t])
                if any(val(b) for b in hard) or (any(val(b) for b in soft) and not val(rp)):
                    continue
                resident.discard(v)
                steps.append(Step(op="free", id=v))
    return Plan(steps=tuple(steps))
