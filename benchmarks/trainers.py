"""remat against transformers' own one line, side by side in one process, on the CPU.

For each model (transformers GPT-2, Llama, Mistral, BERT, T5; random weights, dropout 0,
float32; 6 layers of width 256 at sequence 256 and batch 4 by default, ``--small`` for a
quick run), one training step of:

(a) the plain model (``loss = model(**batch).loss; loss.backward()``);
(b) ``model.gradient_checkpointing_enable()``;
(c) remat at (b)'s measured peak (``remat.solve(graph, peak_b)`` applied op by op);
(d) remat at 50% and 30% (static plus that share of the plain step's activation peak).

Printed per row: the measured peak (the project's storage tracker, the same for all rows), its
share of the plain step's, the predicted peak (remat rows), the step time as a ratio to (a) (the
fastest of ``--repeats`` interleaved steps: each round runs every variant once, so load spikes
hit all alike), remat's predicted ratio beside it, and the largest gradient difference from (a)
(0: bit for bit). Run it alone on the machine: the times mean nothing under other load.

``--breakdown`` adds (k), remat applied with a plan that keeps everything (solved at the plain
step's peak: the eager plan, nothing computed twice, run by the same op-level executor), and
splits each remat row's measured step into (i) the plain model's work, (a); (ii) the op-level
executor's own overhead, (k) - (a); (iii) the recomputation the plan adds, the row - (k). The
recomputation is also timed directly: the row's plan steps are compiled again with a probe
(:func:`remat.executor.autograd.probe_steps`) that reads the clock after each step, and the
fastest time of each recomputing step over ``--repeats`` steps is summed: in all, beside the
simulator's recomputation time, for every remat row ("probed"), and per ATen op beside the
cost model's prediction (the nodes' ``time_s``) for the (c) row. The executor's overhead is
also given per op it runs (the keep-everything plan's computes). The difference (iii) is two
noisy step times apart; the probed sum reads only the recomputing steps.

Run: ``.venv/bin/python benchmarks/trainers.py [--models gpt2,llama] [--repeats 9] [--small]
[--breakdown]``.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import remat  # noqa: E402
from remat.executor import measure, planned_steps  # noqa: E402
from remat.executor.autograd import probe_steps  # noqa: E402

LAYERS, WIDTH, SEQ, BATCH, VOCAB = 6, 256, 256, 4, 1024
KEEP_ALL = "(k) remat keeping everything"


def _configs(layers: int, width: int, seq: int) -> dict[str, tuple[str, str, dict[str, Any]]]:
    heads = max(2, width // 64)
    decoder = {
        "hidden_size": width, "intermediate_size": 4 * width, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads, "vocab_size": VOCAB,
        "max_position_embeddings": seq, "attention_dropout": 0.0,
    }  # fmt: skip
    return {
        "gpt2": ("GPT2Config", "GPT2LMHeadModel", {
            "n_layer": layers, "n_head": heads, "n_embd": width, "vocab_size": VOCAB,
            "n_positions": seq, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        }),
        "llama": ("LlamaConfig", "LlamaForCausalLM", decoder),
        "mistral": ("MistralConfig", "MistralForCausalLM", {**decoder, "sliding_window": seq}),
        "bert": ("BertConfig", "BertForMaskedLM", {
            "hidden_size": width, "num_hidden_layers": layers, "num_attention_heads": heads,
            "intermediate_size": 4 * width, "vocab_size": VOCAB, "max_position_embeddings": seq,
            "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
        }),
        "t5": ("T5Config", "T5ForConditionalGeneration", {
            "d_model": width, "d_ff": 4 * width, "d_kv": 64, "num_layers": layers // 2,
            "num_decoder_layers": layers // 2, "num_heads": heads, "vocab_size": VOCAB,
            "decoder_start_token_id": 0, "pad_token_id": 0, "dropout_rate": 0.0,
        }),
    }  # fmt: skip


def build(name: str, layers: int, width: int, seq: int) -> tuple[Any, dict[str, Any]]:
    import transformers

    config_cls, model_cls, settings = _configs(layers, width, seq)[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**settings))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
    batch: dict[str, Any] = {"input_ids": ids, "labels": ids.clone()}
    if name != "bert":
        batch["use_cache"] = False
    return model.train(), batch


def loss_of(out: Any) -> torch.Tensor:
    loss: torch.Tensor = out.loss
    return loss


def step(model: Any, batch: dict[str, Any]) -> float:
    """One training step's wall time (gradients cleared first, not timed)."""
    for p in model.parameters():
        p.grad = None
    start = time.perf_counter()
    model(**batch).loss.backward()
    return time.perf_counter() - start


