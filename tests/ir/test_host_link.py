"""The host link in the device profile and in the simulator: a copy stream per direction,
latency per copy, copies that hold the compute stream, host memory held and its budget."""

from __future__ import annotations

import json

import pytest
from handmade import offload_chain
from pydantic import ValidationError

from remat.ir import PROFILES, DeviceProfile, Graph, HostLink, Plan, PlanFigures, simulate
from remat.ir.devices import GH200, H100_SXM

OFFLOAD_PLAN = Plan.of(
    [
        ("compute", "f1"), ("compute", "f2"), ("offload", "a"), ("compute", "f3"),
        ("free", "b"), ("compute", "f5"), ("free", "c"), ("prefetch", "a"), ("compute", "f4"),
        ("free", "a"), ("free", "e"),
    ]
)  # fmt: skip


def _link(**kw: object) -> HostLink:
    args: dict[str, object] = {"device_to_host_bytes_per_s": 50, "host_to_device_bytes_per_s": 50}
    args.update(kw)
    return HostLink.model_validate(args)


def test_datasheet_links() -> None:
    for name, bw in (("h100", 64e9), ("h200", 64e9), ("a100", 32e9), ("gh200", 450e9)):
        link = PROFILES[name].link()
        assert link.device_to_host_bytes_per_s == bw == link.host_to_device_bytes_per_s
        assert link.overlaps_compute and PROFILES[name].can_offload
    assert GH200.link().host_memory_bytes == 480 * 10**9


def test_a_profile_without_a_link_reads_its_old_bandwidth_both_ways() -> None:
    old = H100_SXM.model_dump(mode="json")
    del old["host_link"]  # a profile written before the link existed
    p = DeviceProfile.model_validate(old)
    assert p.host_link is None and not p.can_offload
    link = p.link()
    assert link.device_to_host_bytes_per_s == 64e9 == link.host_to_device_bytes_per_s
    assert link.latency_s == 0 and link.host_memory_bytes is None


def test_graph_json_round_trips_the_link() -> None:
    g = offload_chain(f3_time_s=5.0).model_copy(update={"device": H100_SXM})
    back = Graph.model_validate_json(g.model_dump_json())
    assert back.device is not None and back.device.host_link == H100_SXM.host_link
    assert "host_link" in json.loads(g.model_dump_json())["device"]


def test_link_rates_must_agree_with_the_old_field() -> None:
    bad = H100_SXM.model_dump()
    bad["host_bandwidth_bytes_per_s"] = 1e9
    with pytest.raises(ValidationError, match=r"host_link\.device_to_host_bytes_per_s"):
        DeviceProfile.model_validate(bad)


def test_each_direction_has_its_own_stream_and_rate() -> None:
    g = offload_chain(f3_time_s=0.5)
    # offload at 100 B/s: 1..2; prefetch at 25 B/s on its own stream, from when the compute
    # stream reaches it (t=3.5, its host copy done since 2): 3.5..7.5
    sim = simulate(g, OFFLOAD_PLAN, link=_link(device_to_host_bytes_per_s=100,
                                               host_to_device_bytes_per_s=25))  # fmt: skip
    assert sim.device_to_host_busy_s == pytest.approx(1.0)
    assert sim.host_to_device_busy_s == pytest.approx(4.0)
    assert sim.stall_time_s == pytest.approx(4.0)  # f4 waits 3.5..7.5
    assert sim.total_time_s == pytest.approx(8.5)


def test_latency_is_paid_per_copy() -> None:
    g = offload_chain(f3_time_s=5.0)
    sim = simulate(g, OFFLOAD_PLAN, link=_link(latency_s=0.25))
    assert sim.device_to_host_busy_s == pytest.approx(2.25)
    assert sim.host_to_device_busy_s == pytest.approx(2.25)
    assert sim.transfer_time_s == pytest.approx(4.5)


def test_copies_that_do_not_overlap_hold_the_compute_stream() -> None:
    g = offload_chain(f3_time_s=5.0)
    sim = simulate(g, OFFLOAD_PLAN, link=_link(overlaps_compute=False))
    # 9 s of compute and 2 + 2 s of copies, one after the other
    assert sim.total_time_s == pytest.approx(13.0)
    assert sim.stall_time_s == pytest.approx(4.0)
    assert sim.compute_time_s == pytest.approx(9.0)


def test_host_peak_counts_offloaded_values_until_they_are_freed() -> None:
    g = offload_chain(f3_time_s=5.0)
    sim = simulate(g, OFFLOAD_PLAN, host_bandwidth_bytes_per_s=50)
    assert sim.host_peak_bytes == 100
    figures = PlanFigures.of(sim)
    assert figures.host_peak_bytes == 100 and figures.device_to_host_busy_s == pytest.approx(2)


def test_old_figures_json_still_reads() -> None:
    sim = simulate(offload_chain(f3_time_s=5.0), OFFLOAD_PLAN, host_bandwidth_bytes_per_s=50)
    old = PlanFigures.of(sim).model_dump()
    for k in ("prefetch_bytes", "device_to_host_busy_s", "host_to_device_busy_s",
              "host_peak_bytes"):  # fmt: skip
        del old[k]
    assert PlanFigures.model_validate(old).host_peak_bytes == 0


def test_a_plan_over_the_host_budget_does_not_fit() -> None:
    from remat.solver import Problem

    small = H100_SXM.model_copy(
        update={"host_link": H100_SXM.link().model_copy(update={"host_memory_bytes": 99})}
    )
    g = offload_chain(f3_time_s=5.0).model_copy(update={"device": small})
    problem = Problem.build(g, 10**6)
    r = problem.result(OFFLOAD_PLAN, solver="by-hand", started=0.0)
    assert r.status == "infeasible" and not r.fits
    assert "host_memory_bytes" in r.message and r.min_budget_bytes is None
    roomy = g.model_copy(update={"device": H100_SXM})
    assert Problem.build(roomy, 10**6).result(OFFLOAD_PLAN, solver="x", started=0.0).fits
