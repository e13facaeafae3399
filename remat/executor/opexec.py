"""The op-level executor: a plan over a captured joint graph, compiled to one Python function.

:func:`compile_step` captures the training step (:func:`remat.tracer.capture`, on fake tensors:
nothing the size of the model is allocated, so the very first real step already keeps to the
plan), checks that the plan belongs to the captured graph (:func:`remat.ir.simulate` must accept
it), and generates the source of one function that runs the plan's steps in order:

* ``compute(n)``: one call of the ATen op of FX node ``n``, assigned to the variables of the
  storages it creates (``v_<value id>``). Views are never stored: an argument that is a view is
  re-derived from its base inside the call expression, so the base's variable is the only
  reference to a storage and ``del`` releases it.
* ``free(v)``: ``del v_<v>``.
* ``offload(v)``: a host copy (:class:`remat.executor.hostmem.HostMemory`), then ``del``.
* ``prefetch(v)``: a device copy of the host copy (on a GPU, waited for before first use).

Recomputed random ops replay the random numbers of their first computation: the generator's state
is saved before the first computation of every random node that the plan computes more than
once, and set (then restored) around each recomputation. First computations run in the graph's
order, as in the eager step, so the random numbers are those of the unmodified model.

Everything runs under ``torch.no_grad()``: the joint graph holds the backward ops explicitly. At
the end, gradients go to the parameters' ``.grad`` (accumulated when one exists, as
``loss.backward()`` does), buffer updates (batch-norm running statistics) are copied into the
model's buffers as soon as they are made, and the detached loss is returned.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn

from remat.executor.codegen import CodeGen
from remat.executor.errors import ExecutorError
from remat.executor.hostmem import HostMemory
from remat.ir import Graph, InvalidPlanError, Plan, SolveResult, simulate
from remat.ir.simulate import Simulation

LossFn = Callable[[Any], torch.Tensor]


def plan_to_run(result: SolveResult | Plan) -> Plan:
    """The plan of a solve result (or the plan itself); ExecutorError when it has none."""
    if isinstance(result, Plan):
        return result
    if not isinstance(result, SolveResult):
        raise ExecutorError(f"no plan to run: expected a SolveResult or a Plan, got {result!r}")
    if result.plan is None:
        raise ExecutorError(
            f"result has no plan to run (status {result.status!r}: {result.message})"
        )
    return result.plan


def capture_for(
    model: nn.Module, example_inputs: Any, loss_fn: Any, *, plan: Plan, **kwargs: Any
) -> Any:
    """The step captured as the plan's graph was (``remat.tracer.capture``; ``kwargs`` go to
    it): with the CPU's decompositions, as ``remat.trace`` does by default, or, where the plan
    computes nodes that capture lacks, as a GPU target does (``remat.trace(...,
    target="h100")``: the GPU's fused dropout and attention kernels)."""
    from remat.tracer import capture

    computed = {s.id for s in plan.steps if s.op == "compute"}
    got = capture(model, example_inputs, loss_fn, **kwargs)
    if computed <= {n.id for n in got.graph.nodes}:
        return got
    gpu = capture(model, example_inputs, loss_fn, target="cuda", **kwargs)
    return gpu if computed <= {n.id for n in gpu.graph.nodes} else got


def simulate_traced(graph: Graph, plan: Plan) -> Simulation:
    """The simulation of ``plan`` on a model's traced ``graph`` (any host bandwidth: the
    executor's order is the plan's); an :class:`ExecutorError` when the plan is not one for
    that graph."""
    try:
        return simulate(graph, plan, host_bandwidth_bytes_per_s=math.inf)
    except InvalidPlanError as exc:
        raise ExecutorError(
            f"the plan does not fit this model's traced graph ({graph.name}, "
            f"{graph.num_nodes} nodes): {exc}. Solve on remat.trace() of the same model, inputs "
            "and loss_fn"
        ) from exc


def forward_cut(cap: Any, plan: Plan) -> int:
    """Index of the plan's first step that needs the loss's gradient (transitively): the steps
    before it form the forward part, run by ``forward``; the rest run in ``backward``.

    Raises
    ------
    ExecutorError
        When the loss is not computed before the cut (it must be returned by ``forward``).
    """
    graph: Graph = cap.graph
    tainted = {cap.tangent_value}
    needs: set[str] = set()
    for n in graph.nodes:  # topological order
        if any(x in tainted for x in n.inputs):
            needs.add(n.id)
            tainted.update(n.outputs)
    loss_node = graph.producer_of(cap.loss_value)
    for i, s in enumerate(plan.steps):
        if s.op == "compute" and s.id in needs:
            done = {t.id for t in plan.steps[:i] if t.op == "compute"}
            if loss_node is not None and loss_node.id not in done:
                raise ExecutorError(
                    f"the plan computes {s.id!r}, which needs the loss's gradient, before the "
                    f"loss ({loss_node.id!r}); remat.apply returns the loss from forward, so "
                    "the loss must come first (use remat.compile_step for this plan)"
                )
            return i
    raise ExecutorError("the plan never uses the loss's gradient: it has no backward part")


@dataclass
class CompiledStep:
    """A training step that runs one plan exactly. Call it like ``loss = step()``.

    ``step(*inputs)`` (or ``step(kwargs_dict)``) runs on new inputs of the example inputs'
    shapes (tensors that ``loss_fn`` closes over, such as targets, were captured as constants of
    the step). Gradients are left in the parameters' ``.grad``, buffers are updated, the
    detached loss is returned.
    """

    model: nn.Module
    example_inputs: Any
    capture: Any
    plan: Plan
    simulation: Simulation
    source: str
    host: HostMemory
    device: torch.device
    _fn: Callable[..., list[Any]] = field(repr=False)
    _params: dict[str, torch.Tensor] = field(repr=False)

    @property
    def graph(self) -> Graph:
        graph: Graph = self.capture.graph
        return graph

    def __call__(self, *inputs: Any) -> torch.Tensor:
        if not inputs:
            ex = self.example_inputs
        elif len(inputs) == 1 and isinstance(inputs[0], dict):
            ex = inputs[0]  # keyword inputs, as the example was given
        else:
            ex = inputs
        primals = self.capture.primals(self.model, ex)
        loss_val = self.capture.joint.graph.find_nodes(op="placeholder")[-1].meta["val"]
        tangent = torch.ones(tuple(loss_val.shape), dtype=loss_val.dtype, device=self.device)
        with torch.no_grad():
            outs = self._fn(*primals, tangent)
            loss: torch.Tensor | None = None
            for (role, name), t in zip(self.capture.output_roles, outs, strict=True):
                if role == "loss":
                    loss = t
                elif role == "grad" and t is not None and name in self.capture.grad_values:
                    p = self._params[name]
                    if p.grad is None:
                        p.grad = t
                    else:
                        p.grad += t
        del outs
        assert loss is not None
        return loss


def compile_step(
    model: nn.Module,
    example_inputs: Any,
    loss_fn: LossFn | None,
    result: SolveResult | Plan,
    *,
    capture: Any = None,
    probe: Callable[[int], None] | None = None,
) -> CompiledStep:
    """Compile the plan of ``result`` (a :class:`~remat.ir.SolveResult` or a
    :class:`~remat.ir.Plan`) into a training step of ``model``.

    Parameters
    ----------
    model, example_inputs, loss_fn
        As given to :func:`remat.trace` for the graph that the plan was solved on. The model may
        live on a GPU; it is traced as on the CPU.
    result
        The solve result (or plan) to run.
    capture
        A :class:`remat.tracer.Capture` of this step (e.g. from ``remat.tracer.trace_capture``),
        to skip capturing again.
    probe
        Called with the step's index after each plan step runs (for debugging: compare live
        memory with the simulator's ``timeline_bytes``).

    Returns
    -------
    CompiledStep
        ``step()`` runs one training step with the plan; ``step.source`` is the generated code.

    Raises
    ------
    ExecutorError
        When ``result`` has no plan, or the plan does not belong to this model's traced graph.
    """
    plan = plan_to_run(result)
    if capture is None:
        capture = capture_for(model, example_inputs, loss_fn, plan=plan)
    if getattr(capture, "output", None) is not None:
        raise ExecutorError(
            "compile_step runs a closed step that owns its loss, and this model returns an "
            "output without one: pass loss_fn, or use remat.apply (its forward returns the "
            "output, your loss's gradient flows into the plan's backward)"
        )
    graph: Graph = capture.graph
    sim = simulate_traced(graph, plan)
    params: dict[str, torch.Tensor] = dict(model.named_parameters())
    device = next(iter(params.values())).device if params else torch.device("cpu")
    gen = CodeGen(capture, plan, device, probe=probe is not None)
    src = gen.generate()
    host = HostMemory(device)
    g = dict(src.globals)
    g["_host"] = host
    g["_probe"] = probe
    code = compile(src.source, f"<remat step {graph.name}>", "exec")
    exec(code, g)  # our own generated source
    return CompiledStep(
        model=model,
        example_inputs=example_inputs,
        capture=capture,
        plan=plan,
        simulation=sim,
        source=src.source,
        host=host,
        device=device,
        _fn=g["_remat_step"],
        _params=params,
    )
