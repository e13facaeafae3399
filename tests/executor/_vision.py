"""The blocks of torchvision's ConvNeXt, VisionTransformer and Swin, rebuilt (torchvision does
not install beside the CPU torch build here): depthwise convolution, LayerNorm over a
channels-last permute, layer scale and stochastic depth; an encoder with
nn.MultiheadAttention; window attention with shifted windows and a relative position bias.
Random weights, small configurations in the tests."""

# ruff: noqa
import math
from functools import partial
import torch
import torch.nn.functional as F
from torch import nn


class Permute(nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.dims = dims

    def forward(self, x):
        return torch.permute(x, self.dims)


class StochasticDepth(nn.Module):
    def __init__(self, p, mode="row"):
        super().__init__()
        self.p = p
        self.mode = mode

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        survival = 1.0 - self.p
        size = [x.shape[0]] + [1] * (x.ndim - 1) if self.mode == "row" else [1] * x.ndim
        noise = torch.empty(size, dtype=x.dtype, device=x.device).bernoulli_(survival)
        if survival > 0.0:
            noise.div_(survival)
        return x * noise


class LayerNorm2d(nn.LayerNorm):
    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class CNBlock(nn.Module):
    def __init__(self, dim, layer_scale, sd_prob):
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim, bias=True),
            Permute([0, 2, 3, 1]),
            nn.LayerNorm(dim, eps=1e-6),
            nn.Linear(dim, 4 * dim),
            nn.GELU(),
            nn.Linear(4 * dim, dim),
            Permute([0, 3, 1, 2]),
        )
        self.layer_scale = nn.Parameter(torch.ones(dim, 1, 1) * layer_scale)
        self.stochastic_depth = StochasticDepth(sd_prob, "row")

    def forward(self, x):
        result = self.layer_scale * self.block(x)
        result = self.stochastic_depth(result)
        result += x
        return result


class ConvNeXt(nn.Module):
    def __init__(self, dims=(96, 192, 384, 768), depths=(3, 3, 9, 3), sd=0.1, num_classes=1000):
        super().__init__()
        norm = partial(LayerNorm2d, eps=1e-6)
        layers = [nn.Sequential(nn.Conv2d(3, dims[0], 4, 4), norm(dims[0]))]
        total = sum(depths)
        k = 0
        for i, (d, n) in enumerate(zip(dims, depths)):
            stage = []
            for _ in range(n):
                stage.append(CNBlock(d, 1e-6, sd * k / max(total - 1, 1)))
                k += 1
            layers.append(nn.Sequential(*stage))
            if i + 1 < len(dims):
                layers.append(nn.Sequential(norm(d), nn.Conv2d(d, dims[i + 1], 2, 2)))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            norm(dims[-1]), nn.Flatten(1), nn.Linear(dims[-1], num_classes)
        )

    def forward(self, x):
        return self.classifier(self.avgpool(self.features(x)))


class EncoderBlock(nn.Module):
    def __init__(self, heads, hidden, mlp, dropout=0.0, attn_dropout=0.0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(
            hidden, heads, dropout=attn_dropout, batch_first=True
        )
        self.dropout = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(hidden, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, mlp),
            nn.GELU(),
            nn.Dropout(dropout),
            nn.Linear(mlp, hidden),
            nn.Dropout(dropout),
        )

    def forward(self, input):
        x = self.ln_1(input)
        x, _ = self.self_attention(x, x, x, need_weights=False)
        x = self.dropout(x)
        x = x + input
        y = self.ln_2(x)
        y = self.mlp(y)
        return x + y


