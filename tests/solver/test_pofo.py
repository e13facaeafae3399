"""POFO: offloading plans, simulated with the copy stream's overlap and stalls."""

from __future__ import annotations

import math

import pytest

from remat.ir import eager_plan, simulate
from remat.ir.chain import ChainOp
from remat.ir.synthetic import chain, transformer
from remat.solver import get
from remat.solver.pofo import early_prefetch


def budget(g: object, frac: float) -> int:
    dyn = simulate(g, eager_plan(g)).peak_dynamic_bytes  # type: ignore[arg-type]
    return g.static_bytes + int(frac * dyn)  # type: ignore[attr-defined]


@pytest.mark.parametrize("frac", [0.8, 0.6, 0.4])
def test_pofo_no_slower_than_rotor_with_free_transfers(frac: float) -> None:
    g = chain(16, heterogeneous=True, seed=4)
    b = budget(g, frac)
    rot = get("rotor")(g, b)
    pof = get("pofo")(g, b, host_bandwidth_bytes_per_s=math.inf)
    assert pof.status == "feasible" and pof.peak_bytes is not None and pof.peak_bytes <= b
    assert (pof.total_time_s or 0) <= (rot.total_time_s or 0) * (1 + 1e-9)


def test_pofo_offloads_when_transfers_are_cheap() -> None:
    g = transformer(4, d_model=128, seq_len=64, vocab_size=256, num_heads=2)
    b = budget(g, 0.4)
    r = get("pofo")(g, b, host_bandwidth_bytes_per_s=1e15)
    assert r.status == "feasible" and r.plan is not None
    assert r.offload_bytes and r.offload_bytes > 0
    sim = simulate(g, r.plan, host_bandwidth_bytes_per_s=1e15)
    assert sim.peak_bytes <= b and sim.total_time_s == pytest.approx(r.total_time_s)


def test_slow_link_counts_stalls_and_still_fits() -> None:
    g = chain(8)
    b = budget(g, 0.5)
    r = get("pofo")(g, b, host_bandwidth_bytes_per_s=1e9)
    assert r.status == "feasible" and r.peak_bytes is not None and r.peak_bytes <= b
    assert r.plan is not None
    sim = simulate(g, r.plan, host_bandwidth_bytes_per_s=1e9)
    assert sim.total_time_s == pytest.approx(r.total_time_s)
    assert sim.total_time_s >= sim.compute_time_s


def test_early_prefetch_moves_before_the_previous_backward() -> None:
    ops = [
        ChainOp("forward", 0),
        ChainOp("offload", 0),
        ChainOp("forward", 1),
        ChainOp("backward", 1),
        ChainOp("prefetch", 0),
        ChainOp("backward", 0),
    ]
    out = early_prefetch(ops)
    assert [o.kind for o in out][2:] == ["forward", "prefetch", "backward", "backward"]


def test_bad_bandwidth_is_named() -> None:
    with pytest.raises(ValueError, match="host_bandwidth"):
        get("pofo")(chain(3), 10**9, host_bandwidth_bytes_per_s=0.0)
