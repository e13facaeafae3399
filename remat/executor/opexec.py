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

import keyword
import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils import _pytree as pytree

from remat.executor.hostmem import HostMemory, wait
from remat.ir import Graph, InvalidPlanError, Plan, RematError, SolveResult, simulate
from remat.ir.simulate import Simulation

LossFn = Callable[[Any], torch.Tensor]


class ExecutorError(RematError, ValueError):
    """A plan cannot be run on this model (the message says why and what to do)."""


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


def _ident(vid: str) -> str:
    s = re.sub(r"\W", "_", vid)
    if not s or s[0].isdigit() or keyword.iskeyword(s):
        s = "_" + s
    return s


@dataclass
class StepSource:
    """The generated function's source and the globals it runs with."""

    source: str
    globals: dict[str, Any]
    arg_values: list[str]
    """IR value id of each positional argument (primals in capture order, then the tangent)."""
    output_exprs: list[str]


class _CodeGen:
    """Generates the step function of one plan over one capture."""

    def __init__(
        self,
        cap: Any,
        plan: Plan,
        device: torch.device,
        *,
        probe: bool = False,
        cut: int | None = None,
    ) -> None:
        self.cap = cap
        self.probe = probe
        self.cut = cut
        """With a cut, two functions: the plan's steps before index ``cut`` (see
        :func:`forward_cut`) and those from it on (see :meth:`split`)."""
        self.graph: Graph = cap.graph
        self.plan = plan
        self.device = device
        self.globals: dict[str, Any] = {
            "torch": torch,
            "_host": None,  # bound per compiled step
            "_wait": wait,
        }
        self._const_ids: dict[int, str] = {}
        self.lines: list[str] = []
        base_of: dict[str, str] = {}
        for vid, fx in cap.value_fx.items():
            base_of[fx.name] = vid
        self.base_of = base_of  # FX name -> value id, for FX nodes that are a storage's base

    # -- literals and expressions -------------------------------------------------------------

    def const(self, x: Any) -> str:
        if x is None or isinstance(x, (bool, int, str)):
            return repr(x)
        if isinstance(x, float) and math.isfinite(x):
            return repr(x)
        if isinstance(x, torch.device) and x.type == "cpu" and self.device.type != "cpu":
            x = self.device
        if isinstance(x, torch.Tensor):
            x = x.to(self.device)
        key = id(x)
        name = self._const_ids.get(key)
        if name is None:
            name = f"k_{len(self._const_ids)}"
            self._const_ids[key] = name
            self.globals[name] = x
        return name

    def arg(self, a: Any) -> str:
        if isinstance(a, torch.fx.Node):
            return self.expr(a)
        if isinstance(a, (list, tuple)):
            inner = ", ".join(self.arg(x) for x in a)
            if isinstance(a, tuple):
                return f"({inner},)" if len(a) == 1 else f"({inner})"
            return f"[{inner}]"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{k!r}: {self.arg(v)}" for k, v in a.items()) + "}"
        return self.const(a)

    def call(self, n: torch.fx.Node) -> str:
        op = self.const(n.target)
        parts = [self.arg(a) for a in n.args]
        parts += [f"{k}={self.arg(v)}" for k, v in n.kwargs.items()]
        return f"{op}({', '.join(parts)})"

    def expr(self, n: torch.fx.Node) -> str:
        """An expression for FX node ``n``'s tensor from resident variables (views inlined)."""
        vid = self.base_of.get(n.name)
        if vid is not None and n.op in ("placeholder", "call_function"):
            return f"v_{_ident(vid)}"
        if n.op == "get_attr":
            return self.const(_get_attr(self.cap.joint, str(n.target)))
        if n.op != "call_function":
            raise ExecutorError(f"cannot express FX node {n.name!r} ({n.op})")
        if n.name in self.cap.node_fx:
            raise ExecutorError(
                f"FX node {n.name!r} is an op that makes new storage read as a whole; "
                "the op-level executor cannot re-derive it"
            )
        if n.target is _getitem:
            src = n.args[0]
            assert isinstance(src, torch.fx.Node)
            if src.name in self.cap.node_fx:
                raise ExecutorError(
                    f"element {n.args[1]} of op {src.name!r} aliases one of its inputs; "
                    "the op-level executor does not support such ops yet"
                )
            return f"{self.expr(src)}[{n.args[1]!r}]"
        return self.call(n)

    # -- the function -----------------------------------------------------------------------

    def generate(self) -> StepSource:
        cap, graph = self.cap, self.graph
        placeholders = [n for n in cap.joint.graph.nodes if n.op == "placeholder"]
        arg_values = [cap.fx_value[p.name] for p in placeholders]
        if self.cut is not None:  # the tangent is the backward function's argument
            arg_values = [v for v in arg_values if v != cap.tangent_value]
        args = ", ".join(f"v_{_ident(v)}" for v in arg_values)
        out = self.lines

        # Which random nodes are computed more than once: save their generator state.
        counts = self.plan.compute_counts()
        replay = self._replayed(counts)
        first_rng = list(
            dict.fromkeys(
                s.id for s in self.plan.steps if s.op == "compute" and graph.node(s.id).rng
            )
        )
        graph_rng = [n.id for n in graph.nodes if n.rng and n.id in counts]
        if first_rng != graph_rng:
            warnings.warn(
                "the plan computes random ops for the first time in another order than the "
                "eager step: gradients are exact for the numbers drawn, but those numbers differ "
                "from the unmodified model's",
                stacklevel=3,
            )

        # Buffer updates: copied into the buffer right after the op that makes them, when no
        # later op reads the buffer's old value.
        buffer_of_update = {vid: name for name, vid in cap.buffer_updates.items()}
        buffer_arg = {name: cap.buffer_values[name] for name in cap.buffer_updates}

        # Last read of each value by a forward compute step. A buffer
        # is updated in place in the eager step, so backward ops there read the new value: only
        # a later forward read of the old value (a recomputation) delays the copy.
        last_fwd_read: dict[str, int] = {}
        for i, s in enumerate(self.plan.steps):
            if s.op == "compute":
                nd = graph.node(s.id)
                for x in nd.inputs:
                    if nd.phase == "forward":
                        last_fwd_read[x] = i

        done: set[str] = set()
        pending_buffers: list[tuple[str, str]] = []
        prefetched: dict[str, int] = {}
        last_prefetch: dict[str, int] = {}
        for i, s in enumerate(self.plan.steps):
            if s.op == "prefetch":
                last_prefetch[s.id] = i
        ev_pending: set[str] = set()
        lines = out
        lines.append(f"def _remat_step({args}):")
        resident: set[str] = set()  # produced values bound to a variable now
        for i, s in enumerate(self.plan.steps):
            if i == self.cut:
                lines.append(_CUT)
            if s.op == "compute":
                node = graph.node(s.id)
                fx = cap.node_fx[s.id]
                for x in node.inputs:
                    if x in ev_pending:
                        lines.append(f"    _wait(e_{_ident(x)}); e_{_ident(x)} = None")
                        ev_pending.discard(x)
                # Batch norm's new running statistics written into the buffers in place, as
                # eager does: no transient copy of them that the simulator does not count.
                in_place = self._stats_in_place(fx, i, last_fwd_read)
                call = self.call(fx)
                is_first = s.id not in done
                present = [o for o in node.outputs if o in resident]
                if present and len(present) == len(node.outputs):
                    # Every output is still on the device: the simulator allocates nothing and
                    # the recomputation would give the same tensors; skip it.
                    lines.append(f"    # recompute {s.id}: its outputs are still here, skipped")
                    if self.probe:
                        lines.append(f"    _probe({i})")
                    continue
                if present:
                    # Some outputs are still here: release them first, so that the new copies
                    # do not coexist with the old ones (the simulator counts them once).
                    lines.append("    del " + ", ".join(f"v_{_ident(o)}" for o in present))
                resident.update(node.outputs)
                if s.id in replay:
                    st = f"rng_{_ident(s.id)}"
                    get, put = self._rng_fns(fx)
                    if is_first:
                        lines.append(f"    {st} = {get}()")
                        lines.append(f"    # compute {s.id} ({node.op})")
                        self._emit_assign(fx, call)
                    else:
                        lines.append(f"    _saved = {get}(); {put}({st})")
                        lines.append(f"    # recompute {s.id} ({node.op}), same random numbers")
                        self._emit_assign(fx, call)
                        lines.append(f"    {put}(_saved); del _saved")
                elif in_place is not None:
                    lines.append(f"    # compute {s.id} ({node.op}), statistics in place")
                    self._emit_assign_in_place(fx, in_place)
                else:
                    lines.append(
                        f"    # {'compute' if is_first else 'recompute'} {s.id} ({node.op})"
                    )
                    self._emit_assign(fx, call)
                done.add(s.id)
                for o in node.outputs:
                    bname = buffer_of_update.get(o)
                    if bname is None:
                        continue
                    old = buffer_arg[bname]
                    if in_place is not None:
                        continue  # already the buffer
                    if last_fwd_read.get(old, -1) > i:
                        pending_buffers.append((old, o))
                    else:
                        # Later readers of the new value read the buffer itself, as in eager.
                        lines.append(
                            f"    v_{_ident(old)}.copy_({self.expr(cap.value_fx[o])}); "
                            f"v_{_ident(o)} = v_{_ident(old)}  # buffer {bname}"
                        )
            elif s.op == "free":
                lines.append(f"    del v_{_ident(s.id)}")
                resident.discard(s.id)
            elif s.op == "offload":
                resident.discard(s.id)
                v = _ident(s.id)
                if s.id in prefetched:
                    lines.append(f"    del v_{v}  # offload: the host copy is still valid")
                elif last_prefetch.get(s.id, -1) < i:
                    lines.append(f"    del v_{v}  # offload: never prefetched, no copy needed")
                else:
                    lines.append(f"    h_{v} = _host.offload(v_{v}); del v_{v}")
                prefetched.setdefault(s.id, 0)
            elif s.op == "prefetch":
                resident.add(s.id)
                v = _ident(s.id)
                lines.append(f"    v_{v}, e_{v} = _host.prefetch(h_{v})")
                if self.device.type == "cuda":
                    ev_pending.add(s.id)
                else:
                    lines.append(f"    del e_{v}")
                if last_prefetch[s.id] == i:
                    lines.append(f"    del h_{v}")
            if self.probe:
                lines.append(f"    _probe({i})")
        for old, o in pending_buffers:
            lines.append(f"    v_{_ident(old)}.copy_({self.expr(cap.value_fx[o])})")
        out_node = next(n for n in reversed(list(cap.joint.graph.nodes)) if n.op == "output")
        leaves = pytree.tree_leaves(out_node.args[0], is_leaf=lambda x: x is None)
        exprs: list[str] = []
        for (role, _name), a in zip(cap.output_roles, leaves, strict=True):
            if role == "loss" and self.cut is not None:
                exprs.append("None")  # returned by the forward function
            elif role in ("loss", "grad") and isinstance(a, torch.fx.Node):
                exprs.append(self.expr(a))
            else:
                exprs.append("None")
        lines.append(f"    return [{', '.join(exprs)}]")
        if self.cut is not None:
            return self._split(lines, out_node, arg_values, exprs)
        return StepSource("\n".join(lines) + "\n", self.globals, arg_values, exprs)

    def _split(
        self, lines: list[str], out_node: torch.fx.Node, arg_values: list[str], exprs: list[str]
    ) -> StepSource:
        """Two functions from one generated body, cut at the marker.

        ``_remat_fwd(*primals)`` runs the steps before the cut and returns the loss and a dict
        of every variable bound at the cut (resident values, host copies, saved generator
        states); ``_remat_bwd(env, tangent)`` takes those over (the dict is emptied, so that a
        later ``del`` releases the storage) and runs the remaining steps.
        """
        k = lines.index(_CUT)
        fwd, body = lines[:k], lines[k + 1 :]
        leaves = pytree.tree_leaves(out_node.args[0], is_leaf=lambda x: x is None)
        loss_fx = next(
            a for (role, _), a in zip(self.cap.output_roles, leaves, strict=True) if role == "loss"
        )
        fwd.append(f"    _out = {self.expr(loss_fx)}")
        fwd.append("    _env = dict(locals()); del _env['_out']")
        fwd.append("    return _out, _env")
        tangent = f"v_{_ident(self.cap.tangent_value)}"
        names = sorted(set(re.findall(r"\b(?:v|h|e|rng)_\w+", "\n".join(fwd))) - {tangent})
        if re.search(rf"\b{tangent}\b", "\n".join(fwd)):
            raise ExecutorError("internal: the forward part of the plan reads the loss's gradient")
        bwd = [f"def _remat_bwd(_env, {tangent}):"]
        bwd += [f"    {n} = _env.pop({n!r}, None)" for n in names]
        bwd.append("    _env.clear()")
        source = "\n".join(fwd) + "\n\n" + "\n".join(bwd + body) + "\n"
        return StepSource(source, self.globals, arg_values, exprs)

    def _replayed(self, counts: Any) -> set[str]:
        """Random nodes computed more than once: their generator state is saved and replayed."""
        graph = self.graph
        return {
            nid
            for nid, k in counts.items()
            if k > 1 and graph.has_node(nid) and graph.node(nid).rng
        }

    def _emit_assign(self, fx: torch.fx.Node, call: str) -> None:
        node = self.graph.node(fx.name)
        val = fx.meta.get("val")
        if isinstance(val, torch.Tensor):
            (o,) = node.outputs
            self.lines.append(f"    v_{_ident(o)} = {call}")
            return
        self.lines.append(f"    _t = {call}")
        for o in node.outputs:
            base = self.cap.value_fx[o]
            if base is fx:  # "n#i": an element that no getitem names
                idx = int(o.rsplit("#", 1)[1])
            else:
                idx = int(base.args[1])
            self.lines.append(f"    v_{_ident(o)} = _t[{idx}]")
        self.lines.append("    del _t")

    def _stats_in_place(
        self, fx: torch.fx.Node, step: int, last_fwd_read: dict[str, int]
    ) -> dict[int, str] | None:
        """For a functional batch norm whose new running statistics (elements 3 and 4) are
        buffer updates that no later forward step reads the old values of: element index ->
        the buffer's value id. None otherwise."""
        if fx.target is not _BN_FUNCTIONAL:
            return None
        cap = self.cap
        update_of = {vid: name for name, vid in cap.buffer_updates.items()}
        node = self.graph.node(fx.name)
        out: dict[int, str] = {}
        for o in node.outputs:
            base = cap.value_fx[o]
            if base is fx or o not in update_of:
                continue
            idx = int(base.args[1])
            buf = cap.buffer_values[update_of[o]]
            arg = fx.args[idx]  # running_mean is argument 3, running_var argument 4
            if not isinstance(arg, torch.fx.Node) or cap.fx_value.get(arg.name) != buf:
                return None
            if last_fwd_read.get(buf, -1) > step:
                return None
            out[idx] = buf
        return out if sorted(out) == [3, 4] else None

    def _emit_assign_in_place(self, fx: torch.fx.Node, buffers: dict[int, str]) -> None:
        args = [self.arg(a) for a in fx.args]
        self.lines.append(f"    _t = {self.const(_BN_IN_PLACE)}({', '.join(args)})")
        for o in self.graph.node(fx.name).outputs:
            base = self.cap.value_fx[o]
            idx = int(o.rsplit("#", 1)[1]) if base is fx else int(base.args[1])
            src = f"v_{_ident(buffers[idx])}" if idx in buffers else f"_t[{idx}]"
            self.lines.append(f"    v_{_ident(o)} = {src}")
        self.lines.append("    del _t")

    def _rng_fns(self, fx: torch.fx.Node) -> tuple[str, str]:
        if self.device.type == "cuda":
            dev = self.device
            self.globals["_cuda_get_rng"] = lambda: torch.cuda.get_rng_state(dev)
            self.globals["_cuda_set_rng"] = lambda s: torch.cuda.set_rng_state(s, dev)
            return "_cuda_get_rng", "_cuda_set_rng"
        return "torch.get_rng_state", "torch.set_rng_state"


import operator  # noqa: E402

_getitem = operator.getitem
_BN_FUNCTIONAL = torch.ops.aten._native_batch_norm_legit_functional.default
_BN_IN_PLACE = torch.ops.aten._native_batch_norm_legit.default
_CUT = "    # ---- forward | backward ----"


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


def _get_attr(gm: torch.fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


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
        from remat.tracer import capture as capture_fn

        capture = capture_fn(model, example_inputs, loss_fn)
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
    gen = _CodeGen(capture, plan, device, probe=probe is not None)
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
