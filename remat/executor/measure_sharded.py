"""Peak memory of one rank's training step under FSDP2 or DDP, with remat's own tracker.

The split is :mod:`remat.executor.measure`'s (static: parameters, buffers, the parameters'
``.grad`` after the step and the optimizer state present before it; dynamic: everything else),
read on the *local* tensors of a rank: a DTensor parameter's shard (``to_local()``, whose storage
FSDP2 pads), its sharded gradient, the optimizer state of the shards.

FSDP2 frees and re-allocates its gathered parameters by resizing their storages in place
(``UntypedStorage.resize_``, outside the ATen dispatcher), which a dispatch mode never sees;
:class:`ResizeAwareTracker` also wraps ``resize_`` while it is active and counts each resize as
the storage's change in bytes. The step's collectives run through the dispatcher (their outputs
are preallocated, in place); memory gloo allocates inside its own C++ code is not seen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from remat.executor.measure import (
    LiveStorageTracker,
    MemoryMeasurement,
    distinct_storage_bytes,
)


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own tensor of ``t``: a DTensor's local shard, any other tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class ResizeAwareTracker(LiveStorageTracker):
    """A :class:`LiveStorageTracker` that also counts in-place storage resizes."""

    def __init__(self) -> None:
        super().__init__()
        self._orig_resize: Any = None

    def _resized(self, storage: torch.UntypedStorage, before: int) -> None:
        key = self._key_of.get(id(storage))
        if key is None:
            # made before tracking began (FSDP2's buffers, allocated at its lazy init and
            # resized to 0 between uses): known from now on, at the size it had
            key = self._add(storage, before)
            assert key is not None
        delta = int(storage.nbytes()) - before
        if delta:
            self.live[key] = self.live.get(key, 0) + delta
            self.events.append((key, delta))

    def __enter__(self) -> ResizeAwareTracker:
        orig = torch.UntypedStorage.resize_
        self._orig_resize = orig
        tracker = self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            before = int(storage.nbytes())
            out = orig(storage, size)
            tracker._resized(storage, before)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]


def _storages(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [local(t) for t in tensors]


def measure_sharded(
    model: nn.Module,
    step: Callable[[], Any],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    input_tensors: Iterable[torch.Tensor] = (),
) -> MemoryMeasurement:
    """Run ``step`` (forward and backward, the optimizer's step left to the caller) on this rank
    and measure its memory (see the module docstring). Gradients are reset to None first.

    Parameters
    ----------
    model
        The sharded model (``fully_shard`` or ``DistributedDataParallel``'s module).
    step
        Runs the forward and the backward.
    optimizer
        Its state, as present now, counts as static.
    input_tensors
        The step's inputs (dynamic, held all step).
    """
    for p in model.parameters():
        p.grad = None
    params = _storages(model.parameters())
    buffers = _storages(model.buffers())
    state: list[torch.Tensor] = []
    if optimizer is not None:
        for s in optimizer.state.values():
            state.extend(local(v) for v in s.values() if isinstance(v, torch.Tensor))
    inputs = list(input_tensors)
    tracker = ResizeAwareTracker()
    static_keys = tracker.track(params) | tracker.track(buffers) | tracker.track(state)
    input_keys = tracker.track(inputs)
    start = len(tracker.events)
    with tracker:
        step()
    grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
    grad_keys = {tracker.key_of(g) for g in grads} - {None}
    exclude = static_keys | {k for k in grad_keys if k is not None}
    peak, final, timeline = tracker.peak(exclude - input_keys, start)

    param_bytes = distinct_storage_bytes(params)
    buffer_bytes = distinct_storage_bytes(buffers)
    grad_bytes = distinct_storage_bytes(grads)
    opt_bytes = distinct_storage_bytes(state)
    static = param_bytes + buffer_bytes + grad_bytes + opt_bytes
    observed = max((static - grad_bytes) + t for t in [0, *timeline])
    return MemoryMeasurement(
        peak_bytes=static + peak,
        static_bytes=static,
        peak_dynamic_bytes=peak,
        observed_peak_bytes=observed,
        input_bytes=distinct_storage_bytes(inputs),
        final_dynamic_bytes=final,
        param_bytes=param_bytes,
        buffer_bytes=buffer_bytes,
        grad_bytes=grad_bytes,
        optimizer_state_bytes=opt_bytes,
        device="cpu",
        timeline_dynamic_bytes=timeline,
    )


__all__ = ["ResizeAwareTracker", "local", "measure_sharded"]
