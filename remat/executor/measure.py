"""Peak memory of a real training step, split into its static and dynamic parts.

Definitions (those of the IR's memory rules, see ``remat.ir.graph``):

* **static** bytes: the model's parameters and buffers, the parameters' gradients (the ``.grad``
  tensors that hold after the step) and the optimizer state present when the step starts;
* **dynamic** bytes: everything else the step holds: the example inputs (the caller holds them
  all step long) and every tensor storage the step allocates that does not end up as a
  parameter's ``.grad``.

The step runs with every ``.grad`` reset to None (as ``optimizer.zero_grad()`` leaves it), so
each parameter gradient is allocated by the backward op that makes it and kept as ``.grad``
(autograd "steals" it); counting it as static from the start, as the IR does, is what the
simulator's figures mean. ``peak_bytes`` is ``static_bytes + peak_dynamic_bytes`` and is thus
comparable to :class:`remat.ir.Simulation`'s ``peak_bytes``; ``observed_peak_bytes`` is the
largest total actually seen (lower, as gradients appear during the backward pass).

On the CPU a :class:`LiveStorageTracker` (a ``TorchDispatchMode``) sees every ATen op of the
step, adds each new output storage's ``nbytes`` when it is created and subtracts it when the
storage is freed (``weakref.finalize``). Outputs whose schema marks them as aliases (views) are
not new memory. Scratch memory that a kernel allocates and frees inside one op is not seen (the
IR calls it workspace). On a CUDA device the allocator's statistics are used instead.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from remat.tracer.eager_frees import return_alias

LossFn = Callable[[Any], torch.Tensor]
StepFn = Callable[[], Any]


@dataclass(frozen=True)
class MemoryMeasurement:
    """Memory of one measured step. Bytes are exact on the CPU."""

    peak_bytes: int
    """static + peak dynamic bytes (the simulator's definition)."""
    static_bytes: int
    peak_dynamic_bytes: int
    observed_peak_bytes: int
    """Largest total of live bytes actually seen during the step."""
    input_bytes: int
    final_dynamic_bytes: int
    param_bytes: int
    buffer_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    device: str
    timeline_dynamic_bytes: list[int] = field(default_factory=list, repr=False)
    """Dynamic bytes after each allocation or release (CPU only)."""


def _storage_key(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr()) or id(t.untyped_storage())


class LiveStorageTracker(TorchDispatchMode):
    """Counts the bytes of live tensor storages created while it is active.

    ``track(tensors, tag)`` registers storages that exist already (inputs, parameters). Each
    storage gets a tag; ``events`` records ``(key, +nbytes | -nbytes)`` in order, so the live bytes
    of any subset of storages can be replayed afterwards (see :meth:`peak`).
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}  # key -> nbytes
        self.events: list[tuple[int, int]] = []
        self._next = 0
        self._key_of: dict[int, int] = {}  # id(storage object) -> key, while alive

    def _add(self, storage: torch.UntypedStorage, nbytes: int | None = None) -> int | None:
        """Track ``storage`` (at ``nbytes``, default its size now); None if already tracked."""
        sid = id(storage)
        if sid in self._key_of:
            return None
        key = self._next
        self._next += 1
        if nbytes is None:
            nbytes = int(storage.nbytes())
        self._key_of[sid] = key
        self.live[key] = nbytes
        self.events.append((key, nbytes))
        weakref.finalize(storage, self._release, sid, key)
        return key

    def _release(self, sid: int, key: int) -> None:
        self._key_of.pop(sid, None)
        nbytes = self.live.pop(key, None)
        if nbytes is not None:
            self.events.append((key, -nbytes))

    def key_of(self, t: torch.Tensor) -> int | None:
        return self._key_of.get(id(t.untyped_storage()))

    def track(self, tensors: Iterable[torch.Tensor]) -> set[int]:
        """Register existing tensors' storages; returns their keys."""
        keys: set[int] = set()
        for t in tensors:
            k = self._add(t.untyped_storage())
            keys.add(k if k is not None else self._key_of[id(t.untyped_storage())])
        return keys

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        flat = out if isinstance(out, (tuple, list)) else (out,)
        for i, t in enumerate(flat):
            if not isinstance(t, torch.Tensor):
                continue
            if return_alias(returns, out, i) is not None:
                continue  # a view or an in-place result: no new memory
            if t.device.type == "meta":
                continue
            self._add(t.untyped_storage())
        return out

    def peak(self, exclude: set[int], start: int = 0) -> tuple[int, int, list[int]]:
        """Replay the events from ``start``: (peak, final, timeline) of storages not excluded."""
        cur = 0
        for key, delta in self.events[:start]:
            if key not in exclude:
                cur += delta
        peak = cur
        timeline = []
        for key, delta in self.events[start:]:
            if key in exclude:
                continue
            cur += delta
            timeline.append(cur)
            peak = max(peak, cur)
        return peak, cur, timeline


def _default_step(model: nn.Module, example_inputs: Any, loss_fn: LossFn | None) -> StepFn:
    if isinstance(example_inputs, dict):
        args: tuple[Any, ...] = ()
        kwargs: dict[str, Any] = dict(example_inputs)
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
    else:
        args, kwargs = (example_inputs,), {}

    def step() -> None:
        # The model's output is not held past the loss: the IR frees it after its last use.
        out = model(*args, **kwargs)
        loss = loss_fn(out) if loss_fn is not None else out
        del out
        loss.backward()
        del loss

    return step


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(obj) if isinstance(x, torch.Tensor)]


