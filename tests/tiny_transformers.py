"""Tiny transformers models the tests share (random weights, two layers, seconds on 2 cores)."""

from __future__ import annotations

from typing import Any

import torch


def tiny_llama() -> Any:
    """A two-layer LlamaForCausalLM of width 32 in training mode, its config's defaults kept
    (``use_cache=True``, as transformers' decoders ship), weights seeded with 0."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()
