"""Rewrites of the captured joint FX graph so that running it is the eager step, bit for bit.

:func:`bernoulli_in_memory_order`: eager dropout draws its noise with ``empty_like(x)
.bernoulli_(p)``, in ``x``'s memory order; functionalization turns that into ``bernoulli.p``,
whose result is a new contiguous tensor, so on a non-contiguous ``x`` (a transposed
activation) the same random stream lands on other elements and the gradients differ from
eager's. The rewrite draws into the contiguous permutation of the buffer and permutes back: the
same numbers on the same elements as eager, the same storage size, two views more.

:func:`strip_returned` and :func:`held_until_backward`: a step captured with
``return_outputs`` returns the model's other output tensors (detached) after the loss; they
leave the joint graph's outputs (which stay those of the plain step), and their storages become
inputs of the nodes that read the loss's gradient, so that every plan holds them until the
backward part, when the forward has returned them.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
import torch.fx

from remat.ir import Graph, Node
from remat.tracer.errors import TraceError

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


_CLONE = torch.ops.aten.clone.default


def obeys_layout_contract(grad: torch.Tensor, param: torch.Tensor) -> bool:
    """Whether autograd's ``AccumulateGrad`` may keep ``grad`` itself as ``param.grad``.

    The rule of ``torch/csrc/autograd/functions/accumulate_grad.h``: for a dense,
    non-overlapping parameter the gradient must have the parameter's strides on every dim of
    size above 1 (and no 0 stride on a size-1 dim); otherwise it must be contiguous. A gradient
    that breaks it is copied into the parameter's layout, the kernel's own output alive beside
    the copy until the copy is made."""
    if _dense(param):
        for size, gs, ps in zip(grad.shape, grad.stride(), param.stride(), strict=True):
            if size != 1 and gs != ps:
                return False
            if size == 1 and gs == 0:
                return False
        return True
    return grad.is_contiguous()


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: the elements fill ``numel`` consecutive slots in some order
    of the dims (size-1 dims may carry any stride)."""
    expected = 1
    dims = sorted((st, s) for s, st in zip(t.shape, t.stride(), strict=True) if s != 1)
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _layout_of(param: torch.Tensor) -> torch.memory_format | None:
    """The memory format whose ``clone`` gives ``param``'s strides, or None when none does."""
    formats = [torch.contiguous_format]
    if param.dim() == 4:
        formats.append(torch.channels_last)
    if param.dim() == 5:
        formats.append(torch.channels_last_3d)
    for fmt in formats:
        if param.is_contiguous(memory_format=fmt):
            return fmt
    return None


def gradients_in_parameter_layout(joint: torch.fx.GraphModule, param_names: list[str]) -> list[str]:
    """Copy each parameter gradient that autograd would copy into the parameter's layout.

    Eager ``loss.backward()`` hands each parameter's gradient to ``AccumulateGrad``, which keeps
    it as ``.grad`` only when it obeys the layout contract (:func:`obeys_layout_contract`); a
    gradient made in another layout (the channels-last weight gradient of a strided convolution
    on a channels-last input) is copied, and the kernel's output is freed once the copy exists.
    The joint graph returns the kernel's output as the gradient. This pass inserts the copy
    (``clone`` in the parameter's memory format) right after the op that makes the gradient
    and returns it instead: the kernel's output becomes a transient backward value, the copy the
    parameter's gradient, as in eager; and the gradients remat's executor hands back to
    autograd obey the contract, so autograd keeps them without a copy of its own. The copy has
    no ``seq_nr``: autograd runs ``AccumulateGrad`` after the producing node has returned and
    released what it saved; its module (``meta["remat_module"]``) is the parameter's. Returns
    the names of the parameters whose gradients are copied.
    """
    out_node = next(n for n in reversed(joint.graph.nodes) if n.op == "output")
    outs = list(out_node.args[0])
    placeholders = [n for n in joint.graph.nodes if n.op == "placeholder"]
    num_grads = len(placeholders) - 1  # one tangent, one gradient slot per primal
    first = len(outs) - num_grads
    copied: list[str] = []
    for k, pname in enumerate(param_names):
        g = outs[first + k]
        if not isinstance(g, torch.fx.Node):
            continue
        g_val = g.meta.get("val")
        p_val = placeholders[k].meta.get("val")
        if not isinstance(g_val, torch.Tensor) or not isinstance(p_val, torch.Tensor):
            continue
        if g_val.shape != p_val.shape or obeys_layout_contract(g_val, p_val):
            continue
        fmt = _layout_of(p_val)
        if fmt is None:
            continue
        # After the op that makes the gradient, and after every element taken from it.
        src = g.args[0] if g.target is operator.getitem else g
        after = g
        if isinstance(src, torch.fx.Node):
            for u in src.users:
                if u.target is operator.getitem and _before(after, u):
                    after = u
        mode = getattr(g_val, "fake_mode", None)
        with mode if mode is not None else torch.no_grad():
            copy_val = torch.empty_strided(
                tuple(p_val.shape), tuple(p_val.stride()), dtype=g_val.dtype, device=g_val.device
            )
        with joint.graph.inserting_after(after):
            copy = joint.graph.call_function(_CLONE, (g,), {"memory_format": fmt})
        copy.meta.update(
            {key: x for key, x in g.meta.items() if key not in ("val", "seq_nr", "stack_trace")}
        )
        copy.meta["val"] = copy_val
        copy.meta["partitioner_tag"] = "is_backward"
        copy.meta["remat_module"] = pname.rpartition(".")[0]
        outs[first + k] = copy
        copied.append(pname)
    if copied:
        out_node.args = (type(out_node.args[0])(outs), *out_node.args[1:])
        joint.recompile()
    return copied


def _before(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """Whether node ``a`` comes before ``b`` in its graph."""
    n = a.next
    while n.op != "root":
        if n is b:
            return True
        n = n.next
    return False


def strip_returned(joint: torch.fx.GraphModule, start: int, count: int) -> list[torch.fx.Node]:
    """Remove the ``count`` detached outputs after the loss (at ``start``) from the joint
    graph's outputs; the FX nodes of the tensors they detach, in order."""
    out_node = next(n for n in reversed(list(joint.graph.nodes)) if n.op == "output")
    outs = list(out_node.args[0])
    extra = outs[start : start + count]
    nodes: list[torch.fx.Node] = []
    for d in extra:
        if not (isinstance(d, torch.fx.Node) and d.target is torch.ops.aten.detach.default):
            raise TraceError(f"unexpected joint graph: returned output {d} is not a detach")
        src = d.args[0]
        assert isinstance(src, torch.fx.Node)
        nodes.append(src)
    out_node.args = (type(out_node.args[0])(outs[:start] + outs[start + count :]),)
    for d in extra:
        if not d.users:
            joint.graph.erase_node(d)
    joint.recompile()
    return nodes


def held_until_backward(
    graph: Graph, tangent: str, held: Sequence[str], *, through_backward: bool = False
) -> Graph:
    """``graph`` with the ``held`` values among the inputs of every node that reads the loss's
    gradient: the forward returns them, so no plan may free them before its backward part.
    With ``through_backward``, among the inputs of every backward node too: the caller keeps
    them until its backward returns (``out = model(**batch); out.loss.backward()``)."""

    def more(n: Node) -> Node:
        if tangent not in n.inputs and not (through_backward and n.phase == "backward"):
            return n
        extra = tuple(v for v in dict.fromkeys(held) if v not in n.inputs)
        return n.model_copy(update={"inputs": (*n.inputs, *extra)})

    return graph.model_copy(update={"nodes": tuple(more(n) for n in graph.nodes)})
