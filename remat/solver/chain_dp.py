"""The chain dynamic program shared by ``rotor``, ``pofo`` and ``hierarchical``, and the harness
that turns a chain schedule into a result the simulator has judged (``revolve`` too).

* :class:`ChainArrays`: a chain's figures (:mod:`remat.ir.chain`) in memory slots;
* :func:`rotor_table`: rotor's DP over sub-chains and memory, with POFO's offload option,
  identical sub-chains filled once (:func:`subchain_classes`);
* :func:`fit_chain_plan`: lower the memory a chain method plans for until the expanded plan
  fits the real budget (the chain model is an estimate of the op-level memory).

References
----------
J. Herrmann, O. Beaumont, L. Eyraud-Dubois, J. Hermann, A. Joly, A. Shilova. "Optimal
checkpointing for heterogeneous chains: how to train deep neural networks with limited
memory." arXiv:1911.13214, 2019.

O. Beaumont, L. Eyraud-Dubois, A. Shilova. "Efficient Combination of Rematerialization and
Offloading for Training DNNs." NeurIPS 2021.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import overload

import numpy as np

from remat.ir import InvalidPlanError, Plan
from remat.ir.chain import Chain, ChainOp
from remat.ir.result import SolveResult, best_result
from remat.solver.deadline import Deadline
from remat.solver.problem import Problem

INF = math.inf
DTYPE = np.float64


@dataclass(frozen=True)
class ChainArrays:
    """A chain's figures as arrays in memory slots (sizes rounded to the nearest slot)."""

    f: np.ndarray  # forward time per stage
    b: np.ndarray  # backward time per stage
    a: np.ndarray  # input-cut slots per stage, a[L] = 0 (nothing after the last stage)
    abar: np.ndarray  # all-activation slots per stage
    ftmp: np.ndarray  # forward without saving
    fall: np.ndarray  # forward keeping all activations, beyond abar
    btmp: np.ndarray
    slot_bytes: float
    needs_forward: np.ndarray | None = None
    """Per stage: must its forward run again right before its backward? Not when the backward
    reads only the stage's input (and gradients), e.g. a matmul whose output is not saved; the
    last stage always (its first forward happens there)."""

    def must_refresh(self, s: int) -> bool:
        nf = self.needs_forward
        return True if nf is None else bool(nf[s])

    @property
    def num_stages(self) -> int:
        return len(self.f)

    @property
    def fcum(self) -> np.ndarray:
        """``fcum[i]``: forward time of stages ``0..i-1``."""
        return np.concatenate([[0.0], np.cumsum(self.f)])

    @classmethod
    def of(cls, chain: Chain, slot_bytes: float) -> ChainArrays:
        st = chain.stages

        def slots(x: int) -> int:
            # nearest, not ceiling: rounding up dozens of checkpoints would waste a large part
            # of the budget; the expanded plan is checked against the real budget anyway
            return round(x / slot_bytes) if slot_bytes > 0 else 0

        a = np.array([slots(s.input_bytes) for s in st] + [0], dtype=np.int64)
        a[0] = 0  # the graph's inputs are held by the caller and counted apart
        return cls(
            f=np.array([s.forward_time_s for s in st], dtype=np.float64),
            b=np.array([s.backward_time_s for s in st], dtype=np.float64),
            a=a,
            abar=np.array([slots(s.all_bytes) for s in st], dtype=np.int64),
            ftmp=np.array([slots(s.forward_temp_bytes) for s in st], dtype=np.int64),
            fall=np.array([slots(s.forward_all_temp_bytes) for s in st], dtype=np.int64),
            btmp=np.array([slots(s.backward_temp_bytes) for s in st], dtype=np.int64),
            slot_bytes=slot_bytes,
            needs_forward=np.array(
                [s.all_bytes > 0 or i == len(st) - 1 for i, s in enumerate(st)], dtype=bool
            ),
        )


@dataclass(frozen=True)
class StageOption:
    """A partial save of a stage (``hierarchical``): forward keeping ``keep_slots`` of its
    activations and, before its backward, running ``rerun_nodes`` again (``extra_time_s``)
    to make the others."""

    keep_slots: int
    extra_time_s: float
    rerun_nodes: tuple[str, ...]


OPTION_BASE = -10
"""``choice`` of a stage option ``k``: ``OPTION_BASE - k``."""

