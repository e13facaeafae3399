"""Matching the ATen ops a module runs to the graph's nodes: in order, by normalized name.

The checkpoint policy (:mod:`remat.executor.module`) and the offloaded blocks
(:mod:`remat.executor.offload_blocks`) both tell which node of a block an op is this way.
"""

from __future__ import annotations

import re
from typing import Any

from remat.ir import Graph


def op_key(name: str) -> str:
    """Normalize an op name so that eager and traced forms match: ``aten.div_.Scalar`` and
    ``aten.div.Scalar`` -> ``div``; every batch-norm variant -> ``batch_norm``."""
    base = name.split(".")[1] if name.startswith("aten.") else name.split(".")[0]
    base = base.rstrip("_").lstrip("_")
    if "batch_norm" in base:
        return "batch_norm"
    return re.sub(r"_functional$", "", base)


def func_key(func: Any) -> str:
    """The normalized name of an ATen op (an ``OpOverload``)."""
    return op_key(f"aten.{func._schema.name.split('::')[-1]}")


def returns_alias(func: Any) -> bool:
    """Whether every result of ``func`` aliases an argument (views, in-place ops)."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None for r in returns)


class OpMatcher:
    """Matches the ATen ops of a forward pass to graph nodes, in order, by normalized name."""

    LOOKAHEAD = 4

    def __init__(self, graph: Graph, ids: tuple[str, ...]) -> None:
        self.keys = [op_key(graph.node(i).op) for i in ids]
        self.ids = ids
        self.pos = 0

    def match(self, func: Any) -> str | None:
        if returns_alias(func) and not func._schema.is_mutable:
            return None  # a view: not a node of the graph
        key = func_key(func)
        for k in range(self.pos, min(self.pos + self.LOOKAHEAD, len(self.keys))):
            if self.keys[k] == key:
                self.pos = k + 1
                return self.ids[k]
        return None


__all__ = ["OpMatcher", "func_key", "op_key", "returns_alias"]
