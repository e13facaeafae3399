"""The simulator: replays a plan on its graph and is the one judge of it.

Model
-----
* Memory. Static bytes (``graph.static_bytes``) are always held. Dynamic bytes start at the
  inputs' sizes (the caller holds them; a plan may neither free nor offload an input). A
  ``compute`` allocates each output that is not already on the device plus the node's workspace;
  the workspace is released when the node ends. ``free`` releases at once. ``offload`` releases
  the device bytes when its copy completes; ``prefetch`` allocates at once (a prefetch of a value
  whose offload is still in flight waits for it on the copy stream: the old copy is released
  first).
* Time. Three streams. The compute stream runs ``compute`` steps in plan order, each for the
  node's ``time_s``, and waits (a *stall*) for prefetches of the values it reads. The host link
  has a copy stream per direction (:class:`~remat.ir.device_profile.HostLink`): offloads run in
  plan order on the device-to-host stream, prefetches on the host-to-device one, each taking its
  latency plus ``size_bytes`` over its direction's bandwidth; an offload cannot start before its
  value has been computed, a prefetch not before its offload has finished, nor before the
  compute stream reaches it in plan order (its device buffer is allocated there). A link whose
  copies do not overlap compute runs each copy on the compute stream instead (counted as
  stall). The step's time is when every stream is done; each direction's busy time is reported.
* Host memory. An offload allocates its host copy when it starts; the host copy is released
  when the plan frees the value (a value freed on the device is dead). ``host_peak_bytes`` is
  the most held at once; the budget (``HostLink.host_memory_bytes``) is the judge's caller's to
  hold a plan to (:meth:`remat.solver.Problem.result`: a plan over it does not fit).
* The memory reading of a step is the dynamic bytes in use while it runs (for a compute, with
  its outputs and workspace allocated). Releases of finished offloads are observed when the
  compute stream's clock passes their completion time, so a copy that has not finished still
  holds its memory, and the reported peak is exact for this model.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from remat.ir.device_profile import HostLink
from remat.ir.errors import InvalidPlanError
from remat.ir.graph import Graph
from remat.ir.plan import Plan
from remat.ir.shard import recompute_windows

_ON_DEVICE = 1
_OFFLOADING = 2


@dataclass(frozen=True)
class Simulation:
    """The simulator's figures for one plan. Bytes are exact integers; times in seconds."""

    peak_bytes: int
    """static + peak dynamic bytes."""
    static_bytes: int
    peak_dynamic_bytes: int
    peak_step: int
    """Index of the first step at which the dynamic peak is reached (-1 for an empty plan)."""
    final_dynamic_bytes: int
    total_time_s: float
    """When both the compute and the copy stream are done, stalls included."""
    compute_time_s: float
    """Sum of the times of all compute steps (recomputation included, stalls excluded)."""
    stall_time_s: float
    transfer_time_s: float
    recompute_time_s: float
    recompute_flops: int
    flops: int
    num_computes: int
    num_recomputes: int
    offload_bytes: int
    prefetch_bytes: int
    timeline_bytes: list[int] = field(repr=False)
    """Dynamic bytes in use during each step, one entry per step."""
    alive_value_ids: tuple[str, ...] = field(default=(), repr=False)
    """With ``alive_at_step``: the values holding device bytes during that step (inputs, values
    on the device, offloads whose copy has not finished), in the order they were allocated."""
    alive_workspace_bytes: int = 0
    """With ``alive_at_step``: the workspace of the node running at that step (0 for others)."""
    device_to_host_busy_s: float = 0.0
    """Time the device-to-host direction of the link spends copying (latency included)."""
    host_to_device_busy_s: float = 0.0
    """Time the host-to-device direction spends copying (latency included)."""
    host_peak_bytes: int = 0
    """Most bytes held in host memory by offloaded values at once."""


def _windows(graph: Graph) -> Mapping[str, tuple[str, str]]:
    return recompute_windows(graph) if graph.sharding is not None else {}