class ViT(nn.Module):
    def __init__(
        self,
        image=64,
        patch=16,
        layers=2,
        heads=2,
        hidden=128,
        mlp=512,
        classes=1000,
        dropout=0.0,
        attn_dropout=0.0,
    ):
        super().__init__()
        self.patch, self.hidden = patch, hidden
        self.conv_proj = nn.Conv2d(3, hidden, patch, patch)
        seq = (image // patch) ** 2 + 1
        self.class_token = nn.Parameter(torch.zeros(1, 1, hidden))
        self.pos_embedding = nn.Parameter(torch.empty(1, seq, hidden).normal_(std=0.02))
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.Sequential(
            *[EncoderBlock(heads, hidden, mlp, dropout, attn_dropout) for _ in range(layers)]
        )
        self.ln = nn.LayerNorm(hidden, eps=1e-6)
        self.heads = nn.Sequential(nn.Linear(hidden, classes))

    def forward(self, x):
        n, c, h, w = x.shape
        x = self.conv_proj(x).reshape(n, self.hidden, -1).permute(0, 2, 1)
        x = torch.cat([self.class_token.expand(n, -1, -1), x], dim=1)
        x = self.ln(self.layers(self.dropout(x + self.pos_embedding)))
        return self.heads(x[:, 0])


def shifted_window_attention(
    input, qkv_weight, proj_weight, rpb, window, heads, shift, qkv_bias, proj_bias, training
):
    B, H, W, C = input.shape
    pad_r = (window[1] - W % window[1]) % window[1]
    pad_b = (window[0] - H % window[0]) % window[0]
    x = F.pad(input, (0, 0, 0, pad_r, 0, pad_b))
    _, pH, pW, _ = x.shape
    shift = list(shift)
    if window[0] >= pH:
        shift[0] = 0
    if window[1] >= pW:
        shift[1] = 0
    if sum(shift) > 0:
        x = torch.roll(x, shifts=(-shift[0], -shift[1]), dims=(1, 2))
    nw = (pH // window[0]) * (pW // window[1])
    x = x.view(B, pH // window[0], window[0], pW // window[1], window[1], C)
    x = x.permute(0, 1, 3, 2, 4, 5).reshape(B * nw, window[0] * window[1], C)
    qkv = F.linear(x, qkv_weight, qkv_bias)
    qkv = qkv.reshape(x.size(0), x.size(1), 3, heads, C // heads).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    q = q * (C // heads) ** -0.5
    attn = q.matmul(k.transpose(-2, -1))
    attn = attn + rpb
    if sum(shift) > 0:
        mask = x.new_zeros((pH, pW))
        hs = ((0, -window[0]), (-window[0], -shift[0]), (-shift[0], None))
        ws = ((0, -window[1]), (-window[1], -shift[1]), (-shift[1], None))
        count = 0
        for h in hs:
            for w in ws:
                mask[h[0] : h[1], w[0] : w[1]] = count
                count += 1
        mask = mask.view(pH // window[0], window[0], pW // window[1], window[1])
        mask = mask.permute(0, 2, 1, 3).reshape(nw, window[0] * window[1])
        mask = mask.unsqueeze(1) - mask.unsqueeze(2)
        mask = mask.masked_fill(mask != 0, -100.0).masked_fill(mask == 0, 0.0)
        attn = attn.view(x.size(0) // nw, nw, heads, x.size(1), x.size(1))
        attn = attn + mask.unsqueeze(1).unsqueeze(0)
        attn = attn.view(-1, heads, x.size(1), x.size(1))
    attn = F.softmax(attn, dim=-1)
    x = attn.matmul(v).transpose(1, 2).reshape(x.size(0), x.size(1), C)
    x = F.linear(x, proj_weight, proj_bias)
    x = x.view(B, pH // window[0], pW // window[1], window[0], window[1], C)
    x = x.permute(0, 1, 3, 2, 4, 5).reshape(B, pH, pW, C)
    if sum(shift) > 0:
        x = torch.roll(x, shifts=(shift[0], shift[1]), dims=(1, 2))
    return x[:, :H, :W, :].contiguous()


class ShiftedWindowAttention(nn.Module):
    def __init__(self, dim, window, shift, heads):
        super().__init__()
        self.window, self.shift, self.heads = window, shift, heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.table = nn.Parameter(torch.zeros((2 * window[0] - 1) * (2 * window[1] - 1), heads))
        nn.init.trunc_normal_(self.table, std=0.02)
        ch, cw = torch.meshgrid(torch.arange(window[0]), torch.arange(window[1]), indexing="ij")
        coords = torch.flatten(torch.stack([ch, cw]), 1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
        rel[:, :, 0] += window[0] - 1
        rel[:, :, 1] += window[1] - 1
        rel[:, :, 0] *= 2 * window[1] - 1
        self.register_buffer("index", rel.sum(-1).flatten())

    def forward(self, x):
        n = self.window[0] * self.window[1]
        rpb = self.table[self.index].view(n, n, -1).permute(2, 0, 1).contiguous().unsqueeze(0)
        return shifted_window_attention(
            x,
            self.qkv.weight,
            self.proj.weight,
            rpb,
            self.window,
            self.heads,
            self.shift,
            self.qkv.bias,
            self.proj.bias,
            self.training,
        )


class SwinBlock(nn.Module):
    def __init__(self, dim, heads, window, shift, sd):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-5)
        self.attn = ShiftedWindowAttention(dim, window, shift, heads)
        self.stochastic_depth = StochasticDepth(sd, "row")
        self.norm2 = nn.LayerNorm(dim, eps=1e-5)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim),
            nn.GELU(),
            nn.Dropout(0.0),
            nn.Linear(4 * dim, dim),
            nn.Dropout(0.0),
        )

    def forward(self, x):
        x = x + self.stochastic_depth(self.attn(self.norm1(x)))
        x = x + self.stochastic_depth(self.mlp(self.norm2(x)))
        return x


class PatchMerging(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)
        self.norm = nn.LayerNorm(4 * dim)

    def forward(self, x):
        H, W = x.shape[-3:-1]
        x = F.pad(x, (0, 0, 0, W % 2, 0, H % 2))
        x = torch.cat(
            [
                x[..., 0::2, 0::2, :],
                x[..., 1::2, 0::2, :],
                x[..., 0::2, 1::2, :],
                x[..., 1::2, 1::2, :],
            ],
            -1,
        )
        return self.reduction(self.norm(x))


class Swin(nn.Module):
    def __init__(
        self,
        embed=96,
        depths=(2, 2, 6, 2),
        heads=(3, 6, 12, 24),
        window=(7, 7),
        sd=0.2,
        classes=1000,
    ):
        super().__init__()
        layers = [
            nn.Sequential(nn.Conv2d(3, embed, 4, 4), Permute([0, 2, 3, 1]), nn.LayerNorm(embed))
        ]
        total = sum(depths)
        k = 0
        for i, (d, h) in enumerate(zip(depths, heads)):
            dim = embed * 2**i
            stage = []
            for j in range(d):
                stage.append(
                    SwinBlock(
                        dim,
                        h,
                        list(window),
                        [0 if j % 2 == 0 else w // 2 for w in window],
                        sd * k / max(total - 1, 1),
                    )
                )
                k += 1
            layers.append(nn.Sequential(*stage))
            if i < len(depths) - 1:
                layers.append(PatchMerging(dim))
        self.features = nn.Sequential(*layers)
        nf = embed * 2 ** (len(depths) - 1)
        self.norm = nn.LayerNorm(nf)
        self.permute = Permute([0, 3, 1, 2])
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten(1)
        self.head = nn.Linear(nf, classes)

    def forward(self, x):
        x = self.norm(self.features(x))
        return self.head(self.flatten(self.avgpool(self.permute(x))))
