"""Random graphs for the solver property tests: small training steps (single-output forward ops
with random wiring, sizes and costs; backward derived by the StepBuilder), and any graph the
schema accepts (:func:`schema_graphs`, a hypothesis strategy)."""

from __future__ import annotations

import random

from hypothesis import strategies as st

from remat.ir import Graph, Node, Out, StepBuilder, Value


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


@st.composite
def schema_graphs(draw: st.DrawFn, max_nodes: int = 10) -> Graph:
    """Small graphs of any shape the schema and the validator accept, not only training steps:
    nodes of either phase in any order (a forward node may read what a backward node made),
    any recomputable flags, several outputs per node (none too), inputs, parameters, buffers
    (made by a node or not), activations, gradients and losses, values read by later nodes of
    either phase or never, zero sizes and times, and any values required."""
    size = st.integers(0, 400)
    values: list[Value] = []
    readable: list[str] = []
    for kind, most in (("input", 2), ("param", 2), ("buffer", 1)):
        for k in range(draw(st.integers(0, most))):
            values.append(Value(id=f"{kind}{k}", size_bytes=draw(size), kind=kind))
            readable.append(values[-1].id)
    nodes: list[Node] = []
    num_nodes = draw(st.integers(0, max_nodes))
    # mostly a forward pass then a backward one, as in a training step, with phases flipped
    # here and there (the validator accepts any order that is topological)
    split = draw(st.integers(0, num_nodes))
    for i in range(num_nodes):
        flip = draw(st.sampled_from((False, False, False, True)))
        inputs = (
            draw(st.lists(st.sampled_from(readable), min_size=1, max_size=3, unique=True))
            if readable and draw(st.sampled_from((True, True, True, False)))
            else []
        )
        outputs: list[str] = []
        for k in range(draw(st.integers(0, 3))):
            kind = draw(st.sampled_from(("activation", "activation", "gradient", "loss", "buffer")))
            values.append(Value(id=f"v{i}.{k}", size_bytes=draw(size), kind=kind))
            outputs.append(values[-1].id)
        nodes.append(
            Node(
                id=f"n{i}",
                phase="forward" if (i < split) != flip else "backward",
                inputs=tuple(inputs),
                outputs=tuple(outputs),
                time_s=draw(st.sampled_from((0.0, 0.5, 1.0, 3.0))),
                workspace_bytes=draw(st.sampled_from((0, 0, 64))),
                recomputable=draw(st.sampled_from((True, True, True, False))),
                rng=draw(st.booleans()),
            )
        )
        readable += outputs
    made = [v.id for v in values if v.kind not in ("input", "param")]
    required = draw(st.lists(st.sampled_from(made), max_size=4, unique=True)) if made else []
    return Graph(
        values=tuple(values),
        nodes=tuple(nodes),
        required=tuple(required),
        static_bytes=draw(st.integers(0, 500)),
    )
