"""PyTorch's own selective-checkpointing MILP, fed from remat's graph: the ``sac_milp`` rows of
benchmarks/sharded.py.

``torch.distributed._tools.sac_ilp.sac_milp`` decides, per module, whether to checkpoint it and
what share of its activation memory to discard, under a per-rank budget (``world_size`` divides
the parameters and gradients it counts); ``get_optimal_checkpointing_policy_per_module`` then
picks, inside each checkpointed module, the ops to save (a knapsack on op memory and runtime).
Torch gathers their inputs (a ``ModuleInfo``) with ``MemTracker``, ``RuntimeEstimator`` and
``SACEstimator``; the last refuses to run outside ``FakeTensorMode`` and, inside it on this
CPU, needs CUDA for its roofline (FIELD-NOTES). Here the same inputs are read off remat's
traced graph of the same step, so that both solvers plan from one set of figures:

* the module tree: the root and the FSDP units (the decoder layers), each a candidate;
* per module, from the eager schedule's liveness (each value from its producer to its last
  reader, or later where eager holds it: :func:`remat.ir.eager_plan`'s rule): forward
  activation bytes before and after the module's forward (``act_total``, ``act_fw_per_module``
  less its outputs), the activation and gradient bytes at the peak of its backward
  (``act_bw_per_module``, ``act_grad_per_module``), its inputs and outputs; the static bytes
  stand for parameters plus gradients (the measured step keeps the previous step's gradients,
  so they are resident throughout, as ``grad_total``);
* per module, its forward ops (``SACStats``: each op's output bytes and time, random ops, ops
  eager runs in place with their parent) and the trade-off curve of discarded memory against
  recomputation time, greedy in bytes per second as ``SACEstimator`` orders it; the MILP
  takes it as the maximum of lines (``rcp >= slope * r + intercept``), so the curve given is
  the lower convex hull of the greedy points (exact where the greedy curve is convex, which
  ordering by bytes per second makes it).

The decisions become a remat plan of the checkpoint class (each chosen unit a region saving the
ops the per-module policy saves; :func:`remat.ir.checkpoint_class.checkpoint_plan`), which
remat's checkpoint executor runs as torch's own selective-checkpoint policies
(``create_selective_checkpoint_contexts``), so the plan's simulated and measured figures are
those of ``sac_milp``'s policy, side by side with remat's on the per-rank graph. ``sac_milp``
also reports its own upper bound on the peak; it counts neither the unsharded parameters of the
units being gathered nor the all-gather and reduce-scatter buffers, which the per-rank graph
does (:func:`remat.ir.shard.shard_graph`).
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from remat.ir import Graph, Plan, checkpoint_class, eager_plan
from remat.ir.cuts import block_key

ROOT = "root"
"""The fully qualified name the root module gets in the ``ModuleInfo``."""


@dataclass(frozen=True)
class SacResult:
    """What ``sac_milp`` chose at one budget, as a plan of the per-rank graph."""

    plan: Plan | None
    """The checkpoint-class plan of its decisions (None when the MILP found no solution)."""
    decisions: dict[str, float]
    """Unit -> share of its activation memory to discard (the checkpointed units only)."""
    milp_peak_bytes: int
    """The per-rank peak of ``sac_milp``'s own memory model at its decisions (the largest of
    its per-module rows; the ``max_m`` it returns is only some value between that and the
    budget); -1: no solution."""
    milp_recompute_s: float
    """``sac_milp``'s own figure for the recomputation time."""
    saves: dict[str, frozenset[str]] = field(default_factory=dict)
    """Unit -> the node ids its region saves."""


