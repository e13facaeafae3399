"""``trace``: a PyTorch model and its inputs to a costed :class:`remat.ir.Graph`."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from remat.ir import DeviceProfile, Graph
from remat.ir.devices import get_profile
from remat.tracer.capture import Capture, LossFn, TraceError, capture
from remat.tracer.costs import Cost, apply_costs, resolve_cost


def trace(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: LossFn | None = None,
    *,
    cost: Cost | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    require_real: bool = False,
    target: str | None = None,
    return_outputs: bool = False,
) -> Graph:
    """Trace one training step of ``model`` into a costed graph.

    Parameters
    ----------
    model
        Any ``nn.Module`` on the CPU or the meta device; it is not modified.
    example_inputs
        A tensor or a tuple of the model's positional arguments.
    loss_fn
        ``loss_fn(output) -> scalar loss`` (targets closed over); None when the model returns
        the loss itself, or when the training loop computes its loss on the model's output (a
        tensor, or a ``ModelOutput`` holding one): the step then ends at that output and takes
        its gradient as the backward's input (run it with ``remat.apply``).
    cost
        None (default): the roofline of the device the step targets (the measured local CPU
        for ``target="cpu"``, the named profile for ``target="h100"``...); or ``"measure"``,
        ``"flops"`` (FLOPs only: element-wise ops cost 0), a :class:`~remat.ir.DeviceProfile`
        or a profile name (``"cpu"``, ``"a100"``, ``"h100"``, ``"h200"``); see
        :mod:`remat.tracer.costs`.
    optimizer
        When given, its state (real, or the state one step would create) is added to
        ``static_bytes``.
    require_real
        Tracing always runs on fake tensors, so no memory the size of the model is needed (a
        model on the meta device traces too); ``require_real=True`` checks that the model's
        tensors are real.
    target
        Whose eager step the graph mirrors: ``"cpu"`` (default), ``"cuda"`` (see
        :func:`remat.tracer.capture`), or a GPU profile name (``"a100"``, ``"h100"``,
        ``"h200"``), which captures the CUDA step and makes that profile the default cost. Use
        a GPU target to plan a GPU's memory (fused dropout and attention); keep ``"cpu"`` for a
        plan that the executors run on this machine, since they capture the CPU step and node
        ids must match.
    return_outputs
        For a model that returns its own loss beside other tensors (a transformers
        ``ModelOutput`` with ``loss`` and ``logits``): the step returns those tensors too,
        held until the backward part begins (see :func:`remat.tracer.capture`); apply the
        plan with ``remat.apply(..., return_outputs=True)``.

    Returns
    -------
    Graph
        Nodes in the order of the unmodified step; required values are the gradients of the
        parameters with ``requires_grad`` and the loss.

    Raises
    ------
    TraceError
        When the model cannot be traced (the message names the op and the module).
    """
    return trace_capture(
        model,
        example_inputs,
        loss_fn,
        cost=cost,
        optimizer=optimizer,
        require_real=require_real,
        target=target,
        return_outputs=return_outputs,
    ).graph


def trace_capture(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: LossFn | None = None,
    *,
    cost: Cost | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    require_real: bool = False,
    target: str | None = None,
    return_outputs: bool = False,
) -> Capture:
    """As :func:`trace`, but return the whole :class:`Capture` (its ``graph`` is costed)."""
    device, capture_target = _target(target)
    resolved = resolve_cost(cost, device)
    cap = capture(
        model,
        example_inputs,
        loss_fn,
        require_real=require_real,
        target=capture_target,
        return_outputs=return_outputs,
    )
    graph = apply_costs(cap, resolved, model=model, example_inputs=example_inputs)
    if optimizer is not None:
        extra = optimizer_state_bytes(optimizer, model)
        graph = Graph(
            name=graph.name,
            nodes=graph.nodes,
            values=graph.values,
            required=graph.required,
            static_bytes=graph.static_bytes + extra,
            device=graph.device,
        )
    cap.graph = graph.mark_traced(with_loss_fn=loss_fn is not None)
    return cap


def _target(target: str | None) -> tuple[str, str]:
    """(device whose roofline is the default cost, the step ``capture`` mirrors)."""
    if target is None or target.lower() == "cpu":
        return "cpu", "cpu"
    if target.lower() == "cuda":
        return "cuda", "cuda"
    try:
        get_profile(target)
    except ValueError:
        raise ValueError(
            f"target must be 'cpu', 'cuda' or a GPU profile name (a100, h100, h200), got {target!r}"
        ) from None
    return target, "cuda"


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, model: nn.Module) -> int:
    """Bytes of optimizer state for ``model``'s parameters.

    The state already present is counted as is; when it is empty (no step taken yet), one step
    of a fresh optimizer of the same class and settings is run on fake copies of the
    parameters to see what state it creates, so nothing is allocated.
    """
    params = list(dict.fromkeys(p for g in optimizer.param_groups for p in g["params"]))
    if any(optimizer.state.get(p) for p in params):
        return _state_bytes(optimizer.state.values())
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with mode:
            groups = []
            for group in optimizer.param_groups:
                fakes = []
                for p in group["params"]:
                    f = mode.from_tensor(p.detach()).requires_grad_(p.requires_grad)
                    if p.requires_grad:
                        f.grad = torch.zeros_like(f)
                    fakes.append(f)
                groups.append(
                    {**{k: v for k, v in group.items() if k != "params"}, "params": fakes}
                )
            # Only the settings the class's constructor takes: AdamW's defaults hold Adam's
            # decoupled_weight_decay, which AdamW() refuses. Each group carries its own anyway.
            accepted = inspect.signature(type(optimizer).__init__).parameters
            defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
            opt = type(optimizer)(groups, **defaults)
            opt.step()
            return _state_bytes(opt.state.values())
    except Exception as exc:  # an optimizer that cannot step on fake tensors
        raise TraceError(
            f"cannot size the state of optimizer {type(optimizer).__name__}: {exc}; "
            "take one real step first so its state exists"
        ) from exc


def _state_bytes(states: Any) -> int:
    seen: dict[int, int] = {}
    for st in states:
        for v in st.values():
            if isinstance(v, torch.Tensor):
                seen.setdefault(id(v.untyped_storage()), int(v.untyped_storage().nbytes()))
    return sum(seen.values())


# -- MODULE:FUNCTION specs --------------------------------------------------------------------


def load_spec(spec: str) -> tuple[nn.Module, Any, LossFn | None]:
    """Import ``MODULE:FUNCTION`` (a dotted module or a ``.py`` path) and call the function.

    It must return ``(model, example_inputs)`` or ``(model, example_inputs, loss_fn)``.
    """
    if ":" not in spec:
        raise ValueError(
            f"expected MODULE:FUNCTION (e.g. examples/models.py:build_gpt), got {spec!r}"
        )
    target, _, func_name = spec.rpartition(":")
    if not target or not func_name:
        raise ValueError(f"expected MODULE:FUNCTION, got {spec!r}")
    if target.endswith(".py") or "/" in target or Path(target).suffix == ".py":
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"no such file {target!r} in {spec!r}")
        name = f"_remat_spec_{path.stem}"
        mod_spec = importlib.util.spec_from_file_location(name, path)
        if mod_spec is None or mod_spec.loader is None:
            raise ValueError(f"cannot import {target!r}")
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[name] = module
        mod_spec.loader.exec_module(module)
    else:
        if "" not in sys.path and "." not in sys.path:
            sys.path.insert(0, "")
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ValueError(f"cannot import module {target!r}: {exc}") from exc
    fn = getattr(module, func_name, None)
    if fn is None or not callable(fn):
        raise ValueError(f"{target!r} has no function {func_name!r}")
    result = fn()
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise ValueError(
            f"{spec} must return (model, example_inputs) or (model, example_inputs, loss_fn), "
            f"got {type(result).__name__}"
        )
    model, inputs = result[0], result[1]
    loss_fn = result[2] if len(result) == 3 else None
    if not isinstance(model, nn.Module):
        raise ValueError(f"{spec} returned {type(model).__name__} as the model, not an nn.Module")
    return model, inputs, loss_fn


def trace_spec(
    spec: str, *, cost: Cost | None = None, require_real: bool = False, target: str | None = None
) -> Graph:
    """Load ``MODULE:FUNCTION`` (see :func:`load_spec`) and :func:`trace` what it returns."""
    model, inputs, loss_fn = load_spec(spec)
    return trace(model, inputs, loss_fn, cost=cost, require_real=require_real, target=target)


__all__ = [
    "DeviceProfile",
    "load_spec",
    "optimizer_state_bytes",
    "trace",
    "trace_capture",
    "trace_spec",
]
