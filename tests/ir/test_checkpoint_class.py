"""The checkpoint executor's class of plans (``remat.ir.checkpoint_class``), torch-free.

That the class's plans are what ``torch.utils.checkpoint`` regions do is tested against the
real executor in ``tests/executor/test_module.py``; here: the class's own rules.
"""

from __future__ import annotations

import pytest

import remat
from remat.ir import Node, Value, eager_plan, resolve_budget, simulate, synthetic
from remat.ir import checkpoint_class as cc
from remat.ir.checkpoint_search import fit
from remat.ir.cuts import block_key


@pytest.mark.parametrize(
    "graph", [synthetic.transformer(), synthetic.chain(8)], ids=["gpt", "chain"]
)
def test_eager_is_in_the_class_and_fit_keeps_to_budgets(graph: remat.Graph) -> None:
    assert cc.in_class(graph, eager_plan(graph))
    for frac in (0.7, 0.5):
        budget = resolve_budget(graph, frac)
        found = fit(graph, budget)
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
    assert not {r.path for r in fit(graph, resolve_budget(graph, 0.5)).regions} & set(bad)
    with pytest.raises(ValueError, match="side effects"):
        cc.checkpoint_plan(graph, [cc.region(graph, bad[0])])


def test_a_plan_outside_the_class_is_explained() -> None:
    graph = synthetic.transformer()
    found = fit(graph, resolve_budget(graph, 0.5))
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
    found = fit(graph, budget)
    assert cc.in_class(graph, found.plan)
    assert found.simulation.peak_bytes <= budget
    selective = [r for r in found.regions if r.save - cc.forced_saves(graph, r.path, r.nodes)]
    assert selective
    same = cc.checkpoint_plan(graph, [cc.region(graph, r.path) for r in found.regions])
    assert found.simulation.total_time_s < simulate(graph, same).total_time_s
    # with no time for the search, its first candidates still stand
    quick = fit(graph, budget, time_budget_s=0.0)
    assert quick.simulation.peak_bytes <= budget


# -- offloaded blocks ---------------------------------------------------------------------------


def _fast_link(graph: remat.Graph) -> remat.Graph:
    """``graph`` on a device whose host link moves anything at once (no latency)."""
    assert graph.device is not None
    link = remat.ir.HostLink(
        device_to_host_bytes_per_s=1e18, host_to_device_bytes_per_s=1e18, latency_s=0.0
    )
    dev = graph.device.model_copy(update={"host_link": link, "host_bandwidth_bytes_per_s": 1e18})
    return graph.model_copy(update={"device": dev})


def test_offloaded_blocks_move_only_what_no_other_block_reads() -> None:
    graph = synthetic.transformer(3)
    block = {n.id: block_key(n.module) if n.module else "" for n in graph.nodes}
    layers = [p for p in cc.blocks(graph) if p.startswith("layers.")]
    for path in layers:
        moved = cc.offloadable(graph, path)
        assert moved, path
        for v in moved:
            assert graph.value(v).kind == "activation"
            readers = graph.consumers_of(v)
            assert {block[c.id] for c in readers if c.phase == "backward"} == {path}
            assert {block[c.id] for c in readers if c.phase == "forward"} <= {path, ""}
    plan = cc.checkpoint_plan(graph, [cc.region(graph, layers[2])], layers[:2])
    assert cc.in_class(graph, plan) and cc.project(graph, plan) == plan
    assert cc.offloads_of(graph, plan) == layers[:2]
    offloads = [s.id for s in plan.steps if s.op == "offload"]
    prefetches = [s.id for s in plan.steps if s.op == "prefetch"]
    assert sorted(offloads) == sorted(prefetches)
    assert sorted(offloads) == sorted(v for p in layers[:2] for v in cc.offloadable(graph, p))
    # each block's prefetches come together, before the block's first backward node
    first_bwd = min(i for i, n in enumerate(graph.nodes)
                    if n.phase == "backward" and block[n.id] == layers[0])  # fmt: skip
    computes = [s.id for s in plan.steps[: plan.steps.index(
        remat.ir.Step(op="prefetch", id=prefetches[-1]))] if s.op == "compute"]  # fmt: skip
    assert graph.nodes[first_bwd].id not in computes
    sim = simulate(graph, plan)
    assert sim.offload_bytes == sim.prefetch_bytes > 0
    with pytest.raises(ValueError, match="both a checkpoint region and offloaded"):
        cc.checkpoint_plan(graph, [cc.region(graph, layers[0])], [layers[0]])


def test_an_op_level_offload_is_not_in_the_class() -> None:
    graph = synthetic.transformer(3)
    layers = [p for p in cc.blocks(graph) if p.startswith("layers.")]
    plan = cc.checkpoint_plan(graph, [], layers[:1])
    steps = [s for s in plan.steps if not (s.op in ("offload", "prefetch") and s.id == (
        cc.offloadable(graph, layers[0])[0]))]  # fmt: skip
    partial = remat.ir.Plan(steps=tuple(steps))  # one value of the block left on the device
    why = cc.why_not(graph, partial)
    assert why is not None and "offloads or prefetches differently" in why


def test_fit_offloads_where_the_link_hides_the_copies() -> None:
    """At full checkpointing's peak, with a link that moves anything at once, offloading the
    blocks costs no recomputation: the search finds a plan faster than the recompute-only
    class's, within the budget; without ``offload`` nothing is offloaded."""
    graph = _fast_link(synthetic.transformer(4))
    layers = [p for p in cc.blocks(graph) if p.startswith("layers.")]
    full = simulate(graph, cc.checkpoint_plan(graph, [cc.region(graph, p) for p in layers]))
    off = fit(graph, full.peak_bytes, offload=False, time_budget_s=2)
    on = fit(graph, full.peak_bytes, offload=True, time_budget_s=2)
    assert not off.offloaded and on.offloaded
    assert cc.in_class(graph, on.plan)
    assert set(on.offloaded) == set(cc.offloads_of(graph, on.plan))
    assert on.simulation.peak_bytes <= full.peak_bytes
    assert on.simulation.total_time_s < off.simulation.total_time_s
