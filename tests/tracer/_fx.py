"""FX nodes of small functions, for the cost-model tests."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx.experimental.proxy_tensor


def fx_nodes(fn: Callable[..., Any], *args: Any, mode: str = "fake") -> list[torch.fx.Node]:
    """The ATen calls of ``fn`` traced by make_fx (``mode``: fake or real tensors), in order;
    the ``getitem`` nodes that unpack multi-output ops are left out."""
    gm = torch.fx.experimental.proxy_tensor.make_fx(fn, tracing_mode=mode)(*args)
    return [
        n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem
    ]
