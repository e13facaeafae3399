"""Small configurations of transformers models, random weights (nothing is downloaded).

Each builder returns ``(model, inputs, loss_fn)`` in the training configuration: ``train()``
mode, ``use_cache=False`` where the model has a cache, labels in the inputs so that the model
computes its own loss (``loss_fn`` picks it from the model's output).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

BATCH, SEQ, VOCAB = 2, 16, 96


def _loss(out: Any) -> torch.Tensor:
    loss: torch.Tensor = out.loss
    return loss


def _lm(model: Any, *, labels: bool = True, cache: bool = True) -> tuple[Any, Any, Any]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    inputs: dict[str, Any] = {"input_ids": ids, "labels": ids.clone()}
    if cache:
        inputs["use_cache"] = False
    return model.train(), inputs, _loss


def gpt2() -> tuple[Any, Any, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=SEQ)
    return _lm(_seeded(GPT2LMHeadModel, cfg))


def llama() -> tuple[Any, Any, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
    )
    return _lm(_seeded(LlamaForCausalLM, cfg))


def mistral() -> tuple[Any, Any, Any]:
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        sliding_window=8,
    )
    return _lm(_seeded(MistralForCausalLM, cfg))


def mixtral() -> tuple[Any, Any, Any]:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    return _lm(_seeded(MixtralForCausalLM, cfg))


def opt() -> tuple[Any, Any, Any]:
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        vocab_size=VOCAB,
        word_embed_proj_dim=32,
        max_position_embeddings=SEQ,
    )
    return _lm(_seeded(OPTForCausalLM, cfg))


def bert() -> tuple[Any, Any, Any]:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
    )
    return _lm(_seeded(BertForMaskedLM, cfg), cache=False)


def t5() -> tuple[Any, Any, Any]:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        d_model=32,
        d_ff=64,
        d_kv=16,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        vocab_size=VOCAB,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return _lm(_seeded(T5ForConditionalGeneration, cfg))


def whisper() -> tuple[Any, Any, Any]:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=16,
        max_source_positions=16,
        max_target_positions=SEQ,
        vocab_size=VOCAB,
        decoder_start_token_id=1,
        pad_token_id=0,
    )
    model = _seeded(WhisperForConditionalGeneration, cfg)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(BATCH, 16, 32, generator=g)  # (batch, mel bins, 2 x source positions)
    labels = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
    return model.train(), {"input_features": feats, "labels": labels, "use_cache": False}, _loss


def _seeded(cls: Any, cfg: Any) -> Any:
    torch.manual_seed(0)
    return cls(cfg)


ZOO: dict[str, Callable[[], tuple[Any, Any, Any]]] = {
    "gpt2": gpt2,
    "llama": llama,
    "mistral": mistral,
    "t5": t5,
    "opt": opt,
    "bert": bert,
    "whisper": whisper,
    "mixtral": mixtral,
}
