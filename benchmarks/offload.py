"""Offload benchmark: recompute-only planning against offloading baselines and the combined plan.

Graphs: Llama configurations of about 7B and 70B parameters (seq 4,096, batch 1), GPT-2 XL
(seq 1,024, batch 8), a ViT-L/16 (224 px, batch 32), built from ``transformers`` configs on the
meta device (nothing is downloaded), and an SD-style U-Net (examples/models.py's U-Net, width
128, depth 4, 256 px, batch 8); each traced on fake tensors in float32 and bfloat16 with the
roofline of the ``h100`` profile (``--devices h100,h200``: the graph's device swapped, the times
traced again per profile). Budgets: static bytes plus 50/30/15/10 % of the eager activation peak.

Rows: recompute-only ``auto`` (``offload=False``), ``offload-all``, ``offload-checkpoints``,
``pofo`` and the combined ``auto`` (the default: it offloads when the device has a host link):
overhead over eager, peak, host bytes (the most held at once), the share of the step the link's
busier direction is copying, the combined bound (as overhead), and solve seconds.

Traced graphs are cached like benchmarks/scale.py's (``~/.cache/remat/bench/``,
``REMAT_BENCH_CACHE``).

Usage::

    .venv/bin/python benchmarks/offload.py [--quick] [--graphs llama7b,gpt2xl]
        [--dtypes bfloat16,float32] [--devices h100] [--fractions 0.5,0.3,0.15,0.1]
        [--time-limit 60] [--markdown]
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from remat import solver
from remat.ir import Graph, SolveResult, format_bytes

MODELS = ("llama7b", "llama70b", "gpt2xl", "vitl", "unet")
SOLVERS = ("auto-recompute", "offload-all", "offload-checkpoints", "pofo", "auto")
CACHE_DIR = Path(os.environ.get("REMAT_BENCH_CACHE", Path.home() / ".cache" / "remat" / "bench"))


def _build(kind: str, dtype: str, device: str) -> Graph:
    """Trace one training step of ``kind`` in ``dtype`` on the roofline of ``device``."""
    import torch
    import torch.nn.functional as F
    import transformers

    from remat.tracer import trace

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    model: Any
    if kind in ("llama7b", "llama70b"):
        from scale import llama_config

        cfg: Any = llama_config(big=kind == "llama70b")
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(cfg).to(dt)
        batch, seq, vocab = 1, 4096, cfg.vocab_size
    elif kind == "gpt2xl":
        cfg = transformers.GPT2Config(n_embd=1600, n_layer=48, n_head=25, n_positions=1024)
        with torch.device("meta"):
            model = transformers.GPT2LMHeadModel(cfg).to(dt)
        batch, seq, vocab = 8, 1024, cfg.vocab_size
    elif kind == "vitl":
        cfg = transformers.ViTConfig(
            hidden_size=1024,
            num_hidden_layers=24,
            num_attention_heads=16,
            intermediate_size=4096,
            image_size=224,
            patch_size=16,
            num_labels=1000,
        )
        with torch.device("meta"):
            model = transformers.ViTForImageClassification(cfg).to(dt)
        x = torch.randn(32, 3, 224, 224, dtype=dt)
        y = torch.randint(0, 1000, (32,))
        return trace(
            model,
            (x,),
            lambda out: F.cross_entropy(out.logits.float(), y),
            cost=device,
            target="cuda",
        )
    elif kind == "unet":
        from examples.models import UNet

        with torch.device("meta"):
            model = UNet(4, 128, 4, 4).to(dt)
        x = torch.randn(8, 4, 256, 256, dtype=dt)
        y = torch.randint(0, 4, (8, 256, 256))
        return trace(
            model, (x,), lambda out: F.cross_entropy(out.float(), y), cost=device, target="cuda"
        )
    else:
        raise ValueError(f"unknown model {kind!r}; choose from {', '.join(MODELS)}")
    idx = torch.randint(0, vocab, (batch, seq))
    targets = torch.randint(0, vocab, (batch, seq))

    def loss_fn(out: Any) -> torch.Tensor:
        logits = out.logits if hasattr(out, "logits") else out[0]
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))

    return trace(model, (idx,), loss_fn, cost=device, target="cuda")


def _cache_key(kind: str, dtype: str, device: str) -> str:
    import torch
    import transformers

    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    h.update(f"{kind}|{dtype}|{device}|{torch.__version__}|{transformers.__version__}".encode())
    for src in sorted([*(root / "remat" / "tracer").rglob("*.py"), root / "examples/models.py"]):
        h.update(src.read_bytes())
    h.update(inspect.getsource(_build).encode())
    return f"offload-{kind}-{dtype}-{device}-{h.hexdigest()[:16]}"


def load_graph(kind: str, dtype: str, device: str, *, cache: bool = True) -> Graph:
    """The traced graph, from the cache when the same code traced it before."""
    path = CACHE_DIR / f"{_cache_key(kind, dtype, device)}.json"
    if cache and path.is_file():
        return Graph.from_json(path.read_bytes())
    g = _build(kind, dtype, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(g.to_json())
    tmp.replace(path)
    return g


def _solve(g: Graph, name: str, budget: int, limit: float) -> SolveResult:
    if name == "auto-recompute":
        return solver.solve(g, budget, solver="auto", time_limit_s=limit, offload=False)
    return solver.solve(g, budget, solver=name, time_limit_s=limit)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="Llama 7B in bf16 at 30/15%% only")
    ap.add_argument("--graphs", default=",".join(MODELS))
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--devices", default="h100")
    ap.add_argument("--fractions", default="0.5,0.3,0.15,0.1")
    ap.add_argument("--solvers", default=",".join(SOLVERS))
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--no-cache", action="store_true")
    ap.add_argument("--trace-only", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    graphs, dtypes = args.graphs.split(","), args.dtypes.split(",")
    fractions = [float(f) for f in args.fractions.split(",")]
    if args.quick:
        graphs, dtypes, fractions = ["llama7b"], ["bfloat16"], [0.3, 0.15]
    names = args.solvers.split(",")
    head = ["graph", "dtype", "dev", "nodes", "budget", "solver", "status", "overhead",
            "peak", "host", "link busy", "bound", "solve s"]  # fmt: skip
    sep = " | " if args.markdown else "  "
    if args.markdown:
        print("| " + sep.join(head) + " |")
        print("|" + "|".join("---" for _ in head) + "|")
    else:
        print(sep.join(head))
    for kind in graphs:
        for dtype in dtypes:
            for dev in args.devices.split(","):
                t = time.perf_counter()
                g = load_graph(kind, dtype, dev, cache=not args.no_cache)
                print(f"# {kind} {dtype} {dev}: {g.num_nodes} nodes in "
                      f"{time.perf_counter() - t:.0f} s", file=sys.stderr)  # fmt: skip
                if args.trace_only:
                    continue
                for frac in fractions:
                    budget = solver.Problem.build(g, frac).budget_bytes
                    for name in names:
                        r = _solve(g, name, budget, args.time_limit)
                        print(sep.join(_row(g, kind, dtype, dev, frac, name, r)), flush=True)
    return 0


def _row(
    g: Graph, kind: str, dtype: str, dev: str, frac: float, name: str, r: SolveResult
) -> list[str]:
    from remat.solver.offload import combined_bound

    f = r.figures
    ov = "n/a" if r.overhead is None else f"{r.overhead * 100:+.1f}%"
    if not r.fits and r.overhead is not None:
        ov = f"({ov})"  # the time of a plan that does not fit
    if f is None:
        peak = host = busy = "-"
    else:
        peak, host = format_bytes(f.peak_bytes), format_bytes(f.host_peak_bytes)
        busiest = max(f.device_to_host_busy_s, f.host_to_device_busy_s)
        busy = f"{busiest / f.total_time_s * 100:.0f}%" if f.total_time_s > 0 else "0%"
    lb = combined_bound(g, r.budget_bytes, upper_s=f.total_time_s if f else None)
    bound = f"{(lb / r.baseline_time_s - 1) * 100:+.1f}%"
    status = r.status if r.fits else f"{r.status} (min {format_bytes(r.min_budget_bytes or 0)})"
    return [kind, dtype, dev, str(g.num_nodes), f"{frac:.0%}", name, status, ov, peak, host,
            busy, bound, f"{r.solve_time_s:.1f}"]  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
