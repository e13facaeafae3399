"""Checkmate's MILP for one graph and budget: variables and one function per constraint family
(the way back from a 0/1 solution to a plan, and from a plan to a MIP start, is
:mod:`remat.solver.checkmate_plans`).

The formulation (stages, ``R``, ``S``, ``F``, ``A``, ``U``) and its reductions are described in
:mod:`remat.solver.milp`. :meth:`CheckmateModel.build` derives the :class:`MilpIndex` (or takes
one), creates the variables, and adds the families in turn:

1. :func:`_dependency_rows`: a node runs only when what it reads is resident or recomputed
   before it in the stage;
2. :func:`_keep_rows`: a value is kept into stage ``t + 1`` only if it was resident in ``t`` or
   (re)computed in ``t``;
3. :func:`_purpose_rows` and :func:`_residency_rows`: a recomputation serves a later reader or
   a kept value; a value is resident only when read in the stage or kept further;
4. :func:`_allocation_columns` / :func:`_allocation_rows`: a recomputed output is allocated
   when it was not resident or was freed earlier in the stage;
5. :func:`_memory_rows` (with :func:`_free_quantity`, the ``F`` variables and their rows): the
   dynamic bytes while each node runs, within the budget.

References
----------
P. Jain, A. Jain, A. Nrusimha, A. Gholami, P. Abbeel, K. Keutzer, I. Stoica, J. E. Gonzalez.
"Checkmate: Breaking the Memory Wall with Optimal Tensor Rematerialization." MLSys 2020.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from remat.ir import Graph
from remat.solver._mip import SparseModel
from remat.solver.deadline import Deadline
from remat.solver.milp_index import MilpIndex
from remat.solver.problem import room_bytes

# A reference to a model quantity: (column, 0.0) for a variable, (-1, value) for a constant.
Ref = tuple[int, float]
ZERO: Ref = (-1, 0.0)
ONE: Ref = (-1, 1.0)

SMALL_GRAPH_NODES = 32
"""Up to this many nodes the model is exact over the whole class (no optional restriction)."""


def is_var(r: Ref) -> bool:
    return r[0] >= 0


@dataclass(frozen=True)
class ModelOptions:
    """The optional restrictions of the model (all off: exact over the whole class).

    ``window``: recompute in stage ``t`` only nodes of the blocks whose values node ``t``
    reads and of the ``window`` blocks before them (None: any block). ``lazy``: recompute a
    node only in a stage that reads its output (not to keep it for later). ``margin``: the
    relative part of the room kept aside against solver tolerances."""

    recompute_in_forward: bool
    lazy: bool
    window: int | None
    margin: float = 0.0


@dataclass(frozen=True)
class Variables:
    """The model's quantities. ``events[t]``: nodes that may run in stage ``t``, in graph
    order, the frontier last; ``by_stage[t]``: the ``S`` entries of stage ``t``."""

    R: Mapping[tuple[int, int], int]
    S: Mapping[tuple[int, str], Ref]
    A: Mapping[tuple[int, str], Ref]
    F: Mapping[tuple[int, str, int], Ref]
    events: tuple[tuple[int, ...], ...]
    by_stage: tuple[tuple[tuple[str, Ref], ...], ...]

    def r(self, t: int, k: int) -> Ref:
        if k == t:
            return ONE
        c = self.R.get((t, k))
        return ZERO if c is None else (c, 0.0)

    def s(self, t: int, v: str) -> Ref:
        return self.S.get((t, v), ZERO)


@dataclass
class _Draft:
    """The quantities while the model is being built (mutable only here)."""

    m: SparseModel = field(default_factory=SparseModel)
    R: dict[tuple[int, int], int] = field(default_factory=dict)
    S: dict[tuple[int, str], Ref] = field(default_factory=dict)
    A: dict[tuple[int, str], Ref] = field(default_factory=dict)
    F: dict[tuple[int, str, int], Ref] = field(default_factory=dict)
    events: list[tuple[int, ...]] = field(default_factory=list)

    def r(self, t: int, k: int) -> Ref:
        if k == t:
            return ONE
        c = self.R.get((t, k))
        return ZERO if c is None else (c, 0.0)

    def s(self, t: int, v: str) -> Ref:
        return self.S.get((t, v), ZERO)

    def le(self, lhs: list[Ref], rhs: list[Ref]) -> None:
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
        self.m.add_row(terms, -math.inf, -const)


@dataclass(frozen=True)
class CheckmateModel:
    """Checkmate's MILP for one graph and budget, with what is needed to read a solution back.

    Build with :meth:`build`; ``model`` is the sparse MILP;
    :func:`remat.solver.checkmate_plans.replay` turns a 0/1 solution into a plan and the model's
    own peak and time figures, :func:`~remat.solver.checkmate_plans.start_from_plan` a plan of the
    model's class into a MIP start.
    """

    index: MilpIndex
    budget_bytes: int
    options: ModelOptions
    model: SparseModel
    vars: Variables
    time_unit_s: float
    """Objective coefficients are times divided by this (HiGHS' tolerances are absolute)."""
    byte_unit: float
    """Memory rows count bytes divided by this."""

    @property
    def graph(self) -> Graph:
        return self.index.graph

    @property
    def window(self) -> int | None:
        return self.options.window

    @property
    def exact(self) -> bool:
        """No optional restriction is on: the optimum and the bound hold over Checkmate's whole
        schedule class, so they bound every recompute-only plan the simulator accepts in this
        stage order."""
        o = self.options
        return (
            self.index.recompute_backward
            and o.recompute_in_forward
            and not o.lazy
            and o.window is None
        )

    def lower_bound_peak(self) -> int:
        return self.index.lower_bound_peak()

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
        index: MilpIndex | None = None,
        deadline: Deadline | None = None,
    ) -> CheckmateModel:
        """The model of ``graph`` under ``budget_bytes``; restrictions default to on for graphs
        over :data:`SMALL_GRAPH_NODES` nodes. ``index`` (derived when not given) must match
        ``recompute_backward``. Raises :class:`~remat.solver.deadline.Expired` when
        ``deadline`` passes while the model is built (checked per stage)."""

        def tick() -> None:
            if deadline is not None:
                deadline.check("building the MILP")

        n = graph.num_nodes
        small = n <= SMALL_GRAPH_NODES
        rb = small if recompute_backward is None else recompute_backward
        if index is None:
            index = MilpIndex.of(graph, recompute_backward=rb)
        elif index.recompute_backward != rb or index.graph is not graph:
            raise ValueError("index: built for another graph or recompute_backward setting")
        opts = ModelOptions(
            recompute_in_forward=small if recompute_in_forward is None else recompute_in_forward,
            lazy=not small if lazy is None else lazy,
            window=window,
            margin=margin,
        )
        base = sum(nd.time_s for nd in graph.nodes)
        time_unit_s = base / 1e3 if base > 0 else 1.0
        byte_unit = max(1.0, (budget_bytes - graph.static_bytes) / 1e6)
        d = _Draft()
        _recompute_columns(d, index, opts, time_unit_s, tick)
        d.m.offset = base / time_unit_s
        _keep_columns(d, index)
        tick()
        _dependency_rows(d, index)
        _purpose_rows(d, index, opts)
        tick()
        _keep_rows(d, index)
        _residency_rows(d, index)
        _allocation_columns(d, index)
        tick()
        dyn_budget = room_bytes(graph, budget_bytes) / byte_unit
        dyn_budget -= margin * abs(dyn_budget)
        _memory_rows(d, index, byte_unit, dyn_budget, tick)
        _allocation_rows(d, index)
        by_stage: list[list[tuple[str, Ref]]] = [[] for _ in range(n + 1)]
        for (t, v), ref in d.S.items():
            by_stage[t].append((v, ref))
        variables = Variables(
            R=d.R,
            S=d.S,
            A=d.A,
            F=d.F,
            events=tuple(d.events),
            by_stage=tuple(tuple(s) for s in by_stage),
        )
        return cls(index, budget_bytes, opts, d.m, variables, time_unit_s, byte_unit)


