"""Build a training-step graph from forward ops: the backward pass is derived, as autograd would.

:class:`StepBuilder` records forward operations (what they read, what they produce, which
values their backward needs) and :meth:`StepBuilder.build` appends the backward pass in reverse
order: one backward node per differentiable forward op, reading the gradients of its outputs
and the values it saved, writing gradient contributions for its inputs; a value read by several
ops gets an accumulation node that sums its contributions. Times come from a roofline of the
builder's device profile. The synthetic families and the tests build their graphs with it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from remat.ir.devices import A100_SXM_80GB, roofline_time_s
from remat.ir.graph import DeviceProfile, Graph, Node, Phase, Value, ValueKind
from remat.ir.sharding import DTYPE_BYTES


@dataclass(frozen=True)
class Out:
    """An output of a forward op: its name hint, shape, dtype (builder's default when None)
    and whether a gradient flows back through it."""

    name: str
    shape: tuple[int, ...]
    dtype: str | None = None
    grad: bool = True


@dataclass
class _Op:
    node_id: str
    op: str
    inputs: list[str]
    outputs: list[str]
    saved: list[str]
    flops: int
    bwd_flops: int
    module: str
    rng: bool
    recomputable: bool
    workspace_bytes: int
    differentiable: bool


@dataclass
class StepBuilder:
    """Records a forward pass and derives its backward pass. See the module docstring."""

    name: str
    device: DeviceProfile = A100_SXM_80GB
    dtype: str = "float32"
    optimizer_state_bytes: int = 0
    _values: dict[str, Value] = field(default_factory=dict)
    _ops: list[_Op] = field(default_factory=list)
    _requires_grad: dict[str, bool] = field(default_factory=dict)
    _node_ids: set[str] = field(default_factory=set)
    _loss: str | None = None

    # -- leaves --------------------------------------------------------------------------------

    def input(self, name: str, shape: Sequence[int], dtype: str | None = None) -> str:
        return self._leaf(name, shape, dtype, "input", requires_grad=False)

    def param(self, name: str, shape: Sequence[int], dtype: str | None = None) -> str:
        return self._leaf(name, shape, dtype, "param", requires_grad=True)

    def buffer(self, name: str, shape: Sequence[int], dtype: str | None = None) -> str:
        return self._leaf(name, shape, dtype, "buffer", requires_grad=False)

    def _leaf(
        self,
        name: str,
        shape: Sequence[int],
        dtype: str | None,
        kind: ValueKind,
        *,
        requires_grad: bool,
    ) -> str:
        vid = self._unique_value_id(name)
        self._add_value(vid, tuple(shape), dtype or self.dtype, kind, None)
        self._requires_grad[vid] = requires_grad
        return vid

    # -- ops -----------------------------------------------------------------------------------

    def op(
        self,
        op: str,
        inputs: Sequence[str],
        outputs: Sequence[Out],
        *,
        flops: int = 0,
        bwd_flops: int | None = None,
        save: Sequence[str] = (),
        module: str = "",
        rng: bool = False,
        recomputable: bool = True,
        workspace_bytes: int = 0,
        differentiable: bool = True,
        kind: ValueKind = "activation",
    ) -> list[str]:
        """Record one forward op; returns its output value ids.

        ``save`` lists the inputs and outputs its backward reads. ``bwd_flops`` defaults to
        twice ``flops`` (one product for each operand's gradient, as for a matmul).
        """
        short = op.split(".")[1] if op.startswith("aten.") else op
        node_id = self._unique_node_id(f"{module}/{short}" if module else short)
        out_ids = []
        for o in outputs:
            vid = self._unique_value_id(o.name)
            self._add_value(vid, o.shape, o.dtype or self.dtype, kind, node_id)
            out_ids.append(vid)
        any_grad = differentiable and any(self._requires_grad.get(x, False) for x in inputs)
        for o, vid in zip(outputs, out_ids, strict=True):
            self._requires_grad[vid] = any_grad and o.grad
        resolved_save = [out_ids[int(s[1:])] if s.startswith("$") else s for s in save]
        self._ops.append(
            _Op(
                node_id=node_id,
                op=op,
                inputs=list(inputs),
                outputs=out_ids,
                saved=resolved_save,
                flops=int(flops),
                bwd_flops=int(2 * flops if bwd_flops is None else bwd_flops),
                module=module,
                rng=rng,
                recomputable=recomputable,
                workspace_bytes=workspace_bytes,
                differentiable=any_grad,
            )
        )
        return out_ids

    def loss(
        self,
        op: str,
        inputs: Sequence[str],
        *,
        flops: int = 0,
        save: Sequence[str] = (),
        module: str = "loss",
    ) -> str:
        """Record the scalar loss; its backward seeds the backward pass."""
        (vid,) = self.op(
            op,
            inputs,
            [Out("loss", (), "float32")],
            flops=flops,
            bwd_flops=flops,
            save=save,
            module=module,
            kind="loss",
        )
        self._loss = vid
        return vid

    # -- the backward pass and the graph ---------------------------------------------------------

    def build(self) -> Graph:
        if self._loss is None:
            raise ValueError(f"graph {self.name!r}: call loss(...) before build()")
        nodes: list[Node] = [
            self._node(
                o.node_id,
                o.op,
                "forward",
                o.inputs,
                o.outputs,
                o.flops,
                o.module,
                o.rng,
                o.recomputable,
                o.workspace_bytes,
            )
            for o in self._ops
        ]
        contributions: dict[str, list[str]] = {}
        readers: dict[str, int] = {}  # differentiable ops that will send a value a gradient
        for o in self._ops:
            if o.differentiable:
                for x in dict.fromkeys(o.inputs):
                    if self._requires_grad.get(x):
                        readers[x] = readers.get(x, 0) + 1

        def grad_of(v: str, module: str) -> str | None:
            parts = contributions.get(v, [])
            if not parts:
                return None
            if len(parts) == 1:
                return parts[0]
            return self._accumulate(v, parts, module, nodes)

        for o in reversed(self._ops):
            if not o.differentiable:
                continue
            is_loss = o.outputs == [self._loss]
            out_grads = []
            if not is_loss:
                for out in o.outputs:
                    if self._requires_grad.get(out):
                        g = grad_of(out, o.module)
                        if g is not None:
                            out_grads.append(g)
                if not out_grads:
                    continue
            targets = list(dict.fromkeys(x for x in o.inputs if self._requires_grad.get(x)))
            if not targets:
                continue
            bwd_id = self._unique_node_id(f"{o.node_id}.backward")
            params = [x for x in o.inputs if self._values[x].kind == "param"]
            reads = list(dict.fromkeys([*out_grads, *o.saved, *params]))
            outs = []
            for t in targets:
                hint = f"grad[{t}]" if readers.get(t, 0) == 1 else f"grad[{t}]@{o.node_id}"
                gid = self._unique_value_id(hint)
                tv = self._values[t]
                self._add_value(gid, tv.shape or (), tv.dtype or self.dtype, "gradient", bwd_id)
                contributions.setdefault(t, []).append(gid)
                outs.append(gid)
            nodes.append(
                self._node(
                    bwd_id,
                    o.op + ".backward",
                    "backward",
                    reads,
                    outs,
                    o.bwd_flops,
                    o.module,
                    False,
                    True,
                    o.workspace_bytes,
                )
            )

        required: list[str] = []
        static = self.optimizer_state_bytes
        for v in list(self._values.values()):
            if v.kind in ("param", "buffer") and v.producer is None:
                static += v.size_bytes
            if v.kind == "param":
                g = grad_of(v.id, "")
                if g is not None:
                    required.append(g)
                    static += v.size_bytes
        required.append(self._loss)
        return Graph(
            name=self.name,
            nodes=tuple(nodes),
            values=tuple(self._values.values()),
            required=tuple(required),
            static_bytes=static,
            device=self.device,
        )

    def _accumulate(self, v: str, parts: list[str], module: str, nodes: list[Node]) -> str:
        vv = self._values[v]
        node_id = self._unique_node_id(f"{module}/accumulate_grad" if module else "accumulate_grad")
        gid = self._unique_value_id(f"grad[{v}]")
        self._add_value(gid, vv.shape or (), vv.dtype or self.dtype, "gradient", node_id)
        numel = math.prod(vv.shape or ())
        nodes.append(
            self._node(
                node_id,
                "aten.add.Tensor",
                "backward",
                parts,
                [gid],
                numel * (len(parts) - 1),
                module,
                False,
                True,
                0,
            )
        )
        return gid

    # -- helpers ---------------------------------------------------------------------------------

    def _node(
        self,
        node_id: str,
        op: str,
        phase: Phase,
        inputs: Sequence[str],
        outputs: Sequence[str],
        flops: int,
        module: str,
        rng: bool,
        recomputable: bool,
        workspace_bytes: int,
    ) -> Node:
        moved = sum(self._values[x].size_bytes for x in (*inputs, *outputs))
        dtype = self._values[outputs[0]].dtype if outputs else self.dtype
        t = roofline_time_s(self.device, flops, moved, dtype)
        return Node(
            id=node_id,
            name=node_id,
            op=op,
            phase=phase,
            inputs=tuple(dict.fromkeys(inputs)),
            outputs=tuple(outputs),
            time_s=t,
            flops=flops,
            workspace_bytes=workspace_bytes,
            recomputable=recomputable,
            module=module,
            rng=rng,
        )

    def _add_value(
        self, vid: str, shape: tuple[int, ...], dtype: str, kind: ValueKind, producer: str | None
    ) -> None:
        size = math.prod(shape) * DTYPE_BYTES[dtype]
        self._values[vid] = Value(
            id=vid, size_bytes=size, kind=kind, shape=shape, dtype=dtype, producer=producer
        )

    def _unique_value_id(self, hint: str) -> str:
        vid, k = hint, 1
        while vid in self._values:
            k += 1
            vid = f"{hint}#{k}"
        return vid

    def _unique_node_id(self, hint: str) -> str:
        nid, k = hint, 1
        while nid in self._node_ids:
            k += 1
            nid = f"{hint}#{k}"
        self._node_ids.add(nid)
        return nid
