"""`make demo`: the main job end to end on a small GPT.

1. Trace one training step of the GPT example (``examples/models.py:gpt_demo``) into a costed
   graph, on fake tensors, with times from a measured profile of this CPU.
2. Print its eager (no-remat) peak, then for budgets of 90%, 70% and 50% of the eager
   activation memory every registered solver's status, simulated peak, time overhead and solve
   time, side by side.
3. Run the plan ``auto`` chose at the tightest budget on the real model (op-level executor) and
   print predicted vs measured peak and the gradient check against the unmodified model.
4. Train three steps with ``remat.apply``'s module in an ordinary loop (AdamW) and print
   predicted vs measured peak per step.

Run with ``python examples/demo.py [MODULE:FUNCTION]`` (what ``make demo`` does).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from remat import solver
from remat.ir import (
    Graph,
    GraphTooLargeError,
    SolveResult,
    eager_plan,
    format_bytes,
    resolve_budget,
    simulate,
)
from remat.ir.result import speed_key

FRACTIONS = (0.9, 0.7, 0.5)
SOLVER_TIME_LIMIT_S = 10.0
DEFAULT_SPEC = str(Path(__file__).resolve().parent / "models.py") + ":gpt_demo"


def _row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(
        c.ljust(w) if i == 0 else c.rjust(w)
        for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    )


def solver_table(
    graph: Graph, names: list[str]
) -> tuple[list[str], dict[float, dict[str, SolveResult]]]:
    """One line per (budget, solver): status, simulated peak, overhead, solve seconds."""
    widths = [16, 7, 11, 11, 9, 8]
    lines = [_row(["solver", "budget", "status", "peak", "overhead", "solve s"], widths)]
    lines.append("-" * (sum(widths) + 2 * (len(widths) - 1)))
    results: dict[float, dict[str, SolveResult]] = {}
    for frac in FRACTIONS:
        budget = resolve_budget(graph, frac)
        results[frac] = {}
        for name in names:
            try:
                r = solver.get(name)(graph, budget, time_limit_s=SOLVER_TIME_LIMIT_S)
            except GraphTooLargeError as exc:  # poet takes graphs of up to 16 nodes (40 at most)
                lines.append(_row([name, f"{frac:.0%}", "refused", "-", "-", "-"], widths))
                lines.append(f"  {exc}")
                continue
            results[frac][name] = r
            peak = format_bytes(r.peak_bytes) if r.peak_bytes is not None else "-"
            over = f"+{100 * r.overhead:.1f}%" if r.overhead is not None else "-"
            cells = [name, f"{frac:.0%}", r.status, peak, over, f"{r.solve_time_s:.2f}"]
            lines.append(_row(cells, widths))
        lines.append("")
    return lines, results


def training_loop(model: Any, inputs: Any, loss_fn: Any, result: Any, cap: Any) -> bool:
    """Three steps of an ordinary loop (AdamW) on ``remat.apply``'s module; prints predicted
    vs measured peak per step. True when every step is within 2% and within the budget."""
    import copy

    import torch

    import remat
    from remat.executor import measure, planned_steps

    run = remat.apply(
        copy.deepcopy(model), result, cap.graph, example_inputs=inputs, loss_fn=loss_fn, capture=cap
    )
    (planned,) = planned_steps(run)
    sim = planned.simulation
    opt = torch.optim.AdamW(run.parameters(), lr=1e-3)
    print("training loop: remat.apply(model, result), AdamW, 3 steps of")
    print("  opt.zero_grad(); loss = model(*batch); loss.backward(); opt.step()")
    ok = True
    losses: list[float] = []

    def user_step() -> None:
        loss = run(*inputs)
        loss.backward()
        losses.append(float(loss.detach()))

    for k in range(3):
        opt.zero_grad(set_to_none=True)
        mem = measure(run, inputs, optimizer=opt, step=user_step)
        opt.step()
        err = mem.peak_dynamic_bytes / sim.peak_dynamic_bytes - 1 if sim.peak_dynamic_bytes else 0
        # The optimizer's state (from step 2 on) is static memory the graph was not traced with.
        peak = sim.peak_bytes + mem.optimizer_state_bytes
        budget = result.budget_bytes + mem.optimizer_state_bytes
        within = mem.peak_bytes <= budget
        ok = ok and abs(err) <= 0.02 and within
        print(
            f"  step {k + 1}: loss {losses[-1]:.4f}  peak predicted {format_bytes(peak):>10}  "
            f"measured {format_bytes(mem.peak_bytes):>10}  dynamic {err:+.2%}  "
            + ("within budget" if within else "OVER BUDGET")
        )
    return ok


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = argv[0] if argv else DEFAULT_SPEC
    t0 = time.perf_counter()

    from remat.executor import verify
    from remat.tracer import load_spec, trace_capture

    model, inputs, loss_fn = load_spec(spec)
    cap = trace_capture(model, inputs, loss_fn, cost="cpu")
    graph = cap.graph
    n_params = sum(p.numel() for p in model.parameters())
    sim = simulate(graph, eager_plan(graph))
    device = graph.device.name if graph.device else "?"
    print(
        f"traced {spec.rsplit('/', 1)[-1]}: {n_params / 1e6:.2f} M parameters, "
        f"{graph.num_nodes} nodes, {graph.num_values} values in {time.perf_counter() - t0:.1f} s"
    )
    print(f"static (params + grads): {format_bytes(graph.static_bytes)}")
    print(
        f"no-remat peak: {format_bytes(sim.peak_bytes)} "
        f"(activations {format_bytes(sim.peak_dynamic_bytes)}), "
        f"step {1e3 * sim.total_time_s:.1f} ms predicted on {device}"
    )
    print(f"budgets: static + {', '.join(f'{f:.0%}' for f in FRACTIONS)} of the activation peak")
    print()
    names = [n for n in solver.available() if n != "none"]
    lines, results = solver_table(graph, ["none", *names])
    for line in lines:
        print(line)

    tight = min(FRACTIONS)
    chosen_name = (
        "auto"
        if "auto" in results[tight]
        else min(
            (n for n, r in results[tight].items() if r.fits),
            key=lambda n: speed_key(results[tight][n]),
        )
    )
    chosen = results[tight][chosen_name]
    print(f"running the {chosen_name} plan at {tight:.0%} on the real model ...")
    if not chosen.fits:
        print(f"  {chosen_name} found no plan within the budget ({chosen.message})")
        return 1
    report = verify(model, inputs, loss_fn, chosen, capture=cap, repeats=3)
    print(report)
    ok = report.grads_bitwise_equal and report.within_budget and abs(report.dynamic_error) <= 0.05
    print()
    ok = training_loop(model, inputs, loss_fn, chosen, cap) and ok
    print(f"{'OK' if ok else 'MISMATCH'}: done in {time.perf_counter() - t0:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
