"""FLOP counts (torch's counter plus the CPU attention formulas) and the three cost models."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.nn.functional as F
from _fx import fx_nodes
from torch.utils.flop_counter import FlopCounterMode

from examples.models import build_gpt, build_mlp, build_resnet
from remat.ir import DeviceProfile, get_profile
from remat.ir.devices import roofline_time_s
from remat.tracer import capture, cpu_profile, node_flops, resolve_cost, trace, trace_capture
from remat.tracer import profile as profiles
from remat.tracer.costs import (
    FLOPS_SECONDS_PER_FLOP,
    bytes_moved,
    cost_key,
    op_class,
    op_size,
)
from remat.tracer.profile import op_clock

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
    (stored,) = cached["profiles"].values()
    assert DeviceProfile.model_validate(stored) == first
    assert first.peak_flops_per_s["float32"] > 0 and first.memory_bandwidth_bytes_per_s > 0
    assert cpu_profile() == first  # read back, not measured again
    g = trace(*build_mlp(batch=4, in_features=8, hidden=16, depth=1), cost="cpu")
    assert g.device == first


def test_measured_cost_times_every_node(remat_cache_dir) -> None:
    g = trace(*build_mlp(batch=32, in_features=64, hidden=128, depth=2), cost="measure")
    assert all(n.time_s > 0 for n in g.nodes)
    assert g.device is not None and g.device.name == "cpu-local"


def test_measured_storage_sizes_equal_the_fake_ones(remat_cache_dir) -> None:
    """cost='measure' also records real storage sizes; on these models fake ones are exact."""
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


def test_default_cost_is_the_local_cpu_roofline(remat_cache_dir) -> None:
    profile = cpu_profile()
    assert profile.op_overhead_s > 0
    classes = {"elementwise", "elementwise_strided", "transcendental", "softmax", "reduction"}
    classes |= {"norm", "random"}
    assert set(profile.op_bandwidth_bytes_per_s) == classes | set(profiles._OP_PROBES)
    assert set(profile.op_compute_efficiency) == {"attention", "attention_causal"}
    assert set(profile.op_bandwidth_curves) == set(profiles._row_probes(8, torch.device("cpu")))
    for points in profile.op_bandwidth_curves.values():
        assert [size for size, _ in points] == list(profiles._ROW_LENGTHS)
    bmm_sizes = [2.0 * m * k * n for m, k, n in profiles._BMM_SHAPES]
    assert [size for size, _ in profile.op_efficiency_curves["bmm"]] == bmm_sizes
    assert all(0 < eff <= 1 for _, eff in profile.op_efficiency_curves["bmm"])
    cap = trace_capture(*build_gpt(batch=2, seq=16, vocab=64, d_model=32, n_layers=1, n_heads=2))
    assert cap.graph.device == profile
    keys = set()
    for n in cap.graph.nodes:
        fx = cap.node_fx[n.id]
        moved = bytes_moved(fx)
        key = cost_key(fx, profile)
        keys.add(key)
        expected = roofline_time_s(profile, n.flops, moved, "float32", key, op_size(fx, key))
        assert n.time_s == pytest.approx(expected)
        assert n.time_s > 0
    # the example's attention (dropout on: the math path) by its measured curves
    assert {"bmm", "_safe_softmax", "_softmax_backward_data", "native_layer_norm"} <= keys


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
    assert op_class("aten.mean.dim") == op_class("aten.sum.dim_IntList") == "reduction"


@pytest.mark.parametrize("solver", ["none", "checkpoint-all", "rotor", "auto"])
def test_no_computed_op_of_a_plan_is_free(solver, remat_cache_dir) -> None:
    """Under the default cost model every op a plan runs, recomputations included, costs time,
    so a plan that recomputes is slower than eager."""
    from remat import solver as solvers
    from remat.ir import resolve_budget, simulate

    g = trace(*build_gpt(batch=2, seq=16, vocab=64, d_model=32, n_layers=2, n_heads=2))
    r = solvers.get(solver)(g, resolve_budget(g, 0.5), time_limit_s=1)  # any plan will do
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


def test_the_profile_cache_keeps_one_profile_per_key(tmp_path, monkeypatch) -> None:
    """Processes with other thread counts add their profile beside this one, never over it;
    the one-profile file of the previous version is read as one entry."""
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    made = []

    def fake_measure(**kwargs) -> DeviceProfile:
        made.append(1)
        return _toy_profile().model_copy(update={"op_overhead_s": float(len(made))})

    monkeypatch.setattr(profiles, "measure_cpu_profile", fake_measure)
    monkeypatch.setattr(profiles, "_PROFILES", {})
    monkeypatch.setattr(profiles, "_cpu_key", lambda device="cpu": "key-a")
    a = cpu_profile()
    monkeypatch.setattr(profiles, "_PROFILES", {})
    monkeypatch.setattr(profiles, "_cpu_key", lambda device="cpu": "key-b")
    b = cpu_profile()
    monkeypatch.setattr(profiles, "_PROFILES", {})
    monkeypatch.setattr(profiles, "_cpu_key", lambda device="cpu": "key-a")
    assert cpu_profile() == a != b  # read back from the file, not measured again
    assert len(made) == 2
    stored = json.loads((tmp_path / "cpu-profile.json").read_text())["profiles"]
    assert set(stored) == {"key-a", "key-b"}
    # the old format: {"key": ..., "profile": ...}
    (tmp_path / "cpu-profile.json").write_text(
        json.dumps({"key": "key-a", "profile": a.model_dump()})
    )
    monkeypatch.setattr(profiles, "_PROFILES", {})
    assert cpu_profile() == a and len(made) == 2


def test_ops_are_timed_on_the_cpu_clock_with_one_thread(monkeypatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert op_clock("cpu") is time.thread_time
    assert op_clock("cuda") is time.perf_counter
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert op_clock("cpu") is time.perf_counter


def _measured_profile() -> DeviceProfile:
    """A fixed profile of the kind the local CPU gets (per-op keys, attention efficiency)."""
    bw = {"elementwise": 2e10, "elementwise_strided": 1e10, "transcendental": 5e9}
    bw.update({"tanh": 2e9, "sqrt": 1.2e10, "pow": 1e9, "silu": 7e9})
    return DeviceProfile(
        name="fixed",
        peak_flops_per_s={"float32": 8e10},
        memory_bandwidth_bytes_per_s=1.5e10,
        host_bandwidth_bytes_per_s=1.5e10,
        op_overhead_s=3e-6,
        op_bandwidth_bytes_per_s=bw,
        op_compute_efficiency={"attention": 0.7, "attention_causal": 0.35},
    )


def test_cost_keys_of_ops_the_profile_measured() -> None:
    p = _measured_profile()
    x = torch.randn(64, 32)
    nodes = fx_nodes(
        lambda x: (
            torch.tanh(x),
            torch.pow(x, 2),
            torch.pow(x, 0.5),
            torch.pow(x, 1.7),
            torch.exp(x),
            x + x,
            x.t() + 1,
            x * x[0],
            F.silu(x),
        ),
        x,
    )
    keys = [cost_key(n, p) for n in nodes]
    # tanh and silu by name; pow(x, 2) is a multiply, pow(x, 0.5) a square root, pow(x, 1.7) a
    # real power; exp (not measured on its own) by its class; an add or a multiply that reads a
    # transposed or broadcast operand is strided (the views themselves are the executor's).
    assert keys == [
        "tanh",
        "elementwise",
        "sqrt",
        "pow",
        "transcendental",
        "elementwise",
        "elementwise",  # aten.t
        "elementwise_strided",  # x.t() + 1
        "elementwise",  # aten.select
        "elementwise_strided",  # x * x[0]
        "silu",
    ]
    # A datasheet profile has no per-op keys: classes only, as before.
    h100 = get_profile("h100")
    sq = torch.randn(32, 32)
    assert {cost_key(n, h100) for n in fx_nodes(lambda x: torch.tanh(x) + x.t(), sq)} == {
        "transcendental",
        "elementwise",
    }


def test_attention_is_priced_at_the_profiles_efficiency() -> None:
    """A deterministic prediction from a fixed profile: the fused attention kernel's time is
    its counted FLOPs over the matmul rate times the measured efficiency (causal apart)."""
    p = _measured_profile()
    model, inputs, loss_fn = build_gpt(
        batch=2, seq=16, vocab=64, d_model=32, n_layers=1, n_heads=2, dropout=0.0
    )
    cap = trace_capture(model, inputs, loss_fn, cost=p)
    attn = [n for n in cap.graph.nodes if "flash_attention_for_cpu" in n.op]
    assert len(attn) == 2
    for n in attn:
        fx = cap.node_fx[n.id]
        assert cost_key(fx, p) == "attention_causal"
        compute_s = n.flops / (0.35 * 8e10)
        memory_s = bytes_moved(fx) / 1.5e10
        assert n.time_s == pytest.approx(3e-6 + max(compute_s, memory_s))
    assert p.flops_per_s("float32", "attention") == pytest.approx(0.7 * 8e10)
    assert p.flops_per_s("float32", "mm") == 8e10