OFFLOAD = -2
"""POFO's extra option: forward with all activations, offload them while the rest of the chain
runs, prefetch them for the backward."""


@dataclass(frozen=True)
class SubchainCosts:
    """The rotor table's costs, one row per class of identical sub-chains.

    ``self[s, t]`` is the row ``cost[s, t, 0..M-1]`` and ``self[s, t, m]`` one entry. Sub-chains
    whose stages have the same figures (and the same cut after them) have the same costs, so a
    chain of repeated layers stores and fills only a few rows per length."""

    rows: np.ndarray
    """``(classes, M)``: the costs of each class."""
    index: np.ndarray
    """``(L + 1, L + 1)``: the class of sub-chain ``s..t-1``; -1 where ``t <= s``."""

    @overload
    def __getitem__(self, key: tuple[int, int]) -> np.ndarray: ...

    @overload
    def __getitem__(self, key: tuple[int, int, int]) -> float: ...

    def __getitem__(self, key: tuple[int, ...]) -> np.ndarray | float:
        c = int(self.index[key[0], key[1]])
        if c < 0:
            raise IndexError(f"no sub-chain {key[0]}..{key[1] - 1}")
        if len(key) == 2:
            return np.asarray(self.rows[c])
        return float(self.rows[c, key[2]])


@dataclass(frozen=True)
class RotorTable:
    """The rotor DP: ``cost[s, t, m]`` is the least time to run the backward of stages
    ``s..t-1`` with ``x_s`` and ``δ_t`` resident and ``m`` slots in all.

    Only costs are stored; the option that reaches a cost (a single stage, "forward with all
    activations", a checkpoint at ``s'``, or POFO's offload) is found again when a schedule
    is read back (:meth:`choice`), for the ``O(L)`` entries that a schedule visits."""

    arrays: ChainArrays
    cost: SubchainCosts
    transfer_s: np.ndarray | None = None
    options: tuple[tuple[StageOption, ...], ...] | None = None
    filled_subchains: int = 0
    """Sub-chains whose costs were computed (the others share a class's row): counted work."""
    split_cells: int = 0
    """Cells of the split-point tables filled: counted work."""

    def schedule(self, m: int) -> list[ChainOp]:
        """The chain schedule for the whole chain in ``m`` slots (cost must be finite)."""
        L = self.arrays.num_stages
        ops: list[ChainOp] = []
        self._rec(0, L, m, ops)
        return ops

    def choice(self, s: int, t: int, m: int) -> int:
        """The option reaching ``cost[s, t, m]``: -1 for a single stage, 0 for "all",
        :data:`OFFLOAD`, or the checkpointed stage ``s'`` (ties: all, offload, first s')."""
        if t == s + 1:
            return -1
        A, cost = self.arrays, self.cost
        a = A.a
        need = _all_need(A, s, t)
        best, arg = INF, -1
        keep = int(a[s] + A.abar[s])
        if m >= need and m >= keep:
            best, arg = A.f[s] + cost[s + 1, t, m - keep] + A.b[s], 0
        for k, o in enumerate(self.options[s] if self.options is not None else ()):
            kk = int(a[s]) + o.keep_slots
            if m >= need and m >= kk:
                v = cost[s + 1, t, m - kk] + (A.f[s] + A.b[s] + o.extra_time_s)
                if v < best:
                    best, arg = v, OPTION_BASE - k
        tr = self.transfer_s
        if tr is not None and m >= need and m >= int(a[s]):
            v = A.f[s] + max(cost[s + 1, t, m - int(a[s])], 2 * tr[s]) + A.b[s]
            if v < best:
                best, arg = v, OFFLOAD
        shift = int(a[s])
        if m >= shift:
            # split points whose sweep fits in m: a prefix (the peaks do not decrease)
            usable = int(np.searchsorted(_sweep_peaks(A, s, t), m, side="right"))
            if usable:
                sps = np.arange(s + 1, s + 1 + usable)
                rows, index = cost.rows, cost.index
                vals = (rows[index[sps, t], m - shift] + A.fcum[sps]) + rows[index[s, sps], m]
                vals -= A.fcum[s]
                j = int(np.argmin(vals))
                if vals[j] < best:
                    best, arg = float(vals[j]), int(sps[j])
        return arg

    def _rec(self, s: int, t: int, m: int, ops: list[ChainOp]) -> None:
        # An explicit stack keeps deep chains clear of Python's recursion limit.
        stack: list[tuple[int, int, int] | ChainOp] = [(s, t, m)]
        A = self.arrays
        while stack:
            item = stack.pop()
            if isinstance(item, ChainOp):
                ops.append(item)
                continue
            s, t, m = item
            if t == s + 1:
                if A.must_refresh(s):
                    ops.append(ChainOp("forward", s))
                ops.append(ChainOp("backward", s))
                continue
            c = self.choice(s, t, m)
            if c <= OPTION_BASE:
                assert self.options is not None
                o = self.options[s][OPTION_BASE - c]
                ops.append(ChainOp("forward", s))
                stack.append(ChainOp("backward", s))
                stack.append(ChainOp("rerun", s, o.rerun_nodes))
                stack.append((s + 1, t, m - int(A.a[s]) - o.keep_slots))
            elif c == OFFLOAD:
                ops.append(ChainOp("forward", s))
                ops.append(ChainOp("offload", s))
                stack.append(ChainOp("backward", s))
                stack.append(ChainOp("prefetch", s))
                stack.append((s + 1, t, m - int(A.a[s])))
            elif c == 0:
                ops.append(ChainOp("forward", s))
                stack.append(ChainOp("backward", s))
                stack.append((s + 1, t, m - int(A.a[s]) - int(A.abar[s])))
            else:
                assert c > s, f"no option reaches cost[{s}, {t}, {m}]"
                ops.extend(ChainOp("forward", k) for k in range(s, c))
                stack.append((s, c, m))
                stack.append((c, t, m - int(A.a[s])))


