"""benchmarks/sac_torch.py: PyTorch's ``sac_milp`` fed from remat's graph (the baseline rows of
benchmarks/sharded.py). Its figures are checked against the graph they are read from, and its
decisions against the plan they become."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from remat.ir import checkpoint_class as cc
from remat.ir import eager_plan, simulate, synthetic
from remat.ir.shard import shard_graph
from remat.ir.sharding import ShardingSpec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
sac_torch = pytest.importorskip("sac_torch")
pytest.importorskip("torch.distributed._tools.sac_ilp")

UNITS = tuple(f"layers.{i}" for i in range(4))


@pytest.fixture(scope="module")
def graphs() -> tuple:
    g = synthetic.transformer(4, d_model=64, num_heads=2, seq_len=64, batch_size=2,
                              vocab_size=128)  # fmt: skip
    return g, shard_graph(g, ShardingSpec(world_size=2, units=UNITS))


def test_module_info_reads_the_eager_step(graphs: tuple) -> None:
    g, _ = graphs
    info = sac_torch.module_info(g, UNITS)
    order = info["mod_order"]
    assert order["fw_pre_order"] == ["root", *(f"root.{u}" for u in UNITS)]
    assert order["fw_post_order"][-1] == "root"
    stats = info["mod_stats"]
    eager = simulate(g, eager_plan(g))
    root = stats[0]
    assert root["param_per_module"] + root["grad_total"] == g.static_bytes
    # the activations at the end of the forward, plus the backward's own bytes at its peak,
    # are what the eager step holds at its peak
    assert root["act_bw_per_module"] + root["act_grad_per_module"] == (
        eager.peak_dynamic_bytes - g.input_bytes
    )
    totals = [s["act_total"] for s in stats[1:]]
    assert totals == sorted(totals) and totals[0] > 0  # activations pile up layer by layer
    for s in stats:
        assert s["sac_memory"] >= s["act_fw_per_module"] > 0
        # the trade-off curve: from nothing discarded, convex (slopes never fall), ending at
        # most at all the recomputation (ops that hold no memory need not be recomputed)
        assert s["intercepts"][0] == pytest.approx(0.0, abs=1e-12)
        assert s["slopes"] == sorted(s["slopes"])
        end = max(sl + ic for sl, ic in zip(s["slopes"], s["intercepts"], strict=True))
        assert 0.5 < end <= 1.0 + 1e-9


def test_decisions_become_a_plan_of_the_checkpoint_class(graphs: tuple) -> None:
    g, rank = graphs
    eager = simulate(rank, eager_plan(rank))
    whole = simulate(rank, cc.checkpoint_plan(rank, [cc.region(rank, u) for u in UNITS]))
    budget = (eager.peak_bytes + whole.peak_bytes) // 2
    out = sac_torch.solve_sac(g, rank, UNITS, budget, world_size=2)
    assert out.plan is not None and out.decisions
    assert set(out.decisions) <= set(UNITS)
    assert all(0 < r <= 1 for r in out.decisions.values())
    assert cc.in_class(rank, out.plan)
    assert sorted(r.path for r in cc.regions_of(rank, out.plan)) == sorted(out.decisions)
    for unit, save in out.saves.items():
        assert save >= cc.forced_saves(rank, unit, cc.region(rank, unit).nodes)
    sim = simulate(rank, out.plan)
    assert sim.peak_bytes < eager.peak_bytes
    # its own model is within its budget (to its rounding of the shares), and misses the
    # gathered parameters the per-rank graph counts: the plan runs above it
    assert out.milp_peak_bytes <= budget * 1.001
    assert sim.peak_bytes > out.milp_peak_bytes


def test_a_generous_budget_checkpoints_nothing_and_an_impossible_one_has_no_solution(
    graphs: tuple,
) -> None:
    g, rank = graphs
    eager = simulate(rank, eager_plan(rank))
    roomy = sac_torch.solve_sac(g, rank, UNITS, 2 * eager.peak_bytes, world_size=2)
    assert roomy.decisions == {} and roomy.plan is not None
    assert simulate(rank, roomy.plan).peak_bytes == eager.peak_bytes
    none = sac_torch.solve_sac(g, rank, UNITS, rank.static_bytes // 4, world_size=2)
    assert none.plan is None and none.milp_peak_bytes == -1
    with pytest.raises(ValueError, match="units"):
        sac_torch.module_info(g, ("layers.9",))
    with pytest.raises(ValueError, match="unsharded"):
        sac_torch.module_info(rank, UNITS)
