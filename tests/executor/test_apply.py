"""``remat.apply`` (op-level, inside autograd): an ordinary training loop runs the plan exactly.

Every example model (small sizes) x solvers x budgets at 70% and 50%: the first real step of a
fresh copy, driven by ``loss.backward()``, gives the unmodified model's gradients bit for bit
and the simulator's dynamic peak (within 2%, never over the budget). Then what a loop does:
an optimizer over several steps, gradient accumulation, autocast with ``GradScaler``, eval
mode, ``state_dict``, new batches, other shapes, a second backward.
"""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

import pytest
import torch
from _models import FRACTIONS, SMALL, solve_expected

import remat
from remat import solver as solvers
from remat.executor import ExecutorError, measure, planned_steps, remove
from remat.ir import eager_plan, resolve_budget
from remat.tracer import capture

SEED = 4321
SOLVERS = ["none", "checkpoint-all", "rotor"]  # milp plans: test_opexec (same code generation)


@cache
def _setup(model_name: str) -> tuple[Any, Any, Any, Any, dict[str, torch.Tensor]]:
    model, inputs, loss_fn = SMALL[model_name]()
    cap = capture(model, inputs, loss_fn)
    ref = copy.deepcopy(model)
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        loss_fn(ref(*inputs)).backward()
    return model, inputs, loss_fn, cap, {n: p.grad.clone() for n, p in ref.named_parameters()}


def _applied(model_name: str, result: Any) -> Any:
    model, inputs, loss_fn, cap, _ = _setup(model_name)
    run = copy.deepcopy(model)
    # Plans over their budget too ("none" at 50%): the prediction is checked on every plan,
    # the budget where the plan fits.
    return remat.apply(
        run, result, cap.graph, example_inputs=inputs, loss_fn=loss_fn, allow_over_budget=True
    )


@pytest.mark.parametrize("frac", FRACTIONS)
@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("model_name", list(SMALL))
def test_first_step_is_exact(model_name: str, solver: str, frac: float) -> None:
    _model, inputs, _loss_fn, cap, grads = _setup(model_name)
    budget = resolve_budget(cap.graph, frac)
    result = solve_expected(model_name, solver, cap.graph, budget, frac)
    if result is None:
        return  # no plan, as _models.NO_PLAN says
    run = _applied(model_name, result)
    (step,) = planned_steps(run)
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        mem = measure(run, inputs, None)  # forward returns the loss; loss.backward()
    for name, p in run.named_parameters():
        assert torch.equal(p.grad, grads[name]), name
    predicted = step.simulation.peak_dynamic_bytes
    assert abs(mem.peak_dynamic_bytes - predicted) <= 0.02 * predicted
    assert mem.peak_bytes == step.simulation.peak_bytes  # exact on the CPU
    if result.status in ("optimal", "feasible"):
        assert mem.peak_bytes <= budget


