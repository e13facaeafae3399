"""Where plain eager PyTorch frees the forward pass's storages, folded into the graph.

The joint graph frees a value at its last reader. Eager frees a storage when its last Python
reference dies: a local of a module's ``forward`` that is still bound after its last use (Swin's
window attention keeps ``qkv``, ``q``, ``k`` and ``v``; torchvision's VisionTransformer keeps the
token sequence before its dropout) holds it until the function returns. The captured graph cannot
say this, so it is measured: :func:`eager_forward_frees` runs the unmodified forward and loss on
fake tensors (no real memory) under a dispatch mode that logs every ATen op, the storages each
one creates or writes in place, and the moment each storage is freed. The logged ops are aligned
with the joint graph's forward nodes (the same ops, in the same order, but functionalized: an
in-place op of eager is a new value in the graph, so one eager storage may be several values,
of which the last one written is what eager frees), and each value that eager frees after its
graph lifetime gets ``eager_free_after``: the last graph node that has run when eager frees it.

Only the forward pass and the loss are replayed: after them the model's Python frames are gone,
and what autograd still holds is released in the backward pass by the rules that the graph
already follows. A forward that cannot be replayed on fake tensors leaves the graph unchanged.
"""

from __future__ import annotations

import difflib
import operator
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from remat.ir import Graph
from remat.tracer.shadow import ShadowMode, Shadows, seed_batch, shadowing

LossFn = Callable[[Any], torch.Tensor]

__all__ = [
    "EagerForwardLog",
    "eager_block_args",
    "eager_forward_frees",
    "eager_in_place_nodes",
    "fold_eager_frees",
    "replay_forward",
]


def _base_name(func: Any) -> str:
    """``aten::mul`` for ``aten.mul.Tensor`` and ``aten.mul_.Tensor`` alike (functionalization
    turns eager's in-place ops into their out-of-place forms)."""
    schema = getattr(func, "_schema", None)
    name = str(schema.name) if schema is not None else str(func)
    return name[:-1] if name.endswith("_") else name


def _shape_of(val: Any) -> tuple[int, ...] | None:
    for t in pytree.tree_leaves(val):
        if isinstance(t, torch.Tensor):
            return tuple(int(d) for d in t.shape)
    return None


@dataclass
class EagerForwardLog:
    """What :class:`_ForwardLogger` saw: one entry per ATen op of the eager forward."""

    keys: list[tuple[str, tuple[int, ...] | None]] = field(default_factory=list)
    """(op base name, shape of its first tensor output) per op."""
    made: list[list[tuple[int, int]]] = field(default_factory=list)
    """Per op: (output index, storage key) of each storage it created."""
    wrote: list[list[int]] = field(default_factory=list)
    """Per op: keys of the logged storages it wrote in place."""
    freed_at: dict[int, int] = field(default_factory=dict)
    """Storage key -> number of ops that had started when it was freed (frees up to the
    moment the step would call ``backward``)."""
    calls: list[tuple[str, int, list[int]]] = field(default_factory=list)
    """Per submodule call: (its path, ops logged before it, keys of its tensor arguments'
    storages)."""
    closed: bool = False


def return_alias(returns: Any, out: Any, i: int) -> Any:
    """The alias annotation of output ``i`` of an op with schema returns ``returns`` (None when
    it is new memory). One return of list type (``split``: ``Tensor(a)[]``) covers every
    tensor of the list."""
    if len(returns) == 1 and isinstance(out, (tuple, list)):
        return returns[0].alias_info
    return returns[i].alias_info if i < len(returns) else None


class _ForwardLogger(TorchDispatchMode):
    def __init__(self, log: EagerForwardLog) -> None:
        super().__init__()
        self.log = log
        self._key_of: dict[int, int] = {}  # id(storage) -> key while alive
        self._next = 0

    def _freed(self, sid: int, key: int) -> None:
        self._key_of.pop(sid, None)
        if not self.log.closed:
            self.log.freed_at.setdefault(key, len(self.log.keys))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        log = self.log
        log.keys.append((_base_name(func), _shape_of(out)))
        made: list[tuple[int, int]] = []
        wrote: list[int] = []
        returns = func._schema.returns
        flat = out if isinstance(out, (tuple, list)) else (out,)
        for i, t in enumerate(flat):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            alias = return_alias(returns, out, i)
            if alias is not None:
                if alias.is_write and id(st) in self._key_of:
                    wrote.append(self._key_of[id(st)])
                continue
            if id(st) in self._key_of:
                continue
            key = self._next
            self._next += 1
            self._key_of[id(st)] = key
            weakref.finalize(st, self._freed, id(st), key)
            made.append((i, key))
        log.made.append(made)
        log.wrote.append(wrote)
        return out


