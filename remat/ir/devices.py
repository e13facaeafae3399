"""Device profiles from public datasheets, so a CPU-only machine can plan for a GPU.

Peak FLOP/s are the dense (no sparsity) tensor-core figures per dtype; ``float32`` is the
non-tensor-core FP32 rate. Host bandwidth is the theoretical one-direction rate of the host link
(PCIe 4.0 x16: 32 GB/s; PCIe 5.0 x16: 64 GB/s; NVLink-C2C: 900 GB/s in all, 450 GB/s each way),
each direction on its own copy engine, so copies overlap compute. The host memory budget is a
DGX's system memory shared by its eight GPUs (2 TB: 256 GB each); GH200's is its own 480 GB of
LPDDR5X. The per-copy latency (10 us over PCIe, 5 us over C2C) is an order of magnitude for an
asynchronous copy's launch and DMA setup, not a datasheet figure. The tracer adds a measured
profile of the local CPU (``remat.tracer``), which needs torch, with no host link; these need
nothing.
"""

from __future__ import annotations

from remat.ir.device_profile import HostLink, Interconnect
from remat.ir.graph import DeviceProfile

NVLINK3 = Interconnect(bandwidth_bytes_per_s=300e9, latency_s=5e-6)
"""A100 SXM's NVLink 3: 600 GB/s in all, 300 GB/s each way, within a node."""
NVLINK4 = Interconnect(bandwidth_bytes_per_s=450e9, latency_s=5e-6)
"""H100/H200 SXM's NVLink 4: 900 GB/s in all, 450 GB/s each way, within a node (the latency,
an order of magnitude of one ring step, is not a datasheet figure)."""

_DGX_HOST_BYTES = 256 * 10**9
"""A DGX's 2 TB of system memory, shared by its eight GPUs."""

PCIE4_X16 = HostLink(
    device_to_host_bytes_per_s=32e9,
    host_to_device_bytes_per_s=32e9,
    latency_s=10e-6,
    host_memory_bytes=_DGX_HOST_BYTES,
)
PCIE5_X16 = HostLink(
    device_to_host_bytes_per_s=64e9,
    host_to_device_bytes_per_s=64e9,
    latency_s=10e-6,
    host_memory_bytes=_DGX_HOST_BYTES,
)
NVLINK_C2C = HostLink(
    device_to_host_bytes_per_s=450e9,
    host_to_device_bytes_per_s=450e9,
    latency_s=5e-6,
    host_memory_bytes=480 * 10**9,
)

A100_SXM_80GB = DeviceProfile(
    name="a100-sxm-80gb",
    peak_flops_per_s={
        "float32": 19.5e12,
        "tfloat32": 156e12,
        "bfloat16": 312e12,
        "float16": 312e12,
        "float64": 9.7e12,
    },
    memory_bandwidth_bytes_per_s=2.039e12,
    host_bandwidth_bytes_per_s=32e9,
    memory_bytes=80 * 10**9,
    host_link=PCIE4_X16,
    interconnect=NVLINK3,
)

_HOPPER_FLOPS = {
    "float32": 67e12,
    "tfloat32": 494.7e12,
    "bfloat16": 989.4e12,
    "float16": 989.4e12,
    "float64": 34e12,
}
"""Dense peak FLOP/s of the Hopper GPU of H100 SXM, H200 SXM and GH200."""

H100_SXM = DeviceProfile(
    name="h100-sxm",
    peak_flops_per_s=_HOPPER_FLOPS,
    memory_bandwidth_bytes_per_s=3.35e12,
    host_bandwidth_bytes_per_s=64e9,
    memory_bytes=80 * 10**9,
    host_link=PCIE5_X16,
    interconnect=NVLINK4,
)

H200_SXM = DeviceProfile(
    name="h200-sxm",
    peak_flops_per_s=_HOPPER_FLOPS,
    memory_bandwidth_bytes_per_s=4.8e12,
    host_bandwidth_bytes_per_s=64e9,
    memory_bytes=141 * 10**9,
    host_link=PCIE5_X16,
    interconnect=NVLINK4,
)

GH200 = DeviceProfile(
    name="gh200-96gb",
    # the Hopper GPU, its host the Grace CPU's memory over NVLink-C2C
    peak_flops_per_s=_HOPPER_FLOPS,
    memory_bandwidth_bytes_per_s=4.0e12,
    host_bandwidth_bytes_per_s=450e9,
    memory_bytes=96 * 10**9,
    host_link=NVLINK_C2C,
)

PROFILES: dict[str, DeviceProfile] = {p.name: p for p in (A100_SXM_80GB, H100_SXM, H200_SXM, GH200)}
# Short names people type.
PROFILES.update({"a100": A100_SXM_80GB, "h100": H100_SXM, "h200": H200_SXM, "gh200": GH200})


def get_profile(name: str) -> DeviceProfile:
    """Look a datasheet profile up by name (``"a100"``, ``"h100-sxm"``, ...)."""
    try:
        return PROFILES[name.lower()]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(f"unknown device profile {name!r}; known: {known}") from None


def roofline_time_s(
    profile: DeviceProfile,
    flops: float,
    bytes_moved: float,
    dtype: str | None,
    op_class: str | None = None,
    size: float | None = None,
) -> float:
    """Roofline estimate of one op: the profile's per-op overhead plus the slower of compute
    (``flops`` at the dtype's peak, times the efficiency the profile lists for ``op_class``)
    and memory traffic (``bytes_moved`` at the bandwidth of ``op_class``: ``"elementwise"``,
    ``"transcendental"``, ``"softmax"``, ``"random"``, an op's own name where the profile
    measured it, or None for plain memory bandwidth). ``size`` (the length of the rows a
    softmax or norm reduces, the FLOPs of one product of a batched matmul) picks the rate on
    the key's curve where the profile has one (``op_bandwidth_curves``,
    ``op_efficiency_curves``)."""
    return profile.op_overhead_s + max(
        flops / profile.flops_per_s(dtype, op_class, size),
        bytes_moved / profile.bandwidth_bytes_per_s(op_class, size),
    )