def test_optimizer_loop_and_accumulation_match_eager() -> None:
    """Three steps of Adam, each accumulating two micro-batches, as a user writes them."""
    model, inputs, loss_fn, cap, _ = _setup("gpt")
    result = solvers.get("checkpoint-all")(cap.graph, 10**12)
    (idx,) = inputs
    batches = [((idx + k) % 64,) for k in range(6)]
    ref = copy.deepcopy(model)
    run = remat.apply(copy.deepcopy(model), result, cap.graph, loss_fn=loss_fn)
    for m, forward in ((ref, lambda m, b: loss_fn(m(*b))), (run, lambda m, b: m(*b))):
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        torch.manual_seed(SEED)
        for k in range(3):
            opt.zero_grad()
            for b in batches[2 * k : 2 * k + 2]:
                (forward(m, b) / 2).backward()
            opt.step()
    for (name, p), q in zip(run.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert len(planned_steps(run)) == 1  # new batches of the traced shape: one capture


def test_autocast_with_grad_scaler() -> None:
    """Traced under autocast (the casts are in the graph), run under autocast with a scaler."""
    model, inputs, loss_fn, _, _ = _setup("mlp")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cap = capture(model, inputs, loss_fn)
    result = solvers.get("checkpoint-all")(cap.graph, 10**12)
    ref = copy.deepcopy(model)
    run = remat.apply(copy.deepcopy(model), result, cap.graph, loss_fn=loss_fn)
    for m, forward in ((ref, lambda m: loss_fn(m(*inputs))), (run, lambda m: m(*inputs))):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for _ in range(2):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = forward(m)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    for (name, p), q in zip(run.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), name
    # Without autocast the call is another step than the traced one: refused, not misrun.
    with pytest.raises(ExecutorError, match=r"autocast|inputs"):
        run(*inputs)


def test_eval_state_dict_and_identity_are_unchanged() -> None:
    model, inputs, loss_fn, cap, _ = _setup("resnet")
    result = solvers.get("checkpoint-all")(cap.graph, 10**12)
    run = copy.deepcopy(model)
    params = list(run.parameters())
    keys = list(run.state_dict())
    remat.apply(run, result, cap.graph, loss_fn=loss_fn)
    assert list(run.parameters()) == params and all(
        p is q for p, q in zip(run.parameters(), params, strict=True)
    )
    assert list(run.state_dict()) == keys
    run.eval()
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        assert torch.equal(run(*inputs), ref(*inputs))  # the unmodified forward: the output
    assert planned_steps(run) == []  # nothing captured for eval
    run.train()
    with torch.no_grad():
        assert run(*inputs).shape == ref(*inputs).shape  # no grad: unmodified too
    remove(run)
    assert "forward" not in run.__dict__


def test_other_shapes_are_refused_or_replanned() -> None:
    model, inputs, loss_fn, cap, _ = _setup("mlp")
    (x,) = inputs
    result = solvers.get("checkpoint-all")(cap.graph, 10**12)
    run = remat.apply(
        copy.deepcopy(model), result, cap.graph, example_inputs=inputs, loss_fn=loss_fn
    )
    with pytest.raises(ExecutorError, match=r"\(16, 32\).*\(8, 32\)"):
        run(x[:8])

    def replan(graph: Any) -> Any:
        return solvers.get("checkpoint-all")(graph, 10**12)

    def loss_of(out: torch.Tensor) -> torch.Tensor:
        return out.square().mean()

    base = copy.deepcopy(model)
    graph = capture(base, inputs, loss_of).graph
    result = solvers.get("checkpoint-all")(graph, 10**12)
    run = remat.apply(copy.deepcopy(base), result, graph, loss_fn=loss_of, replan=replan)
    ref = copy.deepcopy(base)
    for batch in (x, x[:8], x[:8] + 1):
        run(batch).backward()
        loss_of(ref(batch)).backward()
    for (name, p), q in zip(run.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    assert len(planned_steps(run)) == 2  # one per shape


def test_plan_of_another_graph_is_refused() -> None:
    model, inputs, loss_fn, _cap, _ = _setup("mlp")
    other = _setup("gpt")[3].graph
    with pytest.raises(ExecutorError, match="does not fit"):
        remat.apply(copy.deepcopy(model), eager_plan(other), example_inputs=inputs, loss_fn=loss_fn)


def test_second_backward_is_a_clear_error() -> None:
    _model, inputs, _loss_fn, cap, _ = _setup("mlp")
    run = _applied("mlp", eager_plan(cap.graph))
    loss = run(*inputs)
    loss.backward(retain_graph=True)
    with pytest.raises(ExecutorError, match="once per forward"):
        loss.backward()


def test_bad_mode_is_a_value_error() -> None:
    model, _, _, cap, _ = _setup("mlp")
    with pytest.raises(ValueError, match="mode"):
        remat.apply(copy.deepcopy(model), eager_plan(cap.graph), mode="fast")


@pytest.mark.parametrize("mode", ["op", "checkpoint"])
def test_a_plan_over_its_budget_is_refused_unless_asked(mode: str) -> None:
    # "none" at 50% answers infeasible with the eager plan, which peaks above the budget: a
    # step never runs over the budget it was planned for unless the caller says so.
    model, inputs, loss_fn, cap, grads = _setup("mlp")
    executor = "op" if mode == "op" else "checkpoint"
    budget = resolve_budget(cap.graph, 0.5)
    result = solvers.solve(cap.graph, budget, solver="none", executor=executor)
    assert result.plan is not None and result.peak_bytes > result.budget_bytes
    with pytest.raises(ExecutorError, match=r"over its budget .*allow_over_budget=True"):
        remat.apply(copy.deepcopy(model), result, cap.graph, mode=mode)
    run = remat.apply(
        copy.deepcopy(model),
        result,
        cap.graph,
        example_inputs=inputs if mode == "op" else None,
        loss_fn=loss_fn if mode == "op" else None,
        mode=mode,
        allow_over_budget=True,
    )
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        mem = measure(run, inputs, None if mode == "op" else loss_fn)
    for name, p in run.named_parameters():
        assert torch.equal(p.grad, grads[name]), name
    assert mem.peak_bytes > result.budget_bytes  # what it was asked to do, measured


def test_probe_steps_calls_the_probe_after_every_plan_step_and_keeps_the_gradients() -> None:
    from remat.executor.autograd import probe_steps

    _model, inputs, _loss_fn, cap, grads = _setup("gpt")
    result = remat.solve(cap.graph, 0.5, solver="checkpoint-all")
    run = _applied("gpt", result)
    seen: list[int] = []
    probe_steps(run, seen.append)
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        run(*inputs).backward()
    (step,) = planned_steps(run)
    assert seen == list(range(len(step.plan.steps)))
    for name, p in run.named_parameters():
        assert torch.equal(p.grad, grads[name]), name
    probe_steps(run, None)
    seen.clear()
    run.zero_grad(set_to_none=True)
    run(*inputs).backward()
    assert seen == []
    with pytest.raises(ExecutorError, match=r"probe_steps needs a model given to remat\.apply"):
        probe_steps(copy.deepcopy(_model), seen.append)
