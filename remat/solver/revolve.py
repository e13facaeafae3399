"""``revolve``: Griewank's binomial checkpointing on the graph's chain of blocks.

The chain is treated as homogeneous (mean stage times and sizes), as revolve assumes; the DP
is :func:`remat.solver.chain_dp.revolve_table`.

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
from remat.ir.chain import CutKind, chain_view, expand
from remat.ir.result import SolveResult
from remat.solver.base import SolverOptions, register
from remat.solver.chain_dp import fit_chain_plan, revolve_schedule, revolve_table, trivial_result
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