def _liveness(graph: Graph) -> tuple[list[int], list[int], list[int], list[int]]:
    """Per node of the eager schedule (:func:`remat.ir.eager_plan`, its frees as eager makes
    them): activation and backward bytes alive *during* the node, and alive *after* the frees
    that follow it (forward-made values count as activations, backward-made ones as
    temporaries; inputs and static values are not counted)."""
    alive = {"forward": 0, "backward": 0}
    phase_of: dict[str, str] = {}
    during_act: list[int] = []
    during_tmp: list[int] = []
    after_act: list[int] = []
    after_tmp: list[int] = []
    for st in eager_plan(graph).steps:
        if st.op == "compute":
            if during_act:  # the previous node's frees are done
                after_act.append(alive["forward"])
                after_tmp.append(alive["backward"])
            nd = graph.node(st.id)
            for o in nd.outputs:
                if not graph.is_static(o):
                    phase_of[o] = nd.phase
                    alive[nd.phase] += graph.value(o).size_bytes
            during_act.append(alive["forward"])
            during_tmp.append(alive["backward"])
        elif st.op == "free" and st.id in phase_of:
            alive[phase_of[st.id]] -= graph.value(st.id).size_bytes
    if during_act:
        after_act.append(alive["forward"])
        after_tmp.append(alive["backward"])
    return during_act, during_tmp, after_act, after_tmp


def _param_bytes(graph: Graph) -> int:
    return sum(v.size_bytes for v in graph.values if v.kind == "param")


def _units_in_order(graph: Graph, units: tuple[str, ...]) -> list[str]:
    first: dict[str, int] = {}
    for i, nd in enumerate(graph.nodes):
        if nd.phase == "forward" and nd.module:
            first.setdefault(block_key(nd.module), i)
    missing = [u for u in units if u not in first]
    if missing:
        raise ValueError(f"units: {missing[0]!r} has no forward node in the graph")
    return sorted(units, key=first.__getitem__)


def sac_stats(graph: Graph, unit: str) -> Any:
    """Torch's ``SACStats`` of ``unit``'s forward ops (``unit`` "" for every forward op), read
    off the graph: op memory (output bytes; zero for the ops whose outputs the region must save
    anyway, as ``SACEstimator`` zeroes the block's last op), op time in ms, random ops, and
    in-place ops with their parent (the op that made the storage they write)."""
    from torch.distributed._tools.sac_estimator import SACStats

    nodes = [
        nd for nd in graph.forward_nodes if not unit or (nd.module and block_key(nd.module) == unit)
    ]
    forced = checkpoint_class.forced_saves(graph, unit, [nd.id for nd in nodes]) if unit else set()
    pos = {nd.id: i for i, nd in enumerate(nodes)}
    memory = [
        0 if nd.id in forced else sum(
            graph.value(o).size_bytes for o in nd.outputs if not graph.is_static(o)
        )
        for nd in nodes
    ]  # fmt: skip
    inplace: list[tuple[int, int]] = []
    for i, nd in enumerate(nodes):
        if nd.eager_in_place:
            parent = graph.producer_of(nd.inputs[0]) if nd.inputs else None
            inplace.append((i, pos.get(parent.id, i) if parent is not None else i))
    bwd_reads = {x for nd in graph.backward_nodes for x in nd.inputs}
    return SACStats(
        func_names=[nd.op or nd.id for nd in nodes],
        runtimes=[nd.time_s * 1e3 for nd in nodes],
        memory=memory,
        view_like_ops=[],
        rand_ops=[i for i, nd in enumerate(nodes) if nd.rng],
        saved_autograd_ops=[
            i for i, nd in enumerate(nodes) if any(o in bwd_reads for o in nd.outputs)
        ],
        inplace_ops=inplace,
        force_store_random=False,
    )


def tradeoff(stats: Any) -> tuple[list[float], list[float], list[float], OrderedDict[float, float]]:
    """(slopes, intercepts, breakpoints, curve) of discarding memory against recomputation
    time, both as shares of the module's totals: candidates (each op, an in-place op with its
    parent, the random ops as one group) discarded greedily by bytes per second, then the lower
    convex hull of those points from (0, 0) to (1, 1)."""
    mem, rt = stats.memory, stats.runtimes
    total_m, total_t = sum(mem), sum(rt)
    group_of: dict[int, int] = {}
    for op, parent in stats.inplace_ops:
        group_of[op] = group_of.get(parent, parent)
    rand = sorted(stats.rand_ops)
    for i in rand:
        group_of[i] = group_of.get(rand[0], rand[0])
    groups: dict[int, list[int]] = {}
    for i in range(len(mem)):
        groups.setdefault(group_of.get(i, i), []).append(i)
    cands = []
    for members in groups.values():
        m = sum(mem[i] for i in members)
        t = sum(rt[i] for i in members)
        cands.append((m / t if t > 0 else float("inf"), m, t))
    cands.sort(key=lambda c: -c[0])
    pts = [(0.0, 0.0)]
    dm = dt = 0.0
    for _, m, t in cands:
        dm += m
        dt += t
        pts.append((dm / total_m if total_m else 1.0, dt / total_t if total_t else 0.0))
    pts.append((1.0, 1.0 if total_t else 0.0))
    hull: list[tuple[float, float]] = []
    for p in sorted(set(pts)):
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (x2 - x1) * (p[1] - y1) - (y2 - y1) * (p[0] - x1) <= 0:
                hull.pop()
            else:
                break
        hull.append(p)
    slopes, intercepts = [], []
    for (x1, y1), (x2, y2) in itertools.pairwise(hull):
        if x2 - x1 <= 1e-12:
            continue
        s = (y2 - y1) / (x2 - x1)
        slopes.append(s)
        intercepts.append(y1 - s * x1)
    curve = OrderedDict((x, y) for x, y in pts)
    return slopes, intercepts, [x for x, _ in hull], curve


