"""Peak memory of a compiled training step on the CPU, with the project's storage tracker.

Two things stand between :class:`~remat.executor.measure.LiveStorageTracker` and compiled code:

* dynamo runs a function eagerly, not compiled, while a ``TorchDispatchMode`` is active, unless
  the mode says it ignores compile internals; :class:`CompiledStorageTracker` does, and torch
  then turns it back on while the compiled artifacts run, so it sees every ATen op that an
  ``aot_eager`` graph or an inductor extern kernel calls;
* inductor's generated CPU code allocates its buffers with ``empty_strided_cpu``, which
  bypasses the dispatcher; while measuring, that name is rebound in every generated module so
  that each buffer it allocates is registered with the tracker (and released, as any storage,
  when it dies). Buffers that inductor reuses in place (``buf1 = buf0; del buf0``) are no new
  memory, as on the device.

Scratch memory a kernel allocates and frees inside itself is not seen (the IR calls it
workspace), as in :func:`remat.executor.measure`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from remat.executor.measure import LiveStorageTracker, MemoryMeasurement, measure


class CompiledStorageTracker(LiveStorageTracker):
    """A :class:`LiveStorageTracker` that torch.compile keeps on while compiled code runs."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if isinstance(func, torch._ops.HigherOrderOperator):
            # e.g. run_and_save_rng_state: run it below this mode and count its new outputs.
            from torch.utils._python_dispatch import _disable_current_modes

            with _disable_current_modes():
                out = func(*args, **(kwargs or {}))
            known = {
                id(t.untyped_storage())
                for t in pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)
            }
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in known:
                    self._add(t.untyped_storage())
            return out
        return super().__torch_dispatch__(func, types, args, kwargs)


@contextlib.contextmanager
def _track_inductor_buffers(tracker: LiveStorageTracker) -> Iterator[None]:
    from torch._inductor.codecache import PyCodeCache

    modules = list(PyCodeCache.modules) + list(PyCodeCache.modules_no_attr.values())
    patched: list[tuple[Any, Any]] = []
    for mod in modules:
        orig = getattr(mod, "empty_strided_cpu", None)
        if orig is None or getattr(orig, "_remat_tracking", False):
            continue

        def alloc(*args: Any, _orig: Any = orig, **kwargs: Any) -> torch.Tensor:
            t = _orig(*args, **kwargs)
            tracker._add(t.untyped_storage())
            return t

        alloc._remat_tracking = True  # type: ignore[attr-defined]
        mod.empty_strided_cpu = alloc
        patched.append((mod, orig))
    try:
        yield
    finally:
        for mod, orig in patched:
            mod.empty_strided_cpu = orig


def measure_compiled(
    model: nn.Module,
    example_inputs: Any,
    step: Callable[[], Any],
    *,
    optimizer: torch.optim.Optimizer | None = None,
) -> MemoryMeasurement:
    """Measure one already-compiled step (run it once before, so that it is compiled).

    ``step()`` runs forward and backward and leaves the gradients in ``.grad``; the figures are
    those of :func:`remat.executor.measure` (static + peak dynamic bytes).
    """
    tracker = CompiledStorageTracker()
    with _track_inductor_buffers(tracker):
        return measure(model, example_inputs, optimizer=optimizer, step=step, tracker=tracker)
