"""The checkpoint executor's class of plans (``remat.ir.checkpoint_class``), torch-free.

That the class's plans are what ``torch.utils.checkpoint`` regions do is tested against the
real executor in ``tests/executor/test_module.py``; here: the class's own rules.
"""

from __future__ import annotations

import pytest

import remat
from remat.ir import Node, Value, eager_plan, resolve_budget, simulate, synthetic
from remat.ir import checkpoint_class as cc


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


def _routed_block(*, grouped: bool = True) -> remat.Graph:
    """Block ``blk``: ``f`` (x, w -> h), then ``g`` (h -> y, y read by the loss outside), whose
    backward reads only ``h``; the backward of ``g`` is one autograd node of two ops, ``z0``
    (zeros, reading only the incoming gradient) then ``gb`` (reading ``h``)."""
    V, N = Value, Node
    group = {"autograd_node": 1} if grouped else {}
    return remat.Graph(
        values=[
            V(id="x", size_bytes=64, kind="input"),
            V(id="w", size_bytes=64, kind="param"),
            V(id="h", size_bytes=64),
            V(id="y", size_bytes=64),
            V(id="loss", size_bytes=4, kind="loss"),
            V(id="g_y", size_bytes=64, kind="gradient"),
            V(id="z", size_bytes=1000, kind="gradient"),
            V(id="g_h", size_bytes=64, kind="gradient"),
            V(id="g_w", size_bytes=64, kind="gradient"),
        ],
        nodes=[
            N(id="f", inputs=("x", "w"), outputs=("h",), module="blk", time_s=1.0),
            N(id="g", inputs=("h",), outputs=("y",), module="blk"),
            N(id="L", inputs=("y",), outputs=("loss",)),
            N(id="dL", phase="backward", inputs=("y", "loss"), outputs=("g_y",)),
            N(id="z0", phase="backward", inputs=("g_y",), outputs=("z",), module="blk", **group),
            N(
                id="gb",
                phase="backward",
                inputs=("z", "h", "g_y"),
                outputs=("g_h",),
                module="blk",
                **group,
            ),
            N(id="fw", phase="backward", inputs=("g_h", "x"), outputs=("g_w",), module="blk"),
        ],
        required=["g_w", "loss"],
        static_bytes=128,
    )


def test_recomputation_runs_before_its_autograd_nodes_first_op_and_stops_early() -> None:
    # z0 allocates before gb unpacks h: eager recomputes the region first. g, whose backward
    # saves only its input h, is not run again (the recomputation stops when h is packed,
    # before g's kernel).
    graph = _routed_block()
    plan = cc.checkpoint_plan(graph, [cc.region(graph, "blk")])
    computes = [s.id for s in plan.steps if s.op == "compute"]
    assert computes == ["f", "g", "L", "dL", "f", "z0", "gb", "fw"]
    flat = _routed_block(grouped=False)  # without the group, gb is where it starts
    flat_computes = [
        s.id for s in cc.checkpoint_plan(flat, [cc.region(flat, "blk")]).steps if s.op == "compute"
    ]
    assert flat_computes == ["f", "g", "L", "dL", "z0", "f", "gb", "fw"]


def test_fit_saves_the_ops_that_cost_most_to_recompute_per_byte() -> None:
    # Between eager and every block recomputed whole, the class holds plans whose regions
    # keep their matmul outputs and recompute the rest: fit finds one (the whole-region
    # greedy alone does not: its regions save only what they must), within the budget and
    # faster than the whole regions of the same blocks.
    graph = synthetic.transformer(4, d_model=64, num_heads=2, seq_len=64, batch_size=2,
                                  vocab_size=128)  # fmt: skip
    eager = simulate(graph, eager_plan(graph))
    whole = cc.checkpoint_plan(graph, [cc.region(graph, f"layers.{i}") for i in range(4)])
    budget = (eager.peak_bytes + simulate(graph, whole).peak_bytes) // 2
    found = cc.fit(graph, budget)
    assert cc.in_class(graph, found.plan)
    assert found.simulation.peak_bytes <= budget
    selective = [r for r in found.regions if r.save - cc.forced_saves(graph, r.path, r.nodes)]
    assert selective
    same = cc.checkpoint_plan(graph, [cc.region(graph, r.path) for r in found.regions])
    assert found.simulation.total_time_s < simulate(graph, same).total_time_s
    # with no time for the search, its first candidates still stand
    quick = cc.fit(graph, budget, time_budget_s=0.0)
    assert quick.simulation.peak_bytes <= budget
