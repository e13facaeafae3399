"""Checkmate's exact MILP for rematerialization over the op graph.

The step is split into ``T = num_nodes`` *stages*: stage ``t`` may recompute earlier nodes, in
graph order, and then computes node ``t`` for the first time (the frontier advances by one node
per stage, Checkmate's "frontier-advancing" partial order). Binary variables:

* ``R[t, k]``: node ``k`` runs in stage ``t`` (``R[t, t] = 1``);
* ``S[t, v]``: value ``v`` is on the device when stage ``t`` starts;

and continuous ones: ``F[t, v, k]`` (``v`` is freed right after node ``k`` in stage ``t``, allowed
only when nothing later in the stage reads it and it is not kept into stage ``t + 1``),
``A[t, v]`` (a recomputation allocates ``v``: it was not resident, or was freed earlier in the
stage)
and ``U[t, k]`` (dynamic bytes while node ``k`` of stage ``t`` runs, the recurrence of the paper).
The objective is the sum of node times over all ``R``.

Memory is the simulator's model (``remat.ir.simulate``) without offloading: inputs are always
there, outputs are allocated when a node runs, workspace counts while it runs, a value is freed
after its last read in a stage unless it is kept. The plan extracted from a solution frees
exactly where the model allows, so its simulated peak and time equal the model's figures.

Standard reductions keep the model small and lose no optimal schedule of this class:

* a node whose output is required (the loss) or that has side effects runs exactly once;
* a value produced by a node that cannot run again is kept from its computation to its last
  reader (its ``S`` are constants);
* ``S[t, v]`` exists only up to the last stage in which ``v`` or something recomputed from it can
  still be read, and is one variable across stages in which nothing can make, read or free
  ``v``; a recomputation is only allowed when one of its outputs is read later in the stage or
  kept; a value is only kept into a stage that reads it or keeps it further.

On graphs over 12 nodes, further restrictions shrink the model at the price of exactness over
the whole class (the optimum and the bound are then those of the restricted class):

* ``recompute_backward`` off: backward nodes run once;
* ``recompute_in_forward`` off: only stages of backward nodes recompute;
* lazy recomputation: a node is recomputed only in a stage that reads its output;
* a recompute *window*: stage ``t`` recomputes only nodes of the blocks (``block_key`` of the
  module path) whose values node ``t`` reads, or of the ``window`` blocks before them; the
  window widens (0, 2, 8, all) when the MILP proves it infeasible.

HiGHS starts from the best heuristic plan (Chen's greedy, rotor, fallbacks) that lies in the
model's class, and a faster heuristic plan outside the class is returned when it beats the
MILP's incumbent.

References
----------
P. Jain, A. Jain, A. Nrusimha, A. Gholami, P. Abbeel, K. Keutzer, I. Stoica, J. E. Gonzalez.
"Checkmate: Breaking the Memory Wall with Optimal Tensor Rematerialization." MLSys 2020.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from remat.ir import Graph, InvalidPlanError, Plan, Step, block_key, eager_plan, keep_plan
from remat.solver._mip import Backend, MipSolution, SparseModel
from remat.solver.base import (
    SolveResult,
    best_of,
    infeasible_result,
    register,
    result_from_plan,
)

# A reference to a model quantity: (column, 0.0) for a variable, (-1, value) for a constant.
Ref = tuple[int, float]
ZERO: Ref = (-1, 0.0)
ONE: Ref = (-1, 1.0)

SMALL_GRAPH_NODES = 12
"""Up to this many nodes the model is exact over the whole class (no optional restriction)."""


def is_var(r: Ref) -> bool:
    return r[0] >= 0


@dataclass
class CheckmateModel:
    """Checkmate's MILP for one graph and budget, with the bookkeeping to read a solution back.

    Build with :meth:`build`; ``model`` is the sparse MILP; :meth:`replay` turns a 0/1 solution
    into a plan and the model's own peak and time figures.
    """

    graph: Graph
    budget_bytes: int
    recompute_backward: bool
    recompute_in_forward: bool
    model: SparseModel = field(default_factory=SparseModel)
    R: dict[tuple[int, int], int] = field(default_factory=dict)
    S: dict[tuple[int, str], Ref] = field(default_factory=dict)
    events: list[list[int]] = field(default_factory=list)
    """Per stage, the nodes that may run in it, in graph order (the frontier last)."""
    outs: list[list[str]] = field(default_factory=list)
    ins: list[list[str]] = field(default_factory=list)
    size: dict[str, int] = field(default_factory=dict)
    producer: dict[str, int] = field(default_factory=dict)
    consumers: dict[str, list[int]] = field(default_factory=dict)
    required: frozenset[str] = frozenset()
    rerun: list[bool] = field(default_factory=list)
    last_read: dict[str, int] = field(default_factory=dict)
    need_end: dict[str, int] = field(default_factory=dict)
    A: dict[tuple[int, str], Ref] = field(default_factory=dict)
    Fref: dict[tuple[int, str, int], Ref] = field(default_factory=dict)
    constant_time_s: float = 0.0
    input_bytes: int = 0
    time_unit_s: float = 1.0
    """Objective coefficients are times divided by this (HiGHS' tolerances are absolute)."""
    byte_unit: float = 1.0
    """Memory rows count bytes divided by this."""
    margin: float = 0.0
    lazy: bool = False
    window: int | None = None
    """Recompute in stage ``t`` only nodes of the blocks whose values node ``t`` reads and of
    the ``window`` blocks before them (None: any block)."""
    block: list[int] = field(default_factory=list)
    blocks_read: list[set[int]] = field(default_factory=list)
    """Recompute a node only in a stage that reads its output (not to keep it for later)."""

    @property
    def exact(self) -> bool:
        """No optional restriction is on: the optimum and the bound hold over Checkmate's whole
        schedule class, so they bound every recompute-only plan the simulator accepts in this
        stage order."""
        return (
            self.recompute_backward
            and self.recompute_in_forward
            and not self.lazy
            and self.window is None
        )

    # -- model quantities -----------------------------------------------------------------------

    def r(self, t: int, k: int) -> Ref:
        if k == t:
            return ONE
        c = self.R.get((t, k))
        return ZERO if c is None else (c, 0.0)

    def s(self, t: int, v: str) -> Ref:
        return self.S.get((t, v), ZERO)

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        graph: Graph,
        budget_bytes: int,
        *,
        recompute_backward: bool | None = None,
        recompute_in_forward: bool | None = None,
        margin: float = 0.0,
        lazy: bool | None = None,
        window: int | None = None,
    ) -> CheckmateModel:
        n = graph.num_nodes
        if recompute_backward is None:
            recompute_backward = n <= SMALL_GRAPH_NODES
        if recompute_in_forward is None:
            recompute_in_forward = n <= SMALL_GRAPH_NODES
        self = cls(graph, budget_bytes, recompute_backward, recompute_in_forward)
        self.margin = margin
        self.lazy = n > SMALL_GRAPH_NODES if lazy is None else lazy
        self.window = window
        base = sum(nd.time_s for nd in graph.nodes)
        self.time_unit_s = base / 1e3 if base > 0 else 1.0
        self.byte_unit = max(1.0, (budget_bytes - graph.static_bytes) / 1e6)
        self._index()
        self._variables()
        self._constraints()
        return self

    def _index(self) -> None:
        g = self.graph
        n = g.num_nodes
        self.required = frozenset(g.required)
        dyn = {v.id for v in g.values if not g.is_static(v.id) and v.kind != "input"}
        self.size = {v.id: v.size_bytes for v in g.values}
        self.input_bytes = g.input_bytes
        for i, node in enumerate(g.nodes):
            self.ins.append(list(dict.fromkeys(x for x in node.inputs if x in dyn)))
            self.outs.append([o for o in node.outputs if o in dyn])
            for o in self.outs[-1]:
                self.producer[o] = i
        for v in self.producer:
            self.consumers[v] = sorted(set(g.consumer_positions(v)))
        for i, node in enumerate(g.nodes):
            ok = (
                node.recomputable
                and bool(self.outs[i])
                and not any(o in self.required for o in self.outs[i])
                and (node.phase == "forward" or self.recompute_backward)
            )
            self.rerun.append(ok)
        # last stage in which each value (or something recomputed from it) can be read
        self.last_read = {
            v: max(self.consumers[v], default=self.producer[v]) for v in self.producer
        }
        for i in reversed(range(n)):
            for v in self.outs[i]:
                end = self.last_read[v]
                if v in self.required:
                    end = n
                for k in self.consumers[v]:
                    if self.rerun[k]:
                        for w in self.outs[k]:
                            end = max(end, self.need_end[w])
                self.need_end[v] = end

    def _stage_allows(self, t: int, k: int) -> bool:
        if not self.rerun[k] or k >= t:
            return False
        if not self.recompute_in_forward and self.graph.nodes[t].phase == "forward":
            return False
        if self.window is not None:
            bk = self.block[k]
            if not any(b - self.window <= bk <= b for b in self.blocks_read[t]):
                return False
        return any(self.need_end[w] >= t for w in self.outs[k])

    def _variables(self) -> None:
        g, m = self.graph, self.model
        n = g.num_nodes
        order: dict[str, int] = {}
        for nd in g.nodes:
            if nd.phase == "forward":
                order.setdefault(block_key(nd.module), len(order))
        self.block = [order.get(block_key(nd.module), -1) for nd in g.nodes]
        self.blocks_read = []
        for t in range(n):
            blocks = [
                self.block[self.producer[x]]
                for x in self.ins[t]
                if g.nodes[self.producer[x]].phase == "forward"
            ]
            self.blocks_read.append(set(blocks))
        for t in range(n):
            ev = [k for k in range(t) if self._stage_allows(t, k)]
            for k in ev:
                self.R[(t, k)] = m.add_col(
                    f"R[{t},{k}]", 0, 1, integer=True, cost=g.nodes[k].time_s / self.time_unit_s
                )
            self.events.append([*ev, t])
        self.constant_time_s = sum(nd.time_s for nd in g.nodes)
        m.offset = self.constant_time_s / self.time_unit_s
        for v, p in self.producer.items():
            end = min(self.need_end[v], n)
            if v in self.required:
                for t in range(p + 1, n + 1):
                    self.S[(t, v)] = ONE
                continue
            touched = {p} | set(self.consumers[v])
            prev: Ref | None = None
            for t in range(p + 1, end + 1):
                if t >= n:
                    break
                if not self.rerun[p] and t <= self.last_read[v]:
                    prev = self.S[(t, v)] = ONE  # cannot be recomputed: kept until its last reader
                elif prev is not None and is_var(prev) and not self._active(t - 1, touched):
                    # nothing can make, read or free v in stage t - 1: S[t] == S[t - 1]
                    self.S[(t, v)] = prev
                else:
                    prev = self.S[(t, v)] = (m.add_col(f"S[{t},{v}]", 0, 1, integer=True), 0.0)

    def _active(self, t: int, touched: set[int]) -> bool:
        return t in touched or any((t, j) in self.R for j in touched)

    def _constraints(self) -> None:
        g, m = self.graph, self.model
        n = g.num_nodes
        bu = self.byte_unit
        # a hair under the budget, so that solver tolerances never let a plan exceed it
        # Solver tolerances scale with the row: ``margin`` keeps a relative part aside (a
        # solution that overshoots by a few bytes is solved again with a margin).
        dyn_budget = (self.budget_bytes - g.static_bytes - self.input_bytes) / bu
        dyn_budget -= self.margin * abs(dyn_budget)

        def le(lhs: list[Ref], rhs: list[Ref]) -> None:
            """sum(lhs) <= sum(rhs), dropping constants into the bound."""
            terms: list[tuple[int, float]] = []
            const = 0.0
            for c, val in lhs:
                if c >= 0:
                    terms.append((c, 1.0))
                else:
                    const += val
            for c, val in rhs:
                if c >= 0:
                    terms.append((c, -1.0))
                else:
                    const -= val
            if not terms:
                if const > 1e-9:
                    raise AssertionError("constant constraint violated while building the model")
                return
            m.add_row(terms, -math.inf, -const)

        for t in range(n):
            ev = self.events[t]
            in_stage = set(ev)
            # (1) a node runs only when what it reads is resident or recomputed before it
            for k in ev:
                rk = self.r(t, k)
                for x in self.ins[k]:
                    p = self.producer[x]
                    rhs = [self.s(t, x)]
                    if p in in_stage and p < k:
                        rhs.append(self.r(t, p))
                    le([rk], rhs)
            # (3a) a recomputation must serve a later reader in the stage or a kept value
            for k in ev[:-1]:
                rhs = []
                for w in self.outs[k]:
                    if not self.lazy:
                        rhs.append(self.s(t + 1, w))
                    rhs.extend(self.r(t, j) for j in self.consumers[w] if j in in_stage and j > k)
                le([self.r(t, k)], rhs)
        for v, p in self.producer.items():
            if v in self.required:
                continue
            # (2) kept into t + 1 only if resident in t or (re)computed in t
            for t in range(p + 1, n):
                nxt = self.s(t + 1, v)
                if not is_var(nxt) or nxt == self.s(t, v):
                    continue
                le([nxt], [self.s(t, v), self.r(t, p)])
            # (3b) resident in t only if read in t or kept further
            for t in range(p + 1, n):
                cur = self.s(t, v)
                if not is_var(cur) or cur == self.s(t + 1, v):
                    continue
                in_stage = set(self.events[t])
                rhs = [self.s(t + 1, v)]
                rhs.extend(self.r(t, j) for j in self.consumers[v] if j in in_stage)
                le([cur], rhs)
        # (4) allocation of a recomputed output: A >= R - S + (freed earlier in the stage)
        self.A.clear()
        for (t, k), c in self.R.items():
            for w in self.outs[k]:
                sw = self.s(t, w)
                if not is_var(sw) and sw[1] == 0.0:
                    self.A[(t, w)] = (c, 0.0)  # not resident before: allocated iff it runs
                else:
                    self.A[(t, w)] = (m.add_col(f"A[{t},{w}]", 0, 1), 0.0)
        self.Fref.clear()
        # (5) memory, stage by stage
        for t in range(n):
            ev = self.events[t]
            in_stage = set(ev)
            prev_u: int | None = None
            prev_freed: list[tuple[int, float]] = []
            prev_freed_const = 0.0
            for k in ev:
                alloc: list[tuple[int, float]] = []
                alloc_const = 0.0
                for w in self.outs[k]:
                    aw = ONE if k == t else self.A[(t, w)]
                    if is_var(aw):
                        alloc.append((aw[0], self.size[w] / bu))
                    else:
                        alloc_const += aw[1] * self.size[w] / bu
                u = m.add_col(f"U[{t},{k}]", 0, math.inf)
                terms: list[tuple[int, float]] = [(u, 1.0)]
                const = 0.0
                if prev_u is None:
                    for v in self.producer:
                        sv = self.s(t, v)
                        if is_var(sv):
                            terms.append((sv[0], -self.size[v] / bu))
                        else:
                            const += sv[1] * self.size[v] / bu
                else:
                    terms.append((prev_u, -1.0))
                    terms.extend((c, a) for c, a in prev_freed)
                    const -= prev_freed_const
                terms.extend((c, -a) for c, a in alloc)
                const += alloc_const
                m.add_row(terms, const, const)
                rk = self.r(t, k)
                ws = g.nodes[k].workspace_bytes / bu
                cap: list[tuple[int, float]] = [(u, 1.0)]
                cap_const = 0.0
                if ws:
                    if is_var(rk):
                        cap.append((rk[0], ws))
                    else:
                        cap_const += ws
                m.add_row(cap, -math.inf, dyn_budget - cap_const)
                # what may be freed right after k
                prev_freed, prev_freed_const = [], 0.0
                for v in dict.fromkeys([*self.ins[k], *self.outs[k]]):
                    if v in self.required:
                        continue
                    f = self._free_ref(t, v, k, in_stage)
                    if f is None:
                        continue
                    self.Fref[(t, v, k)] = f
                    if is_var(f):
                        prev_freed.append((f[0], self.size[v] / bu))
                    else:
                        prev_freed_const += f[1] * self.size[v] / bu
                prev_u = u

        for (t, k), c in self.R.items():
            for w in self.outs[k]:
                a = self.A[(t, w)]
                if a[0] == c:
                    continue
                sw = self.s(t, w)
                terms = [(a[0], 1.0), (c, -1.0)]
                lo = 0.0
                if is_var(sw):
                    terms.append((sw[0], 1.0))
                else:
                    lo -= sw[1]
                for j in self.events[t]:
                    if j >= k:
                        break
                    f = self.Fref.get((t, w, j))
                    if f is None:
                        continue
                    if is_var(f):
                        terms.append((f[0], -1.0))
                    else:
                        lo += f[1]
                m.add_row(terms, lo, math.inf)

    def _blockers(
        self, t: int, v: str, k: int, in_stage: set[int]
    ) -> tuple[list[Ref], list[Ref], Ref]:
        """What keeps ``v`` from being freed right after ``k`` in stage ``t``: ``hard`` (any
        one blocks), ``soft`` (block unless the producer runs again later in the stage, then
        the new copy serves them) and that producer's ``R``."""
        p = self.producer[v]
        rp = self.r(t, p) if (p in in_stage and p > k) else ZERO
        later = [j for j in self.consumers[v] if j in in_stage and j > k]
        if rp == ZERO:
            return [self.s(t + 1, v), *(self.r(t, j) for j in later)], [], rp
        hard = [self.r(t, j) for j in later if j < p]
        soft = [self.s(t + 1, v), *(self.r(t, j) for j in later if j > p)]
        return hard, soft, rp

    def _free_ref(self, t: int, v: str, k: int, in_stage: set[int]) -> Ref | None:
        """The F[t, v, k] quantity: None when it is always 0, else a constant 1 or a column."""
        rk = self.r(t, k)
        if not is_var(rk) and rk[1] == 0.0:
            return None
        hard, soft, rp = self._blockers(t, v, k, in_stage)
        if any(not is_var(b) and b[1] == 1.0 for b in hard):
            return None
        var_hard = [b for b in hard if is_var(b)]
        soft = [b for b in soft if is_var(b) or b[1] == 1.0]
        if not is_var(rk) and not var_hard and not soft:
            return ONE
        m = self.model
        f = m.add_col(f"F[{t},{v},{k}]", 0, 1)
        if is_var(rk):
            m.add_row([(f, 1.0), (rk[0], -1.0)], -math.inf, 0.0)
        for b in var_hard:
            m.add_row([(f, 1.0), (b[0], 1.0)], -math.inf, 1.0)
        for b in soft:
            # F <= 1 - b + R[t, p]   (rp is a column here: p < t runs only as a recompute)
            terms = [(f, 1.0), (rp[0], -1.0)]
            hi = 1.0
            if is_var(b):
                terms.append((b[0], 1.0))
            else:
                hi -= b[1]
            m.add_row(terms, -math.inf, hi)
        return (f, 0.0)

    def start_from_plan(self, plan: Plan) -> dict[int, float] | None:
        """A MIP start (values of ``R`` and ``S``) from a plan of the model's class, or None
        when the plan is outside it (offloads, a recomputation the model does not allow, or
        keep decisions that the merged ``S`` variables cannot express)."""
        g = self.graph
        n = g.num_nodes
        start: dict[int, float] = dict.fromkeys(self.R.values(), 0.0)
        s_val: dict[int, float] = {}
        resident: set[str] = set()
        frontier = 0
        snap_due = True

        def snapshot(t: int) -> bool:
            for (tt, v), ref in self.S.items():
                if tt != t or not is_var(ref):
                    continue
                want = 1.0 if v in resident else 0.0
                if s_val.setdefault(ref[0], want) != want:
                    return False
            return True

        for step in plan.steps:
            if step.op in ("offload", "prefetch"):
                return None
            if step.op == "free":
                resident.discard(step.id)
                continue
            k = g.node_position(step.id)
            if snap_due and frontier < n:
                if not snapshot(frontier):
                    return None
                snap_due = False
            if k == frontier:
                frontier += 1
                snap_due = True
            elif k < frontier:
                c = self.R.get((frontier, k))
                if c is None:
                    return None
                start[c] = 1.0
            else:
                return None
            resident.update(self.outs[k])
        if frontier != n:
            return None
        start.update(s_val)
        return start

    # -- reading a solution back ----------------------------------------------------------------

    def replay(self, x: np.ndarray) -> tuple[Plan, int, float]:
        """The plan of a 0/1 solution, with the model's peak (total bytes) and time.

        Values are freed exactly where the model allows it (``F`` at its upper bound), which is
        what the memory constraints assume at most; the peak is computed with the model's own
        arithmetic (stage residency from ``S``, allocation ``R and not resident``, workspace
        while running), independently of the simulator.
        """
        g = self.graph
        n = g.num_nodes

        def val(r: Ref) -> int:
            return round(float(x[r[0]])) if is_var(r) else round(r[1])

        steps: list[Step] = []
        peak = 0
        time_s = 0.0
        for t in range(n):
            ev = [k for k in self.events[t] if val(self.r(t, k))]
            in_stage = set(ev)
            resident = {v for v in self.producer if val(self.s(t, v))}
            cur = sum(self.size[v] for v in resident)
            for k in ev:
                steps.append(Step(op="compute", id=g.nodes[k].id))
                time_s += g.nodes[k].time_s
                for w in self.outs[k]:
                    if w not in resident:
                        resident.add(w)
                        cur += self.size[w]
                peak = max(peak, cur + g.nodes[k].workspace_bytes)
                for v in dict.fromkeys([*self.ins[k], *self.outs[k]]):
                    if v in self.required or v not in resident:
                        continue
                    hard, soft, rp = self._blockers(t, v, k, in_stage)
                    if any(val(b) for b in hard) or (any(val(b) for b in soft) and not val(rp)):
                        continue
                    resident.discard(v)
                    cur -= self.size[v]
                    steps.append(Step(op="free", id=v))
        return Plan(steps=tuple(steps)), g.static_bytes + self.input_bytes + peak, time_s

    def lower_bound_peak(self) -> int:
        """A peak no plan can go below: the largest single node with what it reads and writes,
        plus the inputs and the required values already made (bytes, static included)."""
        g = self.graph
        best = 0
        made_required = 0
        for k, node in enumerate(g.nodes):
            during = sum(self.size[v] for v in dict.fromkeys([*self.ins[k], *self.outs[k]]))
            during += node.workspace_bytes + made_required
            best = max(best, during)
            made_required += sum(self.size[o] for o in self.outs[k] if o in self.required)
        return g.static_bytes + self.input_bytes + best


