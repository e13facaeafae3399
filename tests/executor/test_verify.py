"""``remat.verify``: the predicted-vs-measured report, as ``make demo`` prints it."""

from __future__ import annotations

import pytest
from _models import SMALL

import remat
from remat.executor import ExecutorError, VerifyReport
from remat.ir import eager_plan
from remat.tracer import trace_capture


def test_verify_reports_an_exact_run_of_the_chosen_plan() -> None:
    """The lines ``examples/demo.py`` ends with, on a small GPT."""
    model, inputs, loss_fn = SMALL["gpt"]()
    cap = trace_capture(model, inputs, loss_fn, cost="flops")
    result = remat.solve(cap.graph, "70%", solver="checkpoint-all")
    report = remat.verify(model, inputs, loss_fn, result, capture=cap, repeats=1)

    assert isinstance(report, VerifyReport)
    assert report.ok()
    assert report.grads_bitwise_equal and report.grad_max_abs_diff == 0.0
    assert report.loss_abs_diff == 0.0
    assert report.measured_peak_bytes == report.predicted_peak_bytes == result.peak_bytes
    assert report.measured_static_bytes == report.predicted_static_bytes == cap.graph.static_bytes
    assert report.within_budget == (report.measured_peak_bytes <= result.budget_bytes)
    assert report.measured_dynamic_bytes < report.eager_dynamic_bytes
    assert report.predicted_time_ratio == pytest.approx(
        result.total_time_s / result.baseline_time_s
    )
    assert report.measured_time_ratio is not None and report.measured_time_ratio > 0
    text = str(report)
    for word in ("predicted", "measured", "bit for bit", "budget", "time"):
        assert word in text


def test_verify_leaves_the_model_untouched() -> None:
    model, inputs, loss_fn = SMALL["resnet"]()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    remat.verify(model, inputs, loss_fn, eager_plan(remat.trace(model, inputs, loss_fn)), repeats=0)
    after = model.state_dict()
    assert all(p.grad is None for p in model.parameters())
    for k, v in before.items():
        assert (v == after[k]).all(), k


def test_verify_rejects_bad_arguments() -> None:
    model, inputs, loss_fn = SMALL["mlp"]()
    plan = eager_plan(remat.trace(model, inputs, loss_fn))
    with pytest.raises(ValueError, match="executor"):
        remat.verify(model, inputs, loss_fn, plan, executor="fast")
    with pytest.raises(ExecutorError, match="no plan"):
        remat.verify(model, inputs, loss_fn, object())
