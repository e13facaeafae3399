"""The step of one rank under FSDP2 or DDP, made from the unsharded trace.

:func:`shard_graph` rewrites a traced step (one process, the whole model) into the step of one
rank of a data-parallel group described by a :class:`~remat.ir.sharding.ShardingSpec`. The
graph's own ops are kept as they are; what sharding changes is added around them:

FSDP2 (Zhao et al. 2023, "PyTorch FSDP"; ZeRO-3, Rajbhandari et al. 2020)
    * static bytes: each parameter's shard (dim 0 padded to a multiple of the world size, as
      FSDP2 pads, rank 0's chunk: ``ceil(dim0 / w)`` rows), its gradient's shard, the optimizer
      state the graph counts scaled alike; buffers whole; the root unit's gathered parameters
      too (FSDP2 never reshards the root after forward: they are held the whole step);
    * per non-root unit ``U`` (a module passed to ``fully_shard``), in forward: a node
      ``fsdp.all_gather.forward:U`` before the unit's first op makes the value
      ``fsdp.unsharded.forward:U`` (the gathered parameters, in ``param_dtype``; its workspace is
      the flat all-gather buffer FSDP2 copies out of), which ``fsdp.reshard.forward:U`` after
      the unit's last op frees;
    * in backward: ``fsdp.all_gather.backward:U`` at the unit's pre-backward (with
      ``backward_prefetch``, at the pre-backward of the unit before it in backward order, as
      FSDP2's implicit prefetch does) makes ``fsdp.unsharded.backward:U``; after the unit's
      last backward op ``fsdp.reshard.backward:U`` frees it and ``fsdp.reduce_scatter:U``
      reads the unit's unsharded parameter gradients (no longer static: alive from their
      backward op to here) and makes ``fsdp.reduce_scatter_input:U``, the padded flat buffer
      FSDP2 keeps until the next unit's post-backward (``reduce_scatter_max_input_buffers`` 1);
    * collectives are nodes timed by :func:`~remat.ir.sharding.collective_time_s` on the
      interconnect; they run on the compute stream in the simulator (no overlap with compute
      is modelled, so predicted times are an upper bound on exposed communication).

DDP (Li et al. 2020, "PyTorch Distributed")
    * static bytes: the whole model, plus the gradient buckets unless
      ``gradient_as_bucket_view`` (the gradients are then views into them);
    * one ``ddp.all_reduce:k`` node per bucket after the last gradient of the bucket is made
      (buckets filled in the order the backward makes the gradients, the first one
      ``first_bucket_bytes``, the others ``bucket_cap_bytes``).

Why from the unsharded trace, not by tracing a sharded model: a model under ``fully_shard``
runs DTensor parameters whose ops a trace would see as DTensor dispatch and collectives of
one process group, so the graph would depend on the group that traced it (its world size and
rank) and could not be planned for 64 ranks from one CPU; the unsharded trace plus the
description gives the step of any world size, and of a meta-device model.

Parameter windows and recomputation. The gathered parameters are values anchored on
collective nodes that the unit's ops do not read: FSDP2, not the plan, decides when they are
gathered and freed, so no solver can keep them longer or free them earlier, and every solver
sees their bytes at the right steps. A forward op recomputed in the backward needs its unit's
parameters: the simulator holds a plan to that (:func:`recompute_windows`): a forward op of
unit ``U`` may run again only between ``fsdp.all_gather.backward:U`` and
``fsdp.reshard.backward:U`` (with ``reshard_after_forward=False``, anywhere inside the unit's
one window), and rejects a plan that recomputes it elsewhere. The checkpoint class
(``remat.apply(..., mode="checkpoint")``, the executor that composes with FSDP2's module hooks)
recomputes a region at its own backward, inside that window whenever the regions are not
coarser than the units.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from remat.ir.graph import Graph, Node, Phase, Value
from remat.ir.sharding import (
    ShardingSpec,
    collective_time_s,
    dtype_bytes,
    interconnect_of,
    shard_rows,
)

ROOT = "<root>"
"""How node and value ids name the root unit."""


def shard_graph(graph: Graph, spec: ShardingSpec) -> Graph:
    """The step of one rank of ``spec``'s group (see the module docstring).

    Parameters
    ----------
    graph
        An unsharded step (``graph.sharding`` None), traced with parameter shapes and dtypes
        (the tracer's graphs have them; hand-built parameters without a shape are split by
        bytes).
    spec
        The group and its configuration.

    Returns
    -------
    Graph
        A new graph with ``sharding=spec``; the simulator's figures on it are per rank.

    Raises
    ------
    ValueError
        When the graph is sharded already, or a unit names no module of the graph (naming the
        unit).

    Examples
    --------
    >>> from remat.ir.synthetic import transformer
    >>> g = transformer(2, d_model=64, num_heads=2, seq_len=64, batch_size=2, vocab_size=128)
    >>> spec = ShardingSpec(world_size=4, units=("layers.0", "layers.1"))
    >>> shard_graph(g, spec).static_bytes < g.static_bytes
    True
    """
    if graph.sharding is not None:
        raise ValueError("graph: it is sharded already (graph.sharding is set)")
    if spec.strategy == "ddp":
        return _ddp(graph, spec)
    return _fsdp2(graph, spec)


# -- FSDP2 -------------------------------------------------------------------------------------


def _under(module: str, unit: str) -> bool:
    return unit == "" or module == unit or module.startswith(unit + ".")


class _Units:
    """Unit membership of module paths (the innermost unit holding the module)."""

    def __init__(self, units: Sequence[str]) -> None:
        self.units = tuple(units)
        self._set = frozenset(units)
        self._cache: dict[str, str] = {}

    def of(self, module: str) -> str:
        u = self._cache.get(module)
        if u is None:
            # The longest dotted prefix of the module that is a unit: one set lookup per
            # component, not one test per unit (a spec may list thousands).
            parts = module.split(".") if module else []
            u = next(
                (p for k in range(len(parts), 0, -1) if (p := ".".join(parts[:k])) in self._set),
                "",
            )
            self._cache[module] = u
        return u

    def common(self, modules: Sequence[str]) -> str:
        """The innermost unit holding every one of ``modules`` (the root when none)."""
        if not modules:
            return ""
        first = {self.of(m) for m in modules}
        if len(first) == 1:
            return first.pop()
        for u in sorted(self.units, key=len, reverse=True):
            if all(_under(m, u) for m in modules):
                return u
        return ""


def _elems(v: Value, world_size: int) -> tuple[int, int] | None:
    """(shard elements, padded unsharded elements) of a parameter, or None without a shape."""
    if v.shape is None:
        return None
    if len(v.shape) == 0:
        rows, rest = 1, 1
    else:
        rows, rest = v.shape[0], math.prod(v.shape[1:])
    per = shard_rows(rows, world_size) * rest
    return per, per * world_size


def _scaled(size: int, to_dtype: str | None, v: Value) -> int:
    """``size`` bytes of ``v`` in ``to_dtype`` (itself when None or when ``v`` has no dtype)."""
    if to_dtype is None or v.dtype is None:
        return size
    return size * dtype_bytes(to_dtype, "param_dtype") // dtype_bytes(v.dtype, f"value {v.id!r}")


def _fsdp2(graph: Graph, spec: ShardingSpec) -> Graph:
    w = spec.world_size
    link = interconnect_of(spec, graph.device.interconnect if graph.device else None)
    modules = {n.module for n in graph.nodes}
    for u in spec.units:
        if not any(_under(m, u) for m in modules if m):
            raise ValueError(f"units: {u!r} is no module of graph {graph.name!r}")
    units = _Units(spec.units)
    nodes = graph.nodes

    # Parameters: their unit, shard and gathered bytes.
    param_unit: dict[str, str] = {}
    shard_bytes = 0
    gathered: dict[str, int] = {}
    rs_bytes: dict[str, int] = {}
    param_total = 0
    reduce_dtype = spec.reduce_dtype or spec.param_dtype
    for v in graph.values:
        if v.kind != "param":
            continue
        mods = [c.module for c in graph.consumers_of(v.id) if c.phase == "forward"]
        u = units.common(mods)
        param_unit[v.id] = u
        param_total += v.size_bytes
        el = _elems(v, w)
        if el is None or v.dtype is None:
            own = -(-v.size_bytes // w)
            gathered[u] = gathered.get(u, 0) + _scaled(own * w, spec.param_dtype, v)
            rs_bytes[u] = rs_bytes.get(u, 0) + _scaled(own * w, reduce_dtype, v)
            shard_bytes += own
            continue
        item = dtype_bytes(v.dtype, f"value {v.id!r}")
        shard_bytes += el[0] * item
        pd = dtype_bytes(spec.param_dtype, "param_dtype") if spec.param_dtype else item
        rd = dtype_bytes(reduce_dtype, "reduce_dtype") if reduce_dtype else item
        gathered[u] = gathered.get(u, 0) + el[1] * pd
        rs_bytes[u] = rs_bytes.get(u, 0) + el[1] * rd

    # Parameter gradients: no longer static, each alive until its unit's reduce-scatter.
    grads_of: dict[str, list[str]] = {}
    grad_total = 0
    new_size: dict[str, int] = {}
    for r in graph.required:
        v = graph.value(r)
        if v.kind != "gradient":
            continue
        p = graph.producer_of(r)
        u = units.of(p.module) if p is not None else ""
        grads_of.setdefault(u, []).append(r)
        grad_total += v.size_bytes
        new_size[r] = _scaled(v.size_bytes, spec.param_dtype, v)
    buffer_total = sum(v.size_bytes for v in graph.values if v.kind == "buffer")
    optimizer = max(0, graph.static_bytes - param_total - buffer_total - grad_total)
    # In integers: the product of two byte counts near 2**60 is beyond a float's exactness.
    opt_shard = (optimizer * shard_bytes + param_total // 2) // param_total if param_total else 0
    root_gathered = gathered.get("", 0)
    static = 2 * shard_bytes + buffer_total + opt_shard + root_gathered

    # Spans of each unit (nested units included) in each phase.
    fwd_span: dict[str, tuple[int, int]] = {}
    bwd_span: dict[str, tuple[int, int]] = {}
    for i, n in enumerate(nodes):
        if not n.module:
            continue
        for u in spec.units:
            if _under(n.module, u):
                span = fwd_span if n.phase == "forward" else bwd_span
                a, b = span.get(u, (i, i))
                span[u] = (min(a, i), max(b, i))
    pos = {n.id: i for i, n in enumerate(nodes)}
    for u, gs in grads_of.items():
        if u and u in bwd_span:
            last = max(pos[graph.producer_of(g).id] for g in gs)  # type: ignore[union-attr]
            a, b = bwd_span[u]
            bwd_span[u] = (a, max(b, last))
    live = [u for u in spec.units if gathered.get(u, 0) and u in fwd_span]
    resharded = [u for u in live if spec.reshard_after_forward and u in bwd_span]
    post_forward = sorted(live, key=lambda u: fwd_span[u][1])
    prev = {u: post_forward[k - 1] for k, u in enumerate(post_forward) if k > 0}
    first_module_bwd = next(
        (i for i, n in enumerate(nodes) if n.phase == "backward" and n.module),
        next((i for i, n in enumerate(nodes) if n.phase == "backward"), len(nodes)),
    )

    before: dict[int, list[Node]] = {}
    after: dict[int, list[Node]] = {}
    values: list[Value] = []

    def add(at: dict[int, list[Node]], i: int, node: Node, outs: Mapping[str, int]) -> None:
        at.setdefault(i, []).append(node)
        values.extend(Value(id=o, size_bytes=b, kind="activation") for o, b in outs.items())

    def coll(
        kind: str,
        u: str,
        phase: Phase,
        inputs: tuple[str, ...],
        out: str,
        t: float,
        workspace: int = 0,
    ) -> Node:
        """A collective or reshard node (side effects on the group: never recomputed)."""
        suffix = "" if kind == "reduce_scatter" else f".{phase}"
        return Node(
            id=f"fsdp.{kind}{suffix}:{u or ROOT}",
            name=f"fsdp.{kind}",
            op=f"fsdp.{kind}",
            phase=phase,
            inputs=inputs,
            outputs=(out,),
            time_s=t,
            workspace_bytes=workspace,
            recomputable=False,
        )

    for u in live:
        g = gathered[u]
        t = collective_time_s("all_gather", g, w, link)
        out = f"fsdp.unsharded.forward:{u}"
        node = coll("all_gather", u, "forward", (), out, t, g if w > 1 else 0)
        add(before, fwd_span[u][0], node, {out: g})
        if u in resharded:
            tok = f"fsdp.resharded.forward:{u}"
            add(after, fwd_span[u][1], coll("reshard", u, "forward", (out,), tok, 0.0), {tok: 0})

    # Backward all-gathers at each unit's pre-backward, with the implicit prefetch.
    pre_bwd: list[tuple[int, int, str]] = [(first_module_bwd, 0, "")]
    pre_bwd += [(bwd_span[u][0], len(u), u) for u in live if u in bwd_span]
    issued: set[str] = set()

    def gather_bwd(i: int, u: str) -> None:
        if u in issued or u not in resharded:
            return
        issued.add(u)
        g = gathered[u]
        t = collective_time_s("all_gather", g, w, link)
        out = f"fsdp.unsharded.backward:{u}"
        token = (f"fsdp.resharded.forward:{u}",)
        node = coll("all_gather", u, "backward", token, out, t, g if w > 1 else 0)
        add(before, i, node, {out: g})

    for i, _, u in sorted(pre_bwd):
        gather_bwd(i, u)
        if spec.backward_prefetch:
            target = prev.get(u) if u else (post_forward[-1] if post_forward else None)
            if target is not None:
                gather_bwd(i, target)

    # Post-backward: reshard, then reduce-scatter; the previous unit's buffer is freed first.
    post: list[tuple[int, str]] = [(bwd_span[u][1], u) for u in live if u in bwd_span]
    pending: str | None = None
    for i, u in sorted(post):
        held = f"fsdp.unsharded.{'backward' if u in resharded else 'forward'}:{u}"
        tok = f"fsdp.resharded.backward:{u}"
        ins = (held,) if pending is None else (held, pending)
        add(after, i, coll("reshard", u, "backward", ins, tok, 0.0), {tok: 0})
        pending = tok
        if grads_of.get(u):
            buf = f"fsdp.reduce_scatter_input:{u}"
            t = collective_time_s("reduce_scatter", rs_bytes[u], w, link)
            node = coll("reduce_scatter", u, "backward", (tok, *grads_of[u]), buf, t)
            add(after, i, node, {buf: rs_bytes[u]})
            pending = buf
    # The root's post-backward runs in FSDP2's final callback, at the end of the backward.
    end: list[Node] = []
    root_ins: tuple[str, ...] = () if pending is None else (pending,)
    done_in = root_ins
    if grads_of.get(""):
        buf = f"fsdp.reduce_scatter_input:{ROOT}"
        t = collective_time_s("reduce_scatter", rs_bytes.get("", 0), w, link)
        end.append(coll("reduce_scatter", "", "backward", (*root_ins, *grads_of[""]), buf, t))
        values.append(Value(id=buf, size_bytes=rs_bytes.get("", 0), kind="activation"))
        done_in = (buf,)
    end.append(coll("done", "", "backward", done_in, "fsdp.done", 0.0))
    values.append(Value(id="fsdp.done", size_bytes=0, kind="activation"))

    out_nodes: list[Node] = []
    for i, n in enumerate(nodes):
        out_nodes.extend(before.get(i, ()))
        out_nodes.append(n)
        out_nodes.extend(after.get(i, ()))
    out_nodes.extend(before.get(len(nodes), ()))
    out_nodes.extend(end)
    sharded_grads = {g for gs in grads_of.values() for g in gs}
    out_values = [
        v.model_copy(update={"size_bytes": new_size[v.id]}) if v.id in new_size else v
        for v in graph.values
    ]
    new_required = (*(r for r in graph.required if r not in sharded_grads), "fsdp.done")
    return Graph(
        name=graph.name,
        nodes=tuple(out_nodes),
        values=(*out_values, *values),
        required=new_required,
        static_bytes=static,
        device=graph.device,
        sharding=spec,
    )


def recompute_windows(graph: Graph) -> dict[str, tuple[str, str]]:
    """For an FSDP2 graph: forward node id -> (the node after which, the node before which) it
    may be recomputed: its unit's backward all-gather and backward reshard (see the module
    docstring). Nodes of the root unit, whose parameters are gathered all step, are absent;
    so is every node of a graph that is not FSDP2-sharded."""
    spec = graph.sharding
    if spec is None or spec.strategy != "fsdp2":
        return {}
    units = _Units(spec.units)
    out: dict[str, tuple[str, str]] = {}
    for n in graph.nodes:
        if n.phase != "forward" or not n.module or not n.recomputable:
            continue
        u = units.of(n.module)
        if not u:
            continue
        close = f"fsdp.reshard.backward:{u}"
        if not graph.has_node(close):
            continue
        opened = f"fsdp.all_gather.backward:{u}"
        out[n.id] = (opened if graph.has_node(opened) else f"fsdp.all_gather.forward:{u}", close)
    return out


# -- DDP ---------------------------------------------------------------------------------------


def _ddp(graph: Graph, spec: ShardingSpec) -> Graph:
    w = spec.world_size
    link = interconnect_of(spec, graph.device.interconnect if graph.device else None)
    grads = [r for r in graph.required if graph.value(r).kind == "gradient"]
    pos = {n.id: i for i, n in enumerate(graph.nodes)}

    def made_at(g: str) -> int:
        p = graph.producer_of(g)
        return pos[p.id] if p is not None else len(graph.nodes)

    buckets: list[list[str]] = []
    filled = 0
    for g in sorted(grads, key=made_at):
        cap = spec.first_bucket_bytes if len(buckets) <= 1 else spec.bucket_cap_bytes
        if not buckets or filled >= cap:
            buckets.append([])
            filled = 0
        buckets[-1].append(g)
        filled += graph.value(g).size_bytes
    after: dict[int, list[Node]] = {}
    values: list[Value] = []
    tokens: list[str] = []
    for k, b in enumerate(buckets):
        nbytes = sum(graph.value(g).size_bytes for g in b)
        tok = f"ddp.reduced:{k}"
        node = Node(
            id=f"ddp.all_reduce:{k}",
            name="ddp.all_reduce",
            op="ddp.all_reduce",
            phase="backward",
            inputs=tuple(b),
            outputs=(tok,),
            time_s=collective_time_s("all_reduce", nbytes, w, link),
            recomputable=False,
        )
        after.setdefault(max(made_at(g) for g in b), []).append(node)
        values.append(Value(id=tok, size_bytes=0, kind="activation"))
        tokens.append(tok)
    done = Node(
        id="ddp.done",
        name="ddp.done",
        op="ddp.done",
        phase="backward",
        inputs=tuple(tokens),
        outputs=("ddp.done",),
        recomputable=False,
    )
    values.append(Value(id="ddp.done", size_bytes=0, kind="activation"))
    out_nodes: list[Node] = []
    for i, n in enumerate(graph.nodes):
        out_nodes.append(n)
        out_nodes.extend(after.get(i, ()))
    out_nodes.extend(after.get(len(graph.nodes), ()))
    out_nodes.append(done)
    grad_bytes = sum(graph.value(g).size_bytes for g in grads)
    bucket_bytes = 0 if spec.gradient_as_bucket_view else grad_bytes
    return Graph(
        name=graph.name,
        nodes=tuple(out_nodes),
        values=(*graph.values, *values),
        required=(*graph.required, "ddp.done"),
        static_bytes=graph.static_bytes + bucket_bytes,
        device=graph.device,
        sharding=spec,
    )


__all__ = ["ROOT", "recompute_windows", "shard_graph"]
