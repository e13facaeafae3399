"""Per-op check of the default roofline: each op kind's predicted time against its time in
the step.

Traces one model of ``benchmarks/cost_model.py``, prices its nodes with the default roofline
of the local CPU, and runs the plan of ``none`` and of ``--solver`` with the op-level executor
(``remat.compile_step``), timing every plan step where it runs (the executor's ``probe`` hook,
on the thread's CPU clock; medians of ``--repeats`` steps). Per op kind (the ATen op, the key
of the profile that prices it and the input shapes) it prints the predicted and the in-step
total and their ratio over the whole step's ratio: a kind far from 1.00 is mispriced against
the rest of the step, which is what moves a plan's predicted overhead. The last column is the
in-step time of that kind's recomputations in the solver's plan.

Run: ``.venv/bin/python benchmarks/cost_ops.py [--model gpt] [--solver auto] [--top 25]``.
One core (``--core``), one torch thread, as ``cost_model.py`` runs.
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
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.cost_model import MODELS
from remat import solver as solvers
from remat.executor import compile_step
from remat.ir import Plan, eager_plan, resolve_budget, simulate
from remat.tracer import capture
from remat.tracer.costs import apply_costs, cost_key
from remat.tracer.profile import cpu_profile


def _shape(fx: torch.fx.Node) -> str:
    shapes = []
    for a in fx.all_input_nodes:
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor) and v.dim():
            shapes.append("x".join(map(str, v.shape)))
    return ",".join(shapes)


def step_times(model, inputs, loss_fn, cap, plans: list[Plan], repeats: int) -> list[list[float]]:
    """The median time of each plan step where it runs in the compiled step, for each plan;
    the plans' steps are run in turns (one warm-up round)."""
    marks: list[float] = []
    clock = time.thread_time

    def probe(i: int) -> None:
        marks.append(clock())

    steps = []
    for plan in plans:
        m = copy.deepcopy(model)
        steps.append((m, compile_step(m, inputs, loss_fn, plan, capture=cap, probe=probe)))
    samples: list[list[list[float]]] = [[[] for _ in plan.steps] for plan in plans]
    gc.collect()
    gc.disable()
    try:
        for r in range(repeats + 1):
            for k, (m, step) in enumerate(steps):
                for p in m.parameters():
                    p.grad = None
                torch.manual_seed(0)
                marks.clear()
                marks.append(clock())
                step()
                if r:
                    for i in range(len(plans[k].steps)):
                        samples[k][i].append(marks[i + 1] - marks[i])
    finally:
        gc.enable()
    return [[statistics.median(s) for s in per_plan] for per_plan in samples]


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default="gpt")
    ap.add_argument("--solver", default="auto", help="'' for none")
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--core", type=int, default=0, help="-1: do not pin")
    args = ap.parse_args()
    if args.core >= 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    model, inputs, loss_fn = MODELS[args.model]()
    cap = capture(model, inputs, loss_fn)
    profile = cpu_profile()
    graph = apply_costs(cap, profile)
    predicted = {n.id: n.time_s for n in graph.nodes}
    eager = eager_plan(graph)
    plan = None
    if args.solver:
        plan = solvers.get(args.solver)(graph, resolve_budget(graph, args.budget)).plan
    timed = step_times(
        model, inputs, loss_fn, cap, [eager] + ([plan] if plan else []), args.repeats
    )
    eager_steps = timed[0]
    in_step = {s.id: t for s, t in zip(eager.steps, eager_steps, strict=True) if s.op == "compute"}
    step = sum(eager_steps) / sum(predicted.values())
    redo: dict[str, float] = defaultdict(float)
    redo_pred = 0.0
    if plan is not None:
        times = timed[1]
        seen: set[str] = set()
        for s, t in zip(plan.steps, times, strict=True):
            if s.op == "compute":
                if s.id in seen:
                    redo[s.id] += t
                    redo_pred += predicted[s.id]
                seen.add(s.id)
        sim = simulate(graph, plan).total_time_s / simulate(graph, eager).total_time_s
        print(
            f"# {args.solver} at {args.budget:.0%}: predicted {sim:.3f}x, in-step "
            f"{sum(times) / sum(eager_steps):.3f}x; its recomputations: predicted "
            f"{redo_pred / sum(predicted.values()):.1%} of the step, in-step "
            f"{sum(redo.values()) / sum(eager_steps):.1%}"
        )
    groups: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0, 0.0])
    for nid, fx in cap.node_fx.items():
        op = str(fx.target).removeprefix("aten.")
        g = groups[(op, cost_key(fx, profile), _shape(fx))]
        g[0] += predicted[nid]
        g[1] += in_step.get(nid, 0.0)
        g[2] += 1
        g[3] += redo.get(nid, 0.0)
    print(
        f"# {args.model}: {len(cap.node_fx)} nodes; step: predicted "
        f"{sum(predicted.values()) * 1e3:.1f} ms, in-step {sum(eager_steps) * 1e3:.1f} ms "
        f"(ratio {step:.2f}); load {os.getloadavg()[0]:.1f}"
    )
    print("| op | key | input shapes | n | predicted ms | in-step ms | ratio / step | redone ms |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    ranked = sorted(groups.items(), key=lambda kv: -abs(kv[1][1] - kv[1][0] * step))
    for (op, key, shape), (p_s, m_s, n, redo_s) in ranked[: args.top]:
        rel = (m_s / p_s / step) if p_s > 0 else float("inf")
        print(
            f"| {op} | {key} | {shape} | {n} | {p_s * 1e3:.2f} | {m_s * 1e3:.2f} | {rel:.2f} | "
            f"{redo_s * 1e3:.2f} |"
        )


if __name__ == "__main__":
    main()
