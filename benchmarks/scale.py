"""Scale benchmark: the models people train, every planner against the same simulator.

Graphs: synthetic transformers of 12, 48, 96 and 192 layers; the other synthetic families
(a homogeneous chain of 1,000 stages, a heterogeneous one of 500, U-Nets of depth 6 and 8,
random layered DAGs of 300 and 1,000 forward ops: 228 to 4,002 nodes); the GPT example at 12
and 48 layers; Llama configurations of about 7B and 70B parameters and a 2-layer OPT (hidden 128),
built from ``transformers`` configs with random initialisation on the meta device (nothing is
downloaded) and traced on fake tensors. Budgets: static bytes plus 70/50/30 % of the eager
activation peak. Solvers: ``auto``, ``hierarchical``, ``rotor``, ``checkpoint-all`` and
PyTorch's own knapsack solvers (``torch._functorch._activation_checkpointing.knapsack``: dp,
greedy, ilp), each given the saved values' sizes and their producers' recompute times from the
graph; a knapsack's save set becomes a plan through :func:`remat.ir.keep_plan` (the largest
memory cap, of a scan, whose plan fits the budget) and is judged by the simulator like every
other plan. As in torch's partitioner, whose min-cut saves the values that recomputation
starts from, the values at module boundaries (:func:`remat.ir.block_cuts`) are always saved
and the knapsack chooses among the others; without them a recomputation would start from the
step's inputs and the peak would not move.

Traced graphs are kept in ``~/.cache/remat/bench/`` (``REMAT_BENCH_CACHE``) as the graph's JSON,
keyed by name, the torch and transformers versions and the tracer's source, so a second run
solves without tracing again (``--no-cache`` traces anyway; ``--fractions=`` only traces).

For each solver: nodes, status, overhead over eager, the bound ``auto`` proved (as overhead),
the gap to it, solve seconds against the limit and the machine's 1-minute load average then.
Where no plan fits (``infeasible``), ``smallest`` is the smallest peak of a plan found and
``floor`` the proven lower bound on every plan's peak (``min_budget_bytes`` and
``min_budget_lower_bytes``), both as the budget column is: static bytes plus that share of
the eager activation peak; the bound column is then left empty (no plan to bound).

Usage::

    .venv/bin/python benchmarks/scale.py [--graphs synth12,synth192,llama70b]
        [--fractions 0.7,0.5] [--solvers auto,rotor] [--time-limit 60] [--markdown]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from remat import solver
from remat.ir import (
    Graph,
    InvalidPlanError,
    Plan,
    block_cuts,
    eager_plan,
    keep_plan,
    simulate,
    synthetic,
)
from remat.solver.bounds import best_bound
from remat.solver.deadline import Deadline
from remat.solver.offload import combined_bound


def llama_config(*, big: bool) -> Any:
    """A ``transformers.LlamaConfig`` of about 7B parameters (70B with ``big``)."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=8192 if big else 4096,
        intermediate_size=28672 if big else 11008,
        num_hidden_layers=80 if big else 32,
        num_attention_heads=64 if big else 32,
        num_key_value_heads=8 if big else 32,
        max_position_embeddings=4096,
    )


def _trace_hf(kind: str) -> Graph:
    import torch
    import torch.nn.functional as F
    import transformers

    from remat.tracer import trace

    torch.manual_seed(0)
    if kind == "opt2":
        cfg: Any = transformers.OPTConfig(
            vocab_size=512,
            hidden_size=128,
            num_hidden_layers=2,
            ffn_dim=512,
            num_attention_heads=4,
            word_embed_proj_dim=128,
            max_position_embeddings=256,
        )
        cls: Any = transformers.OPTForCausalLM
        batch, seq, device = 8, 128, "cpu"
    else:
        cfg = llama_config(big=kind == "llama70b")
        cls = transformers.LlamaForCausalLM
        batch, seq, device = 1, 4096, "meta"
    with torch.device(device):
        model = cls(cfg)
    idx = torch.randint(0, cfg.vocab_size, (batch, seq))
    targets = torch.randint(0, cfg.vocab_size, (batch, seq))

    def loss_fn(out: Any) -> torch.Tensor:
        logits = out.logits if hasattr(out, "logits") else out[0]
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    if kind == "opt2":
        return trace(model, (idx,), loss_fn, cost="flops")
    return trace(model, (idx,), loss_fn, cost="h100", target="cuda")


def _gpt(layers: int) -> Graph:
    from examples.models import build_gpt
    from remat.tracer import trace

    model, inputs, loss_fn = build_gpt(
        batch=8, seq=128, vocab=1024, d_model=128, n_layers=layers, n_heads=4
    )
    return trace(model, inputs, loss_fn, cost="flops")


