"""Capture and storage mapping: kinds, required set, views, side effects, metadata, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from examples.models import build_gpt, build_mlp, build_resnet, build_vit
from remat.ir import Graph, eager_plan, simulate
from remat.tracer import Capture, TraceError, capture, trace

VIEW_OPS = {
    "aten.view.default",
    "aten.t.default",
    "aten.transpose.int",
    "aten.expand.default",
    "aten.detach.default",
    "aten._unsafe_view.default",
    "aten.slice.Tensor",
    "aten.permute.default",
    "aten.unsqueeze.default",
    "aten.split.Tensor",
    "aten.unbind.int",
    "aten.select.int",
}


def small_gpt(**kw):
    sizes = {"batch": 2, "seq": 16, "vocab": 64, "d_model": 32, "n_layers": 2, "n_heads": 2}
    return build_gpt(**{**sizes, **kw})


@pytest.fixture(scope="module")
def gpt() -> tuple[Capture, nn.Module]:
    model, inputs, loss_fn = small_gpt()
    return capture(model, inputs, loss_fn), model


def test_required_is_exactly_param_grads_and_loss(gpt) -> None:
    cap, model = gpt
    g = cap.graph
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(cap.grad_values) == sorted(names)  # tied head/wte weight appears once
    assert set(g.required) == {*cap.grad_values.values(), cap.loss_value}
    assert len(g.required) == len(names) + 1
    for vid in cap.grad_values.values():
        v = g.value(vid)
        assert v.kind == "gradient"
        assert g.producer_of(vid).phase == "backward"
    assert g.value(cap.loss_value).kind == "loss"
    assert g.value(cap.loss_value).size_bytes == 4


def test_frozen_parameters_get_no_required_gradient() -> None:
    model, inputs, loss_fn = build_mlp(batch=4, in_features=8, hidden=16, depth=2)
    model.body[0].weight.requires_grad_(False)
    cap = capture(model, inputs, loss_fn)
    assert "body.0.weight" not in cap.grad_values
    assert cap.graph.value(cap.param_values["body.0.weight"]).kind == "param"
    params = dict(model.named_parameters())
    p_bytes = sum(p.numel() * 4 for p in params.values())
    g_bytes = p_bytes - params["body.0.weight"].numel() * 4
    assert cap.graph.static_bytes == p_bytes + g_bytes
    assert len(cap.graph.required) == len(params)  # 5 grads + loss


def test_kinds_and_static_bytes(gpt) -> None:
    cap, model = gpt
    g = cap.graph
    kinds = {v.id: v.kind for v in g.values}
    assert {kinds[v] for v in cap.param_values.values()} == {"param"}
    assert {kinds[v] for v in cap.input_values} == {"input"}
    assert kinds[cap.tangent_value] == "input"
    assert all(
        kinds[v] == "activation" for n in g.forward_nodes for v in n.outputs if v != cap.loss_value
    )
    assert all(kinds[v] == "gradient" for n in g.backward_nodes for v in n.outputs)
    param_bytes = sum(p.numel() * 4 for p in model.parameters())  # tied weight counted once
    assert g.static_bytes == 2 * param_bytes  # params + grads, no buffers


def test_views_are_folded_into_their_base(gpt) -> None:
    cap, _ = gpt
    g = cap.graph
    assert not {n.op for n in g.nodes} & VIEW_OPS
    # Every FX node that reads a view: its IR node reads the base storage.
    for nid, fx in cap.node_fx.items():
        node = g.node(nid)
        for arg in fx.all_input_nodes:
            vid = cap.fx_value.get(arg.name)
            if vid is not None:
                assert vid in node.inputs
    for vid, aliases in cap.value_aliases.items():
        assert aliases[0] is cap.value_fx[vid]
        base = cap.value_fx[vid].meta.get("val")
        for a in aliases[1:]:
            t = a.meta.get("val")
            if (
                isinstance(t, torch.Tensor)
                and isinstance(base, torch.Tensor)
                and a.op != "get_attr"
            ):
                assert t.untyped_storage().nbytes() == base.untyped_storage().nbytes()


def test_node_ids_are_fx_names_and_phases_are_ordered(gpt) -> None:
    cap, _ = gpt
    g = cap.graph
    for node in g.nodes:
        assert node.id == node.name == cap.node_fx[node.id].name
    phases = [n.phase for n in g.nodes]
    first_bwd = phases.index("backward")
    assert all(p == "forward" for p in phases[:first_bwd])
    assert all(p == "backward" for p in phases[first_bwd:])


def test_module_paths_and_rng(gpt) -> None:
    cap, _ = gpt
    g = cap.graph
    fwd_modules = {n.module for n in g.forward_nodes}
    assert {"blocks.0.attn", "blocks.1.attn", "blocks.0.mlp.0", "ln_f", "wte"} <= fwd_modules
    attn_bwd = [n for n in g.backward_nodes if n.op.startswith("aten._softmax_backward")]
    assert attn_bwd and all(n.module.endswith(".attn") for n in attn_bwd)
    mm_bwd = {n.module for n in g.backward_nodes if n.op == "aten.mm.default"}
    assert "blocks.1.mlp.2" in mm_bwd
    rng = [n for n in g.nodes if n.rng]
    # dropout after the embeddings, in attention, after attention, after the MLP, per block
    assert len(rng) == 1 + 3 * 2
    assert all(n.op == "aten.bernoulli.p" and n.phase == "forward" for n in rng)
    assert all(n.recomputable for n in g.nodes)  # no buffers, no side effects


def test_batch_norm_running_stats_are_side_effects() -> None:
    model, inputs, loss_fn = build_resnet(batch=2, image=8, width=4, blocks_per_stage=1, stages=2)
    cap = capture(model, inputs, loss_fn)
    g = cap.graph
    updated = {n for n in cap.buffer_names if not n.endswith("num_batches_tracked")}
    assert updated <= set(cap.buffer_updates)
    side = {n.id for n in g.nodes if not n.recomputable}
    assert side
    for vid in cap.buffer_updates.values():
        assert g.value(vid).kind == "buffer"
        assert g.is_static(vid)
        assert g.producer_of(vid).id in side
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert g.static_bytes == 2 * param_bytes + buffer_bytes
    # The eager plan runs every side-effecting node once.
    simulate(g, eager_plan(g))


def test_multiple_inputs_and_masks() -> None:
    model, inputs, loss_fn = small_gpt(padding_mask=True)
    cap = capture(model, inputs, loss_fn)
    assert len(cap.input_values) == 2
    assert [cap.graph.value(v).dtype for v in cap.input_values] == ["int64", "bool"]
    # The same inputs as keyword arguments (a dict) give the same graph.
    idx, mask = inputs
    by_name = capture(model, {"idx": idx, "padding_mask": mask}, loss_fn)
    assert by_name.graph.content_hash() == cap.graph.content_hash()
    assert len(by_name.primals(model, {"idx": idx, "padding_mask": mask})) == len(
        cap.primals(model, inputs)
    )


class MakesTensors(nn.Module):
    """Creates tensors in forward the ways model libraries do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = torch.tensor([0.5] * 8)  # plain attribute, not a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = torch.tensor(2.0)
        mask = torch.ones(x.shape[0], 8).tril()
        return self.lin(x) * c * self.scale * mask + torch.arange(8.0)


