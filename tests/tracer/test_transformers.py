"""transformers models in their training configuration trace, and run as eager does.

Small configurations with random weights (nothing is downloaded)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from remat.executor.verify import verify
from remat.ir import eager_plan
from remat.tracer import capture

T = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ = 128, 2, 16


def _llama_like(cls_cfg: Any, cls_model: Any, **extra: Any) -> torch.nn.Module:
    cfg = cls_cfg(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        **extra,
    )
    return cls_model(cfg).train()


def _loss(out: Any) -> torch.Tensor:
    return out.loss


def _inputs() -> dict[str, Any]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def _check_eager_plan(model: torch.nn.Module) -> None:
    inputs = _inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cap = capture(model, inputs, _loss)
        report = verify(model, inputs, _loss, eager_plan(cap.graph), capture=cap, repeats=0)
    assert report.grads_bitwise_equal, report.grad_max_abs_diff
    assert report.measured_dynamic_bytes == pytest.approx(report.predicted_dynamic_bytes, rel=0.01)


def test_gpt2_without_cache_traces_and_runs_as_eager() -> None:
    # transformers' masking code read tensor data behind an is_tracing() guard that did not
    # recognise the capture's FunctionalTensors: "cannot trace op TensorBase.item".
    torch.manual_seed(0)
    cfg = T.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    _check_eager_plan(T.GPT2LMHeadModel(cfg).train())


@pytest.mark.slow
def test_llama_without_cache_traces_and_runs_as_eager() -> None:
    torch.manual_seed(0)
    _check_eager_plan(_llama_like(T.LlamaConfig, T.LlamaForCausalLM))


def test_mixtral_grouped_mm_traces_in_float32() -> None:
    # Mixtral's default experts implementation calls torch._grouped_mm, whose meta kernel
    # demanded bfloat16 while the CPU kernel runs float32.
    torch.manual_seed(0)
    model = _llama_like(
        T.MixtralConfig, T.MixtralForCausalLM, num_local_experts=4, num_experts_per_tok=2
    )
    cap = capture(model, _inputs(), _loss)
    assert any(n.op == "aten._grouped_mm.default" for n in cap.graph.nodes)
    _check_eager_plan(model)


def test_the_patches_are_undone() -> None:
    from transformers.utils import import_utils

    before = import_utils.is_fake_tensor
    from torch._subclasses import fake_impls

    checks = list(fake_impls.op_implementations_checks)
    torch.manual_seed(0)
    capture(_llama_like(T.LlamaConfig, T.LlamaForCausalLM), _inputs(), _loss)
    assert import_utils.is_fake_tensor is before
    assert fake_impls.op_implementations_checks == checks
