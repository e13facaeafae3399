"""Plans run for real: predicted vs measured peak memory and step time, on larger example models.

For each model, solver and budget (70% and 50% of the no-remat activation memory), the plan is
run by the op-level executor (``--executor module`` for ``remat.apply``, ``both`` for both) via
``remat.verify``: predicted and measured peak (static + dynamic, exact on the CPU), whether the
gradients equal the unmodified model's bit for bit, and the step-time ratio over eager
(predicted by the simulator from measured node times, and measured as medians of interleaved
steps). No threshold is asserted: machines are noisy.

Run: ``.venv/bin/python benchmarks/executor.py [--models gpt,resnet] [--solvers none,milp]
[--executor op|module|both] [--repeats 3] [--milp-time-limit 60] [--quick]``.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.models import build_gpt, build_mlp, build_resnet, build_unet, build_vit
from remat import solver as solvers
from remat.executor import verify
from remat.ir import resolve_budget
from remat.ir.budget import format_bytes
from remat.tracer import trace_capture

LARGE: dict[str, Any] = {
    "mlp": lambda: build_mlp(batch=512, in_features=512, hidden=1024, depth=8),
    "gpt": lambda: build_gpt(batch=8, seq=128, vocab=1024, d_model=128, n_layers=4, n_heads=4),
    "resnet": lambda: build_resnet(batch=16, image=32, width=16, blocks_per_stage=2, stages=3),
    "unet": lambda: build_unet(batch=4, image=64, width=8, depth=3),
    "vit": lambda: build_vit(batch=16, image=32, patch=4, d_model=128, depth=4, n_heads=4),
}
QUICK: dict[str, Any] = {
    "mlp": lambda: build_mlp(batch=64, in_features=128, hidden=256, depth=4),
    "gpt": lambda: build_gpt(batch=2, seq=32, vocab=128, d_model=32, n_layers=2, n_heads=2),
    "resnet": lambda: build_resnet(batch=2, image=16, width=8, blocks_per_stage=1, stages=2),
    "unet": lambda: build_unet(batch=1, image=32, width=4, depth=2),
    "vit": lambda: build_vit(batch=2, image=16, patch=4, d_model=32, depth=2, n_heads=2),
}
SOLVERS = ["none", "checkpoint-all", "sqrt", "rotor", "milp"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(LARGE))
    ap.add_argument("--solvers", default=",".join(SOLVERS))
    ap.add_argument("--budgets", default="0.7,0.5")
    ap.add_argument("--executor", choices=["op", "module", "both"], default="op")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--milp-time-limit", type=float, default=60.0)
    ap.add_argument("--cost", default="measure", help="tracer cost model (measure, flops, ...)")
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    args = ap.parse_args()
    sizes = QUICK if args.quick else LARGE
    executors = ["op", "module"] if args.executor == "both" else [args.executor]
    registered = set(solvers.available())
    warnings.simplefilter("ignore")  # module-level approximations are reported in the table

    header = (
        f"{'model':7} {'solver':15} {'budget':>6} {'status':10} {'exec':6} {'predicted':>11} "
        f"{'measured':>11} {'dyn err':>8} {'<=budget':>8} {'grads':>6} {'t pred':>7} "
        f"{'t meas':>7} {'solve s':>7}"
    )
    print(header)
    print("-" * len(header))
    for name in args.models.split(","):
        model, inputs, loss_fn = sizes[name]()
        t0 = time.perf_counter()
        cap = trace_capture(model, inputs, loss_fn, cost=args.cost)
        graph = cap.graph
        print(
            f"# {name}: {graph.num_nodes} nodes, static {format_bytes(graph.static_bytes)}, "
            f"traced in {time.perf_counter() - t0:.1f} s"
        )
        for sname in args.solvers.split(","):
            if sname not in registered:
                print(f"{name:7} {sname:15} (not registered)")
                continue
            for frac in (float(x) for x in args.budgets.split(",")):
                budget = resolve_budget(graph, frac)
                opts = {"time_limit_s": args.milp_time_limit} if sname == "milp" else {}
                try:
                    result = solvers.get(sname)(graph, budget, **opts)
                except Exception as exc:  # a solver's bug: report and go on
                    print(f"{name:7} {sname:15} {frac:6.0%} solver error: {exc}")
                    continue
                if result.plan is None:
                    print(f"{name:7} {sname:15} {frac:6.0%} {result.status:10} (no plan)")
                    continue
                for ex in executors:
                    rep = verify(
                        model,
                        inputs,
                        loss_fn,
                        result,
                        executor=ex,
                        capture=cap,
                        repeats=args.repeats,
                    )
                    tp = f"{rep.predicted_time_ratio:.2f}" if rep.predicted_time_ratio else "?"
                    tm = f"{rep.measured_time_ratio:.2f}" if rep.measured_time_ratio else "?"
                    print(
                        f"{name:7} {sname:15} {frac:6.0%} {result.status:10} {ex:6} "
                        f"{format_bytes(rep.predicted_peak_bytes):>11} "
                        f"{format_bytes(rep.measured_peak_bytes):>11} "
                        f"{rep.dynamic_error:+8.2%} {'yes' if rep.within_budget else 'NO':>8} "
                        f"{'exact' if rep.grads_bitwise_equal else 'DIFF':>6} {tp:>7} {tm:>7} "
                        f"{result.solve_time_s:7.2f}"
                    )
                sys.stdout.flush()


if __name__ == "__main__":
    main()
