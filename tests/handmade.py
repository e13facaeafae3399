"""Small graphs built by hand, with sizes and times chosen so answers can be worked out on paper.

Importable from any test (``tests/`` is on sys.path through ``tests/conftest.py``).
"""

from __future__ import annotations

from remat.ir import Graph, Node, Value


def V(id: str, size: int, kind: str = "activation") -> Value:
    return Value(id=id, size_bytes=size, kind=kind)  # type: ignore[arg-type]


def N(
    id: str,
    inputs: tuple[str, ...],
    outputs: tuple[str, ...],
    time_s: float,
    phase: str = "forward",
    **kw: object,
) -> Node:
    return Node(id=id, inputs=inputs, outputs=outputs, time_s=time_s, phase=phase, **kw)  # type: ignore[arg-type]


def chain_step() -> Graph:
    """Two-layer chain with loss and backward.

    forward:  f1: x(10),w1 -> a1(20)  1s;  f2: a1,w2 -> a2(30)  2s;  loss: a2 -> L(1)  0.5s
    backward: bL: a2 -> g2(30)  0.5s;  b2: g2,a1,w2 -> g1(20),gw2  4s;  b1: g1,x,w1 -> gw1  2s
    static_bytes = 100 (params and their gradients).
    """
    return Graph(
        name="hand-chain",
        values=(
            V("x", 10, "input"),
            V("w1", 4, "param"),
            V("w2", 4, "param"),
            V("a1", 20),
            V("a2", 30),
            V("L", 1, "loss"),
            V("g2", 30, "gradient"),
            V("g1", 20, "gradient"),
            V("gw2", 4, "gradient"),
            V("gw1", 4, "gradient"),
        ),
        nodes=(
            N("f1", ("x", "w1"), ("a1",), 1.0),
            N("f2", ("a1", "w2"), ("a2",), 2.0),
            N("loss", ("a2",), ("L",), 0.5),
            N("bL", ("a2",), ("g2",), 0.5, "backward"),
            N("b2", ("g2", "a1", "w2"), ("g1", "gw2"), 4.0, "backward"),
            N("b1", ("g1", "x", "w1"), ("gw1",), 2.0, "backward"),
        ),
        required=("L", "gw1", "gw2"),
        static_bytes=100,
    )


def diamond() -> Graph:
    """Forward-only diamond with a workspace: x(10) -> a(20) -> {b(30), c(40, 50 B scratch)} ->
    d(5) -> L(1)."""
    return Graph(
        name="hand-diamond",
        values=(
            V("x", 10, "input"),
            V("a", 20),
            V("b", 30),
            V("c", 40),
            V("d", 5),
            V("L", 1, "loss"),
        ),
        nodes=(
            N("f1", ("x",), ("a",), 1.0),
            N("f2", ("a",), ("b",), 1.0),
            N("f3", ("a",), ("c",), 2.0, workspace_bytes=50),
            N("f4", ("b", "c"), ("d",), 1.0),
            N("loss", ("d",), ("L",), 1.0),
        ),
        required=("L",),
    )


def residual_step() -> Graph:
    """A residual block y = h + f2(h), h = f1(x), with its backward.

    forward:  f1: x(8),w1 -> h(16) 1s;  f2: h,w2 -> u(32) 2s;  add: h,u -> y(16) 0.5s;
              loss: y -> L(4) 0.5s
    backward: bL: y -> gy(16) 0.5s;  badd: gy -> gu(32), gh_a(16) 0.5s;
              b2: gu,h,w2 -> gh_b(16),gw2 4s;  acc: gh_a,gh_b -> gh(16) 0.5s;
              b1: gh,x,w1 -> gw1 2s
    """
    return Graph(
        name="hand-residual",
        values=(
            V("x", 8, "input"),
            V("w1", 4, "param"),
            V("w2", 4, "param"),
            V("h", 16),
            V("u", 32),
            V("y", 16),
            V("L", 4, "loss"),
            V("gy", 16, "gradient"),
            V("gu", 32, "gradient"),
            V("gh_a", 16, "gradient"),
            V("gh_b", 16, "gradient"),
            V("gh", 16, "gradient"),
            V("gw1", 4, "gradient"),
            V("gw2", 4, "gradient"),
        ),
        nodes=(
            N("f1", ("x", "w1"), ("h",), 1.0),
            N("f2", ("h", "w2"), ("u",), 2.0),
            N("add", ("h", "u"), ("y",), 0.5),
            N("loss", ("y",), ("L",), 0.5),
            N("bL", ("y",), ("gy",), 0.5, "backward"),
            N("badd", ("gy",), ("gu", "gh_a"), 0.5, "backward"),
            N("b2", ("gu", "h", "w2"), ("gh_b", "gw2"), 4.0, "backward"),
            N("acc", ("gh_a", "gh_b"), ("gh",), 0.5, "backward"),
            N("b1", ("gh", "x", "w1"), ("gw1",), 2.0, "backward"),
        ),
        required=("L", "gw1", "gw2"),
        static_bytes=16,
    )


def offload_chain(f3_time_s: float) -> Graph:
    """Forward-only graph where a big early value ``a`` is read again at the very end.

    f1: x(10) -> a(100) 1s;  f2: a -> b(10) 1s;  f3: b -> c(50) ``f3_time_s``;
    f5: c -> e(60) 1s;  f4: e,a -> L(1) 1s.  Host bandwidth in the tests: 50 B/s.
    """
    return Graph(
        name="hand-offload",
        values=(
            V("x", 10, "input"),
            V("a", 100),
            V("b", 10),
            V("c", 50),
            V("e", 60),
            V("L", 1, "loss"),
        ),
        nodes=(
            N("f1", ("x",), ("a",), 1.0),
            N("f2", ("a",), ("b",), 1.0),
            N("f3", ("b",), ("c",), f3_time_s),
            N("f5", ("c",), ("e",), 1.0),
            N("f4", ("e", "a"), ("L",), 1.0),
        ),
        required=("L",),
    )


def partition_chain(fa_time_s: float = 10.0) -> Graph:
    """x -> a -> b -> d -> c (loss); the backward reads d, then b, then a. Activations of 100
    bytes, gradients of 10; a's op takes ``fa_time_s``, the others 1 s (the compile tests'
    stand-in for a joint graph)."""
    values = [
        Value(id="x", size_bytes=10, kind="input"),
        *(Value(id=v, size_bytes=100) for v in "abd"),
        Value(id="c", size_bytes=4),
        *(Value(id=g, size_bytes=10, kind="gradient") for g in ("gd", "gb", "ga")),
    ]
    nodes = [
        Node(id="fa", inputs=("x",), outputs=("a",), time_s=fa_time_s),
        Node(id="fb", inputs=("a",), outputs=("b",), time_s=1.0),
        Node(id="fd", inputs=("b",), outputs=("d",), time_s=1.0),
        Node(id="fc", inputs=("d",), outputs=("c",), time_s=1.0),
        Node(id="bd", phase="backward", inputs=("d",), outputs=("gd",), time_s=1.0),
        Node(id="bb", phase="backward", inputs=("b", "gd"), outputs=("gb",), time_s=1.0),
        Node(id="ba", phase="backward", inputs=("a", "gb"), outputs=("ga",), time_s=1.0),
    ]
    return Graph(nodes=nodes, values=values, required=["ga", "c"])