def test_models_that_create_tensors_in_forward_trace_and_run() -> None:
    model = MakesTensors()
    x = torch.randn(4, 8)
    y = torch.randn(4, 8)
    cap = capture(model, (x,), lambda out: F.mse_loss(out, y))
    kinds = {v.kind for v in cap.graph.values}
    assert "buffer" in kinds  # the constants
    assert cap.graph.static_bytes == 2 * (64 + 8) * 4
    # The joint graph runs on real tensors and gives the eager gradients.
    outs = cap.run([t.detach() for t in cap.primals(model, (x,))], [torch.ones(())])
    F.mse_loss(model(x), y).backward()
    grads = {
        name: o for (role, name), o in zip(cap.output_roles, outs, strict=True) if role == "grad"
    }
    for name, p in model.named_parameters():
        assert torch.equal(grads[name], p.grad)


def test_joint_graph_reproduces_eager_gradients_with_dropout() -> None:
    model, inputs, loss_fn = small_gpt()
    cap = capture(model, inputs, loss_fn)
    primals = [t.detach() for t in cap.primals(model, inputs)]
    torch.manual_seed(3)
    outs = cap.run(primals, [torch.ones(())])
    torch.manual_seed(3)
    loss_fn(model(*inputs)).backward()
    params = dict(model.named_parameters())
    roles = cap.output_roles
    assert [r for r, _ in roles].count("grad") == len(params)
    for (role, name), out in zip(roles, outs, strict=True):
        if role == "grad":
            assert torch.equal(out, params[name].grad), name


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), Nonzero())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).sum()


class Nonzero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[torch.nonzero(x > 0, as_tuple=True)]


