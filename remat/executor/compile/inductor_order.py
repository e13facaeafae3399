"""How closely inductor's generated code follows a plan's order: the three ways the backend
compiles a graph (:mod:`~remat.executor.compile.dynamo`, "Inductor's schedule").

``heuristics``
    Inductor as it is: the fastest code, in an order of its own.
``pinned``
    No pattern passes (:data:`PINNED_ORDER`) and no horizontal fusion (:class:`_PlanOrder`).
    Inductor's post-grad patterns rewrite ``mm`` then ``add`` into one ``addmm`` at the
    ``add``, so a weight's gradient product moves to the end of the backward and holds its
    input there (GPT-2's tied embedding: 1 MiB of logits' gradient across the whole backward);
    a horizontally fused kernel runs where its later part ran, so the earlier part's output is
    made early and its inputs live late (GPT-2's recomputed query and key projections, held
    together where the plan holds one).
``kernels``
    Pinned, and further, each of the plan's values made where the plan makes it, by a kernel of
    its own, in the plan's order (:func:`kernels_order`):

    * inductor's lowering computes a pointwise value inside the kernel of its first reader (it
      inlines it), so the tensors that value is made from stay alive until that reader runs.
      Where the plan makes a value early and reads it late, and one of its inputs dies in
      between, the value is realized where the plan makes it (FX meta
      ``inductor_realize_to_strides``, set on the graph inductor lowers, after its post-grad
      passes, which replace the nodes they rewrite: :func:`mark_realized`). Llama's logits
      gradient, read by the lm head's two products at the end of the backward, was made there
      from the recomputed logits and the loss's one-hot gradient, 2 MiB held across the
      recomputation of every layer where the plan holds the 1 MiB result;
    * no fusion and no reordering (``reorder_for_peak_memory``): a fused kernel allocates every
      output its parts make before it runs and frees their inputs after;
    * on the CPU, one C++ function per kernel: inductor's C++ backend otherwise groups every
      kernel between two library calls into one function, whose outputs are all allocated before
      it runs;
    * a freed buffer is freed (``allow_buffer_reuse=False``), not pooled until a later buffer of
      its size reuses it.

    Measured on the CPU at 30% (``benchmarks/compile.py``, the slow test in
    ``tests/executor/test_compile_below_class.py``): Llama's code needs 7.75 MiB against a
    7.79 MiB budget and an FX plan of 7.77 MiB (pinned: 9.91 MiB); GPT-2's, planned with the
    ``h100`` cost, 7.61 MiB against 7.86 MiB (pinned: 8.23 MiB). The code is slower than
    pinned code (nothing is fused).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.fx
from torch._inductor.choices import InductorChoices

from remat.executor.compile.fuse import FUSED

__all__ = ["KERNELS_ORDER", "MODES", "PINNED_ORDER", "inductor_order", "mark_realized"]

MODES = ("heuristics", "pinned", "kernels")

PINNED_ORDER: dict[str, Any] = {"pattern_matcher": False}
"""Inductor's config with the plan's order pinned (module docstring)."""

KERNELS_ORDER: dict[str, Any] = {
    **PINNED_ORDER,
    "reorder_for_peak_memory": False,
    "reorder_for_locality": False,
    "allow_buffer_reuse": False,
}
"""Inductor's config with the plan's kernels one by one (module docstring)."""


class _PlanOrder(InductorChoices):
    """Inductor's fusion heuristics, less horizontal fusion (of kernels that do not feed each
    other): a fused kernel runs where its later part ran."""

    @staticmethod
    def can_fuse_horizontal(scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
        return False

    def uuid(self) -> Any | None:
        return None


class _PlanKernels(_PlanOrder):
    """No fusion at all: each kernel frees its inputs before the next one allocates."""

    @staticmethod
    def can_fuse(scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
        return False


def _is_alias(n: torch.fx.Node) -> bool:
    schema = getattr(n.target, "_schema", None)
    return (
        n.op == "call_function"
        and schema is not None
        and any(r.alias_info is not None for r in schema.returns)
    )


def _readers(n: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes that read ``n``'s tensor, through views of it."""
    out: list[torch.fx.Node] = []
    stack = [n]
    while stack:
        for u in stack.pop().users:
            if u.op == "output":
                continue
            if _is_alias(u):
                stack.append(u)
            else:
                out.append(u)
    return out


def mark_realized(graph: torch.fx.Graph) -> int:
    """Mark the values inductor's lowering would otherwise make inside a later kernel and so
    keep their inputs alive (module docstring, ``kernels``); return how many.

    A value is marked where it is a tensor computed (not a view) from the graph's inputs (not
    only from constants: a zero fill is cheaper inlined), a reader of it (through views) runs
    more than one node later, and one of its own inputs is read for the last time before its
    first reader. An op the plan folded into its reader (FX meta
    :data:`~remat.executor.compile.fuse.FUSED`) is left inlined."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    last: dict[torch.fx.Node, int] = {}
    data: dict[torch.fx.Node, bool] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            last[a] = pos[n]
        if n.op == "placeholder":
            data[n] = True
        else:
            data[n] = n.op == "call_function" and any(data.get(a, False) for a in n.all_input_nodes)
    marked = 0
    for n in nodes:
        if n.op != "call_function" or not data[n] or _is_alias(n) or n.meta.get(FUSED):
            continue
        if not isinstance(n.meta.get("val"), torch.Tensor):
            continue
        readers = _readers(n)
        if not readers or max(pos[r] for r in readers) - pos[n] <= 1:
            continue
        first = min(pos[r] for r in readers)
        if any(data[a] and last[a] < first for a in n.all_input_nodes):
            n.meta["inductor_realize_to_strides"] = True
            marked += 1
    return marked


@contextlib.contextmanager
def kernels_order() -> Iterator[None]:
    """Inductor's lowering and C++ code generation patched for the ``kernels`` mode: the marks
    of :func:`mark_realized` on each graph as it is lowered, and one C++ function per kernel."""
    from torch._inductor.codegen.cpp import CppScheduling
    from torch._inductor.graph import GraphLowering

    run_node = GraphLowering.run_node
    marked: weakref.WeakSet[torch.fx.Graph] = weakref.WeakSet()

    def run_marked(self: Any, n: torch.fx.Node) -> Any:
        graph = self.module.graph
        if graph not in marked:
            marked.add(graph)
            mark_realized(graph)
        return run_node(self, n)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(GraphLowering, "run_node", run_marked))
        # The C++ group is flushed once more than this many arguments are scheduled into it
        # (a class constant of torch 2.13's C++ backend; without it, groups stay as they are).
        if hasattr(CppScheduling, "MAX_FUSED_KERNEL_ARGS_NUM"):
            stack.enter_context(mock.patch.object(CppScheduling, "MAX_FUSED_KERNEL_ARGS_NUM", -1))
        yield


@contextlib.contextmanager
def inductor_order(mode: str) -> Iterator[None]:
    """Inductor's config, choices handler and patches for ``mode`` (one of :data:`MODES`)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.virtualized import V

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "heuristics":
        yield
        return
    with contextlib.ExitStack() as stack:
        if mode == "pinned":
            stack.enter_context(inductor_config.patch(PINNED_ORDER))
            stack.enter_context(V.set_choices_handler(_PlanOrder()))
        else:
            stack.enter_context(inductor_config.patch(KERNELS_ORDER))
            stack.enter_context(V.set_choices_handler(_PlanKernels()))
            stack.enter_context(kernels_order())
        yield
