"""The simulator against numbers worked out by hand (see each graph's docstring in handmade.py)."""

from __future__ import annotations

import math

import pytest
from handmade import chain_step, diamond, offload_chain, residual_step

from remat.ir import InvalidPlanError, Plan, eager_plan, simulate


def test_chain_eager_by_hand() -> None:
    g = chain_step()
    plan = eager_plan(g)
    assert [str(s) for s in plan.steps] == [
        "compute(f1)", "compute(f2)", "compute(loss)", "compute(bL)", "free(a2)",
        "compute(b2)", "free(a1)", "free(g2)", "compute(b1)", "free(g1)",
    ]  # fmt: skip
    sim = simulate(g, plan)
    # x=10 held from the start. f1 +a1=30, f2 +a2=60, loss +L=61, bL +g2=91, free a2 61,
    # b2 +g1=81 (gw2 is static), free a1 61, free g2 31, b1 31 (gw1 static), free g1 11.
    assert sim.timeline_bytes == [30, 60, 61, 91, 61, 81, 61, 31, 31, 11]
    assert sim.peak_dynamic_bytes == 91
    assert sim.peak_step == 3
    assert sim.peak_bytes == 191  # + static 100
    assert sim.final_dynamic_bytes == 11  # x and L remain
    # 1 + 2 + 0.5 + 0.5 + 4 + 2
    assert sim.total_time_s == pytest.approx(10.0)
    assert sim.compute_time_s == pytest.approx(10.0)
    assert sim.recompute_time_s == 0 and sim.num_recomputes == 0
    assert sim.stall_time_s == 0 and sim.transfer_time_s == 0


def test_chain_with_recomputation_by_hand() -> None:
    g = chain_step()
    plan = Plan.of(
        [
            ("compute", "f1"), ("compute", "f2"), ("free", "a1"), ("compute", "loss"),
            ("compute", "bL"), ("free", "a2"), ("compute", "f1"), ("compute", "b2"),
            ("free", "a1"), ("free", "g2"), ("compute", "b1"), ("free", "g1"),
        ]
    )  # fmt: skip
    sim = simulate(g, plan)
    # f1 30, f2 60, free a1 40, loss 41, bL +g2 71, free a2 41, f1 again +a1 61, b2 +g1 81,
    # free a1 61, free g2 31, b1 31, free g1 11.
    assert sim.timeline_bytes == [30, 60, 40, 41, 71, 41, 61, 81, 61, 31, 31, 11]
    assert sim.peak_dynamic_bytes == 81  # 10 below eager: a1 is not held across bL
    assert sim.total_time_s == pytest.approx(11.0)  # eager 10 + one more f1
    assert sim.recompute_time_s == pytest.approx(1.0)
    assert sim.num_recomputes == 1 and sim.num_computes == 7


def test_diamond_workspace_by_hand() -> None:
    g = diamond()
    sim = simulate(g, eager_plan(g))
    # f1 10+20=30, f2 +30=60, f3 +40 and 50 B of scratch while it runs = 150 (100 after),
    # free a 80, f4 +5 85, free b 55, free c 15, loss +1 16, free d 11.
    assert sim.timeline_bytes == [30, 60, 150, 80, 85, 55, 15, 16, 11]
    assert sim.peak_dynamic_bytes == 150 and sim.peak_step == 2
    assert sim.total_time_s == pytest.approx(6.0)


def test_residual_eager_by_hand() -> None:
    g = residual_step()
    sim = simulate(g, eager_plan(g))
    # x 8. f1 +h16=24, f2 +u32=56, add +y16=72, free u 40, loss +L4 44, bL +gy16 60,
    # free y 44, badd +gu32 +gh_a16 92, free gy 76, b2 +gh_b16 92, free h 76, free gu 44,
    # acc +gh16 60, free gh_a 44, free gh_b 28, b1 28, free gh 12.
    assert sim.timeline_bytes == [
        24,
        56,
        72,
        40,
        44,
        60,
        44,
        92,
        76,
        92,
        76,
        44,
        60,
        44,
        28,
        28,
        12,
    ]
    assert sim.peak_dynamic_bytes == 92 and sim.peak_step == 7
    assert sim.peak_bytes == 108
    # 1 + 2 + 0.5 + 0.5 + 0.5 + 0.5 + 4 + 0.5 + 2
    assert sim.total_time_s == pytest.approx(11.5)


OFFLOAD_PLAN = Plan.of(
    [
        ("compute", "f1"), ("compute", "f2"), ("offload", "a"), ("compute", "f3"),
        ("free", "b"), ("compute", "f5"), ("free", "c"), ("prefetch", "a"), ("compute", "f4"),
        ("free", "a"), ("free", "e"),
    ]
)  # fmt: skip


def test_offload_that_overlaps_by_hand() -> None:
    g = offload_chain(f3_time_s=5.0)
    sim = simulate(g, OFFLOAD_PLAN, host_bandwidth_bytes_per_s=50)
    # a (100 B) is ready at t=1; its offload runs 1..3 on the copy stream while f2, f3 compute.
    # f1 110, f2 120, offload issued 120 (copy not done), f3 (t=2..7) +c 170,
    # free b: the copy finished at 3 <= 7 so a is gone (70), minus b = 60; f5 +e 120 (t=8),
    # free c 70, prefetch a +100 170 (issued at t=8, when the compute stream reaches it: its
    # buffer is allocated there; copy 8..10), f4 waits for it (a 2 s stall) and runs 10..11
    # +L 171, free a 71, free e 11.
    assert sim.timeline_bytes == [110, 120, 120, 170, 60, 120, 70, 170, 171, 71, 11]
    assert sim.peak_dynamic_bytes == 171
    assert sim.stall_time_s == pytest.approx(2.0)
    assert sim.total_time_s == pytest.approx(11.0)
    assert sim.transfer_time_s == pytest.approx(4.0)  # 100 B each way at 50 B/s
    assert sim.offload_bytes == 100 and sim.prefetch_bytes == 100
    # Without the offload the step peaks at 220 (f5 with a, c, e live): the offload saves 49 B.
    assert simulate(g, eager_plan(g)).peak_dynamic_bytes == 220


