"""How fast 100,000-node graphs parse from JSON, validate, hash and simulate.

Run: ``.venv/bin/python benchmarks/ir_parse.py [num_forward_ops]``. Prints seconds per stage,
medians of 3 runs; no threshold is asserted (machines are noisy).
"""

from __future__ import annotations

import statistics
import sys
import time

from remat.ir import Graph, eager_plan, simulate
from remat.ir.synthetic import random_layered_dag


def timed(fn, repeats: int = 3) -> float:  # type: ignore[no-untyped-def]
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    n_ops = int(sys.argv[1]) if len(sys.argv) > 1 else 40_000
    t0 = time.perf_counter()
    g = random_layered_dag(n_ops, seed=0, batch_size=8, max_width=256)
    print(f"built {g.num_nodes} nodes / {g.num_values} values in {time.perf_counter() - t0:.2f} s")
    text = g.to_json()
    print(f"JSON: {len(text) / 2**20:.1f} MiB")
    print(f"to_json         {timed(g.to_json):7.3f} s")
    print(f"from_json       {timed(lambda: Graph.from_json(text)):7.3f} s  (parse + validate)")
    print(f"content_hash    {timed(g.content_hash):7.3f} s")
    plan = eager_plan(g)
    print(f"eager_plan      {timed(lambda: eager_plan(g)):7.3f} s  ({len(plan)} steps)")
    print(f"simulate        {timed(lambda: simulate(g, plan)):7.3f} s")


if __name__ == "__main__":
    main()
