"""Cost models: the ``time_s`` of each node.

* a :class:`~remat.ir.DeviceProfile` (or its name: ``"a100"``, ``"h100"``, ``"h200"``, ``"cpu"``):
  a roofline, ``op_overhead_s + max(flops / FLOP/s, bytes moved / bandwidth)``, where bytes
  moved are the bytes of the tensors the op reads and writes, and the key that picks the rates
  (:func:`cost_key`) is the op's own name where the profile measured it (``tanh``, ``silu``,
  ...; the softmax family and layer norm, whose rates are curves over the length of the rows
  they reduce), ``bmm`` for batched matmuls (a curve of the matmul rate's share over the FLOPs
  of one product, :func:`op_size`), ``attention``/``attention_causal`` for the fused attention
  kernels (a share of the matmul rate), what ``pow`` becomes for its exponent, or else its
  class (:func:`op_class`: plain element-wise/copy, element-wise with a strided or broadcast
  operand, transcendental, softmax, reduction, normalisation, random draw). No op that moves
  bytes costs zero. :func:`node_time_s` prices one node. The default of :func:`remat.trace`
  (``cost=None``) is the roofline of the device the step targets: the measured local CPU for
  ``target="cpu"``.
* ``"measure"``: each node runs on the local device (real tensors, the joint graph executed
  once node by node); its time is the median of ``repeats`` timed calls of the op itself, after
  one untimed warm-up call. The graph carries the measured CPU profile (for the host-link
  bandwidth).
* ``"flops"``: FLOPs alone, expressed in seconds at a nominal 1 TFLOP/s (``time_s = flops *
  1e-12``); ops that torch's counter gives 0 FLOPs (element-wise, views, copies) cost 0, so
  plans may recompute them for free. Kept for FLOP-only comparisons, never the default.

Ops are timed on :func:`~remat.tracer.profile.op_clock` (with one torch thread on a CPU, the
thread's CPU time). The local CPU's profile is :func:`remat.tracer.profile.cpu_profile`.
"""

from __future__ import annotations

import math
import operator
import statistics
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from remat.ir import DeviceProfile, Graph
from remat.ir.devices import get_profile, roofline_time_s
from remat.tracer.capture import Capture, TraceError
from remat.tracer.profile import _OP_PROBES, cpu_profile, op_clock

FLOPS_SECONDS_PER_FLOP = 1e-12

Cost = str | DeviceProfile

# ATen op names (without "aten." and the overload) of each memory-bound class whose effective
# bandwidth differs from a plain element-wise op's. Anything else that does no FLOPs is
# "elementwise" (adds, copies, clones, concatenations, materialised views).
OP_CLASSES: dict[str, frozenset[str]] = {
    "random": frozenset(
        {
            "bernoulli",
            "native_dropout",
            "rand",
            "rand_like",
            "randn",
            "randn_like",
            "uniform",
            "normal",
            "randint",
            "randint_like",
            "randperm",
            "multinomial",
            "exponential",
        }
    ),
    "softmax": frozenset(
        {
            "_softmax",
            "_safe_softmax",
            "_log_softmax",
            "_softmax_backward_data",
            "_log_softmax_backward_data",
            "softmax",
            "log_softmax",
            "logsumexp",
        }
    ),
    "reduction": frozenset(
        {
            "sum",
            "mean",
            "amax",
            "amin",
            "max",
            "min",
            "var",
            "std",
            "var_mean",
            "prod",
            "linalg_vector_norm",
            "norm",
            "argmax",
            "argmin",
            "any",
            "all",
        }
    ),
    "norm": frozenset(
        {
            "native_layer_norm",
            "native_layer_norm_backward",
            "native_batch_norm",
            "native_batch_norm_backward",
            "_native_batch_norm_legit",
            "_native_batch_norm_legit_functional",
            "_native_batch_norm_legit_no_training",
            "native_group_norm",
            "native_group_norm_backward",
            "_fused_rms_norm",
            "_fused_rms_norm_backward",
        }
    ),
    "transcendental": frozenset(
        {
            "exp",
            "exp2",
            "expm1",
            "log",
            "log1p",
            "log2",
            "tanh",
            "tanh_backward",
            "sigmoid",
            "sigmoid_backward",
            "gelu",
            "gelu_backward",
            "silu",
            "silu_backward",
            "erf",
            "erfinv",
            "pow",
            "rsqrt",
            "sqrt",
            "sin",
            "cos",
            "mish",
            "mish_backward",
            "softplus",
            "softplus_backward",
            "elu",
            "elu_backward",
            "hardswish",
            "hardswish_backward",
            "logit",
            "reciprocal",
        }
    ),
}
_CLASS_OF = {name: cls for cls, names in OP_CLASSES.items() for name in names}


