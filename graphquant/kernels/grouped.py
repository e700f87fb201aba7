"""The grouped GEMM: every group's product of two grouped representations in one grouped
kernel, with the group offsets left on the device.

Grouped representations lie in graphquant.formats.groups' padded layout: each group starts at
a multiple of 128 rows (GROUP_ROWS), or of 16 (FEW_TOKEN_ROWS) for the tokens of a graph that
runs fprop alone, which each kernel's tiles of rows then divide. Two kinds of product:

    tokens x experts (fprop, dgrad)  out[r] = A[r] @ B_g^T for r in group g: A rowwise (rows, k),
                                     B an expert stack (groups * n', k) rowwise or columnwise
    tokens x tokens (wgrad)          out[g] = A_g^T B_g over group g's rows: both columnwise

Each call runs the backend its plan chose (backends.select_grouped) or fails (GemmMismatch).

Native (backends.NATIVE_GROUPED_GEMMS): FP8 with per-tensor, per-row or block scales on
graphquant.kernels.triton_grouped_fp8, or on Hopper graphquant.kernels.grouped_fp8 (groups of
whole tiles, sums promoted), which write the unpadded output themselves, their sums promoted into
fp32 or, where the plan's backend accumulates fast, left in the tensor cores' accumulator;
where Triton is not installed, E4M3 with per-tensor or per-row scales on torch._scaled_grouped_mm,
summing in the tensor cores' accumulator, the scales in its epilogue, its padded product
un-padded afterwards.

Emulated: as in graphquant.kernels.emulation, each operand's values leave out the factor its
format applies per group or per row (``Quantizer.grouped_factor``: per-tensor FP8 scales,
per-row FP8 scales, NVFP4's global decode), the product is taken of the rest with fp32
accumulation and the factors are applied to it once: exact up to fp32 accumulation. On a GPU,
values that carry everything and are bf16 numbers (MXFP8, power-of-two-scaled FP8 blocks, bf16)
take torch._grouped_mm's bf16 product, whose one rounding is the output's; the others need their
factors applied to the fp32 sums, which torch._grouped_mm makes only group by group with the
offsets read on the host, so they take graphquant.kernels.triton_grouped_gemm's, which applies
them in its epilogue (where Triton is missing, torch's). MXFP8 rows of tokens are read out of
the padded layout by their values kernel, so that torch._grouped_mm multiplies the tokens alone.
MXFP8 and NVFP4 tokens x experts products there, with few tokens an expert, run the decode
GEMM's programs over the stack instead (triton_decode.experts_gemm), which decode both operands'
codes in registers: no expert's values are written; with more, only the routed experts' values
are. Either way an expert no token was routed to is not read. On the CPU every product is
torch._grouped_mm's fp32 one.
"""

from __future__ import annotations

from typing import Optional

import torch

from graphquant.formats.groups import GroupPadding
from graphquant.kernels import backends, emulation, grouped_fp8

try:
    from graphquant.kernels import triton_dequantize, triton_grouped_gemm
except ImportError:  # no Triton: fp32 products on torch._grouped_mm, which reads the offsets on the host
    triton_dequantize = triton_grouped_gemm = None
from graphquant.quantizers import ROWWISE, Representation, gemm_dims


