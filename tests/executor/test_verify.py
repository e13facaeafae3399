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


def test_executors_capture_the_step_as_a_gpu_target_traced_it() -> None:
    """A plan made on ``trace(..., target="h100")`` computes the GPU's fused kernels (one
    ``native_dropout``, not the CPU's ``bernoulli`` and ``div``): verify, ``compile_step`` and
    ``remat.apply`` capture the step the same way, instead of failing on a node their CPU
    capture does not have."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=1,
        n_head=2,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(cfg).train()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def loss_fn(out: object) -> torch.Tensor:
        return out.logits.float().pow(2).mean()  # type: ignore[attr-defined]

    graph = remat.trace(model, (ids,), loss_fn, target="h100")
    assert any(n.id.startswith("native_dropout") for n in graph.nodes)
    report = remat.verify(model, (ids,), loss_fn, eager_plan(graph), repeats=0)
    assert report.grads_bitwise_equal
    assert report.predicted_static_bytes == report.measured_static_bytes
    step = remat.compile_step(model, (ids,), loss_fn, eager_plan(graph))
    assert torch.isfinite(step(ids))
    model.zero_grad(set_to_none=True)
    applied = remat.apply(model, eager_plan(graph), graph, loss_fn=loss_fn)
    applied(ids).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    remat.executor.remove(model)
