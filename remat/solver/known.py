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
_SMALLEST_RECOMPUTE: OrderedDict[str, KnownPlan] = OrderedDict()
"""The same, among plans that move nothing to the host (what a recompute-only answer may
report)."""


def _keep(table: OrderedDict[str, KnownPlan], key: str, known: KnownPlan) -> None:
    old = table.get(key)
    if old is None or known.peak_bytes < old.peak_bytes:
        table[key] = known
    table.move_to_end(key)
    while len(table) > KEPT_GRAPHS:
        table.popitem(last=False)


def record(graph: Graph, plan: Plan, peak_bytes: int, solver: str) -> None:
    """Remember ``plan`` (simulated peak ``peak_bytes``) when it is the smallest known (of all
    plans, and of those without offloading when it has none)."""
    key = graph.content_hash()
    known = KnownPlan(peak_bytes, plan, solver)
    moves = any(s.op in ("offload", "prefetch") for s in plan.steps)
    with _LOCK:
        _keep(_SMALLEST, key, known)
        if not moves:
            _keep(_SMALLEST_RECOMPUTE, key, known)


def smallest(graph: Graph, *, offload: bool = True) -> KnownPlan | None:
    """The smallest-peak plan known for ``graph``, if any (``offload=False``: among plans
    that move nothing to the host)."""
    with _LOCK:
        table = _SMALLEST if offload else _SMALLEST_RECOMPUTE
        return table.get(graph.content_hash())


def forget() -> None:
    """Drop everything remembered (tests)."""
    with _LOCK:
        _SMALLEST.clear()
        _SMALLEST_RECOMPUTE.clear()


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
