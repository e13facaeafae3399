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

gloo runs each collective on a worker thread, and its work object holds references to the
collective's tensors until that thread lets go of it, just *after* it has woken the waiting
rank. When the worker is descheduled in between, FSDP2's all-gather buffer (or its
reduce-scatter input) outlives the moment the step drops it, by however long the scheduler
takes, and the measured peak varied from run to run by a unit's gathered parameters (on the
FSDP test's GPT, 691,592 B in most runs and 726,024 or 742,408 B in about one in ten: from one
in four to one in forty in batches of runs). The step drops those buffers when it is done
with them; the tracker measures that program, not gloo's thread timing: while it is
active, every ``Work.wait()`` returns only once the process's other threads are off the CPU
(read from ``/proc``, Linux only; at most :data:`QUIESCE_S` seconds), so the worker has
released the work before the step goes on.
"""

from __future__ import annotations

import os
import threading
import time
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


QUIESCE_S = 0.2
"""The longest a collective's ``wait`` waits for the other threads to be idle."""


def _others_running() -> bool:
    """Whether a thread of this process other than the caller is running or runnable."""
    me = threading.get_native_id()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return False
    for tid in tids:
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state == "R":
            return True
    return False


def _quiesce() -> None:
    """Wait (at most :data:`QUIESCE_S`) until no other thread of the process is running."""
    deadline = time.monotonic() + QUIESCE_S
    while _others_running() and time.monotonic() < deadline:
        time.sleep(1e-5)


def _work_class() -> Any:
    try:
        from torch._C._distributed_c10d import Work
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return Work


class ResizeAwareTracker(LiveStorageTracker):
    """A :class:`LiveStorageTracker` that also counts in-place storage resizes."""

    def __init__(self) -> None:
        super().__init__()
        self._orig_resize: Any = None
        self._orig_wait: tuple[Any, Any] | None = None  # (gloo's Work class, its own wait)

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
        work = _work_class()
        if work is not None:
            orig_wait = work.wait
            self._orig_wait = (work, orig_wait)

            def wait(w: Any, *args: Any, **kwargs: Any) -> Any:
                out = orig_wait(w, *args, **kwargs)
                _quiesce()
                return out

            work.wait = wait
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        if self._orig_wait is not None:
            work, orig_wait = self._orig_wait
            work.wait = orig_wait
            self._orig_wait = None


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
