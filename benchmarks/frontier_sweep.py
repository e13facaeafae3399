"""One model, a range of budgets: the frontier remat answers, and the step time of its plans.

The issue's sweep: transformers Llama (4 layers, hidden 256, batch 8, seq 128, random weights,
nothing downloaded; ``benchmarks/cost_model.py``'s ``build_llama``) traced with the default
cost model (the local CPU's roofline), ``remat.frontier`` with ``auto`` over ``--points``
budgets from ``--low`` to ``--high`` MiB (peak bytes, static included). Printed per budget: the
status, the plan's peak, its predicted overhead over the eager schedule, and which distinct
plan it is. The last lines check that the overhead never rises with the budget and count the
distinct plans.

``--measure K`` also runs K of the distinct plans (spread over the range) with the op-level
executor, interleaved with the plain eager step (one torch thread, the process's CPU time,
garbage collection off while timing, medians of ``--repeats``), and prints measured against
predicted ratios. No threshold is asserted: the machine is shared; the load is printed.

Run: ``.venv/bin/python benchmarks/frontier_sweep.py [--low 70] [--high 112] [--points 10]
[--time-limit 10] [--measure 3] [--repeats 7]``.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.cost_model import _eager_step, _time_interleaved, build_llama
from remat.executor import compile_step
from remat.solver import frontier
from remat.tracer import capture
from remat.tracer.costs import apply_costs

MIB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--low", type=float, default=70.0, help="MiB")
    ap.add_argument("--high", type=float, default=112.0, help="MiB")
    ap.add_argument("--points", type=int, default=10)
    ap.add_argument("--time-limit", type=float, default=10.0, help="per budget (seconds)")
    ap.add_argument("--measure", type=int, default=0, help="time this many distinct plans")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    model, inputs, loss_fn = build_llama()
    cap = capture(model, inputs, loss_fn)
    graph = apply_costs(cap, None)
    step = (args.high - args.low) / max(1, args.points - 1)
    budgets = [round((args.low + i * step) * MIB) for i in range(args.points)]
    t0 = time.perf_counter()
    fr = frontier(graph, budgets, time_limit_s=args.time_limit)
    solve_s = time.perf_counter() - t0
    print(
        f"# {graph.name}: {graph.num_nodes} nodes, eager peak {fr.eager_peak_bytes / MIB:.2f} "
        f"MiB, static {fr.static_bytes / MIB:.2f} MiB, smallest plan known "
        f"{(fr.min_budget_bytes or 0) / MIB:.2f} MiB; frontier of {args.points} budgets in "
        f"{solve_s:.0f} s (load average {os.getloadavg()[0]:.1f})"
    )
    print("| budget | status | peak | predicted overhead | plan | method |")
    print("|---:|---|---:|---:|---:|---|")
    ids: dict[tuple[tuple[str, str], ...], int] = {}
    plans = []
    prev = float("inf")
    monotone = True
    for b, r in zip(budgets, fr.results, strict=True):
        if r.plan is None or r.figures is None or r.overhead is None:
            print(f"| {b / MIB:.1f} MiB | {r.status} | | | | |")
            continue
        key = tuple((s.op, s.id) for s in r.plan.steps)
        if key not in ids:
            ids[key] = len(ids) + 1
            plans.append((b, r))
        monotone &= r.overhead <= prev + 1e-12
        prev = r.overhead
        print(
            f"| {b / MIB:.1f} MiB | {r.status} | {r.figures.peak_bytes / MIB:.2f} MiB | "
            f"{r.overhead:+.1%} | #{ids[key]} | {r.solver} |"
        )
    print(f"# distinct plans: {len(ids)}; overhead never rises with the budget: {monotone}")
    if args.measure <= 0 or not plans:
        return
    k = min(args.measure, len(plans))
    chosen = [plans[round(i * (len(plans) - 1) / max(1, k - 1))] for i in range(k)]
    chosen = list({id(r): (b, r) for b, r in chosen}.values())
    runs = [(_eager_step(model, inputs, loss_fn), model)]
    for _, r in chosen:
        m = copy.deepcopy(model)
        runs.append((compile_step(m, inputs, loss_fn, r, capture=cap), m))
    load0 = os.getloadavg()[0]
    medians = _time_interleaved(runs, args.repeats, time.thread_time)
    print(
        f"# measured: one torch thread, CPU clock, median of {args.repeats} interleaved steps; "
        f"load average {load0:.1f} -> {os.getloadavg()[0]:.1f}; eager {medians[0] * 1e3:.0f} ms"
    )
    print("| budget | plan | peak | predicted | measured | error |")
    print("|---:|---:|---:|---:|---:|---:|")
    for (b, r), t in zip(chosen, medians[1:], strict=True):
        assert r.plan is not None and r.figures is not None and r.overhead is not None
        key = tuple((s.op, s.id) for s in r.plan.steps)
        pred = 1 + r.overhead
        meas = t / medians[0]
        print(
            f"| {b / MIB:.1f} MiB | #{ids[key]} | {r.figures.peak_bytes / MIB:.2f} MiB | "
            f"{pred:.3f}x | {meas:.3f}x | {pred / meas - 1:+.1%} |"
        )


if __name__ == "__main__":
    main()
