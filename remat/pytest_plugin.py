"""remat's pytest plugin: the ``remat_budget`` fixture does in a test what ``remat check`` does
in a pipeline.

    def test_gpt_fits(remat_budget):
        model, inputs, loss_fn = build_gpt()
        remat_budget.check(model, inputs, loss_fn, budget="16GiB", max_overhead=0.3)

The check traces one training step (fake tensors: no device memory is used), solves it at the
budget and fails the test, without a traceback into remat, when no plan fits or the plan costs
more extra time than ``max_overhead``. The message names the smallest budget found, the
overhead at the budget and the ten largest values alive at the peak with their modules. The
figures are also recorded as the test's properties, so ``pytest --junitxml`` carries them.

Registered through the ``pytest11`` entry point; torch and the solvers load on first use.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest


class RematBudget:
    """The ``remat_budget`` fixture's object; one per test."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self._request = request
        self.results: list[Any] = []
        """The :class:`~remat.solver.SolveResult` of each check in this test."""

    def check(
        self,
        model: Any,
        inputs: Any,
        loss_fn: Any = None,
        *,
        budget: int | float | str,
        max_overhead: float | None = None,
        solver: str | None = None,
        time_limit_s: float | None = 60.0,
        cost: Any = None,
    ) -> Any:
        """Trace ``model`` on ``inputs`` with ``loss_fn``, solve it within ``budget`` and fail
        the test when no plan fits or its overhead exceeds ``max_overhead`` (0.3: 30% extra
        time). Returns the solve result when the check passes.

        ``budget`` is total device bytes (``"16GiB"``, an ``int``) or a share of the eager
        activation peak (``"70%"``); ``cost`` is the tracer's cost model, by default
        :func:`remat.trace`'s (the measured roofline of the local CPU; also ``"flops"``, a
        device profile name such as ``"h100"``, or ``"measure"``). A failure names it.
        """
        from remat.tracer import trace  # imports torch, which sets up its loggers

        # torch's structured-trace channel logs empty DEBUG records while it traces (seen in a
        # pytest run under its log capture); quiet it for the trace so a failure reads clean.
        trace_log = logging.getLogger("torch.__trace")
        level = trace_log.level
        trace_log.setLevel(logging.WARNING)
        try:
            graph = trace(model, inputs, loss_fn, cost=cost)
        finally:
            trace_log.setLevel(level)
        return self.check_graph(
            graph,
            budget=budget,
            max_overhead=max_overhead,
            solver=solver,
            time_limit_s=time_limit_s,
            what=type(model).__name__,
        )

    def check_graph(
        self,
        graph: Any,
        *,
        budget: int | float | str,
        max_overhead: float | None = None,
        solver: str | None = None,
        time_limit_s: float | None = 60.0,
        what: str | None = None,
    ) -> Any:
        """:meth:`check` for a graph already traced (or read from ``remat trace`` output)."""
        import remat
        from remat.report.check import check_figures, cost_model_text, failure_message

        if max_overhead is not None and not max_overhead >= 0:
            raise ValueError(f"max_overhead must be >= 0, got {max_overhead!r}")
        result = remat.solve(graph, budget, solver=solver, time_limit_s=time_limit_s)
        self.results.append(result)
        figures = check_figures(graph, result)
        node = self._request.node
        node.user_properties += [
            ("remat_budget_bytes", result.budget_bytes),
            ("remat_fits", result.fits),
            ("remat_overhead", result.overhead if result.fits else None),
            ("remat_smallest_budget_bytes", figures.smallest_budget_bytes),
        ]
        message = failure_message(
            what or graph.name or "the model",
            figures,
            result,
            max_overhead=max_overhead,
            cost_model=cost_model_text(graph),
        )
        if message is not None:
            pytest.fail(message, pytrace=False)
        return result


@pytest.fixture
def remat_budget(request: pytest.FixtureRequest) -> RematBudget:
    """Check that a model's training step fits a memory budget: see :class:`RematBudget`."""
    return RematBudget(request)
