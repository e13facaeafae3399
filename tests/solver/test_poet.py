"""``poet``, the MILP of recomputation and paging per value, against the exhaustive offload
oracle on tiny graphs, and against ``milp`` without a host link."""

from __future__ import annotations

import pytest
from _graphs import random_step
from handmade import chain_step, diamond, residual_step
from offload_oracle import offload_oracle
from test_offload import _unrecomputable_chain, _with_link

from remat import solver
from remat.ir import HostLink, eager_plan, simulate
from remat.solver import InvalidOptionError


def _budgets(g):  # type: ignore[no-untyped-def]
    """Every budget from the eager peak down to what is always held, one float apart."""
    peak = simulate(g, eager_plan(g)).peak_bytes
    return range(peak, g.static_bytes + g.input_bytes - 1, -4)


@pytest.mark.parametrize("rate", [1e3, 1e12], ids=["slow-link", "fast-link"])
@pytest.mark.parametrize("ops", [2, 3])
@pytest.mark.parametrize("seed", range(6))
def test_poet_equals_the_exhaustive_offload_oracle(seed: int, ops: int, rate: float) -> None:
    link = HostLink(
        device_to_host_bytes_per_s=rate, host_to_device_bytes_per_s=rate, host_memory_bytes=64
    )
    g = _with_link(random_step(seed, ops), link)
    for b in _budgets(g):
        best = offload_oracle(g, b)
        r = solver.solve(g, b, solver="poet", time_limit_s=10)
        if best is None:
            assert not r.fits, (b, r.message)
            if not solver.solve(g, b, solver="milp", time_limit_s=10).fits:
                break  # below every plan of either class
            continue
        assert r.fits and r.plan is not None, (b, r.message)
        sim = simulate(g, r.plan)  # the simulator's figures are the ones reported
        assert r.total_time_s == pytest.approx(sim.total_time_s)
        assert sim.peak_bytes <= b and sim.host_peak_bytes <= 64
        assert r.total_time_s == pytest.approx(best, rel=1e-9), (b, r.message)


def test_poet_fits_below_the_recompute_only_floor() -> None:
    link = HostLink(
        device_to_host_bytes_per_s=1e12, host_to_device_bytes_per_s=1e12, host_memory_bytes=64
    )
    g = _with_link(random_step(0, 3), link)
    floor = solver.solve(g, 0.01, solver="milp").min_budget_bytes
    assert floor is not None
    r = solver.solve(g, floor - 4, solver="poet")
    assert r.fits and r.figures is not None and r.figures.offload_bytes > 0
    assert r.total_time_s == pytest.approx(offload_oracle(g, floor - 4), rel=1e-9)


def test_poet_offloads_what_cannot_be_recomputed() -> None:
    g = _unrecomputable_chain(4)
    budget = simulate(g, eager_plan(g)).peak_bytes - 2 * 2**20
    assert not solver.solve(g, budget, solver="milp").fits
    r = solver.solve(g, budget, solver="poet", time_limit_s=20)
    assert r.fits and r.figures is not None and r.figures.offload_bytes > 0, r.message


@pytest.mark.parametrize("make", [chain_step, diamond, residual_step, lambda: random_step(3, 3)])
def test_without_a_host_link_poet_is_milp(make) -> None:  # type: ignore[no-untyped-def]
    g = make()
    g = g if g.device is None else _with_link(g, None)
    for b in list(_budgets(g))[::3]:
        r = solver.solve(g, b, solver="poet")
        m = solver.solve(g, b, solver="milp")
        assert r.fits == m.fits, b
        if r.fits:
            assert r.total_time_s == pytest.approx(m.total_time_s, rel=1e-9), b
            assert r.figures is not None and r.figures.offload_bytes == 0


def test_offload_off_is_recompute_only() -> None:
    g = random_step(0, 3)
    b = solver.solve(g, 0.01, solver="milp").min_budget_bytes
    assert b is not None
    r = solver.solve(g, b, solver="poet", offload=False)
    assert r.fits and r.figures is not None and r.figures.offload_bytes == 0


def test_a_link_without_a_host_budget_pages_only_when_asked() -> None:
    # the rule auto and dtr follow: a link whose host memory is not stated is no default
    link = HostLink(device_to_host_bytes_per_s=1e12, host_to_device_bytes_per_s=1e12)
    g = _with_link(random_step(0, 3), link)
    floor = solver.solve(g, 0.01, solver="milp").min_budget_bytes
    assert floor is not None
    assert not solver.solve(g, floor - 4, solver="poet").fits
    r = solver.solve(g, floor - 4, solver="poet", offload=True)
    assert r.fits and r.figures is not None and r.figures.offload_bytes > 0


def test_a_graph_over_max_nodes_is_refused_naming_the_option() -> None:
    g = random_step(0, 3)
    with pytest.raises(ValueError, match="max_nodes=4"):
        solver.solve(g, "50%", solver="poet", max_nodes=4)


@pytest.mark.parametrize(
    "options", [{"max_nodes": 0}, {"max_nodes": 10**6}, {"offload": 1}, {"backend": "x"}]
)
def test_bad_options_are_named(options: dict[str, object]) -> None:
    with pytest.raises(InvalidOptionError) as err:
        solver.solve(random_step(0, 2), "50%", solver="poet", **options)
    assert err.value.option == next(iter(options))
