"""``dtr``: Dynamic Tensor Rematerialization as a planner (Kirisame et al. 2021).

Beyond the contract suite: never below the exhaustive optimum, valid plans that fit whenever
they say so, deterministic, backward recomputation where the step needs it, and a deadline on
counted work.
"""

from __future__ import annotations

import pytest
from _clocks import CountingClock
from _graphs import random_step
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import oracle

import remat.solver.dtr as dtr
from remat import solver
from remat.ir import Graph, eager_plan, simulate
from remat.ir.budget import fraction_bytes
from remat.ir.synthetic import random_layered_dag, transformer, unet
from remat.solver.deadline import Deadline, Expired

FRACS = st.sampled_from([1.0, 0.9, 0.8, 0.7, 0.6, 0.5])


def frac_budget(g: Graph, frac: float) -> int:
    return fraction_bytes(g, frac, simulate(g, eager_plan(g)).peak_dynamic_bytes)


@settings(max_examples=25)
@given(
    seed=st.integers(0, 10**6),
    ops=st.integers(2, 4),
    frac=FRACS,
    heuristic=st.sampled_from(["dtr", "next-use"]),
    backward_last=st.booleans(),
)
def test_never_below_the_exact_optimum_and_fits_when_it_says_so(
    seed: int, ops: int, frac: float, heuristic: str, backward_last: bool
) -> None:
    g = random_step(seed, ops)
    b = frac_budget(g, frac)
    # the oracle without Checkmate's ordering: any recomputation before each first compute,
    # the class DTR's plans lie in
    best = oracle(g, b, ordered=False)
    r = solver.get("dtr")(g, b, heuristic=heuristic, backward_last=backward_last)
    if r.plan is not None:
        sim = simulate(g, r.plan)  # raises if the plan is not valid
        assert r.peak_bytes == sim.peak_bytes
    if r.status == "feasible":
        assert r.peak_bytes is not None and r.peak_bytes <= b
        assert best is not None, "dtr fits a budget that no schedule fits"
        assert (r.total_time_s or 0) >= best.time_s * (1 - 1e-9)
    else:
        assert r.status == "infeasible"
        if r.min_budget_bytes is not None:
            assert r.min_budget_bytes > b


def test_plans_a_random_layered_dag_that_needs_backward_recomputation() -> None:
    # At 70% the restricted MILP (backward nodes run once) has no schedule on this graph.
    # Recompute only: the graph's A100 profile has a host link, on which dtr offloads instead.
    g = random_layered_dag(20)
    b = frac_budget(g, 0.7)
    r = solver.get("dtr")(g, b, offload=False)
    assert r.status == "feasible" and r.plan is not None
    assert r.peak_bytes is not None and r.peak_bytes <= b
    counts = r.plan.compute_counts()
    assert all(counts[n.id] >= 1 for n in g.nodes)
    assert any(counts[n.id] > 1 for n in g.backward_nodes)  # backward nodes run again


def test_a_value_prefetched_from_the_host_can_be_evicted_again() -> None:
    # A value brought back from the host is no candidate until its read: early prefetches
    # fill the free room with values nothing can evict, the planner finds no room and
    # recomputes through the backward (here every such host run fails, and dtr fell back to
    # its +156% recompute-only plan). dtr's second host run makes them evictable at once
    # (again to the host, without a transfer, while their copy is valid): +34.8% (its
    # prefetches issued where room frees up stall the reads that follow them closely).
    g = random_layered_dag(20)
    b = frac_budget(g, 0.7)
    alone = solver.get("dtr")(g, b, offload=False)
    r = solver.get("dtr")(g, b, combine=False)
    assert r.fits and r.plan is not None and r.peak_bytes is not None and r.peak_bytes <= b
    assert "evicted to the host" in r.message
    steps = r.plan.steps
    assert any(s.op == "offload" for s in steps) and any(s.op == "prefetch" for s in steps)
    assert r.overhead is not None and alone.overhead is not None
    assert r.overhead < 0.5 < 1.0 < alone.overhead


@pytest.mark.parametrize("heuristic", ["dtr", "next-use"])
def test_deterministic(heuristic: str) -> None:
    g = unet(3, image_size=64, batch_size=2)
    b = frac_budget(g, 0.5)
    r1 = solver.get("dtr")(g, b, heuristic=heuristic)
    r2 = solver.get("dtr")(g, b, heuristic=heuristic)
    assert r1.status == "feasible"
    assert r1.plan == r2.plan


def test_sampled_candidates_on_a_larger_step() -> None:
    # more than SCAN_ALL candidates at once: the sampled path plans within the budget
    g = transformer(24, d_model=64, seq_len=32, batch_size=4, vocab_size=64)
    b = frac_budget(g, 0.5)
    facts = dtr.Facts.of(g)
    assert facts.num_values > 4 * dtr.SCAN_ALL
    r = solver.get("dtr")(g, b, sample=8)
    assert r.status == "feasible" and r.peak_bytes is not None and r.peak_bytes <= b


def test_ample_budget_is_the_eager_plan_time() -> None:
    g = transformer(2, d_model=16, seq_len=8, batch_size=2, vocab_size=32, num_heads=2)
    r = solver.get("dtr")(g, 10**15)
    eager = simulate(g, eager_plan(g))
    assert r.status == "feasible"
    assert r.total_time_s == pytest.approx(eager.total_time_s)


def test_the_planner_reads_its_deadline_per_block_of_computes() -> None:
    g = transformer(20, d_model=16, seq_len=8, batch_size=2, vocab_size=32, num_heads=2)
    assert g.num_nodes > 2 * dtr.CHECK_EVERY
    clock = CountingClock()
    with pytest.raises(Expired, match="dtr"):
        dtr.dtr_plan(g, 10**15, deadline=Deadline(at=1.5, clock=clock))
    assert clock.reads == 2  # after computes 256 and 512: the second found it past
    plan, ok = dtr.dtr_plan(g, 10**15, deadline=Deadline(at=1e9, clock=CountingClock()))
    assert ok and len(plan.compute_counts()) == g.num_nodes


def test_a_thrashing_run_is_abandoned(monkeypatch: pytest.MonkeyPatch) -> None:
    g = random_layered_dag(20)
    b = frac_budget(g, 0.7)
    monkeypatch.setattr(dtr, "MAX_RUNS_PER_NODE", 1)  # any recomputation counts as thrashing
    r = solver.get("dtr")(g, b)
    assert r.status == "infeasible" and r.plan is None
    assert "thrashed" in r.message