# -- variables --------------------------------------------------------------------------------


def _stage_allows(ix: MilpIndex, opts: ModelOptions, t: int, k: int) -> bool:
    if not ix.rerun[k] or k >= t:
        return False
    if not opts.recompute_in_forward and ix.graph.nodes[t].phase == "forward":
        return False
    if opts.window is not None:
        bk = ix.block[k]
        if not any(b - opts.window <= bk <= b for b in ix.blocks_read[t]):
            return False
    return any(ix.need_end[w] >= t for w in ix.outs[k])


def _recompute_columns(
    d: _Draft, ix: MilpIndex, opts: ModelOptions, time_unit_s: float, tick: Callable[[], None]
) -> None:
    """``R[t, k]`` for every recomputation the options allow; ``events`` per stage."""
    nodes = ix.graph.nodes
    for t in range(ix.num_nodes):
        if t % 64 == 0:
            tick()
        ev = [k for k in range(t) if _stage_allows(ix, opts, t, k)]
        for k in ev:
            d.R[(t, k)] = d.m.add_col(
                f"R[{t},{k}]", 0, 1, integer=True, cost=nodes[k].time_s / time_unit_s
            )
        d.events.append((*ev, t))


def _active(d: _Draft, t: int, touched: set[int]) -> bool:
    return t in touched or any((t, j) in d.R for j in touched)


