"""Folding the chains inductor inlines: one IR node per chain, emitted op by op before its head."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from remat.executor.compile.fuse import FUSED, fold_inlined
from remat.executor.compile.inductor_order import mark_realized
from remat.executor.compile.joint import joint_to_ir
from remat.executor.compile.partition import PartitionModel
from remat.executor.compile.plan_split import emitted_figures, plan_orders, split_plan
from remat.ir import simulate
from remat.ir.plan_builders import eager_plan


def _joint(x: torch.Tensor, w: torch.Tensor, tangent: torch.Tensor):
    """A forward (``mm``, a pointwise chain, a sum) and a hand-written backward, in the joint
    graph's signature: primals, tangents; outputs: the loss, then the gradients."""
    h = torch.mm(x, w)
    a = h * 0.5  # read by tanh only: folded into it
    t = torch.tanh(a)  # read by g and by the backward: a value of its own
    g = t * h  # read by the sum (a reduction): folded into it
    loss = g.sum()
    dg = tangent.expand_as(g) * 1.0  # read by dh only: folded
    dh = dg * (1 - t * t)  # t * t and 1 - it fold too; dh is read by mm (a library call): kept
    dw = torch.mm(x.t(), dh)
    return loss, None, dw, None


def _jir():
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    gm = make_fx(_joint)(x, w, torch.tensor(1.0))
    for i, ph in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        ph.name = ph.target = ["primals_1", "primals_2", "tangents_1"][i]
    gm.recompile()
    return joint_to_ir(gm, num_fwd_outputs=1, static_input_indices=[1])


def test_chains_fold_into_their_kernel_reader():
    jir = _jir()
    folded = fold_inlined(jir)
    names = {h: [fx.name for fx in ms] for h, ms in folded.fused.items()}
    # tanh has two readers (g, and the backward's t * t); mm is a library call
    assert names == {"tanh": ["mul"], "sum_1": ["mul_1"], "mul_4": ["mul_2", "mul_3", "rsub"]}
    node = {n.id: n for n in folded.graph.nodes}
    assert list(node) == ["mm", "tanh", "sum_1", "mul_4", "mm_1"]
    # a head reads what its chain reads from outside, and makes what it made
    assert node["sum_1"].inputs == ("tanh", "mm") and node["sum_1"].outputs == ("sum_1",)
    assert node["mul_4"].inputs == ("tangents_1", "tanh")
    assert node["mul_4"].phase == "backward"
    values = {v.id for v in folded.graph.values}
    assert not values & {"mul", "mul_1", "mul_2", "mul_3", "rsub"}
    assert set(folded.fx_value.values()) <= values and set(folded.node_fx) == set(node)
    # the step's time is the same; its peak is lower (no intermediates)
    before = simulate(jir.graph, eager_plan(jir.graph))
    after = simulate(folded.graph, eager_plan(folded.graph))
    assert after.total_time_s == pytest.approx(before.total_time_s, rel=1e-12)
    assert after.peak_bytes < before.peak_bytes
    # nothing left to fold
    assert fold_inlined(folded) is folded


def test_emitted_graphs_run_the_folded_ops_before_their_head_and_compute_the_same():
    jir = _jir()
    folded = fold_inlined(jir)
    plan = eager_plan(folded.graph)
    orders = plan_orders(folded, plan)
    model = PartitionModel(folded.graph)
    fig = emitted_figures(model, orders, rng_state_bytes=0)
    assert fig.peak_bytes == simulate(folded.graph, plan).peak_bytes
    split = split_plan(folded, orders, num_fwd_outputs=1)
    for gm in (split.forward, split.backward):
        nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
        for i, n in enumerate(nodes):
            if n.meta.get(FUSED):  # a folded op: its reader comes after it, within its chain
                assert all(nodes.index(u) > i for u in n.users)
        # the kernels mode leaves a folded op inlined
        mark_realized(gm.graph)
        assert not any(
            n.meta.get("inductor_realize_to_strides") for n in nodes if n.meta.get(FUSED)
        )
    fused = [
        n for gm in (split.forward, split.backward) for n in gm.graph.nodes if n.meta.get(FUSED)
    ]
    assert len(fused) == sum(len(m) for m in folded.fused.values())
    x, w, tg = torch.randn(8, 8), torch.randn(8, 8), torch.tensor(1.0)
    out = split.forward(x, w)
    loss, saved = out[0], out[1:]
    (dw,) = [g for g in split.backward(*saved, tg) if g is not None]
    want_loss, _, want_dw, _ = _joint(x, w, tg)
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(dw, want_dw)
