"""Offloaded blocks of the checkpoint class: a block's saved tensors in host memory.

A block that :mod:`remat.ir.checkpoint_class` offloads runs its own ``forward`` (no checkpoint)
under ``torch.autograd.graph.saved_tensors_hooks``:

* While it runs, a dispatch mode matches its ATen ops to the graph's nodes (in order, by name,
  as the checkpoint policy does) and notes which storage each node's outputs were made in.
* ``pack``: a tensor an autograd node saves whose storage holds one of the block's offloadable
  values (:func:`remat.ir.checkpoint_class.offloadable`) is copied to host memory, the whole
  storage once however many nodes save it or views of it
  (:class:`~remat.executor.hostmem.HostMemory`: pinned, on the device-to-host stream on a GPU;
  kept out of the device tracker on the CPU); the saved variable holds only a handle, so the
  device storage dies when the forward drops its last reference, as the plan's ``offload``
  says. Every other saved tensor (parameters, values other blocks read) is kept as it is.
* A hook on the gradient of the block's output (the block's backward is next) copies every
  storage the call moved back to the device, in the order the backward reads them, on the
  host-to-device stream: the plan's prefetches. ``unpack`` rebuilds each saved view on its
  storage's device copy (waiting for its copy first); the device copy dies with the last saved
  variable that reads it, after its autograd node has run, as the plan's frees say. A storage
  whose prefetch did not happen (an output without a gradient) is copied back at its first
  ``unpack``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from remat.executor.hostmem import HostMemory, wait
from remat.executor.op_match import OpMatcher
from remat.ir import Graph, checkpoint_class


@dataclass(frozen=True)
class OffloadBlock:
    """One offloaded block: its path, its forward nodes, the values it moves to the host."""

    path: str
    nodes: tuple[str, ...]
    """Forward node ids of the block, in graph order."""
    values: frozenset[str]
    """Value ids whose storages go to host memory when saved (``offloadable``)."""
    order: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    """Value id -> its place in the prefetch order (``prefetch_order``)."""


class _Moved:
    """One storage in host memory: its host copy, and its device copy once prefetched."""

    __slots__ = ("__weakref__", "device", "event", "home", "host", "rank")

    def __init__(self, host: torch.Tensor, home: torch.device, rank: int) -> None:
        self.host = host
        self.home = home
        """The device the storage was made on (and is brought back to)."""
        self.rank = rank
        self.device: torch.Tensor | None = None
        self.event: Any = None


@dataclass(frozen=True)
class _Handle:
    """What a saved variable holds in place of its tensor: a view of a moved storage."""

    moved: _Moved
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _flat(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A byte tensor over all of ``storage`` (no copy, nothing allocated)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Notes, per storage a matched op makes, the graph value it holds (by data pointer, with a
    weak reference to tell a reused address from the same storage)."""

    def __init__(self, graph: Graph, block: OffloadBlock) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.graph = graph
        self.matcher = OpMatcher(graph, block.nodes)
        self.values = block.values
        self.made: dict[int, tuple[weakref.ref[torch.UntypedStorage], str]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        nid = self.matcher.match(func)
        if nid is not None:
            ids = [o for o in self.graph.node(nid).outputs if o in self.values]
            for t in pytree.tree_leaves(out):
                if not ids:
                    break
                if not isinstance(t, torch.Tensor):
                    continue
                st = t.untyped_storage()
                nbytes = st.nbytes()
                for k, vid in enumerate(ids):
                    if self.graph.value(vid).size_bytes == nbytes:
                        self.made[st.data_ptr()] = (weakref.ref(st), vid)
                        del ids[k]
                        break
        return out

    def value_of(self, t: torch.Tensor) -> str | None:
        st = t.untyped_storage()
        entry = self.made.get(st.data_ptr())
        if entry is None or entry[0]() is not st:
            return None
        return entry[1]


class _Call:
    """One forward call of an offloaded block: its hooks and what it moved."""

    def __init__(self, graph: Graph, block: OffloadBlock, hosts: dict[torch.device, HostMemory]):
        self.block = block
        self.hosts = hosts
        self.recorder = _Recorder(graph, block)
        self.by_value: dict[str, _Moved] = {}  # while the forward runs: one copy per storage
        self.moved: list[weakref.ref[_Moved]] = []

    def _host(self, device: torch.device) -> HostMemory:
        host = self.hosts.get(device)
        if host is None:
            host = self.hosts[device] = HostMemory(device)
        return host

    def pack(self, t: torch.Tensor) -> Any:
        vid = self.recorder.value_of(t)
        if vid is None:
            return t
        moved = self.by_value.get(vid)
        if moved is None:
            with _disable_current_modes():
                flat = _flat(t.untyped_storage(), t.device)
            moved = _Moved(
                self._host(t.device).offload(flat), t.device, self.block.order.get(vid, 0)
            )
            self.by_value[vid] = moved
            self.moved.append(weakref.ref(moved))
        shape, stride = tuple(int(n) for n in t.shape), tuple(int(n) for n in t.stride())
        return _Handle(moved, t.dtype, int(t.storage_offset()), shape, stride)

    def fetch(self, moved: _Moved) -> None:
        moved.device, moved.event = self._host(moved.home).prefetch(moved.host)

    def unpack(self, h: Any) -> torch.Tensor:
        if not isinstance(h, _Handle):
            return h  # type: ignore[no-any-return]
        moved = h.moved
        if moved.device is None:
            self.fetch(moved)
        wait(moved.event)
        assert moved.device is not None
        with _disable_current_modes():
            return torch.empty(0, dtype=h.dtype, device=moved.device.device).set_(
                moved.device.untyped_storage(), h.offset, h.size, h.stride
            )

    def prefetch_all(self, *_: Any) -> None:
        """The block's backward is next: every storage it moved back, in reading order."""
        alive = [m for m in (r() for r in self.moved) if m is not None and m.device is None]
        for moved in sorted(alive, key=lambda m: m.rank):
            self.fetch(moved)
        self.moved = []

    def arm(self, out: Any) -> None:
        """Prefetch when the first gradient of the block's outputs arrives."""
        self.by_value = {}
        tensors = [
            t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        if tensors and self.moved:
            torch.autograd.graph.register_multi_grad_hook(tensors, self.prefetch_all, mode="any")


def offloading(
    forward: Callable[..., Any],
    graph: Graph,
    block: OffloadBlock,
    hosts: dict[torch.device, HostMemory],
) -> Callable[..., Any]:
    """``forward`` with its saved tensors moved to host memory (see the module docstring)."""

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        call = _Call(graph, block, hosts)
        with call.recorder, torch.autograd.graph.saved_tensors_hooks(call.pack, call.unpack):
            out = forward(*args, **kwargs)
        call.arm(out)
        return out

    return run


def offload_block(graph: Graph, path: str) -> OffloadBlock:
    """The :class:`OffloadBlock` of block ``path`` of ``graph``."""
    order = checkpoint_class.prefetch_order(graph, path)
    return OffloadBlock(
        path,
        checkpoint_class.blocks(graph)[path],
        frozenset(order),
        {v: k for k, v in enumerate(order)},
    )


__all__ = ["OffloadBlock", "offload_block", "offloading"]
