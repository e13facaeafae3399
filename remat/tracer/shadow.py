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

The batch's own data is the one exception, and a narrow one. transformers asks two questions
of the caller's ``attention_mask`` and ``position_ids`` (does the mask mask any token? is each
row one sequence?) and skips the causal mask when eager's answer allows it. The capture gives
those two inputs their real values (:func:`seed_batch`), but answers questions on them, and on
what is computed from them, only inside the masking functions of :data:`BATCH_QUESTIONS`
(:func:`batch_questions`); everywhere else they stay traced, as any batch data does. The two
answers are the call's :func:`batch_facts`, part of the signature a plan is cached under, so a
batch that answers otherwise is planned apart.
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
_BATCH_OPEN: ContextVar[bool] = ContextVar("remat_batch_questions", default=False)

BATCH_INPUTS = ("attention_mask", "position_ids")
"""Keyword inputs whose real data may answer transformers' masking questions."""

BATCH_QUESTIONS = (
    "find_packed_sequence_indices",
    "_ignore_causal_mask_sdpa",
    "_ignore_bidirectional_mask_sdpa",
)
"""The functions of ``transformers.masking_utils`` inside which the batch's data is read as
eager reads it: each asks only what :func:`batch_facts` records (no padding; one sequence per
row)."""


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
        self.batch: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """The tensors of :attr:`values` that hold (or are computed from) the batch's data."""
        self.answered = 0
        """How many data questions were answered from real values (for tests and reports)."""

    def known(self, t: Any) -> bool:
        """Whether ``t``'s real value answers questions here (batch data: only inside
        :func:`batch_questions`)."""
        return (
            isinstance(t, torch.Tensor)
            and t in self.values
            and (t not in self.batch or _BATCH_OPEN.get())
        )

    def seed(self, t: torch.Tensor, real: torch.Tensor) -> None:
        """Give the capture's ``t`` the batch's real data ``real`` (see :func:`seed_batch`)."""
        self.values[t] = real
        self.batch[t] = True

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
        if name in _QUESTIONS and tensors and self.known(tensors[0]):
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
            self._compute(func, args, kwargs, out, any(t in self.batch for t in tensors))
        elif versions and (_writes(name, kwargs) or any(t._version != v for t, v in versions)):
            self.values = WeakIdKeyDictionary()  # a known tensor written from unknown data
            self.batch = WeakIdKeyDictionary()
        return out

    def _run_real(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """``func`` on the real values, outside the capture's modes."""
        from torch.utils._python_dispatch import _disable_current_modes

        real_args, real_kwargs = pytree.tree_map(self._real, (args, kwargs))
        with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad():
            return func(*real_args, **real_kwargs)

    def _compute(
        self, func: Any, args: Any, kwargs: dict[str, Any], out: Any, from_batch: bool
    ) -> None:
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
                if from_batch:
                    self.batch[o] = True


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


@contextlib.contextmanager
def batch_questions() -> Iterator[None]:
    """Questions on the batch's seeded data answered from it, for the duration (one of
    :data:`BATCH_QUESTIONS` runs)."""
    token = _BATCH_OPEN.set(True)
    try:
        yield
    finally:
        _BATCH_OPEN.reset(token)


def _real_2d(t: Any) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return (
        isinstance(t, torch.Tensor)
        and t.dim() == 2
        and t.device.type != "meta"
        and not is_fake(t)
        and not isinstance(t, torch.nn.Parameter)
    )


def seed_batch(shadows: Shadows, inputs: Any, real_inputs: Any) -> None:
    """Seed ``shadows`` with the real data of the :data:`BATCH_INPUTS` of a keyword call:
    ``inputs`` the capture's (fake) keyword arguments, ``real_inputs`` the caller's."""
    if not isinstance(inputs, dict) or not isinstance(real_inputs, dict):
        return
    for name in BATCH_INPUTS:
        t, real = inputs.get(name), real_inputs.get(name)
        # No op runs here: this is called inside the capture's modes.
        if isinstance(t, torch.Tensor) and _real_2d(real) and _plain(real) and t is not real:
            assert isinstance(real, torch.Tensor)
            shadows.seed(t, real)


def batch_facts(inputs: Any) -> tuple[bool, bool | None]:
    """What eager transformers decides from a keyword call's batch data, as the capture does
    (:data:`BATCH_QUESTIONS`): whether a real 2-D ``attention_mask`` masks no token, and
    whether each row of the ``position_ids`` is one sequence (None: no real positions, or
    transformers not imported). Part of the signature a plan is cached under."""
    import sys

    if not isinstance(inputs, dict):
        return False, None
    mask = inputs.get("attention_mask")
    unpadded = _real_2d(mask) and bool(mask.bool().all())
    masking = sys.modules.get("transformers.masking_utils")
    pos = inputs.get("position_ids")
    single: bool | None = None
    if masking is not None and _real_2d(pos):
        single = masking.find_packed_sequence_indices(pos) is None
    return unpadded, single


__all__ = [
    "BATCH_INPUTS",
    "BATCH_QUESTIONS",
    "MAX_NUMEL",
    "ShadowMode",
    "Shadows",
    "batch_facts",
    "batch_questions",
    "known",
    "seed_batch",
    "shadowing",
]
