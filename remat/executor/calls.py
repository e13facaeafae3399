"""What a plan depends on in a model's call: its signature, and its arguments as the tracer
takes them. Shared by both executors' per-call planning (:func:`remat.apply` with ``replan``,
:func:`remat.enable`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from remat.executor.errors import ExecutorError


def signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What a plan depends on in a call: tensor shapes, dtypes, devices, the other arguments,
    the autocast state, and the two facts of the batch's data that the capture reads as eager
    transformers does (whether the ``attention_mask`` masks no token, whether each row of the
    ``position_ids`` is one sequence: :func:`remat.tracer.shadow.batch_facts`): a batch with
    padding after one without is another step (an explicit mask), and must not run the first
    one's plan."""
    from remat.tracer.shadow import batch_facts

    leaves, spec = pytree.tree_flatten((args, kwargs))
    parts: list[Any] = [str(spec)]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            parts.append((tuple(x.shape), str(x.dtype), str(x.device), bool(x.requires_grad)))
        else:
            parts.append(repr(x))
    parts.append(
        ("autocast", torch.is_autocast_enabled("cpu"), str(torch.get_autocast_dtype("cpu")))
    )
    if kwargs and not args:
        parts.append(("data", *batch_facts(kwargs)))
    return tuple(parts)


@contextlib.contextmanager
def forward_for_capture(
    model: torch.nn.Module, forward: Callable[..., Any] | None
) -> Iterator[None]:
    """While the per-call capture runs ``model``, its ``forward`` is ``forward`` (remat's own).

    A wrapper put on ``model.forward`` after remat's (Accelerate's ``prepare`` wraps it in a
    ``torch.autocast`` decorator) has already run around the call being planned; running it
    again inside re-enters the same ``torch.autocast`` object, which keeps one previous
    state per object, so its outer exit leaves autocast on for the rest of the process."""
    if forward is None:
        yield
        return
    own = model.__dict__  # an instance attribute, as nn.Module.__setattr__ keeps a function
    had, saved = "forward" in own, own.get("forward")
    own["forward"] = forward
    try:
        yield
    finally:
        if had:
            own["forward"] = saved
        else:
            del own["forward"]


def describe(sig: tuple[Any, ...]) -> str:
    """A signature's tensors, for messages: ``(2, 16):int64, ...``."""
    shapes = [
        f"{tuple(p[0])}:{p[1].removeprefix('torch.')}"
        for p in sig
        if isinstance(p, tuple) and len(p) == 4
    ]
    return ", ".join(shapes) or "no tensors"


def example(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The call's arguments in the form the tracer takes (a tuple, or a dict of keywords)."""
    if args and kwargs:
        raise ExecutorError(
            "remat.apply's model was called with positional and keyword arguments at once; the "
            "tracer takes either a tuple of positional arguments or a dict of keyword arguments"
        )
    return dict(kwargs) if kwargs else tuple(args)


__all__ = ["describe", "example", "signature"]
