"""Time limits that hold, tested without wall-clock thresholds: deadlines on an injected
clock that advances per reading (counted work), and the work caps that keep solves small."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from remat.ir import Graph, eager_plan, simulate
from remat.ir.chain import chain_view
from remat.ir.synthetic import transformer
from remat.solver.chain_dp import ChainArrays, rotor_table, stage_cap
from remat.solver.deadline import Deadline, Expired
from remat.solver.problem import Problem
from remat.solver.rotor import rotor_within


def frac_budget(g: Graph, frac: float) -> int:
    return g.static_bytes + int(frac * simulate(g, eager_plan(g)).peak_dynamic_bytes)


class CountingClock:
    """Advances one unit per reading; counts the readings."""

    def __init__(self) -> None:
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return float(self.reads)


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
    asked: list[int | None] = []
    real = rotor.chain_view

    def spy(graph: Graph, **kw: object) -> object:
        asked.append(kw.get("max_stages"))  # type: ignore[arg-type]
        return real(graph, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(rotor, "chain_view", spy)
    # the full chain's DP is slow: by its sixth reading 60 of the 100 s are gone (past its
    # half-share); after that time passes slowly and the halved chain's DP finishes
    readings = itertools.count()

    def clock() -> float:
        k = next(readings)
        return float(k) if k < 6 else 60.0 + 0.01 * k

    r = rotor_within(Problem.build(g, b), Deadline(at=100.0, clock=clock), cuts="blocks")
    assert asked[-1] == 6  # 12 stages, then 6
    assert r.status == "feasible" and r.plan is not None
    assert simulate(g, r.plan).peak_bytes <= b


def test_stage_cap_is_counted_work() -> None:
    assert stage_cap(500) >= 192  # the 192-layer transformer's chain is not merged
    assert stage_cap(500, work=1e6) < stage_cap(500)
    L = stage_cap(500)
    assert L**3 / 6 * 501 <= 1e9 * 1.05


def test_mip_start_scan_checks_its_deadline_and_matches_a_plain_scan() -> None:
    from remat.solver.checkmate import CheckmateModel, is_var
    from remat.solver.deadline import Deadline as D

    g = transformer(1, d_model=16, seq_len=8, batch_size=2, vocab_size=32, num_heads=2)
    b = frac_budget(g, 0.8)
    cm = CheckmateModel.build(g, b)
    plan = eager_plan(g)
    start = cm.start_from_plan(plan)
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
        cm.start_from_plan(plan, deadline=D(at=0.0, clock=CountingClock()))


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
        r = get("milp")(g, b, time_limit_s=5)
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
