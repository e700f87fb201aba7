"""CUDA dequantization of MXFP8 and NVFP4 for the emulated GEMM, one Triton launch each, and
the Triton functions that decode their codes in registers (here and in the decode GEMM).

Each writes bf16 values that are exactly the reference's (see graphquant.kernels.emulation.factored):
MXFP8 codes times their power-of-two scale, NVFP4 E2M1 codes times their E4M3 block scale (the
global amax stays out, applied to the product). Products of so few significant bits are exact
in fp32 and in bf16, so no rounding happens anywhere here.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from graphquant.kernels import devices
from graphquant.kernels.triton_launch import ceil_div


def runs_on(device: torch.device) -> bool:
    """Whether the dequantize kernels run on ``device``: a GPU for which Triton loads E4M3
    (fp8e4nv), sm_89 on; elsewhere the emulation takes the reference's torch ops."""
    return (devices.capability(device) or (0, 0)) >= (8, 9)


# Programs cover BLOCK_ROWS x BLOCK_COLS elements in 2-D, so no index needs a division by a
# runtime width (64-bit divisions per element cost more than the bytes they move).
BLOCK_ROWS, BLOCK_COLS = 16, 256


@triton.jit
def _mxfp8_kernel(
    data_ptr, scale_ptr, out_ptr, rows, cols, data_row_stride, data_col_stride, scale_row_stride, scale_col_stride, ends_ptr, group_rows,
    source_ptr, out_rows,
    ROWWISE: tl.constexpr, LIVE: tl.constexpr, GATHER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Each program loads its scales once (a row of BLOCK_C / 32 per row, or the one row of
    BLOCK_C its 16 rows share), through their strides (rowwise ones lie outer-dim-major), and
    broadcasts them, instead of a load per element. LIVE: see _in_live_group. GATHER (rowwise):
    output row r holds stored row source[r]."""
    if LIVE:
        if not _in_live_group(ends_ptr, tl.program_id(0) * BLOCK_R // group_rows):
            return
    out_row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    if GATHER:
        row = tl.load(source_ptr + out_row, mask=out_row < out_rows, other=rows)  # past the end: masked below
    else:
        row = out_row
    col = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    mask = (row < rows) & (col < cols)
    row64 = row.to(tl.int64)
    if ROWWISE:
        block = tl.program_id(1) * (BLOCK_C // 32) + tl.arange(0, BLOCK_C // 32)[None, :]
        at = row64 * scale_row_stride + block.to(tl.int64) * scale_col_stride
        biased = tl.load(scale_ptr + at, mask=(row < rows) & (block < cols // 32), other=127)
        biased = tl.reshape(tl.broadcast_to(biased[:, :, None], (BLOCK_R, BLOCK_C // 32, 32)), (BLOCK_R, BLOCK_C))
    else:  # BLOCK_R divides 32: a program's rows share one row of scales
        scale_row = (tl.program_id(0) * BLOCK_R // 32).to(tl.int64)
        biased = tl.load(scale_ptr + scale_row * scale_row_stride + col * scale_col_stride, mask=col < cols, other=127)
    codes = tl.load(data_ptr + row64 * data_row_stride + col.to(tl.int64) * data_col_stride, mask=mask, other=0.0)
    values = codes.to(tl.float32) * e8m0_value(biased)
    tl.store(out_ptr + out_row.to(tl.int64) * cols + col, values.to(tl.bfloat16), mask=(out_row < out_rows) & (col < cols))


@triton.jit
def _in_live_group(ends_ptr, group):
    """Whether some token was routed to expert ``group`` (``ends_ptr``: the tokens' cumulative
    group ends): an expert stack's rows of an expert no token reads need no values."""
    start = tl.load(ends_ptr + group - 1, mask=group > 0, other=0)
    return tl.load(ends_ptr + group) > start


@triton.jit
def e8m0_value(biased):
    """The fp32 power of two an E8M0 scale encodes: 2^(biased - 127), 2^-127 (an fp32 subnormal)
    for 0, NaN for 255."""
    biased = biased.to(tl.int32)
    scale = tl.where(biased == 0, 0x00400000, biased << 23).to(tl.float32, bitcast=True)
    return tl.where(biased == 255, float("nan"), scale)


@triton.jit
def e2m1_value_over_2_14(code):
    """An E2M1 code's value times 2^-14, an fp16: its sign, exponent and mantissa bits placed in
    an fp16 (bias 15 against E2M1's 1), whose subnormals hold E2M1's 0.5 exactly."""
    bits = ((code & 8) << 12) | ((code & 7) << 9)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True)