def module_info(graph: Graph, units: tuple[str, ...]) -> dict[str, Any]:
    """Torch's ``ModuleInfo`` of the unsharded ``graph`` with the root and ``units`` as its
    modules (see the module docstring for what each figure is read from)."""
    if graph.sharding is not None:
        raise ValueError("graph: pass the unsharded step; sac_milp divides by world_size itself")
    order = _units_in_order(graph, units)
    during_act, during_tmp, after_act, after_tmp = _liveness(graph)
    params = _param_bytes(graph)
    grads = max(0, graph.static_bytes - params)
    span_f: dict[str, list[int]] = {u: [] for u in order}
    span_b: dict[str, list[int]] = {u: [] for u in order}
    for i, nd in enumerate(graph.nodes):
        key = block_key(nd.module) if nd.module else ""
        if key in span_f:
            (span_f if nd.phase == "forward" else span_b)[key].append(i)
    fwd_all = [i for i, nd in enumerate(graph.nodes) if nd.phase == "forward"]
    bwd_all = [i for i, nd in enumerate(graph.nodes) if nd.phase == "backward"]

    def stats(fqn: str, unit: str, f: list[int], b: list[int]) -> dict[str, Any]:
        members = {graph.nodes[i].id for i in f}
        made = {o for i in f for o in graph.nodes[i].outputs}
        outputs = sum(
            graph.value(o).size_bytes
            for o in made
            if graph.is_required(o)
            or any(c.phase == "forward" and c.id not in members for c in graph.consumers_of(o))
        )
        read = {x for i in f for x in graph.nodes[i].inputs} - made
        inputs = sum(graph.value(x).size_bytes for x in read if not graph.is_static(x))
        f0, f1 = f[0], f[-1]
        pre_act = after_act[f0 - 1] if f0 > 0 else 0
        post_act = after_act[f1]
        k0, k1 = (b[0], b[-1]) if b else (f1, f1)
        pre_tmp = after_tmp[k0 - 1] if k0 > 0 else 0
        t_star = max(range(k0, k1 + 1), key=lambda t: during_act[t] + during_tmp[t])
        sac = sac_stats(graph, unit)
        slopes, intercepts, breaks, curve = tradeoff(sac)
        own_params = (
            params
            if not unit
            else sum(graph.value(x).size_bytes for x in read if graph.value(x).kind == "param")
        )
        return {
            "fqn": fqn,
            "param_per_module": own_params,
            "grad_per_module": own_params,  # as aggregate_stats; sac_milp reads the root's only
            "grad_total": grads,
            "act_fw_per_module": max(0, post_act - pre_act - outputs),
            "act_bw_per_module": during_act[t_star],
            "act_grad_per_module": max(0, during_tmp[t_star] - pre_tmp),
            "act_total": post_act,
            "input_per_module": inputs,
            "output_per_module": outputs,
            "fw_runtime_per_module": sum(graph.nodes[i].time_s for i in f) * 1e3,
            "bw_runtime_per_module": sum(graph.nodes[i].time_s for i in b) * 1e3,
            "is_leaf": False,
            "sac_runtime": sum(sac.runtimes),
            "sac_memory": sum(sac.memory),
            "n_segments": len(slopes),
            "slopes": slopes,
            "intercepts": intercepts,
            "breakpoints": breaks,
            "tradeoff_curve": curve,
        }  # fmt: skip

    names = [f"{ROOT}.{u}" for u in order]
    mod_stats = [stats(ROOT, "", fwd_all, bwd_all)]
    mod_stats += [stats(fqn, u, span_f[u], span_b[u]) for fqn, u in zip(names, order, strict=True)]
    return {
        "mod_order": {
            "fw_pre_order": [ROOT, *names],
            "fw_post_order": [*names, ROOT],
            "bw_pre_order": [ROOT, *reversed(names)],
            "bw_post_order": [*reversed(names), ROOT],
        },
        "mod_stats": mod_stats,
    }