def dequantize(rep: Representation, row_group: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The logical (rows, cols) values of a grouped representation, as ``dtype``."""
    factor = rep.quantizer.grouped_factor(rep, row_group)
    if factor is not None and rep.direction != ROWWISE:
        factor = factor[row_group]
    return emulation.scaled_values(rep, None if factor is None else factor.float(), dtype)


def _joint(fa: Optional[torch.Tensor], fb: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if fa is None or fb is None:
        return fb if fa is None else fa
    return fa * fb


def gemm(
    a: Representation,
    b: Representation,
    b_group: torch.Tensor,
    tokens: GroupPadding,
    token_rows: int,
    n: int,
    out_dtype: torch.dtype,
    backend: backends.GemmBackend,
    site: str,
) -> torch.Tensor:
    """The grouped product of the module docstring, without the padding: (tokens, n) for tokens
    x experts, the padded rows at ``tokens.position``; (groups, n, k) for tokens x tokens.
    ``tokens``: the tokens' padded layout, A's (and B's too for tokens x tokens), its groups
    starting at multiples of ``token_rows`` (GROUP_ROWS for tokens x tokens); ``b_group``:
    each padded row of B's group; ``n``: the extent of the dim that W's padded rows make (the
    output columns of fprop, the rows of each wgrad product), padding dropped.
    ``backend``: the plan's choice for the GEMM ``site`` names ("moe#0 dgrad"), checked as
    backends.checked does (the padded stacks' dims: only x's columns can misalign)."""
    native = backends.checked(backend, a, b, gemm_dims(a, b), 1, site, backends.NATIVE_GROUPED_GEMMS)
    block = native.token_block() if native is not None else None
    if block is not None and token_rows != block:
        raise backends.GemmMismatch(
            f"{site}: its plan chose {backend}, which multiplies groups of tokens that start at multiples of {block} rows; "
            f"this call's start at multiples of {token_rows} (not the tokens an expert the plan was made for)"
        )
    a_group, ends = tokens.row_group, tokens.ends
    if native is backends.WGMMA_GROUPED_GEMM or native in backends.TRITON_GROUPED_GEMMS:
        kernels = grouped_fp8 if native is backends.WGMMA_GROUPED_GEMM else backends.triton_grouped_fp8
        promote_every = kernels.FAST_ACCUMULATION if backend.fast_accumulation else kernels.PROMOTE_EVERY
        if a.direction == ROWWISE:
            return kernels.tokens_by_experts(a, b, b_group, tokens, token_rows, n, out_dtype, promote_every)
        return kernels.tokens_by_tokens(a, a_group, b, b_group, ends, n, out_dtype, promote_every)
    if native is None and _decodes_in_registers(a, b, tokens.position.shape[0], tokens.groups):
        return backends.triton_decode.experts_gemm(a, b, tokens, n, out_dtype)
    if native is not None:
        return _finished(_scaled_grouped_mm(a, a_group, b, b_group, ends), None, a.direction, tokens, n, out_dtype)
    return _emulated(a, b, b_group, tokens, token_rows, n, out_dtype)


def _finished(
    out: torch.Tensor, alpha: Optional[torch.Tensor], direction: str, tokens: GroupPadding, n: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """gemm's output from a padded product of torch's grouped kernels and the factors to apply to it."""
    if direction != ROWWISE:
        out = _empty_groups_zeroed(out, tokens.ends)
    if alpha is not None:
        out = out.float() * alpha
    out = out.index_select(0, tokens.position)[:, :n] if direction == ROWWISE else out[:, :n]
    return out.to(out_dtype).contiguous()


def _empty_groups_zeroed(out: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """A tokens x tokens product with an empty group's zeros (some kernels leave it unwritten)."""
    if out.is_cuda and out.is_contiguous() and triton_grouped_gemm is not None:
        return triton_grouped_gemm.zero_empty_groups(out, ends)
    empty = (torch.diff(ends, prepend=ends.new_zeros(1)) == 0)[:, None, None]
    return torch.where(empty, torch.zeros((), dtype=out.dtype, device=out.device), out)


def _decodes_in_registers(a: Representation, b: Representation, tokens: int, groups: int) -> bool:
    """Whether the emulated tokens x experts product reads MXFP8 or NVFP4 codes straight into its
    tiles (triton_decode.decodes_experts: few tokens an expert) rather than the routed experts'
    values written out first."""
    decoding = backends.triton_decode
    return decoding is not None and triton_dequantize.runs_on(a.data.device) and decoding.decodes_experts(a, b, tokens, groups)


def _emulated(
    a: Representation, b: Representation, b_group: torch.Tensor, tokens: GroupPadding, token_rows: int, n: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """gemm's output from the product of the factored values, the factors applied to its sums."""
    a_group, ends = tokens.row_group, tokens.ends
    fa, fb = a.quantizer.grouped_factor(a, a_group), b.quantizer.grouped_factor(b, b_group)
    live = None
    if triton_dequantize is not None and a.direction == ROWWISE == b.direction and b.stored_k_last:
        # tokens x experts reads only the experts some token was routed to (a decode step's few)
        live = triton_dequantize.LiveGroups(ends, b.data.shape[0] // ends.shape[0])
    vb = emulation.logical_values(b, live)
    exact_bf16 = all(rep.quantizer.values_exact_in_bf16(rep) for rep in (a, b))
    on_gpu = a.data.is_cuda
    bf16_product = on_gpu and exact_bf16 and fa is None and fb is None  # its rounding is the output's
    factored_out = on_gpu and not bf16_product and triton_grouped_gemm is not None
    bf16_values = bf16_product or (factored_out and exact_bf16)
    values_dtype = torch.bfloat16 if bf16_values else torch.float32
    groups = ends.shape[0]
    if a.direction == ROWWISE and fa is None and fb is None and not factored_out and emulation.gathers_rows(a):
        # The tokens' rows read out of the padded layout by the values kernel: the product is taken
        # of them alone (no pad rows multiplied) and needs no un-padding after.
        va = emulation.values_of_rows(a, tokens.position).to(values_dtype)
        out = torch._grouped_mm(va, _experts(vb.to(values_dtype), b.direction, groups), offs=tokens.row_ends)
        return out[:, :n].to(out_dtype).contiguous()
    va, vb = (t.to(values_dtype) for t in (emulation.logical_values(a), vb))
    if a.direction == ROWWISE:
        vb = _experts(vb, b.direction, groups)
        if fb is not None and b.direction == ROWWISE:
            fb = fb.reshape(groups, -1)  # (groups, n'), as columnwise factors already lie
        if factored_out:
            return triton_grouped_gemm.tokens_by_experts(va, vb, tokens, token_rows, n, fa, fb, out_dtype)
        out = torch._grouped_mm(va, vb, offs=ends)
        alpha = _joint(fa, None if fb is None else fb[a_group])
    else:
        if factored_out:
            return triton_grouped_gemm.tokens_by_tokens(va, vb, ends, n, fa, fb, out_dtype)
        out = torch._grouped_mm(va.t(), vb, offs=ends)
        alpha = _joint(None if fa is None else fa[:, :, None], None if fb is None else fb[:, None, :])
    del va, vb  # the values freed before _finished makes the output, not alive beside it at the step's peak
    return _finished(out, alpha, a.direction, tokens, n, out_dtype)


def _experts(values: torch.Tensor, direction: str, groups: int) -> torch.Tensor:
    """An expert stack's (groups * rows, cols) values split by expert as a tokens x experts
    product reads them, (groups, k, n'): a rowwise stack's (n', k) experts transposed, a
    columnwise stack's (k, n') as they lie."""
    experts = values.reshape(groups, -1, values.shape[1])
    return experts.transpose(1, 2) if direction == ROWWISE else experts


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """t (groups, k, n) with each group's matrix column-major and the groups one after another."""
    return t if t.stride() == (t.shape[1] * t.shape[2], 1, t.shape[1]) else t.transpose(1, 2).contiguous().transpose(1, 2)


def _scaled_grouped_mm(
    a: Representation, a_group: torch.Tensor, b: Representation, b_group: torch.Tensor, ends: torch.Tensor
) -> torch.Tensor:
    """The product on torch._scaled_grouped_mm (bf16, padded), A row-major and B column-major in
    their FP8 codes, with one float32 scale per GEMM row of A and per column of B in each group:
    a per-tensor format's group scale repeated over its rows."""
    groups = ends.shape[0]
    fa = a.quantizer.grouped_factor(a, a_group).float()
    fb = b.quantizer.grouped_factor(b, b_group).float()
    if a.direction == ROWWISE:  # tokens x experts: A (rows, k), B (groups, k, n)
        if b.direction == ROWWISE:  # data (groups * n', k): W_g's rows are the output columns
            mat_b, scale_b = b.data.reshape(groups, -1, b.data.shape[1]).transpose(1, 2), fb.reshape(groups, -1)
        else:  # transposed data (k_out, groups * n'): W_g^T's columns are the output columns
            mat_b = b.data.reshape(b.data.shape[0], groups, -1).permute(1, 2, 0)
            scale_b = fb.expand(groups, mat_b.shape[2])
        return torch._scaled_grouped_mm(
            a.data, _column_major(mat_b), fa.reshape(-1).contiguous(), scale_b.contiguous(), offs=ends, out_dtype=torch.bfloat16
        )
    # tokens x tokens (wgrad): both columnwise, stored transposed (cols, rows): A^T row-major, B column-major
    scale_a = fa.expand(groups, a.data.shape[0]).reshape(-1)
    scale_b = fb.expand(groups, b.data.shape[0]).reshape(-1)
    return torch._scaled_grouped_mm(a.data, b.data.t(), scale_a, scale_b, offs=ends, out_dtype=torch.bfloat16)
