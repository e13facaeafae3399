"""The cost profile of one device: the rates a roofline prices ops at.

Kept apart from :mod:`remat.ir.graph` (which re-exports it), as a graph carries one.
"""

from __future__ import annotations

import bisect
import math
from typing import Annotated

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

Rate = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]
Curve = Annotated[tuple[tuple[Rate, Rate], ...], Field(min_length=1)]
"""Measured points ``(size, rate)`` of one key (kept by increasing size)."""


MAX_INTERCONNECT_BYTES_PER_S = 1e30
"""The fastest link between ranks a profile may state (the service's bound on bandwidths)."""
MAX_INTERCONNECT_LATENCY_S = 1.0
"""The longest latency of one ring step a profile may state (real links: microseconds)."""


class HostLink(BaseModel):
    """The link between device memory and host memory, over which values are offloaded.

    Attributes
    ----------
    device_to_host_bytes_per_s
        Bandwidth of offloads (device to host).
    host_to_device_bytes_per_s
        Bandwidth of prefetches (host to device).
    latency_s
        Fixed time of one copy (its launch and setup), added to each copy's size over the
        bandwidth.
    overlaps_compute
        Whether copies run on their own streams, one per direction, beside the compute stream
        (true for a GPU with copy engines). False: each copy holds the compute stream while it
        runs.
    host_memory_bytes
        Host memory available for offloaded values (None: not stated; :attr:`host_budget_bytes`
        then reads as no budget, and ``auto`` does not offload by default).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    device_to_host_bytes_per_s: Rate
    host_to_device_bytes_per_s: Rate
    latency_s: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    overlaps_compute: bool = True
    host_memory_bytes: int | None = Field(default=None, ge=0)

    def offload_s(self, nbytes: float) -> float:
        """Time of one offload (device to host) of ``nbytes``, latency included."""
        return self.latency_s + nbytes / self.device_to_host_bytes_per_s

    def prefetch_s(self, nbytes: float) -> float:
        """Time of one prefetch (host to device) of ``nbytes``, latency included."""
        return self.latency_s + nbytes / self.host_to_device_bytes_per_s


class Interconnect(BaseModel):
    """The link between ranks that collectives (all-gather, reduce-scatter, all-reduce) use.

    Collectives are priced as rings (Patarasuk & Yuan 2009, as NCCL and gloo run them for large
    messages): an all-gather or a reduce-scatter of ``n`` unsharded bytes over ``w`` ranks moves
    ``(w - 1) / w * n`` bytes through each rank's link in ``w - 1`` steps, an all-reduce twice
    that (:func:`remat.ir.sharding.collective_time_s`).

    Attributes
    ----------
    bandwidth_bytes_per_s
        One-direction bandwidth of one rank's link (NVLink 4 on H100/H200 SXM: 450 GB/s; the
        bottleneck of a ring spanning nodes is the slowest link, e.g. 50 GB/s per GPU for
        400 Gb/s InfiniBand); from 1 byte/s to :data:`MAX_INTERCONNECT_BYTES_PER_S`.
    latency_s
        Fixed time of one ring step, 0 to :data:`MAX_INTERCONNECT_LATENCY_S`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Bounded so that a ring over any valid group and message is a finite time: at most
    # 2**20 ranks times 1 s of latency, plus 2**60-byte sums over 1 byte/s (the service's
    # bounds on the graph's byte counts).
    bandwidth_bytes_per_s: float = Field(
        ge=1.0, le=MAX_INTERCONNECT_BYTES_PER_S, allow_inf_nan=False
    )
    latency_s: float = Field(
        default=0.0, ge=0.0, le=MAX_INTERCONNECT_LATENCY_S, allow_inf_nan=False
    )


