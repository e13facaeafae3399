"""``dtr`` evicting to the host inside its loop (Capuchin-style): the plans fit when the
simulator judges them, beat dropping and recomputing where the link is fast, and are unchanged
where there is no link to use."""

from __future__ import annotations

import pytest

import remat.solver.dtr as dtr
from remat import solver
from remat.ir import Graph, HostLink, eager_plan, simulate
from remat.ir.synthetic import chain, random_layered_dag, transformer


def _with_link(g: Graph, link: HostLink | None) -> Graph:
    assert g.device is not None
    dev = g.device.model_copy(update={"host_link": link})
    return g.model_copy(update={"device": dev})


FAST = HostLink(
    device_to_host_bytes_per_s=64e9,
    host_to_device_bytes_per_s=64e9,
    latency_s=1e-5,
    host_memory_bytes=10**12,
)


def _budget(g: Graph, frac: float) -> int:
    peak = simulate(g, eager_plan(g)).peak_bytes
    return int(g.static_bytes + frac * (peak - g.static_bytes))


@pytest.mark.parametrize(
    ("make", "frac"),
    [
        (lambda: chain(32), 0.3),
        (lambda: chain(32), 0.15),
        (lambda: transformer(8), 0.3),
    ],
    ids=["chain-30%", "chain-15%", "transformer-30%"],
)
def test_evicting_to_the_host_beats_dropping_on_a_fast_link(make, frac: float) -> None:  # type: ignore[no-untyped-def]
    g = _with_link(make(), FAST)
    b = _budget(g, frac)
    off = solver.solve(g, b, solver="dtr", offload=False)
    on = solver.solve(g, b, solver="dtr")  # default: on, the device has a host link
    assert off.fits and on.fits and on.plan is not None
    assert on.total_time_s is not None and off.total_time_s is not None
    # at least 2% faster (chain at 30%: 3.6%, where the copies brought back as late as their
    # read leaves no room for them before it stall the compute stream)
    assert on.total_time_s < off.total_time_s * 0.98, (on.overhead, off.overhead)
    assert any(s.op == "offload" for s in on.plan.steps)
    sim = simulate(g, on.plan)  # judged again: within both budgets
    assert sim.peak_bytes <= b and sim.host_peak_bytes <= 10**12
    # the loop itself, without the post-pass on plans for larger budgets, beats dropping
    plan, ok = dtr.dtr_plan(g, b - g.static_bytes, to_host="far")
    loop = simulate(g, plan)
    assert ok and loop.peak_bytes <= b and loop.offload_bytes > 0
    assert loop.total_time_s < off.total_time_s


def test_without_a_host_link_the_plans_are_recompute_only_as_before() -> None:
    g = _with_link(chain(16), None)
    for frac in (0.5, 0.3):
        b = _budget(g, frac)
        default = solver.solve(g, b, solver="dtr")
        assert default.plan == solver.solve(g, b, solver="dtr", offload=False).plan
        assert default.plan is not None and all(s.op != "offload" for s in default.plan.steps)


def test_no_eviction_to_the_host_where_copies_hold_the_compute_stream() -> None:
    g = _with_link(chain(16), FAST.model_copy(update={"overlaps_compute": False}))
    b = _budget(g, 0.3)
    r = solver.solve(g, b, solver="dtr")
    assert r.fits and r.plan is not None
    assert all(s.op != "offload" for s in r.plan.steps)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("frac", [0.6, 0.45])
def test_host_evicting_plans_are_valid_and_stay_within_a_small_host_budget(
    seed: int, frac: float
) -> None:
    g = random_layered_dag(60, seed=seed)
    host = 3 * sorted(v.size_bytes for v in g.values)[len(g.values) // 2]  # three values
    g = _with_link(g, FAST.model_copy(update={"host_memory_bytes": host}))
    b = _budget(g, frac)
    for order in ("far", "score"):
        try:
            plan, ok = dtr.dtr_plan(g, b - g.static_bytes, to_host=order)  # type: ignore[arg-type]
        except dtr.Thrashing:  # one run at the budget itself may thrash; solve bisects
            continue
        sim = simulate(g, plan)  # raises on an invalid plan
        assert sim.host_peak_bytes <= host
        assert not ok or sim.peak_bytes <= b
    on, off = (solver.solve(g, b, solver="dtr", offload=o) for o in (True, False))
    assert off.fits <= on.fits  # never loses a plan, never slower
    assert not off.fits or (on.total_time_s or 0.0) <= (off.total_time_s or 0.0) * (1 + 1e-9)


def test_auto_is_never_slower_than_dtr_evicting_to_the_host() -> None:
    g = _with_link(chain(32), FAST)
    b = _budget(g, 0.3)
    d = solver.solve(g, b, solver="dtr", combine=False)
    # 10 s: alone auto stops within gap_tolerance of its bound in about 0.5 s (dtr's host plan);
    # with 2 s, auto's shares run dtr's host eviction last, and under the suite's load the
    # recompute-only methods took all of it
    r = solver.solve(g, b, time_limit_s=10)
    assert d.fits and r.fits and d.total_time_s is not None and r.total_time_s is not None
    assert r.total_time_s <= d.total_time_s * (1 + 1e-9), r.message
