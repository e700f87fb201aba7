"""Small test models for the compiler tests, written in plain torch (no graphquant imports).

Every size is a multiple of 32, so every operand of every GEMM tiles MXFP8 (32), NVFP4 (16)
and, for FP8 blockwise, partial 1x128 / 128x128 tiles. Batched attention GEMMs quantize their
rows per (batch, head) group, so FP8 blockwise with matmul attention needs seq % 128 == 0
(its columnwise blocks span 128 rows); the other formats need seq % 32 == 0.

Module names (``named_modules()``) the tests rely on:
    MLP:           fc1, fc2
    DecoderBlock:  norm1, attn.{q,k,v,o}_proj, norm2, mlp.{gate,up,down}_proj
    TinyLM:        embed, layers.<i>.<DecoderBlock names>, norm, lm_head (weight tied to embed)
    MLPStack:      layers.<i>.mlp.fc1, layers.<i>.mlp.fc2
    SharedLinear:  fc (called twice), out
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """fc1 -> activation -> fc2; with bias by default."""

    def __init__(self, d_in: int = 64, hidden: int = 128, d_out: int = 64, *, bias: bool = True, act: str = "gelu"):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, d_out, bias=bias)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = F.gelu(h) if self.act == "gelu" else F.relu(h)
        return self.fc2(h)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Causal multi-head attention.

    kind="matmul": scores with torch.matmul (4-D), probabilities x values with torch.bmm (3-D).
    kind="einsum": both products with torch.einsum ("bhqd,bhkd->bhqk", "bhqk,bhkd->bhqd").
    kind="sdpa":   F.scaled_dot_product_attention (left in high precision by graphquant).
    """

    def __init__(self, dim: int = 64, n_heads: int = 2, kind: str = "matmul", causal: bool = True):
        super().__init__()
        assert kind in ("matmul", "einsum", "sdpa")
        self.n_heads, self.head_dim, self.kind, self.causal = n_heads, dim // n_heads, kind, causal
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h, hd = self.n_heads, self.head_dim
        q = self.q_proj(x).view(b, s, h, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, s, h, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, s, h, hd).transpose(1, 2)
        if self.kind == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        else:
            if self.kind == "matmul":
                scores = torch.matmul(q, k.transpose(-2, -1))
            else:
                scores = torch.einsum("bhqd,bhkd->bhqk", q, k)
            scores = scores / math.sqrt(hd)
            if self.causal:
                mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
                scores = scores.masked_fill(~mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            if self.kind == "matmul":
                out = torch.bmm(probs.reshape(b * h, s, s), v.reshape(b * h, s, hd)).view(b, h, s, hd)
            else:
                out = torch.einsum("bhqk,bhkd->bhqd", probs, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, d))


class SwiGLU(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 128):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nn.Module):
    """A Llama-style pre-norm block: x + attn(norm1(x)), then h + mlp(norm2(h))."""

    def __init__(self, dim: int = 64, n_heads: int = 2, hidden: int = 128, attention: str = "matmul", causal: bool = True):
        super().__init__()
        self.norm1 = RMSNorm(dim)
        self.attn = Attention(dim, n_heads, attention, causal)
        self.norm2 = RMSNorm(dim)
        self.mlp = SwiGLU(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.norm1(x))
        return h + self.mlp(self.norm2(h))


class TinyLM(nn.Module):
    """Token ids -> embedding -> decoder blocks -> RMSNorm -> lm_head, with lm_head.weight tied to
    embed.weight (one Parameter, two uses: a gather and a GEMM)."""

    def __init__(
        self, vocab: int = 128, dim: int = 64, n_heads: int = 2, hidden: int = 128, attention=("matmul",), causal: bool = True
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(DecoderBlock(dim, n_heads, hidden, kind, causal) for kind in attention)
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm(h))


class MLPBlock(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 128):
        super().__init__()
        self.mlp = MLP(dim, hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class MLPStack(nn.Module):
    """layers.<i>.mlp.fc1 / fc2: the names of the design's examples."""

    def __init__(self, n_layers: int = 2, dim: int = 64, hidden: int = 128):
        super().__init__()
        self.layers = nn.ModuleList(MLPBlock(dim, hidden) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class SharedLinear(nn.Module):
    """One Linear called twice (fc: two calls, one name), then an output Linear with bias."""

    def __init__(self, dim: int = 64):
        super().__init__()
        self.fc = nn.Linear(dim, dim, bias=True)
        self.out = nn.Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.fc(F.relu(self.fc(x))))


class FunctionalGemms(nn.Module):
    """GEMMs written as functions inside a module's forward: F.linear with the module's own
    parameter, torch.mm / addmm / baddbmm between activations, and an einsum."""

    def __init__(self, dim: int = 64):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (b, s, d)
        b, s, d = x.shape
        h = F.linear(x, self.weight, self.bias)  # linear.0
        flat = h.reshape(b * s, d)
        g = torch.mm(flat.t().contiguous(), flat) / (b * s)  # matmul.0: (d, d) Gram matrix
        y = torch.addmm(flat, flat, g)  # matmul.1
        z = torch.baddbmm(h, h, g.expand(b, d, d))  # matmul.2 (batched)
        e = torch.einsum("bsd,bed->bse", z, h)  # matmul.3: (b, s, s)
        return y.view(b, s, d) + torch.einsum("bse,bed->bsd", e, h) / s  # matmul.4


class Wrapped(nn.Module):
    """``inner`` as a submodule named ``block``, so its functional GEMMs get "block." names."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.block = inner

    def forward(self, *args):
        return self.block(*args)


class NormMLP(nn.Module):
    """x + MLP(RMSNorm(x)): fc1's input is an activation no other op's backward needs."""

    def __init__(self, dim: int = 64, hidden: int = 128):
        super().__init__()
        self.norm = RMSNorm(dim)
        self.mlp = MLP(dim, hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Demo(nn.Module):
    """The module names of the fine-grained recipe guide's example: demo.fc1, demo.fc2, and one
    other module (head)."""

    def __init__(self, dim: int = 64, hidden: int = 128):
        super().__init__()
        self.demo = MLP(dim, hidden, dim)
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.demo(x))


class NoGemm(nn.Module):
    """Norm and elementwise ops only: graphquant finds nothing to quantize."""

    def __init__(self, dim: int = 64):
        super().__init__()
        self.norm = RMSNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.norm(x)) * 2.0


class IntegerGemm(nn.Module):
    """An integer matmul: an operand a quantizer must refuse."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a, b)


def seeded(model: nn.Module, seed: int = 0) -> nn.Module:
    """``model`` with parameters drawn from a fixed seed (the default init, reproducibly)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm1.weight", "norm2.weight", "norm.weight")):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return model
