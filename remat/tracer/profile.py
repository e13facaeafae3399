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

    def rowwise(op: Callable[[Any, Any], Any], n: int) -> Callable[[], Any]:
        return lambda: op(xs[next(turn)].view(-1, n), xs[next(turn)].view(-1, n))

    rows: dict[str, list[tuple[float, float]]] = {}
    for length in _ROW_LENGTHS:
        for op_name, row_op in _row_probes(length, dev).items():
            x, y = xs[0].view(-1, length), xs[1].view(-1, length)
            reads = (x, y) if "backward" in op_name else (x,)  # a gradient and a saved tensor
            moved = _tensor_bytes(*reads, row_op(x, y))

            t = med(rowwise(row_op, length))
            rows.setdefault(op_name, []).append((float(length), moved / max(t - per_call, t / 2)))
    curves: dict[str, list[tuple[float, float]]] = {"bmm": []}
    for m, k, n in _BMM_SHAPES:
        one = 2.0 * m * k * n
        batch = max(1, int(2**26 // one))
        ab = [
            (torch.randn(batch, m, k, device=dev), torch.randn(batch, k, n, device=dev))
            for _ in range(2)
        ]
        pick = itertools.cycle(ab)
        t = med(lambda p=pick: torch.bmm(*next(p)))
        curves["bmm"].append((one, min(1.0, batch * one / max(t - per_call, t / 2) / flops)))
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
        op_bandwidth_curves={k: tuple(v) for k, v in rows.items()},
        op_efficiency_curves={k: tuple(v) for k, v in curves.items()},
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
