"""Trace a 1-billion-parameter GPT-style model under FakeTensorMode: wall time and peak RSS.

The model is built on the meta device (no parameter memory); ``remat.tracer.trace`` captures one
training step (batch 8 x 1024 tokens by default) on fake tensors. Target: under 60 s and under
3 GB of resident memory. Run: ``.venv/bin/python benchmarks/trace_large.py [--batch B --seq T]``.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def rss_bytes() -> int:
    """Current resident set size (Linux /proc), else the peak from getrusage."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--cost", default="h100")
    parser.add_argument("--target", default="cuda", help="whose eager step: cpu or cuda")
    args = parser.parse_args()

    t0 = time.perf_counter()
    import torch

    from examples.models import gpt_1b
    from remat.ir import eager_plan, format_bytes, simulate
    from remat.tracer import trace

    t_import = time.perf_counter() - t0
    rss0 = rss_bytes()
    model, inputs, loss_fn = gpt_1b(batch=args.batch, seq=args.seq)
    n_params = sum(p.numel() for p in model.parameters())
    t1 = time.perf_counter()
    graph = trace(model, inputs, loss_fn, cost=args.cost, target=args.target)
    t_trace = time.perf_counter() - t1
    sim = simulate(graph, eager_plan(graph))
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        f"torch {torch.__version__}; model: {n_params / 1e9:.3f} B parameters, "
        f"batch {args.batch} x seq {args.seq}, cost={args.cost}, target={args.target}"
    )
    print(
        f"graph: {graph.num_nodes} nodes, {graph.num_values} values; static "
        f"{format_bytes(graph.static_bytes)}, eager peak {format_bytes(sim.peak_bytes)} "
        f"(dynamic {format_bytes(sim.peak_dynamic_bytes)})"
    )
    print(f"import {t_import:.1f} s; trace {t_trace:.1f} s (target < 60 s)")
    print(
        f"RSS before trace {rss0 / 2**30:.2f} GiB; peak RSS {peak_rss / 2**30:.2f} GiB "
        "(target < 3 GB)"
    )


if __name__ == "__main__":
    main()