def _unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        seen.setdefault(_storage_key(t), int(t.untyped_storage().nbytes()))
    return sum(seen.values())


def measure(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: LossFn | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    step: StepFn | None = None,
    tracker: LiveStorageTracker | None = None,
) -> MemoryMeasurement:
    """Run one training step for real and measure its peak memory (see the module docstring).

    Parameters
    ----------
    model, example_inputs, loss_fn
        As for :func:`remat.tracer.trace`. The step is ``loss_fn(model(*inputs)).backward()``.
    optimizer
        Its state (as present now) counts as static memory; ``step()`` is not called.
    step
        A callable running the step instead of the default one (e.g. a compiled remat step);
        it must leave the gradients in the parameters' ``.grad``.
    tracker
        The CPU tracker to count with (a subclass that also sees compiled code, as
        :func:`remat.executor.compile.measure_compiled` uses); a new one by default.

    Returns
    -------
    MemoryMeasurement
        ``.grad`` holds the step's gradients afterwards.
    """
    params = list(dict.fromkeys(model.parameters()))
    buffers = list(model.buffers())
    inputs = _tensors(example_inputs)
    for p in params:
        p.grad = None
    opt_tensors = _tensors(list(optimizer.state.values())) if optimizer is not None else []
    run = step if step is not None else _default_step(model, example_inputs, loss_fn)
    device = params[0].device if params else (inputs[0].device if inputs else torch.device("cpu"))
    if device.type == "cuda":
        return _measure_cuda(run, params, buffers, inputs, opt_tensors, device)

    tracker = LiveStorageTracker() if tracker is None else tracker
    param_keys = tracker.track(params)
    buffer_keys = tracker.track(buffers)
    opt_keys = tracker.track(opt_tensors)
    tracker.track(inputs)
    start = len(tracker.events)
    with tracker:
        run()
    grad_keys = {
        k for p in params if p.grad is not None and (k := tracker.key_of(p.grad)) is not None
    }
    static_keys = param_keys | buffer_keys | opt_keys | grad_keys
    param_bytes = _unique_bytes(params)
    buffer_bytes = _unique_bytes(buffers)
    grad_bytes = _unique_bytes([p.grad for p in params if p.grad is not None])
    opt_bytes = _unique_bytes(opt_tensors)
    static = param_bytes + buffer_bytes + grad_bytes + opt_bytes
    input_bytes = _unique_bytes(inputs)
    peak_dyn, final_dyn, timeline = tracker.peak(static_keys, start)
    total_peak, _, _ = tracker.peak(set(), start)
    return MemoryMeasurement(
        peak_bytes=static + peak_dyn,
        static_bytes=static,
        peak_dynamic_bytes=peak_dyn,
        observed_peak_bytes=total_peak,
        input_bytes=input_bytes,
        final_dynamic_bytes=final_dyn,
        param_bytes=param_bytes,
        buffer_bytes=buffer_bytes,
        grad_bytes=grad_bytes,
        optimizer_state_bytes=opt_bytes,
        device=str(device),
        timeline_dynamic_bytes=timeline,
    )


