"""Time limits that hold, tested without wall-clock thresholds: deadlines on an injected
clock that advances per reading (counted work), and the work caps that keep solves small."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from _clocks import CountingClock

from remat.ir import Graph, eager_plan, simulate
from remat.ir.chain import Chain, chain_view
from remat.ir.synthetic import transformer
from remat.solver.chain_dp import ChainArrays, dp_cells, rotor_table
from remat.solver.deadline import Deadline, Expired
from remat.solver.problem import Problem
from remat.solver.rotor import dp_chain, rotor_within


def frac_budget(g: Graph, frac: float) -> int:
    return g.static_bytes + int(frac * simulate(g, eager_plan(g)).peak_dynamic_bytes)


def test_deadline_share_and_check() -> None:
    clock = CountingClock()
    d = Deadline.after(10.0, clock)  # read 1: at = 11
    assert not d.expired()  # read 2
    half = d.share(0.5)  # read 3: now 3, left 8 -> at 7
    assert half.at == pytest.approx(7.0)
    assert d.earlier(half) is half and half.earlier(Deadline(None)) is half
    with pytest.raises(Expired, match="the step"):
        Deadline(at=0.0, clock=clock).check("the step")
    assert Deadline.after(None).left_s() == float("inf")


def test_rotor_dp_checks_its_deadline_once_per_subchain_end() -> None:
    g = transformer(6)
    ch = chain_view(g, cuts="blocks")
    arr = ChainArrays.of(ch, simulate(g, eager_plan(g)).peak_dynamic_bytes / 100)
    clock = CountingClock()
    with pytest.raises(Expired):
        rotor_table(arr, 100, deadline=Deadline(at=4.5, clock=clock))
    assert clock.reads == 5  # once up front, then t = 2..5; t = 5 found it past
    full = rotor_table(arr, 100, deadline=Deadline(at=1e9, clock=CountingClock()))
    assert np.isfinite(full.cost[0, ch.num_stages, 100])


def test_rotor_returns_when_its_deadline_has_passed() -> None:
    g = transformer(8)
    b = frac_budget(g, 0.5)
    clock = CountingClock()
    r = rotor_within(Problem.build(g, b), Deadline(at=0.0, clock=clock))
    # no DP could finish: the halving stops at two stages, and no plan is claimed
    assert r.status == "timeout" and r.plan is None
    assert clock.reads < 200  # every DP gave up at its first check


def test_rotor_coarsens_the_chain_when_the_dp_runs_out(monkeypatch: pytest.MonkeyPatch) -> None:
    import remat.solver.rotor as rotor

    g = transformer(8)
    b = frac_budget(g, 0.5)
    asked: list[int] = []
    real = rotor.coarser

    def spy(ch: Chain) -> Chain:
        asked.append(ch.num_stages)
        out = real(ch)
        asked.append(out.num_stages)
        return out

    monkeypatch.setattr(rotor, "coarser", spy)
    # the full chain's DP is slow: by its sixth reading 60 of the 100 s are gone (past its
    # half-share); after that time passes slowly and the halved chain's DP finishes
    readings = itertools.count()

    def clock() -> float:
        k = next(readings)
        return float(k) if k < 6 else 60.0 + 0.01 * k

    r = rotor_within(Problem.build(g, b), Deadline(at=100.0, clock=clock), cuts="blocks")
    assert asked == [12, 6]  # 12 stages, then every other cut
    assert r.status == "feasible" and r.plan is not None
    assert simulate(g, r.plan).peak_bytes <= b


def test_the_dp_chain_is_picked_by_counted_work() -> None:
    g = transformer(48)
    slot = simulate(g, eager_plan(g)).peak_dynamic_bytes / 500
    own = chain_view(g, cuts="blocks")
    arr = ChainArrays.of(own, slot)
    cells = dp_cells(arr, 500)
    assert cells == rotor_table(arr, 500).split_cells  # counted before filling, exactly
    assert dp_chain(g, "blocks", slot, 500).num_stages == own.num_stages  # within the limit
    small = dp_chain(g, "blocks", slot, 500, work=cells / 10)
    assert small.num_stages < own.num_stages
    assert dp_cells(ChainArrays.of(small, slot), 500) <= cells / 10
    # merged in equal groups: the repeated layers stay repeated stages
    inner = [(s.forward_time_s, s.all_bytes) for s in small.stages[2:-2]]
    assert len(set(inner)) <= 2
    assert dp_chain(g, "blocks", slot, 500, max_stages=7).num_stages == 7


def test_mip_start_scan_checks_its_deadline_and_matches_a_plain_scan() -> None:
    from remat.solver.checkmate import CheckmateModel, is_var
    from remat.solver.checkmate_plans import start_from_plan
    from remat.solver.deadline import Deadline as D

    g = transformer(1, d_model=16, seq_len=8, batch_size=2, vocab_size=32, num_heads=2)
    b = frac_budget(g, 0.8)
    cm = CheckmateModel.build(g, b)
    plan = eager_plan(g)
    start = start_from_plan(cm, plan)
    assert start is not None
    # the plain reading of the same plan: every S entry takes the residency at its stage
    resident: set[str] = set()
    want: dict[int, float] = {}
    frontier = 0
    for step in plan.steps:
        if step.op == "free":
            resident.discard(step.id)
            continue
        k = g.node_position(step.id)
        for (t, v), ref in cm.vars.S.items():
            if t == frontier and is_var(ref):
                want.setdefault(ref[0], 1.0 if v in resident else 0.0)
        frontier += k == frontier
        resident.update(cm.index.outs[k])
    assert {c: start[c] for c in want} == want
    with pytest.raises(Expired):
        start_from_plan(cm, plan, deadline=D(at=0.0, clock=CountingClock()))


def test_milp_and_lp_round_return_when_the_deadline_passed_while_building() -> None:
    from remat.solver import get
    from remat.solver.milp import run_checkmate

    g = transformer(2)
    b = frac_budget(g, 0.5)
    with pytest.raises(Expired):
        run_checkmate(g, b, deadline=Deadline(at=0.0, clock=CountingClock()))
    # through the registry the same expiry is a result, never an exception
    import remat.solver.milp as milp_mod

    def expired(*a: object, **k: object) -> object:
        raise Expired("building the MILP ran past its deadline")

    mp = pytest.MonkeyPatch()
    mp.setattr(milp_mod, "run_checkmate", expired)
    try:
        # at 70%: at 50% the relaxation proves first that no plan fits (and milp says so)
        r = get("milp")(g, frac_budget(g, 0.7), time_limit_s=5)
    finally:
        mp.undo()
    assert r.status in ("feasible", "timeout")
    assert "time" in r.message


def test_highs_is_interrupted_by_the_deadline_clock() -> None:
    from remat.solver.milp import run_checkmate

    g = transformer(4)
    b = frac_budget(g, 0.5)  # left alone, HiGHS reads the clock about 165 times to optimality
    clock = CountingClock()
    run = run_checkmate(g, b, deadline=Deadline(at=40.0, clock=clock))
    assert run.solution is not None and run.solution.status in ("feasible", "timeout")
    assert clock.reads <= 60  # stopped right after the deadline passed
