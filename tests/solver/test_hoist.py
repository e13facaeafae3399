"""Prefetches issued earlier where the budget has room (remat.solver.hoist)."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remat import solver
from remat.ir import Plan, simulate, synthetic
from remat.solver.hoist import hoist_prefetches, polish_prefetches, with_moves


def _prefetches(plan: Plan) -> list[str]:
    return [s.id for s in plan.steps if s.op == "prefetch"]


def test_hoisting_takes_the_stalls_off_dtrs_plan_with_the_host() -> None:
    # a random layered DAG at 40% (A100 link): DTR evicting to the host issues its prefetches
    # only into free memory, and reads wait for them (+15.0% over eager); issued earlier where
    # the room is there at every step they cross: +4.9%
    g = synthetic.random_layered_dag(150)
    eager = simulate(g, solver.get("none")(g, 10**15).plan)
    budget = g.static_bytes + int(0.4 * eager.peak_dynamic_bytes)
    r = solver.get("dtr")(g, budget, heuristic="next-use", offload=True, combine=False)
    assert r.fits and r.plan is not None and r.total_time_s is not None
    before = simulate(g, r.plan)
    plan, sim = polish_prefetches(g, r.plan, budget_bytes=budget)
    assert simulate(g, plan) == sim  # a valid plan, judged again
    assert sim.peak_bytes <= budget
    assert sim.total_time_s < 0.95 * before.total_time_s
    assert sim.stall_time_s < before.stall_time_s
    # the same copies in the same order, the computes and frees unchanged
    assert _prefetches(plan) == _prefetches(r.plan)
    assert [s for s in plan.steps if s.op != "prefetch"] == [
        s for s in r.plan.steps if s.op != "prefetch"
    ]


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10**6), ops=st.integers(10, 40), slack=st.sampled_from([0, 0.05]))
def test_polishing_never_adds_time_nor_passes_the_budget(seed: int, ops: int, slack: float) -> None:
    g = synthetic.random_layered_dag(ops, seed=seed)
    r = solver.get("offload-all")(g, 10**15)
    assert r.plan is not None
    start = simulate(g, r.plan)
    budget = start.peak_bytes + int(slack * (start.peak_bytes - g.static_bytes))
    plan, sim = polish_prefetches(g, r.plan, budget_bytes=budget)
    assert sim.peak_bytes <= budget
    assert sim.total_time_s <= start.total_time_s
    assert _prefetches(plan) == _prefetches(r.plan)
    # without a cap and with no room left, nothing moves
    full = hoist_prefetches(g, r.plan, budget_bytes=start.peak_bytes, sim=start, lead=math.inf,
                            margin_bytes=start.peak_bytes)  # fmt: skip
    assert full == {} and with_moves(r.plan, full)[0] == r.plan
