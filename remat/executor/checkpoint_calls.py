"""Checkpoint mode planned per call: ``remat.apply(model, None, mode="checkpoint", replan=...)``.

What :func:`remat.enable` runs with ``mode="checkpoint"``. The model's first training call of
each signature (:func:`remat.executor.calls.signature`: shapes, dtypes, the other arguments,
the batch's masking facts) is captured on fake tensors with the model's own modules, planned
by ``replan`` for the checkpoint class, and run: the blocks the plan recomputes get their
checkpoint regions (:func:`remat.executor.module.install`), and the model's own ``forward``
runs, so its output is the model's own (a transformers ``ModelOutput`` with its loss). A call
of another signature swaps the regions for that signature's plan; evaluation and ``no_grad``
calls run the model with no region at all.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

from remat.executor.calls import example, forward_for_capture, signature
from remat.executor.module import ModulePlan, checked_plan, install, regions_plan, remove, uninstall
from remat.ir import Graph, SolveResult

Replan = Callable[[Graph], SolveResult]


@dataclass
class _PerCall:
    """What :func:`apply_checkpoint_per_call` attached to the model (``model._remat_applied``)."""

    replan: Replan
    loss_fn: Any
    original_forward: Any
    plans: dict[tuple[Any, ...], ModulePlan] = field(default_factory=dict)
    results: dict[tuple[Any, ...], SolveResult] = field(default_factory=dict)
    """Each signature's solve result (its figures: what the regions are predicted to do)."""
    installed: tuple[Any, ...] | None = None
    originals: dict[str, Any] = field(default_factory=dict)
    capturing: bool = False
    return_outputs: bool = False
    """Trace each signature with the model's other outputs held until the backward."""
    forward: Any = None
    """The forward :func:`apply_checkpoint_per_call` installed (the capture calls it)."""

    @property
    def plan(self) -> ModulePlan | None:
        """The regions installed now (the last training call's signature)."""
        return None if self.installed is None else self.plans[self.installed]

    def take_off(self, model: nn.Module) -> None:
        """The installed regions off (also what :func:`remat.executor.remove` calls before it
        puts :attr:`original_forward` back)."""
        uninstall(model, self.originals)
        self.originals, self.installed = {}, None

    def planned(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        sig = signature(args, kwargs)
        if sig not in self.plans:
            from remat.tracer import trace_capture

            self.take_off(model)
            self.capturing = True
            try:
                # a caller's memory tracker sees no fake tensor
                with _disable_current_modes(), forward_for_capture(model, self.forward):
                    cap = trace_capture(
                        model,
                        example(args, kwargs),
                        self.loss_fn,
                        return_outputs=self.return_outputs,
                    )
            finally:
                self.capturing = False
            graph = cap.graph
            if self.return_outputs and cap.returned_fx:
                from remat.tracer.joint_passes import held_until_backward

                held = [cap.fx_value[n.name] for n in cap.returned_fx]
                graph = held_until_backward(graph, cap.tangent_value, held, through_backward=True)
            result = self.replan(graph)
            self.plans[sig] = regions_plan(graph, checked_plan(graph, result))
            self.results[sig] = result
        return sig


def apply_checkpoint_per_call(
    model: nn.Module, replan: Replan, *, loss_fn: Any = None, return_outputs: bool = False
) -> nn.Module:
    """Run ``model``'s training calls in checkpoint regions planned per call signature by
    ``replan(graph) -> result`` (a plan of the checkpoint class: solve with
    ``executor="checkpoint"``). ``loss_fn``: the loss the capture traces (None: the model's own
    loss, or its output); the model's ``forward`` still returns its own output. With
    ``return_outputs``, each signature is traced as a loop that keeps that output until its
    backward (``out = model(**batch); out.loss.backward()``): the plan holds the output's other
    tensors (the logits) until the backward part begins and counts them in its peak; without,
    the plan takes them as dropped once the loss is computed (as ``Trainer`` does), and a loop
    that keeps them measures their size above the predicted peak. Returns ``model``;
    :func:`remat.executor.remove` undoes it."""
    if getattr(model, "_remat_applied", None) is not None:
        remove(model)
    unmodified = model.forward
    state = _PerCall(replan, loss_fn, model.__dict__.get("forward"), return_outputs=return_outputs)

    @functools.wraps(unmodified)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if state.capturing:
            return unmodified(*args, **kwargs)
        if not (model.training and torch.is_grad_enabled()):
            state.take_off(model)
            return unmodified(*args, **kwargs)
        sig = state.planned(model, args, kwargs)
        if state.installed != sig:
            state.take_off(model)
            state.originals, state.installed = install(model, state.plans[sig]), sig
        return unmodified(*args, **kwargs)

    state.forward = forward
    model.forward = forward
    model._remat_applied = state  # type: ignore[assignment]
    return model


def per_call_results(model: nn.Module) -> list[SolveResult]:
    """The solve results of a model given to :func:`apply_checkpoint_per_call`, one per
    signature planned so far (empty for any other model)."""
    applied = getattr(model, "_remat_applied", None)
    return list(applied.results.values()) if isinstance(applied, _PerCall) else []


__all__ = ["apply_checkpoint_per_call", "per_call_results"]