def op_class(op: str) -> str:
    """The memory-bound class of an IR op name such as ``"aten.gelu.default"``."""
    base = op.removeprefix("aten.").split(".", 1)[0]
    return _CLASS_OF.get(base, "elementwise")


def cost_key(fx: torch.fx.Node, profile: DeviceProfile) -> str:
    """The key of ``profile`` that prices FX node ``fx``: the op's own name where the profile
    measured it (a figure or a curve), ``"bmm"`` for batched matmuls where the profile has
    their curve, ``"attention"``/``"attention_causal"`` for the fused attention kernels, what
    ``pow`` turns into for its exponent, else the op's class (:func:`op_class`)."""
    name = str(fx.target).removeprefix("aten.")
    base = name.split(".", 1)[0]
    measured = profile.op_bandwidth_bytes_per_s
    if base in _ATTENTION_OPS:
        at = 7 if base.endswith("_backward") else 4  # the position of is_causal
        causal = fx.args[at] if len(fx.args) > at else fx.kwargs.get("is_causal", False)
        return "attention_causal" if causal else "attention"
    if base == "pow" and len(fx.args) == 2 and isinstance(fx.args[1], (int, float)):
        as_ = _POW_AS.get(float(fx.args[1]), "pow")
        return as_ if as_ in measured or as_ == "elementwise" else op_class(f"aten.{base}")
    if base in ("bmm", "baddbmm") and "bmm" in profile.op_efficiency_curves:
        return "bmm"
    if (base in _OP_PROBES and base in measured) or base in profile.op_bandwidth_curves:
        return base
    cls = op_class(f"aten.{name}")
    if cls == "elementwise" and "elementwise_strided" in measured and _strided(fx):
        return "elementwise_strided"
    return cls


def op_size(fx: torch.fx.Node, key: str) -> float | None:
    """The size that picks the rate on the profile's curve of ``key`` for FX node ``fx``: the
    FLOPs of one product of a batched matmul (``"bmm"``), the length of the rows a softmax or
    layer norm reduces; None for other ops (or when the shapes are not known)."""
    base = str(fx.target).removeprefix("aten.").split(".", 1)[0]
    try:
        if key == "bmm":
            at = 1 if base == "baddbmm" else 0  # baddbmm(input, batch1, batch2)
            a, b = (x.meta.get("val") for x in fx.args[at : at + 2])  # type: ignore[union-attr]
            if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
                return None
            return 2.0 * int(a.shape[-2]) * int(a.shape[-1]) * int(b.shape[-1])
        if base in _ROW_ARGS:
            at_x, at_dim = _ROW_ARGS[base]
            x = fx.args[at_x].meta.get("val")  # type: ignore[union-attr]
            dim = fx.args[at_dim]
            if isinstance(dim, (list, tuple)):  # a norm's normalized_shape
                return float(math.prod(int(d) for d in dim))
            return float(x.shape[int(dim)])  # type: ignore[arg-type,union-attr]
    except (AttributeError, IndexError, TypeError, ValueError):
        return None
    return None


_ROW_ARGS = {
    "_softmax": (0, 1),
    "_safe_softmax": (0, 1),
    "_log_softmax": (0, 1),
    "_softmax_backward_data": (0, 2),
    "_log_softmax_backward_data": (0, 2),
    "native_layer_norm": (0, 1),
    "native_layer_norm_backward": (0, 2),
}
"""Row ops: the positions of (the tensor, its reduced dim or normalized shape) in the args."""


