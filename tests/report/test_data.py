"""The report's figures against a plan worked out by hand (handmade.chain_step) and against the
simulator on a synthetic transformer."""

from __future__ import annotations

import pytest
from handmade import chain_step

from remat import solver as solvers
from remat.ir import Plan, eager_plan, simulate, synthetic
from remat.report import module_table, timeline
from remat.report.data import INPUT, TOP_LEVEL

# chain_step with a1 dropped after f2 and recomputed before b2 (tests/ir/test_simulate.py).
RECOMPUTE = Plan.of(
    [
        ("compute", "f1"), ("compute", "f2"), ("free", "a1"), ("compute", "loss"),
        ("compute", "bL"), ("free", "a2"), ("compute", "f1"), ("compute", "b2"),
        ("free", "a1"), ("free", "g2"), ("compute", "b1"), ("free", "g1"),
    ]
)  # fmt: skip


def test_timeline_by_hand() -> None:
    g = chain_step()
    tl = timeline(g, RECOMPUTE, budget_bytes=185)
    # Dynamic readings by hand (test_simulate) plus 100 static bytes.
    assert tl.plan.device_bytes == tuple(
        100 + b for b in (30, 60, 40, 41, 71, 41, 61, 81, 61, 31, 31, 11)
    )
    assert tl.eager.device_bytes == tuple(100 + b for b in (30, 60, 61, 91, 61, 81, 61, 31, 31, 11))
    assert tl.eager.backward_step == 3 and tl.plan.backward_step == 4  # bL's position
    assert tl.plan.peak_bytes == 181 and tl.eager.peak_bytes == 191
    assert tl.overhead == pytest.approx(1 / 10)  # one more f1 (1 s) on a 10 s step
    pk = tl.peak
    # Step 7 runs b2: x 10, L 1, g2 30, a1 20 (recomputed) and b2's output g1 20 = 81.
    assert pk.step == 7 and pk.node_id == "b2" and pk.device_bytes == 181
    assert [(v.value_id, v.size_bytes) for v in pk.values] == [
        ("g2", 30), ("a1", 20), ("g1", 20), ("x", 10), ("L", 1),
    ]  # fmt: skip
    assert {v.value_id: v.module for v in pk.values}["x"] == INPUT
    assert {v.module for v in pk.values if v.value_id != "x"} == {TOP_LEVEL}
    assert pk.by_module() == [(TOP_LEVEL, 4, 71), (INPUT, 1, 10)]


def test_module_table_by_hand() -> None:
    (row,) = module_table(chain_step(), RECOMPUTE)
    # a1, a2, L, g2, g1 (the weight gradients are static); a1 computed twice.
    assert row.module == TOP_LEVEL and row.num_values == 5 and row.size_bytes == 101
    assert (row.kept, row.recomputed, row.recomputations, row.recomputed_bytes) == (4, 1, 1, 20)
    assert row.offloaded == 0 and row.recompute_time_s == pytest.approx(1.0)


def test_figures_agree_with_the_simulator_on_a_transformer() -> None:
    g = synthetic.transformer(2)
    r = solvers.get("checkpoint-all")(g, 10**15)
    assert r.plan is not None
    sim = simulate(g, r.plan)
    tl = timeline(g, r.plan, r.budget_bytes)
    assert max(tl.plan.device_bytes) == sim.peak_bytes == tl.peak.device_bytes
    assert tl.plan.device_bytes[tl.peak.step] == sim.peak_bytes
    assert max(tl.eager.device_bytes) == simulate(g, eager_plan(g)).peak_bytes
    # What is alive at the peak adds up to the peak, workspace and static included.
    alive = sum(v.size_bytes for v in tl.peak.values)
    assert alive + tl.peak.workspace_bytes + g.static_bytes == sim.peak_bytes
    assert [v.size_bytes for v in tl.peak.values] == sorted(
        (v.size_bytes for v in tl.peak.values), reverse=True
    )
    rows = module_table(g, r.plan)
    counts = r.plan.compute_counts()
    # Each extra run of a node recomputes each of its non-static outputs once.
    extra = sum(
        (counts[n.id] - 1) * sum(1 for o in n.outputs if not g.is_static(o))
        for n in g.nodes
        if counts[n.id] > 1
    )
    assert sum(row.recomputations for row in rows) == extra
    assert sum(row.recomputations for row in rows) > 0  # checkpoint-all recomputes every block
    assert sum(row.recompute_time_s for row in rows) == pytest.approx(sim.recompute_time_s)
    assert sum(row.num_values for row in rows) == len(r.plan.summary(g))
    assert {row.module for row in rows} >= {"layers.0.attn.qkv", "layers.1.mlp.fc1"}
