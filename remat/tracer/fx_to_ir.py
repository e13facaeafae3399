"""A functional joint forward+backward FX graph -> :class:`remat.ir.Graph`, by storage.

:func:`joint_to_ir` is the one entry point: it takes the joint graph (as AOT autograd's
partition function receives it: placeholders ``[*primals, *tangents]``, outputs
``[*updated buffers, loss, *one gradient per primal]``) and a :class:`JointSignature` saying
what the placeholders and outputs are, and returns an :class:`IrMapping`: the IR graph and the
maps between FX nodes and IR ids. It runs small named passes over typed records, each
returning new records:

1. :func:`forward_modules`: the module path of each forward ``seq_nr``, for backward nodes;
2. :func:`map_storages`: every storage becomes a :class:`StorageRecord`, every op that creates
   one an :class:`OpRecord` (views and aliases fold into the ops that read them);
3. :func:`read_outputs`: the role of each joint output;
4. :func:`classify_outputs`: the loss, the parameter gradients and the updated buffers;
5. :func:`mark_side_effects`: the ops that make updated buffers are not recomputable;
6. :func:`hold_until_group_end`: a backward autograd node's inputs live until its last op;
7. :func:`build_graph`: the validated :class:`~remat.ir.Graph`.

Storage mapping
---------------
Every tensor in the joint graph lives in a storage; each storage is one IR :class:`Value`
(``size_bytes`` is the storage's size). The op that creates a storage is an IR :class:`Node`
with the FX node's name as id and name; ops whose outputs only alias existing storages (views,
``detach``, tuple ``getitem``) are not nodes: a node that reads a view lists the base value.
Kinds: ``param`` and ``buffer`` placeholders, ``input`` for the example inputs and the loss's
incoming gradient (``tangents_1``, the ``ones`` that ``loss.backward()`` creates), ``buffer`` for
updated buffers and graph constants, ``loss``, ``gradient`` for values made in the backward phase
(required for parameter gradients), ``activation`` otherwise. Value ids are FX node names too; a
value that no FX node names alone (an unused element ``i`` of a multi-output op ``n``) has id
``"n#i"``.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

from remat.ir import Graph, Value
from remat.ir.graph import ValueKind
from remat.tracer.errors import TraceError
from remat.tracer.flops import node_flops
from remat.tracer.records import (
    IrMapping,
    JointOutputs,
    JointSignature,
    OpRecord,
    OutputRole,
    OutputValues,
    Phase,
    StorageMap,
    StorageRecord,
)

_getitem = operator.getitem

__all__ = [
    "IrMapping",
    "JointSignature",
    "build_graph",
    "classify_outputs",
    "forward_modules",
    "hold_until_group_end",
    "joint_to_ir",
    "map_storages",
    "mark_side_effects",
    "read_outputs",
]


# -- the entry point --------------------------------------------------------------------------


def joint_to_ir(joint: torch.fx.GraphModule, signature: JointSignature) -> IrMapping:
    """Map a functional joint graph to the IR by storage (the passes of this module in order).

    Raises
    ------
    TraceError
        When the graph does not have the shape the signature describes, or a parameter's
        gradient is not a fresh backward tensor.
    """
    seq_module = forward_modules(joint)
    smap = map_storages(joint, signature, seq_module)
    outputs = read_outputs(joint, signature)
    values = classify_outputs(smap, outputs, signature)
    ops = mark_side_effects(smap.ops, values.buffer_updates)
    kinds = {vid: values.kinds.get(vid, s.kind) for vid, s in smap.storages.items()}
    ops = hold_until_group_end(ops, kinds)
    graph = build_graph(signature.model_name, smap, ops, values, kinds)
    return IrMapping(
        graph=graph,
        node_fx=smap.node_fx,
        value_fx={vid: s.fx for vid, s in smap.storages.items()},
        value_aliases=smap.value_aliases,
        fx_value=smap.fx_value,
        param_values=smap.param_values,
        buffer_values=smap.buffer_values,
        input_values=smap.input_values,
        tangent_value=smap.tangent_value,
        loss_value=values.loss_value,
        grad_values=values.grad_values,
        buffer_updates=values.buffer_updates,
        output_roles=outputs.roles,
    )


# -- pass 1: modules --------------------------------------------------------------------------


def module_of(n: torch.fx.Node) -> str:
    """The innermost module path recorded on a forward FX node ("" for the top level)."""
    stack = n.meta.get("nn_module_stack")
    if stack:
        return str(list(stack.values())[-1][0])
    return ""


def phase_of(n: torch.fx.Node) -> Phase:
    return "backward" if n.meta.get("partitioner_tag") == "is_backward" else "forward"


def forward_modules(joint: torch.fx.GraphModule) -> dict[int, str]:
    """The module of the first forward op of each ``seq_nr``: backward ops with that
    ``seq_nr`` belong to it."""
    seq_module: dict[int, str] = {}
    for n in joint.graph.nodes:
        if n.op == "call_function" and phase_of(n) == "forward":
            seq = n.meta.get("seq_nr")
            if seq is not None and seq not in seq_module:
                seq_module[seq] = module_of(n)
    return seq_module


# -- pass 2: storages -------------------------------------------------------------------------


class _StorageTable:
    """The storages seen so far during :func:`map_storages` (private to that pass)."""

    def __init__(self) -> None:
        self.by_storage: dict[StorageWeakRef, str] = {}
        self.records: dict[str, StorageRecord] = {}
        self.aliases: dict[str, list[torch.fx.Node]] = {}
        self.fx_value: dict[str, str] = {}

    def new(self, vid: str, t: torch.Tensor, fx: torch.fx.Node, kind: ValueKind) -> None:
        self.by_storage[StorageWeakRef(t.untyped_storage())] = vid
        self.records[vid] = StorageRecord(id=vid, tensor=t, fx=fx, kind=kind)
        self.aliases[vid] = [fx]
        self.fx_value[fx.name] = vid

    def alias(self, fx: torch.fx.Node, vid: str) -> None:
        self.fx_value[fx.name] = vid
        self.aliases[vid].append(fx)

    def of(self, t: torch.Tensor) -> str | None:
        return self.by_storage.get(StorageWeakRef(t.untyped_storage()))


def map_storages(
    joint: torch.fx.GraphModule, signature: JointSignature, seq_module: Mapping[int, str]
) -> StorageMap:
    """One :class:`StorageRecord` per storage and one :class:`OpRecord` per op that creates
    storages, in graph order; views and aliases are folded into the ops that read them."""
    P, B = len(signature.param_names), len(signature.buffer_names)
    fx_nodes = list(joint.graph.nodes)
    table = _StorageTable()

    placeholders = [n for n in fx_nodes if n.op == "placeholder"]
    primals = placeholders[: signature.num_primals]
    tangents = placeholders[signature.num_primals :]
    if len(tangents) != 1:
        raise TraceError(f"expected one tangent (the loss's gradient), found {len(tangents)}")
    param_values: dict[str, str] = {}
    buffer_values: dict[str, str] = {}
    input_values: list[str] = []
    for i, ph in enumerate(primals):
        t = ph.meta["val"]
        known = table.of(t)
        if known is not None:  # two primals on one storage (should not happen: tied are deduped)
            table.alias(ph, known)
            vid = known
        else:
            kind: ValueKind = "param" if i < P else ("buffer" if i < P + B else "input")
            table.new(ph.name, t, ph, kind)
            vid = ph.name
        if i < P:
            param_values[signature.param_names[i]] = vid
        elif i < P + B:
            buffer_values[signature.buffer_names[i - P]] = vid
        else:
            input_values.append(vid)
    tangent = tangents[0]
    table.new(tangent.name, tangent.meta["val"], tangent, "input")

    attr_value: dict[str, str] = {}
    ops: list[OpRecord] = []
    node_fx: dict[str, torch.fx.Node] = {}
    for n in fx_nodes:
        if n.op == "get_attr":
            _map_constant(joint, n, table, attr_value)
            continue
        if n.op != "call_function":
            continue
        val = n.meta.get("val")
        if n.target is _getitem:
            # A tuple element: its value was made with the multi-output op (or it aliases one).
            if n.name not in table.fx_value and isinstance(val, torch.Tensor):
                known = table.of(val)
                if known is not None:
                    table.alias(n, known)
            continue
        outs = output_tensors(val)
        created = _map_outputs(n, outs, table)
        if not created and outs:
            continue  # a view or alias: folded into the nodes that read it
        inputs: list[str] = []
        for a in n.all_input_nodes:
            vid = table.fx_value.get(a.name)
            if vid is not None and vid not in inputs:
                inputs.append(vid)
        phase = phase_of(n)
        seq = n.meta.get("seq_nr")
        module = n.meta.get("remat_module")
        if module is None:  # a pass's own node names its module (see joint_passes)
            module = module_of(n) if phase == "forward" else seq_module.get(seq, "")
        ops.append(
            OpRecord(
                id=n.name,
                op=op_name(n.target),
                phase=phase,
                inputs=tuple(inputs),
                outputs=tuple(created),
                flops=_flops(n, val),
                module=module,
                rng=_is_rng(n.target),
                recomputable=True,
                seq_nr=seq,
            )
        )
        node_fx[n.name] = n
    return StorageMap(
        storages=table.records,
        ops=tuple(ops),
        node_fx=node_fx,
        value_aliases=table.aliases,
        fx_value=table.fx_value,
        param_values=param_values,
        buffer_values=buffer_values,
        input_values=input_values,
        tangent_value=tangent.name,
    )


def _map_constant(
    joint: torch.fx.GraphModule,
    n: torch.fx.Node,
    table: _StorageTable,
    attr_value: dict[str, str],
) -> None:
    """A ``get_attr`` tensor (a constant the model made in ``forward``) is a ``buffer``."""
    t = n.meta.get("val")
    if t is None:
        t = getattr(joint, str(n.target), None)
    if not isinstance(t, torch.Tensor):
        return
    known = attr_value.get(str(n.target)) or table.of(t)
    attr_value.setdefault(str(n.target), known or n.name)
    if known is None:
        table.new(n.name, t, n, "buffer")
    else:
        table.alias(n, known)


def _map_outputs(
    n: torch.fx.Node, outs: Sequence[torch.Tensor | None], table: _StorageTable
) -> list[str]:
    """Record the storages that ``n``'s outputs create (aliases of known ones are folded)."""
    created: list[str] = []
    multi = not isinstance(n.meta.get("val"), torch.Tensor)
    for i, t in enumerate(outs):
        if t is None:
            continue
        known = table.of(t)
        if known is None:
            src = aliased_input(n, i)
            if src is not None:
                known = table.fx_value.get(src.name)
        if known is not None:
            if not multi:
                table.alias(n, known)
            else:
                elem = element_node(n, i)
                if elem is not None:
                    table.alias(elem, known)
            continue
        base = element_node(n, i) if multi else n
        vid = base.name if base is not None else f"{n.name}#{i}"
        table.new(vid, t, base or n, "gradient" if phase_of(n) == "backward" else "activation")
        if base is None:
            del table.fx_value[n.name]
        created.append(vid)
    return created


