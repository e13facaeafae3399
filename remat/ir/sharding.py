"""How a training step is sharded across ranks: FSDP2 or DDP, as a graph carries it.

A :class:`ShardingSpec` describes the data-parallel configuration a step runs under; a
:class:`~remat.ir.Graph` with one (``graph.sharding``) is the step of *one rank*
(:func:`remat.ir.shard.shard_graph` makes it from the unsharded trace), and every figure of the
simulator on it is per rank. It is part of the graph's JSON, so the service and the command line
read it with the graph.

* ``fsdp2``: PyTorch's ``torch.distributed.fsdp.fully_shard`` (FSDP, Zhao et al. 2023, "PyTorch
  FSDP: Experiences on Scaling Fully Sharded Data Parallel"; the sharding of parameters,
  gradients and optimizer state is ZeRO stage 3, Rajbhandari et al. 2020). ``units`` are the
  module paths passed to ``fully_shard`` besides the root, which is always one.
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (Li et al. 2020, "PyTorch
  Distributed"): every rank holds the whole model; gradients are all-reduced in buckets.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.config import JsonDict

from remat.ir.device_profile import Interconnect

DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "tfloat32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
"""Bytes per element of the dtypes a sharding description may name (and the step builder,
:mod:`remat.ir.builder`, sizes its values with)."""

DEFAULT_BUCKET_CAP_BYTES = 25 * 2**20
"""DDP's default ``bucket_cap_mb`` (25 MiB)."""
DEFAULT_FIRST_BUCKET_BYTES = 2**20
"""DDP's first bucket (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``, 1 MiB)."""

MAX_WORLD_SIZE = 2**20
"""The most ranks a spec may name (1,048,576: beyond any job run so far, and small enough that a
ring's ``w - 1`` steps stay a finite time)."""
MAX_BUCKET_BYTES = 2**60
"""The largest DDP bucket a spec may name: the graph's own bound on a byte count (the service's
``MAX_BYTES``)."""
MAX_UNITS = 4096
"""The most FSDP2 units a spec may list (every layer of the largest models many times over)."""
MAX_UNIT_PATH_CHARS = 1000

_DTYPE_PATTERN = r"^(torch\.)?(" + "|".join(sorted(DTYPE_BYTES)) + r")$"
_UNIT_PATTERN = r"^[^. ]+(\.[^. ]+)*$"

# The patterns are what the validators below check (with messages that say why), stated in the
# JSON Schema for clients and fuzzers.
DtypeName = Annotated[str, Field(max_length=30, json_schema_extra={"pattern": _DTYPE_PATTERN})]
"""A dtype of :data:`DTYPE_BYTES`, with or without the ``torch.`` prefix."""
UnitPath = Annotated[
    str, Field(max_length=MAX_UNIT_PATH_CHARS, json_schema_extra={"pattern": _UNIT_PATTERN})
]
"""A dotted module path (``layers.0``): no empty component, no space."""

# JSON Schema cannot tie one field to another except through combinators: DDP shards nothing,
# so its spec lists no units (what _strategy_fields checks, stated for clients and fuzzers).
_DDP_HAS_NO_UNITS: JsonDict = {
    "anyOf": [
        {"not": {"required": ["strategy"]}},
        {"properties": {"strategy": {"const": "fsdp2"}}},
        {"properties": {"units": {"maxItems": 0}}},
    ]
}

LOOPBACK_GLOO = Interconnect(bandwidth_bytes_per_s=1e9, latency_s=100e-6)
"""Gloo between processes of one CPU host over the loopback device: an order of magnitude
(measured here at 0.6-2 GB/s for messages of a few MB and about 100 us per small message; the
figure swings with load). Used when neither the spec nor the device profile states a link."""


