"""The matrix products graphquant looks for where it has no site: the aten ops that linear,
matmul, einsum and the grouped product reach at the dispatcher, the autograd nodes they leave in an
eager graph, and how a count of them reads in a warning."""

from __future__ import annotations

import collections

import torch

# Each op, and the node its eager call leaves in the autograd graph.
_BACKWARD_NODES = {
    torch.ops.aten.mm: "MmBackward0",
    torch.ops.aten.bmm: "BmmBackward0",
    torch.ops.aten.addmm: "AddmmBackward0",
    torch.ops.aten.baddbmm: "BaddbmmBackward0",
}
if hasattr(torch.ops.aten, "_grouped_mm"):
    _BACKWARD_NODES[torch.ops.aten._grouped_mm] = "GroupedMmBackward0"
OPS = frozenset(_BACKWARD_NODES)
OP_OF_NODE = {node: op.__name__ for op, node in _BACKWARD_NODES.items()}
# F.scaled_dot_product_attention's nodes, one a backend (ScaledDotProductFlashAttentionBackward0, ...):
# products where the recipe quantizes attention (fp8_dpa).
ATTENTION_NODE_PREFIX = "ScaledDotProduct"
ATTENTION = "scaled_dot_product_attention"


def described(counts: collections.Counter) -> str:
    """"3 matrix product(s) (2 addmm, 1 mm)"."""
    ops = ", ".join(f"{count} {op}" for op, count in sorted(counts.items()))
    return f"{sum(counts.values())} matrix product(s) ({ops})"