def test_unsupported_op_names_op_and_module() -> None:
    with pytest.raises(TraceError) as info:
        capture(DataDependent(), (torch.randn(3, 4),))
    err = info.value
    assert err.module == "inner.1"
    assert "nonzero" in str(err) and "inner.1" in str(err)


def test_bad_loss_and_inputs_are_clear_errors() -> None:
    model, inputs, _ = build_mlp(batch=4, in_features=8, hidden=8, depth=1)
    with pytest.raises(TraceError, match="loss_fn must return a scalar"):
        capture(model, inputs, lambda out: out * 2)  # not a loss
    # Without loss_fn, logits are the step's output: the loop's loss is outside
    # (tests/executor/test_user_loss.py).
    assert capture(model, inputs).output is not None
    with pytest.raises(TypeError, match="example_inputs"):
        capture(model, "x")


def test_trace_returns_a_valid_serialisable_graph() -> None:
    model, inputs, loss_fn = build_vit(batch=2, image=16, patch=8, d_model=16, depth=1)
    g = trace(model, inputs, loss_fn)
    again = Graph.from_json(g.to_json())
    assert again.content_hash() == g.content_hash()
    assert g.name == "ViT"


def test_backward_autograd_nodes_hold_their_inputs_to_the_end(gpt) -> None:
    """Ops of one backward autograd node (same seq_nr) keep what the node reads until its last
    op, as eager autograd releases saved tensors per node."""
    cap, _ = gpt
    g = cap.graph
    runs: list[list] = []
    for node in g.backward_nodes:
        seq = cap.node_fx[node.id].meta.get("seq_nr")
        if runs and seq is not None and runs[-1][0] == seq:
            runs[-1][1].append(node)
        else:
            runs.append([seq, [node]])
    multi = [nodes for _, nodes in runs if len(nodes) > 1]
    assert multi  # e.g. mm backward: two products
    for nodes in multi:
        made = {o for n in nodes for o in n.outputs}
        read = {x for n in nodes for x in n.inputs if x not in made and not g.is_static(x)}
        assert read <= set(nodes[-1].inputs)
        # The extra inputs are the IR's only: the FX op reads its own arguments.
        own = {
            cap.fx_value[a.name]
            for a in cap.node_fx[nodes[-1].id].all_input_nodes
            if a.name in cap.fx_value
        }
        assert own <= set(nodes[-1].inputs)


def test_remat_trace_is_the_tracer() -> None:
    import remat
    import remat.tracer

    assert remat.trace is remat.tracer.trace


def test_cuda_target_plans_fused_dropout_and_attention() -> None:
    model, inputs, loss_fn = small_gpt()
    cpu = capture(model, inputs, loss_fn)
    gpu = capture(model, inputs, loss_fn, target="cuda")
    assert (cpu.target, gpu.target) == ("cpu", "cuda")
    cpu_ops = {n.op for n in cpu.graph.nodes}
    gpu_ops = {n.op for n in gpu.graph.nodes}
    # CPU eager: bernoulli noise, attention by the unfused math path (dropout is on).
    assert "aten.bernoulli.p" in cpu_ops and "aten.native_dropout.default" not in cpu_ops
    assert "aten._safe_softmax.default" in cpu_ops
    # CUDA eager: a 1-byte dropout mask and a fused attention kernel.
    assert "aten.native_dropout.default" in gpu_ops and "aten.bernoulli.p" not in gpu_ops
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in gpu_ops
    assert "aten._safe_softmax.default" not in gpu_ops
    masks = [
        gpu.graph.value(v)
        for n in gpu.graph.nodes
        if n.op == "aten.native_dropout.default"
        for v in n.outputs
    ]
    assert {m.dtype for m in masks} == {"float32", "bool"}
    cpu_peak = simulate(cpu.graph, eager_plan(cpu.graph)).peak_dynamic_bytes
    gpu_peak = simulate(gpu.graph, eager_plan(gpu.graph)).peak_dynamic_bytes
    assert gpu_peak < cpu_peak
    assert {n.op for n in gpu.graph.nodes if n.rng} == {
        "aten.native_dropout.default",
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
    }
    # trace() mirrors the CPU step unless asked (executors capture the CPU step: same ids).
    assert not any(
        "flash_attention" in n.op for n in trace(model, inputs, loss_fn, cost="h100").nodes
    )
    planned = trace(model, inputs, loss_fn, cost="h100", target="cuda")
    assert any("flash_attention" in n.op for n in planned.nodes)
    with pytest.raises(ValueError, match="target"):
        capture(model, inputs, loss_fn, target="tpu")
