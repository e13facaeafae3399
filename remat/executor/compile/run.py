"""One compiled training step, measured against the uncompiled one (tests and benchmarks).

:func:`compiled_step` compiles ``loss_fn(model(*inputs))`` with a backend, runs it once to
compile (timed), then once measured with :func:`measure_compiled`, from the same random seed as
the eager reference, and reports peak bytes, gradients' difference and times.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from remat.executor.compile.memory import measure_compiled
from remat.executor.measure import MemoryMeasurement, measure


@dataclass(frozen=True)
class EagerReference:
    """The uncompiled step: its measured memory, gradients and time."""

    memory: MemoryMeasurement
    grads: dict[str, torch.Tensor]
    step_time_s: float


@dataclass(frozen=True)
class CompiledRun:
    memory: MemoryMeasurement
    compile_time_s: float
    step_time_s: float
    max_grad_diff: float
    """Largest absolute difference of any parameter gradient from the eager step's."""


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _timed(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def eager_reference(
    model: nn.Module,
    inputs: tuple[Any, ...],
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    seed: int = 0,
    time_repeats: int = 0,
) -> EagerReference:
    """Measure the uncompiled step from ``seed``; keep its gradients."""
    torch.manual_seed(seed)
    mem = measure(model, inputs, loss_fn)
    grads = _grads(model)

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        loss_fn(model(*inputs)).backward()

    t = _timed(step, time_repeats) if time_repeats else 0.0
    return EagerReference(memory=mem, grads=grads, step_time_s=t)


def compiled_step(
    model: nn.Module,
    inputs: tuple[Any, ...],
    loss_fn: Callable[[Any], torch.Tensor],
    backend: Any,
    reference: EagerReference,
    *,
    seed: int = 0,
    time_repeats: int = 0,
) -> CompiledRun:
    """Compile the step with ``backend`` (a fresh dynamo state), measure it from ``seed``."""
    torch._dynamo.reset()
    fn = torch.compile(lambda *x: loss_fn(model(*x)), backend=backend, dynamic=False)

    def step() -> None:
        fn(*inputs).backward()

    for p in model.parameters():
        p.grad = None
    t0 = time.perf_counter()
    step()
    compile_s = time.perf_counter() - t0
    torch.manual_seed(seed)
    mem = measure_compiled(model, inputs, step)
    grads = _grads(model)
    diff = 0.0
    for name, g in reference.grads.items():
        if name in grads:
            diff = max(diff, float((grads[name] - g).abs().max()))
        else:
            diff = float("inf")

    def timed() -> None:
        for p in model.parameters():
            p.grad = None
        step()

    t = _timed(timed, time_repeats) if time_repeats else 0.0
    return CompiledRun(memory=mem, compile_time_s=compile_s, step_time_s=t, max_grad_diff=diff)
