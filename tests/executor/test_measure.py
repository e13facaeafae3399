"""Peak memory of real CPU steps: the live-storage tracker and ``measure``'s static/dynamic split."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from remat.executor import LiveStorageTracker, measure  # noqa: E402


def test_tracker_counts_new_storages_and_releases() -> None:
    tracker = LiveStorageTracker()
    with tracker:
        a = torch.ones(1000)  # +4000
        v = a.view(10, 100).t()  # views: no new memory
        b = a * 2  # +4000
        del a  # still alive through the view
        peak_with_view = sum(tracker.live.values())
        del v  # the last reference to ones' storage: -4000
        c = b.add_(1)  # in place: no new memory
        d = torch.empty(250)  # +1000
    assert peak_with_view == 8000
    assert sum(tracker.live.values()) == 5000
    peak, final, timeline = tracker.peak(set())
    assert (peak, final) == (8000, 5000)
    assert timeline == [4000, 8000, 4000, 5000]
    del b, c, d
    assert sum(tracker.live.values()) == 0


def test_measure_splits_static_and_dynamic_exactly() -> None:
    model = nn.Linear(8, 4, bias=False)  # 128 bytes of weight
    x = torch.randn(16, 8)  # 512 bytes of input
    model.weight.grad = torch.ones_like(model.weight)  # reset to None by measure

    def step() -> None:
        t1 = torch.zeros(256)  # 1024 B
        t2 = torch.zeros(512)  # 2048 B -> peak 3072 + input
        del t1
        t3 = torch.zeros(128)  # 512 B
        model.weight.grad = torch.zeros(4, 8)  # becomes .grad: static, not dynamic
        del t2, t3

    m = measure(model, (x,), step=step)
    assert m.param_bytes == 128 and m.grad_bytes == 128 and m.buffer_bytes == 0
    assert m.static_bytes == 256
    assert m.input_bytes == 512
    assert m.peak_dynamic_bytes == 512 + 3072
    assert m.peak_bytes == 256 + 512 + 3072
    assert m.final_dynamic_bytes == 512
    assert m.observed_peak_bytes == 128 + 512 + 3072  # the grad did not exist yet at the peak


def test_measure_default_step_leaves_gradients() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.BatchNorm1d(64), nn.Linear(64, 2))
    x = torch.randn(8, 32)
    y = torch.randn(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()  # creates momentum buffers: static optimizer state
    m = measure(model, (x,), lambda out: nn.functional.mse_loss(out, y), optimizer=opt)
    params = list(model.parameters())
    p_bytes = sum(p.numel() * 4 for p in params)
    b_bytes = sum(b.untyped_storage().nbytes() for b in model.buffers())
    assert all(p.grad is not None for p in params)
    assert (m.param_bytes, m.grad_bytes, m.optimizer_state_bytes) == (p_bytes, p_bytes, p_bytes)
    assert m.buffer_bytes == b_bytes
    assert m.static_bytes == 3 * p_bytes + b_bytes
    # forward activations (8x64 floats at least) on top of the inputs
    assert m.peak_dynamic_bytes >= m.input_bytes + 8 * 64 * 4
    assert m.observed_peak_bytes <= m.peak_bytes
    assert m.final_dynamic_bytes == m.input_bytes  # the loss is released with the step
