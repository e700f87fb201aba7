"""Experimental decode kernels (issue 31) that decode_nvfp4.py times beside the library's decode
GEMM (graphquant/kernels/triton_decode.py), on the library's operands and arithmetic:

- NVFP4 on the tensor cores in one dot a step, the decoded f16x2 registers joined along K (the
  library takes eight, one per register, which the compiler decodes straight into the MMA
  operand layout; Triton waits for every wgmma whose operand is in registers, so eight dots mean
  eight waits, while the joined operand passes through shared memory once);
- MXFP8 on the tensor cores from 64-bit words of 8 E4M3 codes decoded to bf16 by inline PTX
  (e4m3x2 -> f16x2 -> fp32 -> bf16x2, no per-value conversion instruction), one dot a step.

Earlier ones (the one-row FMA kernels, a dot per decoded value) moved into the library or lost;
benchmarks/NOTES.md (decode_nvfp4.py) has their numbers.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from graphquant.kernels import triton_decode
from graphquant.kernels.triton_decode import _nvfp4_blocks, _write
from graphquant.kernels.triton_dequantize import e2m1_block_values, e4m3_word_values, e8m0_value
from graphquant.quantizers import gemm_dims


@triton.jit
def _nvfp4_values(codes, scale, ASM: tl.constexpr):
    """The blocks' values as one (rows, 16 * blocks) operand, each decoded f16x2 register's two
    values side by side in K, the 8 registers of a block in some order (the same for both
    operands)."""
    v = e2m1_block_values(codes, scale, ASM)
    low = tl.join(tl.join(tl.join(v[0], v[1]), tl.join(v[2], v[3])), tl.join(tl.join(v[8], v[9]), tl.join(v[10], v[11])))
    high = tl.join(tl.join(tl.join(v[4], v[5]), tl.join(v[6], v[7])), tl.join(tl.join(v[12], v[13]), tl.join(v[14], v[15])))
    return tl.reshape(tl.join(low, high), (codes.shape[0], 16 * codes.shape[1]))


def _e4m3_bf16_asm() -> str:
    """PTX: 8 E4M3 codes ($8, 64 bits) times their E8M0 scale ($9, its byte in 16 bits) -> 8 bf16
    values (exact while in bf16's range), codes 2i and 2i + 1 in one bf16x2: the scale's bf16 is
    its byte shifted into the exponent (0: 2^-127, a subnormal; 255: NaN); e4m3x2 -> f16x2 ->
    two fp32 -> bf16x2 (all exact), one bf16x2 multiply by the scale."""
    lines = [
        "{", ".reg .b32 w<2>, h, r, sc;", ".reg .b16 c<2>, lo, hi, e;", ".reg .f32 f<2>;", ".reg .pred zero, nan;",
        "mov.b64 {w0, w1}, $8;", "shl.b16 e, $9, 7;", "setp.eq.u16 zero, $9, 0;", "setp.eq.u16 nan, $9, 255;",
        "selp.b16 e, 0x0040, e, zero;", "selp.b16 e, 0x7fc0, e, nan;", "mov.b32 sc, {e, e};",
    ]
    for half in range(2):
        lines.append(f"mov.b32 {{c0, c1}}, w{half};")
        for pair in range(2):
            first = 4 * half + 2 * pair
            lines += [
                f"cvt.rn.f16x2.e4m3x2 h, c{pair};", "mov.b32 {lo, hi}, h;", "cvt.f32.f16 f0, lo;", "cvt.f32.f16 f1, hi;",
                "cvt.rn.bf16x2.f32 r, f1, f0;", "mul.rn.bf16x2 r, r, sc;", f"mov.b32 {{${first}, ${first + 1}}}, r;",
            ]
    return "\n".join(lines + ["}"])


_E4M3_BF16 = tl.constexpr(_e4m3_bf16_asm())


@triton.jit
def _mxfp8_values(codes, biased, ASM: tl.constexpr):
    """One (rows, 8 * words) operand of MXFP8 words times their E8M0 scales (``biased``, as
    stored), codes 2p and 2p + 1 of each word side by side in K (one bf16x2 register as decoded);
    fp32 in the interpreter, whose dot multiplies bf16 bit patterns as integers."""
    if ASM:
        v = tl.inline_asm_elementwise(
            _E4M3_BF16, "=h," * 8 + "l,h", [codes, biased.to(tl.uint16)], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1
        )
    else:
        scale = e8m0_value(biased)
        v = e4m3_word_values(codes, False)
        v = (v[0] * scale, v[1] * scale, v[2] * scale, v[3] * scale, v[4] * scale, v[5] * scale, v[6] * scale, v[7] * scale)
    low = tl.join(tl.join(v[0], v[2]), tl.join(v[4], v[6]))
    high = tl.join(tl.join(v[1], v[3]), tl.join(v[5], v[7]))
    return tl.reshape(tl.join(low, high), (codes.shape[0], 8 * codes.shape[1]))


@triton.jit
def _mxfp8_words(ptr, scale_ptr, row, rows, word, K, stride_words, scale_row_stride, scale_col_stride, INSIDE: tl.constexpr):
    """64-bit words of 8 E4M3 codes at ``word`` (0 outside the operand unless INSIDE), and each
    word's E8M0 scale byte (its 32-block's; 127, 2^0, outside)."""
    at = ptr.to(tl.pointer_type(tl.int64)) + row.to(tl.int64) * stride_words + word
    scale_at = scale_ptr + row.to(tl.int64) * scale_row_stride + (word // 4) * scale_col_stride
    if INSIDE:
        return tl.load(at), tl.load(scale_at)
    inside = (row < rows) & (word < K // 8)
    return tl.load(at, mask=inside, other=0), tl.load(scale_at, mask=inside, other=127)


@triton.jit(do_not_specialize=["M", "has_bias", "k_chunks"])
def _kernel(
    a_ptr, a_scale_ptr, a_factor_ptr, a_stride, a_scale_row_stride, a_scale_col_stride,
    b_ptr, b_scale_ptr, b_factor_ptr, b_stride, b_scale_row_stride, b_scale_col_stride,
    bias_ptr, has_bias, out_ptr, partial_ptr, arrivals_ptr, M, N, K, k_chunks, CHUNK: tl.constexpr,
    A_FACTOR: tl.constexpr, A_DIVISOR: tl.constexpr, B_FACTOR: tl.constexpr, B_DIVISOR: tl.constexpr,
    SPLIT: tl.constexpr, ASM: tl.constexpr, WHOLE_TILES: tl.constexpr, MXFP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """triton_decode._decode_kernel's program, one dot a step: NVFP4's decoded registers joined,
    MXFP8 decoded to bf16 by PTX. Strides are in 64-bit words."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    k_start = tl.program_id(1) * k_chunks * CHUNK
    total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for step in range(0, k_chunks * CHUNK, BLOCK_K):
        if MXFP8:
            word = (k_start + step) // 8 + tl.arange(0, BLOCK_K // 8)[None, :]
            b_codes, b_scale = _mxfp8_words(b_ptr, b_scale_ptr, n, N, word, K, b_stride, b_scale_row_stride, b_scale_col_stride, WHOLE_TILES)
            a_codes, a_scale = _mxfp8_words(a_ptr, a_scale_ptr, m, M, word, K, a_stride, a_scale_row_stride, a_scale_col_stride, False)
            total = tl.dot(_mxfp8_values(b_codes, b_scale, ASM), tl.trans(_mxfp8_values(a_codes, a_scale, ASM)), total)
        else:
            block = (k_start + step) // 16 + tl.arange(0, BLOCK_K // 16)[None, :]
            b_codes, b_scale = _nvfp4_blocks(
                b_ptr, b_scale_ptr, n, N, block, K // 16, b_stride, b_scale_row_stride, b_scale_col_stride, WHOLE_TILES
            )
            a_codes, a_scale = _nvfp4_blocks(a_ptr, a_scale_ptr, m, M, block, K // 16, a_stride, a_scale_row_stride, a_scale_col_stride, False)
            total = tl.dot(_nvfp4_values(b_codes, b_scale, ASM), tl.trans(_nvfp4_values(a_codes, a_scale, ASM)), total)
    if not MXFP8:
        total = total * 268435456.0  # 2^28: both sides' 2^-14, undone exactly
    _write(
        total, n, tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)[None, :], N, M, a_factor_ptr, b_factor_ptr, bias_ptr,
        out_ptr, partial_ptr, arrivals_ptr, A_FACTOR, A_DIVISOR, B_FACTOR, B_DIVISOR, has_bias, SPLIT,
    )