def _flops(n: torch.fx.Node, val: Any) -> int:
    flat_args = pytree.tree_map(_meta_val, list(n.args))
    flat_kwargs = pytree.tree_map(_meta_val, dict(n.kwargs))
    try:
        return node_flops(n.target, flat_args, flat_kwargs, val)
    except Exception:  # a formula that does not fit this call: count nothing
        return 0


# -- pass 3 and 4: outputs --------------------------------------------------------------------


def read_outputs(joint: torch.fx.GraphModule, signature: JointSignature) -> JointOutputs:
    """The role of each joint output: ``("buffer", name)``, ``("loss", "")``, ``("grad",
    param name)`` or ``("none", "")``."""
    P = len(signature.param_names)
    out_node = next(n for n in reversed(joint.graph.nodes) if n.op == "output")
    out_args = pytree.tree_leaves(out_node.args[0], is_leaf=lambda x: x is None)
    n_mut = len(signature.mutated_buffers)
    roles: list[OutputRole] = []
    for j in range(len(out_args)):
        if j < n_mut:
            roles.append(("buffer", signature.mutated_buffers[j]))
        elif j == n_mut:
            roles.append(("loss", ""))
        else:
            k = j - n_mut - 1
            if k < P and out_args[j] is not None:
                roles.append(("grad", signature.param_names[k]))
            else:
                roles.append(("none", ""))
    grads: dict[str, torch.fx.Node] = {}
    buffers: dict[str, torch.fx.Node] = {}
    loss: torch.fx.Node | None = None
    for (role, name), a in zip(roles, out_args, strict=True):
        if role == "buffer":
            buffers[name] = a
        elif role == "grad":
            grads[name] = a
        elif role == "loss":
            loss = a
    if loss is None:
        raise TraceError("the joint graph has no loss output")
    return JointOutputs(roles=roles, loss=loss, grads=grads, buffers=buffers)


