"""The zoo table: transformers models through ``remat.apply`` in both modes, on the CPU.

For each model of ``tests/zoo`` (small configurations, random weights), each budget (70% and
50% of the no-remat activation memory) and each ``apply`` mode: the plan (``auto`` for the
op-level mode, ``remat.solve(..., executor="checkpoint")`` for checkpoint regions) runs one
plain training step (``loss = model(**batch)...; loss.backward()``) on a fresh copy, measured
with the storage tracker. Printed: graph nodes, budget, predicted and measured peak (static +
dynamic), the dynamic difference, whether the measured peak is within the budget (or the class
found no plan within it: ``infeasible``), and the largest gradient difference from the
unmodified model (0 is bit for bit). The same cases are asserted by ``tests/zoo``.

Run: ``.venv/bin/python benchmarks/zoo.py [--models llama,gpt2] [--time-limit 5]``.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "zoo"))

from _zoo import ZOO, reference_grads, run_case  # noqa: E402

from remat.ir import resolve_budget  # noqa: E402
from remat.tracer import trace_capture  # noqa: E402

SEED = 7


def _kib(b: int) -> str:
    return f"{b / 1024:.1f}"


def run_model(name: str, fractions: list[float], time_limit_s: float) -> list[dict[str, Any]]:
    model, inputs, loss_fn = ZOO[name]()
    cap = trace_capture(model, inputs, loss_fn, cost="flops")
    graph = cap.graph
    grads = reference_grads(model, inputs, loss_fn, SEED)
    rows = []
    for frac in fractions:
        budget = resolve_budget(graph, frac)
        for mode in ("op", "checkpoint"):
            case = run_case(
                model, inputs, loss_fn, cap, budget, mode, time_limit_s=time_limit_s, seed=SEED
            )
            mem, sim = case.measured, case.simulation
            diff = max(
                float((p.grad - grads[n]).abs().max())
                for n, p in case.run.named_parameters()
                if n in grads and p.grad is not None
            )
            rows.append(
                {
                    "model": name,
                    "nodes": graph.num_nodes,
                    "mode": mode,
                    "frac": frac,
                    "budget": budget,
                    "predicted": sim.peak_bytes,
                    "measured": mem.peak_bytes,
                    "dyn_rel": mem.peak_dynamic_bytes / sim.peak_dynamic_bytes - 1.0,
                    "within": "yes"
                    if mem.peak_bytes <= budget
                    else ("no (infeasible)" if not case.result.fits else "NO"),
                    "grad_diff": diff,
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(ZOO))
    ap.add_argument("--time-limit", type=float, default=5.0)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    print(
        "| model | nodes | mode | budget | budget KiB | predicted KiB | measured KiB | dynamic "
        "diff | within budget | grad max diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        for r in run_model(name, [0.7, 0.5], args.time_limit):
            print(
                f"| {r['model']} | {r['nodes']} | {r['mode']} | {r['frac']:.0%} | "
                f"{_kib(r['budget'])} | {_kib(r['predicted'])} | {_kib(r['measured'])} | "
                f"{r['dyn_rel']:+.2%} | {r['within']} | {r['grad_diff']:.3g} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
