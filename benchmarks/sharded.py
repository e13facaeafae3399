"""Sharded-training benchmark: per-rank peak and step overhead under FSDP2, predicted and measured.

Two parts.

``measured``: a two-process gloo group on this CPU (``init_device_mesh("cpu", (2,))``, each
decoder layer a ``fully_shard`` unit, then the root), small transformers models (a Llama and a
GPT-2, random weights, nothing downloaded). Rows: FSDP2 with no checkpointing, full per-layer
checkpointing (every layer a ``torch.utils.checkpoint`` region saving nothing: torchtitan's
default), remat at full checkpointing's per-rank peak and at 50 % / 30 % (static bytes plus that
share of the eager dynamic peak). Each plan is applied in checkpoint mode before ``fully_shard``,
one SGD step warms up, and the second step's forward and backward are measured on every rank
with remat's tracker (:func:`remat.executor.measure_sharded.measure_sharded`); the table gives
the larger rank's peak beside the prediction of the per-rank graph
(:func:`remat.ir.shard.shard_graph`).

Where the profile has a host link (``planned``), remat's rows offload blocks too
(:mod:`remat.executor.offload_blocks`), and its recompute-only rows stand beside them; on the CPU
group (no link) one more row offloads at full checkpointing's peak (``offload=True``), its
prediction the plan's with copies done at once, as this CPU's are. The bound of a row that may
offload is :func:`remat.solver.offload.combined_bound`.

``planned``: Llama configurations of about 7B and 70B parameters (seq 4,096, batch 1, float32)
traced on the meta device with the ``h100`` roofline (benchmarks/scale.py's cached graphs), at
world sizes 8 and 64, every layer a unit: the same rows, predicted only. The collectives are
priced on the profile's NVLink (no overlap with compute modelled). The bound column is the
solver's own proven bound, or where the checkpoint class claims none, the bound proven over
every op-level recompute-only schedule (:func:`remat.solver.bounds.best_bound`), a wider class:
no plan the checkpoint executor runs under FSDP2 is faster. ``--big`` adds 70B's remat
rows (the checkpoint-class search takes minutes per budget on its 8,438 nodes).

``sac_milp`` rows: PyTorch's own module-level MILP
(``torch.distributed._tools.sac_ilp.sac_milp``, then its per-module op policy) at each of remat's
budgets, with ``world_size`` and the units as its FSDP units. Its inputs come from remat's graph
of the same step (benchmarks/sac_torch.py), since ``SACEstimator`` will not run on this CPU
(FIELD-NOTES). Its decisions run as checkpoint regions with torch's selective-checkpoint
policies, so its rows are predicted on the per-rank graph and measured on the CPU group like
remat's; "own estimate" is ``sac_milp``'s own model of that plan's peak and overhead.

``FSDPMemTracker`` (``torch.distributed._tools.fsdp2_mem_tracker``), PyTorch's own tracker of a
sharded step, runs on the CPU group too: each rank measures one more step with it, and its peak
total stands beside the prediction (the error in brackets is the prediction's against it).

Usage::

    .venv/bin/python benchmarks/sharded.py [--part measured,planned] [--big] [--time-limit 30]
        [--models llama7b,llama70b]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import socket
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sac_torch import solve_sac

import remat
from remat.ir import Graph, Plan, checkpoint_class, eager_plan, format_bytes, simulate
from remat.ir.shard import shard_graph
from remat.ir.sharding import ShardingSpec
from remat.solver.bounds import best_bound
from remat.solver.deadline import Deadline
from remat.solver.offload import combined_bound, has_host_link

WORLD = 2
FRACTIONS = (0.5, 0.3)


# -- the small models of the measured part -----------------------------------------------------


def build(kind: str) -> tuple[Any, tuple[Any, ...], Any, tuple[str, ...]]:
    """(model, inputs, loss_fn, units) of ``kind``: ``llama`` or ``gpt2``, seeded."""
    import torch
    import torch.nn.functional as F
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        cfg: Any = transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            use_cache=False,
        )
        model: Any = transformers.LlamaForCausalLM(cfg)
        units = tuple(f"model.layers.{i}" for i in range(4))
    else:
        cfg = transformers.GPT2Config(
            vocab_size=256,
            n_embd=64,
            n_layer=4,
            n_head=4,
            n_positions=128,
            use_cache=False,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        model = transformers.GPT2LMHeadModel(cfg)
        units = tuple(f"transformer.h.{i}" for i in range(4))
    model.train()
    idx = torch.randint(0, 256, (4, 128))

    def loss_fn(out: Any) -> torch.Tensor:
        logits = out.logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), idx.reshape(-1))

    return model, (idx,), loss_fn, units


def full_checkpointing(graph: Graph, units: tuple[str, ...]) -> Plan:
    """Every unit a checkpoint region saving only what it must (torchtitan's full AC)."""
    return checkpoint_class.checkpoint_plan(
        graph, [checkpoint_class.region(graph, u) for u in units]
    )


def _worker(
    rank: int, port: int, kind: str, graph_json: str, plans: dict[str, str], out: str
) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from remat.executor.measure_sharded import measure_sharded

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        model, (idx,), loss_fn, units = build(kind)
        x = (idx + rank) % 256  # each rank its own batch
        graph = Graph.from_json(graph_json)
        peaks: dict[str, int] = {}
        theirs: dict[str, int] = {}
        for name, plan_json in plans.items():
            m = copy.deepcopy(model)
            if plan_json:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    remat.apply(m, Plan.model_validate_json(plan_json), graph, mode="checkpoint")
            for u in units:
                fully_shard(m.get_submodule(u), mesh=mesh)
            fully_shard(m, mesh=mesh)
            opt = torch.optim.SGD(m.parameters(), lr=1e-3)

            def step(m: Any = m) -> None:
                loss = loss_fn(m(x))
                loss.backward()
                del loss

            step()
            opt.step()
            peaks[name] = measure_sharded(m, step, optimizer=opt, input_tensors=[x]).peak_bytes
            opt.step()
            theirs[name] = torch_tracker_peak(m, step, opt, x)
        Path(out, f"rank{rank}.json").write_text(json.dumps({"remat": peaks, "torch": theirs}))
    finally:
        dist.destroy_process_group()


def torch_tracker_peak(model: Any, step: Any, opt: Any, x: Any) -> int:
    """PyTorch's own measurement of one more step: ``FSDPMemTracker``'s peak total (it runs
    on the CPU with gloo), the sharded gradients held through the step as remat's static
    bytes count them (with gradients reset to None it leaves them out of a peak they reach
    only at the reduce-scatters)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    opt.zero_grad(set_to_none=False)  # kept, zeroed: remat's static bytes count them all step
    tracker = FSDPMemTracker(model, opt)
    tracker.track_inputs((x,))
    with tracker:
        step()
    snap = tracker.get_tracker_snapshot("peak")
    return max(int(v["Total"]) for v in snap.values())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rows(
    graph: Graph,
    units: tuple[str, ...],
    time_limit_s: float,
    solve: bool = True,
    unsharded: Graph | None = None,
) -> list[dict[str, Any]]:
    """The predicted rows of one per-rank graph: name, plan, peak, overhead, solve seconds;
    with ``unsharded`` (the step the rank graph was sharded from), ``sac_milp``'s rows at each
    of remat's budgets."""
    eager = simulate(graph, eager_plan(graph))
    base = eager.total_time_s
    rows: list[dict[str, Any]] = [
        {"row": "FSDP2, no checkpointing", "plan": None, "peak": eager.peak_bytes, "overhead": 0.0}
    ]
    full = full_checkpointing(graph, units)
    fs = simulate(graph, full)
    rows.append(
        {"row": "full per-layer checkpointing", "plan": full, "peak": fs.peak_bytes,
         "overhead": fs.total_time_s / base - 1}
    )  # fmt: skip
    if not solve:
        return rows
    budgets: list[tuple[str, Any]] = [("remat at full's peak", fs.peak_bytes)]
    budgets += [(f"remat at {f:.0%}", f) for f in FRACTIONS]
    # remat offloads blocks where the profile has a host link: the recompute-only rows beside
    # them; on the CPU group (no link) an offloading row at full's peak, measured like the rest
    variants: list[tuple[str, dict[str, Any]]] = [("remat", {})]
    if has_host_link(graph):
        variants += [("remat, recompute only,", {"offload": False})]
    for label, budget, name, opts in [
        (lb.replace("remat", name), b, name, opts)
        for lb, b in budgets
        for name, opts in variants
    ] + ([] if has_host_link(graph) else [
        ("remat + offloaded blocks at full's peak", fs.peak_bytes, "offload", {"offload": True})
    ]):  # fmt: skip
        t = time.perf_counter()
        r = remat.solve(graph, budget, time_limit_s=time_limit_s, **opts)
        bound_s = r.lower_bound_s
        offloads = opts.get("offload", has_host_link(graph))
        if bound_s is None and r.budget_bytes is not None:
            # the checkpoint class claims no bound: the one proven over every op-level
            # recompute-only schedule (a wider class) still bounds it from below, and where
            # it may offload, the bound over every schedule that also offloads
            limit = Deadline.after(time_limit_s)
            if offloads:
                bound_s = combined_bound(
                    graph, r.budget_bytes, upper_s=r.total_time_s, deadline=limit
                )
            else:
                bound_s = best_bound(graph, r.budget_bytes, deadline=limit).time_s
        bound = None if bound_s is None else bound_s / base - 1
        moved = checkpoint_class.offloads_of(graph, r.plan) if r.plan is not None else []
        rows.append(
            {"row": label, "plan": r.plan, "peak": r.peak_bytes, "overhead": r.overhead,
             "budget": r.budget_bytes, "fits": r.fits, "solve_s": time.perf_counter() - t,
             "bound": bound, "primary": name == "remat",
             "solver": r.solver + (f", {len(moved)} blocks offloaded" if moved else "")}
        )  # fmt: skip
    if unsharded is None or graph.sharding is None:
        return rows
    world = graph.sharding.world_size
    step_s = sum(n.time_s for n in unsharded.nodes)  # what sac_milp's recomputation is over
    for label, budget in [(r["row"], r["budget"]) for r in rows if r.get("primary")]:
        t = time.perf_counter()
        sac = solve_sac(unsharded, graph, units, budget, world)
        row: dict[str, Any] = {
            "row": label.replace("remat", "sac_milp"), "plan": sac.plan, "budget": budget,
            "solver": "sac_milp", "solve_s": time.perf_counter() - t,
            "own": (sac.milp_peak_bytes, sac.milp_recompute_s / step_s),
            "units": len(sac.decisions),
        }  # fmt: skip
        if sac.plan is None:
            row.update(peak=None, overhead=None, fits=False)
        else:
            sim = simulate(graph, sac.plan)
            row.update(
                peak=sim.peak_bytes,
                overhead=sim.total_time_s / base - 1,
                fits=sim.peak_bytes <= budget,
            )
        rows.append(row)
    return rows


def measured(kind: str, time_limit_s: float) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    model, inputs, loss_fn, units = build(kind)
    graph = remat.trace(model, inputs, loss_fn, cost="flops")
    rank = shard_graph(graph, ShardingSpec(world_size=WORLD, units=units))
    rows = _rows(rank, units, time_limit_s, unsharded=graph)
    for r in rows:
        if r["plan"] is not None and any(s.op == "offload" for s in r["plan"].steps):
            # this CPU's copies finish at once (host and device memory are one): the peak the
            # ranks will show is the plan's with a free link
            r["peak"] = simulate(rank, r["plan"], host_bandwidth_bytes_per_s=math.inf).peak_bytes
    plans = {
        r["row"]: (r["plan"].model_dump_json() if r["plan"] is not None else "")
        for r in rows
        if r["peak"] is not None
    }
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _worker,
            args=(_free_port(), kind, rank.to_json(), plans, out),
            nprocs=WORLD,
            join=True,
            start_method="spawn",
        )
        per_rank = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r in rows:
        if r["row"] in plans:
            r["measured"] = max(p["remat"][r["row"]] for p in per_rank)
            r["torch"] = max(p["torch"][r["row"]] for p in per_rank)
    return rows


