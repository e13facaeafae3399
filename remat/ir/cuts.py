"""Cuts of the forward pass: where a step can be split into segments for checkpointing.

The forward pass is the *forward sweep* (:func:`sweep_positions`): the forward-phase nodes and
every node they depend on, so a backward-phase node whose value a later forward node reads runs
in it. A cut after sweep node ``i`` is the set of values produced at or before ``i`` that sweep
nodes after ``i`` read (inputs and static values excluded: they are always there). Keeping a
cut's values lets every later forward value be recomputed without going back past the cut; a cut
of one value is an articulation point of the forward graph (a chain boundary).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import pairwise

from remat.ir.graph import Graph


@dataclass(frozen=True)
class Cut:
    """The forward pass cut after the node at ``position`` (an index into ``graph.nodes``)."""

    position: int
    values: tuple[str, ...]
    size_bytes: int


def sweep_positions(graph: Graph) -> list[int]:
    """Positions (in graph order) of the nodes of the forward sweep: the forward-phase nodes and
    every node one of them depends on, directly or not.

    A graph may list a backward-phase node before a forward node that reads what it made (the
    schema only asks for a topological order); such a node must run before that reader, so the
    chain methods run it in the forward sweep rather than in the backward pass, where it would
    come too late. On an ordinary step (forward, loss, backward) this is the forward phase.
    """
    nodes = graph.nodes
    needed: set[str] = set()  # values some sweep node reads
    inside = [False] * len(nodes)
    # graph order is topological: one pass from the end sees every reader before its producer
    for i in range(len(nodes) - 1, -1, -1):
        node = nodes[i]
        if node.phase == "forward" or any(o in needed for o in node.outputs):
            inside[i] = True
            needed.update(node.inputs)
    return [i for i, yes in enumerate(inside) if yes]


def forward_cuts(graph: Graph) -> list[Cut]:
    """One cut after every node of the forward sweep (:func:`sweep_positions`) but the last, in
    order."""
    fwd = sweep_positions(graph)
    last_fwd_read: dict[str, int] = {}
    for i in fwd:
        for x in graph.nodes[i].inputs:
            last_fwd_read[x] = i
    size = {v.id: v.size_bytes for v in graph.values}
    live: dict[str, None] = {}  # insertion-ordered set
    live_bytes = 0
    cuts: list[Cut] = []
    for k, i in enumerate(fwd):
        node = graph.nodes[i]
        for o in node.outputs:
            if last_fwd_read.get(o, -1) > i and not graph.is_static(o):
                live[o] = None
                live_bytes += size[o]
        for x in node.inputs:
            if x in live and last_fwd_read[x] == i:
                del live[x]
                live_bytes -= size[x]
        if k < len(fwd) - 1:
            cuts.append(Cut(position=i, values=tuple(live), size_bytes=live_bytes))
    return cuts


def articulation_cuts(graph: Graph) -> list[Cut]:
    """Cuts that cross exactly one value: the boundaries of a chain."""
    return [c for c in forward_cuts(graph) if len(c.values) == 1]


_INDEXED = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def block_key(module: str) -> str:
    """The repeated block a module belongs to: ``"layers.3.attn.q"`` -> ``"layers.3"``.

    Module paths without an index keep their first component (``"embed.pos"`` -> ``"embed"``).
    """
    m = _INDEXED.match(module)
    if m:
        return m.group(1)
    return module.split(".", 1)[0]


def block_cuts(graph: Graph) -> list[Cut]:
    """Cuts at the ends of the model's blocks (changes of :func:`block_key` between nodes of the
    forward sweep); articulation cuts when the graph has no module paths."""
    fwd = [graph.nodes[i] for i in sweep_positions(graph)]
    if not any(n.module for n in fwd):
        return articulation_cuts(graph)
    keys = {graph.node_position(n.id): block_key(n.module) for n in fwd}
    order = sorted(keys)
    ends = {a for a, b in pairwise(order) if keys[a] != keys[b]}
    return [c for c in forward_cuts(graph) if c.position in ends]
