"""Llama-3-8B-shaped building blocks in plain torch, for the training-speed benchmark."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DIM, HIDDEN, HEADS, KV_HEADS = 4096, 14336, 32, 8


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


class FeedForward(nn.Module):
    """x + W2 (silu(W1 n) * W3 n), n = RMSNorm(x)."""

    def __init__(self, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.norm = RMSNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.norm(x)
        return x + self.w2(F.silu(self.w1(n)) * self.w3(n))


class Attention(nn.Module):
    """x + Wo SDPA(Wq n, Wk n, Wv n), causal, grouped-query heads."""

    def __init__(self, dim: int = DIM, heads: int = HEADS, kv_heads: int = KV_HEADS) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm = RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        n = self.norm(x)
        q = self.wq(n).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(n).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(n).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return x + self.wo(o.transpose(1, 2).reshape(batch, seq, dim))


class FFNStack(nn.Sequential):
    def __init__(self, blocks: int = 4) -> None:
        super().__init__(*[FeedForward() for _ in range(blocks)])


class DecoderLayer(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(Attention(), FeedForward())


def linear_gemm_shapes(model: nn.Module, tokens: int) -> list[tuple[int, int, int]]:
    """(m, n, k) of every GEMM one training step runs for the model's linears: fprop, dgrad, wgrad."""
    shapes = []
    for module in model.modules():
        if isinstance(module, nn.Linear):
            out_features, in_features = module.weight.shape
            shapes += [(tokens, out_features, in_features), (tokens, in_features, out_features), (out_features, in_features, tokens)]
    return shapes


def attention_flops(model: nn.Module, batch: int, seq: int) -> float:
    """FLOPs of causal SDPA in one training step (forward 2 GEMMs over half the scores, backward 2.5x)."""
    per_layer = sum(4 * batch * seq * seq * m.heads * m.head_dim / 2 for m in model.modules() if isinstance(m, Attention))
    return per_layer * 3.5