def node_time_s(
    fx: torch.fx.Node,
    flops: float,
    profile: DeviceProfile,
    *,
    moved: float | None = None,
    dtype: str | None = None,
) -> float:
    """The roofline time of FX node ``fx`` (``flops`` FLOPs) on ``profile``: the rates of its
    :func:`cost_key` at its :func:`op_size`, its bytes (:func:`bytes_moved` unless given) and
    its dtype (the first floating-point tensor it reads or writes unless given)."""
    key = cost_key(fx, profile)
    return roofline_time_s(
        profile,
        flops,
        bytes_moved(fx) if moved is None else moved,
        _main_dtype(fx) if dtype is None else dtype,
        key,
        op_size(fx, key),
    )


def _strided(fx: torch.fx.Node) -> bool:
    """Whether an op reads a tensor that is not contiguous or that it broadcasts (more than
    one element, fewer than its output): TensorIterator's slower paths."""
    outs = [x for x in pytree.tree_leaves(fx.meta.get("val")) if isinstance(x, torch.Tensor)]
    if not outs:
        return False
    numel = outs[0].numel()
    return any(
        isinstance(t, torch.Tensor)
        and t.numel() > 1
        and (not t.is_contiguous() or t.numel() < numel)
        for t in (a.meta.get("val") for a in fx.all_input_nodes)
    )


_POW_AS = {
    2.0: "elementwise",
    3.0: "elementwise",
    1.0: "elementwise",
    -1.0: "reciprocal",
    -2.0: "elementwise",
    0.5: "sqrt",
    -0.5: "rsqrt",
}
"""What ``pow(x, exponent)`` costs like: ATen turns these exponents into multiplies or roots."""

_ATTENTION_OPS = frozenset(
    {
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
    }
)


def default_cost(target: str = "cpu") -> DeviceProfile:
    """The default cost model: the roofline of the device ``target`` names.

    ``"cpu"``: the measured local CPU. A profile name (``"h100"``): that datasheet profile.
    ``"cuda"``: the local GPU, measured, when there is one; otherwise a ValueError asking for a
    profile name, since a CPU-only machine cannot know which GPU is meant.
    """
    low = target.lower()
    if low == "cpu":
        return cpu_profile()
    if low == "cuda":
        if torch.cuda.is_available():
            return cpu_profile(device="cuda")
        raise ValueError(
            "target='cuda' without a GPU here: name the GPU to plan for (target='h100', "
            "'a100', 'h200') or pass cost=<a DeviceProfile>"
        )
    return get_profile(low)


def resolve_cost(cost: Cost | None, target: str = "cpu") -> str | DeviceProfile:
    """``"flops"`` / ``"measure"`` as is; profile names to profiles (``"cpu"`` measured);
    None to the default roofline of ``target`` (:func:`default_cost`)."""
    if cost is None:
        return default_cost(target)
    if isinstance(cost, DeviceProfile):
        return cost
    if not isinstance(cost, str):
        raise TypeError(
            f"cost must be 'flops', 'measure', a profile name or a DeviceProfile, got {cost!r}"
        )
    low = cost.lower()
    if low in ("flops", "measure"):
        return low
    if low in ("cpu", "cpu-local", "local"):
        return cpu_profile()
    try:
        return get_profile(low)
    except ValueError:
        raise ValueError(
            f"unknown cost {cost!r}: use 'flops', 'measure', 'cpu' or a device profile name "
            "(a100, h100, h200)"
        ) from None


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return int(x.numel() * x.element_size())
    return 0


def _main_dtype(n: torch.fx.Node) -> str | None:
    for x in [
        *pytree.tree_leaves(n.meta.get("val")),
        *(a.meta.get("val") for a in n.all_input_nodes),
    ]:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return str(x.dtype).removeprefix("torch.")
    return None


def bytes_moved(n: torch.fx.Node) -> int:
    """Bytes an op reads (its tensor arguments, as views) and writes (its outputs)."""
    reads = sum(_nbytes(a.meta.get("val")) for a in n.all_input_nodes)
    writes = sum(_nbytes(x) for x in pytree.tree_leaves(n.meta.get("val")))
    return reads + writes


