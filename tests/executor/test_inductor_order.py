"""The ``kernels`` mode's marks: which values inductor must make where the plan makes them."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from remat.executor.compile.inductor_order import MODES, inductor_order, mark_realized


def _step(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    late = x * y  # x and y are not read again: inlined at its reader, it would hold both
    kept = w * 3  # w is read again after this value's first reader: nothing to free
    zeros = torch.zeros(16)  # a constant fill: cheaper made inside its reader
    near = late + 1  # read by the very next node
    near_sum = near.sum()
    h = torch.mm(w, w).relu().sum()
    first = kept.sum()
    again = w.sum()
    return late.view(16).sum() + zeros.sum() + near_sum + h + first + again


def test_marks_the_values_whose_inputs_die_before_their_reader():
    x, y, w = torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4)
    gm = make_fx(_step)(x, y, w)
    marked = mark_realized(gm.graph)
    got = {
        n.name: n.meta.get("inductor_realize_to_strides", False)
        for n in gm.graph.nodes
        if n.op == "call_function"
    }
    assert got["mul"]  # late: read through a view at the end, x and y dead before
    assert not got["mul_1"]  # kept: w is read after its first reader
    assert not got["zeros"]  # a constant fill
    assert not got["add"]  # near: read by the next node
    assert not got["view"]  # a view is never a buffer of its own
    # The sums read at the end whose inputs die when they run (a reduction is made where it
    # runs in any case); the last one is read by the next node.
    assert [k for k in got if k.startswith("sum") and got[k]] == [f"sum_{i}" for i in range(1, 6)]
    assert marked == sum(got.values()) == 6
    assert mark_realized(make_fx(lambda a: (a * 2).sum())(x).graph) == 0


def test_modes_are_checked():
    with pytest.raises(ValueError, match="mode must be one of"), inductor_order("fast"):
        pass
    assert MODES == ("heuristics", "pinned", "kernels")


def test_kernels_mode_patches_inductor_and_restores_it():
    from torch._inductor import config as inductor_config
    from torch._inductor.codegen.cpp import CppScheduling
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V

    run_node, max_args = GraphLowering.run_node, CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM
    with inductor_order("kernels"):
        assert GraphLowering.run_node is not run_node
        assert CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM == -1
        assert not inductor_config.pattern_matcher and not inductor_config.allow_buffer_reuse
        assert not V.choices.can_fuse(None, None, None, 0)
    with inductor_order("pinned"):
        assert GraphLowering.run_node is run_node and not inductor_config.pattern_matcher
        assert not V.choices.can_fuse_horizontal(None, None, None, 0)
    assert GraphLowering.run_node is run_node
    assert max_args == CppScheduling.MAX_FUSED_KERNEL_ARGS_NUM
    assert inductor_config.pattern_matcher and inductor_config.allow_buffer_reuse
