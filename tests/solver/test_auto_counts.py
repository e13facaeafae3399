"""One ``auto`` solve builds the eager plan once, runs no solver twice, and simulates little.

Counted on ``synthetic.transformer(2)`` (63 nodes) at 70% with a 5 s limit. Before the problem
object, the same solve built the eager plan 14 times, ran ``chen-greedy`` and ``rotor`` twice
each (``milp`` ran them again for its start) and made 75 simulations by this count.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import Any

import pytest

import remat.ir.plan_builders
from remat import solver
from remat.ir.simulate import Simulation
from remat.ir.synthetic import transformer
from remat.solver import base

SIMULATIONS_BEFORE = 75


def _count_everywhere(
    monkeypatch: pytest.MonkeyPatch,
    fn: Callable[..., Any],
    key: str,
    counts: collections.Counter[str],
) -> Callable[..., Any]:
    """Replace every module-level binding of ``fn`` in remat by a counting wrapper."""

    @functools.wraps(fn)
    def counted(*args: Any, **kwargs: Any) -> Any:
        counts[key] += 1
        return fn(*args, **kwargs)

    for name, mod in list(sys.modules.items()):
        if (name == "remat" or name.startswith("remat.")) and mod is not None:
            for attr, val in list(vars(mod).items()):
                if val is fn:
                    monkeypatch.setattr(mod, attr, counted)
    return counted


def test_one_auto_solve_builds_eager_once_and_runs_each_solver_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counts: collections.Counter[str] = collections.Counter()
    init = Simulation.__init__

    def counting_init(self: Simulation, *args: Any, **kwargs: Any) -> None:
        counts["simulate"] += 1
        init(self, *args, **kwargs)

    monkeypatch.setattr(Simulation, "__init__", counting_init)
    _count_everywhere(monkeypatch, remat.ir.plan_builders.eager_plan, "eager_plan", counts)
    for name, si in list(base._REGISTRY.items()):
        fn = _count_everywhere(monkeypatch, si.fn, name, counts)
        monkeypatch.setitem(base._REGISTRY, name, dataclasses.replace(si, fn=fn))

    g = transformer(2)
    # recompute only: with offloading, hierarchical and dtr also plan for larger budgets, each
    # offloaded down to this one (remat.solver.offload.combine)
    r = solver.solve(g, "70%", time_limit_s=5, offload=False)

    assert r.solver == "auto" and r.fits
    assert counts["eager_plan"] == 1
    ran = {n: c for n, c in counts.items() if n in base._REGISTRY}
    # which solvers get to run within 5 s depends on the machine's load; none runs twice
    # but dtr, once with each of its two scores
    assert ran["auto"] == 1 and ran["none"] == 1
    assert all(c == (2 if n == "dtr" else 1) for n, c in ran.items()), ran
    # every solver auto ran is named in its message, the winner first
    assert r.message.startswith("best plan from ")
    print(f"\nauto on transformer(2): {counts['simulate']} simulations, runs: {ran}")
    assert counts["simulate"] < SIMULATIONS_BEFORE


def test_milp_runs_no_other_solver_and_takes_start_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    counts: collections.Counter[str] = collections.Counter()
    for name, si in list(base._REGISTRY.items()):
        if name != "milp":
            fn = _count_everywhere(monkeypatch, si.fn, name, counts)
            monkeypatch.setitem(base._REGISTRY, name, dataclasses.replace(si, fn=fn))
    g = transformer(1, d_model=16, seq_len=8, batch_size=2, vocab_size=32, num_heads=2)
    start = solver.solve(g, "70%", solver="checkpoint-all")
    counts.clear()
    assert start.plan is not None
    r = solver.solve(g, "70%", solver="milp", time_limit_s=10, start_plans=[start.plan])
    assert not counts, counts  # milp itself ran nothing else
    assert r.solver == "milp" and r.fits
    assert r.total_time_s is not None and start.total_time_s is not None
    assert r.total_time_s <= start.total_time_s * (1 + 1e-9)  # no slower than its start
    with pytest.raises(ValueError, match="start_plans"):
        solver.info("milp").options_model.model_validate({"start_plans": []})  # type: ignore[union-attr]
