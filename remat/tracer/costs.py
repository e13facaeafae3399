"""Cost models: the ``time_s`` of each node.

* ``"flops"``: FLOPs alone, expressed in seconds at a nominal 1 TFLOP/s (``time_s = flops *
  1e-12``); ops that torch's counter gives 0 FLOPs (element-wise, views, copies) cost 0. The
  graph carries no device profile.
* a :class:`~remat.ir.DeviceProfile` (or its name: ``"a100"``, ``"h100"``, ``"h200"``, ``"cpu"``):
  a roofline, ``max(flops / peak FLOP/s of the dtype, bytes moved / memory bandwidth)``, where
  bytes moved are the bytes of the tensors the op reads and writes.
* ``"measure"``: each node runs on the local device (real tensors, the joint graph executed
  once node by node); its time is the median of ``repeats`` runs. The graph carries the
  measured CPU profile (for the host-link bandwidth).

The CPU profile (:func:`cpu_profile`) is measured at first use (a float32 matmul and a large
copy, medians of a few repeats) and cached as JSON under ``$REMAT_CACHE_DIR`` or
``~/.cache/remat``.
"""

from __future__ import annotations

import json
import operator
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from remat.ir import DeviceProfile, Graph
from remat.ir.devices import get_profile, roofline_time_s
from remat.tracer.capture import Capture, TraceError

FLOPS_SECONDS_PER_FLOP = 1e-12

Cost = str | DeviceProfile


def cache_dir() -> Path:
    return Path(os.environ.get("REMAT_CACHE_DIR") or Path.home() / ".cache" / "remat")


def _median_time(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_cpu_profile(*, repeats: int = 5) -> DeviceProfile:
    """Measure this CPU's float32 matmul rate and memory bandwidth (about a second)."""
    n = 512
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    torch.mm(a, b)
    mm_s = _median_time(lambda: torch.mm(a, b), repeats)
    flops = 2 * n**3 / mm_s
    src = torch.empty(16 * 2**20 // 4)  # 16 MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_s = _median_time(lambda: dst.copy_(src), repeats)
    bandwidth = 2 * src.numel() * 4 / copy_s  # read + write
    return DeviceProfile(
        name="cpu-local",
        peak_flops_per_s={"float32": flops},
        memory_bandwidth_bytes_per_s=bandwidth,
        host_bandwidth_bytes_per_s=bandwidth,  # host and device memory are the same
    )


def _cpu_key() -> str:
    return (
        f"{platform.machine()}-{platform.processor() or 'cpu'}-{os.cpu_count()}-{torch.__version__}"
    )


def cpu_profile(*, refresh: bool = False) -> DeviceProfile:
    """This CPU's profile: measured at first use, then read from the cache."""
    path = cache_dir() / "cpu-profile.json"
    key = _cpu_key()
    if not refresh and path.exists():
        try:
            data = json.loads(path.read_text())
            if data.get("key") == key:
                return DeviceProfile.model_validate(data["profile"])
        except (OSError, ValueError, KeyError):
            pass
    profile = measure_cpu_profile()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "profile": profile.model_dump()}))
    except OSError:
        pass  # a read-only home still gets a profile, just not a cached one
    return profile


def resolve_cost(cost: Cost) -> str | DeviceProfile:
    """``"flops"`` / ``"measure"`` as is; profile names to profiles (``"cpu"`` measured)."""
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
    cap: Capture, cost: Cost, *, model: Any = None, example_inputs: Any = None, repeats: int = 3
) -> Graph:
    """Return ``cap.graph`` with ``time_s`` (and ``device``) filled in by the cost model."""
    resolved = resolve_cost(cost)
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
            times[node.id] = roofline_time_s(device, node.flops, bytes_moved(fx), _main_dtype(fx))
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
            samples = []
            result: Any = None
            for _ in range(repeats):
                t0 = time.perf_counter()
                try:
                    result = super().run_node(n)
                except Exception as exc:
                    node = graph.node(name_of[n.name])
                    where = f" in module {node.module!r}" if node.module else ""
                    raise TraceError(
                        f"cost='measure': op {node.op} (node {node.id!r}){where} failed on real "
                        f"tensors: {type(exc).__name__}: {exc}",
                        op=node.op,
                        module=node.module,
                    ) from exc
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
