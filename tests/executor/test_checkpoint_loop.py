"""``remat.apply(..., mode="checkpoint")`` in an ordinary training loop, as op mode is tested
in ``test_apply.py``: an optimizer over new batches with gradient accumulation, autocast with
``GradScaler``, ``eval()``, ``state_dict`` and parameter identity."""

from __future__ import annotations

import copy
from typing import Any

import torch

import remat
from examples.models import build_gpt
from remat.executor import remove
from remat.ir import resolve_budget
from remat.tracer import capture

SEED = 5


def _applied(**kw: Any) -> tuple[Any, Any, Any, Any]:
    model, inputs, loss_fn = build_gpt(
        batch=2, seq=16, vocab=64, d_model=32, n_layers=2, n_heads=2, dropout=0.1
    )
    if kw.get("autocast"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cap = capture(model, inputs, loss_fn)
    else:
        cap = capture(model, inputs, loss_fn)
    result = remat.solve(cap.graph, resolve_budget(cap.graph, 0.5), executor="checkpoint")
    assert result.plan is not None and "blocks" in result.message  # regions were chosen
    # The loop is under test, not the budget: at 50% the class may have no plan that fits.
    run = remat.apply(
        copy.deepcopy(model), result, cap.graph, mode="checkpoint", allow_over_budget=True
    )
    return model, inputs, loss_fn, run


def test_optimizer_loop_with_accumulation_over_new_batches() -> None:
    model, inputs, loss_fn, run = _applied()
    (idx,) = inputs
    batches = [((idx + k) % 64,) for k in range(4)]
    ref = copy.deepcopy(model)
    for m in (ref, run):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        torch.manual_seed(SEED)
        for k in (0, 2):
            opt.zero_grad()
            for b in batches[k : k + 2]:
                (loss_fn(m(*b)) / 2).backward()
            opt.step()
    for (name, p), q in zip(run.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_autocast_with_grad_scaler() -> None:
    model, inputs, loss_fn, run = _applied(autocast=True)
    ref = copy.deepcopy(model)
    for m in (ref, run):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        torch.manual_seed(SEED)
        for _ in range(2):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(m(*inputs))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    for (name, p), q in zip(run.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_eval_state_dict_and_identity_are_unchanged() -> None:
    model, inputs, _loss_fn, _ = _applied()
    run = copy.deepcopy(model)
    params = list(run.parameters())
    state = {k: v.clone() for k, v in run.state_dict().items()}
    graph = capture(model, inputs, _loss_fn).graph
    result = remat.solve(graph, resolve_budget(graph, 0.5), executor="checkpoint")
    remat.apply(run, result, graph, mode="checkpoint", allow_over_budget=True)
    assert all(p is q for p, q in zip(run.parameters(), params, strict=True))
    assert run.state_dict().keys() == state.keys()
    assert all(torch.equal(run.state_dict()[k], v) for k, v in state.items())
    run.eval()
    ref = copy.deepcopy(model).eval()
    with torch.no_grad():
        assert torch.equal(run(*inputs), ref(*inputs))
    remove(run)
    assert all(p is q for p, q in zip(run.parameters(), params, strict=True))
