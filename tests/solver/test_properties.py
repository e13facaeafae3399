"""Property tests on random small steps and chains (fixed, derandomized hypothesis profile).

* the MILP equals the exhaustive oracle (same schedule class: Checkmate's stages);
* on chains: milp <= rotor <= checkpoint-all (when they fit), pofo <= rotor with free transfers;
* every plan of every solver fits its budget when it says it does;
* lowering the budget never lowers the optimal time.
"""

from __future__ import annotations

import math

import pytest
from _graphs import random_step
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import oracle

from remat import solver
from remat.ir import Graph, eager_plan, simulate
from remat.ir.synthetic import chain

FRACS = st.sampled_from([1.0, 0.9, 0.8, 0.7, 0.6, 0.5])


def frac_budget(g: Graph, frac: float) -> int:
    return g.static_bytes + int(frac * simulate(g, eager_plan(g)).peak_dynamic_bytes)


@settings(max_examples=20)
@given(seed=st.integers(0, 10**6), ops=st.integers(2, 4), frac=FRACS)
def test_milp_equals_the_oracle(seed: int, ops: int, frac: float) -> None:
    g = random_step(seed, ops)
    b = frac_budget(g, frac)
    o = oracle(g, b)
    r = solver.get("milp")(g, b, time_limit_s=20)
    if o is None:
        assert r.status == "infeasible"
        return
    sim = simulate(g, o.plan)
    assert sim.peak_bytes <= b and sim.total_time_s == pytest.approx(o.time_s, rel=1e-12)
    assert r.status == "optimal"
    assert r.total_time_s == pytest.approx(o.time_s, rel=1e-7)


@settings(max_examples=10)
@given(seed=st.integers(0, 10**6), stages=st.integers(1, 2), frac=FRACS)
def test_chain_ordering(seed: int, stages: int, frac: float) -> None:
    g = chain(stages, heterogeneous=True, seed=seed, batch_size=4, width=16)
    b = frac_budget(g, frac)
    m = solver.get("milp")(g, b, time_limit_s=20)
    rot = solver.get("rotor")(g, b)
    ck = solver.get("checkpoint-all")(g, b)
    pof = solver.get("pofo")(g, b, host_bandwidth_bytes_per_s=math.inf)
    if rot.status == "feasible":
        assert m.status == "optimal"
        assert (m.total_time_s or 0) <= (rot.total_time_s or 0) * (1 + 1e-7)
        assert pof.status == "feasible"
        assert (pof.total_time_s or 0) <= (rot.total_time_s or 0) * (1 + 1e-9)
    if ck.status == "feasible":
        assert rot.status == "feasible"
        assert (rot.total_time_s or 0) <= (ck.total_time_s or 0) * (1 + 1e-9)


MINE = ("milp", "lp-round", "rotor", "revolve", "pofo", "auto")


@settings(max_examples=8)
@given(seed=st.integers(0, 10**6), frac=FRACS)
def test_every_plan_fits_its_budget(seed: int, frac: float) -> None:
    g = random_step(seed, 4)
    b = frac_budget(g, frac)
    for name in MINE:
        r = solver.get(name)(g, b, time_limit_s=20)
        if r.status in ("optimal", "feasible"):
            assert r.plan is not None
            sim = simulate(g, r.plan)
            assert sim.peak_bytes <= b, name


@settings(max_examples=8)
@given(seed=st.integers(0, 10**6))
def test_lower_budget_never_lowers_the_optimal_time(seed: int) -> None:
    g = random_step(seed, 3)
    last = -1.0
    for frac in (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4):
        r = solver.get("milp")(g, frac_budget(g, frac), time_limit_s=20)
        if r.status != "optimal":
            assert r.status == "infeasible"
            break
        assert (r.total_time_s or 0) >= last * (1 - 1e-9)
        last = r.total_time_s or 0
