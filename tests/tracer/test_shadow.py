"""Data-independent branches take eager's side while capturing (remat.tracer.shadow)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from remat.tracer import TraceError, capture


class _Branchy(nn.Module):
    """Branches on a tensor made in forward (as transformers' packed-sequence check does)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1]).unsqueeze(0).expand(x.shape[0], -1)
        gaps = (torch.diff(pos, dim=-1) != 1).cumsum(-1)
        if (gaps[:, -1] == 0).all():  # data-independent: always true, eager takes this side
            return self.lin(x).pow(2).sum()
        return self.lin(x).sum()


def _grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    m = copy.deepcopy(model)
    m(x).backward()
    return {n: p.grad for n, p in m.named_parameters() if p.grad is not None}


def test_branch_on_a_tensor_made_in_forward_is_eagers() -> None:
    torch.manual_seed(0)
    model, x = _Branchy(), torch.randn(2, 5, 8)
    cap = capture(model, (x,))
    assert any(n.op == "aten.pow.Tensor_Scalar" for n in cap.graph.nodes)  # eager's side
    prim = cap.primals(model, (x,))
    with torch.no_grad():
        outs = cap.run(prim, [torch.ones(())])
    expected = _grads(model, x)
    got = {n: o for (role, n), o in zip(cap.output_roles, outs, strict=True) if role == "grad"}
    assert got.keys() == expected.keys()
    for n, g in expected.items():
        assert torch.equal(got[n], g), n


class _OnInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x > 0).all():  # the batch's data: no answer while capturing
            return self.lin(x).sum()
        return self.lin(x).pow(2).sum()


def test_branch_on_the_batch_is_still_a_clear_error() -> None:
    with pytest.raises(TraceError, match="DataDependentOutput"):
        capture(_OnInput(), (torch.randn(2, 4),))


class _Poisoned(nn.Module):
    """A known tensor written in place from the batch's data loses its value."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flags = torch.zeros(2, dtype=torch.bool)
        flags.copy_(x[:, 0] > 0)
        if flags.any():
            return self.lin(x).sum()
        return self.lin(x).pow(2).sum()


def test_a_known_tensor_written_from_data_is_unknown() -> None:
    with pytest.raises(TraceError, match="DataDependentOutput"):
        capture(_Poisoned(), (torch.randn(2, 4),))


def test_llama_takes_eagers_mask_path_and_gradients_are_exact(tiny_llama: Any) -> None:
    model = tiny_llama
    ids = torch.randint(0, 64, (2, 16))
    inputs: dict[str, Any] = {"input_ids": ids, "labels": ids, "use_cache": False}

    def loss_fn(out: Any) -> torch.Tensor:
        return out.loss  # type: ignore[no-any-return]

    cap = capture(model, inputs, loss_fn)
    # Eager finds the positions unpacked and uses is_causal with grouped queries: no causal
    # mask is made (the traced path's aten.where), the key/value heads are not repeated.
    assert "aten.where.self" not in [n.op for n in cap.graph.nodes]
    ref = copy.deepcopy(model)
    loss_fn(ref(**inputs)).backward()
    with torch.no_grad():
        outs = cap.run(cap.primals(model, inputs), [torch.ones(())])
    for (role, n), o in zip(cap.output_roles, outs, strict=True):
        if role == "grad":
            p = ref.get_parameter(n)
            assert p.grad is not None and torch.equal(o, p.grad), n


class _ReadsItsMask(nn.Module):
    """Reads the batch's ``attention_mask`` in its own forward, outside transformers' masking
    questions: the batch's data answers nothing there."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if attention_mask.bool().all():
            return self.lin(x).sum()
        return self.lin(x).pow(2).sum()


def test_the_batch_mask_answers_only_transformers_masking_questions() -> None:
    inputs = {"x": torch.randn(2, 4), "attention_mask": torch.ones(2, 3, dtype=torch.long)}
    with pytest.raises(TraceError, match="DataDependentOutput"):
        capture(_ReadsItsMask(), inputs)


@pytest.mark.parametrize("padded", [False, True])
def test_bert_mask_as_eager_decides(padded: bool) -> None:
    # BERT asks transformers' bidirectional question (`_ignore_bidirectional_mask_sdpa`) of its
    # attention mask: with no token masked eager skips the mask; the capture answers alike, and
    # the fake replay of the plain step (measure_fake) reads the same data.
    import sys
    from pathlib import Path

    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parents[1] / "zoo"))
    import _zoo

    from remat.executor import measure
    from remat.executor.measure import measure_fake
    from remat.ir import eager_plan, simulate

    torch.manual_seed(0)
    model, inputs, loss_fn = _zoo.ZOO["bert"]()
    mask = torch.ones_like(inputs["input_ids"])
    if padded:
        mask[0, -3:] = 0
    inputs = {**inputs, "attention_mask": mask}
    graph = capture(model, inputs, loss_fn).graph
    assert any(n.op == "aten.where.self" for n in graph.forward_nodes) == padded
    plain = measure(model, inputs, loss_fn).peak_dynamic_bytes
    assert measure_fake(model, inputs, loss_fn).peak_dynamic_bytes == plain
    predicted = simulate(graph, eager_plan(graph)).peak_dynamic_bytes
    assert plain <= predicted <= plain + 4, (plain, predicted)
