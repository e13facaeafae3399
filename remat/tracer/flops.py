"""FLOP counts of captured ATen ops, from shapes alone (fake tensors are enough).

torch's own counter (``torch.utils.flop_counter``) covers matrix products, convolutions and the
GPU attention kernels; this module uses its registry and adds formulas for the ops it misses,
first of all the CPU attention kernels (``_scaled_dot_product_flash_attention_for_cpu`` and its
backward), which torch counts as 0.

Conventions (those of torch's counter): a multiply-add is 2 FLOPs; element-wise ops, reductions,
normalisations and softmax count 0 (they are memory-bound, which the roofline cost model charges
through bytes moved, not FLOPs). Causal attention counts half the score and value products, as
the CPU flash kernel skips the masked blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten

FlopFormula = Callable[..., int]

# Formulas torch's registry lacks, keyed by OpOverloadPacket. Each takes the op's arguments
# with tensors replaced by their shapes, plus ``out_shape``.
EXTRA_FLOP_FORMULAS: dict[Any, FlopFormula] = {}


def register_flop_formula(*ops: Any) -> Callable[[FlopFormula], FlopFormula]:
    """Register a shape-based FLOP formula for ops that torch's counter does not know."""

    def deco(fn: FlopFormula) -> FlopFormula:
        for op in ops:
            EXTRA_FLOP_FORMULAS[getattr(op, "overloadpacket", op)] = fn
        return fn

    return deco


def _attention_products(q: Sequence[int], k: Sequence[int], v: Sequence[int], causal: bool) -> int:
    """FLOPs of ``softmax(q k^T) v``: two batched products, halved when causal."""
    *batch_q, s_q, d_q = q
    *_, s_k, _ = k
    d_v = v[-1]
    b = 1
    for x in batch_q:
        b *= int(x)
    flops = 2 * b * s_q * s_k * d_q + 2 * b * s_q * s_k * d_v
    return flops // 2 if causal else flops


@register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu)
def _sdpa_cpu_fwd(
    query: Sequence[int],
    key: Sequence[int],
    value: Sequence[int],
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    return _attention_products(query, key, value, bool(is_causal))


@register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu_backward)
def _sdpa_cpu_bwd(
    grad_out: Sequence[int],
    query: Sequence[int],
    key: Sequence[int],
    value: Sequence[int],
    out: Sequence[int],
    logsumexp: Sequence[int],
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    # Recompute the scores (1 product), then dV, dP, dQ, dK (4 products): 5 in all, where the
    # forward has 2, so backward = 2.5x forward, as torch's GPU formulas give.
    return 5 * _attention_products(query, key, value, bool(is_causal)) // 2


@register_flop_formula(aten._scaled_dot_product_attention_math)
def _sdpa_math(
    query: Sequence[int],
    key: Sequence[int],
    value: Sequence[int],
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    return _attention_products(query, key, value, False)


def _shape(x: Any) -> Any:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else x


def node_flops(target: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> int:
    """FLOPs of one ATen op call, given its (fake or real) arguments and output; 0 if unknown."""
    packet = getattr(target, "overloadpacket", None)
    if packet is None:
        return 0
    extra = EXTRA_FLOP_FORMULAS.get(packet)
    if extra is not None:
        shapes = tree_map(_shape, list(args))
        kw = tree_map(_shape, dict(kwargs))
        return int(extra(*shapes, out_shape=tree_map(_shape, out), **kw))
    formula = flop_registry.get(packet)
    if formula is None:
        return 0
    # torch's registry entries take tensors and convert them to shapes themselves.
    return int(formula(*args, out_val=out, **kwargs))