def _all_need(A: ChainArrays, s: int, t: int) -> int:
    """Slots that "forward s keeping all, then s+1..t-1, then backward s" needs beyond the
    sub-chain's own (its forward with all activations, and its backward)."""
    a = A.a
    return _chain_need(
        int(a[s]), int(a[s + 1]), int(a[t]), int(A.abar[s]), int(A.fall[s]), int(A.btmp[s])
    )


def _chain_need(a_s: int, a_next: int, a_t: int, abar_s: int, fall_s: int, btmp_s: int) -> int:
    """:func:`_all_need` from the stage's figures: the larger of its forward keeping all
    (with the sub-chain's ends resident) and its backward."""
    return max(a_s + a_t + abar_s + a_next + fall_s, a_s + abar_s + a_next + a_s + btmp_s)


def _single_need(a_s: int, a_t: int, abar_s: int, fall_s: int, btmp_s: int, refresh: bool) -> int:
    """Slots a single stage's forward (when it must run again) and backward need."""
    b_need = a_s + abar_s + a_t + a_s + btmp_s
    return max(a_s + a_t + abar_s + a_t + fall_s, b_need) if refresh else b_need


def dp_cells(arr: ChainArrays, num_slots: int) -> int:
    """The split-table cells :func:`rotor_table` fills for ``arr`` over ``num_slots`` slots
    (its :attr:`RotorTable.split_cells`), counted without filling it: the DP's work, to pick
    a chain the DP can fill in time."""
    L = arr.num_stages
    M = num_slots + 1
    index, n = subchain_classes(arr)
    a = [int(x) for x in arr.a]
    abar = [int(x) for x in arr.abar]
    fall = [int(x) for x in arr.fall]
    btmp = [int(x) for x in arr.btmp]
    na = [0] * max(n, 1)
    new = cells = 0
    for t in range(1, L + 1):
        col = index[:t, t].tolist()
        for s in range(t - 1, -1, -1):
            c = col[s]
            if c != new:
                continue
            new += 1
            if t == s + 1:
                na[c] = _single_need(a[s], a[t], abar[s], fall[s], btmp[s], arr.must_refresh(s))
                continue
            keep = a[s] + abar[s]
            need = _chain_need(a[s], a[s + 1], a[t], abar[s], fall[s], btmp[s])
            na[c] = max(need, keep + na[col[s + 1]])
            W = min(M, na[c])
            if a[s] < W:
                cells += (t - 1 - s) * W
    return cells


