"""``remat.apply(model, result)``: the plan, op by op, inside autograd.

The model's ``forward`` is replaced (on the instance: parameters, buffers, ``state_dict`` and
the module tree are untouched) by one that, in training with gradients enabled, calls a custom
:class:`torch.autograd.Function`:

* its ``forward`` runs the plan's steps up to the first one that needs the loss's gradient
  (:func:`remat.executor.opexec.forward_cut`), keeping, freeing and offloading as the plan says,
  and returns the loss; what is still resident (kept values, host copies, saved generator
  states) is held by the function's context;
* its ``backward`` receives the loss's gradient from autograd (1 for ``loss.backward()``, the
  scale for ``GradScaler``), runs the rest of the plan (recomputations with the random numbers
  of the first computation) and returns the parameters' gradients to autograd, which
  accumulates them into ``.grad``: gradient accumulation, ``GradScaler`` and the hooks of
  ``DistributedDataParallel`` work as with the unmodified model.

Both halves are the op-level executor's generated code (:mod:`remat.executor.opexec`), so memory
is the plan's from the first step: the step is captured on fake tensors (no real memory) at the
first call, or when ``apply`` is given ``example_inputs``.

The traced step decides what ``forward`` returns: for a graph traced with ``loss_fn``,
``loss_fn(model(...))``, the loss, which the training loop then backpropagates; without
``loss_fn``, the model's own output. That is either the scalar loss (e.g. a model called with
its labels), or an output the loop computes its own loss on (a tensor, or a ``ModelOutput``
holding one tensor, such as the logits): the step was then traced with the output's gradient as
the backward's input (:attr:`remat.tracer.Capture.output`), autograd brings the gradient of the
loop's loss into the function's ``backward``, and the plan's figures cover the model's forward
and backward, not the loss the loop computes in between (its own tensors come on top).
In ``eval()`` mode, or with gradients disabled, the unmodified ``forward`` runs.

Each plan holds for the input shapes it was solved for. A call with other shapes (dtypes,
devices, non-tensor arguments or autocast state) raises :class:`ExecutorError`, or, when
``apply`` was given ``replan``, is traced and planned once and cached per signature.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from remat.executor.calls import describe, example, forward_for_capture, signature
from remat.executor.codegen import CodeGen, ident
from remat.executor.hostmem import HostMemory
from remat.executor.opexec import (
    ExecutorError,
    capture_for,
    forward_cut,
    plan_to_run,
    simulate_traced,
)
from remat.ir import Graph, Plan, SolveResult
from remat.ir.simulate import Simulation

LossFn = Callable[[Any], torch.Tensor]
Replan = Callable[[Graph], Any]


@dataclass
class PlannedStep:
    """One plan compiled for one input signature: the two halves of the step."""

    capture: Any
    plan: Plan
    simulation: Simulation
    source: str
    host: HostMemory
    grad_index: list[int]
    """For each primal: the index of its gradient in the backward function's results, or -1."""
    loss_name: str
    """Variable of the loss's storage in the forward part's environment."""
    backward_reads_loss: bool
    tangent_shape: tuple[int, ...]
    tangent_stride: tuple[int, ...]
    """Layout of the incoming gradient the step was traced with."""
    cut: int
    """Index of the plan's first step run by the backward part (:func:`forward_cut`)."""
    _fwd: Callable[..., Any] = field(repr=False)
    _bwd: Callable[..., list[Any]] = field(repr=False)

    @property
    def graph(self) -> Graph:
        graph: Graph = self.capture.graph
        return graph


