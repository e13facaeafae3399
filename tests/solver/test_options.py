"""Solver options: typed and bounded, checked before any work, every bad one named."""

from __future__ import annotations

import json
from typing import Any

import pytest
from handmade import chain_step

import remat.solver.problem
from remat import solver
from remat.ir.synthetic import chain
from remat.solver import InvalidOptionError, SolverOptions

BUILT_IN = (
    "auto",
    "checkpoint-all",
    "chen-greedy",
    "dtr",
    "lp-round",
    "milp",
    "none",
    "pofo",
    "revolve",
    "rotor",
    "sqrt",
)


@pytest.mark.parametrize("name", BUILT_IN)
def test_every_built_in_solver_publishes_a_json_schema(name: str) -> None:
    si = solver.info(name)
    assert si.options_model is not None and issubclass(si.options_model, SolverOptions)
    schema = si.options_model.model_json_schema()
    json.dumps(schema)  # serialisable, as the service publishes it
    assert set(schema.get("properties", {})) == set(si.options)
    assert schema["additionalProperties"] is False


BAD: list[tuple[str, dict[str, Any]]] = [
    ("chen-greedy", {"num_thresholds": 10**9}),  # each threshold is a plan and a simulation
    ("chen-greedy", {"num_thresholds": True}),  # a bool is not an integer
    ("chen-greedy", {"num_thresholds": 2.0}),
    ("rotor", {"mem_slots": 10**7}),  # the DP table would not fit in memory
    ("rotor", {"mem_slots": 0}),
    ("rotor", {"cuts": "everywhere"}),
    ("rotor", {"max_stages": 0}),
    ("pofo", {"host_bandwidth_bytes_per_s": -1.0}),
    ("pofo", {"mem_slots": 10**7}),
    ("revolve", {"cuts": 3}),
    ("lp-round", {"samples": 10**6}),
    ("lp-round", {"seed": -1}),
    ("lp-round", {"window": -2}),
    ("milp", {"threads": 10**6}),
    ("milp", {"threads": 0}),
    ("milp", {"backend": "gurobi"}),
    ("milp", {"window": True}),
    ("milp", {"window": "some"}),
    ("milp", {"recompute_backward": 1}),  # an integer is not a bool
    ("dtr", {"heuristic": "lru"}),
    ("dtr", {"sample": 0}),
    ("dtr", {"backward_last": 1}),
    ("auto", {"offload": 1}),
    ("auto", {"offload": "yes"}),
]


@pytest.mark.parametrize(("name", "options"), BAD, ids=lambda x: str(x))
def test_bad_options_are_refused_before_any_work(
    name: str, options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_work(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the problem was built before the options were checked")

    monkeypatch.setattr(remat.solver.problem, "simulate", no_work)
    (opt,) = options
    g = chain_step()
    with pytest.raises(InvalidOptionError, match=repr(opt)) as exc:
        solver.solve(g, "50%", solver=name, **options)
    assert exc.value.option == opt and exc.value.solver == name
    assert isinstance(exc.value, ValueError)
    with pytest.raises(ValueError, match=repr(opt)):
        solver.get(name)(g, 10**9, **options)


def test_good_options_reach_the_solver() -> None:
    g = chain_step()
    b = "90%"
    # no threads= here: HiGHS fixes its thread pool on first use in a process, and a later
    # solve asking another count stops early (a known gap of the milp threads option)
    assert solver.solve(g, b, solver="milp", window=0, backend="highs").fits
    assert solver.solve(g, b, solver="milp", window="all", recompute_backward=False).fits
    c = chain(8)
    assert solver.solve(c, "60%", solver="pofo", host_bandwidth_bytes_per_s=10**9).fits  # int
    assert solver.solve(c, "60%", solver="rotor", mem_slots=4000, cuts="blocks").fits
    assert solver.solve(c, "60%", solver="chen-greedy", num_thresholds=1000).fits
    assert solver.solve(c, "60%", solver="auto", offload=True, time_limit_s=10).fits


def test_a_model_that_disagrees_with_its_function_is_refused_at_registration() -> None:
    from pydantic import Field

    from remat.solver.base import register

    class Opts(SolverOptions):
        k: int = Field(3, ge=0)

    def fn(problem: Any, *, k: int = 4) -> Any:
        raise AssertionError

    with pytest.raises(ValueError, match="'k'"):
        register("test-drift", kind="baseline", options=Opts)(fn)

    def other(problem: Any, *, j: int = 3) -> Any:
        raise AssertionError

    with pytest.raises(ValueError, match="fields"):
        register("test-drift", kind="baseline", options=Opts)(other)
    assert "test-drift" not in solver.available()


def test_the_checkpoint_class_takes_offload_whatever_the_seed_solver() -> None:
    """``offload`` is the checkpoint class search's own option too: any seed solver accepts it
    with ``executor="checkpoint"``, and a value that is not a boolean is refused by name."""
    g = chain(4)
    with pytest.raises(InvalidOptionError, match="'offload'"):
        solver.solve(g, "70%", solver="checkpoint-all", executor="checkpoint", offload="yes")
    r = solver.solve(g, "70%", solver="checkpoint-all", executor="checkpoint", offload=False)
    assert r.plan is not None and not any(s.op == "offload" for s in r.plan.steps)
    with pytest.raises(InvalidOptionError, match="'offload'"):
        solver.solve(g, "70%", solver="checkpoint-all", offload=False)  # op level: its own rules
