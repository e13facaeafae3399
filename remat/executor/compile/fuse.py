"""A joint graph's IR with inductor's inlined chains folded: plans made on inductor's buffers.

Inductor's lowering computes a pointwise op inside the kernel of the op that reads it (it
*inlines* it) when that reader is a kernel of its own (pointwise or a reduction) and the value
has no other reader, so the value never exists as a buffer. The decomposed joint graph that
inductor partitions (GELU, layer norm and softmax spelled as chains of pointwise ops) counts
each such value as a tensor of its own in :func:`~remat.executor.compile.joint.joint_to_ir`'s
IR: a plan must find room for intermediates that inductor never allocates, and the smallest
plan the solver finds can lie over a budget that inductor's buffers would fit (the GPT example
at 30%: 6.09 MiB on the 355-node IR against 5.96 MiB).

:func:`fold_inlined` folds each such op into its reader: one IR node per chain, named after its
last op (the *head*), reading what the chain reads from outside, making what the head makes,
costing the time of all its ops. :attr:`~remat.executor.compile.joint.JointIR.fused` lists each
head's folded FX nodes, which :func:`~remat.executor.compile.plan_split.split_plan` emits
before the head wherever the plan computes it (marked ``remat_fused``, so that
:func:`~remat.executor.compile.inductor_order.mark_realized` leaves them inlined).

An op is folded into its reader when

* it is pointwise (``torch.Tag.pointwise``), not random, without side effects, makes one
  storage, and that storage is not an output of the graph;
* exactly one IR node reads that storage (through views too), in the same phase, and that
  reader is pointwise or one of inductor's reductions (:data:`REDUCTIONS`), and not random.

Only inductor inlines: with ``aot_eager`` every FX node allocates, so the folded IR would
under-count, and the backend folds for inductor only.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import torch
import torch.fx

from remat.executor.compile.joint import JointIR
from remat.ir import Graph, Node

__all__ = ["FUSED", "REDUCTIONS", "fold_inlined"]

FUSED = "remat_fused"
"""FX meta key of an emitted copy of a folded op (inductor inlines it into its head)."""

REDUCTIONS = frozenset(
    {"sum", "mean", "amax", "amin", "var_mean", "var", "prod", "max", "min", "argmax", "argmin"}
)
"""aten ops (by overload packet) that inductor lowers as reductions, into whose kernels it
inlines a pointwise input."""


def _tags(fx: torch.fx.Node) -> Any:
    return getattr(fx.target, "tags", ()) if fx.op == "call_function" else ()


def _pointwise(fx: torch.fx.Node) -> bool:
    return torch.Tag.pointwise in _tags(fx)


def _kernel(fx: torch.fx.Node) -> bool:
    """Whether inductor lowers ``fx`` as a kernel of its own that can inline its inputs."""
    if _pointwise(fx):
        return True
    packet = getattr(fx.target, "overloadpacket", None)
    return getattr(packet, "__name__", "") in REDUCTIONS


def fold_inlined(jir: JointIR) -> JointIR:
    """``jir`` with every chain that inductor inlines folded into one IR node (module
    docstring); ``jir`` itself when nothing folds."""
    graph = jir.graph
    node = {n.id: n for n in graph.nodes}
    readers: dict[str, list[str]] = defaultdict(list)
    for n in graph.nodes:
        for v in n.inputs:
            readers[v].append(n.id)
    required = set(graph.required)
    into: dict[str, str] = {}
    for n in graph.nodes:
        fx = jir.node_fx[n.id]
        if n.rng or not n.recomputable or len(n.outputs) != 1 or not _pointwise(fx):
            continue
        v = n.outputs[0]
        if v in required or len(readers[v]) != 1:
            continue
        r = node[readers[v][0]]
        if r.phase != n.phase or r.rng or not _kernel(jir.node_fx[r.id]):
            continue
        into[n.id] = r.id
    if not into:
        return jir

    def head(nid: str) -> str:
        while nid in into:
            nid = into[nid]
        return nid

    members: dict[str, list[str]] = defaultdict(list)
    for n in graph.nodes:  # graph order, a topological order
        if n.id in into:
            members[head(n.id)].append(n.id)
    dropped = {node[m].outputs[0] for ms in members.values() for m in ms}
    nodes: list[Node] = []
    for n in graph.nodes:
        if n.id in into:
            continue
        group = [node[m] for m in members.get(n.id, ())]
        if not group:
            nodes.append(n)
            continue
        inputs: list[str] = []
        for part in (*group, n):
            inputs.extend(v for v in part.inputs if v not in dropped and v not in inputs)
        nodes.append(
            n.model_copy(
                update={
                    "inputs": tuple(inputs),
                    "time_s": sum(p.time_s for p in (*group, n)),
                    "flops": sum(p.flops for p in (*group, n)),
                    "workspace_bytes": max(p.workspace_bytes for p in (*group, n)),
                }
            )
        )
    folded = Graph(
        name=graph.name,
        nodes=nodes,
        values=[v for v in graph.values if v.id not in dropped],
        required=list(graph.required),
        static_bytes=graph.static_bytes,
        device=graph.device,
        sharding=graph.sharding,
    )
    gone = {jir.node_fx[m].name for m in into}
    return dataclasses.replace(
        jir,
        graph=folded,
        node_fx={k: fx for k, fx in jir.node_fx.items() if k not in into},
        value_fx={k: fx for k, fx in jir.value_fx.items() if k not in dropped},
        fx_value={k: v for k, v in jir.fx_value.items() if v not in dropped and k not in gone},
        fused={h: tuple(jir.node_fx[m] for m in ms) for h, ms in members.items()},
    )
