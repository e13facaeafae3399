"""``remat.apply``: an ordinary eager loop with the plan's checkpoint regions and offload hooks.

Gradients and buffers equal the unmodified model's bit for bit; memory follows
``torch.utils.checkpoint`` (a block recomputed at once), which approximates the plan: the
figures are compared with the plan on a block-structured model, where it is close.
"""

from __future__ import annotations

import copy
import math
import warnings
from functools import cache
from typing import Any

import pytest
import torch
from _models import SMALL, solve_or_skip
from test_opexec import _offload_candidates, offload_plan

import remat
from remat import solver as solvers
from remat.executor import ExecutorError, ModuleLevelWarning, measure, module_plan, remove
from remat.ir import eager_plan, resolve_budget, simulate
from remat.tracer import capture

# Module-level approximations warn (see remat.executor.module); these tests check the results.
pytestmark = pytest.mark.filterwarnings("ignore::remat.executor.ModuleLevelWarning")

SEED = 99


@cache
def _setup(model_name: str) -> tuple[Any, Any, Any, Any]:
    model, inputs, loss_fn = SMALL[model_name]()
    return model, inputs, loss_fn, capture(model, inputs, loss_fn)


def _eager(model: Any, inputs: Any, loss_fn: Any) -> Any:
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        return measure(model, inputs, loss_fn)


@pytest.mark.parametrize("solver", ["checkpoint-all", "sqrt", "rotor", "milp"])
@pytest.mark.parametrize("model_name", list(SMALL))
def test_apply_keeps_gradients_and_buffers_exact(model_name: str, solver: str) -> None:
    model, inputs, loss_fn, cap = _setup(model_name)
    result = solve_or_skip(solver, cap.graph, resolve_budget(cap.graph, 0.7))
    ref = copy.deepcopy(model)
    run = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ModuleLevelWarning)
        remat.apply(run, result, cap.graph, mode="checkpoint")
    _eager(ref, inputs, loss_fn)
    _eager(run, inputs, loss_fn)
    for (name, p), q in zip(run.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    for (name, b), rb in zip(run.named_buffers(), ref.buffers(), strict=True):
        assert torch.equal(b, rb), name  # batch-norm statistics updated once


def test_apply_follows_a_block_plan_closely() -> None:
    """checkpoint-all on a 3-block GPT: the module-level step frees what the plan frees."""
    from examples.models import build_gpt

    model, inputs, loss_fn = build_gpt(batch=2, seq=32, vocab=64, d_model=32, n_layers=3)
    cap = capture(model, inputs, loss_fn)
    result = solvers.get("checkpoint-all")(cap.graph, resolve_budget(cap.graph, 0.7))
    report = remat.verify(model, inputs, loss_fn, result, executor="module", capture=cap, repeats=0)
    assert report.grads_bitwise_equal
    assert report.measured_dynamic_bytes < 0.5 * report.eager_dynamic_bytes
    assert abs(report.dynamic_error) <= 0.10, str(report)


def test_model_level_ops_are_approximated_or_refused() -> None:
    """The loss's ops live outside any submodule: strict refuses and names compile_step; the
    default approximates and warns."""
    _, _, _, cap = _setup("gpt")
    result = solvers.get("checkpoint-all")(cap.graph, 10**12)
    with pytest.raises(ExecutorError, match=r"remat\.compile_step"):
        module_plan(cap.graph, result.plan, strict=True)
    with pytest.warns(ModuleLevelWarning, match="outside any submodule"):
        mplan = module_plan(cap.graph, result.plan)
    paths = [r.path for r in mplan.regions]
    assert "blocks.0" in paths
    assert "" not in paths
    assert mplan.approximations


def test_apply_needs_the_graph() -> None:
    model, _, _, cap = _setup("mlp")
    with pytest.raises(ExecutorError, match="graph="):
        remat.apply(copy.deepcopy(model), eager_plan(cap.graph), mode="checkpoint")


def test_remove_restores_the_model() -> None:
    model, _, _, cap = _setup("gpt")
    result = solvers.get("checkpoint-all")(cap.graph, 10**12)
    run = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ModuleLevelWarning)
        remat.apply(run, result, cap.graph, mode="checkpoint")
    assert "forward" in run.blocks[0].__dict__
    remove(run)
    assert "forward" not in run.blocks[0].__dict__
    assert not hasattr(run, "_remat_applied")


def test_apply_works_under_autocast() -> None:
    model, inputs, loss_fn, cap = _setup("gpt")
    result = solvers.get("checkpoint-all")(cap.graph, 10**12)
    ref = copy.deepcopy(model)
    run = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ModuleLevelWarning)
        remat.apply(run, result, cap.graph, mode="checkpoint")
    for m in (ref, run):
        with torch.random.fork_rng(), torch.autocast("cpu", dtype=torch.bfloat16):
            torch.manual_seed(SEED)
            loss_fn(m(*inputs)).backward()
    for (name, p), q in zip(run.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_apply_offloads_saved_tensors_to_the_host() -> None:
    model, inputs, loss_fn, cap = _setup("mlp")
    graph = cap.graph
    values = _offload_candidates(graph, 2)
    plan = offload_plan(graph, values)
    report = remat.verify(model, inputs, loss_fn, plan, executor="module", capture=cap, repeats=0)
    assert report.grads_bitwise_equal
    sizes = sum(graph.value(v).size_bytes for v in values)
    assert report.measured_host_bytes == sizes
    eager_dyn = simulate(graph, eager_plan(graph)).peak_dynamic_bytes
    assert report.measured_dynamic_bytes < report.eager_dynamic_bytes == eager_dyn
    sim = simulate(graph, plan, host_bandwidth_bytes_per_s=math.inf)
    assert report.measured_dynamic_bytes == sim.peak_dynamic_bytes


def test_apply_runs_an_offloading_solver_plan_exactly() -> None:
    """pofo on a 3-block GPT offloads dozens of saved tensors: one host copy per storage (no
    copy mixed up with a dead storage's), gradients exact."""
    from examples.models import build_gpt
    from remat.tracer import trace_capture

    model, inputs, loss_fn = build_gpt(batch=2, seq=32, vocab=64, d_model=32, n_layers=3)
    # Costed with this CPU's profile: its host link is as fast as its memory, offloading pays.
    cap = trace_capture(model, inputs, loss_fn, cost="cpu")
    result = solve_or_skip("pofo", cap.graph, resolve_budget(cap.graph, 0.5))
    if not any(s.op == "offload" for s in result.plan.steps):
        pytest.skip("pofo chose no offload with this machine's cost profile")
    report = remat.verify(model, inputs, loss_fn, result, executor="module", capture=cap, repeats=0)
    assert report.grads_bitwise_equal
    assert report.measured_host_bytes == report.predicted_host_bytes
    assert report.measured_dynamic_bytes < report.eager_dynamic_bytes