# A 32-bit word of 8 E2M1 codes (two a byte, the even column in the low nibble) makes 4 fp16
# pairs, each code's magnitude in fp16 bits 9-11 and its sign in bit 15 (where
# e2m1_value_over_2_14 puts them), in 12 integer instructions: the bytes of each 16-bit half
# swapped (PRMT_SWAP), then two words with every byte's even code (EVEN) or odd code (ODD)
# moved to its bits 1-3 and 7 by a bit select (LOP3 SELECT, bits of the first word where the
# constant has ones); the word masked with PAIR_BITS is one pair, shifted left a byte first the
# other.
PRMT_SWAP = 0x2301
SELECT = 0xE4  # lop3 truth table of (a & c) | (b & ~c)
CODE_BITS = 0x0E0E0E0E  # a byte's magnitude bits after the select; its sign ends in bit 7
PAIR_BITS = 0x8E008E00  # the magnitude and sign bits of an f16x2's two halves


def _e2m1_pair_lines(word: str, pair: str) -> list[tuple[list[str], int]]:
    """PTX that decodes the 32-bit ``word`` of 8 E2M1 codes into its 4 f16x2 pairs of values times
    2^-14, each pair into register ``pair`` in turn: (the lines making the pair, the code c whose
    pair it is: codes c and c + 4). The word becomes y, its bytes B1 B0 B3 B2; even = select(y <<
    1, y << 4) holds codes 2, 0, 6, 4 (byte by byte), odd = select(y >> 3, y) codes 3, 1, 7, 5; a
    pair is even or odd masked (codes 0 and 4, 1 and 5) or shifted left 8 first (2 and 6, 3 and 7)."""
    first = [
        f"prmt.b32 y, {word}, {word}, {PRMT_SWAP:#x};",
        "shl.b32 a, y, 1;", "shl.b32 b, y, 4;", f"lop3.b32 even, a, b, {CODE_BITS:#010x}, {SELECT:#x};",
        "shr.b32 a, y, 3;", f"lop3.b32 odd, a, y, {CODE_BITS:#010x}, {SELECT:#x};",
    ]
    pairs = []
    for source, low in (("even", 0), ("odd", 1)):
        for shifted in (False, True):
            lines = [f"shl.b32 {pair}, {source}, 8;", f"and.b32 {pair}, {pair}, {PAIR_BITS:#010x};"] if shifted else [
                f"and.b32 {pair}, {source}, {PAIR_BITS:#010x};"]
            pairs.append((first + lines if not pairs else lines, low + 2 * shifted))
    return pairs


_E2M1_REGISTERS = ".reg .b32 w<2>, y, a, b, even, odd, h;"


def _e2m1_block_ptx() -> str:
    """PTX for e2m1_block_values: $16, a 64-bit word of 16 codes, and $17, their fp16 scale ->
    $0..$15, the values, code j of the word in $j; one f16x2 multiply scales both values of a pair."""
    lines = ["{", _E2M1_REGISTERS, ".reg .b32 sc;", "mov.b64 {w0, w1}, $16;", "mov.b32 sc, {$17, $17};"]
    for half in range(2):
        for decoded, code in _e2m1_pair_lines(f"w{half}", "h"):
            first = 8 * half + code
            lines += decoded + ["mul.rn.f16x2 h, h, sc;", f"mov.b32 {{${first}, ${first + 4}}}, h;"]
    return "\n".join(lines + ["}"])


def _e2m1_pairs_ptx() -> str:
    """PTX for e2m1_pairs: $8, a 64-bit word of 16 codes -> $0..$7, its f16x2 pairs of values
    (times 2^14, undoing the decoding's 2^-14 exactly), pair 4 h + c holding codes 8 h + c and
    8 h + c + 4."""
    lines = ["{", _E2M1_REGISTERS, ".reg .b32 up;", "mov.b64 {w0, w1}, $8;", f"mov.b32 up, {0x74007400:#010x};"]  # 2^14, 2^14
    for half in range(2):
        for decoded, code in _e2m1_pair_lines(f"w{half}", "h"):
            lines += decoded + [f"mul.rn.f16x2 ${4 * half + code}, h, up;"]
    return "\n".join(lines + ["}"])


