"""torch._grouped_mm(x (T, K), w (E, K, N), offs) quantized as TE's GroupedLinear.

Expert g owns rows offs[g-1]:offs[g] of x (offs: int32 cumulative end rows, offs[-1] == T) and
w[g] (K, N); each expert is its own GEMM of the design's table, with y = x @ W^T for W = w[g]^T:

    fprop  y_g      = x_g.rowwise           @ W_g.rowwise^T
    dgrad  dx_g     = grad_output_g.rowwise @ W_g.columnwise
    wgrad  dW_g^T   = grad_output_g.columnwise^T @ x_g.columnwise

Every group is quantized as if alone (per-tensor formats get one scale per group, as
``native.reference_grouped_quantize`` combines them), and every expert's weight as its own
(N, K) tensor. A grouped representation is one tensor set for all groups: data and block scales
concatenated along the split dim, per-tensor scales and amaxes one per group, so its shapes are
static and backward keeps it as it keeps any other representation.

Known cost: the ops read the group offsets on the host (``offs.tolist()``), one device
synchronisation per op call; no native grouped GEMM exists yet, so every group runs the
emulated GEMM of its pair, as the plan says.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from graphquant.kernels import emulation, native
from graphquant.ops import registry
from graphquant.ops.library import quantizer_of
from graphquant.ops.operands import Operand, save_columnwise, saved_columnwise
from graphquant.ops.quantize import hybrid_directions
from graphquant.ops.site import Site
from graphquant.quantizers import (
    COLUMNWISE,
    ROWWISE,
    QuantizeContext,
    Quantizer,
    Representation,
)


def _bounds(offs: torch.Tensor, rows: int, site: str) -> list[int]:
    """[0, offs...] on the host (the documented synchronisation), checked against ``rows``."""
    bounds = [0] + [int(o) for o in offs.tolist()]
    if any(b > a for a, b in zip(bounds[1:], bounds)) or bounds[-1] != rows:
        raise ValueError(f"{site}: torch._grouped_mm offsets {bounds[1:]} must be non-decreasing and end at the {rows} rows of the input")
    return bounds


def _part(tensors: Sequence[torch.Tensor], spec: str, direction: str, cols: int, dtype: torch.dtype, bounds: list[int], g: int) -> Representation:
    """Group g of a grouped representation, as the representation of that group alone."""
    quantizer = quantizer_of(spec)
    whole = quantizer.stored_representation(direction, (bounds[-1], cols), dtype, tensors)
    a, b = bounds[g], bounds[g + 1]
    transposed = quantizer.transposed(direction)
    block_rows = quantizer.block(direction)[0]

    def rows_of(t: torch.Tensor, per_row: int) -> torch.Tensor:
        return t[:, a // per_row : b // per_row] if transposed and t.dim() == 2 else t[a // per_row : b // per_row]

    def scales(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if t is None:
            return None
        return t[g : g + 1] if block_rows == 0 else rows_of(t, block_rows)

    return quantizer.representation(direction, (b - a, cols), dtype, rows_of(whole.data, 1), scales(whole.scale), scales(whole.amax))


@registry.op("grouped_quantize")
def grouped_quantize(x: torch.Tensor, offs: torch.Tensor, spec: str, direction: str, site: str) -> list[torch.Tensor]:
    """One direction of ``x`` (2-D) with each row group (ends ``offs``) quantized alone: [data, scale, amax].

    ``site`` names the GEMM in errors: each group must tile the format's blocks (TE pads groups to
    its quantization_alignment; graphquant does not pad).
    """
    quantizer = quantizer_of(spec)
    bounds = _bounds(offs, x.shape[0], site)
    for g, (a, b) in enumerate(zip(bounds, bounds[1:])):
        try:
            quantizer.check_shape((b - a, x.shape[1]), direction)
        except ValueError as error:
            raise ValueError(f"{site}: group {g} of torch._grouped_mm has {b - a} rows: {error}") from None
    sizes = torch.tensor([b - a for a, b in zip(bounds, bounds[1:])], device=x.device)
    rep = native.grouped_quantize(quantizer, x, sizes, direction, QuantizeContext())
    return [t.clone() if t is x else t.contiguous() for t in rep.tensors()]


@registry.fake("grouped_quantize")
def _(x, offs, spec, direction, site):
    quantizer = quantizer_of(spec)
    whole = native.reference_quantize(quantizer, x, direction, QuantizeContext()).tensors()
    groups = offs.shape[0]
    per_group = quantizer.block(direction) == (0, 0)
    return [whole[0].new_empty(whole[0].shape)] + [
        t.new_empty((groups,) if per_group and t.numel() else t.shape) for t in whole[1:]
    ]


@registry.op("grouped_dequantize")
def grouped_dequantize(
    tensors: list[torch.Tensor], spec: str, direction: str, shape: Sequence[int], offs: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The logical (rows, cols) values of a grouped representation, as ``dtype``."""
    bounds = _bounds(offs, shape[0], spec)
    parts = []
    for g in range(len(bounds) - 1):
        rep = _part(tensors, spec, direction, shape[1], dtype, bounds, g)
        values = native.dequantize(rep)
        parts.append(values.t() if rep.transposed else values)
    return torch.cat(parts).to(dtype).contiguous()


@registry.fake("grouped_dequantize")
def _(tensors, spec, direction, shape, offs, dtype):
    return tensors[0].new_empty(tuple(shape), dtype=dtype)


