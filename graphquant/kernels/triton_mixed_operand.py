"""x's values for the mixed-input GEMM made from x in one pass: each block's scale, its codes and
their values, stored in the order the GEMM reads (graphquant.kernels.mixed_input).

Made in torch ops, the same values took four kernels a tensor on the GPU (the blocks' amaxes, the
scale op, the codes, the values) and a fifth to reorder them, each reading what the last wrote;
this kernel reads x once and writes the values once. The bits are those of the reference
(mixed_input.operand of x quantized by graphquant.formats): every step below is one of its exact
operations or one IEEE fp32 operation in its order, without flush-to-zero.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from graphquant.formats import fp8, nvfp4
from graphquant.kernels import mixed_input
from graphquant.kernels.triton_launch import ceil_div, dependent_launch, launch, wait_for_the_kernel_before
from graphquant.kernels.triton_dequantize import e8m0_value
from graphquant.kernels.triton_scales import e8m0_biased, e8m0_multiplier, fp8_codes
from graphquant.quantizers import ROWWISE, Quantizer

_BLOCK_M = 16  # with one atom a program, near the best of the tilings measured at 128 and 512 rows
_ATOMS = 1
_FLT_MAX: tl.constexpr = tl.constexpr(nvfp4.FLT_MAX)
_GLOBAL_DIVISOR: tl.constexpr = tl.constexpr(nvfp4.GLOBAL_DIVISOR)
_E4M3_MAX: tl.constexpr = tl.constexpr(fp8.fp8_max("e4m3"))  # MXFP8's E8M0 scale rule


@triton.jit
def _in_gemm_order(values, BLOCK_M: tl.constexpr, ATOMS: tl.constexpr, SIZES: tl.constexpr, ORDER: tl.constexpr):
    """(BLOCK_M, ATOMS * ATOM) ``values`` with each atom's K digits (of ``SIZES``) reordered as
    ``ORDER`` lists them (mixed_input.DIGITS): in registers, so that the store is contiguous (a
    store to each value's own column was several times slower: benchmarks/NOTES.md)."""
    v = tl.reshape(values, (BLOCK_M, ATOMS, SIZES[0], SIZES[1], SIZES[2], SIZES[3]))
    v = tl.permute(v, (0, 1, 2 + ORDER[0], 2 + ORDER[1], 2 + ORDER[2], 2 + ORDER[3]))
    return tl.reshape(v, (BLOCK_M, ATOMS * SIZES[0] * SIZES[1] * SIZES[2] * SIZES[3]))


@triton.jit
def _magnitude_max(blocks):
    """max |blocks| over the last axis (fp32), as an integer max of the bits without their sign:
    exact, and a NaN (above infinity) propagates."""
    return tl.max(blocks.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2).to(tl.float32, bitcast=True)


@triton.jit
def _mxfp8_values(blocks):
    """mxfp8.quantize's E4M3 codes of (rows, blocks, 32) fp32 ``blocks``, dequantized: fp32."""
    biased = e8m0_biased(_magnitude_max(blocks), _E4M3_MAX)
    codes = fp8_codes(blocks, e8m0_multiplier(biased)[:, :, None], tl.float8e4nv)
    return codes.to(tl.float32) * e8m0_value(biased)[:, :, None]


@triton.jit
def _e2m1_values(v):
    """The value of nvfp4.round_to_e2m1's code of fp32 ``v`` (nearest, ties to the even code): the
    grid's steps above |v| clamped to 6, each sum exact; the sign of v kept (-0.0 too), NaN +6."""
    a = tl.minimum(tl.abs(v), 6.0)
    half = (a > 0.25).to(tl.float32) + (a >= 0.75).to(tl.float32) + (a > 1.25).to(tl.float32) + (a >= 1.75).to(tl.float32)
    magnitude = 0.5 * half + (a > 2.5).to(tl.float32) + (a >= 3.5).to(tl.float32) + 2.0 * (a > 5.0).to(tl.float32)
    signed = magnitude.to(tl.int32, bitcast=True) | (v.to(tl.int32, bitcast=True) & -0x80000000)  # -x is 0 - x: no -0.0
    return tl.where(v != v, 6.0, signed.to(tl.float32, bitcast=True))


@triton.jit
def _nvfp4_values(blocks, amax):
    """nvfp4.quantize's codes of (rows, blocks, 16) fp32 ``blocks`` under global ``amax``, times
    their E4M3 scales (nvfp4.dequantize without the global factor, which the GEMM applies): fp32."""
    s_enc = tl.math.div_rn(tl.full(amax.shape, _GLOBAL_DIVISOR, tl.float32), amax)
    s_enc = tl.where(s_enc > _FLT_MAX, _FLT_MAX, s_enc)  # a NaN stays NaN, as torch.minimum keeps it
    s_enc = tl.where((s_enc == 0.0) | (amax == 0.0), 1.0, s_enc)
    s_dec = tl.math.div_rn(tl.full(s_enc.shape, 1.0, tl.float32), s_enc)
    scale = fp8_codes(_magnitude_max(blocks), s_enc * (1.0 / 6.0), tl.float8e4nv).to(tl.float32)
    denom = scale * s_dec
    encode = tl.math.div_rn(tl.full(denom.shape, 1.0, tl.float32), denom)
    encode = tl.where(encode > _FLT_MAX, _FLT_MAX, encode)
    return _e2m1_values(blocks * encode[:, :, None]) * scale[:, :, None]


@triton.jit
def _values_kernel(
    x_ptr, amax_ptr, out_ptr, M, K, stride,
    FORMAT: tl.constexpr, SIZES: tl.constexpr, ORDER: tl.constexpr, BLOCK_M: tl.constexpr, ATOMS: tl.constexpr, ATOM: tl.constexpr,
    DEPENDENT: tl.constexpr,
):
    wait_for_the_kernel_before(DEPENDENT)
    if DEPENDENT:  # the GEMM after it may start: it copies its stored weight's first steps meanwhile (mixed_gemm.cu)
        gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * ATOMS * ATOM + tl.arange(0, ATOMS * ATOM)
    inside = (rows < M)[:, None]
    x = tl.load(x_ptr + rows[:, None] * stride + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    if FORMAT == 0:
        values = _mxfp8_values(tl.reshape(x, (BLOCK_M, ATOMS * ATOM // 32, 32)))
    else:
        values = _nvfp4_values(tl.reshape(x, (BLOCK_M, ATOMS * ATOM // 16, 16)), tl.load(amax_ptr))
    values = tl.reshape(values, (BLOCK_M, ATOMS * ATOM)).to(tl.bfloat16)
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], _in_gemm_order(values, BLOCK_M, ATOMS, SIZES, ORDER), mask=inside)


def values(x: torch.Tensor, amax: Optional[torch.Tensor], quantizer: Quantizer) -> torch.Tensor:
    """mixed_input.operand_of_x: the bf16 (m, k) values of 2-D ``x`` quantized rowwise by
    ``quantizer`` (one that mixed_input.values_from_x takes; NVFP4's from the global ``amax``), in
    the GEMM's order."""
    m, k = x.shape
    if k % (_ATOMS * mixed_input.ATOM):
        raise ValueError(f"the mixed-input GEMM's x values take K a multiple of {_ATOMS * mixed_input.ATOM}, not {m}x{k}")
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty((m, k), dtype=torch.bfloat16, device=x.device)
    amax = out if amax is None else amax.float()  # MXFP8 reads none
    family = quantizer.kernel_encoding(ROWWISE).scaling
    sizes, order = mixed_input.DIGITS[family]
    launch(
        _values_kernel, (ceil_div(m, _BLOCK_M), k // (_ATOMS * mixed_input.ATOM)), x, amax, out, m, k, x.stride(0),
        FORMAT=mixed_input.FORMATS[family], SIZES=sizes, ORDER=order, BLOCK_M=_BLOCK_M, ATOMS=_ATOMS, ATOM=mixed_input.ATOM, num_warps=4,
        **dependent_launch(x.device),
    )
    return out
