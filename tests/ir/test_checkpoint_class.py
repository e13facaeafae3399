"""The checkpoint executor's class of plans (``remat.ir.checkpoint_class``), torch-free.

That the class's plans are what ``torch.utils.checkpoint`` regions do is tested against the
real executor in ``tests/executor/test_module.py``; here: the class's own rules.
"""

from __future__ import annotations

import pytest

import remat
from remat.ir import checkpoint_class as cc
from remat.ir import eager_plan, resolve_budget, simulate, synthetic


@pytest.mark.parametrize(
    "graph", [synthetic.transformer(), synthetic.chain(8)], ids=["gpt", "chain"]
)
def test_eager_is_in_the_class_and_fit_keeps_to_budgets(graph: remat.Graph) -> None:
    assert cc.in_class(graph, eager_plan(graph))
    for frac in (0.7, 0.5):
        budget = resolve_budget(graph, frac)
        found = cc.fit(graph, budget)
        assert cc.in_class(graph, found.plan)
        assert found.regions, "tight budgets need regions"
        assert simulate(graph, found.plan).peak_bytes == found.simulation.peak_bytes
        counts = found.plan.compute_counts()
        assert max(counts.values()) <= 2  # a region is recomputed once
        recomputed = {n for n, k in counts.items() if k > 1}
        members = {n for r in found.regions for n in r.nodes}
        assert recomputed <= members
        if frac == 0.7:
            assert found.simulation.peak_bytes <= budget


def test_recomputed_values_stay_inside_their_region() -> None:
    graph = synthetic.transformer()
    for path in cc.blocks(graph):
        r = cc.region(graph, path)
        for nid in set(r.nodes) - r.save:
            for o in graph.node(nid).outputs:
                for c in graph.consumers_of(o):
                    if c.phase == "forward":
                        assert c.id in r.nodes


def test_solve_for_the_checkpoint_executor() -> None:
    graph = synthetic.transformer()
    result = remat.solve(graph, "50%", solver="checkpoint-all", executor="checkpoint")
    assert result.solver == "checkpoint-all+checkpoint"
    assert result.plan is not None and cc.in_class(graph, result.plan)
    assert "layers." in result.message
    with pytest.raises(ValueError, match="executor"):
        remat.solve(graph, "50%", executor="gpu")


def test_blocks_with_side_effects_are_not_regions() -> None:
    graph = synthetic.unet()  # batch norm in every block
    bad = [p for p in cc.blocks(graph) if not cc.admissible(graph, p)]
    assert bad
    assert not {r.path for r in cc.fit(graph, resolve_budget(graph, 0.5)).regions} & set(bad)
    with pytest.raises(ValueError, match="side effects"):
        cc.checkpoint_plan(graph, [cc.region(graph, bad[0])])


def test_a_plan_outside_the_class_is_explained() -> None:
    graph = synthetic.transformer()
    found = cc.fit(graph, resolve_budget(graph, 0.5))
    steps = list(found.plan.steps)
    # Move the first free later: the plan still runs, but not as checkpoint regions do.
    k = next(i for i, s in enumerate(steps) if s.op == "free")
    steps.insert(k + 3, steps.pop(k))
    other = remat.Plan(steps=tuple(steps))
    simulate(graph, other)
    assert cc.why_not(graph, other) is not None
    with pytest.raises(ValueError, match="no forward node"):
        cc.region(graph, "nope")
