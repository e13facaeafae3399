"""Synthetic training-step graphs: the families tests, benchmarks, the demo and the service use.

Each function returns a whole step (forward, loss, backward derived by
:class:`~remat.ir.builder.StepBuilder`), with sizes from real tensor shapes and times from a
roofline of a device profile (A100 by default), so baselines and solvers have meaning on them:

* :func:`chain` - homogeneous or heterogeneous chains of ``n`` stages (the rotor/revolve model);
* :func:`transformer` - a GPT-style decoder op graph (attention, MLP, layer norm, dropout,
  residuals, a weight-tied head);
* :func:`unet` - a U-Net with long skip connections and batch norm (running-statistic updates
  are side effects: not recomputable);
* :func:`random_layered_dag` - random layered DAGs like those of the Moccasin paper
  (Bartan et al., 2023).
"""

from __future__ import annotations

import random

from remat.ir.builder import Out, StepBuilder
from remat.ir.devices import A100_SXM_80GB
from remat.ir.graph import DeviceProfile, Graph


def chain(
    num_stages: int,
    *,
    heterogeneous: bool = False,
    batch_size: int = 256,
    width: int = 1024,
    seed: int = 0,
    device: DeviceProfile = A100_SXM_80GB,
) -> Graph:
    """A chain of ``num_stages`` stages, each ``linear -> gelu`` in module ``stages.<i>``.

    A stage's backward reads its input (for the linear) and its pre-activation (for the gelu),
    so keeping only stage inputs halves the saved bytes, as in the rotor paper's chains.

    Homogeneous chains have equal widths (equal sizes and times per stage); heterogeneous ones
    draw each stage's width from [width/4, 2*width] with ``seed``.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    rng = random.Random(seed)
    b = StepBuilder(f"{'het' if heterogeneous else 'hom'}-chain-{num_stages}", device=device)
    x = b.input("x", (batch_size, width))
    w_in = width
    for i in range(num_stages):
        w_out = rng.randint(width // 4, 2 * width) if heterogeneous else width
        mod = f"stages.{i}"
        w = b.param(f"{mod}.weight", (w_in, w_out))
        (h,) = b.op(
            "aten.mm",
            [x, w],
            [Out(f"{mod}.pre", (batch_size, w_out))],
            flops=2 * batch_size * w_in * w_out,
            save=[x],
            module=mod,
        )
        (x,) = b.op(
            "aten.gelu",
            [h],
            [Out(f"{mod}.out", (batch_size, w_out))],
            flops=8 * batch_size * w_out,
            save=[h],
            module=mod,
        )
        w_in = w_out
    b.loss("aten.sum", [x], flops=batch_size * w_in, save=[])
    return b.build()


def transformer(
    num_layers: int = 12,
    *,
    d_model: int = 768,
    num_heads: int = 12,
    seq_len: int = 1024,
    batch_size: int = 8,
    vocab_size: int = 16384,
    dropout: bool = True,
    device: DeviceProfile = A100_SXM_80GB,
) -> Graph:
    """A GPT-style decoder step at the op level (about 25 nodes per layer)."""
    if num_layers < 0:
        raise ValueError(f"num_layers must be >= 0, got {num_layers}")
    B, S, D, V, H = batch_size, seq_len, d_model, vocab_size, num_heads
    bsd = B * S * D
    g = StepBuilder(f"transformer-{num_layers}l-{D}d", device=device)
    ids = g.input("ids", (B, S), "int64")
    targets = g.input("targets", (B, S), "int64")
    wte = g.param("embed.wte", (V, D))
    wpe = g.param("embed.wpe", (S, D))
    (x,) = g.op(
        "aten.embedding",
        [ids, wte, wpe],
        [Out("embed.out", (B, S, D))],
        flops=bsd,
        bwd_flops=bsd,
        save=[ids],
        module="embed",
    )
    if dropout:
        x, _ = g.op(
            "aten.native_dropout",
            [x],
            [Out("embed.drop", (B, S, D)), Out("embed.drop.mask", (B, S, D), "bool", grad=False)],
            flops=bsd,
            bwd_flops=bsd,
            save=["$1"],
            module="embed",
            rng=True,
        )

    def layer_norm(x: str, mod: str) -> str:
        gamma = g.param(f"{mod}.weight", (D,))
        beta = g.param(f"{mod}.bias", (D,))
        h, _ = g.op(
            "aten.native_layer_norm",
            [x, gamma, beta],
            [Out(f"{mod}.out", (B, S, D)), Out(f"{mod}.stats", (B, S, 2), grad=False)],
            flops=8 * bsd,
            save=[x, "$1"],
            module=mod,
        )
        return h

    def linear(x: str, d_in: int, d_out: int, mod: str) -> str:
        w = g.param(f"{mod}.weight", (d_in, d_out))
        bias = g.param(f"{mod}.bias", (d_out,))
        (y,) = g.op(
            "aten.addmm",
            [x, w, bias],
            [Out(f"{mod}.out", (B, S, d_out))],
            flops=2 * B * S * d_in * d_out,
            save=[x],
            module=mod,
        )
        return y

    def drop(x: str, mod: str) -> str:
        if not dropout:
            return x
        y, _ = g.op(
            "aten.native_dropout",
            [x],
            [Out(f"{mod}.out", (B, S, D)), Out(f"{mod}.mask", (B, S, D), "bool", grad=False)],
            flops=bsd,
            bwd_flops=bsd,
            save=["$1"],
            module=mod,
            rng=True,
        )
        return y

    for layer in range(num_layers):
        p = f"layers.{layer}"
        h = layer_norm(x, f"{p}.ln1")
        qkv = linear(h, D, 3 * D, f"{p}.attn.qkv")
        # Causal flash attention: QK^T and PV over half the square; backward ~2.5x forward.
        attn_flops = 2 * B * S * S * D
        o, _ = g.op(
            "aten._scaled_dot_product_flash_attention",
            [qkv],
            [Out(f"{p}.attn.out", (B, S, D)), Out(f"{p}.attn.lse", (B, H, S), grad=False)],
            flops=attn_flops,
            bwd_flops=int(2.5 * attn_flops),
            save=[qkv, "$0", "$1"],
            module=f"{p}.attn.sdpa",
        )
        a = drop(linear(o, D, D, f"{p}.attn.proj"), f"{p}.attn.drop")
        (x,) = g.op(
            "aten.add", [x, a], [Out(f"{p}.res1", (B, S, D))], flops=bsd, bwd_flops=0, module=p
        )
        h = layer_norm(x, f"{p}.ln2")
        u = linear(h, D, 4 * D, f"{p}.mlp.fc1")
        (v,) = g.op(
            "aten.gelu",
            [u],
            [Out(f"{p}.mlp.gelu", (B, S, 4 * D))],
            flops=8 * 4 * bsd,
            save=[u],
            module=f"{p}.mlp.gelu",
        )
        m = drop(linear(v, 4 * D, D, f"{p}.mlp.fc2"), f"{p}.mlp.drop")
        (x,) = g.op(
            "aten.add", [x, m], [Out(f"{p}.res2", (B, S, D))], flops=bsd, bwd_flops=0, module=p
        )

    h = layer_norm(x, "ln_f")
    (logits,) = g.op(
        "aten.mm",
        [h, wte],
        [Out("head.logits", (B, S, V))],
        flops=2 * B * S * D * V,
        save=[h],
        module="head",
    )
    g.loss("aten.cross_entropy", [logits, targets], flops=5 * B * S * V, save=[logits, targets])
    return g.build()


def unet(
    depth: int = 4,
    *,
    base_channels: int = 32,
    image_size: int = 128,
    batch_size: int = 8,
    in_channels: int = 3,
    device: DeviceProfile = A100_SXM_80GB,
) -> Graph:
    """A U-Net: ``depth`` down levels and up levels joined by long skip connections.

    Each conv is followed by batch norm (with a side-effecting running-statistics update, not
    recomputable) and ReLU.
    """
    if depth < 1 or image_size % (2**depth):
        raise ValueError(f"depth must be >= 1 and divide image_size by 2**depth, got {depth}")
    B = batch_size
    g = StepBuilder(f"unet-{depth}", device=device)
    x = g.input("image", (B, in_channels, image_size, image_size))
    target = g.input("target", (B, 1, image_size, image_size))

    def conv_bn_relu(x: str, c_in: int, c_out: int, hw: int, mod: str) -> str:
        w = g.param(f"{mod}.conv.weight", (c_out, c_in, 3, 3))
        shape = (B, c_out, hw, hw)
        (y,) = g.op(
            "aten.convolution",
            [x, w],
            [Out(f"{mod}.conv", shape)],
            flops=2 * B * hw * hw * c_out * c_in * 9,
            save=[x],
            module=f"{mod}.conv",
        )
        gamma = g.param(f"{mod}.bn.weight", (c_out,))
        beta = g.param(f"{mod}.bn.bias", (c_out,))
        z, stats = g.op(
            "aten._native_batch_norm_legit",
            [y, gamma, beta],
            [Out(f"{mod}.bn", shape), Out(f"{mod}.bn.stats", (2, c_out), grad=False)],
            flops=8 * B * hw * hw * c_out,
            save=[y, "$1"],
            module=f"{mod}.bn",
        )
        running = g.buffer(f"{mod}.bn.running_stats", (2, c_out))
        g.op(
            "aten.running_stats_update",
            [stats, running],
            [Out(f"{mod}.bn.running_stats.new", (2, c_out), grad=False)],
            flops=4 * c_out,
            module=f"{mod}.bn",
            recomputable=False,
            differentiable=False,
            kind="buffer",
        )
        (r,) = g.op(
            "aten.relu",
            [z],
            [Out(f"{mod}.relu", shape)],
            flops=B * hw * hw * c_out,
            bwd_flops=B * hw * hw * c_out,
            save=["$0"],
            module=f"{mod}.relu",
        )
        return r

    skips: list[tuple[str, int, int]] = []
    c_in, hw = in_channels, image_size
    for level in range(depth):
        c = base_channels * 2**level
        mod = f"down.{level}"
        x = conv_bn_relu(x, c_in, c, hw, f"{mod}.block1")
        x = conv_bn_relu(x, c, c, hw, f"{mod}.block2")
        skips.append((x, c, hw))
        hw //= 2
        x, _ = g.op(
            "aten.max_pool2d_with_indices",
            [x],
            [
                Out(f"{mod}.pool", (B, c, hw, hw)),
                Out(f"{mod}.pool.idx", (B, c, hw, hw), "int64", grad=False),
            ],
            flops=4 * B * c * hw * hw,
            bwd_flops=B * c * hw * hw,
            save=["$1"],
            module=f"{mod}.pool",
        )
        c_in = c
    c = base_channels * 2**depth
    x = conv_bn_relu(x, c_in, c, hw, "bottleneck.block1")
    x = conv_bn_relu(x, c, c, hw, "bottleneck.block2")
    for level in reversed(range(depth)):
        skip, c_skip, hw_skip = skips[level]
        mod = f"up.{level}"
        w = g.param(f"{mod}.upconv.weight", (c, c_skip, 2, 2))
        (u,) = g.op(
            "aten.convolution_transpose",
            [x, w],
            [Out(f"{mod}.upconv", (B, c_skip, hw_skip, hw_skip))],
            flops=2 * B * hw * hw * c * c_skip * 4,
            save=[x],
            module=f"{mod}.upconv",
        )
        hw = hw_skip
        (cat,) = g.op(
            "aten.cat",
            [u, skip],
            [Out(f"{mod}.cat", (B, 2 * c_skip, hw, hw))],
            flops=0,
            bwd_flops=0,
            module=mod,
        )
        x = conv_bn_relu(cat, 2 * c_skip, c_skip, hw, f"{mod}.block1")
        x = conv_bn_relu(x, c_skip, c_skip, hw, f"{mod}.block2")
        c = c_skip
    w = g.param("head.weight", (1, c, 1, 1))
    (out,) = g.op(
        "aten.convolution",
        [x, w],
        [Out("head.out", (B, 1, hw, hw))],
        flops=2 * B * hw * hw * c,
        save=[x],
        module="head",
    )
    g.loss("aten.mse_loss", [out, target], flops=3 * B * hw * hw, save=[out, target])
    return g.build()


def random_layered_dag(
    num_nodes: int = 200,
    *,
    num_layers: int | None = None,
    seed: int = 0,
    max_inputs: int = 3,
    skip_prob: float = 0.2,
    batch_size: int = 2048,
    max_width: int = 1024,
    device: DeviceProfile = A100_SXM_80GB,
) -> Graph:
    """A random layered DAG with ``num_nodes`` forward ops, after the Moccasin paper's
    generator: each op reads 1..``max_inputs`` values of the previous layer and, with
    ``skip_prob``, one from an earlier layer; every output is read by a later op or the loss.
    Half the ops are matmul-like with a weight (save their inputs), half elementwise products
    (save all inputs). Sizes and FLOPs are drawn with ``seed``.
    """
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    rng = random.Random(seed)
    layers = num_layers or max(1, round(num_nodes**0.5))
    per_layer = [num_nodes // layers + (1 if i < num_nodes % layers else 0) for i in range(layers)]
    per_layer = [k for k in per_layer if k > 0]
    # First decide the wiring, so that every op's output gets a reader.
    wiring: list[list[list[tuple[int, int]]]] = []  # layer -> op -> [(layer, op)] inputs
    for li, k in enumerate(per_layer):
        ops: list[list[tuple[int, int]]] = []
        for _ in range(k):
            if li == 0:
                ops.append([])
                continue
            prev = per_layer[li - 1]
            picked = {(li - 1, rng.randrange(prev)) for _ in range(rng.randint(1, max_inputs))}
            if li > 1 and rng.random() < skip_prob:
                lj = rng.randrange(li - 1)
                picked.add((lj, rng.randrange(per_layer[lj])))
            ops.append(sorted(picked))
        wiring.append(ops)
    read = {src for layer in wiring for op in layer for src in op}
    for li in range(len(per_layer) - 1):
        for oi in range(per_layer[li]):
            if (li, oi) not in read:
                lj = rng.randrange(li + 1, len(per_layer))
                wiring[lj][rng.randrange(per_layer[lj])].append((li, oi))

    g = StepBuilder(f"random-dag-{num_nodes}-s{seed}", device=device)
    x = g.input("x", (batch_size, max_width // 4))
    widths: dict[tuple[int, int], int] = {}
    outs: dict[tuple[int, int], str] = {}
    for li, layer in enumerate(wiring):
        for oi, srcs in enumerate(layer):
            w_out = rng.randrange(max_width // 16, max_width + 1, 16)
            widths[(li, oi)] = w_out
            ins = [outs[s] for s in srcs] or [x]
            w_in = sum(widths.get(s, max_width // 4) for s in srcs) or max_width // 4
            mod = f"layer.{li}.op{oi}"
            if rng.random() < 0.5:
                w = g.param(f"{mod}.weight", (w_in, w_out))
                (y,) = g.op(
                    "aten.mm",
                    [*ins, w],
                    [Out(mod, (batch_size, w_out))],
                    flops=2 * batch_size * w_in * w_out,
                    save=ins,
                    module=mod,
                )
            else:
                (y,) = g.op(
                    "aten.mul",
                    ins,
                    [Out(mod, (batch_size, w_out))],
                    flops=batch_size * w_out * len(ins),
                    bwd_flops=2 * batch_size * w_out * len(ins),
                    save=ins,
                    module=mod,
                )
            outs[(li, oi)] = y
    last = [outs[(len(wiring) - 1, oi)] for oi in range(per_layer[-1])]
    g.loss(
        "aten.sum",
        last,
        flops=batch_size * sum(widths[(len(wiring) - 1, oi)] for oi in range(per_layer[-1])),
    )
    return g.build()


FAMILIES = {
    "chain": lambda: chain(64),
    "heterogeneous-chain": lambda: chain(64, heterogeneous=True),
    "transformer": lambda: transformer(12),
    "unet": lambda: unet(4),
    "random-dag": lambda: random_layered_dag(200),
}
"""The benchmark families at their standard sizes, by name."""
