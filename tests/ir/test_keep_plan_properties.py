"""keep_plan is valid for any keep set on any step graph (hypothesis over random DAGs)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from remat.ir import eager_plan, keep_plan, simulate
from remat.ir.synthetic import random_layered_dag, unet


@given(
    n=st.integers(min_value=1, max_value=40),
    seed=st.integers(min_value=0, max_value=10_000),
    data=st.data(),
)
def test_any_keep_set_gives_a_valid_plan(n: int, seed: int, data: st.DataObject) -> None:
    g = random_layered_dag(n, seed=seed, batch_size=2, max_width=64)
    fwd_values = sorted(
        v.id for v in g.values if (p := g.producer_of(v.id)) is not None and p.phase == "forward"
    )
    keep = data.draw(st.sets(st.sampled_from(fwd_values)) if fwd_values else st.just(set()))
    sim = simulate(g, keep_plan(g, keep))  # raises on any invalid step
    eager = simulate(g, eager_plan(g))
    assert sim.total_time_s >= eager.total_time_s * (1 - 1e-12)
    # Everything kept: nothing is recomputed.
    if keep == set(fwd_values):
        assert sim.num_recomputes == 0


def test_side_effects_are_never_recomputed() -> None:
    g = unet(2, base_channels=4, image_size=8, batch_size=1)
    plan = keep_plan(g, set())
    counts = plan.compute_counts()
    for node in g.nodes:
        if not node.recomputable:
            assert counts[node.id] == 1
    simulate(g, plan)