CACHE_DIR = Path(os.environ.get("REMAT_BENCH_CACHE", Path.home() / ".cache" / "remat" / "bench"))
"""Where traced graphs are kept (``REMAT_BENCH_CACHE`` overrides): tracing the 70B Llama step
takes minutes, solving it again should not."""

TRACED = ("gpt12", "gpt48", "llama7b", "llama70b", "opt2")
"""The graphs that are traced (slow) rather than built: these are cached on disk."""


def _cache_key(name: str) -> str:
    """The graph's name, the torch and transformers versions, and the source of the tracer, the
    example models and this file's model builders: a change to any of them traces again."""
    import inspect

    import torch
    import transformers

    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    h.update(f"{name}|{torch.__version__}|{transformers.__version__}".encode())
    sources = [*(root / "remat" / "tracer").rglob("*.py"), root / "examples" / "models.py"]
    for src in sorted(sources):
        h.update(src.read_bytes())
    h.update(inspect.getsource(_trace_hf).encode())
    h.update(inspect.getsource(_gpt).encode())
    return f"{name}-{h.hexdigest()[:16]}"


def load_graph(name: str, *, cache: bool = True) -> tuple[Graph, str]:
    """The graph ``name`` of :data:`GRAPHS`; a traced one from :data:`CACHE_DIR` when it was
    traced before by the same code (the graph's own JSON form), traced and stored otherwise.
    Returns the graph and where it came from ("built", "traced" or "cache")."""
    if name not in GRAPHS:
        raise ValueError(f"unknown graph {name!r}; choose from {', '.join(GRAPHS)}")
    if not cache or name not in TRACED:
        return GRAPHS[name](), "built" if name not in TRACED else "traced"
    path = CACHE_DIR / f"{_cache_key(name)}.json"
    if path.is_file():
        return Graph.from_json(path.read_bytes()), "cache"
    g = GRAPHS[name]()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(g.to_json())
    tmp.replace(path)  # atomic: a concurrent run reads the whole file or none
    return g, "traced"


GRAPHS: dict[str, Callable[[], Graph]] = {
    "synth12": lambda: synthetic.transformer(12),
    "synth48": lambda: synthetic.transformer(48),
    "synth96": lambda: synthetic.transformer(96),
    "synth192": lambda: synthetic.transformer(192),
    "chain1000": lambda: synthetic.chain(1000),
    "hetchain500": lambda: synthetic.chain(500, heterogeneous=True),
    "unet6": lambda: synthetic.unet(6),
    "unet8": lambda: synthetic.unet(8, image_size=512, batch_size=2),
    "dag300": lambda: synthetic.random_layered_dag(300),
    "dag1000": lambda: synthetic.random_layered_dag(1000),
    "gpt12": lambda: _gpt(12),
    "gpt48": lambda: _gpt(48),
    "llama7b": lambda: _trace_hf("llama7b"),
    "llama70b": lambda: _trace_hf("llama70b"),
    "opt2": lambda: _trace_hf("opt2"),
}
REMAT_SOLVERS = ("auto", "dtr", "hierarchical", "rotor", "checkpoint-all")
TORCH_SOLVERS = ("torch-dp", "torch-greedy", "torch-ilp")


def knapsack_items(graph: Graph) -> tuple[list[str], list[int], list[float]]:
    """The values torch's partitioner would choose among: forward values the backward reads,
    made by nodes that may run again, except the module-boundary values (always saved); their
    sizes and their producers' times."""
    cut = {v for c in block_cuts(graph) for v in c.values}
    ids, sizes, times = [], [], []
    for v in graph.values:
        if v.id in cut:
            continue
        p = graph.producer_position(v.id)
        if p is None or graph.is_static(v.id) or v.kind == "input":
            continue
        node = graph.nodes[p]
        if node.phase != "forward" or not node.recomputable:
            continue
        if not any(r.phase == "backward" for r in graph.consumers_of(v.id)):
            continue
        ids.append(v.id)
        sizes.append(v.size_bytes)
        times.append(node.time_s)
    return ids, sizes, times


