"""FLOP counts (torch's counter plus the CPU attention formulas) and the three cost models."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from examples.models import build_gpt, build_mlp, build_resnet
from remat.ir import DeviceProfile, get_profile
from remat.ir.devices import roofline_time_s
from remat.tracer import capture, cpu_profile, node_flops, resolve_cost, trace, trace_capture
from remat.tracer.costs import FLOPS_SECONDS_PER_FLOP, bytes_moved, op_class

aten = torch.ops.aten


def eager_flops(model, inputs, loss_fn) -> int:
    with FlopCounterMode(display=False) as counter:
        loss_fn(model(*inputs)).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("build", [build_mlp, build_resnet])
def test_graph_flops_equal_torch_counter_on_the_eager_step(build) -> None:
    model, inputs, loss_fn = build()
    graph = capture(model, inputs, loss_fn).graph
    assert sum(n.flops for n in graph.nodes) == eager_flops(model, inputs, loss_fn) > 0


def test_cpu_attention_flops_are_counted() -> None:
    b, h, t, d = 2, 4, 16, 8
    q = torch.randn(b, h, t, d)
    out = aten._scaled_dot_product_flash_attention_for_cpu.default(q, q, q, 0.0, False)
    full = 2 * (2 * b * h * t * t * d)  # q k^T and p v
    fwd = node_flops(
        aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q, 0.0, False), {}, out
    )
    causal = node_flops(
        aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q, 0.0, True), {}, out
    )
    assert fwd == full
    assert causal == full // 2
    bwd = node_flops(
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        (out[0], q, q, q, out[0], out[1], 0.0, False),
        {},
        (q, q, q),
    )
    assert bwd == 5 * full // 2
    # torch's own counter misses them: that is why the formulas exist.
    with FlopCounterMode(display=False) as counter:
        F.scaled_dot_product_attention(q, q, q)
    assert counter.get_total_flops() == 0


def test_gpt_graph_counts_attention() -> None:
    model, inputs, loss_fn = build_gpt(
        batch=2, seq=16, vocab=64, d_model=32, n_layers=1, n_heads=2, dropout=0.0
    )
    g = capture(model, inputs, loss_fn).graph
    attn = [n for n in g.nodes if "flash_attention_for_cpu" in n.op]
    assert [n.phase for n in attn] == ["forward", "backward"]
    fwd = 2 * (2 * 2 * 2 * 16 * 16 * 16) // 2  # causal
    assert [n.flops for n in attn] == [fwd, 5 * fwd // 2]
    assert all(n.module == "blocks.0.attn" for n in attn)
    # Everything else is what torch's counter sees in the eager step.
    other = sum(n.flops for n in g.nodes) - sum(n.flops for n in attn)
    assert other == eager_flops(model, inputs, loss_fn)


def test_flops_cost_is_flops_in_seconds() -> None:
    g = trace(*build_mlp(batch=4, in_features=8, hidden=16, depth=1), cost="flops")
    assert g.device is None
    for n in g.nodes:
        assert n.time_s == pytest.approx(n.flops * FLOPS_SECONDS_PER_FLOP)


@pytest.mark.parametrize("name", ["a100", "h100", "h200"])
def test_roofline_cost_against_a_datasheet_profile(name) -> None:
    cap = trace_capture(*build_mlp(batch=8, in_features=16, hidden=32, depth=2), cost=name)
    profile = get_profile(name)
    assert cap.graph.device == profile
    for n in cap.graph.nodes:
        moved = bytes_moved(cap.node_fx[n.id])
        assert moved > 0
        assert n.time_s == pytest.approx(roofline_time_s(profile, n.flops, moved, "float32"))
        assert n.time_s >= moved / profile.memory_bandwidth_bytes_per_s * (1 - 1e-12)


def test_profile_object_and_bad_cost() -> None:
    custom = DeviceProfile(
        name="toy",
        peak_flops_per_s={"float32": 1e9},
        memory_bandwidth_bytes_per_s=1e9,
        host_bandwidth_bytes_per_s=1e8,
    )
    g = trace(*build_mlp(batch=4, in_features=8, hidden=16, depth=1), cost=custom)
    assert g.device == custom and g.host_bandwidth_bytes_per_s == 1e8
    with pytest.raises(ValueError, match="unknown cost"):
        resolve_cost("tpu-v9")


def test_cpu_profile_is_measured_once_and_cached(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    first = cpu_profile()
    cached = json.loads((tmp_path / "cpu-profile.json").read_text())
    assert DeviceProfile.model_validate(cached["profile"]) == first
    assert first.peak_flops_per_s["float32"] > 0 and first.memory_bandwidth_bytes_per_s > 0
    assert cpu_profile() == first  # read back, not measured again
    g = trace(*build_mlp(batch=4, in_features=8, hidden=16, depth=1), cost="cpu")
    assert g.device == first


def test_measured_cost_times_every_node(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    g = trace(*build_mlp(batch=32, in_features=64, hidden=128, depth=2), cost="measure")
    assert all(n.time_s > 0 for n in g.nodes)
    assert g.device is not None and g.device.name == "cpu-local"


def test_measured_storage_sizes_equal_the_fake_ones(tmp_path, monkeypatch) -> None:
    """cost='measure' also records real storage sizes; on these models fake ones are exact."""
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    model, inputs, loss_fn = build_gpt(batch=2, seq=16, vocab=64, d_model=32, n_layers=1)
    measured = trace(model, inputs, loss_fn, cost="measure")
    assert measured.values == trace(model, inputs, loss_fn).values


def test_measure_needs_a_real_model() -> None:
    model, inputs, loss_fn = build_gpt(
        batch=1, seq=8, vocab=32, d_model=16, n_layers=1, n_heads=2, device="meta"
    )
    with pytest.raises(ValueError, match="meta"):
        trace(model, inputs, loss_fn, cost="measure")


# -- the default cost model: the local device's roofline ----------------------------------------


def _toy_profile() -> DeviceProfile:
    return DeviceProfile(
        name="toy",
        peak_flops_per_s={"float32": 1e11},
        memory_bandwidth_bytes_per_s=5e10,
        host_bandwidth_bytes_per_s=5e10,
        op_overhead_s=2e-6,
        op_bandwidth_bytes_per_s={"elementwise": 2e10, "transcendental": 4e9, "random": 1e9},
    )


def test_default_cost_is_the_local_cpu_roofline(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    profile = cpu_profile()
    assert profile.op_overhead_s > 0
    assert set(profile.op_bandwidth_bytes_per_s) == {
        "elementwise",
        "transcendental",
        "softmax",
        "norm",
        "random",
    }
    cap = trace_capture(*build_gpt(batch=2, seq=16, vocab=64, d_model=32, n_layers=1, n_heads=2))
    assert cap.graph.device == profile
    for n in cap.graph.nodes:
        moved = bytes_moved(cap.node_fx[n.id])
        expected = roofline_time_s(profile, n.flops, moved, "float32", op_class(n.op))
        assert n.time_s == pytest.approx(expected)
        assert n.time_s > 0


def test_copies_and_elementwise_ops_cost_bytes_over_bandwidth(monkeypatch) -> None:
    toy = _toy_profile()
    cap = trace_capture(
        *build_gpt(batch=2, seq=16, vocab=64, d_model=32, n_layers=1, n_heads=2), cost=toy
    )
    seen = set()
    for n in cap.graph.nodes:
        if n.flops:
            continue
        moved = bytes_moved(cap.node_fx[n.id])
        cls = op_class(n.op)
        bw = toy.op_bandwidth_bytes_per_s.get(cls, toy.memory_bandwidth_bytes_per_s)
        assert moved > 0
        assert n.time_s == pytest.approx(toy.op_overhead_s + moved / bw)
        seen.add(n.op.split(".")[1])
    # a copy (clone of a transposed view), element-wise ops and a random draw are among them
    assert {"clone", "add", "mul", "bernoulli", "gelu"} <= seen


def test_op_classes() -> None:
    assert op_class("aten.add.Tensor") == "elementwise"
    assert op_class("aten.clone.default") == "elementwise"
    assert op_class("aten.gelu_backward.default") == "transcendental"
    assert op_class("aten._safe_softmax.default") == "softmax"
    assert op_class("aten.native_layer_norm.default") == "norm"
    assert op_class("aten.bernoulli.p") == "random"


@pytest.mark.parametrize("solver", ["none", "checkpoint-all", "rotor", "auto"])
def test_no_computed_op_of_a_plan_is_free(solver, tmp_path, monkeypatch) -> None:
    """Under the default cost model every op a plan runs, recomputations included, costs time,
    so a plan that recomputes is slower than eager."""
    from remat import solver as solvers
    from remat.ir import resolve_budget, simulate

    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    g = trace(*build_gpt(batch=2, seq=16, vocab=64, d_model=32, n_layers=2, n_heads=2))
    r = solvers.get(solver)(g, resolve_budget(g, 0.5), time_limit_s=5)
    assert r.plan is not None
    for step in r.plan.steps:
        if step.op == "compute":
            assert g.node(step.id).time_s > 0, step.id
    sim = simulate(g, r.plan)
    if sim.num_recomputes:
        assert sim.recompute_time_s > 0 and r.overhead is not None and r.overhead > 0


def test_a_gpu_target_names_its_profile() -> None:
    g = trace(*build_mlp(batch=4, in_features=8, hidden=16, depth=1), target="h100")
    assert g.device == get_profile("h100")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="name the GPU"):
            trace(*build_mlp(batch=4, in_features=8, hidden=16, depth=1), target="cuda")
    with pytest.raises(ValueError, match="target must be"):
        trace(*build_mlp(batch=4, in_features=8, hidden=16, depth=1), target="tpu")


def test_profile_rejects_a_negative_overhead_or_bandwidth() -> None:
    from pydantic import ValidationError

    base = _toy_profile().model_dump()
    with pytest.raises(ValidationError, match="op_overhead_s"):
        DeviceProfile.model_validate({**base, "op_overhead_s": -1.0})
    with pytest.raises(ValidationError, match="op_bandwidth_bytes_per_s"):
        DeviceProfile.model_validate({**base, "op_bandwidth_bytes_per_s": {"random": 0.0}})
