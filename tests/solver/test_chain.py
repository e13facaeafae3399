"""The chain view and the expansion of chain schedules to op-level plans."""

from __future__ import annotations

import pytest
from _graphs import schema_graphs
from handmade import chain_step
from hypothesis import given, settings

from remat.ir import Graph, InvalidPlanError, Node, Step, Value, eager_plan, simulate
from remat.ir.chain import ChainOp, chain_view, expand, plan_from_steps
from remat.ir.cuts import sweep_positions
from remat.ir.synthetic import chain, random_layered_dag, transformer, unet


def straight(n: int) -> list[ChainOp]:
    return [ChainOp("forward", i) for i in range(n)] + [
        ChainOp("backward", i) for i in reversed(range(n))
    ]


def test_chain_of_blocks_has_exact_figures() -> None:
    g = chain(5, batch_size=4, width=8)
    ch = chain_view(g, cuts="blocks")
    assert ch.num_stages == 6  # five blocks and the loss
    act = 4 * 8 * 4  # one (batch, width) float32 tensor
    for i, st in enumerate(ch.stages[:5]):
        assert st.input_bytes == (0 if i == 0 else act)
        assert st.all_bytes == act  # the pre-activation (the input is counted as input)
        assert st.forward_nodes[0] == f"stages.{i}/mm"
    assert ch.is_homogeneous
    total = sum(s.forward_time_s + s.backward_time_s for s in ch.stages)
    assert total == pytest.approx(sum(n.time_s for n in g.nodes))


@pytest.mark.parametrize(
    "make",
    [
        lambda: chain(6, heterogeneous=True),
        lambda: transformer(2, d_model=32, seq_len=16, vocab_size=64, num_heads=2),
        lambda: unet(2, base_channels=4, image_size=16),
        lambda: random_layered_dag(40, seed=3),
    ],
    ids=["het-chain", "transformer", "unet", "random-dag"],
)
def test_every_node_in_one_stage_and_straight_schedule_is_eager(make: object) -> None:
    g = make()  # type: ignore[operator]
    ch = chain_view(g)
    ids = [n for s in ch.stages for n in (*s.forward_nodes, *s.backward_nodes)]
    assert sorted(ids) == sorted(n.id for n in g.nodes)
    sim = simulate(g, expand(ch, straight(ch.num_stages)))
    eager = simulate(g, eager_plan(g))
    assert sim.num_recomputes == 0
    assert sim.peak_bytes == eager.peak_bytes
    assert sim.total_time_s == pytest.approx(eager.total_time_s)


def test_recomputing_a_stage_frees_its_activations_early() -> None:
    g = chain(4, batch_size=4, width=8)
    ch = chain_view(g, cuts="blocks")
    L = ch.num_stages
    # forward all without keeping activations, then recompute each stage from the input
    ops = [ChainOp("forward", i) for i in range(L)] + [ChainOp("backward", L - 1)]
    for i in reversed(range(L - 1)):
        ops += [ChainOp("forward", k) for k in range(i + 1)] + [ChainOp("backward", i)]
    sim = simulate(g, expand(ch, ops))
    eager = simulate(g, eager_plan(g))
    assert sim.num_recomputes > 0
    assert sim.peak_bytes < eager.peak_bytes


def test_offload_and_prefetch_expand_to_transfers() -> None:
    g = chain(3, batch_size=4, width=8)
    ch = chain_view(g, cuts="blocks")
    L = ch.num_stages
    ops = [ChainOp("forward", 0), ChainOp("offload", 0)]
    ops += [ChainOp("forward", i) for i in range(1, L)]
    ops += [ChainOp("backward", i) for i in reversed(range(1, L))]
    ops += [ChainOp("prefetch", 0), ChainOp("backward", 0)]
    plan = expand(ch, ops)
    assert any(s.op == "offload" for s in plan.steps)
    assert any(s.op == "prefetch" for s in plan.steps)
    sim = simulate(g, plan, host_bandwidth_bytes_per_s=1e3)
    assert sim.transfer_time_s > 0 and sim.stall_time_s > 0


def test_plan_from_steps_frees_after_last_read_and_names_missing_values() -> None:
    g = chain_step()
    plan = plan_from_steps(g, [Step(op="compute", id=n.id) for n in g.nodes])
    assert (
        plan == eager_plan(g)
        or simulate(g, plan).peak_bytes == simulate(g, eager_plan(g)).peak_bytes
    )
    with pytest.raises(InvalidPlanError, match="a1"):
        plan_from_steps(g, [Step(op="compute", id="f2")])


def test_max_stages_merges_and_bad_value_is_named() -> None:
    g = chain(16)
    assert chain_view(g, cuts="blocks", max_stages=4).num_stages <= 4
    with pytest.raises(ValueError, match="max_stages"):
        chain_view(g, max_stages=0)


def test_a_backward_node_a_forward_node_reads_runs_in_the_forward_sweep() -> None:
    # The schema only asks for a topological order: backward-phase "b0" makes "a", which the
    # forward node "f1" reads, and "b1" (a true backward node) reads "b". A chain schedule runs
    # every backward after all forwards, so "b0" (and only it) must be a forward node of its
    # stage, or the expansion reads "a" before anything made it.
    g = Graph(
        values=(
            Value(id="x", size_bytes=8, kind="input"),
            Value(id="a", size_bytes=100),
            Value(id="b", size_bytes=100),
            Value(id="c", size_bytes=100),
            Value(id="L", size_bytes=4, kind="loss"),
        ),
        nodes=(
            Node(id="b0", phase="backward", inputs=("x",), outputs=("a",), recomputable=False),
            Node(id="f1", inputs=("a",), outputs=("b",), time_s=1.0),
            Node(id="f2", inputs=("b",), outputs=("L",), time_s=1.0),
            Node(id="b1", phase="backward", inputs=("b", "L"), outputs=("c",), time_s=1.0),
        ),
        required=("L", "c"),
    )
    assert [g.nodes[i].id for i in sweep_positions(g)] == ["b0", "f1", "f2"]
    ch = chain_view(g)
    assert [n for s in ch.stages for n in s.forward_nodes] == ["b0", "f1", "f2"]
    assert [n for s in ch.stages for n in s.backward_nodes] == ["b1"]
    plan = expand(ch, straight(ch.num_stages))
    assert simulate(g, plan).num_recomputes == 0
    # a second forward of every stage skips "b0", which cannot run again, and stays valid
    again = [ChainOp("forward", i) for i in range(ch.num_stages)]
    simulate(g, expand(ch, again + straight(ch.num_stages)))


@settings(max_examples=60, deadline=None)
@given(g=schema_graphs())
def test_every_schema_graph_expands_to_valid_plans(g: Graph) -> None:
    # Whatever the phases' order, every node of the graph in a stage (one stage of backward
    # nodes when there is no forward pass), and schedules that run forwards again stay valid:
    # the forward sweep runs before any backward that could need it.
    ch = chain_view(g)
    placed = [n for s in ch.stages for n in (*s.forward_nodes, *s.backward_nodes)]
    assert sorted(placed) == sorted(n.id for n in g.nodes)
    simulate(g, expand(ch, straight(ch.num_stages)))
    again = [ChainOp("forward", i) for i in range(ch.num_stages)]
    simulate(g, expand(ch, again + straight(ch.num_stages)))