def fallback_plans(graph: Graph) -> list[Plan]:
    """Cheap plans to fall back on (eager, keep nothing, keep block/articulation cuts)."""
    from remat.ir import block_cuts

    plans = [eager_plan(graph)]
    for keep in (set(), {v for c in block_cuts(graph) for v in c.values}):
        try:
            plans.append(keep_plan(graph, keep))
        except InvalidPlanError:  # a heuristic that does not apply is skipped
            continue
    return plans


DEFAULT_TIME_LIMIT_S = 60.0


def heuristic_plans(graph: Graph, budget_bytes: int) -> list[Plan]:
    """Fast plans within the budget, fastest first, to start the MILP from (Chen's greedy,
    rotor and the fallbacks)."""
    from remat.solver.baselines import solve_chen_greedy
    from remat.solver.rotor import solve_rotor

    results = [
        solve_chen_greedy(graph, budget_bytes),
        solve_rotor(graph, budget_bytes),
        best_of(graph, budget_bytes, fallback_plans(graph), solver="milp", started=0.0),
    ]
    fitting = [r for r in results if r.status != "infeasible" and r.plan is not None]
    fitting.sort(key=lambda r: r.total_time_s or 0.0)
    return [r.plan for r in fitting if r.plan is not None]


@dataclass
class CheckmateRun:
    """A solved model: the model, the back end's answer and, when it has one, the plan."""

    model: CheckmateModel
    solution: MipSolution | None
    plan: Plan | None = None
    bound_s: float | None = None


