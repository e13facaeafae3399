"""The default roofline's size-dependent rates: batched matmuls by the FLOPs of one product,
softmax and layer norm by the length of their rows (deterministic, from a fixed profile)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from _fx import fx_nodes

from examples.models import build_gpt
from remat.ir import DeviceProfile, get_profile
from remat.ir.device_profile import interpolate
from remat.tracer import cpu_profile, trace_capture
from remat.tracer import profile as profiles
from remat.tracer.costs import bytes_moved, cost_key, node_time_s, op_size

aten = torch.ops.aten

BMM = ((1e5, 0.25), (1e6, 0.5), (1e7, 1.0))
ROWS = ((32.0, 1e9), (128.0, 2e9), (2048.0, 6e9))


def _curved() -> DeviceProfile:
    names = ["_softmax", "_safe_softmax", "_log_softmax", "_softmax_backward_data"]
    names += ["_log_softmax_backward_data", "native_layer_norm", "native_layer_norm_backward"]
    return DeviceProfile(
        name="curved",
        peak_flops_per_s={"float32": 1e11},
        memory_bandwidth_bytes_per_s=2e10,
        host_bandwidth_bytes_per_s=2e10,
        op_overhead_s=2e-6,
        op_bandwidth_bytes_per_s={"elementwise": 1e10, "softmax": 5e9, "norm": 5e9},
        op_bandwidth_curves={name: ROWS for name in names},
        op_efficiency_curves={"bmm": BMM},
    )


def test_keys_and_sizes_of_batched_matmuls_and_row_ops() -> None:
    p = _curved()
    a, b = torch.randn(6, 128, 32), torch.randn(6, 32, 64)
    c, x = torch.zeros(6, 128, 64), torch.randn(4, 16, 128)
    nodes = fx_nodes(
        lambda a, b, c, x: (
            torch.bmm(a, b),
            torch.baddbmm(c, a, b),
            torch.bmm(c, c.transpose(1, 2)),  # one tensor twice
            aten._safe_softmax(x, -1),
            aten._softmax(x, 1, False),
            aten._log_softmax_backward_data(x, x, 2, torch.float32),
            aten.native_layer_norm(x, [16, 128], None, None, 1e-5),
            a + a,
        ),
        a,
        b,
        c,
        x,
    )
    got = [(str(n.target), cost_key(n, p), op_size(n, cost_key(n, p))) for n in nodes]
    per_product = 2.0 * 128 * 32 * 64
    assert got[:2] == [
        ("aten.bmm.default", "bmm", per_product),
        ("aten.baddbmm.default", "bmm", per_product),
    ]
    assert got[3] == ("aten.bmm.default", "bmm", 2.0 * 128 * 64 * 128)  # after the transpose
    assert [(key, size) for _, key, size in got[4:]] == [
        ("_safe_softmax", 128.0),
        ("_softmax", 16.0),  # over dim 1
        ("_log_softmax_backward_data", 128.0),
        ("native_layer_norm", 16.0 * 128),  # the normalised shape's elements
        ("elementwise", None),
    ]
    # A profile without curves (a datasheet GPU) prices them by their class, as before.
    h100 = get_profile("h100")
    assert [cost_key(nodes[i], h100) for i in (0, 1, 4)] == [
        "elementwise",
        "elementwise",
        "softmax",
    ]


def test_a_fixed_profile_prices_attention_by_its_shapes() -> None:
    """The GPT example with dropout (the math attention: bmm, then a softmax over rows of
    ``seq``): each such node costs what the curves give at its size, exactly."""
    p = _curved()
    seq, d_model, heads = 16, 32, 2
    cap = trace_capture(
        *build_gpt(batch=2, seq=seq, vocab=64, d_model=d_model, n_layers=1, n_heads=heads),
        cost=p,
    )
    head = d_model // heads
    seen = set()
    for n in cap.graph.nodes:
        fx = cap.node_fx[n.id]
        base = n.op.split(".")[1]
        if base == "bmm":
            a, b = (x.meta["val"] for x in fx.all_input_nodes)
            one = 2.0 * a.shape[1] * a.shape[2] * b.shape[2]
            assert sorted([a.shape[1], a.shape[2], b.shape[2]]) == sorted([seq, seq, head])
            eff = interpolate(BMM, one)
            assert eff == 0.25  # below the smallest probe: its efficiency
            compute_s = n.flops / (eff * 1e11)
            memory_s = bytes_moved(fx) / 2e10  # "bmm" has no bandwidth of its own
            assert n.time_s == pytest.approx(2e-6 + max(compute_s, memory_s))
            seen.add(base)
        elif base in ("_safe_softmax", "_softmax_backward_data"):
            assert op_size(fx, base) == seq
            assert n.time_s == pytest.approx(2e-6 + bytes_moved(fx) / interpolate(ROWS, seq))
            seen.add(base)
        elif base in ("native_layer_norm", "native_layer_norm_backward"):
            assert op_size(fx, base) == d_model
            bw = 1e9 + (2e9 - 1e9) * math.log(d_model / 32) / math.log(4)
            assert n.time_s == pytest.approx(2e-6 + bytes_moved(fx) / bw)
            seen.add(base)
        assert n.time_s == node_time_s(fx, n.flops, p)
    assert seen == {
        "bmm",
        "_safe_softmax",
        "_softmax_backward_data",
        "native_layer_norm",
        "native_layer_norm_backward",
    }


def test_a_profile_of_an_older_version_is_measured_again(tmp_path, monkeypatch) -> None:
    """The cache key carries PROFILE_VERSION: a profile measured before the curves existed is
    not used, and the new one is stored beside it."""
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(profiles, "_PROFILES", {})
    key = profiles._cpu_key()
    assert key.startswith(f"v{profiles.PROFILE_VERSION}-")
    old_key = key.replace(f"v{profiles.PROFILE_VERSION}-", f"v{profiles.PROFILE_VERSION - 1}-", 1)
    old = _curved().model_copy(update={"op_bandwidth_curves": {}, "op_efficiency_curves": {}})
    path = tmp_path / "cpu-profile.json"
    path.write_text(json.dumps({"profiles": {old_key: old.model_dump()}}))
    made: list[DeviceProfile] = []

    def fake_measure(**kwargs) -> DeviceProfile:
        made.append(_curved())
        return made[-1]

    monkeypatch.setattr(profiles, "measure_cpu_profile", fake_measure)
    assert cpu_profile() == _curved() and len(made) == 1
    stored = json.loads(path.read_text())["profiles"]
    assert set(stored) == {old_key, key}
    assert DeviceProfile.model_validate(stored[key]) == _curved()  # curves round-trip
    monkeypatch.setattr(profiles, "_PROFILES", {})
    assert cpu_profile() == _curved() and len(made) == 1  # read back


def test_the_row_probes_count_bytes_as_the_roofline_does() -> None:
    """Each row op's probe counts the bytes bytes_moved counts for the same op, apart from its
    small operands (a norm's weights and statistics, under 2%)."""
    length = 64
    x = torch.rand(2**20 // length, length)
    for name, op in profiles._row_probes(length, torch.device("cpu")).items():
        reads = (x, x) if "backward" in name else (x,)
        probe_bytes = profiles._tensor_bytes(*reads, op(x, x))
        (node,) = [
            n
            for n in fx_nodes(op, x, x.clone(), mode="real")
            if str(n.target).startswith("aten._") or "layer_norm" in str(n.target)
        ]
        counted = bytes_moved(node)
        assert probe_bytes <= counted <= probe_bytes * 1.02, name
