"""The op-level executor runs plans exactly: bit-exact gradients, the simulator's peak, RNG replay.

Every example model (small sizes) x every solver the issue names x budgets at 70% and 50% of the
no-remat activation memory. The measured step is the first real step of a fresh model copy
(the executor captures on fake tensors: there is no set-up step).
"""

from __future__ import annotations

import copy
import math
from functools import cache
from typing import Any

import pytest
import torch
from _models import FRACTIONS, SMALL, SOLVERS, solve_expected

from remat import solver as solvers
from remat.executor import ExecutorError, compile_step, measure
from remat.ir import Plan, Step, eager_plan, keep_plan, resolve_budget, simulate
from remat.tracer import capture

SEED = 1234


@cache
def _setup(model_name: str) -> tuple[Any, Any, Any, Any, dict[str, torch.Tensor], Any]:
    """(model, inputs, loss_fn, capture, eager grads, eager measurement), computed once."""
    model, inputs, loss_fn = SMALL[model_name]()
    cap = capture(model, inputs, loss_fn)
    ref = copy.deepcopy(model)
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        mem = measure(ref, inputs, loss_fn)
    grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    return model, inputs, loss_fn, cap, grads, mem


def _run(model_name: str, plan: Any) -> tuple[Any, Any, Any]:
    model, inputs, loss_fn, cap, _, _ = _setup(model_name)
    run_model = copy.deepcopy(model)
    step = compile_step(run_model, inputs, loss_fn, plan, capture=cap)
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        mem = measure(run_model, inputs, loss_fn, step=step)
    return run_model, mem, step


