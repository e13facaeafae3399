"""Checkmate's MILP: agrees with hand-worked answers and with the simulator, honest statuses."""

from __future__ import annotations

import pytest
from handmade import chain_step, diamond, residual_step

from remat.ir import Graph, eager_plan, simulate
from remat.ir.synthetic import chain, transformer, unet
from remat.solver import get
from remat.solver.checkmate import SMALL_GRAPH_NODES
from remat.solver.checkmate_plans import replay
from remat.solver.milp import CheckmateModel, run_checkmate, window_ladder

milp = get("milp")


def frac_budget(g: Graph, frac: float) -> int:
    return g.static_bytes + int(frac * simulate(g, eager_plan(g)).peak_dynamic_bytes)


def test_hand_chain_answers() -> None:
    g = chain_step()
    # Eager peak, during bL: static 100 + x 10 + a1 20 + a2 30 + L 1 + g2 30 = 191.
    eager = simulate(g, eager_plan(g))
    assert eager.peak_bytes == 191
    r = milp(g, 191, time_limit_s=20)
    assert r.status == "optimal" and r.total_time_s == pytest.approx(10.0)
    # 10 bytes less: a1 (f1, 1 s) is dropped and recomputed after bL (b2 then peaks at
    # 100 + x 10 + L 1 + g2 30 + a1 20 + g1 20 = 181): 11 s.
    r = milp(g, 181, time_limit_s=20)
    assert r.status == "optimal"
    assert r.total_time_s == pytest.approx(11.0)
    assert r.plan is not None and r.plan.compute_counts()["f1"] == 2
    assert r.lower_bound_s == pytest.approx(11.0)
    # b2 itself needs 181: below that nothing fits.
    assert milp(g, 180, time_limit_s=20).status == "infeasible"


def test_workspace_counts_while_the_node_runs() -> None:
    g = diamond()
    peak = simulate(g, eager_plan(g)).peak_bytes
    r = milp(g, peak, time_limit_s=20)
    assert r.status == "optimal" and r.peak_bytes == peak
    # f3's 50 B scratch is part of the peak: one byte less cannot fit without recomputing.
    r2 = milp(g, peak - 1, time_limit_s=20)
    assert r2.status in ("optimal", "infeasible")
    if r2.status == "optimal":
        assert r2.total_time_s is not None and r2.total_time_s > 6.0


_CLAIM_GRAPHS = {
    "chain4": lambda: chain(4, batch_size=2, width=8),
    "transformer1": lambda: transformer(
        1, d_model=16, seq_len=8, batch_size=2, vocab_size=32, num_heads=2
    ),
    "unet1": lambda: unet(1, base_channels=4, image_size=4, batch_size=1),
    "residual": residual_step,
}
ids_of = {make: name for name, make in _CLAIM_GRAPHS.items()}
# (fraction, graph) where the MILP has no solution today, and why: the budget is below the
# peak any plan needs (no model is built), or the window ladder's rungs find none in time.
NO_SOLUTION = {
    (0.8, "residual"): "below the floor",
    (0.6, "residual"): "below the floor",
    (0.6, "transformer1"): "none in time",
}