def test_offload_that_stalls_by_hand() -> None:
    g = offload_chain(f3_time_s=0.5)
    sim = simulate(g, OFFLOAD_PLAN, host_bandwidth_bytes_per_s=50)
    # Offload of a runs 1..3. f3 ends at 2.5, so a is still held when b is freed (160) and when
    # f5 runs (t=2.5..3.5: 220). free c at t=3.5 sees the copy done: 70 after freeing c.
    # prefetch a, issued at 3.5 (its host copy is done since 3), copies 3.5..5.5; f4 waits
    # from 3.5 to 5.5: a 2 s stall; ends at 6.5.
    assert sim.timeline_bytes == [110, 120, 120, 170, 160, 220, 70, 170, 171, 71, 11]
    assert sim.peak_dynamic_bytes == 220 and sim.peak_step == 5
    assert sim.stall_time_s == pytest.approx(2.0)
    assert sim.total_time_s == pytest.approx(6.5)


def test_infinite_bandwidth_makes_transfers_free() -> None:
    g = offload_chain(f3_time_s=0.5)
    sim = simulate(g, OFFLOAD_PLAN, host_bandwidth_bytes_per_s=math.inf)
    assert sim.stall_time_s == 0 and sim.transfer_time_s == 0
    assert sim.total_time_s == pytest.approx(4.5)


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ([("compute", "f2")], "reads value 'a1', which is not on the device"),
        ([("compute", "f1"), ("free", "a2")], "frees value 'a2', which is not on the device"),
        ([("compute", "f1"), ("free", "a1"), ("free", "a1")], "frees value 'a1'"),
        (
            [("compute", "f1"), ("prefetch", "a1")],
            "prefetches value 'a1', which was never offloaded",
        ),
        ([("compute", "nope")], "unknown node 'nope'"),
        ([("free", "ghost")], "unknown value 'ghost'"),
        ([("free", "x")], "input held by the caller"),
        ([("free", "w1")], "is static"),
        (
            [("compute", "f1"), ("offload", "a1"), ("compute", "f2")],
            "reads value 'a1', which is being offloaded",
        ),
    ],
)
def test_invalid_steps_name_the_step_and_id(steps: list[tuple[str, str]], message: str) -> None:
    g = chain_step()
    with pytest.raises(InvalidPlanError, match=message) as info:
        simulate(g, Plan.of(steps))
    assert info.value.step == len(steps) - 1
    assert f"step {len(steps) - 1}" in str(info.value)


def test_plan_must_end_with_required_values() -> None:
    g = chain_step()
    steps = [s for s in eager_plan(g).steps]
    with pytest.raises(InvalidPlanError, match="without required value 'gw1'"):
        simulate(g, Plan(steps=tuple(steps[:-2])))  # b1 never runs
    with pytest.raises(InvalidPlanError, match="without required value 'L'"):
        simulate(g, Plan(steps=(*steps, Plan.of([("free", "L")]).steps[0])))


def test_side_effecting_node_runs_exactly_once() -> None:
    g = diamond().model_copy()
    from remat.ir import Graph

    data = g.model_dump()
    data["nodes"][1]["recomputable"] = False
    g2 = Graph.from_dict(data)
    with pytest.raises(InvalidPlanError, match="side effects"):
        simulate(
            g2, Plan.of([("compute", "f1"), ("compute", "f2"), ("free", "b"), ("compute", "f2")])
        )
    with pytest.raises(InvalidPlanError, match="never ran"):
        simulate(g2, Plan.of([("compute", "f1"), ("compute", "f3"), ("free", "a")]))


def test_alive_at_step_names_what_holds_the_memory() -> None:
    # The stalling offload above: at its peak (step 5, f5 running) x, a (copy not finished),
    # c and e are held: 10 + 100 + 50 + 60 = 220 by hand (offload_chain's sizes).
    g = offload_chain(f3_time_s=0.5)
    sim = simulate(g, OFFLOAD_PLAN, host_bandwidth_bytes_per_s=50, alive_at_step=5)
    assert sorted(sim.alive_value_ids) == ["a", "c", "e", "x"]
    # With the copy done in time (overlapping case) a is gone by step 5.
    g = offload_chain(f3_time_s=5.0)
    sim = simulate(g, OFFLOAD_PLAN, host_bandwidth_bytes_per_s=50, alive_at_step=5)
    assert sorted(sim.alive_value_ids) == ["c", "e", "x"]
    # Every step: the sizes alive plus the running node's workspace are the timeline reading.
    for graph, plan in ((diamond(), eager_plan(diamond())), (g, OFFLOAD_PLAN)):
        full = simulate(graph, plan, host_bandwidth_bytes_per_s=50)
        for i in range(len(plan)):
            s = simulate(graph, plan, host_bandwidth_bytes_per_s=50, alive_at_step=i)
            held = sum(graph.value(v).size_bytes for v in s.alive_value_ids)
            assert held + s.alive_workspace_bytes == full.timeline_bytes[i], i
    assert simulate(diamond(), eager_plan(diamond()), alive_at_step=2).alive_workspace_bytes == 50
    assert simulate(diamond(), eager_plan(diamond())).alive_value_ids == ()