def classify_outputs(
    smap: StorageMap, outputs: JointOutputs, signature: JointSignature
) -> OutputValues:
    """The loss value, the gradient of each parameter with ``requires_grad`` and the updated
    buffers, with the kinds they take."""
    kinds: dict[str, ValueKind] = {}
    loss_value = smap.fx_value[outputs.loss.name]
    kinds[loss_value] = "loss"
    producer_phase = {o: op.phase for op in smap.ops for o in op.outputs}
    grad_values: dict[str, str] = {}
    for pname, a in outputs.grads.items():
        vid = smap.fx_value[a.name]
        if producer_phase.get(vid) != "backward":
            raise TraceError(
                f"the gradient of parameter {pname!r} is not a fresh tensor made by the backward "
                f"pass (it aliases value {vid!r}); such models are not supported"
            )
        # Two parameters may get one storage as gradient (the CPU LSTM kernel returns the same
        # tensor for both biases): one value, required once; eager copies it into the second
        # ``.grad``, and static_bytes counts a gradient per parameter either way.
        kinds[vid] = "gradient"
        if signature.requires_grad.get(pname, True):
            grad_values[pname] = vid
    made = {o for op in smap.ops for o in op.outputs}
    buffer_updates: dict[str, str] = {}
    for bname, a in outputs.buffers.items():
        vid = smap.fx_value[a.name]
        if vid not in made:
            raise TraceError(f"buffer {bname!r} is updated to an existing tensor {vid!r}")
        kinds[vid] = "buffer"
        buffer_updates[bname] = vid
    return OutputValues(
        loss_value=loss_value, grad_values=grad_values, buffer_updates=buffer_updates, kinds=kinds
    )