def _e2m1_block_dot_ptx() -> str:
    """PTX for e2m1_block_dot: $1, a 64-bit word of 16 codes, and $2..$9, another word's pairs
    (e2m1_pairs) -> $0, the sum of their 16 products times 2^-14 in fp32. Each half of an f16x2
    accumulator sums 8 of the products by fma, exactly (the module's comment on e2m1_block_dot)."""
    lines = ["{", _E2M1_REGISTERS, ".reg .b32 acc;", ".reg .b16 lo, hi;", ".reg .f32 low, high;",
             "mov.b64 {w0, w1}, $1;"]
    for half in range(2):
        for decoded, code in _e2m1_pair_lines(f"w{half}", "h"):
            product = f"h, ${2 + 4 * half + code}"
            lines += decoded + [f"fma.rn.f16x2 acc, {product}, acc;" if half or code else f"mul.rn.f16x2 acc, {product};"]
    lines += ["mov.b32 {lo, hi}, acc;", "cvt.f32.f16 low, lo;", "cvt.f32.f16 high, hi;", "add.f32 $0, low, high;"]
    return "\n".join(lines + ["}"])


_E2M1_BLOCK_PTX = tl.constexpr(_e2m1_block_ptx())
_E2M1_PAIRS_PTX = tl.constexpr(_e2m1_pairs_ptx())
_E2M1_BLOCK_DOT_PTX = tl.constexpr(_e2m1_block_dot_ptx())


@triton.jit
def _e2m1_value(codes, scale, j: tl.constexpr):
    return e2m1_value_over_2_14(((codes >> (4 * j)) & 0xF).to(tl.int32)) * scale


@triton.jit
def e2m1_block_values(codes, scale, ASM: tl.constexpr):
    """The 16 values of each 64-bit word of E2M1 codes (``codes``, int64) times its ``scale``
    (fp16) times 2^-14, as a tuple of fp16 (exact, as e2m1_value_over_2_14 * scale); the j-th is
    the code in nibble j (column 16 w + j of word w). By inline PTX (ASM), two values an
    instruction, or one at a time in Triton (its interpreter runs no PTX)."""
    if ASM:
        return tl.inline_asm_elementwise(
            _E2M1_BLOCK_PTX, "=h," * 16 + "l,h", [codes, scale], dtype=(tl.float16,) * 16, is_pure=True, pack=1
        )
    return (
        _e2m1_value(codes, scale, 0), _e2m1_value(codes, scale, 1), _e2m1_value(codes, scale, 2),
        _e2m1_value(codes, scale, 3), _e2m1_value(codes, scale, 4), _e2m1_value(codes, scale, 5),
        _e2m1_value(codes, scale, 6), _e2m1_value(codes, scale, 7), _e2m1_value(codes, scale, 8),
        _e2m1_value(codes, scale, 9), _e2m1_value(codes, scale, 10), _e2m1_value(codes, scale, 11),
        _e2m1_value(codes, scale, 12), _e2m1_value(codes, scale, 13), _e2m1_value(codes, scale, 14),
        _e2m1_value(codes, scale, 15),
    )


@triton.jit
def _e2m1_pair(codes, low: tl.constexpr, high: tl.constexpr):
    """Codes ``low`` and ``high`` of each word as one f16x2 of their values, in an int32."""
    low_bits = (e2m1_value_over_2_14(((codes >> (4 * low)) & 0xF).to(tl.int32)) * 16384.0).to(tl.uint16, bitcast=True)
    high_bits = (e2m1_value_over_2_14(((codes >> (4 * high)) & 0xF).to(tl.int32)) * 16384.0).to(tl.uint16, bitcast=True)
    return (low_bits.to(tl.uint32) | (high_bits.to(tl.uint32) << 16)).to(tl.int32, bitcast=True)


@triton.jit
def e2m1_pairs(codes, ASM: tl.constexpr):
    """The 16 E2M1 values of each 64-bit word ``codes`` (int64), unscaled, as 8 f16x2 pairs (int32
    each): pair 4 h + c holds codes 8 h + c and 8 h + c + 4, the order e2m1_block_dot multiplies
    them in. By inline PTX (ASM), or in Triton."""
    if ASM:
        return tl.inline_asm_elementwise(_E2M1_PAIRS_PTX, "=r," * 8 + "l", [codes], dtype=(tl.int32,) * 8, is_pure=True, pack=1)
    return (
        _e2m1_pair(codes, 0, 4), _e2m1_pair(codes, 1, 5), _e2m1_pair(codes, 2, 6), _e2m1_pair(codes, 3, 7),
        _e2m1_pair(codes, 8, 12), _e2m1_pair(codes, 9, 13), _e2m1_pair(codes, 10, 14), _e2m1_pair(codes, 11, 15),
    )