class StepTimer:
    """A probe for :func:`probe_steps`: the wall time of each plan step, the fastest over the
    steps it saw. Step ``i``'s time is the clock at its probe less the clock at step ``i - 1``'s
    (the first step, with no probe before it, is not timed; the first step of the backward
    part carries autograd's hand-over from the forward part too)."""

    def __init__(self) -> None:
        self.fastest: dict[int, float] = {}
        self.last: tuple[int, float] | None = None

    def start(self) -> None:
        self.last = None

    def __call__(self, i: int) -> None:
        now = time.perf_counter()
        if self.last is not None and self.last[0] == i - 1:
            self.fastest[i] = min(self.fastest.get(i, float("inf")), now - self.last[1])
        self.last = (i, now)


def recompute_by_op(
    run: Any, graph: Any, batch: dict[str, Any], repeats: int
) -> dict[str, list[float]]:
    """Per ATen op of the recomputing steps of ``run``'s plan: [steps, measured seconds (the
    fastest of ``repeats`` probed steps, per plan step), predicted seconds (the ``time_s`` of
    the traced ``graph``'s node)]."""
    (step_,) = planned_steps(run)
    timer = StepTimer()
    probe_steps(run, timer)
    try:
        for _ in range(repeats):
            timer.start()
            step(run, batch)
    finally:
        probe_steps(run, None)
    seen: set[str] = set()
    out: dict[str, list[float]] = {}
    for i, s in enumerate(step_.plan.steps):
        if s.op != "compute":
            continue
        if s.id in seen:
            node = graph.node(s.id)
            row = out.setdefault(node.op, [0, 0.0, 0.0])
            row[0] += 1
            row[1] += timer.fastest.get(i, 0.0)
            row[2] += node.time_s
        seen.add(s.id)
    return out