# -- pass 5 and 6: node properties ------------------------------------------------------------


def mark_side_effects(
    ops: Sequence[OpRecord], buffer_updates: Mapping[str, str]
) -> tuple[OpRecord, ...]:
    """Ops that make an updated buffer are side effects: not recomputable."""
    updated = set(buffer_updates.values())
    return tuple(
        dataclasses.replace(op, recomputable=False) if updated & set(op.outputs) else op
        for op in ops
    )


def hold_until_group_end(
    ops: Sequence[OpRecord], kinds: Mapping[str, ValueKind]
) -> tuple[OpRecord, ...]:
    """Make each backward autograd node's inputs live until its last op, as in eager.

    Eager autograd runs one backward node (e.g. ``BmmBackward``) as a unit: its saved tensors
    and incoming gradients are released when the whole node has run. The joint graph spells the
    node as several ops with the same ``seq_nr``; without this, a value read only by the first
    of them would be freed between them, earlier than eager frees it. Likewise the intermediate
    results of the node's formula (C++ locals and temporaries) live until the formula returns.
    The last op of each such run lists every dynamic value the earlier ops of the run read or
    make.
    """
    out = list(ops)
    i = 0
    while i < len(out):
        seq = out[i].seq_nr
        j = i + 1
        if out[i].phase == "backward" and seq is not None:
            while j < len(out) and out[j].phase == "backward" and out[j].seq_nr == seq:
                j += 1
        if j - i > 1:
            run = out[i:j]
            last = run[-1]
            # Reads from outside the run, and what earlier ops of the run made (C++ locals and
            # temporaries of the backward formula live until it returns).
            # ``copy_`` in a formula (CopySlices) is functionalized into ``copy``, a new
            # storage where eager writes in place: its destination and result are not held.
            made = {o for op in run for o in op.outputs}
            copies = {
                v
                for op in run
                if op.op == "aten.copy.default"
                for v in (*op.outputs, *op.inputs[:1])
            }
            extra = [
                x
                for op in run[:-1]
                for x in (*op.inputs, *op.outputs)
                if x not in last.outputs
                and kinds.get(x) not in ("param", "buffer")
                and (x not in copies or x not in made)
            ]
            merged = list(last.inputs)
            for x in extra:
                if x not in merged:
                    merged.append(x)
            out[j - 1] = dataclasses.replace(last, inputs=tuple(merged))
        i = j
    return tuple(out)


# -- pass 7: the graph ------------------------------------------------------------------------


