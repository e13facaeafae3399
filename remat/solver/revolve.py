"""``revolve``: Griewank's binomial checkpointing on the graph's chain of blocks.

The chain is treated as homogeneous (mean stage times and sizes), as revolve assumes; the DP
is :func:`revolve_table`.

References
----------
A. Griewank, A. Walther. "Algorithm 799: revolve: an implementation of checkpointing for the
reverse or adjoint mode of computational differentiation." ACM TOMS 26(1), 2000.
"""

from __future__ import annotations

import time

import numpy as np
from pydantic import Field

from remat.ir import Plan
from remat.ir.chain import ChainOp, CutKind, chain_view, expand
from remat.ir.result import SolveResult
from remat.solver.base import SolverOptions, register
from remat.solver.chain_dp import INF, fit_chain_plan, trivial_result
from remat.solver.problem import Problem


class RevolveOptions(SolverOptions):
    """Options of ``revolve``."""

    cuts: CutKind = Field("blocks", description="Which cuts make the chain (chain_view).")


@register(
    "revolve",
    kind="chain",
    summary="Binomial checkpointing on homogeneous chains (revolve)",
    options=RevolveOptions,
)
def solve_revolve(problem: Problem, *, cuts: CutKind = "blocks") -> SolveResult:
    """Griewank's binomial checkpointing on the graph's chain of blocks.

    The chain is treated as homogeneous (mean stage times and sizes), as revolve assumes; the
    number of checkpoints is the largest that fits the budget by that model, lowered until the
    expanded plan fits.

    References
    ----------
    A. Griewank, A. Walther, "Algorithm 799: revolve", ACM TOMS 26(1), 2000.
    """
    t0 = time.perf_counter()
    triv = trivial_result(problem, "revolve", t0)
    if triv is not None:
        return triv
    ch = chain_view(problem.graph, cuts=cuts)
    L = ch.num_stages
    f = float(np.mean([s.forward_time_s for s in ch.stages]))
    b = float(np.mean([s.backward_time_s for s in ch.stages]))
    ckpt = max(1, int(np.mean([s.input_bytes for s in ch.stages[1:]] or [1])))
    per_stage = max(
        (s.all_bytes + 2 * s.input_bytes + s.backward_temp_bytes for s in ch.stages), default=0
    )
    top = max(0, min(L, (problem.room_bytes - per_stage) // ckpt))
    cost = revolve_table(L, L, f, b)

    def plan_for(c: int) -> Plan | None:
        if c < 0:
            return None
        return expand(ch, revolve_schedule(L, c, cost, f))

    return fit_chain_plan(problem, plan_for, int(top), solver="revolve", started=t0)


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