@registry.op("grouped_gemm")
def grouped_gemm(
    a: list[torch.Tensor],
    a_spec: str,
    a_direction: str,
    a_shape: Sequence[int],
    a_offs: torch.Tensor,
    b: list[torch.Tensor],
    b_spec: str,
    b_direction: str,
    b_shape: Sequence[int],
    b_offs: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """out_g = A_g @ B_g^T for each row group g of both operands, on ``emulation.gemm``: the
    backend the plan gives every grouped pair (an Identity pair's high-precision matmul too).

    A rowwise: the groups' outputs are stacked along the rows, (rows of A, n). A columnwise
    (wgrad, both operands reduced over their groups' rows): one (m, n) per group, (groups, m, n).
    Not ``backends.gemm``: it would choose again per group, and on Hopper send a per-tensor FP8
    group to cuBLASLt, which rejects a group's scale (a view 4 bytes into the stacked scales).
    """
    a_bounds, b_bounds = _bounds(a_offs, a_shape[0], a_spec), _bounds(b_offs, b_shape[0], b_spec)
    outs = []
    for g in range(len(a_bounds) - 1):
        rep_a = _part(a, a_spec, a_direction, a_shape[1], out_dtype, a_bounds, g)
        rep_b = _part(b, b_spec, b_direction, b_shape[1], out_dtype, b_bounds, g)
        outs.append(emulation.gemm(rep_a, rep_b, 1, out_dtype)[0])
    return torch.cat(outs) if a_direction == ROWWISE else torch.stack(outs)


@registry.fake("grouped_gemm")
def _(a, a_spec, a_direction, a_shape, a_offs, b, b_spec, b_direction, b_shape, b_offs, out_dtype):
    groups = b_offs.shape[0]
    n = b_shape[0] // groups if b_direction == ROWWISE else b_shape[1]
    shape = (a_shape[0], n) if a_direction == ROWWISE else (groups, a_shape[1], n)
    return a[0].new_empty(shape, dtype=out_dtype)


def quantize_grouped(x: torch.Tensor, offs: torch.Tensor, quantizer: Quantizer, directions: tuple[str, ...], site: str) -> dict[str, Operand]:
    """The grouped representations of ``x`` in ``directions``, honouring hybrid children and sources."""

    def encode(source: torch.Tensor, child: Quantizer, direction: str) -> Operand:
        tensors = torch.ops.graphquant.grouped_quantize(source, offs, child.spec, direction, site)
        return Operand(list(tensors), child.spec, direction, (x.shape[0], x.shape[1]))

    def rowwise_values(row: Operand) -> torch.Tensor:
        return torch.ops.graphquant.grouped_dequantize(row.tensors, row.spec, ROWWISE, row.shape, offs, x.dtype)

    return hybrid_directions(x, quantizer, directions, encode, rowwise_values)


def _gemm(a: Operand, a_offs: torch.Tensor, b: Operand, b_offs: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return torch.ops.graphquant.grouped_gemm(
        a.tensors, a.spec, a.direction, a.shape, a_offs, b.tensors, b.spec, b.direction, b.shape, b_offs, out_dtype
    )


class QuantizedGroupedMM(torch.autograd.Function):
    """y (T, N) = torch._grouped_mm(x (T, K), w (E, K, N), offs), per expert in the site's formats."""

    @staticmethod
    def forward(ctx, x, w, offs, site: Site):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        experts, k, n = w.shape
        w_offs = torch.arange(1, experts + 1, dtype=torch.int32, device=w.device) * n
        w2d = w.transpose(1, 2).reshape(experts * n, k)  # expert g's W_g = w[g]^T, stacked
        x_quantizer, w_quantizer, _ = site.quantizers
        xq = quantize_grouped(x, offs, x_quantizer, (ROWWISE, COLUMNWISE) if need_dw else (ROWWISE,), site.label)
        wq = quantize_grouped(w2d, w_offs, w_quantizer, (ROWWISE, COLUMNWISE) if need_dx else (ROWWISE,), site.label)
        y = _gemm(xq[ROWWISE], offs, wq[ROWWISE], w_offs, torch.promote_types(x.dtype, w.dtype))

        save_columnwise(ctx, xq.get(COLUMNWISE), wq.get(COLUMNWISE), offs, w_offs)
        ctx.site, ctx.dtypes = site, (x.dtype, w.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        x_col, w_col, (offs, w_offs) = saved_columnwise(ctx)
        directions = ((ROWWISE,) if need_dx else ()) + ((COLUMNWISE,) if need_dw else ())
        gq = quantize_grouped(dy.contiguous(), offs, ctx.site.quantizers[2], directions, ctx.site.label)
        dx = _gemm(gq[ROWWISE], offs, w_col, w_offs, ctx.dtypes[0]) if need_dx else None
        dw = _gemm(gq[COLUMNWISE], offs, x_col, offs, ctx.dtypes[1]).transpose(1, 2) if need_dw else None
        return dx, dw, None, None


def quantized_grouped_mm(x, w, offs, *, site: Site, states=None, rng=None):
    """torch._grouped_mm(x, w, offs=offs) in the site's formats.

    states, rng: what rewrite passes every site; unused, as the planner admits no stateful or
    stochastic format for grouped sites (``backends.grouped_unsupported``).
    """
    return QuantizedGroupedMM.apply(x, w, offs, site)