def _keep_columns(d: _Draft, ix: MilpIndex) -> None:
    """``S[t, v]``: constants for required values and values that cannot be recomputed, one
    column across stages in which nothing can make, read or free ``v``."""
    n = ix.num_nodes
    for v, p in ix.producer.items():
        end = min(ix.need_end[v], n)
        if v in ix.required:
            for t in range(p + 1, n + 1):
                d.S[(t, v)] = ONE
            continue
        touched = {p} | set(ix.consumers[v])
        prev: Ref | None = None
        for t in range(p + 1, end + 1):
            if t >= n:
                break
            if not ix.rerun[p] and t <= ix.last_read[v]:
                prev = d.S[(t, v)] = ONE  # cannot be recomputed: kept until its last reader
            elif prev is not None and is_var(prev) and not _active(d, t - 1, touched):
                # nothing can make, read or free v in stage t - 1: S[t] == S[t - 1]
                d.S[(t, v)] = prev
            else:
                prev = d.S[(t, v)] = (d.m.add_col(f"S[{t},{v}]", 0, 1, integer=True), 0.0)


# -- constraint families ----------------------------------------------------------------------


def _dependency_rows(d: _Draft, ix: MilpIndex) -> None:
    """(1) a node runs only when what it reads is resident or recomputed before it."""
    for t in range(ix.num_nodes):
        ev = d.events[t]
        in_stage = set(ev)
        for k in ev:
            rk = d.r(t, k)
            for x in ix.ins[k]:
                p = ix.producer[x]
                rhs = [d.s(t, x)]
                if p in in_stage and p < k:
                    rhs.append(d.r(t, p))
                d.le([rk], rhs)


def _purpose_rows(d: _Draft, ix: MilpIndex, opts: ModelOptions) -> None:
    """(3a) a recomputation must serve a later reader in the stage or a kept value."""
    for t in range(ix.num_nodes):
        ev = d.events[t]
        in_stage = set(ev)
        for k in ev[:-1]:
            rhs = []
            for w in ix.outs[k]:
                if not opts.lazy:
                    rhs.append(d.s(t + 1, w))
                rhs.extend(d.r(t, j) for j in ix.consumers[w] if j in in_stage and j > k)
            d.le([d.r(t, k)], rhs)


def _keep_rows(d: _Draft, ix: MilpIndex) -> None:
    """(2) kept into ``t + 1`` only if resident in ``t`` or (re)computed in ``t``."""
    n = ix.num_nodes
    for v, p in ix.producer.items():
        if v in ix.required:
            continue
        for t in range(p + 1, n):
            nxt = d.s(t + 1, v)
            if not is_var(nxt) or nxt == d.s(t, v):
                continue
            d.le([nxt], [d.s(t, v), d.r(t, p)])


def _residency_rows(d: _Draft, ix: MilpIndex) -> None:
    """(3b) resident in ``t`` only if read in ``t`` or kept further."""
    n = ix.num_nodes
    for v, p in ix.producer.items():
        if v in ix.required:
            continue
        for t in range(p + 1, n):
            cur = d.s(t, v)
            if not is_var(cur) or cur == d.s(t + 1, v):
                continue
            in_stage = set(d.events[t])
            rhs = [d.s(t + 1, v)]
            rhs.extend(d.r(t, j) for j in ix.consumers[v] if j in in_stage)
            d.le([cur], rhs)


def _allocation_columns(d: _Draft, ix: MilpIndex) -> None:
    """(4) ``A[t, w]``: a recomputation allocates its output (the rows come after ``F``)."""
    for (t, k), c in d.R.items():
        for w in ix.outs[k]:
            sw = d.s(t, w)
            if not is_var(sw) and sw[1] == 0.0:
                d.A[(t, w)] = (c, 0.0)  # not resident before: allocated iff it runs
            else:
                d.A[(t, w)] = (d.m.add_col(f"A[{t},{w}]", 0, 1), 0.0)