def run_model(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    plain, batch = build(name, args.layers, args.width, args.seq)
    variants: dict[str, Any] = {"(a) plain": plain}
    peaks: dict[str, int] = {"(a) plain": measure(plain, batch, loss_of).peak_bytes}
    grads = {n: p.grad.clone() for n, p in plain.named_parameters() if p.grad is not None}

    hf = copy.deepcopy(plain)
    hf.gradient_checkpointing_enable()
    variants["(b) gradient_checkpointing_enable"] = hf
    peaks["(b) gradient_checkpointing_enable"] = measure(hf, batch, loss_of).peak_bytes

    graph = remat.trace(plain, batch)
    predicted: dict[str, tuple[int, float]] = {}
    steps: dict[str, tuple[int, float, float]] = {}  # computes, predicted first, recompute s
    budgets = [("(c) remat at (b)'s peak", peaks["(b) gradient_checkpointing_enable"])]
    budgets += [(f"(d) remat at {f}", f) for f in args.fractions.split(",")]
    if args.breakdown:
        budgets.append((KEEP_ALL, peaks["(a) plain"]))
    for label, budget in budgets:
        result = remat.solve(graph, budget, time_limit_s=args.time_limit)
        if result.plan is None or result.figures is None:
            print(f"  {name} {label}: no plan ({result.status})")
            continue
        if label == KEEP_ALL and max(result.plan.compute_counts().values()) > 1:
            raise SystemExit(f"{name}: the plan at the plain step's peak recomputes")
        run = copy.deepcopy(plain)
        remat.apply(run, result, allow_over_budget=True)
        peaks[label] = measure(run, batch, loss_of).peak_bytes
        variants[label] = run
        (sim,) = [s.simulation for s in planned_steps(run)]
        predicted[label] = (sim.peak_bytes, 1.0 + (result.overhead or 0.0))
        sim = remat.ir.simulate(graph, result.plan)  # the traced graph's costs
        steps[label] = (
            sum(1 for s in result.plan.steps if s.op == "compute"),
            sim.compute_time_s - sim.recompute_time_s,
            sim.recompute_time_s,
        )

    best = {k: float("inf") for k in variants}
    for _ in range(args.repeats):  # interleaved: every variant once per round
        for k, m in variants.items():
            best[k] = min(best[k], step(m, batch))
    by_op: dict[str, dict[str, list[float]]] = {}  # per remat row (keep-all aside)
    if args.breakdown:
        for label, _ in budgets:
            if label in variants and label != KEEP_ALL:
                by_op[label] = recompute_by_op(variants[label], graph, batch, args.repeats)
    rows = []
    for k, m in variants.items():
        diff = max(
            float((p.grad - grads[n]).abs().max())
            for n, p in m.named_parameters()
            if n in grads and p.grad is not None
        )
        pred_peak, pred_ratio = predicted.get(k, (None, None))
        rows.append(
            {
                "model": name,
                "variant": k,
                "peak": peaks[k],
                "share": peaks[k] / peaks["(a) plain"],
                "predicted": pred_peak,
                "ratio": best[k] / best["(a) plain"],
                "predicted_ratio": pred_ratio,
                "grad_diff": diff,
                "time_s": best[k],
                "plain_s": best["(a) plain"],
                "keep_all_s": best.get(KEEP_ALL),
                "steps": steps.get(k),
                "keep_all_computes": steps[KEEP_ALL][0] if KEEP_ALL in steps else None,
                "by_op": by_op.get(k),
                "op_table": k == budgets[0][0],
            }
        )
    return rows


def print_breakdown(rows: list[dict[str, Any]], top: int) -> None:
    """Each remat row's step in (i) plain work, (ii) executor overhead, (iii) recomputation;
    then, for the (c) rows, the recomputation per ATen op, measured against predicted."""
    ms = 1e3
    print()
    print(
        "| model | variant | step | (i) plain work, (a) | (ii) executor overhead, (k) - (a) | "
        "per op run | (iii) recomputation, step - (k) | (iii) probed | predicted recomputation |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["steps"] is None or r["keep_all_s"] is None:
            continue
        _computes, _first_s, recompute_s = r["steps"]
        overhead = r["keep_all_s"] - r["plain_s"]
        per_op = overhead / r["keep_all_computes"]
        recompute = r["time_s"] - r["keep_all_s"]
        probed = sum(v[1] for v in r["by_op"].values()) if r["by_op"] else 0.0
        print(
            f"| {r['model']} | {r['variant']} | {r['time_s'] * ms:.1f} ms | "
            f"{r['plain_s'] * ms:.1f} ms | {overhead * ms:.1f} ms "
            f"({100 * overhead / r['plain_s']:.1f}%) | {per_op * 1e6:.1f} us | "
            f"{recompute * ms:.1f} ms ({100 * recompute / r['plain_s']:.1f}%) | "
            f"{probed * ms:.1f} ms | {recompute_s * ms:.1f} ms |"
        )
    for r in rows:
        if not (r["op_table"] and r["by_op"]):
            continue
        ops = sorted(r["by_op"].items(), key=lambda kv: (-kv[1][1], kv[0]))
        total = [sum(v[i] for _, v in ops) for i in range(3)]
        print()
        print(f"{r['model']} {r['variant']}: recomputation per op (probed steps, fastest each)")
        print()
        print("| op | recomputes | measured | predicted | measured / predicted |")
        print("|---|---|---|---|---|")
        for op, (count, meas, pred) in [*ops[:top], ("all", total)]:
            ratio = f"{meas / pred:.2f}" if pred > 0 else ""
            print(f"| {op} | {int(count)} | {meas * ms:.2f} ms | {pred * ms:.2f} ms | {ratio} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt2,llama,mistral,bert,t5")
    ap.add_argument("--fractions", default="50%,30%")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--width", type=int, default=WIDTH)
    ap.add_argument("--seq", type=int, default=SEQ)
    ap.add_argument("--small", action="store_true", help="2 layers of width 64, sequence 64")
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="split remat's steps into plain work, executor overhead and recomputation",
    )
    ap.add_argument("--top", type=int, default=10, help="ops listed in the breakdown")
    args = ap.parse_args()
    if args.small:
        args.layers, args.width, args.seq, args.repeats = 2, 64, 64, min(args.repeats, 3)
    torch.set_num_threads(1)  # one quiet core: op timings comparable across variants
    print(
        f"{args.layers} layers, width {args.width}, sequence {args.seq}, batch {BATCH}, fp32, "
        f"fastest of {args.repeats} interleaved steps; one torch thread"
    )
    print(
        "| model | variant | measured peak | of plain | predicted peak | step time | "
        "predicted | max grad diff |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rows: list[dict[str, Any]] = []
    for name in args.models.split(","):
        new = run_model(name, args)
        rows += new
        for r in new:
            pred = "" if r["predicted"] is None else f"{r['predicted'] / 2**20:.2f} MiB"
            pr = "" if r["predicted_ratio"] is None else f"{r['predicted_ratio']:.3f}x"
            print(
                f"| {r['model']} | {r['variant']} | {r['peak'] / 2**20:.2f} MiB | "
                f"{100 * r['share']:.1f}% | {pred} | {r['ratio']:.3f}x | {pr} | "
                f"{r['grad_diff']:.2g} |"
            )
    if args.breakdown:
        print_breakdown(rows, args.top)


if __name__ == "__main__":
    main()
