"""The op-level executor's eager plan is the eager step: same gradients bit for bit and the
simulator's peak, on the cases where the functional joint graph differs from eager PyTorch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from remat.executor.verify import verify
from remat.ir import eager_plan
from remat.tracer import capture


class TransposedDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x.transpose(1, 2)).transpose(1, 2)  # non-contiguous
        return F.dropout(h, 0.5, training=True).pow(2).sum()


def test_dropout_on_a_transposed_tensor_draws_as_eager() -> None:
    # Eager draws the mask in the input's memory order; the functional bernoulli in a
    # contiguous buffer. The gradients differed (max |diff| 26 here) before the rewrite.
    torch.manual_seed(0)
    model, x = TransposedDropout(), torch.randn(2, 6, 3)
    cap = capture(model, x)
    report = verify(model, x, None, eager_plan(cap.graph), capture=cap, repeats=0)
    assert report.grads_bitwise_equal, report.grad_max_abs_diff
    assert report.loss_abs_diff == 0.0


def test_batch_norm_statistics_have_no_transient() -> None:
    # The functional batch norm returns new running mean and variance (2 x 8192 x 4 bytes)
    # that were copied into the buffers: +33% over the prediction, uncounted by the simulator.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8192), nn.BatchNorm1d(8192))
    x = torch.randn(2, 4)

    def loss_fn(y: torch.Tensor) -> torch.Tensor:
        return y.sum()

    cap = capture(model, x, loss_fn)
    report = verify(model, x, loss_fn, eager_plan(cap.graph), capture=cap, repeats=0)
    assert report.measured_dynamic_bytes == report.predicted_dynamic_bytes
    assert report.eager_dynamic_bytes == report.predicted_dynamic_bytes
    assert report.grads_bitwise_equal
    # ... and the buffers hold the eager step's statistics.
    ref = nn.Sequential(nn.Linear(4, 8192), nn.BatchNorm1d(8192))
    ref.load_state_dict(model.state_dict())
    loss_fn(ref(x)).backward()
    from remat.executor.opexec import compile_step

    run = nn.Sequential(nn.Linear(4, 8192), nn.BatchNorm1d(8192))
    run.load_state_dict(model.state_dict())
    compile_step(run, x, loss_fn, eager_plan(cap.graph), capture=cap)(x)
    for (name, a), (_, b) in zip(ref.named_buffers(), run.named_buffers(), strict=True):
        assert torch.equal(a, b), name