def replay_forward(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], loss_fn: LossFn | None
) -> EagerForwardLog | None:
    """Run ``loss_fn(model(*args, **kwargs))`` (the eager forward and loss) on fake tensors and
    log it; None when it cannot run on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu":
            with mode:
                return torch.empty_strided(
                    tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu"
                )
        return mode.from_tensor(t.detach())

    params = {n: fake(p).requires_grad_(p.requires_grad) for n, p in model.named_parameters()}
    buffers = {n: fake(b) for n, b in model.named_buffers()}
    flat, spec = pytree.tree_flatten((args, kwargs))
    fargs, fkwargs = pytree.tree_unflatten(
        [fake(x) if isinstance(x, torch.Tensor) else x for x in flat], spec
    )
    log = EagerForwardLog()
    logger = _ForwardLogger(log)

    def called(path: str) -> Callable[..., None]:
        def hook(_m: nn.Module, a: Any, kw: Any) -> None:
            storages = [
                t.untyped_storage()
                for t in pytree.tree_leaves((a, kw))
                if isinstance(t, torch.Tensor)
            ]
            keys = [logger._key_of[id(s)] for s in storages if id(s) in logger._key_of]
            log.calls.append((path, len(log.keys), keys))

        return hook

    hooks = [
        m.register_forward_pre_hook(called(path), with_kwargs=True)
        for path, m in model.named_modules()
        if path
    ]
    # The model's data questions answered as in the capture (remat.tracer.shadow).
    shadows = Shadows()
    seed_batch(shadows, fkwargs, kwargs)
    try:
        with mode, logger, ShadowMode(shadows), shadowing(shadows):
            out = torch.func.functional_call(model, {**params, **buffers}, fargs, fkwargs)
            loss = loss_fn(out) if loss_fn is not None else out
            del out
            # Where the step calls backward: what the loss's autograd graph holds is freed by
            # the backward pass, not here.
            log.closed = True
            del loss
    except Exception:  # a forward that needs real data: no fold
        return None
    finally:
        for h in hooks:
            h.remove()
    return log


def _fx_key(n: torch.fx.Node) -> tuple[str, tuple[int, ...] | None]:
    return (_base_name(n.target), _shape_of(n.meta.get("val")))


def eager_forward_frees(
    log: EagerForwardLog,
    joint: torch.fx.GraphModule,
    graph: Graph,
    node_fx: Mapping[str, torch.fx.Node],
    fx_value: Mapping[str, str],
) -> dict[str, str]:
    """Value id -> the graph node after which eager frees it, for each forward value that eager
    frees later than the graph's last use (see the module docstring)."""
    fx_of = _aligned(log, joint)

    # The last IR node at or before each FX node (views are not nodes).
    ir_of_fx = {fx.name: nid for nid, fx in node_fx.items()}
    last_ir: dict[str, str] = {}
    cur: str | None = None
    for n in joint.graph.nodes:
        cur = ir_of_fx.get(n.name, cur)
        if cur is not None:
            last_ir[n.name] = cur

    # Each eager storage -> the graph value that holds its last contents.
    latest = {
        key: made[-1][1] for key, made in _storage_values(log, fx_of, graph, fx_value).items()
    }

    last_use: dict[str, int] = {}
    for pos, node in enumerate(graph.nodes):
        for x in node.inputs:
            last_use[x] = pos
    matched = sorted(fx_of)
    out: dict[str, str] = {}
    for key, at in log.freed_at.items():
        vid = latest.get(key)
        if vid is None:
            continue
        # The last matched eager op that had started when the storage was freed.
        j = _last_at_most(matched, at - 1)
        if j is None:
            continue
        node_id = last_ir.get(fx_of[j].name)
        if node_id is None:
            continue
        v = graph.value(vid)
        p = graph.producer_position(vid)
        if p is None or v.kind in ("input", "param", "buffer") or graph.is_required(vid):
            continue
        if graph.node(node_id).phase != "forward":
            continue
        if graph.node_position(node_id) > max(p, last_use.get(vid, p)):
            out[vid] = node_id
    return out