def _compile(
    cap: Any, plan: Plan, device: torch.device, probe: Callable[[int], None] | None = None
) -> PlannedStep:
    graph: Graph = cap.graph
    sim = simulate_traced(graph, plan)
    cut = forward_cut(cap, plan)
    gen = CodeGen(cap, plan, device, cut=cut, probe=probe is not None)
    src = gen.generate()
    host = HostMemory(device)
    g = dict(src.globals)
    g["_host"] = host
    g["_probe"] = probe
    exec(compile(src.source, f"<remat apply {graph.name}>", "exec"), g)  # our generated source

    loss_name = f"v_{ident(cap.loss_value)}"
    reads_loss = any(
        cap.loss_value in graph.node(s.id).inputs for s in plan.steps[cut:] if s.op == "compute"
    )
    roles = cap.output_roles
    index_of_grad = {name: j for j, (role, name) in enumerate(roles) if role == "grad"}
    grad_index = [
        index_of_grad.get(n, -1) if cap.requires_grad.get(n, True) else -1 for n in cap.param_names
    ]
    grad_index += [-1] * (len(cap.buffer_names) + cap.num_inputs)
    tangent = cap.joint.graph.find_nodes(op="placeholder")[-1].meta["val"]
    return PlannedStep(
        capture=cap,
        plan=plan,
        simulation=sim,
        source=src.source,
        host=host,
        grad_index=grad_index,
        loss_name=loss_name,
        backward_reads_loss=reads_loss,
        tangent_shape=tuple(tangent.shape),
        tangent_stride=tuple(tangent.stride()),
        cut=cut,
        _fwd=g["_remat_step"],
        _bwd=g["_remat_bwd"],
    )


def _no_autocast() -> Any:
    """The plan's ops are the traced ones (casts included): autocast must not cast again."""
    return torch.autocast("cpu", enabled=False)


class _PlanFunction(torch.autograd.Function):
    """``forward``: the plan up to the loss; ``backward``: the rest, gradients to autograd."""

    @staticmethod
    def forward(ctx: Any, step: PlannedStep, *primals: torch.Tensor) -> Any:
        with torch.no_grad(), _no_autocast():
            (loss, *others), env = step._fwd(*primals)
        if step.backward_reads_loss:
            ctx.save_for_backward(env.pop(step.loss_name))
        else:
            env.pop(step.loss_name, None)  # the output: held by autograd, not by the context
        ctx.step = step
        ctx.env = env
        if not others:
            return loss
        # The returned outputs (return_outputs=True): new tensor objects on the plan's
        # storages (the context's variables must not carry this node's grad_fn: a cycle);
        # a gradient that reaches them is refused in backward, not dropped.
        ctx.set_materialize_grads(False)
        return (loss, *(t.detach() for t in others))

    @staticmethod
    def backward(ctx: Any, grad: Any, *others: Any) -> tuple[torch.Tensor | None, ...]:
        step: PlannedStep = ctx.step
        if grad is None or any(g is not None for g in others):
            raise ExecutorError(
                "the loss being backpropagated reads the model's returned outputs (its logits), "
                "and remat's planned backward takes only the gradient of the model's own loss: "
                "backpropagate the output's .loss, or plan a loss of your own with "
                "loss_fn= (or call the model without labels, so that the step ends at its "
                "output and your loss's gradient flows into the plan)"
            )
        env = ctx.env
        if env is None:
            raise ExecutorError(
                "remat.apply's planned backward runs once per forward (the plan frees what it "
                "used): retain_graph=True and a second backward are not supported"
            )
        ctx.env = None
        if step.backward_reads_loss:
            env[step.loss_name] = ctx.saved_tensors[0]
        if tuple(grad.shape) != step.tangent_shape:
            raise ExecutorError(
                f"the gradient of the step's output has shape {tuple(grad.shape)}, the step was "
                f"traced with {step.tangent_shape}"
            )
        if tuple(grad.stride()) != step.tangent_stride and grad.numel() > 1:
            # The layout the step was traced with (aot_autograd's tangent: contiguous, or the
            # output's own layout), so that the backward ops run as traced.
            laid = torch.empty_strided(
                step.tangent_shape, step.tangent_stride, dtype=grad.dtype, device=grad.device
            )
            grad = laid.copy_(grad)
        with torch.no_grad(), _no_autocast():
            outs = step._bwd(env, grad)
        grads = tuple(outs[j] if j >= 0 else None for j in step.grad_index)
        del outs
        return (None, *grads)


@dataclass
class _Applied:
    """What :func:`apply` attached to the model (``model._remat_applied``)."""

    mode: str
    result: Any
    loss_fn: LossFn | None
    graph: Graph | None
    replan: Replan | None
    original_forward: Any
    steps: dict[tuple[Any, ...], PlannedStep] = field(default_factory=dict)
    capturing: bool = False
    first: tuple[Any, ...] | None = None
    """Signature the given plan is bound to (set by the first capture)."""
    capture: Any = None
    """A capture given to :func:`apply`, used for the first signature."""
    return_outputs: bool = False
    forward: Any = None
    """The forward :func:`apply` installed (what the capture calls the model through)."""


