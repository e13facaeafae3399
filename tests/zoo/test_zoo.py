"""The zoo: small transformers models traced, solved at 70% and 50%, and trained through
``remat.apply`` in a plain training step (``loss = model(**batch); loss.backward()``).

Gradients must equal the unmodified model's bit for bit (float32, dropout included), the
measured peak must be the prediction within 2% and within the budget. Cases that are not yet
are expected failures, with what was measured (``NOT_YET_EXACT``).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from _zoo import ZOO, reference_grads, run_case

from remat.ir import resolve_budget
from remat.tracer import TraceError, trace_capture

SEED = 7
SOLVE_TIME_LIMIT_S = 2.0  # exactness holds for any plan; the 50% solves run the limit out
FRACTIONS = [0.7, 0.5]
SLOW = {"t5", "whisper", "mixtral"}  # the largest graphs (700+ nodes): slow on 2 cores
# Cases not within 2% yet, with what was measured. Not strict: a case that passes is reported
# XPASS. None are left (Mixtral at 50% in checkpoint mode was the last: see
# tests/executor/test_module.py::test_routed_block_recomputation_is_exact).
NOT_YET_EXACT: dict[tuple[str, float, str], str] = {}


@cache
def _setup(name: str) -> tuple[Any, Any, Any, Any, dict[str, torch.Tensor]]:
    model, inputs, loss_fn = ZOO[name]()
    try:
        cap = trace_capture(model, inputs, loss_fn, cost="flops")
    except TraceError as exc:  # every zoo model traces today: one that stops is a regression
        pytest.fail(f"{name} no longer traces: {exc}"[:600], pytrace=False)
    return model, inputs, loss_fn, cap, reference_grads(model, inputs, loss_fn, SEED)


def _cases() -> list[Any]:
    out = []
    for name in ZOO:
        for frac in FRACTIONS:
            for mode in ("op", "checkpoint"):
                marks: list[Any] = [pytest.mark.slow] if name in SLOW else []
                why = NOT_YET_EXACT.get((name, frac, mode))
                if why is not None:
                    marks.append(pytest.mark.xfail(reason=why, strict=False))
                out.append(pytest.param(name, frac, mode, marks=marks, id=f"{name}-{frac}-{mode}"))
    return out


@pytest.mark.parametrize(("name", "frac", "mode"), _cases())
def test_zoo_apply_is_exact(name: str, frac: float, mode: str) -> None:
    model, inputs, loss_fn, cap, grads = _setup(name)
    budget = resolve_budget(cap.graph, frac)
    case = run_case(
        model, inputs, loss_fn, cap, budget, mode, time_limit_s=SOLVE_TIME_LIMIT_S, seed=SEED
    )
    for n, p in case.run.named_parameters():
        if n in grads:
            assert p.grad is not None and torch.equal(p.grad, grads[n]), n
    predicted = case.simulation.peak_dynamic_bytes
    assert abs(case.measured.peak_dynamic_bytes - predicted) <= 0.02 * predicted
    if mode == "checkpoint":
        # to the byte: the frame's hold on the blocks' tensor arguments is counted
        # (Value.held_by; Llama's cache_position and OPT's position_ids were 128-256 B over)
        assert case.measured.peak_dynamic_bytes == predicted
    if case.result.fits:
        assert case.measured.peak_bytes <= budget


OFFLOAD_MODELS = {"gpt2": 0.4, "llama": 0.3, "bert": 0.3}
"""Budgets (shares of the eager step) at which auto's answer offloads. GPT-2 at 30% has no plan
that fits in the solve's 2 s since prefetches start where they are issued (the smallest found,
dtr's, moves nothing); at 40% dtr's plan evicting to the host fits."""


@pytest.mark.parametrize("name", OFFLOAD_MODELS)
def test_zoo_offload_plans_are_exact(name: str) -> None:
    # At 30-40% with a host link (emulated: this CPU's profile has none, host and device memory
    # being one), auto offloads by default; the op-level executor runs the plan with device
    # bytes as predicted, host bytes as planned, gradients bit-exact.
    import remat
    from remat.executor import verify
    from remat.ir import DeviceProfile, HostLink, Plan

    model, inputs, loss_fn, cap, _ = _setup(name)
    assert cap.graph.device is None  # priced by FLOPs alone, no device, no host link
    rate = 1e12  # bytes/s each way: faster than this CPU's compute, so offloading pays
    link = HostLink(
        device_to_host_bytes_per_s=rate, host_to_device_bytes_per_s=rate, host_memory_bytes=1 << 34
    )
    device = DeviceProfile(
        name="cpu-emulated-link",
        peak_flops_per_s={"float32": 1e11},
        memory_bandwidth_bytes_per_s=1e10,
        host_bandwidth_bytes_per_s=rate,
        host_link=link,
    )
    graph = cap.graph.model_copy(update={"device": device})
    budget = resolve_budget(graph, OFFLOAD_MODELS[name])
    result = remat.solve(graph, budget, time_limit_s=SOLVE_TIME_LIMIT_S)
    assert "offloading on" in result.message, result.message
    assert isinstance(result.plan, Plan)
    assert any(s.op == "offload" for s in result.plan.steps), result.message
    report = verify(model, inputs, loss_fn, result, capture=cap, repeats=0)
    assert report.grads_bitwise_equal
    assert report.measured_dynamic_bytes == report.predicted_dynamic_bytes
    assert report.measured_host_bytes == report.predicted_host_bytes > 0
    if result.fits:
        assert report.measured_peak_bytes <= result.budget_bytes
