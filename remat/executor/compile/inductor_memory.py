"""The bytes inductor's generated code allocates for one compiled step, replayed without running.

Inductor fuses pointwise ops into kernels, so most intermediates of the FX graphs never exist,
and its wrapper reuses freed buffers of the same size for later ones. The simulator's peak on the
FX graphs (:class:`~remat.executor.compile.partition.PartitionModel`) is therefore an upper
bound of what a compiled step allocates. After inductor has compiled the forward and the
backward graph, :func:`compiled_memory` replays the memory lines of each graph's generated
wrapper (allocations, ``del``, reuses, reinterpreted views, extern kernels' outputs) in the
order the code runs them, counting each storage once however many names refer to it, and joins
the two graphs with remat's accounting of the step:

* static bytes (parameters, buffers, the parameters' gradients: what the backward graph returns)
  are counted in full, as by the storage tracker;
* while the forward runs, the step's non-static inputs are held by the caller;
* the forward's outputs (the user's and the saved activations) are held from the forward into
  the backward; the user's outputs (the loss) until the backward returns, each saved activation
  until the backward's code frees it (the backward graph's inputs are freed after their last
  use, or reused in place when inductor donated them).

Scratch memory a kernel allocates and frees inside itself is not counted (nor by the tracker).
The replay reads inductor's scheduler output, which :func:`capture_graphs` collects through the
``_post_fusion_custom_pass`` config hook (the graph being lowered, ``V.graph``, whose wrapper
lines stay on it after code generation).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from remat.executor.compile.joint import JointIR

__all__ = ["CompiledMemory", "capture_graphs", "compiled_memory"]


@dataclass(frozen=True)
class CompiledMemory:
    """Peak bytes of one joint graph's compiled forward and backward (module docstring)."""

    peak_bytes: int
    """Static bytes plus the larger of the forward's and the backward's dynamic peaks."""
    static_bytes: int
    forward_peak_dynamic_bytes: int
    backward_peak_dynamic_bytes: int
    saved_bytes: int
    """Bytes the forward hands to the backward (saved activations, random-generator states)."""
    held_bytes: int
    """Non-static inputs the caller holds, and the forward's outputs to the user."""
    num_allocations: int
    """Storages the two graphs' code allocates (after fusion and reuse)."""


class _Capture:
    """``_post_fusion_custom_pass``: note each graph inductor lowers, change nothing."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous
        self.graphs: list[Any] = []

    def __call__(self, nodes: list[Any]) -> list[Any]:
        from torch._inductor.virtualized import V

        self.graphs.append(V.graph)
        return self.previous(nodes) if self.previous is not None else nodes

    def __deepcopy__(self, memo: dict[int, Any]) -> _Capture:
        # Inductor copies its config for debug strings; the graphs it holds do not copy.
        return self


@contextlib.contextmanager
def capture_graphs() -> Iterator[list[Any]]:
    """Collect the graphs (``GraphLowering``) inductor compiles inside the block, in order."""
    from torch._inductor import config as inductor_config

    capture = _Capture(inductor_config._post_fusion_custom_pass)
    with inductor_config.patch(_post_fusion_custom_pass=capture):
        yield capture.graphs


@dataclass
class _Replay:
    """Storages of one graph's run: allocation and free events in code order."""

    sizes: dict[int, int] = field(default_factory=dict)
    events: list[tuple[bool, int]] = field(default_factory=list)
    """(allocated?, storage) in the order the code runs."""
    names: dict[str, int] = field(default_factory=dict)
    refs: dict[int, set[str]] = field(default_factory=dict)
    next_key: int = 0

    def new(self, name: str, size_bytes: int) -> None:
        key = self.next_key
        self.next_key += 1
        self.sizes[key] = size_bytes
        self.events.append((True, key))
        self.bind(name, key)

    def bind(self, name: str, key: int) -> None:
        self.drop(name)
        self.names[name] = key
        self.refs.setdefault(key, set()).add(name)

    def drop(self, name: str) -> None:
        key = self.names.pop(name, None)
        if key is None:
            return
        refs = self.refs[key]
        refs.discard(name)
        if not refs:
            self.events.append((False, key))

    def peak(self, counted: set[int], start_bytes: int) -> int:
        """The largest sum of counted live storages, from those live before the first line."""
        cur = peak = start_bytes
        for alloc, key in self.events:
            if key not in counted:
                continue
            if alloc:
                cur += self.sizes[key]
                peak = max(peak, cur)
            else:
                cur -= self.sizes[key]
        return peak


_EXTERNAL = -1


def _storage_bytes(node: Any) -> int:
    from torch._inductor.utils import get_dtype_size
    from torch._inductor.virtualized import V

    try:
        layout = node.get_layout()
    except (AttributeError, NotImplementedError):
        return 0
    from torch._inductor import ir

    if isinstance(layout, (ir.MultiOutputLayout, ir.NoneLayout)):
        return 0
    size = V.graph.sizevars.optimization_hint(V.graph.get_allocation_storage_size(node), fallback=0)
    return int(size) * get_dtype_size(node.get_dtype())


