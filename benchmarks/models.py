"""Llama-3-8B-shaped building blocks and a DeepSeek-V3 / Qwen3-MoE style MoE layer in plain
torch, for the training-speed benchmarks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphquant.formats import groups

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


class SwiGLU(nn.Module):
    """W2 (silu(W1 x) * W3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GroupedSwiGLU(nn.Module):
    """Every expert's SwiGLU over its rows of x (sorted by expert, cumulative ends ``offs``), each
    projection one torch._grouped_mm. The weights are stored as nn.Linear's are, (experts, out,
    in), and multiplied transposed, as TorchTitan's experts are (and torchao's MoE training
    expects): gate_up (experts, 2 * hidden, dim), down (experts, dim, hidden)."""

    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(experts, 2 * hidden, dim) * dim**-0.5)
        self.down = nn.Parameter(torch.randn(experts, dim, hidden) * hidden**-0.5)

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        gate, up = torch._grouped_mm(x, self.gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, self.down.transpose(-2, -1), offs=offs)


class MoE(nn.Module):
    """x + shared(n) + sum over the token's top_k experts of gate * expert(n), n = RMSNorm(x):
    a DeepSeek-V3 / Qwen3-MoE style layer (softmax router, top-k gates renormalised over the
    chosen experts, one always-on shared expert).

    The routed copies of the tokens are sorted by expert and the experts run as grouped GEMMs
    over their rows, the offsets counted on the device, as MoE training code does.
    ``token_group_alignment`` > 1 pads every expert's rows with zero rows to a multiple of it
    before the experts (and drops them after), as TorchTitan's MoE does for FP8 grouped GEMMs
    that need aligned groups (torchao's). Parameters are bf16 (torch._grouped_mm's dtype).
    """

    def __init__(self, dim: int, experts: int, top_k: int, hidden: int, shared_hidden: int, token_group_alignment: int = 1) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.token_group_alignment = experts, top_k, token_group_alignment
        self.norm = RMSNorm(dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = GroupedSwiGLU(experts, dim, hidden)
        self.shared = SwiGLU(dim, shared_hidden)
        self.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n = self.norm(x)
        gates, chosen = self.router(n).float().softmax(-1).topk(self.top_k, dim=-1)
        gates = (gates / gates.sum(-1, keepdim=True)).to(x.dtype).reshape(-1)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // self.top_k
        experts = torch.arange(self.num_experts, device=x.device)
        offs = torch.searchsorted(flat[order], experts, right=True).to(torch.int32)  # static shape, unlike bincount
        if self.token_group_alignment > 1:
            rows, align = token.shape[0], self.token_group_alignment
            layout = groups.padding(offs, rows, align, groups.padded_bound(rows, self.num_experts, align))
            y = self.experts(layout.pad(n[token]), layout.ends)[layout.position]
        else:
            y = self.experts(n[token], offs)
        y = y * gates[order, None]
        routed = torch.zeros_like(n).index_add(0, token, y)
        return (x + routed + self.shared(n)).reshape(shape)

    def step_flops(self, tokens: int) -> float:
        """FLOPs of one training step's GEMMs (forward, dgrad, wgrad: three times the forward's)."""
        two_hidden, dim = self.experts.gate_up.shape[1:]
        routed = tokens * self.top_k * 2 * dim * (two_hidden + two_hidden // 2)
        dense = tokens * 2 * dim * (self.num_experts + 3 * self.shared.w1.out_features)
        return 3.0 * (routed + dense)


class FFNStack(nn.Sequential):
    def __init__(self, blocks: int = 4, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__(*[FeedForward(dim, hidden) for _ in range(blocks)])


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