def build_graph(
    name: str,
    smap: StorageMap,
    ops: Sequence[OpRecord],
    values: OutputValues,
    kinds: Mapping[str, ValueKind],
) -> Graph:
    """The validated IR graph: values by storage, nodes in graph order, the gradients and the
    loss required, parameters, their gradients and buffers static."""
    ir_values = [
        Value(
            id=vid,
            size_bytes=storage_bytes(s.tensor, s.fx),
            kind=kinds[vid],
            shape=tuple(int(d) for d in s.tensor.shape),
            dtype=dtype_name(s.tensor.dtype),
        )
        for vid, s in smap.storages.items()
    ]
    required = [*dict.fromkeys(values.grad_values.values()), values.loss_value]
    # Backward ops of one autograd node share its seq_nr; numbered 0, 1, ... in order here (the
    # raw numbers count every autograd node made in the process: the same model traced twice
    # must give the same graph).
    group: dict[int, int] = {}
    for op in ops:
        if op.phase == "backward" and op.seq_nr is not None:
            group.setdefault(op.seq_nr, len(group))
    return Graph(
        name=name,
        nodes=[
            op.to_node(
                group.get(op.seq_nr) if op.phase == "backward" and op.seq_nr is not None else None
            )
            for op in ops
        ],
        values=ir_values,
        required=required,
        static_bytes=static_bytes(smap, values.grad_values),
    )


def static_bytes(smap: StorageMap, grad_values: Mapping[str, str]) -> int:
    """Parameters, their gradients (one per parameter with requires_grad) and buffers."""
    size = {vid: int(s.tensor.untyped_storage().nbytes()) for vid, s in smap.storages.items()}
    params = set(smap.param_values.values())
    buffers = set(smap.buffer_values.values())
    grads = sum(size[smap.param_values[p]] for p in grad_values)
    return sum(size[v] for v in params) + sum(size[v] for v in buffers) + grads


# CPU loss kernels that compute the unreduced loss into their result tensor and then reduce it
# in place: the scalar they return keeps a storage as large as the input. Fake tensors report 4
# bytes; the eager step holds the full size until the loss is freed.
_FULL_STORAGE_REDUCTIONS = frozenset(
    {
        "aten.mse_loss.default",
        "aten.smooth_l1_loss.default",
        "aten.soft_margin_loss.default",
        "aten.binary_cross_entropy.default",
    }
)


def storage_bytes(t: torch.Tensor, fx: torch.fx.Node) -> int:
    """Bytes of the storage of ``t`` (made by ``fx``) as the eager CPU kernel allocates it."""
    nbytes = int(t.untyped_storage().nbytes())
    if fx.op == "call_function" and op_name(fx.target) in _FULL_STORAGE_REDUCTIONS:
        src = fx.args[0].meta.get("val") if isinstance(fx.args[0], torch.fx.Node) else None
        reduction = fx.args[2] if len(fx.args) > 2 else fx.kwargs.get("reduction", 1)
        if isinstance(src, torch.Tensor) and reduction != 0:
            nbytes = max(nbytes, int(src.numel() * t.element_size()))
    return nbytes


# -- small helpers ----------------------------------------------------------------------------


def op_name(target: Any) -> str:
    """``aten.mm.default`` for an aten overload, the callable's name otherwise."""
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target.__name__}" if target.namespace == "aten" else str(target)
    return getattr(target, "__name__", str(target))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _is_rng(target: Any) -> bool:
    tags = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def output_tensors(val: Any) -> list[torch.Tensor | None]:
    """The tensors of a node's ``meta['val']``: one, or one per output (``None`` for others)."""
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [v if isinstance(v, torch.Tensor) else None for v in val]
    return []


def _meta_val(x: Any) -> Any:
    return x.meta.get("val") if isinstance(x, torch.fx.Node) else x


def aliased_input(n: torch.fx.Node, i: int, *, writes: bool = False) -> torch.fx.Node | None:
    """The FX input that output ``i`` of ``n`` aliases according to the op's schema, if any;
    an in-place op's output (a write alias) counts only with ``writes=True``."""
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return None
    returns = schema.returns
    if not returns:
        return None
    ret = returns[min(i, len(returns) - 1)]
    if ret.alias_info is None or (ret.alias_info.is_write and not writes):
        return None
    sets = set(ret.alias_info.before_set)
    for k, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is None or not sets & set(info.before_set):
            continue
        value = n.args[k] if k < len(n.args) else n.kwargs.get(arg.name)
        if isinstance(value, torch.fx.Node):
            return value
    return None


def element_node(n: torch.fx.Node, i: int) -> torch.fx.Node | None:
    """The ``getitem`` node that extracts element ``i`` of a multi-output node, if any."""
    for u in n.users:
        if u.target is _getitem and u.args[1] == i:
            return u
    return None
