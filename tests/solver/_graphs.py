"""Random small training steps for the solver property tests (single-output forward ops with
random wiring, sizes and costs; backward derived by the StepBuilder)."""

from __future__ import annotations

import random

from remat.ir import Graph, Out, StepBuilder


def random_step(seed: int, num_ops: int = 3) -> Graph:
    rng = random.Random(seed)
    b = StepBuilder(f"random-step-{seed}")
    vals = [b.input("x", (rng.randint(1, 8),))]
    for i in range(num_ops):
        ins = rng.sample(vals, rng.randint(1, min(2, len(vals))))
        w = [b.param(f"w{i}", (2,))] if rng.random() < 0.5 else []
        (y,) = b.op(
            "op",
            ins + w,
            [Out(f"v{i}", (rng.randint(1, 8),))],
            flops=rng.randint(1, 10) * 10**9,
            save=rng.sample(ins, rng.randint(0, len(ins))),
            module=f"m.{i}",
        )
        vals.append(y)
    b.loss("loss", [vals[-1]], flops=10**8, save=[vals[-1]])
    return b.build()
