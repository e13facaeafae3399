"""Cost models: the ``time_s`` of each node.

* a :class:`~remat.ir.DeviceProfile` (or its name: ``"a100"``, ``"h100"``, ``"h200"``, ``"cpu"``):
  a roofline, ``op_overhead_s + max(flops / FLOP/s, bytes moved / bandwidth)``, where bytes
  moved are the bytes of the tensors the op reads and writes, and the key that picks the rates
  (:func:`cost_key`) is the op's own name where the profile measured it (``tanh``, ``silu``,
  ...), ``attention``/``attention_causal`` for the fused attention kernels (a share of the
  matmul rate), what ``pow`` becomes for its exponent, or else its class (:func:`op_class`:
  plain element-wise/copy, element-wise with a strided or broadcast operand, transcendental,
  softmax, reduction, normalisation, random draw). No op that moves bytes costs zero. The default of
  :func:`remat.trace` (``cost=None``) is the roofline of the device the step targets: the
  measured local CPU for ``target="cpu"``.
* ``"measure"``: each node runs on the local device (real tensors, the joint graph executed
  once node by node); its time is the median of ``repeats`` timed calls of the op itself, after
  one untimed warm-up call. The graph carries the measured CPU profile (for the host-link
  bandwidth).
* ``"flops"``: FLOPs alone, expressed in seconds at a nominal 1 TFLOP/s (``time_s = flops *
  1e-12``); ops that torch's counter gives 0 FLOPs (element-wise, views, copies) cost 0, so
  plans may recompute them for free. Kept for FLOP-only comparisons, never the default.

Ops are timed on :func:`op_clock`: with one torch thread on a CPU, the calling thread's CPU
time, so that time the scheduler gives other processes on a shared machine is not counted.

The CPU profile (:func:`cpu_profile`) is measured at first use with the threads torch uses
(a float32 matmul, a large copy, the per-op overhead of an ATen call from Python, a 4 MiB
tensor through an op of each class and each op of :data:`_OP_PROBES`, read cold from 64 MiB of
inputs as a step reads its activations, and the attention kernel; medians of a few repeats, a
few seconds) and cached as JSON under ``$REMAT_CACHE_DIR`` or ``~/.cache/remat``, one profile
per machine, torch version and thread count; a process uses the first profile it reads or
measures throughout.
"""

from __future__ import annotations

import itertools
import json
import operator
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from remat.ir import DeviceProfile, Graph
from remat.ir.devices import get_profile, roofline_time_s
from remat.tracer.capture import Capture, TraceError

FLOPS_SECONDS_PER_FLOP = 1e-12
PROFILE_VERSION = 3
"""Bumped when :func:`measure_cpu_profile` measures something new (old caches are re-measured)."""

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
    measured it, ``"attention"``/``"attention_causal"`` for the fused attention kernels, what
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
    if base in _OP_PROBES and base in measured:
        return base
    cls = op_class(f"aten.{name}")
    if cls == "elementwise" and "elementwise_strided" in measured and _strided(fx):
        return "elementwise_strided"
    return cls


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


def cache_dir() -> Path:
    return Path(os.environ.get("REMAT_CACHE_DIR") or Path.home() / ".cache" / "remat")