WindowSpec = int | Literal["auto", "all"]


def window_ladder(graph: Graph, window: WindowSpec) -> list[int | None]:
    """The recompute windows to try in turn: a fixed one, or (``"auto"``) 0, 2 and 8 blocks
    and then any block for graphs over 12 nodes, widening only when a window is infeasible."""
    if window == "all" or (window == "auto" and graph.num_nodes <= SMALL_GRAPH_NODES):
        return [None]
    if window == "auto":
        return [0, 2, 8, None]
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be 'auto', 'all' or an integer >= 0, got {window!r}")
    return [window]


def run_checkmate(
    graph: Graph,
    budget_bytes: int,
    *,
    time_limit_s: float,
    backend: Backend = "highs",
    relax: bool = False,
    recompute_backward: bool | None = None,
    recompute_in_forward: bool | None = None,
    window: WindowSpec = "auto",
    threads: int | None = None,
    hints: list[Plan] | None = None,
) -> CheckmateRun:
    """Build and solve the model (``hints``: plans to start the MIP from, the first one in the
    model's class is used); ``solution`` is None when the budget is below the peak that
    any plan needs. A window that proves infeasible is widened (see :func:`window_ladder`). A
    MILP plan that overshoots the budget by solver tolerance (a few bytes) is solved again with
    a relative margin of 10^-6."""
    t0 = time.perf_counter()
    run: CheckmateRun | None = None
    ladder = window_ladder(graph, window)
    for w in ladder:
        for margin in (0.0, 1e-6):
            left = time_limit_s - (time.perf_counter() - t0)
            if run is not None and left < 0.1:
                return run
            cm = CheckmateModel.build(
                graph,
                budget_bytes,
                recompute_backward=recompute_backward,
                recompute_in_forward=recompute_in_forward,
                margin=margin,
                window=w,
            )
            if budget_bytes < cm.lower_bound_peak():
                return CheckmateRun(cm, None)
            start = None
            for h in hints or []:
                start = cm.start_from_plan(h)
                if start is not None:
                    break
            sol = cm.model.solve(
                backend=backend,
                relax=relax,
                time_limit_s=max(0.1, left),
                threads=threads,
                start=start,
            )
            bound = None if sol.bound is None else sol.bound * cm.time_unit_s
            run = CheckmateRun(cm, sol, None, bound)
            if sol.status == "infeasible":
                break  # widen the window
            if relax or sol.values is None:
                return run
            plan, peak, _ = cm.replay(sol.values)
            if peak <= budget_bytes:
                run.plan = plan
                return run
        else:
            assert run is not None
            return run
    assert run is not None
    return run


