"""The chain dynamic programs shared by ``rotor``, ``revolve`` and ``pofo``, and the harness
that turns a chain schedule into a result the simulator has judged.

* :class:`ChainArrays`: a chain's figures (:mod:`remat.ir.chain`) in memory slots;
* :func:`rotor_table`: rotor's DP over sub-chains and memory, with POFO's offload option;
* :func:`revolve_table` / :func:`revolve_schedule`: Griewank's binomial checkpointing as a DP;
* :func:`fit_chain_plan`: lower the memory a chain method plans for until the expanded plan
  fits the real budget (the chain model is an estimate of the op-level memory).

References
----------
J. Herrmann, O. Beaumont, L. Eyraud-Dubois, J. Hermann, A. Joly, A. Shilova. "Optimal
checkpointing for heterogeneous chains: how to train deep neural networks with limited
memory." arXiv:1911.13214, 2019.

O. Beaumont, L. Eyraud-Dubois, A. Shilova. "Efficient Combination of Rematerialization and
Offloading for Training DNNs." NeurIPS 2021.

A. Griewank, A. Walther. "Algorithm 799: revolve: an implementation of checkpointing for the
reverse or adjoint mode of computational differentiation." ACM TOMS 26(1), 2000.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

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
class RotorTable:
    """The rotor DP: ``cost[s, t, m]`` is the least time to run the backward of stages
    ``s..t-1`` with ``x_s`` and ``δ_t`` resident and ``m`` slots in all.

    Only costs are stored; the option that reaches a cost (a single stage, "forward with all
    activations", a checkpoint at ``s'``, or POFO's offload) is found again when a schedule
    is read back (:meth:`choice`), for the ``O(L)`` entries that a schedule visits."""

    arrays: ChainArrays
    cost: np.ndarray
    transfer_s: np.ndarray | None = None
    options: tuple[tuple[StageOption, ...], ...] | None = None

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
            fcum = A.fcum
            peaks = _sweep_peaks(A, s, t)
            for j, sp in enumerate(range(s + 1, t)):
                if m < peaks[j]:
                    break
                v = ((cost[sp, t, m - shift] + fcum[sp]) + cost[s, sp, m]) - fcum[s]
                if v < best:
                    best, arg = v, sp
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
    fall_need = a[s] + a[t] + A.abar[s] + a[s + 1] + A.fall[s]
    b_need = a[s] + A.abar[s] + a[s + 1] + a[s] + A.btmp[s]
    return int(max(fall_need, b_need))


def _sweep_peaks(A: ChainArrays, s: int, t: int) -> np.ndarray:
    """Peak slots of sweeping ``s..s'-1`` forward without saving, for ``s' = s+1..t-1``
    (non-decreasing in ``s'``)."""
    a = A.a
    inner = a[s + 1 : t] + A.ftmp[s : t - 1]
    inner[1:] += a[s + 1 : t - 1]
    return np.asarray(a[s] + a[t] + np.maximum.accumulate(inner))


def rotor_table(
    arr: ChainArrays,
    num_slots: int,
    transfer_s: np.ndarray | None = None,
    *,
    deadline: Deadline | None = None,
    options: tuple[tuple[StageOption, ...], ...] | None = None,
) -> RotorTable:
    """Fill the rotor DP for ``m = 0..num_slots``.

    Sub-chains are filled by increasing end ``t`` and decreasing start ``s``, so that for the
    checkpoint option ``C(s', t, m - a_s) + C(s, s', m)`` (plus the sweep's forward time) every
    term is known; split points and memory are vectorised, and memory from which keeping every
    activation of the sub-chain fits is not searched for split points (there "all" is optimal:
    every other option runs some forward again). Rotor's ``O(L^3 M)`` recurrence with most of
    its constant removed.

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
    # only entries t > s are ever read; each is written whole below
    cost = np.empty((L + 1, L + 1, M), dtype=DTYPE)
    # need_all[s][t]: from this many slots on, "keep everything" is feasible (and optimal)
    need_all = [[0] * (L + 1) for _ in range(L + 1)]
    a = [int(x) for x in arr.a]
    abar = [int(x) for x in arr.abar]
    fall = [int(x) for x in arr.fall]
    btmp = [int(x) for x in arr.btmp]
    f = [float(x) for x in arr.f]
    b = [float(x) for x in arr.b]
    fcum = [float(x) for x in arr.fcum]
    tr = None if transfer_s is None else [2 * float(x) for x in transfer_s]
    # sweep peaks: pm[s][j] = max over i = s..s+j of (a[i+1] + ftmp[i] + a[i] if i > s)
    pm: list[np.ndarray] = []
    for s in range(L):
        inner = arr.a[s + 1 : L] + arr.ftmp[s : L - 1]
        inner[1:] += arr.a[s + 1 : L - 1]
        pm.append(np.maximum.accumulate(inner))
    for s in range(L):
        t = s + 1
        b_need = a[s] + abar[s] + a[t] + a[s] + btmp[s]
        if arr.must_refresh(s):
            need, val = max(a[s] + a[t] + abar[s] + a[t] + fall[s], b_need), f[s] + b[s]
        else:
            need, val = b_need, b[s]
        cost[s, t, : min(need, M)] = INF
        cost[s, t, min(need, M) :] = val
        need_all[s][t] = need
    # D[s'] = cost[s', t] + fcum[s'] for the current t; buf holds the split-point table
    D = np.empty((L + 1, M), dtype=DTYPE)
    buf = np.empty((max(L, 1), M), dtype=DTYPE)
    cols = np.arange(M)
    for t in range(2, L + 1):
        if deadline is not None:
            deadline.check("the rotor DP")
        np.add(cost[t - 1, t], fcum[t - 1], out=D[t - 1])
        at = a[t]
        for s in range(t - 2, -1, -1):
            best = cost[s, t]  # a view: filled in place
            keep = a[s] + abar[s]
            need = max(a[s] + at + abar[s] + a[s + 1] + fall[s], keep + a[s + 1] + a[s] + btmp[s])
            # option "all": forward s keeping its activations, then s+1..t-1, then backward s
            lo = min(max(need, keep), M)
            best[:lo] = INF
            if lo < M:
                np.add(cost[s + 1, t, lo - keep : M - keep], f[s] + b[s], out=best[lo:])
            for o in options[s] if options is not None else ():
                kk = a[s] + o.keep_slots
                lo = min(max(need, kk), M)
                if lo < M:
                    alt = cost[s + 1, t, lo - kk : M - kk] + (f[s] + b[s] + o.extra_time_s)
                    np.minimum(best[lo:], alt, out=best[lo:])
            na = max(need, keep + need_all[s + 1][t])
            need_all[s][t] = na
            sh = a[s]
            lo = max(need, sh)
            if tr is not None and lo < M:
                off = np.maximum(cost[s + 1, t, lo - sh : M - sh], tr[s])
                off += f[s] + b[s]
                np.minimum(best[lo:], off, out=best[lo:])
            # option "checkpoint at s'": sweep s..s'-1 without saving, keep x_{s'}; only
            # below na, where "all" may not be optimal
            W = min(M, na)
            if sh < W:
                rows = t - 1 - s
                tot = buf[:rows, :W]
                tot[:, :sh] = INF
                np.add(D[s + 1 : t, : W - sh], cost[s, s + 1 : t, sh:W], out=tot[:, sh:])
                # a split point is usable at m only when its sweep fits in m; the peaks are
                # small next to W, so only the first columns need masking
                base = a[s] + at
                top = min(int(pm[s][rows - 1]) + base, W)
                if top > sh:
                    peaks = pm[s][:rows] + base
                    np.putmask(tot[:, :top], cols[None, :top] < peaks[:, None], INF)
                ck = tot.min(axis=0)
                ck -= fcum[s]
                np.minimum(best[:W], ck, out=best[:W])
            np.add(best, fcum[s], out=D[s])
    return RotorTable(arr, cost, transfer_s, options)


# -- shared harness for the chain solvers ------------------------------------------------------


WORK_LIMIT = 1e9
"""Cells of split-point tables (``L^3 / 6 * M``) the rotor DP is allowed by default: a few
seconds on one loaded core. Longer chains are merged down to :func:`stage_cap` stages."""


def stage_cap(num_slots: int, work: float = WORK_LIMIT) -> int:
    """The most stages a chain may have for the rotor DP over ``num_slots`` slots to stay
    within ``work`` table cells (counted work, not time)."""
    return max(2, int((6 * work / (num_slots + 1)) ** (1 / 3)))


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
            # The chain does not describe this graph (a forward node that reads what a backward
            # node made, say): its schedules are no plans for it, and only eager is left.
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


# -- revolve ----------------------------------------------------------------------------------


def revolve_table(num_steps: int, num_checkpoints: int, f: float, b: float) -> np.ndarray:
    """``cost[l, c]``: least time to reverse ``l`` homogeneous steps from a stored input with
    ``c`` more checkpoint slots (Griewank's binomial checkpointing, as a DP)."""
    L, C = num_steps, num_checkpoints
    cost = np.full((L + 1, C + 1), INF)
    cost[0, :] = 0.0
    for c in range(C + 1):
        for n in range(1, L + 1):
            if n == 1:
                cost[1, c] = f + b
                continue
            # no checkpoint: sweep forward to the last step each time
            best = n * (f + b) + f * (n - 1) * n / 2
            if c > 0:
                j = np.arange(1, n)
                cand = j * f + cost[n - j, c - 1] + cost[j, c]
                best = min(best, float(cand.min()))
            cost[n, c] = best
    return cost


def revolve_schedule(L: int, c: int, cost: np.ndarray, f: float) -> list[ChainOp]:
    ops: list[ChainOp] = []
    stack: list[tuple[int, int, int] | ChainOp] = [(0, L, c)]
    while stack:
        item = stack.pop()
        if isinstance(item, ChainOp):
            ops.append(item)
            continue
        s, n, cc = item
        if n == 0:
            continue
        if n == 1:
            ops += [ChainOp("forward", s), ChainOp("backward", s)]
            continue
        sweep = n * (cost[1, 0]) + f * (n - 1) * n / 2
        best_j, best = 0, sweep
        if cc > 0:
            for j in range(1, n):
                v = j * f + cost[n - j, cc - 1] + cost[j, cc]
                if v < best - 1e-15:
                    best_j, best = j, v
        if best_j == 0:
            # sweep: for each stage from the last, re-run the forward from s
            for i in range(n):
                stack.append(ChainOp("backward", s + i))
                stack.append(ChainOp("forward", s + i))
                for k in reversed(range(i)):
                    stack.append(ChainOp("forward", s + k))
            continue
        ops.extend(ChainOp("forward", s + k) for k in range(best_j))
        stack.append((s, best_j, cc))
        stack.append((s + best_j, n - best_j, cc - 1))
    return ops