def _sweep_peaks(A: ChainArrays, s: int, t: int) -> np.ndarray:
    """Peak slots of sweeping ``s..s'-1`` forward without saving, for ``s' = s+1..t-1``
    (non-decreasing in ``s'``)."""
    a = A.a
    inner = a[s + 1 : t] + A.ftmp[s : t - 1]
    inner[1:] += a[s + 1 : t - 1]
    return np.asarray(a[s] + a[t] + np.maximum.accumulate(inner))


def subchain_classes(
    arr: ChainArrays,
    transfer_s: np.ndarray | None = None,
    options: tuple[tuple[StageOption, ...], ...] | None = None,
    *,
    share: bool = True,
) -> tuple[np.ndarray, int]:
    """The class of every sub-chain ``s..t-1`` (an ``(L + 1, L + 1)`` array, -1 where
    ``t <= s``) and the number of classes: sub-chains whose stages have equal figures (times,
    slots, refresh, copy time, partial saves' slots and times) and whose next cut has equal
    slots have the same rotor costs. Classes are numbered in the DP's fill order (increasing
    end, decreasing start), so a class is new exactly when its number is the next one.
    ``share=False`` gives every sub-chain its own class."""
    L = arr.num_stages
    sym: list[int] = []
    seen: dict[object, int] = {}
    for s in range(L):
        opts = options[s] if options is not None else ()
        key = (
            float(arr.f[s]),
            float(arr.b[s]),
            int(arr.a[s]),
            int(arr.abar[s]),
            int(arr.ftmp[s]),
            int(arr.fall[s]),
            int(arr.btmp[s]),
            arr.must_refresh(s),
            None if transfer_s is None else float(transfer_s[s]),
            tuple((o.keep_slots, o.extra_time_s) for o in opts),
        )
        sym.append(seen.setdefault(key, len(seen)) if share else s)
    index = np.full((L + 1, L + 1), -1, dtype=np.int64)
    ids: dict[tuple[int, int], int] = {}
    for t in range(1, L + 1):
        # a sub-chain is its first stage followed by the sub-chain after it; the empty one is
        # the cut after the last stage (its slots), numbered apart (negative)
        prev = -1 - int(arr.a[t]) if share else -1 - t
        for s in range(t - 1, -1, -1):
            prev = ids.setdefault((sym[s], prev), len(ids))
            index[s, t] = prev
    return index, len(ids)


def rotor_table(
    arr: ChainArrays,
    num_slots: int,
    transfer_s: np.ndarray | None = None,
    *,
    deadline: Deadline | None = None,
    options: tuple[tuple[StageOption, ...], ...] | None = None,
    share: bool = True,
) -> RotorTable:
    """Fill the rotor DP for ``m = 0..num_slots``.

    Sub-chains are filled by increasing end ``t`` and decreasing start ``s``, so that for the
    checkpoint option ``C(s', t, m - a_s) + C(s, s', m)`` (plus the sweep's forward time) every
    term is known; split points and memory are vectorised, and memory from which keeping every
    activation of the sub-chain fits is not searched for split points (there "all" is optimal:
    every other option runs some forward again). Sub-chains identical to one filled before
    (:func:`subchain_classes`) share its costs and are not filled again: on a chain of ``L``
    repeated layers that leaves ``O(L)`` sub-chains to fill instead of ``L^2 / 2``. Rotor's
    ``O(L^3 M)`` recurrence with most of its constant removed.

    With ``transfer_s`` (seconds to copy each stage's saved values one way), POFO's option is
    added: offload stage ``s``'s activations while stages ``s+1..t-1`` run and prefetch them for
    its backward; the copies overlap the compute, so the option costs
    ``f_s + max(C(s+1, t), 2 * transfer_s) + b_s`` and holds no activation memory meanwhile.

    With ``options`` (per stage, partial saves: ``hierarchical``), each is one more way to run
    a stage: forward keeping ``keep_slots``, the rest of the chain, rerun, backward; its memory
    needs are taken as those of keeping everything (a cautious model: the expanded plan is
    judged by the simulator).

    Raises :class:`~remat.solver.deadline.Expired` when ``deadline`` passes (checked once per
    sub-chain end ``t``)."""
    L = arr.num_stages
    M = num_slots + 1
    if deadline is not None:
        deadline.check("the rotor DP")
    index, num_classes = subchain_classes(arr, transfer_s, options, share=share)
    rows = np.empty((max(num_classes, 1), M), dtype=DTYPE)
    fill = _Filler(arr, M, index, rows, transfer_s, options)
    fcum, D = fill.fcum, fill.D
    new = 0  # the next class to fill
    cells = 0
    for t in range(1, L + 1):
        if deadline is not None and t >= 2:
            deadline.check("the rotor DP")
        for s in range(t - 1, -1, -1):
            c = int(index[s, t])
            if c == new:
                new += 1
                if t == s + 1:
                    fill.single(s, c)
                else:
                    cells += fill.chain(s, t, c)
            np.add(rows[c], fcum[s], out=D[s])
    return RotorTable(arr, SubchainCosts(rows, index), transfer_s, options, num_classes, cells)