def planned(name: str, world: int, time_limit_s: float, solve: bool) -> list[dict[str, Any]]:
    from scale import load_graph

    graph, _ = load_graph(name)
    units = tuple(p for p in checkpoint_class.blocks(graph) if p.startswith("model.layers."))
    rank = shard_graph(graph, ShardingSpec(world_size=world, units=units))
    return _rows(rank, units, time_limit_s, solve, unsharded=graph if solve else None)


def _table(title: str, rows: list[dict[str, Any]]) -> str:
    head = (
        "| row | budget | per-rank peak (predicted) | measured | error | FSDPMemTracker "
        "| overhead (predicted) | bound | solver | own estimate |"
    )
    lines = [f"### {title}", "", head, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r.get("measured")
        err = "" if m is None or r["peak"] is None else f"{(r['peak'] - m) / m:+.2%}"
        budget = "" if "budget" not in r else format_bytes(r["budget"])
        if "fits" in r and not r["fits"]:
            budget += (
                " (over budget)" if r.get("solver") == "sac_milp" and r["peak"] is not None
                else " (no plan fits: smallest shown)"
            )  # fmt: skip
        own = ""
        if "own" in r:
            own = "no solution" if r["own"][0] < 0 else (
                f"{format_bytes(r['own'][0])}, {r['own'][1]:+.1%}"
            )  # fmt: skip
        peak = "-" if r["peak"] is None else format_bytes(r["peak"])
        t = r.get("torch")
        torch_col = "" if t is None else format_bytes(t)
        if t is not None and r["peak"] is not None:
            torch_col += f" ({(r['peak'] - t) / t:+.2%})"
        overhead = "-" if r["overhead"] is None else f"{r['overhead']:+.1%}"
        lines.append(
            f"| {r['row']} | {budget} | {peak} "
            f"| {'' if m is None else format_bytes(m)} | {err} | {torch_col} | {overhead} "
            f"| {'' if r.get('bound') is None else format(r['bound'], '+.1%')} "
            f"| {r.get('solver', '')} | {own} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", default="measured,planned")
    ap.add_argument("--big", action="store_true", help="also solve the 70B graphs (slow)")
    ap.add_argument("--models", default="llama7b,llama70b", help="the planned part's graphs")
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--json", metavar="PATH", help="write the rows (without plans) as JSON")
    args = ap.parse_args()
    parts = set(args.part.split(","))
    out: dict[str, list[dict[str, Any]]] = {}
    if "measured" in parts:
        for kind in ("llama", "gpt2"):
            out[f"{kind}, 2 CPU ranks (gloo), measured"] = measured(kind, args.time_limit)
            print(_table(*list(out.items())[-1]), flush=True)
    if "planned" in parts:
        for name in args.models.split(","):
            for world in (8, 64):
                solve = name != "llama70b" or args.big
                key = f"{name}, {world} ranks, h100, planned"
                out[key] = planned(name, world, args.time_limit, solve)
                print(_table(key, out[key]), flush=True)
    if args.json:
        slim = {
            k: [{f: v for f, v in r.items() if f != "plan"} for r in rs] for k, rs in out.items()
        }
        Path(args.json).write_text(json.dumps(slim, indent=1))


if __name__ == "__main__":
    main()
