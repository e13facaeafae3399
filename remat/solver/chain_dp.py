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

from remat.ir import Plan
from remat.ir.chain import Chain, ChainOp
from remat.ir.result import SolveResult, best_result
from remat.solver.problem import Problem

INF = math.inf


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


@dataclass
class RotorTable:
    """The rotor DP: ``cost[s, t, m]`` is the least time to run the backward of stages
    ``s..t-1`` with ``x_s`` and ``δ_t`` resident and ``m`` slots in all; ``choice`` is -1 for a
    single stage, 0 for "forward with all activations", ``s'`` for a checkpoint at ``s'``."""

    arrays: ChainArrays
    cost: np.ndarray
    choice: np.ndarray

    def schedule(self, m: int) -> list[ChainOp]:
        """The chain schedule for the whole chain in ``m`` slots (cost must be finite)."""
        L = self.arrays.num_stages
        ops: list[ChainOp] = []
        self._rec(0, L, m, ops)
        return ops

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
            c = int(self.choice[s, t, m])
            if c == OFFLOAD:
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
                ops.extend(ChainOp("forward", k) for k in range(s, c))
                stack.append((s, c, m))
                stack.append((c, t, m - int(A.a[s])))


OFFLOAD = -2
"""``choice`` of POFO's extra option: forward with all activations, offload them while the
rest of the chain runs, prefetch them for the backward."""


def rotor_table(
    arr: ChainArrays, num_slots: int, transfer_s: np.ndarray | None = None
) -> RotorTable:
    """Fill the rotor DP for ``m = 0..num_slots`` (vectorised over ``m`` and the split point).

    With ``transfer_s`` (seconds to copy each stage's saved values one way), POFO's option is
    added: offload stage ``s``'s activations while stages ``s+1..t-1`` run and prefetch them for
    its backward; the copies overlap the compute, so the option costs
    ``f_s + max(C(s+1, t), 2 * transfer_s) + b_s`` and holds no activation memory meanwhile."""
    L = arr.num_stages
    M = num_slots + 1
    cost = np.full((L + 1, L + 1, M), INF)
    choice = np.full((L + 1, L + 1, M), -1, dtype=np.int32)
    ms = np.arange(M)
    a, abar, ftmp, fall, btmp = arr.a, arr.abar, arr.ftmp, arr.fall, arr.btmp
    f, b = arr.f, arr.b
    delta = a  # gradient of a cut: as large as the cut
    fcum = np.concatenate([[0.0], np.cumsum(f)])
    for s in range(L):
        t = s + 1
        b_need = a[s] + abar[s] + delta[t] + delta[s] + btmp[s]
        if arr.must_refresh(s):
            need = max(a[s] + delta[t] + abar[s] + a[t] + fall[s], b_need)
            cost[s, t, ms >= need] = f[s] + b[s]
        else:
            cost[s, t, ms >= b_need] = b[s]
    for d in range(2, L + 1):
        for s in range(0, L - d + 1):
            t = s + d
            best = np.full(M, INF)
            arg = np.full(M, -1, dtype=np.int32)
            # option "all": forward s keeping its activations, then s+1..t, then backward s
            keep = int(a[s] + abar[s])
            fall_need = a[s] + delta[t] + abar[s] + a[s + 1] + fall[s]
            b_need = a[s] + abar[s] + delta[s + 1] + delta[s] + btmp[s]
            if keep < M:
                sub = np.full(M, INF)
                sub[keep:] = cost[s + 1, t, : M - keep]
                opt = f[s] + sub + b[s]
                opt[ms < max(fall_need, b_need)] = INF
                best = opt
                arg[np.isfinite(opt)] = 0
            if transfer_s is not None and int(a[s]) < M:
                sh = int(a[s])
                sub = np.full(M, INF)
                sub[sh:] = cost[s + 1, t, : M - sh]
                opt = f[s] + np.maximum(sub, 2 * transfer_s[s]) + b[s]
                opt[ms < max(fall_need, b_need)] = INF
                better = opt < best
                best = np.where(better, opt, best)
                arg = np.where(better, OFFLOAD, arg)
            # option "checkpoint at s'": sweep s..s'-1 without saving, keep x_{s'}
            sp = np.arange(s + 1, t)
            sweep_peak = (
                a[s]
                + delta[t]
                + np.maximum.accumulate(
                    a[s + 1 : t]
                    + ftmp[s : t - 1]
                    + np.where(np.arange(s, t - 1) > s, a[s : t - 1], 0)
                )
            )
            shift = min(int(a[s]), M)
            # tot[j, m] = sweep cost + C(s'_j, t, m - a_s) + C(s, s'_j, m), built in place
            tot = np.empty((len(sp), M))
            tot[:, :shift] = INF
            np.add(cost[s + 1 : t, t, : M - shift], cost[s, s + 1 : t, shift:], out=tot[:, shift:])
            tot += (fcum[sp] - fcum[s])[:, None]
            np.putmask(tot, ms[None, :] < sweep_peak[:, None], INF)
            k = np.argmin(tot, axis=0)
            kv = np.take_along_axis(tot, k[None, :], axis=0)[0]
            better = kv < best
            best = np.where(better, kv, best)
            arg = np.where(better, sp[k], arg)
            cost[s, t] = best
            choice[s, t] = arg
    return RotorTable(arr, cost, choice)


# -- shared harness for the chain solvers ------------------------------------------------------


def fit_chain_plan(
    problem: Problem,
    plan_for: Callable[[int], Plan | None],
    top: int,
    *,
    solver: str,
    started: float,
    host_bandwidth_bytes_per_s: float | None = None,
    extra_plans: list[Plan] | None = None,
) -> SolveResult:
    """Lower the chain budget ``m`` from ``top`` until the expanded plan fits the budget.

    ``plan_for(m)`` returns the plan the chain method makes for ``m`` units of memory (None when
    it has none). Returns the fastest fitting plan among those tried (and ``extra_plans``), or an
    ``infeasible`` result with the smallest peak found.
    """
    budget_bytes = problem.budget_bytes
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

    while m >= 0:
        if problem.expired() and tried:
            break
        plan = plan_for(m)
        if plan is None:
            break
        r = judge(plan)
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
    # The eager plan, when it fits, beats every chain schedule (the chain model is cautious).
    tried.append(judge(problem.eager_plan))
    best = best_result(tried)
    assert best is not None
    return best.model_copy(update={"solve_time_s": time.perf_counter() - started})


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
