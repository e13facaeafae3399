"""Rewrites of the captured joint FX graph so that running it is the eager step, bit for bit.

:func:`bernoulli_in_memory_order`: eager dropout draws its noise with ``empty_like(x)
.bernoulli_(p)``, in ``x``'s memory order; functionalization turns that into ``bernoulli.p``,
whose result is a new contiguous tensor, so on a non-contiguous ``x`` (a transposed
activation) the same random stream lands on other elements and the gradients differ from
eager's. The rewrite draws into the contiguous permutation of the buffer and permutes back: the
same numbers on the same elements as eager, the same storage size, two views more.
"""

from __future__ import annotations

import torch
import torch.fx

_BERNOULLI_P = torch.ops.aten.bernoulli.p
_PERMUTE = torch.ops.aten.permute.default


def memory_order(t: torch.Tensor) -> list[int] | None:
    """The dims of ``t`` from outermost to innermost in memory, when ``t`` is a dense
    permutation of a contiguous tensor that is not itself contiguous; None otherwise."""
    if t.is_contiguous() or t.dim() < 2:
        return None
    # Size-1 dims may carry any stride: order them by position, they do not move elements.
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d) if t.shape[d] != 1 else 0, d))
    permuted = t.permute(order)
    if not permuted.is_contiguous():
        return None  # overlapping or with gaps: empty_like made it contiguous anyway
    return order


def bernoulli_in_memory_order(joint: torch.fx.GraphModule) -> int:
    """Rewrite each ``bernoulli.p(e, p)`` on a non-contiguous ``e`` into
    ``permute(bernoulli.p(permute(e, order), p), inverse)``; returns how many were rewritten."""
    count = 0
    for n in list(joint.graph.nodes):
        if n.op != "call_function" or n.target is not _BERNOULLI_P:
            continue
        src = n.args[0]
        if not isinstance(src, torch.fx.Node):
            continue
        src_val = src.meta.get("val")
        val = n.meta.get("val")
        if not isinstance(src_val, torch.Tensor) or not isinstance(val, torch.Tensor):
            continue
        order = memory_order(src_val)
        if order is None:
            continue
        inverse = [order.index(d) for d in range(len(order))]
        mode = getattr(src_val, "fake_mode", None)
        ctx = mode if mode is not None else torch.no_grad()
        with ctx:
            dense_val = src_val.permute(order)
            drawn_val = torch.empty_like(dense_val, memory_format=torch.contiguous_format)
            back_val = drawn_val.permute(inverse)
        with joint.graph.inserting_before(n):
            dense = joint.graph.call_function(_PERMUTE, (src, order))
        with joint.graph.inserting_after(n):
            back = joint.graph.call_function(_PERMUTE, (n, inverse))
        n.replace_all_uses_with(back, delete_user_cb=lambda user, back=back: user is not back)
        n.args = (dense, *n.args[1:])
        for node, v in ((dense, dense_val), (back, back_val)):
            node.meta.update({k: x for k, x in n.meta.items() if k != "val"})
            node.meta["val"] = v
        n.meta["val"] = drawn_val
        count += 1
    if count:
        joint.recompile()
    return count