def solve_torch(
    graph: Graph, budget_bytes: int, kind: str, deadline: Deadline
) -> tuple[str, Plan | None, float]:
    """Run torch's ``kind`` knapsack at a scan of memory caps (fractions of the saved bytes),
    keep the fastest plan within the budget; (status, plan, seconds)."""
    from torch._functorch._activation_checkpointing import knapsack as ks

    fn = {
        "torch-dp": ks.dp_knapsack,
        "torch-greedy": ks.greedy_knapsack,
        "torch-ilp": ks.ilp_knapsack,
    }[kind]
    t0 = time.perf_counter()
    ids, sizes, times = knapsack_items(graph)
    cut = [v for c in block_cuts(graph) for v in c.values]
    total = float(sum(sizes)) or 1.0
    memory = [s / total for s in sizes]  # torch's solvers take fractions of a whole
    best: tuple[float, Plan] | None = None
    status = "infeasible"
    for cap in (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05, 0.0):
        if deadline.expired():
            status = "timeout" if best is None else status
            break
        # no values to choose among (every saved value is at a module boundary): torch's ilp
        # rejects an empty problem, and every solver would save nothing more
        saved = fn(memory, times, cap)[1] if ids else []
        try:
            plan = keep_plan(graph, [*cut, *(ids[i] for i in saved)])
        except InvalidPlanError:
            continue
        sim = simulate(graph, plan)
        if sim.peak_bytes <= budget_bytes:
            status = "feasible"
            if best is None or sim.total_time_s < best[0]:
                best = (sim.total_time_s, plan)
            break  # smaller caps only save less: slower
    return status, None if best is None else best[1], time.perf_counter() - t0


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def share(graph: Graph, total_bytes: int | None, eager_dynamic_bytes: int) -> str:
    """``total_bytes`` (static included) as the budget column writes budgets: the share of the
    eager activation peak above the static bytes; "-" for None."""
    if total_bytes is None or eager_dynamic_bytes <= 0:
        return "-"
    return f"{(total_bytes - graph.static_bytes) / eager_dynamic_bytes:.1%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--graphs", default=",".join(GRAPHS))
    ap.add_argument("--fractions", default="0.7,0.5,0.3")
    ap.add_argument("--solvers", default=",".join(REMAT_SOLVERS + TORCH_SOLVERS))
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    ap.add_argument("--no-cache", action="store_true", help=f"trace again, ignoring {CACHE_DIR}")
    args = ap.parse_args()
    names = [s for s in args.solvers.split(",") if s]
    fracs = [float(f) for f in args.fractions.split(",") if f]
    sep = " | " if args.markdown else "  "
    header = [
        "graph",
        "nodes",
        "budget",
        "solver",
        "status",
        "overhead",
        "bound",
        "gap",
        "solve_s",
        "load",
        "smallest",
        "floor",
    ]
    print(("| " if args.markdown else "") + sep.join(header) + (" |" if args.markdown else ""))
    if args.markdown:
        print("|" + "---|" * len(header))
    for gname in args.graphs.split(","):
        t = time.perf_counter()
        g, source = load_graph(gname, cache=not args.no_cache)
        build_s = time.perf_counter() - t
        eager = simulate(g, eager_plan(g))
        base = eager.total_time_s
        print(
            f"# {gname}: {g.num_nodes} nodes, {source} in {build_s:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        for frac in fracs:
            budget = g.static_bytes + int(frac * eager.peak_dynamic_bytes)
            lb = best_bound(g, budget, deadline=Deadline.after(min(10.0, args.time_limit))).time_s
            for name in names:
                bound: float | None = None
                smallest = floor = "-"
                if name.startswith("torch-"):
                    st, plan, secs = solve_torch(g, budget, name, Deadline.after(args.time_limit))
                    over = None if plan is None else simulate(g, plan).total_time_s / base - 1
                else:
                    t = time.perf_counter()
                    r = solver.get(name)(g, budget, time_limit_s=args.time_limit)
                    secs = time.perf_counter() - t
                    st = r.status
                    over = r.overhead if r.status in ("optimal", "feasible") else None
                    if r.lower_bound_s is not None:
                        bound = r.lower_bound_s
                    smallest = share(g, r.min_budget_bytes, eager.peak_dynamic_bytes)
                    floor = share(g, r.min_budget_lower_bytes, eager.peak_dynamic_bytes)
                if name == "auto":
                    # the recompute-only bound holds only for plans that do not offload; for
                    # one that does, the combined bound (solver.offload.combined_bound) does
                    if r.status in ("optimal", "feasible") and (r.offload_bytes or 0) > 0:
                        comb = combined_bound(g, budget, upper_s=r.total_time_s)
                        bound = max(bound or 0.0, comb)
                    elif r.status in ("optimal", "feasible"):
                        bound = max(bound or 0.0, lb)
                bnd = None if bound is None else bound / base - 1
                gap = None
                if over is not None and bound is not None and bound > 0:
                    gap = (1 + over) * base / bound - 1
                row = [
                    gname,
                    str(g.num_nodes),
                    f"{frac:.0%}",
                    name,
                    st,
                    pct(over),
                    pct(bnd),
                    pct(gap),
                    f"{secs:.1f}",
                    f"{os.getloadavg()[0]:.1f}",  # the 1-minute load the solve ran under
                    smallest,
                    floor,
                ]
                print(
                    ("| " if args.markdown else "")
                    + sep.join(row)
                    + (" |" if args.markdown else ""),
                    flush=True,
                )


if __name__ == "__main__":
    main()