class _Filler:
    """The per-chain figures the fill of one sub-chain reads, as plain Python numbers."""

    def __init__(
        self,
        arr: ChainArrays,
        M: int,
        index: np.ndarray,
        rows: np.ndarray,
        transfer_s: np.ndarray | None,
        options: tuple[tuple[StageOption, ...], ...] | None,
    ) -> None:
        L = arr.num_stages
        self.arr, self.M, self.index, self.rows, self.options = arr, M, index, rows, options
        # need_all[c]: from this many slots on, "keep everything" is feasible (and optimal)
        self.need_all = [0] * len(rows)
        self.a = [int(x) for x in arr.a]
        self.abar = [int(x) for x in arr.abar]
        self.fall = [int(x) for x in arr.fall]
        self.btmp = [int(x) for x in arr.btmp]
        self.f = [float(x) for x in arr.f]
        self.b = [float(x) for x in arr.b]
        self.fcum = [float(x) for x in arr.fcum]
        self.tr = None if transfer_s is None else [2 * float(x) for x in transfer_s]
        # sweep peaks: pm[s][j] = max over i = s..s+j of (a[i+1] + ftmp[i] + a[i] if i > s)
        self.pm: list[np.ndarray] = []
        for s in range(L):
            inner = arr.a[s + 1 : L] + arr.ftmp[s : L - 1]
            inner[1:] += arr.a[s + 1 : L - 1]
            self.pm.append(np.maximum.accumulate(inner))
        # D[s'] = cost[s', t] + fcum[s'] for the current t; buf holds the split-point table
        self.D = np.empty((L + 1, M), dtype=DTYPE)
        self.buf = np.empty((max(L, 1), M), dtype=DTYPE)
        self.cols = np.arange(M)

    def single(self, s: int, c: int) -> None:
        """One stage: forward (unless its backward needs only its input) and backward."""
        a, abar, t, M = self.a, self.abar, s + 1, self.M
        best = self.rows[c]
        refresh = self.arr.must_refresh(s)
        need = _single_need(a[s], a[t], abar[s], self.fall[s], self.btmp[s], refresh)
        val = self.f[s] + self.b[s] if refresh else self.b[s]
        best[: min(need, M)] = INF
        best[min(need, M) :] = val
        self.need_all[c] = need

    def chain(self, s: int, t: int, c: int) -> int:
        """Fill ``cost[s, t]`` (``t > s + 1``) into class ``c``'s row; returns the
        split-table cells filled."""
        a, abar, f, b, M, index = self.a, self.abar, self.f, self.b, self.M, self.index
        best = self.rows[c]  # a view: filled in place
        c1 = int(index[s + 1, t])
        nxt = self.rows[c1]  # cost[s + 1, t]
        at = a[t]
        keep = a[s] + abar[s]
        need = _chain_need(a[s], a[s + 1], at, abar[s], self.fall[s], self.btmp[s])
        # option "all": forward s keeping its activations, then s+1..t-1, then backward s
        lo = min(max(need, keep), M)
        best[:lo] = INF
        if lo < M:
            np.add(nxt[lo - keep : M - keep], f[s] + b[s], out=best[lo:])
        for o in self.options[s] if self.options is not None else ():
            kk = a[s] + o.keep_slots
            lo = min(max(need, kk), M)
            if lo < M:
                alt = nxt[lo - kk : M - kk] + (f[s] + b[s] + o.extra_time_s)
                np.minimum(best[lo:], alt, out=best[lo:])
        na = max(need, keep + self.need_all[c1])
        self.need_all[c] = na
        sh = a[s]
        lo = max(need, sh)
        if self.tr is not None and lo < M:
            off = np.maximum(nxt[lo - sh : M - sh], self.tr[s])
            off += f[s] + b[s]
            np.minimum(best[lo:], off, out=best[lo:])
        # option "checkpoint at s'": sweep s..s'-1 without saving, keep x_{s'}; only below
        # na, where "all" may not be optimal
        W = min(M, na)
        if sh >= W:
            return 0
        rows = t - 1 - s
        tot = self.buf[:rows, :W]
        tot[:, :sh] = INF
        left = self.rows[index[s, s + 1 : t], sh:W]  # cost[s, s'], s' = s+1..t-1 (a copy)
        np.add(self.D[s + 1 : t, : W - sh], left, out=tot[:, sh:])
        # a split point is usable at m only when its sweep fits in m; the peaks are small
        # next to W, so only the first columns need masking
        base = a[s] + at
        pm = self.pm[s]
        top = min(int(pm[rows - 1]) + base, W)
        if top > sh:
            peaks = pm[:rows] + base
            np.putmask(tot[:, :top], self.cols[None, :top] < peaks[:, None], INF)
        ck = tot.min(axis=0)
        ck -= self.fcum[s]
        np.minimum(best[:W], ck, out=best[:W])
        return rows * W


