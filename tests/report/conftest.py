"""A small planned graph and its report page, shared by the report tests."""

from __future__ import annotations

import pytest
from _pages import Planned

from remat import solver as solvers
from remat.ir import synthetic
from remat.report import FrontierPoint, compute_frontier


@pytest.fixture(scope="session")
def planned() -> Planned:
    g = synthetic.transformer(2)
    r = solvers.solve(g, "70%", solver="rotor")
    assert r.fits, r
    fr = compute_frontier(g, budgets=["100%", "60%", "40%"], solvers=["checkpoint-all", "rotor"])
    # A point with a proven bound, as milp gives on small graphs: the page draws it as a band.
    base = r.baseline_time_s
    fr += [
        FrontierPoint(
            solver="bounded",
            budget=b,
            budget_bytes=p.budget_bytes,
            status="feasible",
            overhead=0.30 - 0.1 * i,
            total_time_s=base * (1.30 - 0.1 * i),
            baseline_time_s=base,
            lower_bound_s=base * (1.10 - 0.05 * i),
        )
        for i, (b, p) in enumerate(zip(["40%", "60%", "100%"], fr[:3][::-1], strict=True))
    ]
    return Planned(g, r, fr)
