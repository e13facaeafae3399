"""The facts about a graph that Checkmate's MILP and its LP rounding read, derived once.

:class:`MilpIndex` lists, per node position, the dynamic values it reads and writes (static
values and the graph's inputs are always resident and never enter the model), each value's
producer and readers, which nodes may run again, and how long each value can matter. It is
frozen: ``milp`` builds its model over it and ``lp-round`` completes its roundings from it,
and neither reaches into the other's bookkeeping.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from remat.ir import Graph, block_key


@dataclass(frozen=True)
class MilpIndex:
    """Index of ``graph`` for the Checkmate formulation (positions are graph order).

    Attributes
    ----------
    ins, outs
        Per node: the dynamic values it reads (duplicates dropped) and writes.
    size
        Bytes of every value.
    producer
        Position of each dynamic value's producer.
    consumers
        Positions of each dynamic value's readers, sorted.
    required
        Values that must exist at the end.
    rerun
        Per node: may it run again (recomputable, makes something, nothing required, and a
        forward node unless ``recompute_backward``)?
    last_read
        Last reader of each dynamic value (its producer when nothing reads it).
    need_end
        Last stage in which the value, or something recomputed from it, can still be read
        (``num_nodes`` for required values).
    block, blocks_read
        Per node: the index of its forward block (``remat.ir.block_key`` of its module, -1 for
        backward-only modules), and the forward blocks whose values it reads.
    """

    graph: Graph
    recompute_backward: bool
    ins: tuple[tuple[str, ...], ...]
    outs: tuple[tuple[str, ...], ...]
    size: Mapping[str, int]
    producer: Mapping[str, int]
    consumers: Mapping[str, tuple[int, ...]]
    required: frozenset[str]
    rerun: tuple[bool, ...]
    last_read: Mapping[str, int]
    need_end: Mapping[str, int]
    block: tuple[int, ...]
    blocks_read: tuple[frozenset[int], ...]
    input_bytes: int

    @property
    def num_nodes(self) -> int:
        return len(self.ins)

    @classmethod
    def of(cls, graph: Graph, *, recompute_backward: bool) -> MilpIndex:
        """Derive the index of ``graph`` (one pass over nodes and values)."""
        n = graph.num_nodes
        required = frozenset(graph.required)
        dyn = {v.id for v in graph.values if not graph.is_static(v.id) and v.kind != "input"}
        ins: list[tuple[str, ...]] = []
        outs: list[tuple[str, ...]] = []
        producer: dict[str, int] = {}
        for i, node in enumerate(graph.nodes):
            ins.append(tuple(dict.fromkeys(x for x in node.inputs if x in dyn)))
            outs.append(tuple(o for o in node.outputs if o in dyn))
            for o in outs[-1]:
                producer[o] = i
        consumers = {v: tuple(sorted(set(graph.consumer_positions(v)))) for v in producer}
        rerun = tuple(
            node.recomputable
            and bool(outs[i])
            and not any(o in required for o in outs[i])
            and (node.phase == "forward" or recompute_backward)
            for i, node in enumerate(graph.nodes)
        )
        last_read = {v: max(consumers[v], default=producer[v]) for v in producer}
        need_end: dict[str, int] = {}
        for i in reversed(range(n)):
            for v in outs[i]:
                end = n if v in required else last_read[v]
                for k in consumers[v]:
                    if rerun[k]:
                        for w in outs[k]:
                            end = max(end, need_end[w])
                need_end[v] = end
        order: dict[str, int] = {}
        for nd in graph.nodes:
            if nd.phase == "forward":
                order.setdefault(block_key(nd.module), len(order))
        block = tuple(order.get(block_key(nd.module), -1) for nd in graph.nodes)
        blocks_read = tuple(
            frozenset(
                block[producer[x]] for x in ins[t] if graph.nodes[producer[x]].phase == "forward"
            )
            for t in range(n)
        )
        return cls(
            graph=graph,
            recompute_backward=recompute_backward,
            ins=tuple(ins),
            outs=tuple(outs),
            size={v.id: v.size_bytes for v in graph.values},
            producer=producer,
            consumers=consumers,
            required=required,
            rerun=rerun,
            last_read=last_read,
            need_end=need_end,
            block=block,
            blocks_read=blocks_read,
            input_bytes=graph.input_bytes,
        )

    def lower_bound_peak(self) -> int:
        """A peak no plan can go below: the largest single node with what it reads and writes,
        plus the inputs and the required values already made (bytes, static included)."""
        g = self.graph
        best = 0
        made_required = 0
        for k, node in enumerate(g.nodes):
            during = sum(self.size[v] for v in dict.fromkeys([*self.ins[k], *self.outs[k]]))
            during += node.workspace_bytes + made_required
            best = max(best, during)
            made_required += sum(self.size[o] for o in self.outs[k] if o in self.required)
        return g.static_bytes + self.input_bytes + best
