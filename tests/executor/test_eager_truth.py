"""The plain eager step (the unmodified model, ``loss.backward()``) against remat's eager plan.

``measure_fake`` replays the plain eager step on fake tensors and equals the real measurement
to the byte; ``verify`` reports plain eager measured, eager plan predicted and plan measured,
and flags a difference above 1%. Where the eager plan's prediction is not the plain eager step
(the causes found for issue 15), a small model reproduces each one."""

from __future__ import annotations

from typing import Any

import _vision as V
import pytest
import torch

from examples import models as E
from remat.executor.measure import measure, measure_fake
from remat.executor.verify import verify
from remat.ir import eager_plan, simulate
from remat.tracer import capture


def _mse(y: torch.Tensor) -> torch.Tensor:
    return y.float().pow(2).mean()


def _convnext() -> tuple[torch.nn.Module, torch.Tensor, Any]:
    # Three stages: the last one is 2x2, where the downsampling convolution's channels-last
    # weight gradient is copied by AccumulateGrad at the step's peak.
    model = V.ConvNeXt(num_classes=10, dims=(16, 32, 64), depths=(1, 1, 1), sd=0.1)
    return model.train(), torch.randn(2, 3, 32, 32), _mse


def _swin() -> tuple[torch.nn.Module, torch.Tensor, Any]:
    # The attention function's Python locals (qkv, q, k, v) keep their storages until it
    # returns; the graph frees each at its last use.
    model = V.Swin(classes=10, sd=0.1, embed=16, depths=(1, 1, 1, 1), heads=(2, 2, 4, 4))
    return model.train(), torch.randn(2, 3, 64, 64), _mse


def _vit() -> tuple[torch.nn.Module, torch.Tensor, Any]:
    return V.ViT(heads=2, mlp=256, classes=10).train(), torch.randn(2, 3, 64, 64), _mse


CASES = {
    "mlp": E.build_mlp,
    "gpt": E.build_gpt,
    "resnet": E.build_resnet,
    "unet": E.build_unet,
    "vit-example": E.build_vit,
    "convnext": _convnext,
    "swin": _swin,
    "vit": _vit,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fake_replay_is_the_plain_eager_step(name: str) -> None:
    torch.manual_seed(0)
    model, x, loss_fn = CASES[name]()
    fake = measure_fake(model, x, loss_fn)
    real = measure(model, x, loss_fn)
    assert fake.peak_dynamic_bytes == real.peak_dynamic_bytes
    assert fake.static_bytes == real.static_bytes


@pytest.mark.parametrize("name", ["mlp", "gpt", "resnet", "unet", "vit-example", "vit"])
def test_eager_plan_predicts_the_plain_eager_step(name: str) -> None:
    torch.manual_seed(0)
    model, x, loss_fn = CASES[name]()
    graph = capture(model, x, loss_fn).graph
    predicted = simulate(graph, eager_plan(graph)).peak_dynamic_bytes
    plain = measure(model, x, loss_fn).peak_dynamic_bytes
    assert plain == pytest.approx(predicted, rel=0.01)


@pytest.mark.parametrize("name", ["convnext", pytest.param("swin", marks=pytest.mark.slow)])
def test_verify_flags_where_the_eager_plan_is_not_plain_eager(name: str) -> None:
    # Known gaps (README): the eager plan predicts less than the plain eager step here.
    torch.manual_seed(0)
    model, x, loss_fn = CASES[name]()
    cap = capture(model, x, loss_fn)
    report = verify(model, x, loss_fn, eager_plan(cap.graph), capture=cap, repeats=0)
    assert report.eager_predicted_dynamic_bytes == report.predicted_dynamic_bytes
    assert report.measured_dynamic_bytes == report.predicted_dynamic_bytes  # the plan is exact
    assert report.eager_dynamic_bytes > report.eager_predicted_dynamic_bytes
    assert report.eager_mismatch
    assert "EAGER MISMATCH" in str(report)