@register("milp", kind="dag", exact=True, summary="Checkmate's exact MILP (Jain et al. 2020)")
def solve_milp(
    graph: Graph,
    budget_bytes: int,
    *,
    time_limit_s: float | None = None,
    solver: str = "highs",
    recompute_backward: bool | None = None,
    recompute_in_forward: bool | None = None,
    window: WindowSpec = "auto",
    threads: int | None = None,
) -> SolveResult:
    """Checkmate's MILP over the op graph, solved with HiGHS (default) or CBC.

    Parameters
    ----------
    time_limit_s
        Wall-clock limit for the MILP solver (default 60 s). When it stops early the result is
        ``feasible`` with the best plan found (or the best fallback plan) and the solver's proven
        lower bound in ``lower_bound_s``.
    solver
        ``"highs"`` (HiGHS through highspy) or ``"cbc"`` (CBC through pulp).
    recompute_backward
        Whether backward nodes may run again (default: only for graphs up to 12 nodes).
    recompute_in_forward
        Whether stages of forward nodes may recompute (default: only for graphs up to 12
        nodes).
    window
        Which nodes a stage may recompute: those of the blocks (``remat.ir.block_key``) whose
        values the stage's node reads and of ``window`` blocks before them; ``"all"`` for any
        node; ``"auto"`` (default) tries 0, 2, 8 blocks, then all, widening only when the
        MILP proves a window infeasible (graphs up to 12 nodes: all).
    threads
        Threads for the MILP solver.

    Notes
    -----
    ``status="optimal"`` only when the MILP solver proved optimality; the optimum is over
    schedules that first compute nodes in graph order, as every remat schedule does, and only
    when none of the optional restrictions above is on; ``lower_bound_s`` (the MILP's dual
    bound) likewise only then. With restrictions on (graphs over 12 nodes by default) the
    result is ``feasible``, and its message gives the restricted class's optimum status and
    bound. See the module docstring for the formulation.

    References
    ----------
    P. Jain et al., "Checkmate: Breaking the Memory Wall with Optimal Tensor
    Rematerialization", MLSys 2020.
    """
    t0 = time.perf_counter()
    if solver not in ("highs", "cbc"):
        raise ValueError(f"solver: unknown MILP solver {solver!r} (use 'highs' or 'cbc')")
    limit = DEFAULT_TIME_LIMIT_S if time_limit_s is None else time_limit_s
    if graph.num_nodes == 0:
        return result_from_plan(
            graph,
            budget_bytes,
            Plan(),
            solver="milp",
            started=t0,
            status="optimal",
            lower_bound_s=0.0,
        )
    hints = heuristic_plans(graph, budget_bytes) if graph.num_nodes > SMALL_GRAPH_NODES else []
    run = run_checkmate(
        graph,
        budget_bytes,
        time_limit_s=max(0.1, limit - (time.perf_counter() - t0)),
        backend=solver,  # type: ignore[arg-type]
        recompute_backward=recompute_backward,
        recompute_in_forward=recompute_in_forward,
        window=window,
        threads=threads,
        hints=hints,
    )
    sol = run.solution
    if sol is None or sol.status == "infeasible":
        fb = best_of(graph, budget_bytes, hints + fallback_plans(graph), solver="milp", started=t0)
        if fb.status != "infeasible":
            # The model's class is narrower than a fallback's (restrictions on): use it.
            return fb.model_copy(update={"message": "the MILP found no schedule; fallback plan"})
        w = run.model.window
        why = (
            "the budget is below what the largest node needs"
            if sol is None
            else "the MILP proved that no schedule fits the budget"
            if w is None
            else f"the MILP proved that no schedule recomputing within {w} block(s) fits the "
            "budget (wider windows were not tried)"
        )
        return infeasible_result(
            graph,
            budget_bytes,
            solver="milp",
            started=t0,
            min_budget_bytes=max(run.model.lower_bound_peak(), fb.min_budget_bytes or 0),
            message=f"{why} ({budget_bytes} bytes)",
        )
    info = f"{run.model.model.num_integer} binaries, {run.model.model.num_rows} rows"
    fb = best_of(graph, budget_bytes, hints + fallback_plans(graph), solver="milp", started=t0)
    fb_time = fb.total_time_s if fb.status != "infeasible" and fb.plan is not None else None
    exact = run.model.exact
    if not exact:
        # Restrictions are on: the solver's optimum and bound hold for the restricted class
        # only, which other plans can beat. Say so, and claim neither.
        how = "proven optimal" if sol.status == "optimal" else "best found"
        cls_bound = "-" if run.bound_s is None else f"{run.bound_s:.6g} s"
        info += f"; {how} within the restricted class (class bound {cls_bound}), not overall"
    if run.plan is not None:
        res = result_from_plan(
            graph,
            budget_bytes,
            run.plan,
            solver="milp",
            started=t0,
            status="optimal" if sol.status == "optimal" and exact else "feasible",
            lower_bound_s=run.bound_s if exact else None,
            message=f"{info}; {sol.message}" if sol.message else info,
        )
        if fb_time is None or (res.total_time_s or 0.0) <= fb_time:
            return res
    # No incumbent in time, or a heuristic plan (outside the model's class) is faster.
    if fb.status == "infeasible" or fb.plan is None or fb_time is None:
        return infeasible_result(
            graph,
            budget_bytes,
            solver="milp",
            started=t0,
            min_budget_bytes=fb.min_budget_bytes,
            status="timeout",
            message=f"the MILP found no schedule within the time limit ({info})",
        )
    bound = run.bound_s if exact else None
    if bound is not None and bound > fb_time * (1 + 1e-9):
        bound = None  # the bound holds for the model's class only; this plan lies outside it
    return result_from_plan(
        graph,
        budget_bytes,
        fb.plan,
        solver="milp",
        started=t0,
        status="feasible",
        lower_bound_s=bound,
        message=f"a heuristic plan beats the MILP's incumbent ({info})",
    )