class DeviceProfile(BaseModel):
    """The cost profile a graph's times were made for (a roofline of one accelerator).

    Attributes
    ----------
    name
        e.g. ``"h100-sxm"`` or ``"cpu-local"``.
    peak_flops_per_s
        Peak dense FLOP/s per dtype name (``"float32"``, ``"bfloat16"``, ...).
    memory_bandwidth_bytes_per_s
        Device memory bandwidth.
    host_bandwidth_bytes_per_s
        One-direction bandwidth of the host link, used for offload and prefetch where the
        profile has no :attr:`host_link` (profiles written before it existed).
    memory_bytes
        Device memory capacity, when known.
    op_overhead_s
        Fixed time of one op call (dispatch on a CPU, kernel launch on a GPU), added to every
        op's roofline time; 0 for the datasheet profiles, which do not state one.
    op_bandwidth_bytes_per_s
        Effective bandwidth of memory-bound op classes (``"elementwise"``, ``"transcendental"``,
        ``"softmax"``, ``"random"``; see :func:`remat.ir.devices.roofline_time_s`) where they
        differ from ``memory_bandwidth_bytes_per_s`` (measured for the local CPU). A key may
        also be one op's base name (``"tanh"``, ``"silu_backward"``), measured on its own.
    op_compute_efficiency
        Fraction of the dtype's peak FLOP/s that compute-bound op kinds reach, where it is not
        the matrix product's (measured for the local CPU: ``"attention"`` and
        ``"attention_causal"``, the fused attention kernels, whose causal FLOPs count half).
    op_bandwidth_curves
        Effective bandwidth of a key as a function of the op's size, where one figure does not
        fit every size (measured for the local CPU: the softmax and layer-norm ops by the length
        of the rows they reduce, ``"_safe_softmax"``, ``"native_layer_norm"``, ...). Points
        ``(size, bytes/s)``; between two points the rate is interpolated on log(size), beyond
        the ends it is the end's. A curve is used for an op whose size is known, in place of
        the key's figure in ``op_bandwidth_bytes_per_s``.
    op_efficiency_curves
        The same for compute efficiency (a fraction of the peak FLOP/s): measured for the local
        CPU, ``"bmm"``, batched matrix products, by the FLOPs of one matrix product of the batch
        (small products run far below the large matmul's rate).
    host_link
        The host link per direction, its latency, overlap and host memory (None: a profile
        without one, e.g. the local CPU's, where host and device memory are the same; the
        simulator then prices copies at ``host_bandwidth_bytes_per_s`` both ways, and ``auto``
        does not offload by default). When given, ``host_bandwidth_bytes_per_s`` must equal
        its device-to-host rate.
    interconnect
        The link to the other ranks that collectives of a sharded step are priced on
        (:mod:`remat.ir.sharding`; None: not stated, a sharded graph then needs one in its
        :class:`~remat.ir.sharding.ShardingSpec`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    peak_flops_per_s: dict[str, float]
    memory_bandwidth_bytes_per_s: float
    host_bandwidth_bytes_per_s: float
    memory_bytes: int | None = None
    op_overhead_s: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    op_bandwidth_bytes_per_s: dict[str, Rate] = Field(default_factory=dict)
    op_compute_efficiency: dict[str, Rate] = Field(default_factory=dict)
    op_bandwidth_curves: dict[str, Curve] = Field(default_factory=dict)
    op_efficiency_curves: dict[str, Curve] = Field(default_factory=dict)
    host_link: HostLink | None = None
    interconnect: Interconnect | None = None

    @model_serializer(mode="wrap")
    def _without_unstated_link(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        """A profile without an interconnect serialises as before the field existed (its JSON,
        and the content hash of a graph carrying it, unchanged)."""
        out: dict[str, object] = handler(self)
        if self.interconnect is None:
            out.pop("interconnect", None)
        return out

    @model_validator(mode="after")
    def _one_host_rate(self) -> DeviceProfile:
        link = self.host_link
        if link is not None and link.device_to_host_bytes_per_s != self.host_bandwidth_bytes_per_s:
            raise ValueError(
                "host_link.device_to_host_bytes_per_s "
                f"({link.device_to_host_bytes_per_s:g}) must equal host_bandwidth_bytes_per_s "
                f"({self.host_bandwidth_bytes_per_s:g})"
            )
        return self

    def link(self) -> HostLink:
        """The host link the simulator prices copies on: :attr:`host_link`, or for a profile
        without one, ``host_bandwidth_bytes_per_s`` both ways with no latency and no host
        budget."""
        if self.host_link is not None:
            return self.host_link
        bw = self.host_bandwidth_bytes_per_s
        return HostLink(device_to_host_bytes_per_s=bw, host_to_device_bytes_per_s=bw)

    @property
    def can_offload(self) -> bool:
        """The profile states a host link with a host memory budget (``auto`` then offloads
        by default)."""
        link = self.host_link
        return link is not None and bool(link.host_memory_bytes)

    @field_validator("op_bandwidth_curves", "op_efficiency_curves")
    @classmethod
    def _by_size(cls, curves: dict[str, Curve]) -> dict[str, Curve]:
        """Points in any order are kept sorted by size (at a size given twice, the rate of the
        first of them in that order)."""
        return {key: tuple(sorted(points, key=lambda p: p[0])) for key, points in curves.items()}

    def knows(self, key: str) -> bool:
        """Whether ``key`` has a rate of its own here (a figure or a curve)."""
        return any(
            key in rates
            for rates in (
                self.op_bandwidth_bytes_per_s,
                self.op_compute_efficiency,
                self.op_bandwidth_curves,
                self.op_efficiency_curves,
            )
        )

    def bandwidth_bytes_per_s(self, op_class: str | None, size: float | None = None) -> float:
        """Effective bandwidth of ``op_class`` (at ``size``, where it has a curve), else the
        memory bandwidth."""
        if op_class is None:
            return self.memory_bandwidth_bytes_per_s
        if size is not None and op_class in self.op_bandwidth_curves:
            return interpolate(self.op_bandwidth_curves[op_class], size)
        if op_class in self.op_bandwidth_bytes_per_s:
            return self.op_bandwidth_bytes_per_s[op_class]
        return self.memory_bandwidth_bytes_per_s

    def flops_per_s(
        self, dtype: str | None, op_class: str | None = None, size: float | None = None
    ) -> float:
        """FLOP/s for ``dtype`` (its peak, falling back to float32, then to the slowest listed),
        times the compute efficiency of ``op_class`` (at ``size``, where it has a curve) when
        the profile lists one."""
        eff = 1.0
        if op_class is not None:
            if size is not None and op_class in self.op_efficiency_curves:
                eff = interpolate(self.op_efficiency_curves[op_class], size)
            else:
                eff = self.op_compute_efficiency.get(op_class, 1.0)
        return eff * self._peak_flops_per_s(dtype)

    def _peak_flops_per_s(self, dtype: str | None) -> float:
        if dtype is not None and dtype in self.peak_flops_per_s:
            return self.peak_flops_per_s[dtype]
        if "float32" in self.peak_flops_per_s:
            return self.peak_flops_per_s["float32"]
        return min(self.peak_flops_per_s.values())


def interpolate(points: Curve, size: float) -> float:
    """The rate of ``points`` at ``size``: linear in log(size) between the two points around
    it, the end point's rate beyond either end."""
    sizes = [s for s, _ in points]
    i = bisect.bisect_left(sizes, size)
    if i == 0:
        return points[0][1]
    if i == len(points):
        return points[-1][1]
    (s0, r0), (s1, r1) = points[i - 1], points[i]
    w = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
    return r0 + w * (r1 - r0)
