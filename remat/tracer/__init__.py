"""PyTorch model -> costed :class:`remat.ir.Graph` (the only part of remat, with the executor,
that imports torch).

Public API
----------
``trace(model, example_inputs, loss_fn=None, *, cost=None, optimizer=None,
require_real=False, target=None)``
    One training step as a validated, costed ``Graph``. ``cost`` is None (default: the
    roofline of the target device, the measured local CPU unless ``target`` names a GPU
    profile), ``"measure"``, ``"flops"``, a :class:`~remat.ir.DeviceProfile` or a profile name
    (``"cpu"``, ``"a100"``, ``"h100"``, ``"h200"``). ``target="cuda"`` (or a GPU profile name)
    mirrors the CUDA eager step (fused dropout and attention) to plan a GPU's memory; the
    default mirrors the CPU step that the executors run.
``trace_spec("MODULE:FUNCTION", *, cost=...)``
    Imports ``MODULE`` (dotted name or ``.py`` path), calls ``FUNCTION()``, which returns
    ``(model, example_inputs)`` or ``(model, example_inputs, loss_fn)``, and traces it. The CLI's
    ``remat trace`` and ``remat check`` use it. ``load_spec`` does the loading alone.
``capture(model, example_inputs, loss_fn=None, *, require_real=False, target="cpu") -> Capture``
    The lower level, for the op-level executor: the functional joint FX graph and the IR graph
    (FLOPs, no times) with the maps between them. ``trace_capture(...)`` returns a ``Capture``
    whose ``graph`` is costed like ``trace``'s.
``cpu_profile()``
    This CPU's measured :class:`~remat.ir.DeviceProfile`, cached under ``~/.cache/remat``.
``TraceError``
    Raised when a model cannot be traced; names the op and the module.

The ``Capture`` object (stable API)
-----------------------------------
``cap.joint`` is a ``torch.fx.GraphModule``. ``cap.run(primals, tangents)`` runs it and returns
one result per ``cap.output_roles`` entry: ``("buffer", name)`` updated buffers first, then
``("loss", "")``, then one entry per primal, ``("grad", param name)`` or ``("none", "")``.
``primals = cap.primals(model, example_inputs)`` are the parameters in ``cap.param_names``
order, the buffers in ``cap.buffer_names`` order, then the flattened tensor inputs (a dict of
keyword inputs is accepted); ``tangents = [torch.ones((), dtype=loss dtype)]``. The graph is
functional: buffer updates are returned, not applied (copy them into the buffers to reproduce
the eager step). Run on real tensors it gives the eager step's loss and gradients bit for bit
on the CPU, dropout included (same seed), because dropout is traced as eager CPU runs it.

IR <-> FX maps: ``cap.node_fx[node_id]`` is the FX node an IR node runs (IR node ids and names
are FX node names). ``cap.value_fx[value_id]`` is the FX node whose result is the base tensor
of that storage (a ``getitem`` for an element of a tuple-returning op; a placeholder for
params, buffers, inputs and the tangent; a ``get_attr`` for constants); a value that no FX node
names alone (an unused element ``i`` of a multi-output op ``n``) has id ``"n#i"``.
``cap.value_aliases[value_id]`` lists every FX node whose tensor lives in that storage (views
included); ``cap.fx_value[fx_name]`` goes the other way. ``cap.param_values``,
``cap.buffer_values``, ``cap.input_values``, ``cap.tangent_value``, ``cap.loss_value``,
``cap.grad_values`` (parameter name -> gradient value) and ``cap.buffer_updates`` (buffer name ->
updated value, made by a node with ``recomputable=False``) name the special values.

An IR node's ``inputs`` are the storages its FX node reads (views resolved to their base),
plus, for the last op of a backward autograd node spelled as several ops (same ``seq_nr``), the
dynamic values the earlier ops of that autograd node read: eager autograd holds them until the
whole node has run, and so does the IR. Executors must keep those on the device for that op
but pass the FX node only its own arguments.

Memory rules are those of ``remat.ir.graph``; :func:`remat.executor.measure` measures a real
step with the same definitions (see ``remat.executor.measure``), and the simulator's eager peak
matches it (tested on every example model).
"""

from remat.tracer.capture import Capture, TraceError, capture
from remat.tracer.costs import resolve_cost
from remat.tracer.flops import EXTRA_FLOP_FORMULAS, node_flops, register_flop_formula
from remat.tracer.profile import cpu_profile, measure_cpu_profile
from remat.tracer.trace import (
    load_spec,
    optimizer_state_bytes,
    trace,
    trace_capture,
    trace_spec,
)

__all__ = [
    "EXTRA_FLOP_FORMULAS",
    "Capture",
    "TraceError",
    "capture",
    "cpu_profile",
    "load_spec",
    "measure_cpu_profile",
    "node_flops",
    "optimizer_state_bytes",
    "register_flop_formula",
    "resolve_cost",
    "trace",
    "trace_capture",
    "trace_spec",
]