def _storage_values(
    log: EagerForwardLog,
    fx_of: Mapping[int, torch.fx.Node],
    graph: Graph,
    fx_value: Mapping[str, str],
) -> dict[int, list[tuple[int, str]]]:
    """Eager storage key -> the graph values that hold its contents, in op order: (index of the
    logged op that made or wrote it, value id). Functionalized, an eager storage written in
    place is one value per write."""

    def value_of(n: torch.fx.Node, i: int) -> str | None:
        if isinstance(n.meta.get("val"), torch.Tensor):
            return fx_value.get(n.name)
        for u in n.users:
            if u.target is operator.getitem and u.args[1] == i:
                return fx_value.get(u.name)
        vid = f"{n.name}#{i}"
        return vid if graph.has_value(vid) else None

    history: dict[int, list[tuple[int, str]]] = {}
    for i, fx in sorted(fx_of.items()):
        for out_i, key in log.made[i]:
            vid = value_of(fx, out_i)
            if vid is not None:
                history.setdefault(key, []).append((i, vid))
        for key in log.wrote[i]:
            vid = value_of(fx, 0)
            if vid is not None and key in history:
                history[key].append((i, vid))
    return history


def eager_block_args(
    log: EagerForwardLog, joint: torch.fx.GraphModule, graph: Graph, fx_value: Mapping[str, str]
) -> dict[str, tuple[str, ...]]:
    """Value id -> the module paths whose ``forward`` was called with its storage among the
    tensor arguments (``Value.held_by``): the contents the storage held at the call."""
    history = _storage_values(log, _aligned(log, joint), graph, fx_value)
    held: dict[str, set[str]] = {}
    for path, at, keys in log.calls:
        for key in keys:
            before = [vid for i, vid in history.get(key, []) if i < at]
            if before:
                held.setdefault(before[-1], set()).add(path)
    return {vid: tuple(sorted(paths)) for vid, paths in held.items()}


def _aligned(log: EagerForwardLog, joint: torch.fx.GraphModule) -> dict[int, torch.fx.Node]:
    """Logged eager op index -> the joint graph's forward FX node it is (same ops in the same
    order, up to functionalization)."""
    fwd = [
        n
        for n in joint.graph.nodes
        if n.op == "call_function"
        and n.target is not operator.getitem
        and n.meta.get("partitioner_tag") != "is_backward"
    ]
    matcher = difflib.SequenceMatcher(None, log.keys, [_fx_key(n) for n in fwd], autojunk=False)
    fx_of: dict[int, torch.fx.Node] = {}
    for block in matcher.get_matching_blocks():
        for d in range(block.size):
            fx_of[block.a + d] = fwd[block.b + d]
    return fx_of


def eager_in_place_nodes(
    log: EagerForwardLog, joint: torch.fx.GraphModule, node_fx: Mapping[str, torch.fx.Node]
) -> frozenset[str]:
    """The forward graph nodes whose eager op writes in place into a storage that an earlier op
    made (dropout's ``bernoulli_`` and ``div_`` on its noise): functionalized, each is a new
    value here, and a selective checkpoint policy cannot cache it (``Node.eager_in_place``)."""
    ir_of_fx = {fx.name: nid for nid, fx in node_fx.items()}
    return frozenset(
        ir_of_fx[fx.name]
        for i, fx in _aligned(log, joint).items()
        if log.wrote[i] and fx.name in ir_of_fx
    )


def _last_at_most(sorted_ints: list[int], x: int) -> int | None:
    import bisect

    k = bisect.bisect_right(sorted_ints, x)
    return sorted_ints[k - 1] if k else None


def fold_eager_frees(
    graph: Graph,
    frees: Mapping[str, str | None],
    in_place: frozenset[str] = frozenset(),
    held_by: Mapping[str, tuple[str, ...]] | None = None,
) -> Graph:
    """``graph`` with ``eager_free_after`` set on the values in ``frees``, ``held_by`` on the
    values in ``held_by`` and ``eager_in_place`` on the nodes in ``in_place``."""
    held_by = held_by or {}
    if not frees and not in_place and not held_by:
        return graph

    def update(v: Any) -> dict[str, Any]:
        up: dict[str, Any] = {}
        if v.id in frees:
            up["eager_free_after"] = frees[v.id]
        if v.id in held_by:
            up["held_by"] = held_by[v.id]
        return up

    values = [v.model_copy(update=update(v)) if update(v) else v for v in graph.values]
    nodes = [
        n.model_copy(update={"eager_in_place": True}) if n.id in in_place else n
        for n in graph.nodes
    ]
    return Graph(
        name=graph.name,
        nodes=nodes,
        values=values,
        required=graph.required,
        static_bytes=graph.static_bytes,
        device=graph.device,
    )
