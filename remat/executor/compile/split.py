"""A saved set -> forward and backward FX graphs, with torch's own partitioner helpers.

``torch._functorch.partitioners._extract_fwd_bwd_modules`` splits the joint graph for a list of
saved FX nodes (the backward graph recomputes whatever else it needs from them),
``reordering_to_mimic_autograd_engine`` moves each recomputation to just before its first use,
and ``functionalize_rng_ops`` makes recomputed random ops replay the forward's random numbers
(the forward saves the generator state before each such op, the backward restores it around the
recomputation), on the CPU as on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from remat.executor.compile.joint import JointIR
from remat.executor.compile.partition import Partition

RNG_STATE_BYTES = int(torch.get_rng_state().numel())
"""Bytes of one saved CPU generator state (what a recomputed random op saves instead)."""


@dataclass
class Split:
    """The forward and backward graph modules and the IR node orders they run."""

    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    forward_order: list[str]
    backward_order: list[str]
    saved_nodes: list[str]
    """FX names of the saved tensors (parameters and inputs the backward reads included)."""
    rng_replayed: list[str]
    """FX names of random ops that the backward recomputes with the forward's random state."""


def _is_sym(n: torch.fx.Node) -> bool:
    return isinstance(n.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


def split_joint(
    jir: JointIR,
    part: Partition,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int] | None = None,
) -> Split:
    """Split ``jir.joint`` so that the forward saves ``part.saved`` (plus the inputs the
    backward reads) and the backward recomputes the rest."""
    from torch._functorch import partitioners as P
    from torch.utils.checkpoint import CheckpointPolicy

    joint = jir.joint
    saved_fx = {jir.value_fx[v] for v in part.saved}
    tangents = set(jir.tangents)
    fw_needed = set(_forward_closure(jir))
    # Which placeholders and symbolic sizes the backward reaches from the saved set.
    saved_values: list[torch.fx.Node] = []
    saved_syms: list[torch.fx.Node] = []
    seen: set[torch.fx.Node] = set()
    stack = [o for o in jir.bw_outputs if isinstance(o, torch.fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen or n in tangents:
            continue
        seen.add(n)
        if _is_sym(n) and (n.op == "placeholder" or n in fw_needed):
            saved_syms.append(n)
            continue
        if n in saved_fx or n.op == "placeholder":
            saved_values.append(n)
            continue
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(joint.graph.nodes)}
    saved_values.sort(key=order.__getitem__)
    saved_syms.sort(key=order.__getitem__)
    static_nodes = None
    if static_lifetime_input_indices:
        from torch.utils._ordered_set import OrderedSet

        static_nodes = OrderedSet(jir.primals[i] for i in static_lifetime_input_indices)
    fw, bw = P._extract_fwd_bwd_modules(
        joint,
        saved_values,
        saved_sym_nodes=saved_syms,
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_nodes=static_nodes,
    )
    bw = P.reordering_to_mimic_autograd_engine(bw)
    fw_order = [n.name for n in fw.graph.nodes if n.op == "call_function" and n.name in jir.node_fx]
    bw_order = [n.name for n in bw.graph.nodes if n.op == "call_function" and n.name in jir.node_fx]
    fw_names = {n.name for n in fw.graph.nodes if n.op == "call_function"}
    rng = [
        n
        for n in joint.graph.nodes
        if n.op == "call_function"
        and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())
        and n.name in fw_names
        and n.name in {m.name for m in bw.graph.nodes}
    ]
    if rng:
        saved_meta: dict[torch.fx.Node, Any] = {}
        for n in rng:
            saved_meta[n] = n.meta.get("recompute")
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        try:
            fw, bw = P.functionalize_rng_ops(joint, fw, bw, len(saved_syms))
        finally:
            for n, m in saved_meta.items():
                if m is None:
                    n.meta.pop("recompute", None)
                else:
                    n.meta["recompute"] = m
    fw = P.raise_getitems(fw)
    bw = P.raise_getitems(bw)
    return Split(
        forward=fw,
        backward=bw,
        forward_order=fw_order,
        backward_order=bw_order,
        saved_nodes=[n.name for n in saved_values],
        rng_replayed=[n.name for n in rng],
    )


def _forward_closure(jir: JointIR) -> list[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    stack = [o for o in jir.fw_outputs if isinstance(o, torch.fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return list(seen)