@pytest.mark.parametrize("make", list(_CLAIM_GRAPHS.values()), ids=list(_CLAIM_GRAPHS))
@pytest.mark.parametrize("frac", [1.0, 0.8, 0.6])
def test_plan_simulates_to_the_models_claims(make: object, frac: float) -> None:
    g = make()  # type: ignore[operator]
    budget = frac_budget(g, frac)
    # Where the ladder finds nothing in time today, 5 s is as good as 20 (and a plan found in
    # them is checked in full).
    known_slow = NO_SOLUTION.get((frac, ids_of[make])) == "none in time"
    # the exact class (up to 32 nodes) proves chain4 at 60% slowly; its claims hold for the
    # incumbent it has after 5 s as well
    exact = g.num_nodes <= SMALL_GRAPH_NODES
    run = run_checkmate(g, budget, time_limit_s=5 if known_slow or exact else 20)
    if run.solution is None or run.solution.values is None:
        why = NO_SOLUTION.get((frac, ids_of[make]))
        assert why is not None, f"no MILP solution for {ids_of[make]} at {frac}: {run.solution}"
        if why == "below the floor":
            assert run.solution is None  # refused before solving: no plan can fit
        else:  # the ladder's windows run out of time before one has a plan (load-dependent)
            assert run.solution is not None and run.solution.status in ("timeout", "infeasible")
        return
    plan, claimed_peak, claimed_time = replay(run.model, run.solution.values)
    sim = simulate(g, plan)
    assert sim.peak_bytes == claimed_peak
    assert sim.total_time_s == pytest.approx(claimed_time, rel=1e-12)
    assert claimed_peak <= budget
    # and the objective the MILP reports is that time
    assert run.solution.objective is not None
    assert run.solution.objective * run.model.time_unit_s == pytest.approx(claimed_time, rel=1e-6)


def test_side_effecting_nodes_run_exactly_once() -> None:
    g = unet(1, base_channels=4, image_size=4, batch_size=1)
    # any plan shows it: HiGHS has one within 2 s; closing the gap takes 10 s more
    r = milp(g, frac_budget(g, 0.7), time_limit_s=4)
    assert r.plan is not None
    counts = r.plan.compute_counts()
    for n in g.nodes:
        if not n.recomputable:
            assert counts[n.id] == 1


def test_cbc_backend_agrees_with_highs() -> None:
    g = chain_step()
    b = simulate(g, eager_plan(g)).peak_bytes - 10
    a = milp(g, b, time_limit_s=20)
    c = milp(g, b, time_limit_s=20, backend="cbc")
    assert a.status == c.status == "optimal"
    assert a.total_time_s == pytest.approx(c.total_time_s)


def test_time_limit_gives_feasible_or_timeout_with_a_valid_bound() -> None:
    g = transformer(2)
    r = milp(g, frac_budget(g, 0.4), time_limit_s=0.3)
    assert r.status in ("optimal", "feasible", "timeout", "infeasible")
    if r.status == "feasible" and r.lower_bound_s is not None:
        assert r.lower_bound_s <= (r.total_time_s or 0) * (1 + 1e-6)


def test_zero_budget_is_infeasible_with_a_working_budget() -> None:
    g = chain_step()
    r = milp(g, 0, time_limit_s=20)
    assert r.status == "infeasible"
    assert r.min_budget_bytes is not None and r.min_budget_bytes > 0


def test_bad_options_are_named() -> None:
    g = chain_step()
    with pytest.raises(ValueError, match="solver"):
        milp(g, 10**6, solver="gurobi")
    with pytest.raises(ValueError, match="window"):
        window_ladder(chain(8), -3)


def test_reductions_shrink_the_model_on_large_graphs() -> None:
    g = transformer(2)
    b = frac_budget(g, 0.5)
    small = CheckmateModel.build(g, b, window=0)
    full = CheckmateModel.build(g, b, window=None, recompute_in_forward=True)
    assert small.model.num_integer < full.model.num_integer


def test_a_default_restriction_proven_infeasible_widens_to_backward_recomputation() -> None:
    # 20 nodes at 70%: with backward nodes running once (the default above 12 nodes) the
    # MILP proves every window infeasible; widened, it proves a plan that reruns one optimal
    # in well under a second (the 46-node graph this used took 11 s, past 8 s under load)
    from remat.ir.budget import fraction_bytes
    from remat.ir.synthetic import random_layered_dag

    g = random_layered_dag(9)
    b = fraction_bytes(g, 0.7, simulate(g, eager_plan(g)).peak_dynamic_bytes)
    narrow = run_checkmate(g, b, recompute_backward=False, time_limit_s=60)
    assert narrow.solution is not None and narrow.solution.status == "infeasible"
    r = get("milp")(g, b, time_limit_s=60)
    assert r.fits and r.plan is not None, r.message
    counts = r.plan.compute_counts()
    assert any(counts[n.id] > 1 for n in g.backward_nodes)
