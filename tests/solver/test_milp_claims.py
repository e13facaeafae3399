"""milp, lp-round and auto claim optimality and bounds only where the model proves them."""

from __future__ import annotations

from handmade import chain_step

from remat import solver
from remat.ir import resolve_budget
from remat.ir.synthetic import unet


def test_small_graph_gets_a_proven_optimum_and_bound() -> None:
    g = chain_step()  # 6 nodes: the model has no optional restriction
    r = solver.get("milp")(g, resolve_budget(g, 0.9), time_limit_s=20)
    assert r.status == "optimal"
    assert r.lower_bound_s is not None and r.total_time_s is not None
    assert r.lower_bound_s <= r.total_time_s * (1 + 1e-9)


def test_restricted_model_claims_neither_optimum_nor_bound() -> None:
    # Over 12 nodes the MILP restricts recomputation (window, lazy, forward-only): its optimum
    # is that of a narrower class, which other plans (lp-round's roundings) can beat.
    g = unet(1, base_channels=4, image_size=4, batch_size=1)
    assert g.num_nodes > 12
    budget = resolve_budget(g, 0.7)
    for name in ("milp", "lp-round"):
        r = solver.get(name)(g, budget, time_limit_s=20)
        assert r.status != "optimal", name
        assert r.lower_bound_s is None, name
    r = solver.get("milp")(g, budget, time_limit_s=20)
    assert "restricted class" in r.message
