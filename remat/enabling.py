"""One line, driven by a budget: ``remat.enable(model, budget="12GiB")``.

The drop-in for transformers' ``model.gradient_checkpointing_enable()``: nothing is traced when
it is called. The model's first training call (``model.train()``, gradients on) is captured on
fake tensors with the arguments it was given (whatever a trainer passes: ``labels``,
``attention_mask``, ``num_items_in_batch``), solved under the budget, and run by the op-level
executor (:func:`remat.apply`), or with ``mode="checkpoint"`` as checkpoint regions around the
model's own blocks (:mod:`remat.executor.checkpoint_calls`); later calls with the same
signature (shapes, dtypes, the other arguments) reuse that plan, and a new signature (another
sequence length) is planned once under the same budget and cached. The model keeps its type,
its ``state_dict`` and its outputs (a model that returns its own loss in a ``ModelOutput``
returns one, with the loss); evaluation and ``no_grad`` calls run the unmodified forward.
:func:`disable` restores the model.

As transformers' own checkpointing does, a training call of a model whose ``forward`` takes
``use_cache`` runs with ``use_cache=False`` unless the caller passes it: a key/value cache
built during training serves no later step, and its appends would be replayed by
recomputation. Each plan is announced once through :mod:`logging` (logger ``remat``): the
solver, the predicted peak against the budget, the predicted overhead.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import torch
from torch import nn

from remat.executor import ExecutorError, apply, remove
from remat.ir import Graph, SolveResult, format_bytes
from remat.solver import solve

log = logging.getLogger("remat")


def enable(
    model: nn.Module,
    budget: int | float | str,
    *,
    solver: str | None = None,
    time_limit_s: float | None = 30.0,
    loss_fn: Any = None,
    allow_over_budget: bool = False,
    mode: str = "op",
    return_outputs: bool = False,
    **solve_options: Any,
) -> nn.Module:
    """Plan ``model``'s training step under ``budget`` at its first training call, and run it.

    Parameters
    ----------
    model
        The model, modified in place (its ``forward`` on the instance); returned.
    budget
        Total device bytes (``"12GiB"``, an ``int``) or a share of the eager activation peak
        (``"50%"``, ``0.5``), as :func:`remat.solve` takes it; the same budget for every
        signature.
    solver, time_limit_s, solve_options
        Passed to :func:`remat.solve` for each signature (default ``auto``, 30 s).
    loss_fn
        None (default) when the model returns its loss (a scalar, or a ``ModelOutput`` whose
        ``loss`` is set, as transformers models do given ``labels``), or its output is what the
        caller's loss reads; else ``loss_fn(output) -> scalar``, and the training ``forward``
        returns that loss.
    allow_over_budget
        Run the smallest plan found when none fits the budget; by default that signature's
        first call raises :class:`~remat.executor.ExecutorError` naming the smallest budget
        found.
    mode
        ``"op"`` (default): the op-level executor runs each plan (any plan, offloads
        included). ``"checkpoint"``: plans of the checkpoint class (solved with
        ``executor="checkpoint"``), run as ``torch.utils.checkpoint`` regions around the
        model's own blocks (:mod:`remat.executor.checkpoint_calls`); the ``forward`` returns
        the model's own output even with a ``loss_fn``.
    return_outputs
        Op mode, a model that returns its own loss in a ``ModelOutput``: the training
        ``forward`` returns its other tensors too (the logits), held by every plan until the
        backward part begins and counted in its peak; they carry no gradient path (a loss
        computed on them is refused in backward). Off by default (the logits are then None):
        Trainer, Accelerate and Lightning read only the loss in training, and the logits'
        storage would otherwise be free before the forward's end. Checkpoint mode always
        returns the model's own output; there ``return_outputs=True`` plans a loop that keeps
        it until the backward (``out = model(**batch); out.loss.backward()``), counting its
        other tensors in the peak, and the default a loop that drops them once it has the
        loss (``Trainer``, Accelerate, Lightning), which a loop that keeps them exceeds by
        their size.

    Returns
    -------
    nn.Module
        ``model`` itself.

    Examples
    --------
    >>> model = remat.enable(model, budget="50%")     # doctest: +SKIP
    >>> Trainer(model=model, args=args, train_dataset=ds).train()  # doctest: +SKIP
    """
    name = type(model).__name__
    if mode not in ("op", "checkpoint"):
        raise ValueError(f"mode must be 'op' or 'checkpoint', got {mode!r}")
    if mode == "checkpoint":
        solve_options = {**solve_options, "executor": "checkpoint"}

    def replan(graph: Graph) -> SolveResult:
        result = solve(graph, budget, solver=solver, time_limit_s=time_limit_s, **solve_options)
        if not result.fits and not allow_over_budget:
            small = result.min_budget_bytes
            raise ExecutorError(
                f"remat.enable: no plan for {name} ({graph.num_nodes} nodes) fits "
                f"{format_bytes(result.budget_bytes)}"
                + (f"; the smallest found needs {format_bytes(small)}" if small else "")
                + ": raise the budget, or pass allow_over_budget=True to run the smallest plan"
            )
        assert result.figures is not None
        log.info(
            "remat: planned %s (%d nodes) with %s%s: predicted peak %s of %s budget, overhead "
            "%+.1f%% (%s)",
            name,
            graph.num_nodes,
            result.solver,
            " in checkpoint regions" if mode == "checkpoint" else "",
            format_bytes(result.figures.peak_bytes),
            format_bytes(result.budget_bytes),
            100 * (result.overhead or 0.0),
            result.status,
        )
        return result

    apply(model, None, loss_fn=loss_fn, replan=replan, mode=mode, return_outputs=return_outputs)
    planned = model.forward
    if "use_cache" in _parameters(model):

        @functools.wraps(planned)
        def forward(*args: Any, **kwargs: Any) -> Any:
            if model.training and torch.is_grad_enabled() and "use_cache" not in kwargs:
                kwargs["use_cache"] = False  # as gradient checkpointing does in training
            return planned(*args, **kwargs)

        model.forward = forward
    return model


def disable(model: nn.Module) -> nn.Module:
    """Undo :func:`enable` (or :func:`remat.apply`): the model's own ``forward`` runs again."""
    return remove(model)


def _parameters(model: nn.Module) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return {}


__all__ = ["disable", "enable"]
