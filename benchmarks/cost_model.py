"""Cost models against the clock: predicted vs measured step-time ratios of real plans.

For each model (the examples in ``examples/models.py`` and transformers models with random
weights, nothing downloaded), each cost model (``default``: the roofline of the local CPU that
``remat.trace`` uses when given no cost; ``measure``; ``flops``) and each solver (``none``,
``checkpoint-all``, ``rotor``, ``auto``) at a budget of 50% of the activation memory, the
plan is run by the op-level executor (``remat.compile_step``) and timed against the plain
eager step (autograd), in turns: one warm-up round, then ``--repeats`` rounds of eager and every
distinct plan, medians (and, beside them, the fastest step of each over the fastest eager step:
the figure least moved by other processes on a shared machine). The predicted ratio is the
simulator's time of the plan over that of the eager schedule on the same graph; the measured
one is the executor's median over eager's.
The process is pinned to one core (``--core``, like ``taskset -c 0``) with one torch thread.

No threshold is asserted: the machine is shared; the load average is printed with the table.

Run: ``.venv/bin/python benchmarks/cost_model.py [--models gpt,resnet,llama] [--costs
default,measure] [--solvers none,checkpoint-all,rotor,auto] [--repeats 9] [--budget 0.5]
[--quick]``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn

from examples.models import build_gpt, build_mlp, build_resnet, build_unet, build_vit
from remat import solver as solvers
from remat.executor import compile_step
from remat.ir import Plan, eager_plan, resolve_budget, simulate
from remat.tracer import capture
from remat.tracer.costs import apply_costs

Built = tuple[nn.Module, Any, Any]


def build_llama(*, batch: int = 8, seq: int = 128, hidden: int = 256, layers: int = 4) -> Built:
    """transformers Llama with random weights (the issue's 4 layers, hidden 256, 8 x 128)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=688,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max(256, seq),
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))

    def loss_fn(out: Any) -> torch.Tensor:
        return nn.functional.cross_entropy(out.logits.flatten(0, 1), ids.flatten())

    return model, (ids,), loss_fn


