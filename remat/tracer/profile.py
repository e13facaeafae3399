"""The measured profile of the local device: the rates the default roofline prices ops at.

:func:`cpu_profile` is measured at first use with the threads torch uses (a float32 matmul, a
large copy, the per-op overhead of an ATen call from Python, a 4 MiB tensor through an op of
each class and each op of :data:`_OP_PROBES`, read cold from 64 MiB of inputs as a step reads
its activations, the softmax and layer-norm ops on rows of each of :data:`_ROW_LENGTHS`,
batched matmuls of the shapes :data:`_BMM_SHAPES`, and the fused attention kernel; medians of
a few repeats, about two seconds) and
cached as JSON under ``$REMAT_CACHE_DIR`` or ``~/.cache/remat``, one profile per machine, torch
version and thread count; a process uses the first profile it reads or measures throughout.

Ops are timed on :func:`op_clock`: with one torch thread on a CPU, the calling thread's CPU
time, so that time the scheduler gives other processes on a shared machine is not counted.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from remat.ir import DeviceProfile

PROFILE_VERSION = 4
"""Bumped when :func:`measure_cpu_profile` measures something new (old caches are re-measured)."""


def cache_dir() -> Path:
    return Path(os.environ.get("REMAT_CACHE_DIR") or Path.home() / ".cache" / "remat")


def op_clock(device: str = "cpu") -> Callable[[], float]:
    """The clock that times ops: this thread's CPU time on a CPU with one torch thread (the
    op runs on the calling thread, and time the scheduler gives to other processes on a shared
    machine is not the op's), the wall clock otherwise (a GPU, or several torch threads)."""
    if device == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def _median_times(
    fns: dict[str, Callable[[], Any]],
    repeats: int,
    *,
    sync: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """The median time of each of ``fns``, timed in turns: one warm-up round (first-call
    allocations and lazy initialisation are not the op's cost), then ``repeats`` rounds of
    every probe, so that a burst of another process's work on a shared machine slows one
    sample of every probe rather than every sample of one."""
    for fn in fns.values():
        fn()
    sync()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = clock()
            fn()
            sync()
            times[name].append(clock() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


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


_ROW_LENGTHS = (32, 128, 512, 2048)
"""Row lengths the row-reducing ops of :data:`_ROW_PROBES` are measured at (rows of a 4 MiB
tensor): a softmax or layer norm over short rows runs at a fraction of its long-row rate."""


def _row_probes(length: int, dev: torch.device) -> dict[str, Callable[[Any, Any], Any]]:
    """The ops measured on rows of ``length`` (read ``x``, and ``y`` where they read two
    tensors), by base name."""
    aten = torch.ops.aten
    w = torch.ones(length, device=dev)
    rows = 2**20 // length
    mean = torch.zeros(rows, 1, device=dev)
    rstd = torch.ones(rows, 1, device=dev)
    f32 = torch.float32
    return {
        "_softmax": lambda x, y: aten._softmax(x, -1, False),
        "_safe_softmax": lambda x, y: aten._safe_softmax(x, -1),
        "_log_softmax": lambda x, y: aten._log_softmax(x, -1, False),
        "_softmax_backward_data": lambda x, y: aten._softmax_backward_data(x, y, -1, f32),
        "_log_softmax_backward_data": lambda x, y: aten._log_softmax_backward_data(x, y, -1, f32),
        "native_layer_norm": lambda x, y: aten.native_layer_norm(x, [length], w, w, 1e-5),
        "native_layer_norm_backward": lambda x, y: aten.native_layer_norm_backward(
            x, y, [length], mean, rstd, w, w, [True, True, True]
        ),
    }


_BMM_SHAPES = ((64, 16, 64), (128, 32, 128), (256, 64, 256), (512, 128, 512))
"""Batched matmuls the profile measures, (m, k, n) of one product of the batch (attention's
score shapes: rows, head size, columns), each batched to 2**26 FLOPs: the curve of ``"bmm"``
by the FLOPs of one product."""


def _tensor_bytes(*objs: Any) -> int:
    """Bytes of the tensors among ``objs`` (nested in tuples and lists), as the roofline counts
    an op's reads and writes."""
    total = 0
    for o in objs:
        if isinstance(o, torch.Tensor):
            total += o.numel() * o.element_size()
        elif isinstance(o, (tuple, list)):
            total += _tensor_bytes(*o)
    return total


def measure_cpu_profile(*, repeats: int = 5, device: str = "cpu") -> DeviceProfile:
    """Measure this machine's profile (about two seconds): float32 matmul rate, copy bandwidth,
    per-op overhead, the effective bandwidth of each op class and of the ops in
    :data:`_OP_PROBES` on a 4 MiB tensor (the allocation of the result included, as in a real
    step), the curves of the row ops by row length (``op_bandwidth_curves``) and of batched
    matmuls by the FLOPs of one product (``op_efficiency_curves["bmm"]``, a share of the matmul
    rate, at most 1) and, on a CPU, the fraction of the matmul rate the fused attention kernel
    reaches.
    Times are this thread's CPU time when torch uses one thread (:func:`op_clock`), so a busy
    machine does not make the profile slow. ``device="cuda"`` measures the local GPU the same
    way."""
    dev = torch.device(device)
    sync: Callable[[], None] = (
        (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    )
    clock = op_clock(dev.type)
    timed: dict[str, Callable[[], Any]] = {}  # every probe, by name; timed in turns below
    n = 512 if dev.type == "cpu" else 4096
    a = torch.randn(n, n, device=dev)
    b = torch.randn(n, n, device=dev)
    timed["mm"] = lambda: torch.mm(a, b)
    src = torch.empty(16 * 2**20 // 4, device=dev)  # 16 MiB
    dst = torch.empty_like(src)
    timed["copy"] = lambda: dst.copy_(src)
    one = torch.ones(1, device=dev)
    calls = 100
    # Ops are called as the executor calls them: an ATen overload from Python.
    add = torch.ops.aten.add.Tensor
    timed["call"] = lambda: [add(one, one) for _ in range(calls)]
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
    for cls, (fn, _) in probes.items():
        timed[f"class:{cls}"] = fn

    def rowwise(op: Callable[[Any, Any], Any], n: int) -> Callable[[], Any]:
        return lambda: op(xs[next(turn)].view(-1, n), xs[next(turn)].view(-1, n))

    row_bytes: dict[tuple[str, int], int] = {}
    for length in _ROW_LENGTHS:
        for op_name, row_op in _row_probes(length, dev).items():
            x, y = xs[0].view(-1, length), xs[1].view(-1, length)
            reads = (x, y) if "backward" in op_name else (x,)  # a gradient and a saved tensor
            row_bytes[(op_name, length)] = _tensor_bytes(*reads, row_op(x, y))
            timed[f"row:{op_name}:{length}"] = rowwise(row_op, length)
    bmm_flops: dict[str, tuple[float, float]] = {}  # probe: (FLOPs of one product, of all)
    for m, k, n_ in _BMM_SHAPES:
        batch = max(1, int(2**26 // (2 * m * k * n_)))
        bmm_flops[f"bmm:{m}:{k}:{n_}"] = (2.0 * m * k * n_, 2.0 * batch * m * k * n_)
        pick = itertools.cycle(
            [
                (torch.randn(batch, m, k, device=dev), torch.randn(batch, k, n_, device=dev))
                for _ in range(2)
            ]
        )
        timed[f"bmm:{m}:{k}:{n_}"] = lambda p=pick: torch.bmm(*next(p))
    if dev.type == "cpu":
        # The fused attention kernel at a decoder's shape (batch 4, 4 heads, 256 positions,
        # head size 64), forward and backward together, against the FLOPs the tracer counts.
        q = torch.randn(4, 4, 256, 64, device=dev)
        fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
        for causal in (False, True):
            out, lse = fwd(q, q, q, 0.0, causal)
            timed[f"attention_fwd:{causal}"] = lambda c=causal: fwd(q, q, q, 0.0, c)
            timed[f"attention_bwd:{causal}"] = lambda c=causal, o=out, s=lse: bwd(
                o, q, q, q, o, s, 0.0, c
            )
    if dev.type == "cuda":
        h = torch.empty(src.numel(), pin_memory=True)
        timed["host"] = lambda: src.copy_(h, non_blocking=True)

    t = _median_times(timed, repeats, sync=sync, clock=clock)
    flops = 2 * n**3 / t["mm"]
    bandwidth = 2 * src.numel() * 4 / t["copy"]  # read + write
    per_call = t["call"] / calls

    def rate(amount: float, time_s: float, ops: int = 1) -> float:
        """``amount`` (bytes or FLOPs) per second of the op's own time (less the call cost)."""
        return amount / max(time_s - ops * per_call, time_s / 2)

    per_class = {cls: rate(moved, t[f"class:{cls}"]) for cls, (_, moved) in probes.items()}
    rows: dict[str, list[tuple[float, float]]] = {}
    for (op_name, length), moved in row_bytes.items():
        bw = rate(moved, t[f"row:{op_name}:{length}"])
        rows.setdefault(op_name, []).append((float(length), bw))
    bmm = tuple(
        (one, min(1.0, rate(all_, t[key]) / flops)) for key, (one, all_) in bmm_flops.items()
    )
    efficiency = {}
    if dev.type == "cpu":
        for key, causal in (("attention", False), ("attention_causal", True)):
            counted = 3.5 * 4 * q.numel() * q.shape[2] / (2 if causal else 1)  # fwd + 2.5x
            both = t[f"attention_fwd:{causal}"] + t[f"attention_bwd:{causal}"]
            efficiency[key] = min(1.0, rate(counted, both, ops=2) / flops)
    host = src.nbytes / t["host"] if dev.type == "cuda" else bandwidth
    name = "cpu-local" if dev.type == "cpu" else f"{dev.type}-local"
    return DeviceProfile(
        name=name,
        peak_flops_per_s={"float32": flops},
        memory_bandwidth_bytes_per_s=bandwidth,
        host_bandwidth_bytes_per_s=host,  # on a CPU, host and device memory are the same
        op_overhead_s=per_call,
        op_bandwidth_bytes_per_s=per_class,
        op_compute_efficiency=efficiency,
        op_bandwidth_curves={k: tuple(v) for k, v in rows.items()},
        op_efficiency_curves={"bmm": bmm},
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