def _replay(g: Any, inputs: Mapping[str, tuple[int, int]]) -> _Replay:
    """Replay ``g``'s wrapper lines. ``inputs``: graph input name -> (storage key, bytes) for
    the inputs whose storage this step counts; other inputs are never counted."""
    from torch._inductor.codegen import wrapper as w
    from torch._inductor.virtualized import V

    r = _Replay()
    r.next_key = max((k for k, _ in inputs.values()), default=-1) + 1
    for name, (key, size) in inputs.items():
        r.sizes[key] = size
        r.bind(name, key)
    # The other inputs share one storage key, -1, that a sentinel name keeps alive: freeing
    # their names frees nothing the step counts.
    r.sizes[_EXTERNAL] = 0
    r.refs[_EXTERNAL] = {"<held by the caller>"}
    for name in g.graph_inputs:
        if name not in r.names:
            r.names[name] = _EXTERNAL
            r.refs[_EXTERNAL].add(name)
    with V.set_graph_handler(g):
        for line in g.wrapper_code.lines:
            if isinstance(line, (w.AllocateLine, w.ExternKernelAllocLine)):
                r.new(line.node.get_name(), _storage_bytes(line.node))
            elif isinstance(line, w.MultiOutputLine):
                buf = g.get_buffer(line.result_name)
                r.new(line.result_name, _storage_bytes(buf) if buf is not None else 0)
            elif isinstance(line, w.ReuseLine):
                old, new = line.node.get_name(), line.reused_as.get_name()
                if old in r.names:
                    r.bind(new, r.names[old])
                else:
                    r.new(new, _storage_bytes(line.reused_as))
                if line.delete_old:
                    r.drop(old)
            elif isinstance(line, w.ReinterpretLine):
                base = line.node.get_name()
                if base in r.names:
                    r.bind(line.reused_as.get_name(), r.names[base])
            elif isinstance(line, w.FreeIfNotReusedLine):
                if not line.is_reused:
                    r.drop(line.node.get_name())
            elif isinstance(line, w.FreeLine):
                r.drop(line.node.get_name())
    return r


def _output_keys(g: Any, r: _Replay) -> list[int | None]:
    """The storage of each graph output (None: a constant, a size or no tensor)."""
    return [r.names.get(name) for name in g.get_output_names()]


def compiled_memory(
    jir: JointIR, graphs: Sequence[Any], *, num_fwd_outputs: int
) -> CompiledMemory | None:
    """The compiled step's figures from the forward and backward graphs inductor lowered for
    ``jir`` (as :func:`capture_graphs` collected them); None when they are not both there."""
    fw = next((g for g in graphs if not g.is_backward), None)
    bw = next((g for g in reversed(graphs) if g.is_backward), None)
    if fw is None or bw is None:
        return None
    graph = jir.graph
    size = {v.id: v.size_bytes for v in graph.values}
    kind = {v.id: v.kind for v in graph.values}
    tangents = {t.name for t in jir.tangents}

    # The forward: its inputs are the caller's (parameters: static; the rest: held).
    held_inputs = {
        jir.fx_value[name]
        for name in fw.graph_inputs
        if name in jir.fx_value and not graph.is_static(jir.fx_value[name])
    }
    held = sum(size[v] for v in held_inputs)
    f = _replay(fw, {})
    fw_out = _output_keys(fw, f)
    owned = {k for k in f.sizes if k >= 0}
    fw_peak = f.peak(owned, 0)
    user = {k for k in fw_out[:num_fwd_outputs] if k is not None and k >= 0}
    saved_keys = {k for k in fw_out[num_fwd_outputs:] if k is not None and k >= 0}
    user_bytes = sum(f.sizes[k] for k in user - saved_keys)

    # The backward: the forward's saved storages are its inputs (one storage per forward
    # output storage, however many views of it were saved), freed by its code.
    fw_names = [n.name for n in _fx_outputs(fw)]
    by_name: dict[str, int] = {}
    for name, key in zip(fw_names[num_fwd_outputs:], fw_out[num_fwd_outputs:], strict=False):
        if key is not None and key >= 0 and key not in user:
            by_name[name] = key
    inputs: dict[str, tuple[int, int]] = {}
    fresh: dict[str, int] = {}
    next_key = max(f.sizes) + 1
    for name, node in bw.graph_inputs.items():
        if name in by_name:
            inputs[name] = (by_name[name], f.sizes[by_name[name]])
            continue
        value = jir.fx_value.get(name)
        if value is not None and name not in tangents and kind.get(value) != "activation":
            continue  # a parameter or an input: the caller's
        # A tangent (made by autograd for this call), a generator state, or an activation
        # the forward's outputs did not name: one storage per IR value.
        group = value if value is not None else name
        if group not in fresh:
            fresh[group] = next_key
            next_key += 1
        nbytes = size[value] if value is not None else _input_bytes(bw, node)
        inputs[name] = (fresh[group], nbytes)
    b = _replay(bw, inputs)
    grads = {k for k in _output_keys(bw, b) if k is not None}
    counted = {k for k in b.sizes if k >= 0} - grads
    start = sum(b.sizes[k] for k in {k for k, _ in inputs.values()} if k in counted)
    bw_peak = b.peak(counted, start)
    saved_bytes = sum(f.sizes[k] for k in set(by_name.values()))
    static = graph.static_bytes
    fw_dyn = held + fw_peak
    bw_dyn = held + user_bytes + bw_peak
    return CompiledMemory(
        peak_bytes=static + max(fw_dyn, bw_dyn),
        static_bytes=static,
        forward_peak_dynamic_bytes=fw_dyn,
        backward_peak_dynamic_bytes=bw_dyn,
        saved_bytes=saved_bytes,
        held_bytes=held + user_bytes,
        num_allocations=sum(1 for a, _ in f.events if a) + sum(1 for a, _ in b.events if a),
    )


def _fx_outputs(g: Any) -> list[torch.fx.Node]:
    out = next(n for n in reversed(g.orig_gm.graph.nodes) if n.op == "output")
    args = out.args[0]
    return [a if isinstance(a, torch.fx.Node) else _NoNode for a in args]


class _NoNodeType:
    name = ""


_NoNode: Any = _NoNodeType()


def _input_bytes(g: Any, node: Any) -> int:
    from torch._inductor.virtualized import V

    with V.set_graph_handler(g):
        return _storage_bytes(node)
