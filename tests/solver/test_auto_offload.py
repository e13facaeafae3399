"""``auto`` with offloading on tiny graphs: ``poet`` runs among its methods, so the combined
answer is the optimum over poet's class of recomputation and paging."""

from __future__ import annotations

import dataclasses

import pytest
from _graphs import random_step
from test_offload import _with_link

import remat
from remat import solver
from remat.ir import HostLink, keep_plan, simulate, synthetic
from remat.ir.result import SolveResult, best_result
from remat.solver import Problem, base
from remat.solver.auto import _plain_on_a_tie
from remat.solver.offload import offload_pass

FAST = HostLink(
    device_to_host_bytes_per_s=1e12, host_to_device_bytes_per_s=1e12, host_memory_bytes=64
)


@pytest.mark.parametrize(("seed", "ops"), [(0, 3), (3, 2), (6, 3)])
def test_auto_reaches_poets_optimum_below_the_recompute_only_floor(seed: int, ops: int) -> None:
    g = _with_link(random_step(seed, ops), FAST)
    floor = solver.solve(g, 0.01, solver="milp").min_budget_bytes
    assert floor is not None
    budget = floor - 4
    poet = solver.solve(g, budget, solver="poet")
    assert poet.fits and poet.total_time_s is not None
    r = remat.solve(g, budget)
    assert r.fits and r.plan is not None, r.message
    assert simulate(g, r.plan).peak_bytes <= budget
    # as fast as poet's MILP optimum (within its gap: its copies may stall for a few
    # picoseconds more than another plan's, as it weighs each copy too)
    assert r.total_time_s <= poet.total_time_s * (1 + 1e-9), r.message
    assert "poet" in r.message


@pytest.mark.parametrize("seed", [2, 3])
def test_auto_is_never_slower_than_poet(seed: int) -> None:
    g = _with_link(random_step(seed, 3), FAST)
    peak = simulate(g, remat.ir.eager_plan(g)).peak_bytes
    for b in range(peak - 4, g.static_bytes + g.input_bytes - 1, -12):
        poet = solver.solve(g, b, solver="poet")
        r = remat.solve(g, b)
        assert r.fits == poet.fits or r.fits, b
        if poet.fits:
            assert r.total_time_s is not None and poet.total_time_s is not None
            assert r.total_time_s <= poet.total_time_s * (1 + 1e-9), (b, r.message)


def test_auto_evicts_to_the_host_with_both_dtr_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, object]] = []
    si = base._REGISTRY["dtr"]

    def recorded(problem: Problem, **options: object) -> SolveResult:
        calls.append(options)
        return si.fn(problem, **options)

    monkeypatch.setitem(base._REGISTRY, "dtr", dataclasses.replace(si, fn=recorded))
    g = synthetic.random_layered_dag(30)  # an A100 link; 40% is far from the eager time
    r = solver.solve(g, 0.4, time_limit_s=5)
    assert r.fits, r.message
    host = {str(c.get("heuristic", "dtr")) for c in calls if c.get("offload") is True}
    assert host == {"dtr", "next-use"}, calls


@pytest.mark.slow
def test_auto_is_within_a_tenth_of_its_bound_on_a_random_dag_at_30_percent() -> None:
    # issue 26, item 3: benchmarks/scale.py's dag300 (759 nodes). DTR evicting to the host
    # with the next-use score gives +25.1%, its prefetches issued earlier (remat.solver.hoist)
    # +9.3%, against a combined bound of +0.0%; before, auto's answer was +90.0% (the
    # paper's score; all figures with prefetches starting where the plan issues them)
    g = synthetic.random_layered_dag(300)
    r = solver.solve(g, 0.3, time_limit_s=30)
    assert r.fits and r.offload_bytes, r.message
    assert r.gap is not None and r.gap <= 0.10, (r.overhead, r.gap, r.message)


def test_a_plan_that_moves_nothing_wins_a_tie() -> None:
    g = synthetic.transformer(2)  # an A100 link
    problem = Problem.build(g, 10**15)
    moved, sim = offload_pass(g, problem.eager_plan)
    assert sim.offload_bytes > 0 and sim.total_time_s == problem.eager.total_time_s
    plain = problem.result(problem.eager_plan, solver="none", started=0.0)
    copies = problem.result(moved, solver="copies", started=0.0)
    # the offloading plan peaks lower at the same time: best_result takes it, auto does not
    assert best_result([copies, plain]) is copies
    assert _plain_on_a_tie([copies, plain]) is plain
    slower = problem.result(keep_plan(g, []), solver="slower", started=0.0)
    assert _plain_on_a_tie([copies, slower]) is copies
