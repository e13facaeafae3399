"""The op-level executor's code generator: one plan over one capture, as Python source.

:class:`CodeGen` writes the function that :func:`remat.executor.opexec.compile_step` runs (and,
cut in two at :func:`remat.executor.opexec.forward_cut`, the forward and backward parts that
:func:`remat.apply` runs inside autograd): one ATen call per ``compute``, ``del`` per ``free``,
host copies per ``offload`` and ``prefetch``, generator state replayed for reruns of random ops.
See :mod:`remat.executor.opexec` for what each step becomes.
"""

from __future__ import annotations

import keyword
import math
import re
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from remat.executor.errors import ExecutorError
from remat.executor.hostmem import wait
from remat.ir import Graph, Plan


def ident(vid: str) -> str:
    """A Python identifier for an IR value id (the generated code's ``v_<id>`` variables)."""
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


class CodeGen:
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
            return f"v_{ident(vid)}"
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
        args = ", ".join(f"v_{ident(v)}" for v in arg_values)
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
                        lines.append(f"    _wait(e_{ident(x)}); e_{ident(x)} = None")
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
                    lines.append("    del " + ", ".join(f"v_{ident(o)}" for o in present))
                resident.update(node.outputs)
                if s.id in replay:
                    st = f"rng_{ident(s.id)}"
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
                            f"    v_{ident(old)}.copy_({self.expr(cap.value_fx[o])}); "
                            f"v_{ident(o)} = v_{ident(old)}  # buffer {bname}"
                        )
            elif s.op == "free":
                lines.append(f"    del v_{ident(s.id)}")
                resident.discard(s.id)
            elif s.op == "offload":
                resident.discard(s.id)
                v = ident(s.id)
                if s.id in prefetched:
                    lines.append(f"    del v_{v}  # offload: the host copy is still valid")
                elif last_prefetch.get(s.id, -1) < i:
                    lines.append(f"    del v_{v}  # offload: never prefetched, no copy needed")
                else:
                    lines.append(f"    h_{v} = _host.offload(v_{v}); del v_{v}")
                prefetched.setdefault(s.id, 0)
            elif s.op == "prefetch":
                resident.add(s.id)
                v = ident(s.id)
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
            lines.append(f"    v_{ident(old)}.copy_({self.expr(cap.value_fx[o])})")
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

        ``_remat_fwd(*primals)`` runs the steps before the cut and returns ``[loss, *the
        capture's returned_fx tensors]`` and a dict
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
        returned = [self.expr(n) for n in getattr(self.cap, "returned_fx", ())]
        fwd.append(f"    _out = [{', '.join([self.expr(loss_fx), *returned])}]")
        fwd.append("    _env = dict(locals()); del _env['_out']")
        fwd.append("    return _out, _env")
        tangent = f"v_{ident(self.cap.tangent_value)}"
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
            self.lines.append(f"    v_{ident(o)} = {call}")
            return
        self.lines.append(f"    _t = {call}")
        for o in node.outputs:
            base = self.cap.value_fx[o]
            if base is fx:  # "n#i": an element that no getitem names
                idx = int(o.rsplit("#", 1)[1])
            else:
                idx = int(base.args[1])
            self.lines.append(f"    v_{ident(o)} = _t[{idx}]")
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
            src = f"v_{ident(buffers[idx])}" if idx in buffers else f"_t[{idx}]"
            self.lines.append(f"    v_{ident(o)} = {src}")
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


def _get_attr(gm: torch.fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
