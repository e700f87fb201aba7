"""Operand: one direction of one quantized tensor as graphquant's ops carry it, and the two
things an autograd formula does with operands besides making them: multiply two, and keep the
columnwise ones for backward."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from graphquant.kernels import mixed_input
from graphquant.kernels.backends import GemmBackend
from graphquant.ops.library import unflatten


@dataclasses.dataclass(frozen=True)
class Operand:
    """One direction of one quantized tensor as the ops carry it; ``stored``: a frozen weight's
    (graphquant.freeze), which no kernel of the graph writes."""

    tensors: list[torch.Tensor]
    spec: str
    direction: str
    shape: tuple[int, int]
    stored: bool = False


def gemm(
    a: Operand,
    b: Operand,
    batch: int,
    out_dtype: torch.dtype,
    backend: GemmBackend,
    site: str,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """graphquant::gemm of two operands on ``backend``, the plan's choice for the GEMM ``site``
    names ("fc1#0 dgrad"): (batch, m, n), a @ b^T per group (+ bias, one group)."""
    if backend.name == mixed_input.BACKEND:
        return _mixed_input_gemm(a, b, out_dtype, site, bias)
    return torch.ops.graphquant.gemm(
        a.tensors, a.spec, a.direction, a.shape, b.tensors, b.spec, b.direction, b.shape, batch, out_dtype,
        backend.name, backend.fast_accumulation, site, bias,
    )


def _mixed_input_gemm(a: Operand, b: Operand, out_dtype: torch.dtype, site: str, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """graphquant::mixed_input_gemms of one B, A's values in the kernel's order made here in torch
    ops, which Inductor compiles with the graph's other pointwise work."""
    rep = unflatten(a.tensors, a.spec, a.direction, a.shape, out_dtype)
    (out,) = torch.ops.graphquant.mixed_input_gemms(
        mixed_input.operand(rep), mixed_input.a_amax(rep), b.tensors, b.spec, b.direction, list(b.shape), out_dtype, site, [bias], b.stored
    )
    return out


def save_columnwise(ctx, x_col: Optional[Operand], w_col: Optional[Operand], *others: Optional[torch.Tensor]) -> None:
    """Save what a backward needs: the columnwise operands that exist (x's for wgrad, w's for
    dgrad), then ``others``; ``saved_columnwise`` gives them back."""
    kept = [op for op in (x_col, w_col) if op is not None]
    ctx.kept = [(x_col is not None, w_col is not None), [(len(op.tensors), op.spec, op.direction, op.shape) for op in kept]]
    ctx.save_for_backward(*[t for op in kept for t in op.tensors], *others)


def saved_columnwise(ctx) -> tuple[Optional[Operand], Optional[Operand], list[Optional[torch.Tensor]]]:
    """(x's columnwise operand or None, w's or None, the others) as ``save_columnwise`` saved them."""
    (has_x, has_w), metas = ctx.kept
    saved, start, kept = list(ctx.saved_tensors), 0, []
    for count, *meta in metas:
        kept.append(Operand(saved[start : start + count], *meta))
        start += count
    x_col = kept.pop(0) if has_x else None
    w_col = kept.pop(0) if has_w else None
    return x_col, w_col, saved[start:]