def build_gpt2(*, batch: int = 8, seq: int = 128, hidden: int = 256, layers: int = 4) -> Built:
    """transformers GPT-2 with random weights, dropout on."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=1024, n_positions=max(256, seq), n_embd=hidden, n_layer=layers, n_head=4
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))

    def loss_fn(out: Any) -> torch.Tensor:
        return nn.functional.cross_entropy(out.logits.flatten(0, 1), ids.flatten())

    return model, (ids,), loss_fn


MODELS: dict[str, Callable[[], Built]] = {
    "mlp": lambda: build_mlp(batch=256, in_features=512, hidden=1024, depth=6),
    "gpt": lambda: build_gpt(batch=8, seq=128, vocab=1024, d_model=128, n_layers=4, n_heads=4),
    "resnet": lambda: build_resnet(batch=16, image=32, width=16, blocks_per_stage=2, stages=3),
    "unet": lambda: build_unet(batch=4, image=64, width=8, depth=3),
    "vit": lambda: build_vit(batch=16, image=32, patch=4, d_model=128, depth=4, n_heads=4),
    "llama": build_llama,
    "gpt2": build_gpt2,
}
QUICK: dict[str, Callable[[], Built]] = {
    "mlp": lambda: build_mlp(batch=32, in_features=64, hidden=128, depth=3),
    "gpt": lambda: build_gpt(batch=2, seq=32, vocab=128, d_model=32, n_layers=2, n_heads=2),
    "resnet": lambda: build_resnet(batch=2, image=16, width=8, blocks_per_stage=1, stages=2),
    "unet": lambda: build_unet(batch=1, image=32, width=4, depth=2),
    "vit": lambda: build_vit(batch=2, image=16, patch=4, d_model=32, depth=2, n_heads=2),
    "llama": lambda: build_llama(batch=2, seq=32, hidden=64, layers=2),
    "gpt2": lambda: build_gpt2(batch=2, seq=32, hidden=64, layers=2),
}


def _eager_step(model: nn.Module, inputs: Any, loss_fn: Any) -> Callable[[], None]:
    def step() -> None:
        loss_fn(model(*inputs)).backward()

    return step


def _time_interleaved(
    runs: list[tuple[Callable[[], None], nn.Module]], repeats: int, clock: Callable[[], float]
) -> list[list[float]]:
    samples: list[list[float]] = [[] for _ in runs]
    gc.collect()
    gc.disable()  # as timeit does: a collection of the whole process is no step's cost
    try:
        for r in range(repeats + 1):
            for k, (run, model) in enumerate(runs):
                for p in model.parameters():
                    p.grad = None
                torch.manual_seed(0)
                t0 = clock()
                run()
                if r:
                    samples[k].append(clock() - t0)
    finally:
        gc.enable()
    return samples


def bench_model(
    name: str, built: Built, costs: list[str], names: list[str], budget: float, args: Any
) -> list[dict[str, Any]]:
    model, inputs, loss_fn = built
    cap = capture(model, inputs, loss_fn)
    plans: dict[tuple[Any, ...], Plan] = {}
    rows: list[dict[str, Any]] = []
    for cost in costs:
        graph = apply_costs(
            cap, None if cost == "default" else cost, model=model, example_inputs=inputs
        )
        eager_s = simulate(graph, eager_plan(graph)).total_time_s
        b = resolve_budget(graph, budget)
        for solver in names:
            limit = args.time_limit if solver in ("auto", "milp", "lp-round") else None
            r = solvers.get(solver)(graph, b, time_limit_s=limit)
            if r.plan is None:
                continue
            key = tuple((s.op, s.id) for s in r.plan.steps)
            plans.setdefault(key, r.plan)
            sim = simulate(graph, r.plan)
            rows.append(
                {
                    "model": name,
                    "nodes": graph.num_nodes,
                    "cost": cost,
                    "solver": solver,
                    "status": r.status,
                    "key": key,
                    "predicted": sim.total_time_s / eager_s,
                    "eager_predicted_s": eager_s,
                }
            )
    keys = list(plans)
    runs: list[tuple[Callable[[], None], nn.Module]] = [
        (_eager_step(model, inputs, loss_fn), model)
    ]
    for k in keys:
        m = copy.deepcopy(model)
        runs.append((compile_step(m, inputs, loss_fn, plans[k], capture=cap), m))
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    samples = _time_interleaved(runs, args.repeats, clock)
    medians = [statistics.median(s) for s in samples]
    fastest = [min(s) for s in samples]
    by_key = dict(zip(keys, zip(medians[1:], fastest[1:], strict=True), strict=True))
    for row in rows:
        median, least = by_key[row.pop("key")]
        row["measured"] = median / medians[0]
        row["measured_min"] = least / fastest[0]
        row["eager_measured_s"] = medians[0]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--models", default="mlp,gpt,resnet,unet,vit,llama,gpt2")
    ap.add_argument("--costs", default="default,measure")
    ap.add_argument("--solvers", default="none,checkpoint-all,rotor,auto")
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--time-limit", type=float, default=10.0, help="for auto (seconds)")
    ap.add_argument("--core", type=int, default=0, help="pin to this core (-1: do not pin)")
    ap.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu: this thread's CPU time (one torch thread: the step runs on it; time the "
        "scheduler gives to other processes is not counted); wall: the wall clock",
    )
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    args = ap.parse_args()
    if args.core >= 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    table = QUICK if args.quick else MODELS
    costs = args.costs.split(",")
    names = args.solvers.split(",")
    load0 = os.getloadavg()
    print(
        f"# one core ({args.core}), 1 thread, budget {args.budget:.0%}, median of "
        f"{args.repeats} interleaved steps, {args.clock} clock; load average at start "
        f"{load0[0]:.1f} "
        f"on {os.cpu_count()} cores"
    )
    print(
        "| model | nodes | cost | solver | status | predicted | measured | error "
        "| measured, fastest | error |"
    )
    print("|---|---:|---|---|---|---:|---:|---:|---:|---:|")
    errors: dict[str, list[float]] = {c: [] for c in costs}
    for name in args.models.split(","):
        t0 = time.perf_counter()
        rows = bench_model(name, table[name](), costs, names, args.budget, args)
        for r in rows:
            err = r["predicted"] / r["measured"] - 1
            err_min = r["predicted"] / r["measured_min"] - 1
            errors[r["cost"]].append(abs(err))
            print(
                f"| {r['model']} | {r['nodes']} | {r['cost']} | {r['solver']} | {r['status']} | "
                f"{r['predicted']:.3f}x | {r['measured']:.3f}x | {err:+.1%} | "
                f"{r['measured_min']:.3f}x | {err_min:+.1%} |",
                flush=True,
            )
        print(
            f"<!-- {name}: eager {rows[0]['eager_measured_s'] * 1e3:.1f} ms measured, "
            f"{time.perf_counter() - t0:.0f} s -->",
            flush=True,
        )
    load1 = os.getloadavg()
    print(f"# load average at end {load1[0]:.1f}")
    for c, e in errors.items():
        if e:
            print(f"# {c}: median |error| {statistics.median(e):.1%}, max {max(e):.1%}")


if __name__ == "__main__":
    main()