def _assert_same_grads(model: Any, grads: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.equal(p.grad, grads[name]), (
            f"{name}: max |diff| {(p.grad - grads[name]).abs().max().item()}"
        )


@pytest.mark.parametrize("frac", FRACTIONS)
@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("model_name", list(SMALL))
def test_plan_runs_as_simulated(model_name: str, solver: str, frac: float) -> None:
    _, _, _, cap, grads, eager = _setup(model_name)
    graph = cap.graph
    budget = resolve_budget(graph, frac)
    result = solve_expected(model_name, solver, graph, budget, frac)
    if result is None:
        return  # no plan, as _models.NO_PLAN says
    run_model, mem, _ = _run(model_name, result)

    _assert_same_grads(run_model, grads)
    sim = simulate(graph, result.plan)
    assert mem.static_bytes == sim.static_bytes
    # The CPU tracker counts storages exactly as the IR does: the figures agree to the byte
    # (the issue asks for 5%).
    assert mem.peak_dynamic_bytes == pytest.approx(sim.peak_dynamic_bytes, rel=0.05)
    assert mem.peak_dynamic_bytes == sim.peak_dynamic_bytes
    assert mem.peak_bytes == result.peak_bytes
    if result.fits:
        assert mem.peak_bytes <= budget
    if solver == "none":
        assert mem.peak_bytes == eager.peak_bytes


def test_recomputed_dropout_replays_its_random_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """checkpoint-all recomputes the dropout masks of the GPT blocks: with the generator state
    replayed the gradients are exact; without it they are not (the test can fail)."""
    _, _, _, cap, grads, _ = _setup("gpt")
    graph = cap.graph
    result = solvers.get("checkpoint-all")(graph, 10**12)
    counts = result.plan.compute_counts()
    recomputed_rng = [n.id for n in graph.nodes if n.rng and counts[n.id] > 1]
    assert recomputed_rng, "the plan should recompute some dropout"
    run_model, _, step = _run("gpt", result)
    assert f"# recompute {recomputed_rng[0]} " in step.source
    _assert_same_grads(run_model, grads)

    from remat.executor import codegen

    monkeypatch.setattr(codegen.CodeGen, "_replayed", lambda self, counts: set())
    broken, _, _ = _run("gpt", result)
    assert any(not torch.equal(p.grad, grads[n]) for n, p in broken.named_parameters())


def test_second_step_continues_the_random_stream() -> None:
    """Two compiled steps draw the numbers of two eager steps (recomputation restores the
    generator state), and buffers and gradients accumulate the same way."""
    model, inputs, loss_fn, cap, _, _ = _setup("gpt")
    ref = copy.deepcopy(model)
    run_model = copy.deepcopy(model)
    result = solvers.get("checkpoint-all")(cap.graph, 10**12)
    step = compile_step(run_model, inputs, loss_fn, result, capture=cap)
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        for _ in range(2):
            loss_fn(ref(*inputs)).backward()
        ref_state = torch.get_rng_state()
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        step()
        loss = step()
        assert torch.equal(torch.get_rng_state(), ref_state)
    assert loss.shape == ()
    for (name, p), q in zip(run_model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name  # accumulated over two steps


def test_batch_norm_buffers_are_updated_like_eager() -> None:
    model, inputs, loss_fn, cap, _, _ = _setup("resnet")
    ref = copy.deepcopy(model)
    run_model = copy.deepcopy(model)
    loss_fn(ref(*inputs)).backward()
    compile_step(run_model, inputs, loss_fn, eager_plan(cap.graph), capture=cap)()
    for (name, b), rb in zip(run_model.named_buffers(), ref.buffers(), strict=True):
        assert torch.equal(b, rb), name


def test_generated_source_frees_what_the_plan_frees() -> None:
    _, _, _, cap, _, _ = _setup("mlp")
    plan = eager_plan(cap.graph)
    _, _, step = _run("mlp", plan)
    frees = [s.id for s in plan.steps if s.op == "free"]
    for v in frees:
        assert f"del v_{v}" in step.source
    assert step.source.startswith("def _remat_step(")


# -- offload ----------------------------------------------------------------------------------


def offload_plan(graph: Any, values: list[str]) -> Plan:
    """The eager plan, with each value in ``values`` offloaded after its last forward reader and
    prefetched before its first backward reader."""
    steps = list(eager_plan(graph).steps)
    pos = {s.id: i for i, s in enumerate(steps) if s.op == "compute"}
    inserts: list[tuple[int, int, Step]] = []  # (position, prefetch first at a tie, step)
    for v in values:
        readers = graph.consumers_of(v)
        fwd = [pos[n.id] for n in readers if n.phase == "forward"] or [pos[graph.producer_of(v).id]]
        bwd = [pos[n.id] for n in readers if n.phase == "backward"]
        inserts.append((max(fwd) + 1, 1, Step(op="offload", id=v)))
        inserts.append((min(bwd), 0, Step(op="prefetch", id=v)))
    # From the end, so earlier positions stay valid; at one position the prefetch goes in
    # first and the offload lands before it.
    for at, _, step in sorted(inserts, key=lambda x: (-x[0], x[1])):
        steps.insert(at, step)
    return Plan(steps=tuple(steps))


def _offload_candidates(graph: Any, k: int) -> list[str]:
    """The ``k`` largest forward activations that the backward pass reads."""
    cands = []
    for v in graph.values:
        p = graph.producer_of(v.id)
        if v.kind != "activation" or p is None or p.phase != "forward":
            continue
        readers = graph.consumers_of(v.id)
        if any(n.phase == "backward" for n in readers):
            cands.append(v)
    cands.sort(key=lambda v: -v.size_bytes)
    return [v.id for v in cands[:k]]


@pytest.mark.parametrize("model_name", ["mlp", "gpt"])
def test_offload_moves_bytes_to_the_host_as_simulated(model_name: str) -> None:
    _, _, _, cap, grads, eager = _setup(model_name)
    graph = cap.graph
    values = _offload_candidates(graph, 3)
    plan = offload_plan(graph, values)
    sim = simulate(graph, plan, host_bandwidth_bytes_per_s=math.inf)
    eager_sim = simulate(graph, eager_plan(graph))
    assert sim.peak_dynamic_bytes < eager_sim.peak_dynamic_bytes

    run_model, mem, step = _run(model_name, plan)
    _assert_same_grads(run_model, grads)
    # Device side: the tracker never sees the host copies; the peak falls as simulated.
    assert mem.peak_dynamic_bytes == sim.peak_dynamic_bytes
    assert eager.peak_dynamic_bytes - mem.peak_dynamic_bytes == (
        eager_sim.peak_dynamic_bytes - sim.peak_dynamic_bytes
    )
    # Host side: every offloaded copy, counted by storage.
    sizes = sum(graph.value(v).size_bytes for v in values)
    assert step.host.offloaded_bytes == sizes
    assert step.host.prefetched_bytes == sizes
    assert 0 < step.host.peak_bytes <= sizes
    assert step.host.live_bytes == 0


# -- errors -----------------------------------------------------------------------------------


def test_plan_of_another_graph_is_refused() -> None:
    model, inputs, loss_fn, _, _, _ = _setup("mlp")
    _, _, _, other, _, _ = _setup("resnet")
    with pytest.raises(ExecutorError, match="does not fit this model's traced graph"):
        compile_step(model, inputs, loss_fn, eager_plan(other.graph))


def test_result_without_plan_is_refused() -> None:
    model, inputs, loss_fn, cap, _, _ = _setup("mlp")
    result = solvers.get("none")(cap.graph, 1).model_copy(
        update={"plan": None, "status": "infeasible"}
    )
    with pytest.raises(ExecutorError, match="no plan"):
        compile_step(model, inputs, loss_fn, result, capture=cap)


def test_keep_plan_checkpoints_every_other_value() -> None:
    """A hand-made keep set: not a solver's, still exact."""
    _, _, _, cap, grads, _ = _setup("vit")
    graph = cap.graph
    fwd_values = [o for n in graph.nodes if n.phase == "forward" for o in n.outputs]
    plan = keep_plan(graph, fwd_values[::2])
    run_model, mem, _ = _run("vit", plan)
    _assert_same_grads(run_model, grads)
    assert mem.peak_dynamic_bytes == simulate(graph, plan).peak_dynamic_bytes


def test_recomputing_a_value_still_on_the_device_allocates_nothing() -> None:
    """The simulator allocates nothing for a compute whose outputs are all resident (MILP plans
    do this); the executor skips it rather than holding two copies for a moment."""
    _, _, _, cap, grads, _ = _setup("mlp")
    graph = cap.graph
    steps = list(eager_plan(graph).steps)
    first = steps[0].id
    steps.insert(1, Step(op="compute", id=first))
    plan = Plan(steps=tuple(steps))
    run_model, mem, step = _run("mlp", plan)
    assert f"# recompute {first}: its outputs are still here, skipped" in step.source
    _assert_same_grads(run_model, grads)
    assert mem.peak_dynamic_bytes == simulate(graph, plan).peak_dynamic_bytes


def test_compiled_step_takes_new_inputs() -> None:
    """``step(*inputs)`` runs on a new batch of the same shape (a training loop)."""
    model, inputs, loss_fn, cap, _, _ = _setup("gpt")
    (idx,) = inputs
    new_idx = (idx * 7 + 3) % 64
    ref = copy.deepcopy(model)
    run_model = copy.deepcopy(model)
    step = compile_step(
        run_model, inputs, loss_fn, solvers.get("sqrt")(cap.graph, 10**12), capture=cap
    )
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        ref_loss = loss_fn(ref(new_idx))
        ref_loss.backward()
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        loss = step(new_idx)
    assert torch.equal(loss, ref_loss.detach())
    for (name, p), q in zip(run_model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("model_name", list(SMALL))
def test_offloading_solver_plans_run_exactly(model_name: str) -> None:
    """pofo's plans offload and prefetch: device peak as simulated (copies done at once on the
    CPU), host bytes as planned, gradients exact."""
    from remat.executor import verify
    from remat.tracer import trace_capture

    model, inputs, loss_fn, _, _, _ = _setup(model_name)
    # Costed with this CPU's profile: its host link is as fast as its memory, offloading pays.
    cap = trace_capture(model, inputs, loss_fn, cost="cpu")
    graph = cap.graph
    result = solve_expected(model_name, "pofo", graph, resolve_budget(graph, 0.5), 0.5)
    if result is None:
        return  # no plan, as _models.NO_PLAN says
    report = verify(model, inputs, loss_fn, result, capture=cap, repeats=0)
    assert report.grads_bitwise_equal
    assert report.measured_dynamic_bytes == report.predicted_dynamic_bytes
    assert report.measured_host_bytes == report.predicted_host_bytes
    if result.fits:
        assert report.measured_peak_bytes <= result.budget_bytes
