"""The measured profile of the local device: the rates the default roofline prices ops at.

:func:`cpu_profile` is measured at first use with the threads torch uses (a float32 matmul, a
large copy, the per-op overhead of an ATen call from Python, a 4 MiB tensor through an op of
each class and each op of :data:`_OP_PROBES`, read cold from 64 MiB of inputs as a step reads
its activations, and the fused attention kernel; medians of a few repeats, a few seconds) and
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

PROFILE_VERSION = 3
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
