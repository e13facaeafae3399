"""Small configurations of transformers models, random weights (nothing is downloaded).

Each entry of :data:`ZOO` builds ``(model, inputs, loss_fn)`` in the training configuration:
``train()`` mode, ``use_cache=False`` where the model has a cache, labels in the inputs so that
the model computes its own loss (``loss_fn`` picks it from the model's output). The models are
described by :data:`SPECS` (transformers class names and config settings) and all built by
:func:`build`.
"""

from __future__ import annotations

import copy
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

BATCH, SEQ, VOCAB = 2, 16, 96

# What the decoders share: two layers of width 32, grouped-query attention (4 heads, 2 for keys
# and values), positions up to SEQ.
_DECODER: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": SEQ,
}


@dataclass(frozen=True)
class Spec:
    """One zoo model: its transformers config and model classes, the config's settings, and
    what its inputs are."""

    config: str
    model: str
    settings: dict[str, Any] = field(default_factory=dict)
    cache: bool = True
    """The model has a key/value cache (``use_cache=False`` is passed, as in training)."""
    audio: bool = False
    """Speech input (log-mel features) instead of token ids; the labels are the decoder's."""


SPECS: dict[str, Spec] = {
    "gpt2": Spec(
        "GPT2Config",
        "GPT2LMHeadModel",
        {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": VOCAB, "n_positions": SEQ},
    ),
    "llama": Spec("LlamaConfig", "LlamaForCausalLM", _DECODER),
    "mistral": Spec("MistralConfig", "MistralForCausalLM", {**_DECODER, "sliding_window": 8}),
    "t5": Spec(
        "T5Config",
        "T5ForConditionalGeneration",
        {
            "d_model": 32,
            "d_ff": 64,
            "d_kv": 16,
            "num_layers": 2,
            "num_decoder_layers": 2,
            "num_heads": 2,
            "vocab_size": VOCAB,
            "decoder_start_token_id": 0,
            "pad_token_id": 0,
        },
    ),
    "opt": Spec(
        "OPTConfig",
        "OPTForCausalLM",
        {
            "hidden_size": 32,
            "ffn_dim": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "vocab_size": VOCAB,
            "word_embed_proj_dim": 32,
            "max_position_embeddings": SEQ,
        },
    ),
    "bert": Spec(
        "BertConfig",
        "BertForMaskedLM",
        {
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "intermediate_size": 64,
            "vocab_size": VOCAB,
            "max_position_embeddings": SEQ,
        },
        cache=False,
    ),
    "whisper": Spec(
        "WhisperConfig",
        "WhisperForConditionalGeneration",
        {
            "d_model": 32,
            "encoder_layers": 1,
            "decoder_layers": 1,
            "encoder_attention_heads": 2,
            "decoder_attention_heads": 2,
            "encoder_ffn_dim": 64,
            "decoder_ffn_dim": 64,
            "num_mel_bins": 16,
            "max_source_positions": 16,
            "max_target_positions": SEQ,
            "vocab_size": VOCAB,
            "decoder_start_token_id": 1,
            "pad_token_id": 0,
        },
        audio=True,
    ),
    "mixtral": Spec(
        "MixtralConfig",
        "MixtralForCausalLM",
        {**_DECODER, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
}


def _loss(out: Any) -> torch.Tensor:
    loss: torch.Tensor = out.loss
    return loss


def _inputs(spec: Spec) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    if spec.audio:
        feats = torch.randn(BATCH, 16, 32, generator=g)  # (batch, mel bins, 2 x source positions)
        labels = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
        return {"input_features": feats, "labels": labels, "use_cache": False}
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    inputs: dict[str, Any] = {"input_ids": ids, "labels": ids.clone()}
    if spec.cache:
        inputs["use_cache"] = False
    return inputs


def build(name: str) -> tuple[Any, Any, Any]:
    """``(model, inputs, loss_fn)`` for zoo model ``name``: weights seeded with 0, inputs
    from their own generator seeded with 0."""
    spec = SPECS[name]
    transformers = importlib.import_module("transformers")
    cfg = getattr(transformers, spec.config)(**spec.settings)
    torch.manual_seed(0)
    model = getattr(transformers, spec.model)(cfg)
    return model.train(), _inputs(spec), _loss


ZOO: dict[str, Callable[[], tuple[Any, Any, Any]]] = {
    name: functools.partial(build, name) for name in SPECS
}


def reference_grads(model: Any, inputs: Any, loss_fn: Any, seed: int) -> dict[str, torch.Tensor]:
    """The unmodified model's parameter gradients for one step (on a copy; the random numbers
    seeded with ``seed``)."""
    ref = copy.deepcopy(model)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        loss_fn(ref(**inputs)).backward()
    return {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


@dataclass(frozen=True)
class Case:
    """One zoo case run: the plan, the applied copy of the model (its ``.grad`` set by the
    step), the measured step and the simulator's figures for it."""

    result: Any
    run: Any
    measured: Any
    simulation: Any


def run_case(
    model: Any,
    inputs: Any,
    loss_fn: Any,
    cap: Any,
    budget_bytes: int,
    mode: str,
    *,
    time_limit_s: float,
    seed: int,
) -> Case:
    """Solve ``cap``'s graph for ``mode`` (``"op"``: ``auto``'s plan through ``remat.apply``;
    ``"checkpoint"``: a plan of the checkpoint class through ``mode="checkpoint"``), apply it
    to a copy of ``model`` and run one plain training step on it, measured, as a user's loop
    writes it: ``model(**batch)`` returns the loss (op level), or the model's own output whose
    ``loss`` is taken (checkpoint regions), then ``loss.backward()``."""
    import remat
    from remat.executor import measure, planned_steps
    from remat.ir import simulate

    graph = cap.graph
    if mode == "op":
        result = remat.solve(graph, budget_bytes, time_limit_s=time_limit_s)
        assert result.plan is not None, result.message
        # An infeasible answer's plan (the smallest found) is run too: its prediction is
        # checked like any other, and the test asserts the budget only where the plan fits.
        run = remat.apply(
            copy.deepcopy(model),
            result,
            graph,
            example_inputs=inputs,
            loss_fn=loss_fn,
            capture=cap,
            allow_over_budget=True,
        )

        def step() -> None:
            loss = run(**inputs)
            loss.backward()

    else:
        result = remat.solve(graph, budget_bytes, time_limit_s=time_limit_s, executor="checkpoint")
        assert result.plan is not None, result.message
        run = remat.apply(
            copy.deepcopy(model), result, graph, mode="checkpoint", allow_over_budget=True
        )

        def step() -> None:
            loss = loss_fn(run(**inputs))
            loss.backward()

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        mem = measure(run, inputs, step=step)
    sim = planned_steps(run)[0].simulation if mode == "op" else simulate(graph, result.plan)
    return Case(result, run, mem, sim)