def apply_costs(
    cap: Capture,
    cost: Cost | None,
    *,
    model: Any = None,
    example_inputs: Any = None,
    repeats: int = 3,
) -> Graph:
    """Return ``cap.graph`` with ``time_s`` (and ``device``) filled in by the cost model."""
    resolved = resolve_cost(cost, cap.target)
    graph = cap.graph
    times: dict[str, float]
    device: DeviceProfile | None
    if resolved == "flops":
        times = {n.id: n.flops * FLOPS_SECONDS_PER_FLOP for n in graph.nodes}
        device = None
    elif resolved == "measure":
        if model is None:
            raise ValueError("cost='measure' needs the model and its example inputs")
        real_sizes: dict[str, int] = {}
        times = measure_node_times(
            cap, model, example_inputs, repeats=repeats, sizes_out=real_sizes
        )
        device = cpu_profile()
        # Kernels whose fake implementation under-reports a storage (a saved workspace) get
        # the size the real kernel allocated.
        values = tuple(
            v.model_copy(update={"size_bytes": real_sizes[v.id]})
            if v.id in real_sizes and not graph.is_static(v.id) and real_sizes[v.id] != v.size_bytes
            else v
            for v in graph.values
        )
        graph = Graph(
            name=graph.name,
            nodes=graph.nodes,
            values=values,
            required=graph.required,
            static_bytes=graph.static_bytes,
        )
    else:
        assert isinstance(resolved, DeviceProfile)
        device = resolved
        times = {}
        for node in graph.nodes:
            times[node.id] = node_time_s(cap.node_fx[node.id], node.flops, device)
    nodes = [n.model_copy(update={"time_s": float(times.get(n.id, 0.0))}) for n in graph.nodes]
    return Graph(
        name=graph.name,
        nodes=nodes,
        values=graph.values,
        required=graph.required,
        static_bytes=graph.static_bytes,
        device=device,
    )


def measure_node_times(
    cap: Capture,
    model: Any,
    example_inputs: Any,
    *,
    repeats: int = 3,
    sizes_out: dict[str, int] | None = None,
) -> dict[str, float]:
    """Run the joint graph once on real tensors, timing each IR node (median of ``repeats``).

    When ``sizes_out`` is given it receives the real storage size of each value a node makes.
    """
    params = cap.primals(model, example_inputs)
    for t in params:
        if t.device.type == "meta":
            raise ValueError(
                "cost='measure' runs the model: its parameters and inputs must be real tensors, "
                "not on the meta device (use cost='cpu' or a device profile instead)"
            )
    times: dict[str, float] = {}
    graph = cap.graph
    wanted = set(cap.node_fx)
    name_of = {fx.name: nid for nid, fx in cap.node_fx.items()}
    clock = op_clock()

    class Timer(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            if n.name not in name_of or name_of[n.name] not in wanted:
                return super().run_node(n)
            # The op alone is timed: its arguments are fetched once, outside the clock, and one
            # untimed call first pays for lazy initialisation and the allocator's first touch.
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            call = getattr(self, n.op)
            samples = []
            result: Any = None
            for k in range(repeats + 1):
                t0 = clock()
                try:
                    result = call(n.target, args, kwargs)
                except Exception as exc:
                    node = graph.node(name_of[n.name])
                    where = f" in module {node.module!r}" if node.module else ""
                    raise TraceError(
                        f"cost='measure': op {node.op} (node {node.id!r}){where} failed on real "
                        f"tensors: {type(exc).__name__}: {exc}",
                        op=node.op,
                        module=node.module,
                    ) from exc
                if k:
                    samples.append(clock() - t0)
            nid = name_of[n.name]
            times[nid] = statistics.median(samples)
            if sizes_out is not None:
                for vid in graph.node(nid).outputs:
                    t = _element(result, cap.value_fx[vid], n, vid)
                    if isinstance(t, torch.Tensor):
                        sizes_out[vid] = int(t.untyped_storage().nbytes())
            return result

    with torch.no_grad():
        primals = [t.detach() for t in params]
        loss_dtype = cap.value_fx[cap.loss_value].meta["val"].dtype
        tangents = [torch.ones((), dtype=loss_dtype)]
        Timer(cap.joint).run(primals, tangents)
    return times


def _element(result: Any, base: torch.fx.Node, n: torch.fx.Node, vid: str) -> Any:
    """The tensor of value ``vid`` in the result of FX node ``n``."""
    if base is n and "#" not in vid:
        return result
    if base.target is operator.getitem and base.args[0] is n:
        return result[base.args[1]]
    if "#" in vid:
        return result[int(vid.rpartition("#")[2])]
    return None