def solve_sac(
    graph: Graph, rank_graph: Graph, units: tuple[str, ...], budget_bytes: int, world_size: int
) -> SacResult:
    """Run ``sac_milp`` on ``graph``'s figures at ``budget_bytes`` per rank, then torch's
    per-module policy for each unit it checkpoints; the result as a plan of ``rank_graph`` (the
    per-rank step of the same trace, or ``graph`` itself for one process)."""
    from torch.distributed._tools.ilp_utils import parse_module_info
    from torch.distributed._tools.sac_ilp import (
        get_optimal_checkpointing_policy_per_module,
        sac_milp,
    )

    info = module_info(graph, units)
    tree = parse_module_info(info)  # type: ignore[arg-type]
    names = info["mod_order"]["fw_pre_order"][1:]
    log = logging.getLogger("torch.distributed._tools.sac_ilp")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        decisions, rct_ms, peak = sac_milp(
            tree, budget_bytes / 2**30, world_size=world_size, ac_units=names, fsdp_units=names
        )
    finally:
        log.setLevel(level)
    if peak < 0:
        return SacResult(None, {}, -1, 0.0)
    regions, saves = [], {}
    chosen = {fqn[len(ROOT) + 1 :]: r for fqn, r in decisions.items()}
    for unit, discard in chosen.items():
        stats = sac_stats(graph, unit)
        # an op of neither memory nor time gets no term in torch's knapsack, and pulp leaves
        # its variable without a value (``round(None)``): a nanosecond makes it a term
        stats.runtimes = [max(t, 1e-6) for t in stats.runtimes]
        keep = get_optimal_checkpointing_policy_per_module(stats, max(0.0, 1.0 - discard))
        if not keep:
            raise RuntimeError(f"torch's per-module policy found no solution for {unit!r}")
        ids = [nd.id for nd in graph.forward_nodes if nd.module and block_key(nd.module) == unit]
        save = frozenset(i for i, k in zip(ids, keep, strict=True) if k)
        reg = checkpoint_class.region(rank_graph, unit, save)
        regions.append(reg)
        saves[unit] = reg.save
    plan = (
        checkpoint_class.checkpoint_plan(rank_graph, regions) if regions else eager_plan(rank_graph)
    )
    return SacResult(plan, chosen, model_peak(info, decisions, world_size), rct_ms / 1e3, saves)


def model_peak(info: dict[str, Any], decisions: dict[str, float], world_size: int) -> int:
    """The peak of ``sac_milp``'s memory model (its rows, in bytes) with ``decisions`` (fqn ->
    discarded share): per module, the activations at the end of its forward and the gradients of
    its backward, less what the modules before it in forward post-order discard, plus the
    parameters and gradients over ``world_size``."""
    stats = {s["fqn"]: s for s in info["mod_stats"]}
    post = info["mod_order"]["fw_post_order"]
    params = stats[ROOT]["param_per_module"]
    peak = 0.0
    for s in info["mod_stats"]:
        discarded = 0.0
        for fqn in post[: post.index(s["fqn"])]:
            if fqn in decisions:
                acm = max(stats[fqn]["sac_memory"], stats[fqn]["act_fw_per_module"])
                discarded += acm * decisions[fqn] - (acm - stats[fqn]["act_fw_per_module"])
        act = s["act_total"] + s["act_grad_per_module"] - discarded
        peak = max(peak, act + (params + s["grad_total"]) / world_size)
    return round(peak)
