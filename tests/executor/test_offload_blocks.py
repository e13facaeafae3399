"""Offloaded blocks in checkpoint mode: a block's saved tensors in host memory, exact.

Hand-made plans of the checkpoint class on a GPT with dropout (offloaded blocks alone, all of
them, beside a checkpoint region) and a plan that ``remat.solve(..., executor="checkpoint")``
finds on a graph whose device has a host link: the device peak measured to the byte against the
simulator (the CPU's copies finish at once: predicted with a free link), the host bytes as
planned, gradients bit for bit. The two-process FSDP2 case is in ``test_fsdp.py``.
"""

from __future__ import annotations

import copy
import math
from functools import cache
from typing import Any

import pytest
import torch

import remat
from remat.executor import measure, remove, verify
from remat.executor.module import applied_plan
from remat.ir import HostLink, checkpoint_class, simulate
from remat.ir.devices import get_profile
from remat.tracer import capture

SEED = 7


@cache
def _gpt() -> tuple[Any, Any, Any, Any]:
    from examples.models import build_gpt

    model, inputs, loss_fn = build_gpt(
        batch=2, seq=32, vocab=64, d_model=32, n_layers=3, n_heads=2, dropout=0.1
    )
    return model, inputs, loss_fn, capture(model, inputs, loss_fn).graph


def _step(model: Any, inputs: Any, loss_fn: Any) -> Any:
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        return measure(model, inputs, loss_fn)


@pytest.mark.parametrize(
    ("regions", "offloaded"),
    [
        ((), ("blocks.0",)),
        ((), ("blocks.0", "blocks.1", "blocks.2")),
        (("blocks.2",), ("blocks.0", "blocks.1")),
    ],
    ids=["one", "all", "beside-a-region"],
)
def test_offloaded_blocks_run_as_simulated(
    regions: tuple[str, ...], offloaded: tuple[str, ...]
) -> None:
    model, inputs, loss_fn, graph = _gpt()
    plan = checkpoint_class.checkpoint_plan(
        graph, [checkpoint_class.region(graph, r) for r in regions], offloaded
    )
    assert checkpoint_class.in_class(graph, plan)
    assert checkpoint_class.offloads_of(graph, plan) == list(offloaded)
    sim = simulate(graph, plan, host_bandwidth_bytes_per_s=math.inf)
    moved = sum(graph.value(s.id).size_bytes for s in plan.steps if s.op == "offload")
    assert moved > 0 and sim.offload_bytes == sim.prefetch_bytes == moved

    ref, run = copy.deepcopy(model), copy.deepcopy(model)
    remat.apply(run, plan, graph, mode="checkpoint")
    eager = _step(ref, inputs, loss_fn)
    mem = _step(run, inputs, loss_fn)
    for (n, p), q in zip(run.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n
    assert mem.peak_dynamic_bytes == sim.peak_dynamic_bytes < eager.peak_dynamic_bytes
    hosts = applied_plan(run).hosts  # type: ignore[union-attr]
    assert [str(d) for d in hosts] == ["cpu"]
    (host,) = hosts.values()
    # measure runs the step once: every planned storage moved out and back once, all freed
    assert host.offloaded_bytes == host.prefetched_bytes == moved
    assert host.peak_bytes == sim.host_peak_bytes
    assert host.live_bytes == 0

    remove(run)
    assert "forward" not in run.get_submodule(offloaded[0]).__dict__
    assert applied_plan(run) is None


def test_a_block_is_not_both_a_region_and_offloaded() -> None:
    _, _, _, graph = _gpt()
    with pytest.raises(ValueError, match="both a checkpoint region and offloaded"):
        checkpoint_class.checkpoint_plan(
            graph, [checkpoint_class.region(graph, "blocks.1")], ["blocks.1"]
        )


def test_solve_offloads_blocks_where_the_link_hides_the_copies() -> None:
    """With a host link on the graph's device the class search offloads blocks instead of
    recomputing them: faster than the recompute-only class at the same budget, and the plan
    runs exactly (verify: predicted with a free link on the CPU, host bytes as planned)."""
    model, inputs, loss_fn, _ = _gpt()
    graph = remat.trace(model, inputs, loss_fn, cost="flops")  # costed: copies compete
    link = HostLink(device_to_host_bytes_per_s=1e15, host_to_device_bytes_per_s=1e15,
                    latency_s=0.0, host_memory_bytes=2**30)  # fmt: skip
    device = get_profile("h100").model_copy(
        update={"host_link": link, "host_bandwidth_bytes_per_s": 1e15}
    )
    fast = graph.model_copy(update={"device": device})
    budget = remat.ir.resolve_budget(fast, 0.5)
    recompute = remat.solve(fast, budget, solver="checkpoint-all", executor="checkpoint",
                            offload=False)  # fmt: skip
    result = remat.solve(fast, budget, solver="checkpoint-all", executor="checkpoint")
    assert recompute.fits and result.fits and result.plan is not None
    assert checkpoint_class.offloads_of(fast, result.plan)
    assert "offloaded blocks" in (result.message or "")
    assert result.total_time_s is not None and recompute.total_time_s is not None
    assert result.total_time_s < recompute.total_time_s
    report = verify(model, inputs, loss_fn, result, executor="checkpoint", repeats=0)
    assert report.grads_bitwise_equal
    assert report.measured_dynamic_bytes == report.predicted_dynamic_bytes
    assert report.measured_host_bytes == report.predicted_host_bytes > 0
    assert report.measured_peak_bytes <= budget