# -- shared harness for the chain solvers ------------------------------------------------------


WORK_LIMIT = 2e8
"""Cells of split-point tables (:func:`dp_cells`) the rotor DP is allowed by default: a second
or two on one idle core (about 8 ns a cell). Chains whose DP would fill more are merged."""


def fit_chain_plan(
    problem: Problem,
    plan_for: Callable[[int], Plan | None],
    top: int,
    *,
    solver: str,
    started: float,
    deadline: Deadline | None = None,
    host_bandwidth_bytes_per_s: float | None = None,
    extra_plans: list[Plan] | None = None,
) -> SolveResult:
    """Lower the chain budget ``m`` from ``top`` until the expanded plan fits the budget.

    ``plan_for(m)`` returns the plan the chain method makes for ``m`` units of memory (None when
    it has none). Returns the fastest fitting plan among those tried (and ``extra_plans``, and
    the eager plan), or an ``infeasible`` result with the smallest peak found. After the first
    plan, no further one is tried once ``deadline`` (default: the problem's) has passed.
    """
    budget_bytes = problem.budget_bytes
    dl = deadline if deadline is not None else Deadline(problem.deadline)
    tried: list[SolveResult] = []
    m = top
    last_m = None

    def judge(plan: Plan) -> SolveResult:
        return problem.result(
            plan,
            solver=solver,
            started=started,
            host_bandwidth_bytes_per_s=host_bandwidth_bytes_per_s,
        )

    unfit = ""
    while m >= 0:
        if tried and dl.expired():
            break
        try:
            plan = plan_for(m)
            if plan is None:
                break
            r = judge(plan)
        except InvalidPlanError as exc:
            # The chain does not describe this graph: its schedules are no plans for it, and
            # only eager is left (the forward sweep keeps a backward node that a forward node
            # reads in the forward pass, so no graph known to the tests gets here).
            unfit = f"chain expansion failed: {exc}"
            break
        tried.append(r)
        if r.fits:
            break
        assert r.figures is not None  # a judged plan always has figures
        over = r.figures.peak_bytes - budget_bytes
        step = max(1, int(m * over / max(1, problem.room_bytes)) + 1)
        last_m = m
        m = m - step
        if last_m == m:  # pragma: no cover - step >= 1
            break
    tried.extend(judge(p) for p in extra_plans or [])
    # The eager plan, when it fits, beats every chain schedule (the chain model is cautious);
    # its simulation is the problem's own, not run again.
    tried.append(judge(problem.eager_plan))
    best = best_result(tried)
    assert best is not None
    update: dict[str, object] = {"solve_time_s": time.perf_counter() - started}
    if unfit:
        update["message"] = unfit
    return best.model_copy(update=update)


def trivial_result(problem: Problem, solver: str, started: float) -> SolveResult | None:
    """Graphs without a forward pass to checkpoint: the eager plan is the only sensible one."""
    if not problem.graph.forward_nodes or not problem.graph.backward_nodes:
        return problem.best_of([problem.eager_plan], solver=solver, started=started)
    return None


def min_chain_slots(cost_row: np.ndarray) -> int | None:
    finite = np.flatnonzero(np.isfinite(cost_row))
    return int(finite[0]) if len(finite) else None
