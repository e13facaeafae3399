"""A plan the simulator rejects is the solver's bug: the registry raises it naming the solver,
``auto`` logs it and answers with the others' plans, and ``remat.solve`` never hands it back."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import pytest
from handmade import chain_step

import remat
from remat.ir import Plan, SolverBugError, eager_plan, simulate
from remat.ir.result import SolveResult
from remat.solver import base
from remat.solver.problem import Problem

BUDGET = "70%"  # below the eager peak, so that auto runs its sub-solvers


def missing_read(problem: Problem) -> Plan:
    """The eager plan without its first compute: a later compute reads what nothing made."""
    return Plan(steps=eager_plan(problem.graph).steps[1:])


def judged_inside(problem: Problem, **_: Any) -> SolveResult:
    # the common case: a solver judges its own broken plan through Problem.result
    return problem.result(missing_read(problem), solver="chen-greedy", started=0.0)


def hand_built(problem: Problem, **_: Any) -> SolveResult:
    # a plugin that builds its result itself, copying the eager figures onto a broken plan
    eager = problem.result(problem.eager_plan, solver="chen-greedy", started=0.0)
    return eager.model_copy(update={"plan": missing_read(problem)})


def wrong_figures(problem: Problem, **_: Any) -> SolveResult:
    # a valid plan whose result reports a peak the simulator does not find
    good = problem.result(problem.eager_plan, solver="chen-greedy", started=0.0)
    assert good.figures is not None
    figures = good.figures.model_copy(update={"peak_bytes": good.figures.peak_bytes - 1})
    return good.model_copy(update={"figures": figures})


def false_fit(problem: Problem, **_: Any) -> SolveResult:
    # the simulator's figures, but "feasible" for a plan over the budget
    over = problem.result(problem.eager_plan, solver="chen-greedy", started=0.0)
    return over.model_copy(update={"status": "feasible", "min_budget_bytes": None})


BROKEN: dict[str, Callable[..., SolveResult]] = {
    "judged-inside": judged_inside,
    "hand-built": hand_built,
    "wrong-figures": wrong_figures,
    "false-fit": false_fit,
}


def break_solver(
    monkeypatch: pytest.MonkeyPatch, name: str, fn: Callable[..., SolveResult]
) -> None:
    si = base.info(name)
    monkeypatch.setitem(base._REGISTRY, name, dataclasses.replace(si, fn=fn))


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_a_broken_solver_is_named_by_every_call_path(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    g = chain_step()
    break_solver(monkeypatch, "chen-greedy", BROKEN[kind])
    budget = remat.solver.Problem.build(g, BUDGET).budget_bytes
    with pytest.raises(SolverBugError, match="'chen-greedy'") as info:
        remat.solve(g, BUDGET, solver="chen-greedy")
    assert info.value.solver == "chen-greedy"
    with pytest.raises(SolverBugError, match="'chen-greedy'"):
        remat.solver.get("chen-greedy")(g, budget)


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_auto_skips_a_broken_sub_solver_and_logs_its_name(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    g = chain_step()
    break_solver(monkeypatch, "chen-greedy", BROKEN[kind])
    with caplog.at_level(logging.ERROR, logger="remat.solver.auto"):
        r = remat.solve(g, BUDGET, time_limit_s=10, gap_tolerance=0.0)
    assert r.solver == "auto" and r.plan is not None
    simulate(g, r.plan)  # the answer is one of the other solvers' valid plans
    assert "skipped chen-greedy" in r.message
    logged = [rec for rec in caplog.records if rec.name == "remat.solver.auto"]
    assert len(logged) == 1 and "'chen-greedy'" in logged[0].getMessage()


def test_a_registered_plugin_with_a_broken_plan_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # the registry's own path, as a plugin module would use it (removed again afterwards)
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    base.register("broken-plugin", kind="dag")(hand_built)
    with pytest.raises(SolverBugError, match="'broken-plugin'"):
        remat.solve(chain_step(), BUDGET, solver="broken-plugin")


def test_results_of_problem_result_are_not_simulated_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # the check costs nothing for results built through Problem.result (every shipped solver)
    g = chain_step()
    p = Problem.build(g, BUDGET)
    r = p.result(p.eager_plan, solver="none", started=0.0)
    assert r.simulated and r.model_copy(update={"message": "x"}).simulated
    assert not r.model_copy(update={"plan": eager_plan(g)}).simulated

    def no_simulation(*_: object, **__: object) -> None:
        raise AssertionError("simulated again")

    monkeypatch.setattr(Problem, "simulate", no_simulation)
    assert base.held_to_simulator(p, r, "none") is r