class ShardingSpec(BaseModel):
    """The data-parallel configuration of a step (see the module docstring).

    Attributes
    ----------
    world_size
        Number of ranks, 1 to :data:`MAX_WORLD_SIZE`.
    strategy
        ``"fsdp2"`` or ``"ddp"``.
    units
        FSDP2: the module paths ``fully_shard`` is called on besides the root (``""``, always a
        unit), e.g. each decoder layer's ``model.layers.3``. Each parameter belongs to the
        innermost unit holding every module that reads it.
    reshard_after_forward
        FSDP2: free each non-root unit's gathered parameters after its forward and gather them
        again in the backward (the default, ZeRO-3); False keeps them from the forward's
        all-gather to the unit's backward (ZeRO-2 for parameters). The root never reshards after
        forward (FSDP2 skips it, the backward needs it at once).
    backward_prefetch
        FSDP2's implicit backward prefetch: at a unit's pre-backward, the all-gather of the unit
        whose backward runs next is issued too (two units' parameters gathered at once).
    param_dtype, reduce_dtype
        FSDP2's ``MixedPrecisionPolicy``: the dtype parameters are gathered (and unsharded
        gradients made) in, and the dtype gradients are reduce-scattered in (default: the
        parameter dtype). None: the parameters' own.
    bucket_cap_bytes, first_bucket_bytes
        DDP's gradient bucket sizes (``bucket_cap_mb``; the first bucket is smaller), 1 byte to
        :data:`MAX_BUCKET_BYTES`.
    gradient_as_bucket_view
        DDP: gradients are views into the buckets (one copy of the gradient bytes); False: the
        buckets are a second copy.
    interconnect
        The link collectives are priced on, when not the device profile's
        (:attr:`~remat.ir.DeviceProfile.interconnect`); with neither, :data:`LOOPBACK_GLOO`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", json_schema_extra=_DDP_HAS_NO_UNITS)

    world_size: int = Field(ge=1, le=MAX_WORLD_SIZE)
    strategy: Literal["fsdp2", "ddp"] = "fsdp2"
    units: tuple[UnitPath, ...] = Field(
        default=(), max_length=MAX_UNITS, json_schema_extra={"uniqueItems": True}
    )
    reshard_after_forward: bool = True
    backward_prefetch: bool = True
    param_dtype: DtypeName | None = None
    reduce_dtype: DtypeName | None = None
    bucket_cap_bytes: int = Field(default=DEFAULT_BUCKET_CAP_BYTES, gt=0, le=MAX_BUCKET_BYTES)
    first_bucket_bytes: int = Field(default=DEFAULT_FIRST_BUCKET_BYTES, gt=0, le=MAX_BUCKET_BYTES)
    gradient_as_bucket_view: bool = False
    interconnect: Interconnect | None = None

    @field_validator("param_dtype", "reduce_dtype")
    @classmethod
    def _known_dtype(cls, v: str | None) -> str | None:
        if v is None:
            return None
        name = v.removeprefix("torch.")
        if name not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {v!r}; known: {', '.join(sorted(DTYPE_BYTES))}")
        return name

    @field_validator("units")
    @classmethod
    def _unit_paths(cls, units: tuple[str, ...]) -> tuple[str, ...]:
        seen: set[str] = set()
        for u in units:
            if u == "" or u.startswith(".") or u.endswith(".") or ".." in u or " " in u:
                raise ValueError(
                    f"unit {u!r} is not a module path (dotted names such as 'layers.0'; the "
                    "root is always a unit and is not listed)"
                )
            if u in seen:
                raise ValueError(f"unit {u!r} is listed twice")
            seen.add(u)
        return units

    @model_validator(mode="after")
    def _strategy_fields(self) -> ShardingSpec:
        if self.strategy == "ddp" and self.units:
            raise ValueError("units: DDP shards nothing, units are for strategy 'fsdp2'")
        return self


def interconnect_of(spec: ShardingSpec, device_link: Interconnect | None) -> Interconnect:
    """The link collectives are priced on: the spec's, else the device's, else loopback gloo."""
    return spec.interconnect or device_link or LOOPBACK_GLOO


def collective_time_s(
    kind: Literal["all_gather", "reduce_scatter", "all_reduce"],
    unsharded_bytes: int,
    world_size: int,
    link: Interconnect,
) -> float:
    """Time of one ring collective over ``unsharded_bytes`` (the gathered or reduced size).

    An all-gather or reduce-scatter takes ``w - 1`` steps, each moving ``n / w`` bytes through
    every rank's link: ``(w - 1) * latency + (w - 1) / w * n / bandwidth``; an all-reduce is a
    reduce-scatter then an all-gather, twice that (Patarasuk & Yuan 2009, "Bandwidth optimal
    all-reduce algorithms for clusters of workstations"). One rank: no communication, 0.

    Raises
    ------
    ValueError
        When the time is not a finite number (bytes beyond any real step's).

    Examples
    --------
    >>> link = Interconnect(bandwidth_bytes_per_s=1e9)
    >>> collective_time_s("all_gather", 4_000_000, 4, link)
    0.003
    """
    if world_size <= 1 or unsharded_bytes <= 0:
        return 0.0
    w = world_size
    try:
        # (w - 1) / w first: the byte count may be a Python int beyond a float's range.
        moved_s = (w - 1) / w * unsharded_bytes / link.bandwidth_bytes_per_s
        one = (w - 1) * link.latency_s + moved_s
    except OverflowError:
        one = math.inf
    if not math.isfinite(one):
        raise ValueError(
            f"{kind}: {unsharded_bytes} bytes over {w} ranks take no finite time on a link of "
            f"{link.bandwidth_bytes_per_s:g} bytes/s"
        )
    return 2.0 * one if kind == "all_reduce" else one


def shard_rows(dim0: int, world_size: int) -> int:
    """Rows of one rank's shard of a parameter whose first dimension is ``dim0``: FSDP2 pads dim
    0 to a multiple of the world size and gives each rank an equal chunk (rank 0's is never
    smaller than another's, so this is the per-rank peak's)."""
    return -(-dim0 // world_size)  # in integers: a shape may be beyond a float's exactness


def dtype_bytes(dtype: str | None, where: str) -> int:
    """Bytes per element of ``dtype`` (``"float32"`` or ``"torch.float32"``).

    Raises
    ------
    ValueError
        Naming ``where`` when the dtype is unknown or missing.
    """
    if dtype is None:
        raise ValueError(f"{where}: the value has no dtype, its element size is unknown")
    name = dtype.removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"{where}: unknown dtype {dtype!r}")
    return DTYPE_BYTES[name]


__all__ = [
    "DEFAULT_BUCKET_CAP_BYTES",
    "DEFAULT_FIRST_BUCKET_BYTES",
    "DTYPE_BYTES",
    "LOOPBACK_GLOO",
    "MAX_BUCKET_BYTES",
    "MAX_UNITS",
    "MAX_WORLD_SIZE",
    "ShardingSpec",
    "collective_time_s",
    "dtype_bytes",
    "interconnect_of",
    "shard_rows",
]
