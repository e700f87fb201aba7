"""Experimental NVFP4 decode kernels (issue 31), timed by decode_nvfp4.py beside bf16 F.linear
and the library's decode GEMM; the winner moves into graphquant/kernels/triton_decode.py.

Both operands' E2M1 codes are read as 32-bit words (8 codes, 16-byte vector loads) and turned
into fp16 values times 2^-14 (exact) a word at a time: by inline PTX on packed fp16 pairs
(shift and mask two codes per instruction, one f16x2 multiply by the block scale for two values),
or (ASM=False, what Triton's interpreter runs) by the same arithmetic on one value at a time.
Value j of word w is the code at column 8 w + j (nibble j of the little-endian word).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from graphquant.kernels import triton_decode
from graphquant.kernels.triton_decode import _block_scales, _broadcast, _write
from graphquant.kernels.triton_dequantize import e2m1_block_values, e2m1_value_over_2_14, e8m0_value
from graphquant.quantizers import gemm_dims

def _decode_asm(out: str) -> str:
    """PTX: one block of 16 E2M1 codes ($16, 64 bits) and its scale as fp16 ($17) -> 16 values
    times 2^-14, fp32 (out "f32") or fp16. Pair j of each 32-bit half holds codes j (low half) and
    j + 4 (high half), shifted so that each code's magnitude lands in fp16 bits 9-11 and its sign
    in bit 15; one f16x2 multiply scales both."""
    lines = ["{", ".reg .b32 w<2>, mg, sg, h, sc;", ".reg .b16 lo, hi;", "mov.b64 {w0, w1}, $16;", "mov.b32 sc, {$17, $17};"]
    for half in range(2):
        for j in range(4):
            low, high = 8 * half + j, 8 * half + j + 4
            magnitude = f"shl.b32 mg, w{half}, {9 - 4 * j};" if j < 3 else f"shr.b32 mg, w{half}, 3;"
            sign = f"shl.b32 sg, w{half}, {12 - 4 * j};" if j < 3 else f"mov.b32 sg, w{half};"
            lines += [
                magnitude, "and.b32 mg, mg, 0x0E000E00;", sign, "and.b32 sg, sg, 0x80008000;", "or.b32 h, mg, sg;",
                "mul.rn.f16x2 h, h, sc;",
            ]
            if out == "f32":
                lines += ["mov.b32 {lo, hi}, h;", f"cvt.f32.f16 ${low}, lo;", f"cvt.f32.f16 ${high}, hi;"]
            else:
                lines += [f"mov.b32 {{${low}, ${high}}}, h;"]
    return "\n".join(lines + ["}"])


_DECODE_F32 = tl.constexpr(_decode_asm("f32"))


@triton.jit
def _blocks(ptr, scale_ptr, row, rows, block, K, stride_blocks, scale_row_stride, scale_col_stride, EVEN: tl.constexpr):
    """Blocks of 16 codes (64-bit words) at ``block`` (0 outside the operand, unless EVEN: all
    inside), and each block's scale as fp16 (exact)."""
    at = ptr.to(tl.pointer_type(tl.int64)) + row.to(tl.int64) * stride_blocks + block
    scale_at = scale_ptr + row.to(tl.int64) * scale_row_stride + block * scale_col_stride
    if EVEN:
        return tl.load(at), tl.load(scale_at).to(tl.float16)
    inside = (row < rows) & (block < K // 16)
    scale = tl.where(inside, tl.load(scale_at, mask=inside).to(tl.float32), 0.0)
    return tl.load(at, mask=inside, other=0), scale.to(tl.float16)


@triton.jit
def _values(codes, scale, j: tl.constexpr, DTYPE: tl.constexpr):
    """Value j of each block, one at a time (the twin of the PTX)."""
    return (e2m1_value_over_2_14(((codes >> (4 * j)) & 0xF).to(tl.int32)) * scale).to(DTYPE)


@triton.jit
def _decode(codes, scale, ASM: tl.constexpr, DTYPE: tl.constexpr):
    """The 16 values of each block (column 16 b + j is the j-th), in DTYPE (fp32 or fp16)."""
    if ASM:
        if DTYPE == tl.float32:
            return tl.inline_asm_elementwise(_DECODE_F32, "=r," * 16 + "l,h", [codes, scale], dtype=(tl.float32,) * 16, is_pure=True, pack=1)
        else:
            return e2m1_block_values(codes, scale, True)  # the library's decode
    return (
        _values(codes, scale, 0, DTYPE), _values(codes, scale, 1, DTYPE), _values(codes, scale, 2, DTYPE),
        _values(codes, scale, 3, DTYPE), _values(codes, scale, 4, DTYPE), _values(codes, scale, 5, DTYPE),
        _values(codes, scale, 6, DTYPE), _values(codes, scale, 7, DTYPE), _values(codes, scale, 8, DTYPE),
        _values(codes, scale, 9, DTYPE), _values(codes, scale, 10, DTYPE), _values(codes, scale, 11, DTYPE),
        _values(codes, scale, 12, DTYPE), _values(codes, scale, 13, DTYPE), _values(codes, scale, 14, DTYPE),
        _values(codes, scale, 15, DTYPE),
    )


@triton.jit(do_not_specialize=["M", "has_bias", "k_chunks"])
def fma_words_kernel(
    a_ptr, a_scale_ptr, a_factor_ptr, a_stride, a_scale_row_stride, a_scale_col_stride,
    b_ptr, b_scale_ptr, b_factor_ptr, b_stride, b_scale_row_stride, b_scale_col_stride,
    bias_ptr, has_bias, out_ptr, partial_ptr, M, N, K, k_chunks, CHUNK: tl.constexpr,
    A_FACTOR: tl.constexpr, A_DIVISOR: tl.constexpr, B_FACTOR: tl.constexpr, B_DIVISOR: tl.constexpr,
    SPLIT: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """NVFP4 x NVFP4 on the FMA units for one row of A (BLOCK_M = 1), blocks of codes decoded to
    fp32 (exact): one fp32 partial sum per (weight row, block), summed over blocks at the end.
    Strides are in blocks of 16 codes (8 bytes)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :, None]
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)[None, :, None]
    k_start = tl.program_id(1) * k_chunks * CHUNK
    # (pairs of blocks, weight rows, 2): a pair is 16 bytes, one vector load; the pairs go to the
    # threads first, so that each thread takes a pair of a few weight rows and decodes A's once.
    pair = tl.arange(0, BLOCK_K // 32)[:, None, None] * 2 + tl.arange(0, 2)[None, None, :]
    sums = tl.zeros((BLOCK_K // 32, BLOCK_N, 2), dtype=tl.float32)
    for step in range(0, k_chunks * CHUNK, BLOCK_K):  # columns past K load as zeros
        block = (k_start + step) // 16 + pair
        b_codes, b_scale = _blocks(b_ptr, b_scale_ptr, n, N, block, K, b_stride, b_scale_row_stride, b_scale_col_stride, EVEN)
        a_codes, a_scale = _blocks(a_ptr, a_scale_ptr, m, M, block, K, a_stride, a_scale_row_stride, a_scale_col_stride, EVEN)
        b = _decode(b_codes, b_scale, ASM, tl.float32)
        a = _decode(a_codes, a_scale, ASM, tl.float32)
        for j in tl.static_range(16):
            sums += b[j] * a[j]
    total = tl.reshape(tl.sum(tl.sum(sums, axis=2), axis=0), (BLOCK_N, 1)) * 268435456.0  # 2^28: both sides' 2^-14, undone exactly
    _write(
        total, tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None], tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)[None, :], N, M, a_factor_ptr, b_factor_ptr, bias_ptr,
        out_ptr, partial_ptr, A_FACTOR, A_DIVISOR, B_FACTOR, B_DIVISOR, has_bias, SPLIT,
    )


@triton.jit
def _join(v, i: tl.constexpr, step: tl.constexpr):
    """Values i, i + step, i + 2 step, ... of the 16, joined along new last dims."""
    if step == 16:
        return v[i]
    return tl.join(_join(v, i, 2 * step), _join(v, i + step, 2 * step))


@triton.jit
def _row_pairs(codes, scale, ASM: tl.constexpr):
    """(rows, 16 * blocks) fp16 values: each block's 8 f16x2 registers as decoded (values j and
    j + 4 adjacent in K), the 8 registers in some order (the same for both operands)."""
    v = _decode(codes, scale, ASM, tl.float16)
    low = tl.join(tl.join(tl.join(v[0], v[1]), tl.join(v[2], v[3])), tl.join(tl.join(v[8], v[9]), tl.join(v[10], v[11])))
    high = tl.join(tl.join(tl.join(v[4], v[5]), tl.join(v[6], v[7])), tl.join(tl.join(v[12], v[13]), tl.join(v[14], v[15])))
    return tl.reshape(tl.join(low, high), (codes.shape[0], codes.shape[1] * 16))


@triton.jit
def _row_values(codes, scale, ASM: tl.constexpr):
    """(rows, 16 * blocks) fp16 values, the columns of each block in the order of _join (a
    permutation of K within each block, the same for both operands)."""
    values = _join(_decode(codes, scale, ASM, tl.float16), 0, 1)
    return tl.reshape(values, (codes.shape[0], codes.shape[1] * 16))


@triton.jit(do_not_specialize=["M", "has_bias", "k_chunks"])
def mma_words_kernel(
    a_ptr, a_scale_ptr, a_factor_ptr, a_stride, a_scale_row_stride, a_scale_col_stride,
    b_ptr, b_scale_ptr, b_factor_ptr, b_stride, b_scale_row_stride, b_scale_col_stride,
    bias_ptr, has_bias, out_ptr, partial_ptr, M, N, K, k_chunks, CHUNK: tl.constexpr,
    A_FACTOR: tl.constexpr, A_DIVISOR: tl.constexpr, B_FACTOR: tl.constexpr, B_DIVISOR: tl.constexpr,
    SPLIT: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_DOTS: tl.constexpr,
):
    """NVFP4 x NVFP4 on the tensor cores: blocks decoded to fp16 (exact), one fp16 dot (fp32
    accumulation) a step. The weight tile is the dot's left operand. A's rows are masked (EVEN
    speaks of the weight and K only)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    k_start = tl.program_id(1) * k_chunks * CHUNK
    BLOCKS: tl.constexpr = BLOCK_K // 16
    total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    t0 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    t1 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    t2 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    t3 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    t4 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    t5 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    t6 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    t7 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for step in range(0, k_chunks * CHUNK, BLOCK_K):
        block = (k_start + step) // 16 + tl.arange(0, BLOCKS)[None, :]
        b_codes, b_scale = _blocks(b_ptr, b_scale_ptr, n, N, block, K, b_stride, b_scale_row_stride, b_scale_col_stride, EVEN)
        a_codes, a_scale = _blocks(a_ptr, a_scale_ptr, m, M, block, K, a_stride, a_scale_row_stride, a_scale_col_stride, False)
        if SPLIT_DOTS == 16:  # one dot per value j of the blocks (K = BLOCKS each): no join, no reshape
            b = _decode(b_codes, b_scale, ASM, tl.float16)
            a = _decode(a_codes, a_scale, ASM, tl.float16)
            for j in tl.static_range(16):
                total = tl.dot(b[j], tl.trans(a[j]), total)
        elif SPLIT_DOTS == 88:  # as 8, each pair's dot into an accumulator of its own (no wait between them)
            b = _decode(b_codes, b_scale, ASM, tl.float16)
            a = _decode(a_codes, a_scale, ASM, tl.float16)
            shape_b: tl.constexpr = (b_codes.shape[0], 2 * b_codes.shape[1])
            shape_a: tl.constexpr = (a_codes.shape[0], 2 * a_codes.shape[1])
            t0 = tl.dot(tl.reshape(tl.join(b[0], b[4]), shape_b), tl.trans(tl.reshape(tl.join(a[0], a[4]), shape_a)), t0)
            t1 = tl.dot(tl.reshape(tl.join(b[1], b[5]), shape_b), tl.trans(tl.reshape(tl.join(a[1], a[5]), shape_a)), t1)
            t2 = tl.dot(tl.reshape(tl.join(b[2], b[6]), shape_b), tl.trans(tl.reshape(tl.join(a[2], a[6]), shape_a)), t2)
            t3 = tl.dot(tl.reshape(tl.join(b[3], b[7]), shape_b), tl.trans(tl.reshape(tl.join(a[3], a[7]), shape_a)), t3)
            t4 = tl.dot(tl.reshape(tl.join(b[8], b[12]), shape_b), tl.trans(tl.reshape(tl.join(a[8], a[12]), shape_a)), t4)
            t5 = tl.dot(tl.reshape(tl.join(b[9], b[13]), shape_b), tl.trans(tl.reshape(tl.join(a[9], a[13]), shape_a)), t5)
            t6 = tl.dot(tl.reshape(tl.join(b[10], b[14]), shape_b), tl.trans(tl.reshape(tl.join(a[10], a[14]), shape_a)), t6)
            t7 = tl.dot(tl.reshape(tl.join(b[11], b[15]), shape_b), tl.trans(tl.reshape(tl.join(a[11], a[15]), shape_a)), t7)
        elif SPLIT_DOTS == 8:  # one dot per pair (j, j + 4) of each word, the two adjacent in K
            b = _decode(b_codes, b_scale, ASM, tl.float16)
            a = _decode(a_codes, a_scale, ASM, tl.float16)
            for half in tl.static_range(2):
                for j in tl.static_range(4):
                    b_pair = tl.reshape(tl.join(b[8 * half + j], b[8 * half + j + 4]), (b_codes.shape[0], 2 * b_codes.shape[1]))
                    a_pair = tl.reshape(tl.join(a[8 * half + j], a[8 * half + j + 4]), (a_codes.shape[0], 2 * a_codes.shape[1]))
                    total = tl.dot(b_pair, tl.trans(a_pair), total)
        elif SPLIT_DOTS == 1:  # one dot a step, each decoded f16x2 register's values adjacent in K
            total = tl.dot(_row_pairs(b_codes, b_scale, ASM), tl.trans(_row_pairs(a_codes, a_scale, ASM)), total)
        else:
            total = tl.dot(_row_values(b_codes, b_scale, ASM), tl.trans(_row_values(a_codes, a_scale, ASM)), total)
    if SPLIT_DOTS == 88:
        total = ((t0 + t1) + (t2 + t3)) + ((t4 + t5) + (t6 + t7))
    total = total * 268435456.0
    _write(
        total, n, tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)[None, :], N, M, a_factor_ptr, b_factor_ptr, bias_ptr,
        out_ptr, partial_ptr, A_FACTOR, A_DIVISOR, B_FACTOR, B_DIVISOR, has_bias, SPLIT,
    )