def _measure_cuda(
    run: StepFn,
    params: list[torch.Tensor],
    buffers: list[torch.Tensor],
    inputs: list[torch.Tensor],
    opt_tensors: list[torch.Tensor],
    device: torch.device,
) -> MemoryMeasurement:
    """Allocator statistics. The dynamic peak is the step's peak allocation minus what was
    allocated before the step (inputs excepted) minus the gradients left in ``.grad``. The
    allocator does not say when each gradient was allocated, so gradients that did not exist yet
    at the peak make this an underestimate by at most their bytes; allocator rounding (512-byte
    blocks) makes small tensors count a little more than their ``nbytes``.
    """
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    peak_total = torch.cuda.max_memory_allocated(device)
    after = torch.cuda.memory_allocated(device)
    param_bytes = _unique_bytes(params)
    buffer_bytes = _unique_bytes(buffers)
    grad_bytes = _unique_bytes([p.grad for p in params if p.grad is not None])
    opt_bytes = _unique_bytes(opt_tensors)
    input_bytes = _unique_bytes(inputs)
    static = param_bytes + buffer_bytes + grad_bytes + opt_bytes
    held_before = before - input_bytes  # static state other than grads, plus anything else held
    peak_dyn = max(0, peak_total - held_before - grad_bytes)
    return MemoryMeasurement(
        peak_bytes=static + peak_dyn,
        static_bytes=static,
        peak_dynamic_bytes=peak_dyn,
        observed_peak_bytes=peak_total,
        input_bytes=input_bytes,
        final_dynamic_bytes=max(0, after - held_before - grad_bytes),
        param_bytes=param_bytes,
        buffer_bytes=buffer_bytes,
        grad_bytes=grad_bytes,
        optimizer_state_bytes=opt_bytes,
        device=str(device),
    )


def measure_fake(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: LossFn | None = None,
) -> MemoryMeasurement:
    """The plain eager step's memory, measured on fake tensors (no memory the size of the
    model is allocated; a model on the meta device works too).

    The unmodified step (``loss_fn(model(*inputs)).backward()``) runs under a
    ``FakeTensorMode`` with the same tracker and definitions as :func:`measure`: autograd,
    its saved tensors, ``AccumulateGrad``'s layout copies and the lifetimes of the model's
    Python locals are PyTorch's own; fake kernels report the layouts the CPU kernels choose
    (channels-last convolution gradients included). Equal to :func:`measure` on the CPU to the
    byte on the example models (tested). The model is not modified: its parameters and
    buffers are replaced by fake copies through ``torch.func.functional_call``.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu":  # meta (or an accelerator): a CPU fake of the same layout
            with mode:
                return torch.empty_strided(
                    tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu"
                )
        return mode.from_tensor(t.detach())

    named_params = dict(model.named_parameters())
    params = {n: fake(p).requires_grad_(p.requires_grad) for n, p in named_params.items()}
    buffers = {n: fake(b) for n, b in model.named_buffers()}
    flat, spec = pytree.tree_flatten(example_inputs)
    fake_flat = [fake(x) if isinstance(x, torch.Tensor) else x for x in flat]
    fake_inputs = pytree.tree_unflatten(fake_flat, spec)
    if isinstance(fake_inputs, dict):
        args: tuple[Any, ...] = ()
        kwargs: dict[str, Any] = dict(fake_inputs)
    elif isinstance(fake_inputs, (tuple, list)):
        args, kwargs = tuple(fake_inputs), {}
    else:
        args, kwargs = (fake_inputs,), {}

    tracker = LiveStorageTracker()
    param_keys = tracker.track(params.values())
    buffer_keys = tracker.track(buffers.values())
    inputs = _tensors(fake_inputs)
    tracker.track(inputs)
    start = len(tracker.events)
    from remat.tracer.patches import answering_as_eager

    # The model's branches on data-independent tensors (transformers' packed-sequence check)
    # take eager's side, as in the capture.
    with mode, tracker, answering_as_eager(kwargs, example_inputs):
        out = torch.func.functional_call(model, {**params, **buffers}, args, kwargs)
        loss = loss_fn(out) if loss_fn is not None else out
        del out
        loss.backward()
        del loss
    grads = [p.grad for p in params.values() if p.grad is not None]
    grad_keys = {k for g in grads if (k := tracker.key_of(g)) is not None}
    static_keys = param_keys | buffer_keys | grad_keys
    param_bytes = distinct_storage_bytes(params.values())
    buffer_bytes = distinct_storage_bytes(buffers.values())
    grad_bytes = distinct_storage_bytes(grads)
    static = param_bytes + buffer_bytes + grad_bytes
    peak_dyn, final_dyn, timeline = tracker.peak(static_keys, start)
    total_peak, _, _ = tracker.peak(set(), start)
    return MemoryMeasurement(
        peak_bytes=static + peak_dyn,
        static_bytes=static,
        peak_dynamic_bytes=peak_dyn,
        observed_peak_bytes=total_peak,
        input_bytes=distinct_storage_bytes(inputs),
        final_dynamic_bytes=final_dyn,
        param_bytes=param_bytes,
        buffer_bytes=buffer_bytes,
        grad_bytes=grad_bytes,
        optimizer_state_bytes=0,
        device="cpu (fake)",
        timeline_dynamic_bytes=timeline,
    )


def distinct_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of distinct storages, told apart by identity (fake storages have no address, and
    a DTensor's local shards are each their own storage object)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen.setdefault(id(st), int(st.nbytes()))
    return sum(seen.values())
