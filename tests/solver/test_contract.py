"""One contract, every registered solver: plans that simulate, fit, and cost no less than eager.

New solvers are picked up from the registry automatically.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from _graphs import schema_graphs
from handmade import chain_step, diamond, residual_step
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remat import solver
from remat.ir import (
    Graph,
    GraphTooLargeError,
    Node,
    SolverUnavailableError,
    Value,
    eager_plan,
    simulate,
)
from remat.ir.synthetic import chain, random_layered_dag, transformer, unet
from remat.solver import SolveResult
from remat.solver.poet import DEFAULT_MAX_NODES as POET_MAX_NODES

TIME_LIMIT_S = 2.0  # every assertion holds for any limit; the slow cases run it out


def one_node() -> Graph:
    return Graph(
        values=(
            Value(id="x", size_bytes=8, kind="input"),
            Value(id="L", size_bytes=4, kind="loss"),
        ),
        nodes=(Node(id="loss", inputs=("x",), outputs=("L",), time_s=1.0),),
        required=("L",),
    )


def backward_first() -> Graph:
    # Valid (listed in a topological order), though no chain: a forward node reads what a
    # backward node made. revolve and pofo expanded their chain into an invalid plan here
    # (found by schemathesis through the service).
    return Graph(
        values=(
            Value(id="x", size_bytes=8, kind="input"),
            Value(id="a", size_bytes=100),
            Value(id="b", size_bytes=100),
            Value(id="L", size_bytes=4, kind="loss"),
        ),
        nodes=(
            Node(id="b0", phase="backward", inputs=("x",), outputs=("a",), time_s=1.0),
            Node(id="f1", inputs=("a",), outputs=("b",), time_s=1.0),
            Node(id="f2", inputs=("b",), outputs=("L",), time_s=1.0),
        ),
        required=("L",),
    )


GRAPHS: dict[str, Callable[[], Graph]] = {
    "empty": Graph,
    "one-node": one_node,
    "hand-chain": chain_step,
    "hand-diamond": diamond,
    "hand-residual": residual_step,
    "chain4": lambda: chain(4, batch_size=2, width=8),
    "het-chain5": lambda: chain(5, heterogeneous=True, batch_size=2, width=8, seed=1),
    "transformer1": lambda: transformer(1, d_model=16, seq_len=8, batch_size=2, vocab_size=32, num_heads=2),
    "unet1": lambda: unet(1, base_channels=4, image_size=4, batch_size=1),
    "random-dag12": lambda: random_layered_dag(12, seed=1, batch_size=4, max_width=64),
    "backward-first": backward_first,
}  # fmt: skip

FRACTIONS = (0.0, 0.5, 0.7, 1.0, None)  # None: an ample budget


def budget_for(g: Graph, frac: float | None) -> int:
    if frac is None:
        return 10**15
    dyn = simulate(g, eager_plan(g)).peak_dynamic_bytes
    return 0 if frac == 0 else g.static_bytes + int(frac * dyn)


_graph_cache: dict[str, Graph] = {}


def graph(name: str) -> Graph:
    if name not in _graph_cache:
        _graph_cache[name] = GRAPHS[name]()
    return _graph_cache[name]


@pytest.mark.parametrize("frac", FRACTIONS, ids=lambda f: "ample" if f is None else f"{f:.0%}")
@pytest.mark.parametrize("gname", sorted(GRAPHS))
@pytest.mark.parametrize("name", solver.available())
def test_contract(name: str, gname: str, frac: float | None) -> None:
    g = graph(gname)
    budget = budget_for(g, frac)
    if name == "poet" and g.num_nodes > POET_MAX_NODES:  # an exact MILP for small graphs only
        with pytest.raises(GraphTooLargeError, match="max_nodes") as err:
            solver.get(name)(g, budget, time_limit_s=TIME_LIMIT_S)
        assert err.value.option == "max_nodes"
        return
    r = solver.get(name)(g, budget, time_limit_s=TIME_LIMIT_S)
    assert isinstance(r, SolveResult)
    assert r.solver == name and r.budget_bytes == budget
    eager_time = simulate(g, eager_plan(g)).total_time_s
    assert r.baseline_time_s == pytest.approx(eager_time)

    if r.plan is not None:
        # The simulator is the judge: the plan runs, and the result reports its figures.
        sim = simulate(g, r.plan)  # raises InvalidPlanError if the plan is wrong
        assert r.peak_bytes == sim.peak_bytes
        assert r.total_time_s == pytest.approx(sim.total_time_s)
        assert sim.total_time_s >= eager_time * (1 - 1e-9)
    if r.status in ("optimal", "feasible"):
        assert r.plan is not None
        assert r.peak_bytes is not None and r.peak_bytes <= budget
        assert r.overhead is not None and r.overhead >= -1e-9
        if r.lower_bound_s is not None:
            assert r.lower_bound_s <= r.total_time_s * (1 + 1e-6)  # type: ignore[operator]
    elif r.status == "infeasible":
        # The smallest budget found to work, when one was found, lies above what was asked.
        if r.min_budget_bytes is not None:
            assert r.min_budget_bytes > budget
        if r.plan is not None:
            assert r.peak_bytes is not None and r.peak_bytes > budget
    else:
        assert r.status == "timeout"

    floor = g.static_bytes + g.input_bytes  # nothing can go below what is always held
    if budget < floor:
        assert r.status in ("infeasible", "timeout")
    if frac is None:
        assert r.status in ("optimal", "feasible"), r.message


def test_unknown_solver_and_option_are_named() -> None:
    with pytest.raises(SolverUnavailableError, match="no-such-solver"):
        solver.get("no-such-solver")
    g = chain_step()
    with pytest.raises(ValueError, match="'bogus'"):
        solver.get("none")(g, 10**9, bogus=1)
    with pytest.raises(ValueError, match="budget_bytes"):
        solver.get("none")(g, -5)
    with pytest.raises(ValueError, match="time_limit_s"):
        solver.get("none")(g, 10**9, time_limit_s=-1.0)


def test_registry_lists_the_baselines() -> None:
    names = solver.available()
    for n in ("none", "checkpoint-all", "sqrt", "chen-greedy"):
        assert n in names
    assert solver.info("sqrt").kind == "baseline"
    assert "num_thresholds" in solver.info("chen-greedy").options


def backward_made_read_later() -> Graph:
    # Found by the schemathesis fuzz of POST /v1/frontier (reduced from 18 nodes): a backward
    # node that cannot run again makes a value that a later forward-phase node reads.
    return Graph(
        values=(Value(id="x", size_bytes=8, kind="input"), Value(id="v", size_bytes=63554)),
        nodes=(
            Node(
                id="p",
                inputs=(),
                outputs=("v",),
                time_s=1.0,
                phase="backward",
                recomputable=False,
                workspace_bytes=8125,
            ),
            Node(id="q", inputs=(), outputs=(), time_s=1.0, phase="backward"),
            Node(id="r", inputs=("v",), outputs=(), time_s=1.0),
        ),
        required=(),
        static_bytes=30707673,
    )


def test_a_backward_made_value_read_later_gets_valid_plans() -> None:
    g = backward_made_read_later()
    for name in solver.available():
        r = solver.solve(g, "50%", solver=name, time_limit_s=5)
        if r.plan is not None:
            simulate(g, r.plan)  # raises InvalidPlanError on a plan that reads a missing value


# -- the contract on drawn graphs -----------------------------------------------------------

DRAWN_TIME_LIMIT_S = 1.0


@pytest.mark.parametrize("name", solver.available())
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(g=schema_graphs(), frac=st.sampled_from((0.0, 0.3, 0.7, 0.95, None)))
def test_contract_on_drawn_graphs(name: str, g: Graph, frac: float | None) -> None:
    budget = budget_for(g, frac)
    r = solver.get(name)(g, budget, time_limit_s=DRAWN_TIME_LIMIT_S)
    assert r.budget_bytes == budget
    if r.plan is not None:
        sim = simulate(g, r.plan)  # raises InvalidPlanError if the plan is wrong
        assert r.peak_bytes == sim.peak_bytes
    if r.fits:
        assert r.peak_bytes is not None and r.peak_bytes <= budget
    if frac is None:
        assert r.fits, r.message