def op_clock(device: str = "cpu") -> Callable[[], float]:
    """The clock that times ops: this thread's CPU time on a CPU with one torch thread (the
    op runs on the calling thread, and time the scheduler gives to other processes on a shared
    machine is not the op's), the wall clock otherwise (a GPU, or several torch threads)."""
    if device == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def _median_time(
    fn: Callable[[], Any],
    repeats: int,
    *,
    sync: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    fn()  # warm-up: first-call allocations and lazy initialisation are not the op's cost
    sync()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        sync()
        times.append(clock() - t0)
    return statistics.median(times)


# Ops whose effective bandwidth the profile measures on their own (a 4 MiB float32 tensor,
# positive values): the vectorised kernels of one class differ by up to 5x on a CPU (tanh and
# log against silu; tanh_backward is a plain multiply-add).
_OP_PROBES: dict[str, tuple[Callable[[torch.Tensor], Any], int]] = {
    # name: (the op on x, how many 4 MiB tensors it reads and writes)
    "gelu": (F.gelu, 2),
    "gelu_backward": (lambda x: torch.ops.aten.gelu_backward(x, x), 3),
    "silu": (F.silu, 2),
    "silu_backward": (lambda x: torch.ops.aten.silu_backward(x, x), 3),
    "tanh": (torch.tanh, 2),
    "tanh_backward": (lambda x: torch.ops.aten.tanh_backward(x, x), 3),
    "sigmoid": (torch.sigmoid, 2),
    "sigmoid_backward": (lambda x: torch.ops.aten.sigmoid_backward(x, x), 3),
    "exp": (torch.exp, 2),
    "log": (torch.log, 2),
    "sqrt": (torch.sqrt, 2),
    "rsqrt": (torch.rsqrt, 2),
    "erf": (torch.erf, 2),
    "pow": (lambda x: torch.pow(x, 1.7), 2),  # a general exponent (2, 3, -1 are multiplies)
    "reciprocal": (torch.reciprocal, 2),
    "sin": (torch.sin, 2),
    "cos": (torch.cos, 2),
}
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


def measure_cpu_profile(*, repeats: int = 5, device: str = "cpu") -> DeviceProfile:
    """Measure this machine's profile (about a second): float32 matmul rate, copy bandwidth,
    per-op overhead, the effective bandwidth of each op class and of the ops in
    :data:`_OP_PROBES` on a 4 MiB tensor (the allocation of the result included, as in a real
    step) and, on a CPU, the fraction of the matmul rate the fused attention kernel reaches.
    Times are this thread's CPU time when torch uses one thread (:func:`op_clock`), so a busy
    machine does not make the profile slow. ``device="cuda"`` measures the local GPU the same
    way."""
    dev = torch.device(device)
    sync: Callable[[], None] = (
        (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    )
    clock = op_clock(dev.type)

    def med(fn: Callable[[], Any]) -> float:
        return _median_time(fn, repeats, sync=sync, clock=clock)

    n = 512 if dev.type == "cpu" else 4096
    a = torch.randn(n, n, device=dev)
    b = torch.randn(n, n, device=dev)
    mm_s = med(lambda: torch.mm(a, b))
    flops = 2 * n**3 / mm_s
    src = torch.empty(16 * 2**20 // 4, device=dev)  # 16 MiB
    dst = torch.empty_like(src)
    copy_s = med(lambda: dst.copy_(src))
    bandwidth = 2 * src.numel() * 4 / copy_s  # read + write
    one = torch.ones(1, device=dev)
    calls = 100
    # Ops are called as the executor calls them: an ATen overload from Python.
    add = torch.ops.aten.add.Tensor
    per_call = med(lambda: [add(one, one) for _ in range(calls)]) / calls
    # Inputs are cold, as the activations a training step reads are: each call reads the next
    # of 16 tensors of 4 MiB (64 MiB, more than a CPU's last-level cache), positive (log, sqrt:
    # no NaN paths).
    xs = [torch.rand(2**20, device=dev) + 0.5 for _ in range(16)]
    turn = itertools.cycle(range(len(xs)))
    w = torch.ones(1024, device=dev)

    def cold(op: Callable[[torch.Tensor], Any]) -> Callable[[], Any]:
        return lambda: op(xs[next(turn)])

    nbytes = xs[0].nbytes
    # (op, bytes it reads and writes): one input and one output of 4 MiB unless said.
    probes: dict[str, tuple[Callable[[], Any], int]] = {
        "elementwise": (cold(lambda x: x + x), 3 * nbytes),
        # a transposed read and a broadcast operand, as in reshaped attention heads
        "elementwise_strided": (cold(lambda x: x.view(1024, 1024).t() * w), 2 * nbytes),
        "transcendental": (cold(F.gelu), 2 * nbytes),
        "softmax": (cold(lambda x: torch.softmax(x.view(1024, 1024), -1)), 2 * nbytes),
        "norm": (cold(lambda x: F.layer_norm(x.view(1024, 1024), (1024,), w, w)), 2 * nbytes),
        # over the last dimension of rows of 1024, as a norm's statistics (the output is tiny)
        "reduction": (cold(lambda x: x.view(1024, 1024).mean(-1)), nbytes + 4096),
        "random": (cold(lambda x: torch.ops.aten.bernoulli.p(x, 0.9)), 2 * nbytes),
    }
    for name, (op, tensors) in _OP_PROBES.items():
        probes[name] = (cold(op), tensors * nbytes)
    per_class = {}
    for cls, (fn, moved) in probes.items():
        t = med(fn)
        per_class[cls] = moved / max(t - per_call, t / 2)
    efficiency = {}
    if dev.type == "cpu":
        # The fused attention kernel at a decoder's shape (batch 4, 4 heads, 256 positions,
        # head size 64), forward and backward together, against the FLOPs the tracer counts.
        q = torch.randn(4, 4, 256, 64, device=dev)
        fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
        for key, causal in (("attention", False), ("attention_causal", True)):
            out, lse = fwd(q, q, q, 0.0, causal)
            t = med(lambda c=causal: fwd(q, q, q, 0.0, c)) + med(
                lambda c=causal, o=out, s=lse: bwd(o, q, q, q, o, s, 0.0, c)
            )
            counted = 3.5 * 4 * q.numel() * q.shape[2] / (2 if causal else 1)  # fwd + 2.5x
            efficiency[key] = min(1.0, counted / max(t - 2 * per_call, t / 2) / flops)
    name = "cpu-local" if dev.type == "cpu" else f"{dev.type}-local"
    host = bandwidth
    if dev.type == "cuda":
        h = torch.empty(src.numel(), pin_memory=True)
        up_s = med(lambda: src.copy_(h, non_blocking=True))
        host = src.nbytes / up_s
    return DeviceProfile(
        name=name,
        peak_flops_per_s={"float32": flops},
        memory_bandwidth_bytes_per_s=bandwidth,
        host_bandwidth_bytes_per_s=host,  # on a CPU, host and device memory are the same
        op_overhead_s=per_call,
        op_bandwidth_bytes_per_s=per_class,
        op_compute_efficiency=efficiency,
    )


def _cpu_key(device: str = "cpu") -> str:
    return (
        f"v{PROFILE_VERSION}-{device}-{platform.machine()}-{platform.processor() or 'cpu'}-"
        f"{os.cpu_count()}-threads{torch.get_num_threads()}-{torch.__version__}"
    )


_PROFILES: dict[tuple[str, str], DeviceProfile] = {}
"""Profiles this process has measured or read, by (cache file, key): one process traces every
graph with the same profile, even when another process rewrites the cache meanwhile."""


def _read_profiles(path: Path) -> dict[str, Any]:
    """The cache file's profiles by key (``{}`` when it is missing or unreadable)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    if "key" in data and "profile" in data:  # the one-profile format of PROFILE_VERSION 2
        return {str(data["key"]): data["profile"]}
    profiles = data.get("profiles")
    return profiles if isinstance(profiles, dict) else {}


def cpu_profile(*, refresh: bool = False, device: str = "cpu") -> DeviceProfile:
    """This machine's profile: measured at first use, then read from the cache.

    The cache file holds one profile per key (machine, torch version, thread count), so
    processes that use different thread counts do not re-measure each other's profile; within
    one process the first profile read or measured is used throughout.
    """
    path = cache_dir() / ("cpu-profile.json" if device == "cpu" else f"{device}-profile.json")
    key = _cpu_key(device)
    memo = (str(path), key)
    if not refresh and memo in _PROFILES:
        return _PROFILES[memo]
    profile: DeviceProfile | None = None
    if not refresh and key in (stored := _read_profiles(path)):
        try:
            profile = DeviceProfile.model_validate(stored[key])
        except ValueError:
            profile = None
    if profile is None:
        profile = measure_cpu_profile(device=device)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            profiles = _read_profiles(path)
            profiles[key] = profile.model_dump()
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"profiles": profiles}))
            tmp.replace(path)  # atomic: a reader never sees half a file
        except OSError:
            pass  # a read-only home still gets a profile, just not a cached one
    _PROFILES[memo] = profile
    return profile


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
            fx = cap.node_fx[node.id]
            times[node.id] = roofline_time_s(
                device, node.flops, bytes_moved(fx), _main_dtype(fx), cost_key(fx, device)
            )
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
