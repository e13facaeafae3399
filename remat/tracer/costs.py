"""Cost models: the ``time_s`` of each node.

* a :class:`~remat.ir.DeviceProfile` (or its name: ``"a100"``, ``"h100"``, ``"h200"``, ``"cpu"``):
  a roofline, ``op_overhead_s + max(flops / peak FLOP/s of the dtype, bytes moved / bandwidth of
  the op's class)``, where bytes moved are the bytes of the tensors the op reads and writes and
  the class (:func:`op_class`) says whether the op is a plain element-wise/copy op, a
  transcendental one (``exp``, ``gelu``, ...), a softmax, a normalisation or a random draw. No
  op that moves bytes costs zero. The default of :func:`remat.trace` (``cost=None``) is the
  roofline of the device the step targets: the measured local CPU for ``target="cpu"``.
* ``"measure"``: each node runs on the local device (real tensors, the joint graph executed
  once node by node); its time is the median of ``repeats`` timed calls of the op itself, after
  one untimed warm-up call. The graph carries the measured CPU profile (for the host-link
  bandwidth).
* ``"flops"``: FLOPs alone, expressed in seconds at a nominal 1 TFLOP/s (``time_s = flops *
  1e-12``); ops that torch's counter gives 0 FLOPs (element-wise, views, copies) cost 0, so
  plans may recompute them for free. Kept for FLOP-only comparisons, never the default.

The CPU profile (:func:`cpu_profile`) is measured at first use with the threads torch uses
(a float32 matmul, a large copy, one small call for the per-op overhead and a 4 MiB tensor
through an op of each class; medians of a few repeats, about a second) and cached as JSON under
``$REMAT_CACHE_DIR`` or ``~/.cache/remat``, keyed by machine, torch version and thread count.
"""

from __future__ import annotations

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
PROFILE_VERSION = 2
"""Bumped when :func:`measure_cpu_profile` measures something new (old caches are re-measured)."""

Cost = str | DeviceProfile

# ATen op names (without "aten." and the overload) of each memory-bound class whose effective
# bandwidth differs from a plain element-wise op's. Anything else that does no FLOPs is
# "elementwise" (adds, copies, clones, concatenations, reductions, materialised views).
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


def cache_dir() -> Path:
    return Path(os.environ.get("REMAT_CACHE_DIR") or Path.home() / ".cache" / "remat")


def _median_time(
    fn: Callable[[], Any], repeats: int, *, sync: Callable[[], None] = lambda: None
) -> float:
    fn()  # warm-up: first-call allocations and lazy initialisation are not the op's cost
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_cpu_profile(*, repeats: int = 5, device: str = "cpu") -> DeviceProfile:
    """Measure this machine's profile (about a second): float32 matmul rate, copy bandwidth,
    per-op overhead, and the effective bandwidth of each op class on a 4 MiB tensor (the
    allocation of the result included, as in a real step). ``device="cuda"`` measures the
    local GPU the same way."""
    dev = torch.device(device)
    sync: Callable[[], None] = (
        (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    )
    n = 512 if dev.type == "cpu" else 4096
    a = torch.randn(n, n, device=dev)
    b = torch.randn(n, n, device=dev)
    mm_s = _median_time(lambda: torch.mm(a, b), repeats, sync=sync)
    flops = 2 * n**3 / mm_s
    src = torch.empty(16 * 2**20 // 4, device=dev)  # 16 MiB
    dst = torch.empty_like(src)
    copy_s = _median_time(lambda: dst.copy_(src), repeats, sync=sync)
    bandwidth = 2 * src.numel() * 4 / copy_s  # read + write
    one = torch.ones(1, device=dev)
    calls = 100
    per_call = (
        _median_time(lambda: [torch.add(one, one) for _ in range(calls)], repeats, sync=sync)
        / calls
    )
    x = torch.randn(2**20, device=dev)  # 4 MiB
    rows = x.view(1024, 1024)
    w = torch.ones(1024, device=dev)
    # (op, bytes it reads and writes): one input and one output of 4 MiB unless said.
    probes: dict[str, tuple[Callable[[], Any], int]] = {
        "elementwise": (lambda: x + x, 3 * x.nbytes),
        "transcendental": (lambda: F.gelu(x), 2 * x.nbytes),
        "softmax": (lambda: torch.softmax(rows, -1), 2 * x.nbytes),
        "norm": (lambda: F.layer_norm(rows, (1024,), w, w), 2 * x.nbytes),
        "random": (lambda: torch.ops.aten.bernoulli.p(x, 0.9), 2 * x.nbytes),
    }
    per_class = {}
    for cls, (fn, moved) in probes.items():
        t = _median_time(fn, repeats, sync=sync)
        per_class[cls] = moved / max(t - per_call, t / 2)
    name = "cpu-local" if dev.type == "cpu" else f"{dev.type}-local"
    host = bandwidth
    if dev.type == "cuda":
        h = torch.empty(src.numel(), pin_memory=True)
        up_s = _median_time(lambda: src.copy_(h, non_blocking=True), repeats, sync=sync)
        host = src.nbytes / up_s
    return DeviceProfile(
        name=name,
        peak_flops_per_s={"float32": flops},
        memory_bandwidth_bytes_per_s=bandwidth,
        host_bandwidth_bytes_per_s=host,  # on a CPU, host and device memory are the same
        op_overhead_s=per_call,
        op_bandwidth_bytes_per_s=per_class,
    )


def _cpu_key(device: str = "cpu") -> str:
    return (
        f"v{PROFILE_VERSION}-{device}-{platform.machine()}-{platform.processor() or 'cpu'}-"
        f"{os.cpu_count()}-threads{torch.get_num_threads()}-{torch.__version__}"
    )


_PROFILES: dict[tuple[str, str], DeviceProfile] = {}
"""Profiles this process has measured or read, by (cache file, key): one process traces every
graph with the same profile, even when another process rewrites the cache meanwhile."""


def cpu_profile(*, refresh: bool = False, device: str = "cpu") -> DeviceProfile:
    """This machine's profile: measured at first use, then read from the cache."""
    path = cache_dir() / ("cpu-profile.json" if device == "cpu" else f"{device}-profile.json")
    key = _cpu_key(device)
    memo = (str(path), key)
    if not refresh and memo in _PROFILES:
        return _PROFILES[memo]
    profile: DeviceProfile | None = None
    if not refresh and path.exists():
        try:
            data = json.loads(path.read_text())
            if data.get("key") == key:
                profile = DeviceProfile.model_validate(data["profile"])
        except (OSError, ValueError, KeyError):
            pass
    if profile is None:
        profile = measure_cpu_profile(device=device)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": key, "profile": profile.model_dump()}))
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
                device, node.flops, bytes_moved(fx), _main_dtype(fx), op_class(node.op)
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
                t0 = time.perf_counter()
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
                    samples.append(time.perf_counter() - t0)
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