@dataclasses.dataclass(frozen=True)
class Variant:
    """A tiling of the lab's kernel (fields as triton_decode.DecodeConfig's)."""

    block_n: int
    block_k: int
    block_m: int
    warps: int
    stages: int
    tiles_per_sm: int

    def __str__(self) -> str:
        return f"lab n{self.block_n} k{self.block_k} m{self.block_m} w{self.warps} s{self.stages} t{self.tiles_per_sm}"


def gemm(a, b, out_dtype: torch.dtype, variant: Variant) -> torch.Tensor:
    """triton_decode.gemm's arithmetic on the lab's kernel (NVFP4 or MXFP8 operands)."""
    m, n, k = gemm_dims(a, b)
    (a_layout, a_args), (b_layout, b_args) = triton_decode._operand(a, "A"), triton_decode._operand(b, "B")
    if b_layout.operand == triton_decode.FP8_CODES:
        raise ValueError(f"{variant} multiplies NVFP4 or MXFP8 operands; got {b.quantizer}")
    a_args, b_args = triton_decode._in_words(a_args), triton_decode._in_words(b_args)
    row_tiles = triton.cdiv(m, variant.block_m)
    out = torch.empty((m, n), dtype=out_dtype, device=a.data.device)
    splits = triton_decode.split_k(n, k, a.data.device, variant.tiles_per_sm, variant.block_n, row_tiles)
    chunk = triton_decode.K_CHUNK
    k_chunks = triton.cdiv(triton.cdiv(k, splits), chunk)
    splits = triton.cdiv(k, k_chunks * chunk)
    partial, arrivals = out, out
    if splits > 1:
        partial = torch.empty((splits, m, n), dtype=torch.float32, device=out.device)
        arrivals = triton_decode._arrivals(out.device, triton.cdiv(n, variant.block_n) * row_tiles)
    factors = triton_decode._factors(a_layout, b_layout)
    _kernel[(triton.cdiv(n, variant.block_n), splits, row_tiles)](
        *a_args, *b_args, out, 0, out, partial, arrivals, m, n, k, k_chunks, chunk, **factors, SPLIT=splits > 1,
        ASM=not triton.knobs.runtime.interpret, WHOLE_TILES=n % variant.block_n == 0 and k % (k_chunks * chunk) == 0,
        MXFP8=b_layout.operand == triton_decode.BF16_VALUES, BLOCK_M=variant.block_m, BLOCK_N=variant.block_n,
        BLOCK_K=variant.block_k, num_warps=variant.warps, num_stages=variant.stages,
    )
    return out
