"""What this process knows about a graph's memory: the smallest-peak plan any method found,
and a proven lower bound on the peak of every plan.

Every result built by :meth:`remat.solver.Problem.result` records its plan here (keyed
by the graph's content hash), whatever its budget, so ``auto``'s and the frontier's
``min_budget_bytes`` is never above a plan already found for that graph, by any method, at any
budget, in this process (a service worker keeps its own).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from remat.ir import Graph, Plan

KEPT_GRAPHS = 64
"""Graphs remembered (least recently used dropped first)."""


@dataclass(frozen=True)
class KnownPlan:
    """The smallest-peak plan found so far for one graph."""

    peak_bytes: int
    plan: Plan
    solver: str


_LOCK = threading.Lock()
_SMALLEST: OrderedDict[str, KnownPlan] = OrderedDict()


def record(graph: Graph, plan: Plan, peak_bytes: int, solver: str) -> None:
    """Remember ``plan`` (simulated peak ``peak_bytes``) when it is the smallest known."""
    key = graph.content_hash()
    with _LOCK:
        old = _SMALLEST.get(key)
        if old is None or peak_bytes < old.peak_bytes:
            _SMALLEST[key] = KnownPlan(peak_bytes, plan, solver)
        _SMALLEST.move_to_end(key)
        while len(_SMALLEST) > KEPT_GRAPHS:
            _SMALLEST.popitem(last=False)


def smallest(graph: Graph) -> KnownPlan | None:
    """The smallest-peak plan known for ``graph``, if any."""
    with _LOCK:
        return _SMALLEST.get(graph.content_hash())


def forget() -> None:
    """Drop everything remembered (tests)."""
    with _LOCK:
        _SMALLEST.clear()


def min_budget_lower_bytes(graph: Graph) -> int:
    """A proven lower bound on the peak (static + dynamic) of every valid plan.

    Every plan runs each node at least once, and while a node runs its inputs are on the device,
    its outputs are allocated and its workspace is held; the caller's inputs stay on the device
    all step long; the required values are all on the device at the end. So the peak is at least
    the static bytes plus the inputs plus the largest of: any single node's working set (its
    other dynamic inputs, its dynamic outputs and its workspace), and the required dynamic values
    together. Computed once per graph.
    """
    return graph.memo("known.min_budget_lower_bytes", lambda: _min_budget_lower_bytes(graph))


def _min_budget_lower_bytes(graph: Graph) -> int:
    size = graph.size_map()
    static = graph.static_ids()
    inputs = {v.id for v in graph.values if v.kind == "input"}
    resident = inputs - static
    skip = resident | static

    working = 0
    for n in graph.nodes:
        touched = {x for x in (*n.inputs, *n.outputs) if x not in skip}
        working = max(working, sum(size[x] for x in touched) + n.workspace_bytes)
    required = sum(size[r] for r in graph.required if r not in skip)
    return graph.static_bytes + sum(size[v] for v in resident) + max(working, required)