def _allocation_rows(d: _Draft, ix: MilpIndex) -> None:
    """(4) ``A >= R - S + (freed earlier in the stage)``."""
    m = d.m
    for (t, k), c in d.R.items():
        for w in ix.outs[k]:
            a = d.A[(t, w)]
            if a[0] == c:
                continue
            sw = d.s(t, w)
            terms = [(a[0], 1.0), (c, -1.0)]
            lo = 0.0
            if is_var(sw):
                terms.append((sw[0], 1.0))
            else:
                lo -= sw[1]
            for j in d.events[t]:
                if j >= k:
                    break
                f = d.F.get((t, w, j))
                if f is None:
                    continue
                if is_var(f):
                    terms.append((f[0], -1.0))
                else:
                    lo += f[1]
            m.add_row(terms, lo, math.inf)


def _memory_rows(
    d: _Draft, ix: MilpIndex, bu: float, dyn_budget: float, tick: Callable[[], None]
) -> None:
    """(5) ``U[t, k]``, the dynamic bytes while node ``k`` of stage ``t`` runs (the paper's
    recurrence), plus its workspace, within the room."""
    m = d.m
    nodes = ix.graph.nodes
    for t in range(ix.num_nodes):
        if t % 16 == 0:
            tick()
        ev = d.events[t]
        in_stage = set(ev)
        prev_u: int | None = None
        prev_freed: list[tuple[int, float]] = []
        prev_freed_const = 0.0
        for k in ev:
            alloc: list[tuple[int, float]] = []
            alloc_const = 0.0
            for w in ix.outs[k]:
                aw = ONE if k == t else d.A[(t, w)]
                if is_var(aw):
                    alloc.append((aw[0], ix.size[w] / bu))
                else:
                    alloc_const += aw[1] * ix.size[w] / bu
            u = m.add_col(f"U[{t},{k}]", 0, math.inf)
            terms: list[tuple[int, float]] = [(u, 1.0)]
            const = 0.0
            if prev_u is None:
                for v in ix.producer:
                    sv = d.s(t, v)
                    if is_var(sv):
                        terms.append((sv[0], -ix.size[v] / bu))
                    else:
                        const += sv[1] * ix.size[v] / bu
            else:
                terms.append((prev_u, -1.0))
                terms.extend((c, a) for c, a in prev_freed)
                const -= prev_freed_const
            terms.extend((c, -a) for c, a in alloc)
            const += alloc_const
            m.add_row(terms, const, const)
            rk = d.r(t, k)
            ws = nodes[k].workspace_bytes / bu
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
            for v in dict.fromkeys([*ix.ins[k], *ix.outs[k]]):
                if v in ix.required:
                    continue
                f = _free_quantity(d, ix, t, v, k, in_stage)
                if f is None:
                    continue
                d.F[(t, v, k)] = f
                if is_var(f):
                    prev_freed.append((f[0], ix.size[v] / bu))
                else:
                    prev_freed_const += f[1] * ix.size[v] / bu
            prev_u = u


def blockers(
    q: _Draft | Variables, ix: MilpIndex, t: int, v: str, k: int, in_stage: set[int]
) -> tuple[list[Ref], list[Ref], Ref]:
    """What keeps ``v`` from being freed right after ``k`` in stage ``t``: ``hard`` (any
    one blocks), ``soft`` (block unless the producer runs again later in the stage, then
    the new copy serves them) and that producer's ``R``."""
    p = ix.producer[v]
    rp = q.r(t, p) if (p in in_stage and p > k) else ZERO
    later = [j for j in ix.consumers[v] if j in in_stage and j > k]
    if rp == ZERO:
        return [q.s(t + 1, v), *(q.r(t, j) for j in later)], [], rp
    hard = [q.r(t, j) for j in later if j < p]
    soft = [q.s(t + 1, v), *(q.r(t, j) for j in later if j > p)]
    return hard, soft, rp


def _free_quantity(
    d: _Draft, ix: MilpIndex, t: int, v: str, k: int, in_stage: set[int]
) -> Ref | None:
    """``F[t, v, k]`` and its rows: None when it is always 0, else a constant 1 or a column."""
    rk = d.r(t, k)
    if not is_var(rk) and rk[1] == 0.0:
        return None
    hard, soft, rp = blockers(d, ix, t, v, k, in_stage)
    if any(not is_var(b) and b[1] == 1.0 for b in hard):
        return None
    var_hard = [b for b in hard if is_var(b)]
    soft = [b for b in soft if is_var(b) or b[1] == 1.0]
    if not is_var(rk) and not var_hard and not soft:
        return ONE
    m = d.m
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
