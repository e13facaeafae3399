"""Example models, written the way users write them, each with a ``build_*`` function.

Every ``build_*(...)`` takes sizes as keyword arguments and returns ``(model, example_inputs,
loss_fn)``: ``loss_fn(model(*example_inputs))`` is the scalar training loss (targets are closed
over). ``remat trace examples/models.py:build_gpt --out gpt.json`` traces one of them.

* :func:`build_mlp` - a stack of Linear/ReLU blocks.
* :func:`build_gpt` - a GPT-style decoder: token and position embeddings, causal attention with
  ``scaled_dot_product_attention`` (the causal mask is built on the fly, optionally combined with
  a padding mask passed as a second input), dropout, layer norm, MLP, head tied to the token
  embedding. :func:`gpt_demo` is the small configuration ``make demo`` uses; :func:`gpt_1b` is
  a 1-billion-parameter configuration for tracing benchmarks (build it on the meta device).
* :func:`build_resnet` - a ResNet-style conv net with batch norm and in-place ReLU.
* :func:`build_unet` - a U-Net with skip connections (concatenation), max-pool and transposed
  convolutions.
* :func:`build_vit` - a ViT-style encoder: patch embedding, class token, position embedding,
  pre-norm attention blocks.
* :func:`build_causal_lm` - transformers' GPT-2 or Llama with the user's own next-token loss
  (:class:`NextTokenLM`; needs ``transformers``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Built = tuple[nn.Module, tuple[Any, ...], Callable[[Any], torch.Tensor]]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- MLP --------------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, in_features: int, hidden: int, depth: int, classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def build_mlp(
    *,
    batch: int = 64,
    in_features: int = 256,
    hidden: int = 512,
    depth: int = 4,
    classes: int = 10,
    seed: int = 0,
) -> Built:
    torch.manual_seed(seed)
    model = MLP(in_features, hidden, depth, classes)
    g = _generator(seed)
    x = torch.randn(batch, in_features, generator=g)
    y = torch.randint(0, classes, (batch,), generator=g)
    return model, (x,), lambda out: F.cross_entropy(out, y)


# -- GPT --------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        assert d_model % n_heads == 0
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim)
        q = q.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        k = k.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        v = v.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(
        self,
        vocab: int,
        block_size: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        dropout: float,
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.wte.weight  # weight tying
        for emb in (self.wte, self.wpe):
            nn.init.normal_(emb.weight, std=0.02)  # as GPT-2 does: small logits at the start

    def forward(self, idx: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)  # a tensor made inside forward
        x = self.drop(self.wte(idx) + self.wpe(pos))
        mask = None
        if padding_mask is not None:
            # Causal mask built on the fly, combined with the keys' padding: (B, 1, T, T).
            causal = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()
            mask = causal[None, None] & padding_mask[:, None, None, :]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


def build_gpt(
    *,
    batch: int = 4,
    seq: int = 64,
    vocab: int = 512,
    d_model: int = 128,
    n_layers: int = 2,
    n_heads: int = 4,
    dropout: float = 0.1,
    padding_mask: bool = False,
    seed: int = 0,
    device: str = "cpu",
) -> Built:
    """A GPT-style decoder; ``padding_mask=True`` adds a (batch, seq) bool mask as 2nd input.

    ``device`` is where the model is built (``"meta"`` for models too large to allocate); the
    example inputs are on the CPU either way.
    """
    torch.manual_seed(seed)
    with torch.device(device):
        model = GPT(vocab, seq, d_model, n_layers, n_heads, dropout)
    g = _generator(seed)
    # Inputs stay on the CPU (they are small); a meta-device model traces as on the CPU.
    idx = torch.randint(0, vocab, (batch, seq), generator=g)
    targets = torch.randint(0, vocab, (batch, seq), generator=g)

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    inputs: tuple[Any, ...] = (idx,)
    if padding_mask:
        keep = torch.ones(batch, seq, dtype=torch.bool)
        keep[0, seq // 2 :] = False  # the first sequence is padded
        inputs = (idx, keep)
    return model, inputs, loss_fn


def gpt_demo() -> Built:
    """The small GPT that ``make demo`` traces (0.94 M parameters; traces in about a second)."""
    return build_gpt(batch=8, seq=128, vocab=1024, d_model=128, n_layers=4, n_heads=4)


def gpt_1b(*, batch: int = 8, seq: int = 1024, device: str = "meta") -> Built:
    """A 1.0-billion-parameter GPT (d=2048, 18 layers, vocab 50304), on the meta device."""
    return build_gpt(
        batch=batch,
        seq=seq,
        vocab=50304,
        d_model=2048,
        n_layers=18,
        n_heads=16,
        dropout=0.1,
        device=device,
    )


# -- ResNet -----------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.down: nn.Module | None = None
        if stride != 1 or c_in != c_out:
            self.down = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, width: int, blocks_per_stage: int, stages: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)
        )
        layers: list[nn.Module] = []
        c = width
        for s in range(stages):
            c_out = width * 2**s
            for b in range(blocks_per_stage):
                layers.append(BasicBlock(c, c_out, 2 if (b == 0 and s > 0) else 1))
                c = c_out
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def build_resnet(
    *,
    batch: int = 8,
    image: int = 32,
    width: int = 16,
    blocks_per_stage: int = 2,
    stages: int = 3,
    classes: int = 10,
    seed: int = 0,
) -> Built:
    torch.manual_seed(seed)
    model = ResNet(width, blocks_per_stage, stages, classes)
    g = _generator(seed)
    x = torch.randn(batch, 3, image, image, generator=g)
    y = torch.randint(0, classes, (batch,), generator=g)
    return model, (x,), lambda out: F.cross_entropy(out, y)


# -- U-Net ------------------------------------------------------------------------------------


class DoubleConv(nn.Sequential):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__(
            nn.Conv2d(c_in, c_out, 3, padding=1),
            nn.BatchNorm2d(c_out),
            nn.ReLU(),
            nn.Conv2d(c_out, c_out, 3, padding=1),
            nn.BatchNorm2d(c_out),
            nn.ReLU(),
        )


class UNet(nn.Module):
    def __init__(self, channels: int, width: int, depth: int, classes: int) -> None:
        super().__init__()
        self.downs = nn.ModuleList()
        c = channels
        for i in range(depth):
            self.downs.append(DoubleConv(c, width * 2**i))
            c = width * 2**i
        self.bottom = DoubleConv(c, c * 2)
        self.ups = nn.ModuleList()
        self.up_convs = nn.ModuleList()
        c = c * 2
        for i in reversed(range(depth)):
            skip = width * 2**i
            self.ups.append(nn.ConvTranspose2d(c, skip, 2, stride=2))
            self.up_convs.append(DoubleConv(2 * skip, skip))
            c = skip
        self.out = nn.Conv2d(c, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for down in self.downs:
            x = down(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.bottom(x)
        for up, conv, skip in zip(self.ups, self.up_convs, reversed(skips), strict=True):
            x = conv(torch.cat([up(x), skip], dim=1))
        return self.out(x)


def build_unet(
    *,
    batch: int = 2,
    image: int = 32,
    channels: int = 3,
    width: int = 8,
    depth: int = 3,
    classes: int = 4,
    seed: int = 0,
) -> Built:
    torch.manual_seed(seed)
    model = UNet(channels, width, depth, classes)
    g = _generator(seed)
    x = torch.randn(batch, channels, image, image, generator=g)
    y = torch.randint(0, classes, (batch, image, image), generator=g)
    return model, (x,), lambda out: F.cross_entropy(out, y)


# -- ViT --------------------------------------------------------------------------------------


class EncoderBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        h = self.n_heads
        qkv = self.qkv(self.ln1(x)).reshape(B, N, 3, h, C // h).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        a = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(a.transpose(1, 2).reshape(B, N, C))
        return x + self.mlp(self.ln2(x))


class ViT(nn.Module):
    def __init__(
        self,
        image: int,
        patch: int,
        d_model: int,
        depth: int,
        n_heads: int,
        classes: int,
        dropout: float,
    ) -> None:
        super().__init__()
        n = (image // patch) ** 2
        self.patch = nn.Conv2d(3, d_model, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, d_model))
        self.pos = nn.Parameter(torch.randn(1, n + 1, d_model) * 0.02)
        self.blocks = nn.Sequential(
            *(EncoderBlock(d_model, n_heads, dropout) for _ in range(depth))
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)  # (B, N, C)
        cls = self.cls.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def build_vit(
    *,
    batch: int = 4,
    image: int = 32,
    patch: int = 4,
    d_model: int = 64,
    depth: int = 2,
    n_heads: int = 4,
    classes: int = 10,
    dropout: float = 0.1,
    seed: int = 0,
) -> Built:
    torch.manual_seed(seed)
    model = ViT(image, patch, d_model, depth, n_heads, classes, dropout)
    g = _generator(seed)
    x = torch.randn(batch, 3, image, image, generator=g)
    y = torch.randint(0, classes, (batch,), generator=g)
    return model, (x,), lambda out: F.cross_entropy(out, y)


# -- transformers causal LMs ------------------------------------------------------------------
class NextTokenLM(nn.Module):
    """A transformers causal LM with the user's own next-token loss: ``forward(ids)`` returns
    the loss (transformers' own loss function breaks a torch.compile graph)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=ids).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


def build_causal_lm(
    family: str = "gpt2",
    *,
    batch: int = 4,
    seq: int = 64,
    vocab: int = 1024,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    positions: int = 128,
    seed: int = 0,
) -> Built:
    """transformers' GPT-2 (``"gpt2"``) or Llama (``"llama"``: MLP width 344, two key-value
    heads, attention dropout 0.1) from a config (random weights, nothing downloaded) in
    :class:`NextTokenLM`; the loss is the model's output (needs ``transformers``)."""
    import transformers

    torch.manual_seed(seed)
    lm: nn.Module
    if family == "gpt2":
        cfg: Any = transformers.GPT2Config(
            vocab_size=vocab, n_positions=positions, n_embd=hidden, n_layer=layers,
            n_head=heads, use_cache=False, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        lm = transformers.GPT2LMHeadModel(cfg)
    elif family == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=344,
            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
            max_position_embeddings=positions, use_cache=False, attention_dropout=0.1,
        )  # fmt: skip
        lm = transformers.LlamaForCausalLM(cfg)
    else:
        raise ValueError(f"family must be 'gpt2' or 'llama', got {family!r}")
    ids = torch.randint(0, vocab, (batch, seq), generator=_generator(seed))
    return NextTokenLM(lm.train()), (ids,), lambda loss: loss


BUILDERS: dict[str, Callable[..., Built]] = {
    "mlp": build_mlp,
    "gpt": build_gpt,
    "resnet": build_resnet,
    "unet": build_unet,
    "vit": build_vit,
}

__all__ = [
    "BUILDERS",
    "NextTokenLM",
    "build_causal_lm",
    "build_gpt",
    "build_mlp",
    "build_resnet",
    "build_unet",
    "build_vit",
    "gpt_1b",
    "gpt_demo",
]