@triton.jit
def _pair_value(pair, high: tl.constexpr):
    return ((pair >> (16 * high)) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e2m1_block_dot(codes, pairs, ASM: tl.constexpr):
    """The sum of the 16 products of each 64-bit word of E2M1 codes ``codes`` (unscaled) with
    another word's values (``pairs``, e2m1_pairs; broadcast against ``codes``), times 2^-14, in
    fp32, exactly. By inline PTX (ASM) two products an fma: the codes decoded times 2^-14, so a
    product is a multiple of 2^-16 of at most 36 * 2^-14 and each f16x2 half sums 8 of them, at
    most 1152 multiples of 2^-16: an fp16 holds every such sum exactly (its subnormals included),
    and fp32 their total. In Triton the same sum in fp32 (the same bits: nothing rounds)."""
    if ASM:
        return tl.inline_asm_elementwise(
            _E2M1_BLOCK_DOT_PTX, "=f,l" + ",r" * 8, [codes, pairs[0], pairs[1], pairs[2], pairs[3], pairs[4], pairs[5], pairs[6], pairs[7]],
            dtype=tl.float32, is_pure=True, pack=1,
        )
    total = tl.zeros(codes.shape, tl.float32)
    for j in tl.static_range(16):
        b = e2m1_value_over_2_14(((codes >> (4 * j)) & 0xF).to(tl.int32)).to(tl.float32)
        total += b * _pair_value(pairs[4 * (j // 8) + j % 4], (j % 8) // 4)
    return total


def _e4m3_word_ptx() -> str:
    """PTX for e4m3_word_values: $8, a 64-bit word of 8 E4M3 codes -> $0..$7, their fp32 values,
    through f16 pairs (exact)."""
    lines = ["{", ".reg .b32 w<2>, h;", ".reg .b16 c<2>, lo, hi;", "mov.b64 {w0, w1}, $8;"]
    for half in range(2):
        lines.append(f"mov.b32 {{c0, c1}}, w{half};")
        for pair in range(2):
            first = 4 * half + 2 * pair
            lines += [f"cvt.rn.f16x2.e4m3x2 h, c{pair};", "mov.b32 {lo, hi}, h;", f"cvt.f32.f16 ${first}, lo;", f"cvt.f32.f16 ${first + 1}, hi;"]
    return "\n".join(lines + ["}"])


_E4M3_WORD_PTX = tl.constexpr(_e4m3_word_ptx())


@triton.jit
def _e4m3_value(codes, j: tl.constexpr):
    return ((codes >> (8 * j)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def e4m3_word_values(codes, ASM: tl.constexpr):
    """The 8 E4M3 codes of each 64-bit word ``codes`` as a tuple of fp32 values (the j-th is byte
    j): by inline PTX (ASM), two codes an instruction, or one at a time in Triton."""
    if ASM:
        return tl.inline_asm_elementwise(_E4M3_WORD_PTX, "=r," * 8 + "l", [codes], dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    return (
        _e4m3_value(codes, 0), _e4m3_value(codes, 1), _e4m3_value(codes, 2), _e4m3_value(codes, 3),
        _e4m3_value(codes, 4), _e4m3_value(codes, 5), _e4m3_value(codes, 6), _e4m3_value(codes, 7),
    )


# A 32-bit word of 4 E4M3 codes makes 2 bf16 pairs with integer instructions (no conversion
# unit): a byte permute (PRMT_CODES_01, PRMT_CODES_23) puts two codes in the high bytes of the
# halves, a shift right by 4 and a mask (E4M3_MAGNITUDE) put each magnitude in a bf16's exponent
# and mantissa bits, a bit select keeps the sign (lop3 with SIGN_OR); that bf16 is the code's
# value times 2^-120 (E4M3's subnormals become bf16 subnormals, which bf16 arithmetic keeps), so
# one bf16x2 multiply by 2^120 gives the value exactly and a second the value times its block's
# power-of-two scale. A NaN code would read as 480: the format's quantizer never writes one
# without its block's scale being NaN too (a NaN makes its block's amax NaN), which the product
# keeps.
PRMT_CODES_01 = 0x1404  # bytes: 0, code 0, 0, code 1
PRMT_CODES_23 = 0x3424  # bytes: 0, code 2, 0, code 3
E4M3_MAGNITUDE = 0x07F007F0  # after the shift: each half's exponent (bits 7-10) and mantissa (4-6)
SIGN_OR = 0xF8  # lop3 truth table of a | (b & c)
BF16X2_2_POW_120 = 0x7B807B80
# The multiplies are fmas adding -0, which leave every product (a zero's sign included) as it is:
# mul.bf16x2 needs sm_90, fma.bf16x2 sm_80, and the decode GEMM serves sm_89 too.
BF16X2_NEGATIVE_ZEROS = 0x80008000


def _e4m3_bf16_word_ptx() -> str:
    """PTX for e4m3_bf16_word_values: $8, a 64-bit word of 8 E4M3 codes, and $9, their E8M0 scale
    (its byte in 16 bits) -> $0..$7, the values times the scale in bf16, code j in $j. The scale's
    bf16 is its byte in the exponent bits (0: 2^-127, a subnormal; 255: NaN)."""
    lines = [
        "{", ".reg .b32 w<2>, p, t, sc, e120, nz;", ".reg .b16 e;", ".reg .pred zero, nan;",
        "mov.b64 {w0, w1}, $8;", f"mov.b32 e120, {BF16X2_2_POW_120:#010x};", "mov.b32 sc, {$9, $9};",
        f"mov.b32 nz, {BF16X2_NEGATIVE_ZEROS:#010x};",
    ]
    for half in range(2):
        for pair, selector in enumerate((PRMT_CODES_01, PRMT_CODES_23)):
            first = 4 * half + 2 * pair
            lines += [
                f"prmt.b32 p, w{half}, 0, {selector:#06x};", "shr.b32 t, p, 4;", f"and.b32 t, t, {E4M3_MAGNITUDE:#010x};",
                f"lop3.b32 t, t, 0x80008000, p, {SIGN_OR:#x};", "fma.rn.bf16x2 t, t, e120, nz;",
                "fma.rn.bf16x2 t, t, sc, nz;", f"mov.b32 {{${first}, ${first + 1}}}, t;",
            ]
    return "\n".join(lines + ["}"])


_E4M3_BF16_WORD_PTX = tl.constexpr(_e4m3_bf16_word_ptx())


@triton.jit
def e4m3_bf16_word_values(codes, biased, ASM: tl.constexpr):
    """The 8 E4M3 codes of each 64-bit word ``codes`` times its E8M0 scale (``biased``, the byte
    as stored), a tuple whose j-th is byte j: bf16 by inline PTX (ASM; exact where the product
    is in bf16's range, as the emulation's values), else fp32 in Triton (its interpreter
    multiplies bf16 in a dot wrongly)."""
    if ASM:  # one return for both branches: Triton types a function's returns together
        v = tl.inline_asm_elementwise(
            _E4M3_BF16_WORD_PTX, "=h," * 8 + "l,h", [codes, e8m0_value(biased).to(tl.bfloat16)], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1
        )
    else:
        scale = e8m0_value(biased)
        v = e4m3_word_values(codes, False)
        v = (v[0] * scale, v[1] * scale, v[2] * scale, v[3] * scale, v[4] * scale, v[5] * scale, v[6] * scale, v[7] * scale)
    return v


@triton.jit
def _nvfp4_kernel(
    packed_ptr, scale_ptr, factor_ptr, out_ptr, rows, cols, factor_stride, ends_ptr, group_rows,
    LIVE: tl.constexpr, SCALED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """Each program decodes BLOCK_B packed bytes (2 * BLOCK_B values) of BLOCK_R rows, loading
    their BLOCK_B / 8 block scales a row once and broadcasting them; SCALED: times their row's
    factor. LIVE: see _in_live_group."""
    if LIVE:
        if not _in_live_group(ends_ptr, tl.program_id(0) * BLOCK_R // group_rows):
            return
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    byte = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)[None, :]
    block = tl.program_id(1) * (BLOCK_B // 8) + tl.arange(0, BLOCK_B // 8)[None, :]
    row64 = row.to(tl.int64)
    packed = tl.load(packed_ptr + row64 * (cols // 2) + byte, mask=(row < rows) & (byte < cols // 2), other=0).to(tl.int32)
    scale = tl.load(scale_ptr + row64 * (cols // 16) + block, mask=(row < rows) & (block < cols // 16), other=0.0)
    scale = scale.to(tl.float32) * 16384.0  # undoes the 2^-14 of the decoded codes, exactly
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_R, BLOCK_B // 8, 8)), (BLOCK_R, BLOCK_B))
    values = tl.interleave(e2m1_value_over_2_14(packed & 0xF) * scale, e2m1_value_over_2_14(packed >> 4) * scale)
    if SCALED:
        values = values * tl.load(factor_ptr + row64 * factor_stride, mask=row < rows, other=1.0)
    col = tl.program_id(1) * 2 * BLOCK_B + tl.arange(0, 2 * BLOCK_B)[None, :]
    tl.store(out_ptr + row64 * cols + col, values.to(out_ptr.dtype.element_ty), mask=(row < rows) & (col < cols))


class LiveGroups(NamedTuple):
    """The stored rows of an expert stack to write values for: those of the experts some token
    was routed to, per the tokens' cumulative group ``ends`` (on the device), ``group_rows``
    rows an expert (a multiple of BLOCK_ROWS). The other experts' rows are left unwritten."""

    ends: torch.Tensor
    group_rows: int


def _live_arguments(live: Optional[LiveGroups], data: torch.Tensor) -> dict:
    if live is not None and live.group_rows % BLOCK_ROWS:
        raise ValueError(f"an expert's {live.group_rows} stored rows are not a multiple of the dequantize's {BLOCK_ROWS}-row programs")
    return dict(ends_ptr=data if live is None else live.ends, group_rows=1 if live is None else live.group_rows, LIVE=live is not None)


def mxfp8_values(
    data: torch.Tensor,
    scale: torch.Tensor,
    *,
    rowwise: bool,
    live: Optional[LiveGroups] = None,
    rows: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """bf16 values (contiguous) of MXFP8 ``data`` (stored orientation, any strides: a slice of
    columns is read in place, not copied) with E8M0 ``scale``; with ``live``, of those rows alone;
    with ``rows`` (rowwise, int64 on the device), of those stored rows in their order (a gather
    read in place: no copy of the gathered codes or values)."""
    if rows is not None and not rowwise:
        raise ValueError("MXFP8 values of gathered rows: a columnwise block's scale spans 32 rows, so only rowwise data gathers")
    stored_rows, cols = data.shape
    out_rows = stored_rows if rows is None else rows.shape[0]
    out = torch.empty((out_rows, cols), dtype=torch.bfloat16, device=data.device)
    grid = (ceil_div(out_rows, BLOCK_ROWS), ceil_div(cols, BLOCK_COLS))
    _mxfp8_kernel[grid](
        data, scale, out, stored_rows, cols, *data.stride(), *scale.stride(), **_live_arguments(live, data),
        source_ptr=data if rows is None else rows, out_rows=out_rows,
        ROWWISE=rowwise, GATHER=rows is not None, BLOCK_R=BLOCK_ROWS, BLOCK_C=BLOCK_COLS,
    )
    return out


def nvfp4_block_values(
    packed: torch.Tensor,
    scale: torch.Tensor,
    live: Optional[LiveGroups] = None,
    row_factor: Optional[torch.Tensor] = None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """q * s of NVFP4 ``packed`` codes with E4M3 block ``scale`` (exact in bf16), as ``dtype``;
    with ``row_factor`` (fp32, a (rows, 1) column: the global decode a row takes), times it,
    rounded to fp32 and then to ``dtype`` as torch's ops round (values.float() * factor); with
    ``live``, of those rows alone."""
    packed, scale = packed.contiguous(), scale.contiguous()
    rows, cols = packed.shape[0], packed.shape[1] * 2
    out = torch.empty((rows, cols), dtype=dtype, device=packed.device)
    factor = scale if row_factor is None else row_factor.float().expand(rows, 1)  # scale: a pointer not read
    grid = (ceil_div(rows, BLOCK_ROWS), ceil_div(cols // 2, BLOCK_COLS // 2))
    _nvfp4_kernel[grid](
        packed, scale, factor, out, rows, cols, factor.stride(0), **_live_arguments(live, packed),
        SCALED=row_factor is not None, BLOCK_R=BLOCK_ROWS, BLOCK_B=BLOCK_COLS // 2,
    )
    return out
