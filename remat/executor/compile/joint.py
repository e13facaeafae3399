"""AOT autograd's joint graph (as a partition function receives it) -> the IR, by storage.

The joint graph that torch.compile hands a partition function differs from the one
:func:`remat.tracer.capture` records: dynamo lifts parameters and inputs in its own order (the
partitioner is told which placeholders are parameters or buffers through
``static_lifetime_input_indices``), the compiled region may return several outputs and so have
several tangents, and the backward runs as one FX graph, not as autograd nodes. The mapping:

* every storage is one IR :class:`~remat.ir.Value`, every op that creates storages one
  :class:`~remat.ir.Node` with the FX node's name as id (views, aliases and ``getitem`` fold
  into the ops that read them), sized and named by the tracer's rules
  (:func:`remat.tracer.fx_to_ir.storage_bytes`, ``op_name``), as the tracer maps a captured
  step (its :func:`~remat.tracer.fx_to_ir.joint_to_ir` expects the tracer's own signature:
  parameters first, one tangent, a loss);
* phases come from the data flow, as AOT autograd's partitioners decide them: an op that the
  forward outputs need is ``forward``, every other op ``backward`` (it runs in the backward
  graph, from the saved values);
* kinds: static-lifetime placeholders are ``param`` (they get a gradient) or ``buffer``; other
  placeholders and the tangents are ``input``; forward storages are ``activation``, backward
  storages ``gradient``; graph constants ``buffer``;
* required at the end: the gradients the backward graph returns and the forward outputs (the
  caller holds those);
* static bytes: parameters, buffers and the parameters' gradients.

Unlike :func:`remat.tracer.capture`, no op holds the inputs of a backward autograd node until
its last op: the compiled backward graph frees each tensor after its last use.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

from remat.ir import DeviceProfile, Graph, Node, Value
from remat.ir.devices import roofline_time_s
from remat.tracer.costs import bytes_moved, node_time_s, resolve_cost
from remat.tracer.flops import node_flops
from remat.tracer.fx_to_ir import (
    aliased_input,
    dtype_name,
    element_node,
    op_name,
    output_tensors,
    storage_bytes,
)

_getitem = operator.getitem

__all__ = ["JointIR", "joint_to_ir"]


@dataclass
class JointIR:
    """The IR of one joint graph and the maps between them.

    Attributes
    ----------
    graph
        The costed IR graph: forward nodes (joint order), then backward nodes (joint order).
    node_fx
        IR node id -> FX node of the joint graph.
    value_fx
        IR value id -> the FX node whose result is the base tensor of that storage.
    fx_value
        FX node name -> IR value id of the storage its tensor lives in.
    primals, tangents
        Placeholder FX nodes.
    fw_outputs, bw_outputs
        The joint graph's outputs, split at ``num_fwd_outputs`` (None where no gradient).
    static_inputs
        Value ids of parameters and buffers.
    symbolic
        True when some tensor size was symbolic (dynamic shapes); sizes are then those of the
        example that triggered the compile (the symbols' hints).
    fused
        IR node id -> the FX nodes folded into it, in joint order, which run just before its
        own FX node (:func:`~remat.executor.compile.fuse.fold_inlined`; empty: none).
    """

    graph: Graph
    joint: torch.fx.GraphModule
    node_fx: dict[str, torch.fx.Node]
    value_fx: dict[str, torch.fx.Node]
    fx_value: dict[str, str]
    primals: list[torch.fx.Node]
    tangents: list[torch.fx.Node]
    fw_outputs: list[Any]
    bw_outputs: list[Any]
    static_inputs: set[str]
    symbolic: bool
    fused: dict[str, tuple[torch.fx.Node, ...]] = field(default_factory=dict)

    def forward_node_ids(self) -> list[str]:
        return [n.id for n in self.graph.nodes if n.phase == "forward"]

    def backward_node_ids(self) -> list[str]:
        return [n.id for n in self.graph.nodes if n.phase == "backward"]


def _int(x: Any) -> tuple[int, bool]:
    """A concrete int for a size (a SymInt's hint) and whether it was symbolic."""
    if isinstance(x, torch.SymInt):
        from torch.fx.experimental.symbolic_shapes import has_hint

        node = x.node
        hint = node.hint if has_hint(x) else None
        return (int(hint) if hint is not None else 1), True
    return int(x), False


def _nbytes(t: torch.Tensor, fx: torch.fx.Node) -> tuple[int, bool]:
    """The storage's bytes as the eager CPU kernel allocates it (the tracer's rule), at the
    size hints when sizes are symbolic."""
    try:
        n = t.untyped_storage().nbytes()
        if isinstance(n, torch.SymInt):
            return _int(n)
        return storage_bytes(t, fx), False
    except Exception:  # a storage of symbolic size: from the shape's hints
        numel, sym = 1, True
        for s in t.shape:
            v, _ = _int(s)
            numel *= v
        return numel * t.element_size(), sym


def is_rng(target: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())


def _required_forward(joint: torch.fx.GraphModule, fw_outputs: Sequence[Any]) -> set[str]:
    """Names of the FX nodes the forward outputs depend on."""
    seen: set[str] = set()
    stack = [a for a in pytree.tree_leaves(list(fw_outputs)) if isinstance(a, torch.fx.Node)]
    while stack:
        n = stack.pop()
        if n.name in seen:
            continue
        seen.add(n.name)
        stack.extend(n.all_input_nodes)
    return seen


def _meta_val(x: Any) -> Any:
    return x.meta.get("val") if isinstance(x, torch.fx.Node) else x


def joint_to_ir(
    joint: torch.fx.GraphModule,
    *,
    num_fwd_outputs: int,
    static_input_indices: Sequence[int] = (),
    cost: str | DeviceProfile = "cpu",
    name: str = "compiled",
) -> JointIR:
    """Map ``joint`` (placeholders ``primals_*`` then ``tangents_*``) to a costed IR graph."""
    fx_nodes = list(joint.graph.nodes)
    placeholders = [n for n in fx_nodes if n.op == "placeholder"]
    tangents = [n for n in placeholders if n.name.startswith("tangents")]
    primals = [n for n in placeholders if not n.name.startswith("tangents")]
    out_node = next(n for n in reversed(fx_nodes) if n.op == "output")
    outs = list(pytree.tree_leaves(out_node.args[0], is_leaf=lambda x: x is None))
    fw_outputs, bw_outputs = outs[:num_fwd_outputs], outs[num_fwd_outputs:]
    forward_fx = _required_forward(joint, fw_outputs)

    by_storage: dict[StorageWeakRef, str] = {}
    base: dict[str, torch.Tensor] = {}
    value_fx: dict[str, torch.fx.Node] = {}
    fx_value: dict[str, str] = {}
    kinds: dict[str, str] = {}
    sizes: dict[str, int] = {}
    symbolic = False

    def new_value(vid: str, t: torch.Tensor, fx: torch.fx.Node, kind: str) -> None:
        nonlocal symbolic
        by_storage[StorageWeakRef(t.untyped_storage())] = vid
        base[vid] = t
        value_fx[vid] = fx
        fx_value[fx.name] = vid
        kinds[vid] = kind
        sizes[vid], sym = _nbytes(t, fx)
        symbolic = symbolic or sym

    def storage_of(t: torch.Tensor) -> str | None:
        return by_storage.get(StorageWeakRef(t.untyped_storage()))

    static_idx = set(static_input_indices)
    grad_of_primal = {
        i: o for i, o in enumerate(bw_outputs) if i < len(primals) and isinstance(o, torch.fx.Node)
    }
    static_inputs: set[str] = set()
    for i, ph in enumerate(primals):
        t = ph.meta.get("val")
        if not isinstance(t, torch.Tensor):
            continue  # a SymInt input
        known = storage_of(t)
        if known is not None:
            fx_value[ph.name] = known
            continue
        if i in static_idx:
            kind = "param" if i in grad_of_primal else "buffer"
            static_inputs.add(ph.name)
        else:
            kind = "input"
        new_value(ph.name, t, ph, kind)
    for tg in tangents:
        t = tg.meta.get("val")
        if isinstance(t, torch.Tensor) and storage_of(t) is None:
            new_value(tg.name, t, tg, "input")

    nodes: list[dict[str, Any]] = []
    node_fx: dict[str, torch.fx.Node] = {}
    for n in fx_nodes:
        if n.op == "get_attr":
            t = getattr(joint, str(n.target), None)
            if isinstance(t, torch.Tensor):
                known = storage_of(t)
                if known is None:
                    new_value(n.name, t, n, "buffer")
                else:
                    fx_value[n.name] = known
            continue
        if n.op != "call_function":
            continue
        val = n.meta.get("val")
        if n.target is _getitem:
            if n.name not in fx_value and isinstance(val, torch.Tensor):
                known = storage_of(val)
                if known is not None:
                    fx_value[n.name] = known
            continue
        outs_t = output_tensors(val)
        multi = not isinstance(val, torch.Tensor)
        phase = "forward" if n.name in forward_fx else "backward"
        created: list[str] = []
        for i, t in enumerate(outs_t):
            if t is None:
                continue
            known = storage_of(t)
            if known is None:
                src = aliased_input(n, i, writes=True)
                if src is not None:
                    known = fx_value.get(src.name)
            elem = element_node(n, i) if multi else n
            if known is not None:
                if elem is not None:
                    fx_value[elem.name] = known
                continue
            vid = elem.name if elem is not None else f"{n.name}#{i}"
            new_value(vid, t, elem or n, "activation" if phase == "forward" else "gradient")
            if elem is None:
                del fx_value[n.name]
            created.append(vid)
        if not created and outs_t:
            continue
        inputs: list[str] = []
        for a in n.all_input_nodes:
            vid = fx_value.get(a.name)
            if vid is not None and vid not in inputs:
                inputs.append(vid)
        try:
            flops = node_flops(
                n.target,
                pytree.tree_map(_meta_val, list(n.args)),
                pytree.tree_map(_meta_val, dict(n.kwargs)),
                val,
            )
        except Exception:  # a formula that does not fit this call (or symbolic sizes)
            flops = 0
        flops, sym = _int(flops) if isinstance(flops, torch.SymInt) else (int(flops), False)
        symbolic = symbolic or sym
        mutates = bool(getattr(getattr(n.target, "_schema", None), "is_mutable", False))
        nodes.append(
            {
                "id": n.name,
                "name": n.name,
                "op": op_name(n.target),
                "phase": phase,
                "inputs": tuple(inputs),
                "outputs": tuple(created),
                "flops": flops,
                "rng": is_rng(n.target),
                "recomputable": not mutates,
                "module": "",
            }
        )
        node_fx[n.name] = n

    required: list[str] = []
    for o in [*bw_outputs, *fw_outputs]:
        if isinstance(o, torch.fx.Node) and o.name in fx_value:
            vid = fx_value[o.name]
            if vid not in required:
                required.append(vid)
    # Static, as the simulator counts it: parameters, buffers and every gradient the backward
    # returns (a gradient kept to the end of the step is ``.grad`` memory).
    grads = {v for v in required if kinds[v] == "gradient"}
    static = sum(sizes[v] for v in static_inputs) + sum(sizes[v] for v in grads)
    # Forward nodes first, then backward nodes (both in joint order): a topological order, as
    # no forward op reads what a backward op makes.
    ordered = [d for d in nodes if d["phase"] == "forward"]
    ordered += [d for d in nodes if d["phase"] == "backward"]
    resolved = resolve_cost(cost) if isinstance(cost, str) else cost
    device = resolved if isinstance(resolved, DeviceProfile) else None
    for d in ordered:
        fx = node_fx[d["id"]]
        if device is not None:
            try:
                moved, _ = _int(bytes_moved(fx))
            except Exception:
                moved = 0
            try:  # the op's own rates, as the tracer's default prices it
                t = node_time_s(fx, d["flops"], device, moved=moved, dtype=_dtype_of(fx))
            except Exception:  # shapes it cannot read (symbolic): the plain roofline
                t = roofline_time_s(device, d["flops"], moved, _dtype_of(fx))
            d["time_s"] = float(t)
        else:
            d["time_s"] = d["flops"] * 1e-12
        if not math.isfinite(d["time_s"]):
            d["time_s"] = 0.0
    values = [
        Value(
            id=vid,
            size_bytes=sizes[vid],
            kind=kinds[vid],  # type: ignore[arg-type]
            dtype=dtype_name(t.dtype),
        )
        for vid, t in base.items()
    ]
    graph = Graph(
        name=name,
        nodes=[Node(**d) for d in ordered],
        values=values,
        required=required,
        static_bytes=static,
        device=device,
    )
    return JointIR(
        graph=graph,
        joint=joint,
        node_fx=node_fx,
        value_fx=value_fx,
        fx_value=fx_value,
        primals=primals,
        tangents=tangents,
        fw_outputs=fw_outputs,
        bw_outputs=bw_outputs,
        static_inputs=static_inputs,
        symbolic=symbolic,
    )


def _dtype_of(n: torch.fx.Node) -> str | None:
    for x in [*pytree.tree_leaves(n.meta.get("val")), *(_meta_val(a) for a in n.all_input_nodes)]:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return str(x.dtype).removeprefix("torch.")
    return None
