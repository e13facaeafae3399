"""The loop's own loss on the model's output: ``remat.apply`` of a step traced without a loss.

The model returns a tensor (or a ``ModelOutput`` holding one, the logits); the traced step
ends there and its backward takes the output's gradient. The applied module's ``forward``
returns the output, the loop computes its loss, and autograd brings that loss's gradient into
the plan's backward. A user-written loop (own loss, an optimizer, gradient accumulation over
two micro-batches) gives the unmodified model's gradients and parameters bit for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat import solver as solvers
from remat.executor import ExecutorError, compile_step, planned_steps
from remat.ir import resolve_budget
from remat.tracer import TraceError, capture

SEED = 11


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.2), nn.Linear(64, 64), nn.GELU(),
        nn.Dropout(0.2), nn.Linear(64, 10),
    ).train()  # fmt: skip


def _loop(
    model: nn.Module,
    batches: list[tuple[Any, torch.Tensor]],
    loss_of: Callable[[Any, torch.Tensor], torch.Tensor],
    call: Callable[[nn.Module, Any], Any],
) -> list[dict[str, torch.Tensor]]:
    """Two optimizer steps, each over two micro-batches; the gradients before each step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen = []
    torch.manual_seed(SEED)
    for k in range(0, len(batches), 2):
        opt.zero_grad()
        for x, y in batches[k : k + 2]:
            loss = loss_of(call(model, x), y) / 2
            loss.backward()
        seen.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return seen


def _same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    assert len(a) == len(b)
    for ga, gb in zip(a, b, strict=True):
        assert ga.keys() == gb.keys()
        for n in ga:
            assert torch.equal(ga[n], gb[n]), n


def test_tensor_output_own_loss_optimizer_and_accumulation() -> None:
    model = _mlp()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=g), torch.randint(0, 10, (8,), generator=g))]
    batches += [(torch.randn(8, 16, generator=g), torch.randint(0, 10, (8,), generator=g))]
    batches = batches * 2
    cap = capture(model, (batches[0][0],))
    assert cap.output is not None
    assert cap.graph.value(cap.tangent_value).size_bytes == 8 * 10 * 4  # the logits' gradient
    graph = cap.graph
    result = solvers.get("checkpoint-all")(graph, resolve_budget(graph, 0.5))
    assert result.plan is not None
    assert result.plan.compute_counts() != {n.id: 1 for n in graph.nodes}  # it recomputes
    run = remat.apply(  # the loop is under test: checkpoint-all may not fit 50%
        copy.deepcopy(model), result, graph, example_inputs=(batches[0][0],), allow_over_budget=True
    )

    def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y, label_smoothing=0.1)

    def call(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m(x)  # type: ignore[no-any-return]

    _same(_loop(run, batches, loss_of, call), _loop(copy.deepcopy(model), batches, loss_of, call))
    assert len(planned_steps(run)) == 1  # every batch of the traced shape ran the same plan
    for p, q in zip(run.parameters(), model.parameters(), strict=True):
        assert p is not q
    with torch.no_grad():
        out = run.eval()(batches[0][0])  # eval runs the unmodified forward
    assert out.shape == (8, 10)


def test_model_output_of_a_transformers_decoder(tiny_llama: Any) -> None:
    model = tiny_llama
    g = torch.Generator().manual_seed(2)
    ids = [torch.randint(0, 64, (2, 16), generator=g) for _ in range(4)]
    batches = [({"input_ids": x, "use_cache": False}, x) for x in ids]
    cap = capture(model, batches[0][0])  # no labels: the model returns the logits, no loss
    assert cap.output is not None
    result = remat.solve(cap.graph, resolve_budget(cap.graph, 0.5), time_limit_s=5)
    assert result.plan is not None
    run = remat.apply(  # the loop is under test: a 5 s solve may find no plan within 50%
        copy.deepcopy(model),
        result,
        cap.graph,
        example_inputs=batches[0][0],
        allow_over_budget=True,
    )

    def loss_of(out: Any, ids: torch.Tensor) -> torch.Tensor:  # the loop's own shifted loss
        logits = out.logits[:, :-1].reshape(-1, out.logits.shape[-1])
        return F.cross_entropy(logits, ids[:, 1:].reshape(-1))

    def call(m: nn.Module, kw: dict[str, Any]) -> Any:
        return m(**kw)

    got = _loop(run, batches, loss_of, call)
    _same(got, _loop(copy.deepcopy(model), batches, loss_of, call))
    assert type(run(**batches[0][0])).__name__ == "CausalLMOutputWithPast"


def test_outputs_with_several_tensors_need_a_loss_fn() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = self.lin(x)
            return y, y.sum(-1)

    with pytest.raises(TraceError, match="holds 2 tensors"):
        capture(Two(), (torch.randn(2, 4),))


def test_closed_step_and_verify_refuse_an_output_step() -> None:
    model = _mlp()
    x = torch.randn(8, 16)
    cap = capture(model, (x,))
    plan = solvers.get("none")(cap.graph, 10**12).plan
    assert plan is not None
    with pytest.raises(ExecutorError, match="owns its loss"):
        compile_step(model, (x,), None, plan, capture=cap)
    with pytest.raises(ExecutorError, match="owns its loss"):
        remat.verify(model, (x,), None, plan, capture=cap)