def _check_graph(expected: Graph | None, result: Any, cap: Any, sim: Simulation) -> None:
    """The captured graph must be the one the plan was solved on (same shapes and sizes)."""
    graph: Graph = cap.graph
    same = expected is None or (
        [n.id for n in expected.nodes] == [n.id for n in graph.nodes]
        and [(v.id, v.size_bytes) for v in expected.values]
        == [(v.id, v.size_bytes) for v in graph.values]
    )
    if not same:
        assert expected is not None
        raise ExecutorError(
            f"this call's step ({graph.num_nodes} nodes) is not the graph the plan was "
            f"solved on ({expected.num_nodes} nodes): trace the same model, inputs and "
            "loss_fn"
        )
    figures = getattr(result, "figures", None)
    predicted = getattr(figures, "peak_bytes", None) if figures is not None else None
    if predicted is None and not isinstance(result, Plan):
        predicted = getattr(result, "peak_bytes", None)
    # With offloads the result's peak depends on the host link it was solved for.
    offloads = sim.offload_bytes > 0
    if isinstance(predicted, int) and not offloads and predicted != sim.peak_bytes:
        raise ExecutorError(
            f"the plan was solved for another step: on this call's inputs it peaks at "
            f"{sim.peak_bytes} bytes, the result says {predicted}. Trace and solve for these "
            "inputs"
        )


def check_applicable(
    model: nn.Module, graph: Graph, loss_fn: LossFn | None, *, loss: bool = True
) -> None:
    """What :func:`apply` can tell before any step that its plan is not for this model: the
    parameters' shapes are not the graph's (another model or config), or (with ``loss``, for
    the op-level executor, which runs the loss itself) the ``loss_fn`` differs from the
    trace's (a graph traced with one applied without, or the reverse).

    Raises
    ------
    ExecutorError
        Naming the mismatch and the fix.
    """
    traced = graph.traced_with_loss_fn
    if loss and traced is not None and traced != (loss_fn is not None):
        if traced:
            raise ExecutorError(
                f"the plan was solved on a step traced with a loss_fn (graph {graph.name!r}), "
                "and remat.apply was given none: pass the same loss_fn= to remat.apply, or "
                "trace and solve without one (forward then returns the model's output)"
            )
        raise ExecutorError(
            f"the plan was solved on a step traced without a loss_fn (graph {graph.name!r}), "
            "and remat.apply was given one: trace with that loss_fn (remat.trace(model, "
            "inputs, loss_fn)) and solve again, or apply without it"
        )
    planned = Counter(v.shape for v in graph.values if v.kind == "param" and v.shape)
    if not planned:
        return  # a hand-built graph without shapes: the first capture checks the step
    mine = Counter(tuple(p.shape) for p in model.parameters())
    if mine != planned:
        only_graph = sorted((planned - mine).elements())[:3]
        only_model = sorted((mine - planned).elements())[:3]
        raise ExecutorError(
            f"the plan was solved on another model: the graph {graph.name!r} has "
            f"{planned.total()} parameters, this {type(model).__name__} {mine.total()}; "
            f"shapes only in the graph {only_graph}, only in the model {only_model}. Trace "
            "and solve this model"
        )


