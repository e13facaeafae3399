"""``hierarchical`` with offloading: POFO's whole-block offload in the DP across blocks, and its
recompute-only plans for larger budgets offloaded down to the budget.

Every plan is judged again by the simulator here (device peak within the budget, host peak
within the host budget); memory figures are deterministic and asserted exactly, times only
against each other."""

from __future__ import annotations

import functools

import pytest
from _graphs import random_step
from hypothesis import given, settings
from hypothesis import strategies as st
from test_offload import _unrecomputable_chain, _with_link

from remat import solver
from remat.ir import Graph, Plan, eager_plan, simulate
from remat.ir.chain import chain_view
from remat.ir.devices import H100_SXM
from remat.ir.result import SolveResult
from remat.ir.synthetic import transformer
from remat.solver.base import InvalidOptionError
from remat.solver.hierarchical import HierarchicalOptions, host_blocks


@functools.cache
def tf3() -> Graph:
    return transformer(3)


def budget(g: Graph, frac: float) -> int:
    return g.static_bytes + int(frac * simulate(g, eager_plan(g)).peak_dynamic_bytes)


@functools.cache
def solve(frac: float, offload: bool | None, combine: bool = True) -> SolveResult:
    g = tf3()
    return solver.get("hierarchical")(g, budget(g, frac), offload=offload, combine=combine)


def judged(g: Graph, r: SolveResult, b: int) -> tuple[float, int, int]:
    """The plan's simulated time, device peak and host peak, checked against the budgets."""
    assert r.fits and r.plan is not None, r.message
    sim = simulate(g, r.plan)
    assert sim.peak_bytes <= b
    host = g.link.host_memory_bytes
    assert host is None or sim.host_peak_bytes <= host
    return sim.total_time_s, sim.peak_bytes, sim.host_peak_bytes


def offloads(plan: Plan | None) -> int:
    assert plan is not None
    return sum(s.op == "offload" for s in plan.steps)


@pytest.mark.parametrize("frac", [0.7, 0.5])
def test_never_slower_than_recompute_only(frac: float) -> None:
    g = tf3()
    b = budget(g, frac)
    on_s, _, on_host = judged(g, solve(frac, None), b)  # on by default: A100 with a host link
    off_s, _, off_host = judged(g, solve(frac, False), b)
    assert on_s <= off_s * (1 + 1e-9)
    assert off_host == 0 and on_host > 0


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10**6), ops=st.integers(2, 4), frac=st.sampled_from([0.8, 0.6, 0.4]))
def test_never_slower_on_random_steps(seed: int, ops: int, frac: float) -> None:
    # the recompute-only candidates are all still there (no time limit: the same ones), so
    # offloading can only add faster plans; every plan is judged by the simulator
    g = random_step(seed, ops)
    b = budget(g, frac)
    off = solver.get("hierarchical")(g, b, offload=False)
    on = solver.get("hierarchical")(g, b, offload=True)
    if off.fits:
        on_s, _, _ = judged(g, on, b)
        assert on_s <= (off.total_time_s or 0) * (1 + 1e-9)
    elif on.fits:
        judged(g, on, b)


def test_the_dp_offloads_blocks_where_the_link_is_idle() -> None:
    # the DP's own offloads (no combination): whole blocks copied during the forward pass
    g = tf3()
    b = budget(g, 0.5)
    dp_s, dp_peak, dp_host = judged(g, solve(0.5, True, combine=False), b)
    off_s, off_peak, _ = judged(g, solve(0.5, False), b)
    # +5.1% against +17.4% on this graph (+10.2% without the link cap: 0.94 of it)
    assert dp_s < off_s * 0.92
    assert (dp_peak, dp_host) == (1464195076, 781189120)
    assert off_peak == 1464260612
    # with the combination: plans for larger budgets offloaded down to this one, faster still
    on_s, on_peak, on_host = judged(g, solve(0.5, True), b)
    assert on_s < dp_s * 0.97  # +0.3% (+0.5% before combine searched below the reach's shares)
    assert (on_peak, on_host) == (1465505796, 861929472)


def test_reaches_a_budget_below_every_recompute_only_plan() -> None:
    g = _unrecomputable_chain()
    low = solver.get("hierarchical")(g, 1, offload=False)
    assert not low.fits and low.peak_bytes == 11534340
    b = low.peak_bytes - 1
    assert not solver.get("hierarchical")(g, b, offload=False).fits
    r = solver.get("hierarchical")(g, b)
    _, peak, host = judged(g, r, b)
    assert (peak, host) == (10485764, 1048576)
    assert offloads(r.plan) > 0


def test_the_host_budget_bounds_the_offloads() -> None:
    g = tf3()
    b = budget(g, 0.5)
    off = solve(0.5, False)
    # a host budget below every block's activations and every value's: no offload at all,
    # and the recompute-only plan itself
    tiny = _with_link(g, H100_SXM.link().model_copy(update={"host_memory_bytes": 1024}))
    r = solver.get("hierarchical")(tiny, b)
    judged(tiny, r, b)
    assert offloads(r.plan) == 0 and r.plan == off.plan
    # under half of what the DP's plan holds on the host without a host budget: the DP
    # offloads only the earliest blocks that fit there together, and still beats recompute only
    dp = solve(0.5, True, combine=False).figures
    assert dp is not None and dp.host_peak_bytes == 781189120
    cap = 299_139_072
    small = _with_link(g, g.link.model_copy(update={"host_memory_bytes": cap}))
    r = solver.get("hierarchical")(small, b, combine=False)
    t, _, host = judged(small, r, b)
    assert host == 132579328 and host <= cap
    assert t < (off.total_time_s or 0) * 0.99  # +14.6% against +17.4%


def test_without_a_host_link_nothing_changes() -> None:
    g = tf3()
    b = budget(g, 0.5)
    bare = _with_link(g, None)
    assert bare.device is not None and not bare.device.can_offload
    r = solver.get("hierarchical")(bare, b)
    assert offloads(r.plan) == 0
    assert r.plan == solve(0.5, False).plan  # offload=False on the linked graph: the same plan


def test_host_blocks_takes_the_earliest_that_fit_together() -> None:
    ch = chain_view(tf3())
    sizes = [st.all_bytes for st in ch.stages]
    assert host_blocks(ch, None) == [True] * len(sizes)
    assert host_blocks(ch, sum(sizes)) == [True] * len(sizes)
    ok = host_blocks(ch, sizes[0] + sizes[1])
    assert ok[:2] == [True, True]
    assert sum(s for s, k in zip(sizes, ok, strict=True) if k) <= sizes[0] + sizes[1]
    assert host_blocks(ch, 0) == [s == 0 for s in sizes]


def test_the_option_is_in_the_schema_and_checked() -> None:
    info = solver.info("hierarchical")
    assert {"offload", "combine"} <= set(info.options)
    field = HierarchicalOptions.model_fields["offload"]
    assert field.default is None and field.description and "host link" in field.description
    with pytest.raises(InvalidOptionError, match="'offload'"):
        solver.get("hierarchical")(tf3(), budget(tf3(), 0.5), offload=3)