def _e4m3_asm() -> str:
    """PTX: 8 E4M3 codes ($8, 64 bits) -> 8 fp32 values, through f16 pairs (exact)."""
    lines = ["{", ".reg .b32 w<2>, h;", ".reg .b16 c<4>, lo, hi;", "mov.b64 {w0, w1}, $8;"]
    for half in range(2):
        lines.append(f"mov.b32 {{c0, c1}}, w{half};")
        for pair in range(2):
            lines += [f"cvt.rn.f16x2.e4m3x2 h, c{pair};", "mov.b32 {lo, hi}, h;",
                      f"cvt.f32.f16 ${4 * half + 2 * pair}, lo;", f"cvt.f32.f16 ${4 * half + 2 * pair + 1}, hi;"]
    return "\n".join(lines + ["}"])


_E4M3_F32 = tl.constexpr(_e4m3_asm())


@triton.jit
def _e4m3_values(codes, ASM: tl.constexpr):
    """The 8 E4M3 codes of each 64-bit word as fp32 (byte j is the j-th)."""
    if ASM:
        return tl.inline_asm_elementwise(_E4M3_F32, "=r," * 8 + "l", [codes], dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    return (
        _e4m3_value(codes, 0), _e4m3_value(codes, 1), _e4m3_value(codes, 2), _e4m3_value(codes, 3),
        _e4m3_value(codes, 4), _e4m3_value(codes, 5), _e4m3_value(codes, 6), _e4m3_value(codes, 7),
    )


@triton.jit
def _e4m3_value(codes, j: tl.constexpr):
    return ((codes >> (8 * j)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _mxfp8_words(ptr, scale_ptr, row, rows, word, K, stride_words, scale_row_stride, scale_col_stride, EVEN: tl.constexpr):
    """64-bit words of 8 E4M3 codes at ``word`` (0 outside the operand unless EVEN), and each
    word's power-of-two scale (its 32-block's) as fp32."""
    at = ptr.to(tl.pointer_type(tl.int64)) + row.to(tl.int64) * stride_words + word
    scale_at = scale_ptr + row.to(tl.int64) * scale_row_stride + (word // 4) * scale_col_stride
    if EVEN:
        return tl.load(at), e8m0_value(tl.load(scale_at))
    inside = (row < rows) & (word < K // 8)
    return tl.load(at, mask=inside, other=0), tl.where(inside, e8m0_value(tl.load(scale_at, mask=inside, other=127)), 0.0)


@triton.jit(do_not_specialize=["M", "has_bias", "k_chunks"])
def mxfp8_fma_kernel(
    a_ptr, a_scale_ptr, a_factor_ptr, a_stride, a_scale_row_stride, a_scale_col_stride,
    b_ptr, b_scale_ptr, b_factor_ptr, b_stride, b_scale_row_stride, b_scale_col_stride,
    bias_ptr, has_bias, out_ptr, partial_ptr, M, N, K, k_chunks, CHUNK: tl.constexpr,
    A_FACTOR: tl.constexpr, A_DIVISOR: tl.constexpr, B_FACTOR: tl.constexpr, B_DIVISOR: tl.constexpr,
    SPLIT: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """MXFP8 x MXFP8 on the FMA units for one row of A: each word's 8 code products (exact in
    fp32) summed, then times both power-of-two scales (exact in fp32's normal range) into one
    partial sum per (pair of words, weight row). Strides are in words of 8 codes."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :, None]
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)[None, :, None]
    k_start = tl.program_id(1) * k_chunks * CHUNK
    pair = tl.arange(0, BLOCK_K // 16)[:, None, None] * 2 + tl.arange(0, 2)[None, None, :]
    sums = tl.zeros((BLOCK_K // 16, BLOCK_N, 2), dtype=tl.float32)
    for step in range(0, k_chunks * CHUNK, BLOCK_K):
        word = (k_start + step) // 8 + pair
        b_codes, b_scale = _mxfp8_words(b_ptr, b_scale_ptr, n, N, word, K, b_stride, b_scale_row_stride, b_scale_col_stride, EVEN)
        a_codes, a_scale = _mxfp8_words(a_ptr, a_scale_ptr, m, M, word, K, a_stride, a_scale_row_stride, a_scale_col_stride, EVEN)
        b = _e4m3_values(b_codes, ASM)
        a = _e4m3_values(a_codes, ASM)
        word_sum = b[0] * a[0]
        for j in tl.static_range(1, 8):
            word_sum += b[j] * a[j]
        sums += word_sum * (b_scale * a_scale)
    total = tl.reshape(tl.sum(tl.sum(sums, axis=2), axis=0), (BLOCK_N, 1))
    _write(
        total, tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None], tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)[None, :],
        N, M, a_factor_ptr, b_factor_ptr, bias_ptr, out_ptr, partial_ptr, A_FACTOR, A_DIVISOR, B_FACTOR, B_DIVISOR, has_bias, SPLIT,
    )


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
def _mxfp8_bf16_pairs(codes, biased, ASM: tl.constexpr):
    """4 (rows, 2 * words) bf16 operands of MXFP8 words times their E8M0 scales (``biased``, the
    bytes as stored): the p-th holds codes 2p and 2p + 1 of each word side by side, one bf16x2
    register as decoded."""
    if ASM:
        v = tl.inline_asm_elementwise(_E4M3_BF16, "=h," * 8 + "l,h", [codes, biased.to(tl.uint16)], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
    else:  # fp32 (the interpreter's dot multiplies bf16 bit patterns as integers)
        scale = e8m0_value(biased)
        v = _e4m3_values(codes, False)
        v = (v[0] * scale, v[1] * scale, v[2] * scale, v[3] * scale, v[4] * scale, v[5] * scale, v[6] * scale, v[7] * scale)
    shape: tl.constexpr = (codes.shape[0], 2 * codes.shape[1])
    return (
        tl.reshape(tl.join(v[0], v[1]), shape), tl.reshape(tl.join(v[2], v[3]), shape),
        tl.reshape(tl.join(v[4], v[5]), shape), tl.reshape(tl.join(v[6], v[7]), shape),
    )


@triton.jit
def _mxfp8_raw_words(ptr, scale_ptr, row, rows, word, K, stride_words, scale_row_stride, scale_col_stride, EVEN: tl.constexpr):
    """As _mxfp8_words, the scales as stored (E8M0 bytes; 127, 2^0, outside the operand)."""
    at = ptr.to(tl.pointer_type(tl.int64)) + row.to(tl.int64) * stride_words + word
    scale_at = scale_ptr + row.to(tl.int64) * scale_row_stride + (word // 4) * scale_col_stride
    if EVEN:
        return tl.load(at), tl.load(scale_at)
    inside = (row < rows) & (word < K // 8)
    return tl.load(at, mask=inside, other=0), tl.load(scale_at, mask=inside, other=127)


@triton.jit(do_not_specialize=["M", "has_bias", "k_chunks"])
def mxfp8_mma_kernel(
    a_ptr, a_scale_ptr, a_factor_ptr, a_stride, a_scale_row_stride, a_scale_col_stride,
    b_ptr, b_scale_ptr, b_factor_ptr, b_stride, b_scale_row_stride, b_scale_col_stride,
    bias_ptr, has_bias, out_ptr, partial_ptr, M, N, K, k_chunks, CHUNK: tl.constexpr,
    A_FACTOR: tl.constexpr, A_DIVISOR: tl.constexpr, B_FACTOR: tl.constexpr, B_DIVISOR: tl.constexpr,
    SPLIT: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """MXFP8 x MXFP8 on the tensor cores: words of 8 codes decoded to bf16 times their scales by
    PTX (no per-value conversion instruction), one bf16 dot a step. Strides in words."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    k_start = tl.program_id(1) * k_chunks * CHUNK
    total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for step in range(0, k_chunks * CHUNK, BLOCK_K):
        word = (k_start + step) // 8 + tl.arange(0, BLOCK_K // 8)[None, :]
        b_codes, b_scale = _mxfp8_raw_words(b_ptr, b_scale_ptr, n, N, word, K, b_stride, b_scale_row_stride, b_scale_col_stride, EVEN)
        a_codes, a_scale = _mxfp8_raw_words(a_ptr, a_scale_ptr, m, M, word, K, a_stride, a_scale_row_stride, a_scale_col_stride, False)
        b = _mxfp8_bf16_pairs(b_codes, b_scale, ASM)
        a = _mxfp8_bf16_pairs(a_codes, a_scale, ASM)
        for p in tl.static_range(4):
            total = tl.dot(b[p], tl.trans(a[p]), total)
    _write(
        total, n, tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)[None, :], N, M, a_factor_ptr, b_factor_ptr, bias_ptr,
        out_ptr, partial_ptr, A_FACTOR, A_DIVISOR, B_FACTOR, B_DIVISOR, has_bias, SPLIT,
    )


@dataclasses.dataclass(frozen=True)
class Variant:
    """One experimental kernel and its tiling (as triton_decode.DecodeConfig's fields)."""

    kernel: str  # "fma", "mma" (one dot a step), "mma16" (a dot per value of the blocks), "mma8" (per pair)
    asm: bool
    block_n: int
    block_k: int
    block_m: int
    warps: int
    stages: int
    tiles_per_sm: int

    def __str__(self) -> str:
        return (
            f"{self.kernel}{' asm' if self.asm else ''} n{self.block_n} k{self.block_k} m{self.block_m} "
            f"w{self.warps} s{self.stages} t{self.tiles_per_sm}"
        )


def gemm(a, b, out_dtype: torch.dtype, variant: Variant) -> torch.Tensor:
    """triton_decode.gemm's arithmetic on the variant's kernel (NVFP4 operands, K a multiple of 8)."""
    m, n, k = gemm_dims(a, b)
    (a_layout, a_args), (b_layout, b_args) = triton_decode._operand(a, "A"), triton_decode._operand(b, "B")
    mx = b_layout.operand == triton_decode.BF16_VALUES
    if b_layout.operand == triton_decode.FP8_CODES or k % (8 if mx else 16) or a_args[3] % 8 or b_args[3] % 8:
        raise ValueError(f"{variant} multiplies NVFP4 or MXFP8 operands of whole 64-bit words; got {b.quantizer}, k={k}")
    if mx and variant.kernel not in ("fma", "mma"):
        raise ValueError(f"{variant}: MXFP8 on the FMA kernel or one dot a step only")
    row_tiles = triton.cdiv(m, variant.block_m)
    out = torch.empty((m, n), dtype=out_dtype, device=a.data.device)
    splits = triton_decode.split_k(n, k, a.data.device, variant.tiles_per_sm, variant.block_n, row_tiles)
    chunk = triton_decode.K_CHUNK
    k_chunks = triton.cdiv(triton.cdiv(k, splits), chunk)
    splits = triton.cdiv(k, k_chunks * chunk)
    partial = torch.empty((splits, m, n), dtype=torch.float32, device=out.device) if splits > 1 else out
    factors = triton_decode._factors(a_layout, b_layout)
    if variant.kernel == "fma" and variant.block_m != 1:
        raise ValueError(f"{variant}: the FMA kernel multiplies one row of A")
    # Strides in 64-bit words.
    a_args = (*a_args[:3], a_args[3] // 8, *a_args[4:])
    b_args = (*b_args[:3], b_args[3] // 8, *b_args[4:])
    if mx:
        kernel, extra = (mxfp8_fma_kernel if variant.kernel == "fma" else mxfp8_mma_kernel), {}
    else:
        kernel = fma_words_kernel if variant.kernel == "fma" else mma_words_kernel
        extra = {} if variant.kernel == "fma" else {"SPLIT_DOTS": {"mma": 0, "mma16": 16, "mma8": 8, "mma8x8": 88, "mma1": 1}[variant.kernel]}
    kernel[(triton.cdiv(n, variant.block_n), splits, row_tiles)](
        *a_args, *b_args, out, 0, out, partial, m, n, k, k_chunks, chunk, **factors, SPLIT=splits > 1, ASM=variant.asm,
        EVEN=n % variant.block_n == 0 and k % (k_chunks * chunk) == 0,
        BLOCK_M=variant.block_m, BLOCK_N=variant.block_n, BLOCK_K=variant.block_k,
        num_warps=variant.warps, num_stages=variant.stages, **extra,
    )
    if splits > 1:
        triton_decode._reduce_kernel[(triton.cdiv(n, 128), triton.cdiv(m, 16))](
            partial, a_args[2], b_args[2], out, 0, out, m, n, splits, **factors, BLOCK_M=16, BLOCK_N=128,
        )
    return out