def _capturing(applied: _Applied, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Capture with the unmodified forward, outside any dispatch mode of the caller (a memory
    tracker must not see the capture's fake tensors)."""
    from torch.utils._python_dispatch import _disable_current_modes

    model = args[0]
    applied.capturing = True
    try:
        with _disable_current_modes(), forward_for_capture(model, applied.forward):
            return fn(*args, **kwargs)
    finally:
        applied.capturing = False


def _planned(
    model: nn.Module, applied: _Applied, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> PlannedStep:
    sig = signature(args, kwargs)
    step = applied.steps.get(sig)
    if step is not None:
        return step
    inputs = example(args, kwargs)
    if applied.first is None and applied.result is not None:
        plan = plan_to_run(applied.result)
        cap = applied.capture
        applied.capture = None
        if cap is None:
            cap = _capturing(
                applied, capture_for, model, inputs, applied.loss_fn, plan=plan,
                return_outputs=applied.return_outputs,
            )  # fmt: skip
        params = list(model.parameters())
        device = params[0].device if params else torch.device("cpu")
        step = _compile(cap, plan, device)
        _check_graph(applied.graph, applied.result, cap, step.simulation)
        applied.first = sig
    elif applied.replan is not None:
        from remat.tracer import trace_capture

        cap = _capturing(
            applied, trace_capture, model, inputs, applied.loss_fn,
            return_outputs=applied.return_outputs,
        )  # fmt: skip
        result = applied.replan(cap.graph)
        params = list(model.parameters())
        device = params[0].device if params else torch.device("cpu")
        step = _compile(cap, plan_to_run(result), device)
    else:
        assert applied.first is not None
        raise ExecutorError(
            "remat.apply's plan was made for inputs "
            f"[{describe(applied.first)}]; this call has [{describe(sig)}]. Trace and solve "
            "for these inputs and apply that result, or pass replan= (e.g. "
            "replan=lambda graph: remat.solve(graph, '50%')) to plan each new shape once"
        )
    applied.steps[sig] = step
    return step


def _check_budget(result: Any, allow_over_budget: bool) -> None:
    peak, budget = getattr(result, "peak_bytes", None), getattr(result, "budget_bytes", None)
    if allow_over_budget or peak is None or budget is None or peak <= budget:
        return
    smallest = getattr(result, "min_budget_bytes", None)
    hint = f" (the smallest plan known peaks at {smallest} bytes)" if smallest else ""
    raise ExecutorError(
        f"result's plan peaks at {peak} bytes, over its budget of {budget} bytes "
        f"(status {getattr(result, 'status', None)!r}){hint}: solve with a larger budget, or "
        "pass allow_over_budget=True to run it anyway"
    )


def apply(
    model: nn.Module,
    result: Any,
    graph: Graph | None = None,
    *,
    example_inputs: Any = None,
    loss_fn: LossFn | None = None,
    replan: Replan | None = None,
    mode: str = "op",
    capture: Any = None,
    allow_over_budget: bool = False,
    return_outputs: bool = False,
) -> nn.Module:
    """Make ``model``'s training forward and backward run ``result``'s plan.

    ``mode="op"`` (default): op by op inside autograd (see the module docstring).
    ``mode="checkpoint"``: the model's own modules in ``torch.utils.checkpoint`` regions
    (:func:`remat.executor.module.apply_checkpoint`), for plans of that class only.
    Returns ``model`` itself (its ``forward`` replaced on the instance);
    :func:`remat.executor.remove` undoes it.

    Parameters
    ----------
    model
        The model the plan was solved for.
    result
        A solve result with a plan, or a :class:`~remat.ir.Plan`; None with ``replan``:
        every input signature is then planned at its first call (``remat.enable``), in either
        mode (checkpoint mode: :mod:`remat.executor.checkpoint_calls`).
    graph
        The graph the plan was solved on; when given, the captured step must equal it. By
        default the one the result was solved on (``result.graph``: ``remat.solve`` attaches
        it), so a model, a ``loss_fn`` or shapes other than the traced ones are reported here,
        not at the first backward.
    example_inputs
        Capture now instead of at the first call.
    loss_fn
        The ``loss_fn`` the graph was traced with; ``forward`` then returns the loss.
    replan
        ``replan(graph) -> result``, called once per new input signature.
    capture
        A :class:`remat.tracer.Capture` of this step (with ``example_inputs``), to skip
        capturing again.
    allow_over_budget
        Run a result whose plan peaks above its budget (an ``infeasible`` answer carries the
        smallest plan found). By default such a result is refused with an
        :class:`ExecutorError` naming both figures, so that a step never runs over the budget
        it was planned for without the caller asking.
    return_outputs
        For a model that returns its own loss in a ``ModelOutput`` (no ``loss_fn``): the
        training ``forward`` returns the output's other tensors too (a transformers model's
        logits), bit for bit the unmodified model's, and every plan holds them until the
        backward part begins, as the returning forward does (the graph must be traced with
        ``return_outputs=True`` too). They carry no gradient path: backpropagating a loss
        computed on them raises :class:`ExecutorError` in backward (none is silently dropped).
        Off by default (they are then None): the training loops (``Trainer``, Accelerate,
        Lightning) read only the loss, and holding the logits costs their size at the
        forward's end, where the step's memory is high.
        In checkpoint mode the model's own output is always returned; with ``replan``
        (``remat.enable``), ``return_outputs=True`` traces each signature with that output
        kept until the backward, so the plan counts it
        (:func:`remat.executor.checkpoint_calls.apply_checkpoint_per_call`); given a result
        it is refused (the graph the result was solved on decides what it counts).
    """
    from remat.executor.module import apply_checkpoint, remove

    _check_budget(result, allow_over_budget)
    if graph is None and isinstance(result, SolveResult):
        graph = result.graph
    if graph is not None:
        # checkpoint mode runs the model's own forward; the caller's loop computes the loss
        check_applicable(model, graph, loss_fn, loss=mode == "op")
    if mode == "checkpoint":
        if result is None and replan is not None:
            from remat.executor.checkpoint_calls import apply_checkpoint_per_call

            return apply_checkpoint_per_call(
                model, replan, loss_fn=loss_fn, return_outputs=return_outputs
            )
        if return_outputs:
            raise ExecutorError(
                "remat.apply(mode='checkpoint') runs the model's own forward, which always "
                "returns its output; return_outputs=True has no effect given a result (its "
                "graph decides what the plan counts): to plan a loop that keeps the output "
                "through its backward, use remat.enable(model, budget, mode='checkpoint', "
                "return_outputs=True)"
            )
        return apply_checkpoint(
            model, result, graph, example_inputs=example_inputs, loss_fn=loss_fn
        )
    if mode != "op":
        raise ValueError(f"mode must be 'op' or 'checkpoint', got {mode!r}")
    if result is None:
        if replan is None:
            raise ExecutorError("remat.apply needs a result, or replan= to plan each call")
    else:
        plan_to_run(result)

    if getattr(model, "_remat_applied", None) is not None:
        remove(model)
    original = model.__dict__.get("forward")
    unmodified = model.forward
    applied = _Applied(
        "op", result, loss_fn, graph, replan, original, return_outputs=return_outputs
    )
    if capture is not None:
        if example_inputs is None:
            raise ValueError("apply(capture=...) needs the example_inputs it was captured with")
        applied.capture = capture

    @functools.wraps(unmodified)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if applied.capturing or not (model.training and torch.is_grad_enabled()):
            return unmodified(*args, **kwargs)
        step = _planned(model, applied, args, kwargs)
        primals = step.capture.primals(model, example(args, kwargs))
        out = _PlanFunction.apply(step, *primals)
        around = step.capture.output or step.capture.returned
        if around is None:
            return out
        if step.capture.returned_fx:
            return around.rebuild(out[0], out[1:])
        return around.rebuild(out)

    applied.forward = forward
    if example_inputs is not None:
        args_, kwargs_ = (
            ((), dict(example_inputs))
            if isinstance(example_inputs, dict)
            else (tuple(example_inputs), {})
            if isinstance(example_inputs, (tuple, list))
            else ((example_inputs,), {})
        )
        _planned(model, applied, args_, kwargs_)
    model.forward = forward
    model._remat_applied = applied  # type: ignore[assignment]
    return model


def planned_steps(model: nn.Module) -> list[PlannedStep]:
    """The compiled steps of a model given to :func:`apply` (one per input signature)."""
    applied = getattr(model, "_remat_applied", None)
    if not isinstance(applied, _Applied):
        return []
    return list(applied.steps.values())


def probe_steps(model: nn.Module, probe: Callable[[int], None] | None) -> None:
    """Compile the planned steps of a model given to :func:`apply` again, calling
    ``probe(i)`` after the plan's step ``i`` runs (None: without a probe, as :func:`apply`
    compiles them). For timing or memory checks per plan step (``benchmarks/trainers.py
    --breakdown``): the probe's own calls cost time, so time a probed step only for its
    shares, never as the step's time. Steps captured later are compiled without it.
    """
    applied = getattr(model, "_remat_applied", None)
    if not isinstance(applied, _Applied):
        raise ExecutorError("probe_steps needs a model given to remat.apply (mode='op')")
    for sig, step in applied.steps.items():
        params = list(model.parameters())
        device = params[0].device if params else torch.device("cpu")
        applied.steps[sig] = _compile(step.capture, step.plan, device, probe)


__all__ = ["PlannedStep", "apply", "planned_steps", "probe_steps"]
