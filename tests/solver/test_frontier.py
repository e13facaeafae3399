"""``remat.frontier``: budgets share work, time never rises with memory, spare room is used."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import remat
from remat.ir import InvalidPlanError, eager_plan, resolve_budget, simulate
from remat.ir.synthetic import chain, random_layered_dag, transformer
from remat.solver import get, known
from remat.solver.fill import fill_budget

FRONTIER = sys.modules[
    "remat.solver.frontier"
]  # the module (remat.solver.frontier is the function)
FRACS = [0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]


def check_frontier(graph, budgets, fr) -> None:
    """The invariants every frontier keeps."""
    assert len(fr.results) == len(budgets)
    eager = simulate(graph, eager_plan(graph))
    assert fr.eager_peak_bytes == eager.peak_bytes
    assert fr.min_budget_lower_bytes <= eager.peak_bytes
    by_budget = sorted(fr.results, key=lambda r: r.budget_bytes)
    last_time = None
    for spec, r in zip(budgets, fr.results, strict=True):
        assert r.budget_bytes == resolve_budget(graph, spec)
    for r in by_budget:
        if r.plan is not None:
            sim = simulate(graph, r.plan)  # a valid plan, and its figures are the simulator's
            assert sim.peak_bytes == r.peak_bytes and sim.total_time_s == r.total_time_s
            assert fr.min_budget_lower_bytes <= sim.peak_bytes
            assert fr.min_budget_bytes is not None and fr.min_budget_bytes <= sim.peak_bytes
        if r.fits:
            assert r.peak_bytes <= r.budget_bytes
            if last_time is not None:
                assert r.total_time_s <= last_time * (1 + 1e-12)  # never slower with more memory
            last_time = r.total_time_s
            if r.lower_bound_s is not None:
                assert r.lower_bound_s <= r.total_time_s * (1 + 1e-9)
        else:
            assert last_time is None, "a budget above a feasible one must be feasible"
            if r.min_budget_bytes is not None:
                assert r.min_budget_bytes > r.budget_bytes
                assert r.min_budget_bytes >= fr.min_budget_lower_bytes


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    nodes=st.integers(3, 14),
    fracs=st.lists(st.sampled_from(FRACS), min_size=1, max_size=6),
    solver=st.sampled_from(["checkpoint-all", "chen-greedy", "rotor"]),
)
def test_frontier_properties_on_random_graphs(seed, nodes, fracs, solver) -> None:
    g = random_layered_dag(nodes, seed=seed)
    fr = remat.frontier(g, fracs, solver=solver, fill_time_s=0.5)
    check_frontier(g, fracs, fr)


def test_a_budget_with_room_gets_a_faster_plan() -> None:
    """checkpoint-all returns one plan for every budget; the frontier spends the room."""
    g = chain(12)
    budgets = [0.5, 0.7, 0.9]
    alone = [get("checkpoint-all")(g, resolve_budget(g, b)) for b in budgets]
    assert len({r.total_time_s for r in alone}) == 1
    fr = remat.frontier(g, budgets, solver="checkpoint-all")
    check_frontier(g, budgets, fr)
    times = [r.total_time_s for r in fr.results]
    assert times[-1] < alone[-1].total_time_s
    assert len(set(times)) >= 2  # distinct plans where the budget allows


def test_plans_of_smaller_budgets_serve_larger_ones(monkeypatch) -> None:
    """A solver that answers worse at a larger budget (time-limited search) cannot make the
    frontier slower there: the smaller budget's plan is reused."""
    g = transformer(2, d_model=64, num_heads=2, seq_len=32, batch_size=2, vocab_size=128)
    calls: list[int] = []
    good = get("rotor")

    def erratic(graph, budget_bytes, *, time_limit_s=None):
        calls.append(budget_bytes)
        if len(calls) == 1:
            return good(graph, budget_bytes)
        return get("checkpoint-all")(graph, budget_bytes)

    monkeypatch.setattr(FRONTIER, "get", lambda name: erratic if name == "erratic" else get(name))
    fr = remat.frontier(g, [0.5, 0.8], solver="erratic", fill_time_s=0)
    r50, r80 = fr.results
    assert r80.total_time_s <= r50.total_time_s
    assert r80.total_time_s <= get("checkpoint-all")(g, r80.budget_bytes).total_time_s


def test_eager_budgets_are_not_solved_and_bounds_carry_down(monkeypatch) -> None:
    g = chain(8)
    calls: list[int] = []
    rotor = get("rotor")

    def counted(graph, budget_bytes, *, time_limit_s=None):
        calls.append(budget_bytes)
        return rotor(graph, budget_bytes)

    monkeypatch.setattr(FRONTIER, "get", lambda name: counted if name == "counted" else get(name))
    fr = remat.frontier(g, [1.0, 0.6, 1.0, 10**12], solver="counted")
    assert calls == [resolve_budget(g, 0.6)]  # the eager budgets cost no solve
    assert [r.status for r in fr.results] == ["optimal", fr.results[1].status, "optimal", "optimal"]
    assert fr.results[0].plan.steps == eager_plan(g).steps
    r60 = fr.results[1]
    assert r60.lower_bound_s is None or r60.lower_bound_s <= r60.total_time_s


def test_bad_budget_names_its_index() -> None:
    with pytest.raises(ValueError, match=r"budgets\[1\]"):
        remat.frontier(chain(4), [0.5, "lots"])
    with pytest.raises(ValueError, match="fill_time_s"):
        remat.frontier(chain(4), [0.5], fill_time_s=-1)


def test_fill_respects_an_injected_clock() -> None:
    """With no time at all, only the seed's own keep plan is judged."""
    g = chain(16)
    seed = get("checkpoint-all")(g, resolve_budget(g, 0.5)).plan
    ticks = iter(range(10**6))  # each reading of the clock is one second later

    def clock() -> float:
        return float(next(ticks))

    b = resolve_budget(g, 0.9)
    got = fill_budget(g, b, [seed], time_limit_s=0.0, clock=clock)
    assert got is not None and got[1].total_time_s == simulate(g, seed).total_time_s
    got = fill_budget(g, b, [seed], time_limit_s=1000.0, clock=clock)
    assert got is not None and got[1].total_time_s < simulate(g, seed).total_time_s
    assert got[1].peak_bytes <= b


def test_min_budget_lower_bound_holds_for_the_eager_plan_and_every_keep_plan() -> None:
    g = random_layered_dag(30, seed=3)
    low = known.min_budget_lower_bytes(g)
    assert low <= simulate(g, eager_plan(g)).peak_bytes
    fwd = [o for n in g.nodes if n.phase == "forward" for o in n.outputs]
    for k in range(0, len(fwd), 5):
        try:
            p = remat.ir.keep_plan(g, fwd[:k])
        except InvalidPlanError:
            continue
        assert low <= simulate(g, p).peak_bytes


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_frontier_on_the_example_models_over_ten_budgets(name, remat_cache_dir) -> None:
    pytest.importorskip("torch")
    from examples.models import build_gpt, build_resnet
    from remat.tracer import trace

    build = {
        "gpt": lambda: build_gpt(batch=2, seq=16, vocab=64, d_model=32, n_layers=2, n_heads=2),
        "resnet": lambda: build_resnet(batch=2, image=16, width=8, blocks_per_stage=1, stages=2),
    }[name]
    g = trace(*build())
    fr = remat.frontier(g, FRACS, time_limit_s=0.5, fill_time_s=0.5)
    check_frontier(g, FRACS, fr)
    fitting = [r for r in fr.results if r.fits]
    assert fitting and fitting[-1].overhead == 0.0  # 100%: the eager plan
