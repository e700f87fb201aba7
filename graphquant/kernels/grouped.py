"""The emulated grouped GEMM: every group's product of two grouped representations in one
torch._grouped_mm over their values, with the group offsets left on the device.

Grouped representations lie in graphquant.formats.groups' padded layout (each group starts at
a multiple of 128 rows). Two kinds of product:

    tokens x experts (fprop, dgrad)  out[r] = A[r] @ B_g^T for r in group g: A rowwise (rows, k),
                                     B an expert stack (groups * n', k) rowwise or columnwise
    tokens x tokens (wgrad)          out[g] = A_g^T B_g over group g's rows: both columnwise

As in graphquant.kernels.emulation, each operand's values leave out the factor its format
applies per group or per row (``Quantizer.grouped_factor``: per-tensor FP8 scales, per-row FP8
scales, NVFP4's global decode), the product is taken of the rest and the factors are applied
to it once. On the CPU the product is fp32, exact up to fp32 accumulation. On a GPU, where
torch._grouped_mm multiplies without host synchronisation only bf16 into bf16, values that are
bf16 numbers are multiplied that way (exact up to fp32 accumulation and the bf16 rounding of the
product, which a factor then rounds once more); other values are multiplied in fp32, which
torch._grouped_mm does group by group with the offsets read on the host.
"""

from __future__ import annotations

from typing import Optional

import torch

from graphquant.quantizers import ROWWISE, Representation


def factored(rep: Representation, row_group: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(values in the logical (rows, cols) orientation, grouped factor) of a grouped representation."""
    values = rep.quantizer.emulated_values(rep)
    return (values.t() if rep.transposed else values), rep.quantizer.grouped_factor(rep, row_group)


def dequantize(rep: Representation, row_group: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The logical (rows, cols) values of a grouped representation, as ``dtype``."""
    values, factor = factored(rep, row_group)
    values = values.float()
    if factor is not None:
        values = values * (factor if rep.direction == ROWWISE else factor[row_group])
    return values.to(dtype)


def _joint(fa: Optional[torch.Tensor], fb: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if fa is None or fb is None:
        return fb if fa is None else fa
    return fa * fb


def gemm(
    a: Representation,
    a_group: torch.Tensor,
    b: Representation,
    b_group: torch.Tensor,
    ends: torch.Tensor,
    position: torch.Tensor,
    n: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The grouped product of the module docstring, without the padding: (tokens, n) for tokens
    x experts, the padded rows at ``position``; (groups, n, k) for tokens x tokens.
    ``a_group``/``b_group``: each padded row's group; ``ends``: the padded groups' cumulative
    ends (A's rows, and B's too for tokens x tokens); ``n``: the extent of the dim that W's padded
    rows make (the output columns of fprop, the rows of each wgrad product), padding dropped."""
    exact_bf16 = all(rep.quantizer.values_exact_in_bf16(rep) for rep in (a, b))
    dtype = torch.bfloat16 if a.data.is_cuda and exact_bf16 else torch.float32
    va, fa = factored(a, a_group)
    vb, fb = factored(b, b_group)
    va, vb = va.to(dtype), vb.to(dtype)
    groups = ends.shape[0]
    if a.direction == ROWWISE:
        experts = vb.reshape(groups, -1, vb.shape[1])  # (groups, n', k) rowwise, (groups, k, n) columnwise
        out = torch._grouped_mm(va, experts.transpose(1, 2) if b.direction == ROWWISE else experts, offs=ends)
        if fb is not None:
            fb = fb.reshape(groups, -1)[a_group] if b.direction == ROWWISE else fb[a_group]
        alpha = _joint(fa, fb)
    else:
        out = torch._grouped_mm(va.t(), vb, offs=ends)
        alpha = _joint(None if fa is None else fa[:, :, None], None if fb is None else fb[:, None, :])
        # An empty group's product is zeros (some kernels leave it unwritten).
        empty = (torch.diff(ends, prepend=ends.new_zeros(1)) == 0)[:, None, None]
        out = torch.where(empty, torch.zeros((), dtype=out.dtype, device=out.device), out)
    if alpha is not None:
        out = out.float() * alpha
    out = out.index_select(0, position)[:, :n] if a.direction == ROWWISE else out[:, :n]
    return out.to(out_dtype).contiguous()
