"""Real values of the data-independent tensors a model makes while it is captured.

Models branch in Python on tensor data that does not depend on the batch: transformers'
masking code asks whether ``position_ids`` (an ``arange`` made inside ``forward``) describe
packed sequences, and skips the causal mask when they do not. On the capture's fake tensors
such a question has no answer, so a model either fails (``.item()`` on a fake tensor) or, told
that it is being traced, takes its conservative path (the mask materialised, attention with an
explicit mask and repeated key/value heads instead of ``is_causal`` with grouped queries): a
different computation from the eager step, whose gradients differ in the last bits and whose
memory differs by the mask.

While capturing, :class:`Shadows` computes alongside each torch call, on real CPU tensors, the
results of calls whose tensor arguments all have known values: factory functions (``arange``,
``tensor``, ``zeros``, ...), tensors the model closes over, and calls on such results. Random
and uninitialised factories never get a value, nor do the model's parameters, buffers and
inputs (their data changes from batch to batch: a branch on them stays the traced one). A
question on a tensor with a value (``bool``, ``item``, ``tolist``, ``int``, ``float``) is then
answered as eager answers it, so the captured graph is the eager step's. An in-place call that
writes a tensor with a value from one without drops every value (aliases are not tracked).
Only small tensors get values (at most :data:`MAX_NUMEL` elements).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

MAX_NUMEL = 1 << 16
"""Largest tensor (elements) whose real value is computed alongside the capture."""

_RANDOM_OR_UNINITIALISED = (
    "rand",
    "normal",
    "bernoulli",
    "multinomial",
    "poisson",
    "dropout",
    "exponential",
    "geometric",
    "cauchy",
    "uniform",
    "empty",
    "random",
)
_QUESTIONS = {"__bool__", "item", "tolist", "__int__", "__float__", "__index__"}

_IN_PLACE_DUNDERS = {
    "__setitem__",
    *(
        f"__i{op}__"
        for op in [
            "add",
            "sub",
            "mul",
            "truediv",
            "floordiv",
            "mod",
            "pow",
            "and",
            "or",
            "xor",
            "lshift",
            "rshift",
            "matmul",
        ]
    ),
}

_ACTIVE: ContextVar[Shadows | None] = ContextVar("remat_shadows", default=None)


def _name(func: Any) -> str:
    return str(getattr(func, "__name__", "") or "")


def _writes(name: str, kwargs: dict[str, Any]) -> bool:
    """Whether a call of this name writes into a tensor argument (in-place, ``out=``)."""
    if name.startswith("__"):
        return name in _IN_PLACE_DUNDERS
    return name.endswith("_") or "out" in kwargs


def _plain(t: torch.Tensor) -> bool:
    """A real tensor (not fake, not a functional wrapper, not on the meta device)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and not isinstance(t, (FakeTensor, FunctionalTensor))
        and t.device.type == "cpu"
    )


class Shadows:
    """Capture tensor -> its real value, for the data-independent tensors of one capture."""

    def __init__(self) -> None:
        self.values: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.answered = 0
        """How many data questions were answered from real values (for tests and reports)."""

    def known(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t in self.values

    def _real(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return self.values.get(x, x)
        return x

    def _has_value(self, t: torch.Tensor) -> bool:
        return t in self.values or _plain(t)

    def call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``func`` as the capture does, and compute its real result where it has one."""
        name = _name(func)
        tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        if name in _QUESTIONS and tensors and tensors[0] in self.values:
            self.answered += 1
            return self._run_real(func, args, kwargs)
        versions = [(t, t._version) for t in tensors if t in self.values]
        out = func(*args, **kwargs)
        computable = (
            all(self._has_value(t) for t in tensors)
            and not any(word in name.lower() for word in _RANDOM_OR_UNINITIALISED)
            and any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(out))
        )
        if computable:
            self._compute(func, args, kwargs, out)
        elif versions and (_writes(name, kwargs) or any(t._version != v for t, v in versions)):
            self.values = WeakIdKeyDictionary()  # a known tensor written from unknown data
        return out

    def _run_real(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """``func`` on the real values, outside the capture's modes."""
        from torch.utils._python_dispatch import _disable_current_modes

        real_args, real_kwargs = pytree.tree_map(self._real, (args, kwargs))
        with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad():
            return func(*real_args, **real_kwargs)

    def _compute(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        outs = pytree.tree_leaves(out)
        if any(isinstance(o, torch.Tensor) and o.numel() > MAX_NUMEL for o in outs):
            return
        try:
            real = self._run_real(func, args, kwargs)
        except Exception:  # the capture's own call succeeded; the value stays unknown
            return
        reals = pytree.tree_leaves(real)
        if len(reals) != len(outs):
            return
        for o, r in zip(outs, reals, strict=True):
            if (
                isinstance(o, torch.Tensor)
                and isinstance(r, torch.Tensor)
                and not _plain(o)
                and tuple(o.shape) == tuple(r.shape)
                and o.dtype == r.dtype
            ):
                self.values[o] = r


class ShadowMode(TorchFunctionMode):
    """Every torch call through :meth:`Shadows.call` (for a step run on fake tensors outside
    the capture, as :func:`remat.executor.measure.measure_fake` runs the plain eager step)."""

    def __init__(self, shadows: Shadows) -> None:
        super().__init__()
        self.shadows = shadows

    def __torch_function__(
        self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        return self.shadows.call(func, tuple(args), dict(kwargs or {}))


@contextlib.contextmanager
def shadowing(shadows: Shadows) -> Iterator[Shadows]:
    """Make ``shadows`` the capture's (what :func:`known` consults)."""
    token = _ACTIVE.set(shadows)
    try:
        yield shadows
    finally:
        _ACTIVE.reset(token)


def known(t: Any) -> bool:
    """Whether the running capture knows ``t``'s real value (eager's answers to its data)."""
    shadows = _ACTIVE.get()
    return shadows is not None and shadows.known(t)


__all__ = ["MAX_NUMEL", "ShadowMode", "Shadows", "known", "shadowing"]
