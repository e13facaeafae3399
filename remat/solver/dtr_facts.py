"""What ``dtr``'s planner reads per value and node (:mod:`remat.solver.dtr`), as flat lists
indexed by integers, made once per graph."""

from __future__ import annotations

from dataclasses import dataclass

from remat.ir import Graph


@dataclass(frozen=True)
class Facts:
    """What the planner reads per value and node, as flat lists indexed by integers."""

    num_values: int
    size: list[int]
    producer: list[int]  # node index, -1 for inputs and static values
    cost: list[float]  # time of the producer
    uses: list[list[int]]  # node indices reading the value, ascending
    node_in: list[tuple[int, ...]]  # dynamic inputs (inputs of the step excluded)
    node_out: list[tuple[int, ...]]  # dynamic outputs
    node_time: list[float]
    node_ws: list[int]
    node_id: list[str]
    value_id: list[str]
    backward: list[bool]  # made by a backward node
    pinned_until: list[int]  # the value may not be evicted before this node index
    last_use: list[int]  # the value is dead after this node index (inf: required)
    input_bytes: int

    @classmethod
    def of(cls, graph: Graph) -> Facts:
        static = graph.static_ids()
        vid = [v.id for v in graph.values if v.id not in static and v.kind != "input"]
        vix = {v: i for i, v in enumerate(vid)}
        size_map = graph.size_map()
        size = [size_map[v] for v in vid]
        nodes = graph.nodes
        producer = [-1] * len(vid)
        uses: list[list[int]] = [[] for _ in vid]
        node_in: list[tuple[int, ...]] = []
        node_out: list[tuple[int, ...]] = []
        for k, n in enumerate(nodes):
            ins = tuple(dict.fromkeys(vix[x] for x in n.inputs if x in vix))
            outs = tuple(vix[o] for o in n.outputs if o in vix)
            node_in.append(ins)
            node_out.append(outs)
            for x in ins:
                uses[x].append(k)
            for o in outs:
                producer[o] = k
        cost = [nodes[p].time_s if p >= 0 else 0.0 for p in producer]
        required = graph.required_set()
        inf = len(nodes) + 1
        last_use = [
            inf if vid[v] in required else (uses[v][-1] if uses[v] else producer[v])
            for v in range(len(vid))
        ]
        pinned_until = [inf if vid[v] in required else -1 for v in range(len(vid))]
        # A value made by a node that cannot run again must stay until nothing that may be
        # recomputed from it is needed any more: the last need of any value downstream of it
        # through recomputable producers.
        reach = list(last_use)
        for k in range(len(nodes) - 1, -1, -1):
            if not nodes[k].recomputable:
                continue
            far = max((reach[o] for o in node_out[k]), default=-1)
            for x in node_in[k]:
                if far > reach[x]:
                    reach[x] = far
        for k, n in enumerate(nodes):
            if not n.recomputable:
                for o in node_out[k]:
                    pinned_until[o] = last_use[o] = max(last_use[o], reach[o])
        return cls(
            num_values=len(vid),
            size=size,
            producer=producer,
            cost=cost,
            uses=uses,
            node_in=node_in,
            node_out=node_out,
            node_time=[n.time_s for n in nodes],
            node_ws=[n.workspace_bytes for n in nodes],
            node_id=[n.id for n in nodes],
            value_id=vid,
            backward=[p >= 0 and nodes[p].phase == "backward" for p in producer],
            pinned_until=pinned_until,
            last_use=last_use,
            input_bytes=graph.input_bytes,
        )
