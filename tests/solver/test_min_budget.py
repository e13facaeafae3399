"""``min_budget_bytes``: the smallest peak any method found, never above a known plan, with a
proven lower bound beside it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

import remat
from remat.ir import InvalidPlanError, eager_plan, keep_plan, resolve_budget, simulate
from remat.ir.synthetic import chain, random_layered_dag, unet
from remat.solver import get, known
from remat.solver.minbudget import squeeze


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), nodes=st.integers(1, 12), picks=st.integers(0, 2**12))
def test_lower_bound_is_below_every_plan(seed, nodes, picks) -> None:
    g = random_layered_dag(nodes, seed=seed)
    low = known.min_budget_lower_bytes(g)
    assert low <= simulate(g, eager_plan(g)).peak_bytes
    fwd = [o for n in g.nodes if n.phase == "forward" for o in n.outputs]
    keep = [v for i, v in enumerate(fwd) if picks >> (i % 12) & 1]
    try:
        plan = keep_plan(g, keep)
    except InvalidPlanError:
        return
    assert low <= simulate(g, plan).peak_bytes


def test_lower_bound_counts_the_largest_working_set() -> None:
    g = chain(4)
    static = g.static_bytes
    inputs = sum(v.size_bytes for v in g.values if v.kind == "input" and not g.is_static(v.id))
    biggest = max(
        sum(
            g.value(x).size_bytes
            for x in {*n.inputs, *n.outputs}
            if not g.is_static(x) and g.value(x).kind != "input"
        )
        + n.workspace_bytes
        for n in g.nodes
    )
    assert known.min_budget_lower_bytes(g) >= static + inputs + biggest


def test_every_result_records_its_plan_and_the_smallest_wins() -> None:
    known.forget()
    g = chain(10)
    big = get("none")(g, 10**12)
    assert known.smallest(g).peak_bytes == big.peak_bytes
    small = get("checkpoint-all")(g, 10**12)
    assert small.peak_bytes < big.peak_bytes
    assert known.smallest(g).peak_bytes == small.peak_bytes
    get("none")(g, 10**12)  # a larger plan later changes nothing
    assert known.smallest(g).peak_bytes == small.peak_bytes


def test_an_infeasible_frontier_point_reports_a_plan_found_at_another_budget() -> None:
    """The issue's false minimum: a plan found at 50% must bound what 30% reports."""
    known.forget()
    g = unet(2, base_channels=8, image_size=32, batch_size=2)
    fr = remat.frontier(g, [0.05, 0.5, 0.9], solver="chen-greedy", fill_time_s=0)
    peaks = [r.peak_bytes for r in fr.results if r.plan is not None]
    low = fr.results[0]
    assert low.status == "infeasible"
    assert low.min_budget_bytes == fr.min_budget_bytes == min(peaks)
    assert low.plan is not None and simulate(g, low.plan).peak_bytes == low.min_budget_bytes
    assert fr.min_budget_lower_bytes <= low.min_budget_bytes


def test_squeeze_never_reports_more_than_a_known_plan_and_counts_its_work() -> None:
    known.forget()
    g = random_layered_dag(40, seed=7)
    b = resolve_budget(g, 0.05)
    get("none")(g, b)  # the only plan known: eager
    eager_peak = known.smallest(g).peak_bytes
    calls: list[int] = []
    ticks = iter(range(10**6))

    def counted(name):
        def run(graph, budget_bytes, *, time_limit_s=None):
            calls.append(budget_bytes)
            # squeeze's limits are in the test clock's ticks; each solve gets 2 real seconds
            # at most (it ran auto's 60 s default and took two minutes on 2 cores)
            return get(name)(graph, budget_bytes, time_limit_s=min(time_limit_s or 2.0, 2.0))

        return run

    import remat.solver.minbudget as mb

    real = mb.get
    mb.get = counted
    try:
        got = squeeze(g, b, time_limit_s=50, clock=lambda: float(next(ticks)))
    finally:
        mb.get = real
    assert got is not None and got.peak_bytes <= eager_peak
    assert got.peak_bytes >= known.min_budget_lower_bytes(g)
    assert simulate(g, got.plan).peak_bytes == got.peak_bytes
    assert 0 < len(calls) <= 50  # one clock tick per reading bounds the work
    assert all(c >= b for c in calls)


def test_auto_infeasible_reports_the_smallest_known_plan_and_a_lower_bound() -> None:
    """The issue's false minimum, on a U-Net: a plan found at a larger budget bounds what a
    budget no method reaches reports, whatever that solve finds itself."""
    known.forget()
    g = unet(3, base_channels=8, image_size=32, batch_size=2)
    roomy = get("lp-round")(g, resolve_budget(g, 0.5), time_limit_s=5)
    assert roomy.plan is not None
    r = get("auto")(g, resolve_budget(g, 0.02), time_limit_s=2)
    assert r.status == "infeasible" and r.plan is not None
    assert r.min_budget_bytes is not None and r.min_budget_bytes <= roomy.peak_bytes
    assert r.min_budget_bytes == simulate(g, r.plan).peak_bytes == known.smallest(g).peak_bytes
    assert r.min_budget_lower_bytes == known.min_budget_lower_bytes(g) <= r.min_budget_bytes
    assert str(r.min_budget_lower_bytes) in r.message


def test_resnet_example_minimum_budget_is_never_above_a_plan_found_at_50_percent(
    remat_cache_dir,
) -> None:
    import pytest

    pytest.importorskip("torch")
    from examples.models import build_resnet
    from remat.tracer import trace

    known.forget()
    g = trace(*build_resnet(batch=2, image=16, width=8, blocks_per_stage=1, stages=2))
    at50 = get("auto")(g, resolve_budget(g, 0.5), time_limit_s=3)
    at30 = get("auto")(g, resolve_budget(g, 0.3), time_limit_s=3)
    assert at50.plan is not None
    if at30.status == "infeasible":
        assert at30.min_budget_bytes is not None and at30.min_budget_bytes <= at50.peak_bytes
        assert at30.min_budget_lower_bytes is not None
        assert at30.min_budget_lower_bytes <= at30.min_budget_bytes