def simulate(
    graph: Graph,
    plan: Plan,
    *,
    host_bandwidth_bytes_per_s: float | None = None,
    alive_at_step: int | None = None,
    link: HostLink | None = None,
) -> Simulation:
    """Replay ``plan`` on ``graph`` and return exact memory and time figures.

    Parameters
    ----------
    graph
        A validated graph.
    plan
        The schedule to judge.
    host_bandwidth_bytes_per_s
        Price copies at this bandwidth in both directions with no latency (the link's overlap
        kept); ``math.inf`` makes transfers free. Default: the link of the graph's device
        profile (:meth:`~remat.ir.DeviceProfile.link`).
    alive_at_step
        Also record which values hold device bytes during this step (for example
        ``peak_step`` of an earlier run, to name what is alive at the peak); their sizes plus
        the workspace add up to ``timeline_bytes[alive_at_step]``.
    link
        The host link to simulate in place of the profile's (an emulated one, for example);
        ``host_bandwidth_bytes_per_s``, when also given, overrides its bandwidths.

    Raises
    ------
    InvalidPlanError
        At the first step that reads a value not on the device, frees or offloads a value that
        is not there, prefetches one that was never offloaded, recomputes a side-effecting node,
        names an unknown id, or when the plan ends without a required value; on an FSDP2 graph
        also when it recomputes a forward op outside its unit's parameter window
        (:func:`remat.ir.shard.recompute_windows`).
    """
    if link is None:
        link = graph.link
    d2h_bw, h2d_bw, latency = (
        link.device_to_host_bytes_per_s,
        link.host_to_device_bytes_per_s,
        link.latency_s,
    )
    if host_bandwidth_bytes_per_s is not None:
        if not host_bandwidth_bytes_per_s > 0:
            raise ValueError(
                f"host_bandwidth_bytes_per_s must be > 0, got {host_bandwidth_bytes_per_s}"
            )
        d2h_bw = h2d_bw = host_bandwidth_bytes_per_s
        latency = 0.0
    overlaps = link.overlaps_compute

    size = graph.size_map()
    node_of = graph.node_map()  # plain dicts: graph lookups cost microseconds
    static = graph.static_ids()  # as Graph.is_static, without a lookup per value
    inputs = graph.memo(
        "simulate.inputs", lambda: frozenset(v.id for v in graph.values if v.kind == "input")
    )

    windows = graph.memo("simulate.windows", lambda: _windows(graph))

    state: dict[str, int] = dict.fromkeys(inputs, _ON_DEVICE)
    ready: dict[str, float] = dict.fromkeys(inputs, 0.0)
    host_ready: dict[str, float] = {}  # value -> time its host copy is complete
    pending: list[tuple[float, int, str]] = []  # (completion time, seq, value) of offloads
    computed: dict[str, int] = {}

    cur = sum(size[v] for v in inputs)
    peak = cur
    peak_step = -1
    timeline: list[int] = []
    t_c = 0.0
    t_d2h = 0.0  # when each direction's copy stream is free
    t_h2d = 0.0
    d2h_busy = 0.0
    h2d_busy = 0.0
    host_cur = 0
    host_peak = 0
    stall = 0.0
    transfer = 0.0
    compute_time = 0.0
    recompute_time = 0.0
    recompute_flops = 0
    flops = 0
    num_computes = 0
    num_recomputes = 0
    offload_bytes = 0
    prefetch_bytes = 0
    seq = 0
    alive: tuple[str, ...] = ()
    alive_ws = 0

    def release_until(t: float) -> None:
        nonlocal cur
        while pending and pending[0][0] <= t:
            _, _, v = heapq.heappop(pending)
            if state.get(v) == _OFFLOADING:
                del state[v]
                cur -= size[v]

    def fail(i: int, msg: str) -> InvalidPlanError:
        s = plan.steps[i]
        return InvalidPlanError(f"step {i} ({s.op} {s.id!r}): {msg}", step=i)

    for i, step in enumerate(plan.steps):
        op, sid = step.op, step.id
        if op == "compute":
            node = node_of.get(sid)
            if node is None:
                raise fail(i, f"unknown node {sid!r}")
            start = t_c
            for x in node.inputs:
                if x in static:
                    continue
                st = state.get(x)
                if st != _ON_DEVICE:
                    why = "is being offloaded" if st == _OFFLOADING else "is not on the device"
                    raise fail(i, f"reads value {x!r}, which {why}")
                start = max(start, ready[x])
            k = computed.get(sid, 0)
            if k and not node.recomputable:
                raise fail(i, f"node {sid!r} has side effects and was already computed")
            if k and sid in windows:
                opened, closed = windows[sid]
                if opened not in computed or closed in computed:
                    raise fail(
                        i,
                        f"recomputes {sid!r} outside its FSDP unit's parameter window (between "
                        f"{opened!r} and {closed!r}): its parameters are not gathered there",
                    )
            stall += start - t_c
            release_until(start)
            new = 0
            for o in node.outputs:
                if o in static:
                    continue
                st = state.get(o)
                if st == _OFFLOADING:
                    raise fail(i, f"recomputes value {o!r} while it is being offloaded")
                if st is None:
                    new += size[o]
            during = cur + new + node.workspace_bytes
            cur += new
            t_c = start + node.time_s
            for o in node.outputs:
                if o not in static:
                    state[o] = _ON_DEVICE
                    ready[o] = t_c
            computed[sid] = k + 1
            num_computes += 1
            compute_time += node.time_s
            flops += node.flops
            if k:
                num_recomputes += 1
                recompute_time += node.time_s
                recompute_flops += node.flops
        elif op == "free":
            _check_value(size, sid, static, inputs, fail, i)
            release_until(t_c)
            st = state.get(sid)
            if st != _ON_DEVICE:
                why = "is being offloaded" if st == _OFFLOADING else "is not on the device"
                raise fail(i, f"frees value {sid!r}, which {why}")
            del state[sid]
            cur -= size[sid]
            if host_ready.pop(sid, None) is not None:  # dead: its host copy goes too
                host_cur -= size[sid]
            during = cur
        elif op == "offload":
            _check_value(size, sid, static, inputs, fail, i)
            release_until(t_c)
            if state.get(sid) != _ON_DEVICE:
                raise fail(i, f"offloads value {sid!r}, which is not on the device")
            if sid in host_ready:
                # The host copy made earlier is still valid: drop the device copy, no transfer.
                del state[sid]
                cur -= size[sid]
            else:
                dur = latency + size[sid] / d2h_bw
                if overlaps:
                    begin = max(t_d2h, ready[sid])
                    t_d2h = begin + dur
                else:  # the copy holds the compute stream
                    begin = max(t_c, t_d2h, ready[sid])
                    t_d2h = t_c = begin + dur
                    stall += dur
                done = begin + dur
                transfer += dur
                d2h_busy += dur
                offload_bytes += size[sid]
                host_ready[sid] = done
                host_cur += size[sid]
                host_peak = max(host_peak, host_cur)
                state[sid] = _OFFLOADING
                seq += 1
                heapq.heappush(pending, (done, seq, sid))
                release_until(t_c)
            during = cur
        elif op == "prefetch":
            _check_value(size, sid, static, inputs, fail, i)
            release_until(t_c)
            if sid not in host_ready:
                raise fail(i, f"prefetches value {sid!r}, which was never offloaded")
            if state.get(sid) == _ON_DEVICE:
                raise fail(i, f"prefetches value {sid!r}, which is still on the device")
            if state.get(sid) == _OFFLOADING:
                # The prefetch starts after the offload has finished, so the old device copy
                # is gone before the new one is filled.
                del state[sid]
                cur -= size[sid]
            dur = latency + size[sid] / h2d_bw
            # Not before the plan issues it: its device buffer is allocated here.
            begin = max(t_c, t_h2d, host_ready[sid])
            if overlaps:
                t_h2d = begin + dur
            else:
                t_h2d = t_c = begin + dur
                stall += dur
            transfer += dur
            h2d_busy += dur
            prefetch_bytes += size[sid]
            state[sid] = _ON_DEVICE
            ready[sid] = begin + dur
            cur += size[sid]
            during = cur
        else:  # pragma: no cover - Step validates op
            raise fail(i, f"unknown op {op!r}")
        timeline.append(during)
        if i == alive_at_step:
            alive = tuple(v for v in state if v not in static)
            alive_ws = graph.node(sid).workspace_bytes if op == "compute" else 0
        if during > peak:
            peak = during
            peak_step = i

    n = len(plan.steps)
    for node in graph.nodes:
        if not node.recomputable and not computed.get(node.id):
            raise InvalidPlanError(f"side-effecting node {node.id!r} never ran", step=n)
    for r in graph.required:
        if r in static:
            p = graph.producer_of(r)
            if p is not None and not computed.get(p.id):
                raise InvalidPlanError(
                    f"plan ends without required value {r!r}: node {p.id!r} never ran", step=n
                )
        elif r not in inputs and state.get(r) != _ON_DEVICE:
            raise InvalidPlanError(f"plan ends without required value {r!r} on the device", step=n)
    release_until(math.inf)
    total = max(t_c, t_d2h, t_h2d)
    return Simulation(
        peak_bytes=graph.static_bytes + peak,
        static_bytes=graph.static_bytes,
        peak_dynamic_bytes=peak,
        peak_step=peak_step,
        final_dynamic_bytes=cur,
        total_time_s=total,
        compute_time_s=compute_time,
        stall_time_s=stall,
        transfer_time_s=transfer,
        recompute_time_s=recompute_time,
        recompute_flops=recompute_flops,
        flops=flops,
        num_computes=num_computes,
        num_recomputes=num_recomputes,
        offload_bytes=offload_bytes,
        prefetch_bytes=prefetch_bytes,
        timeline_bytes=timeline,
        alive_value_ids=alive,
        alive_workspace_bytes=alive_ws,
        device_to_host_busy_s=d2h_busy,
        host_to_device_busy_s=h2d_busy,
        host_peak_bytes=host_peak,
    )


def _check_value(
    size: Mapping[str, int],
    sid: str,
    static: frozenset[str],
    inputs: frozenset[str],
    fail: Callable[[int, str], InvalidPlanError],
    i: int,
) -> None:
    if sid not in size:
        raise fail(i, f"unknown value {sid!r}")
    if sid in static:
        raise fail(i, f"value {sid!r} is static (parameter, buffer or parameter gradient)")
    if sid in inputs:
        raise fail(i, f"value {sid!r} is an input held by the caller")
