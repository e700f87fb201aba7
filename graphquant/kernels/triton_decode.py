"""The decode GEMM: out (m, n) = A @ B^T (+ bias) for the rows of A it takes (MAX_ROWS: few for
FP8, thousands for MXFP8 and NVFP4), Triton kernels that read both quantized operands as they
are stored, so the weight (B) crosses memory once.

At decode sizes the product costs little beside reading the weight, so each program takes
BLOCK_N rows of B against a tile of A's rows (all of them, where they fit), and K is split across
programs (each writes an fp32 partial sum; the last of a tile's programs to finish adds them in
split order and finishes the tile: one launch, the same bits every run), enough programs to keep
every SM reading; with more rows, a grid of row tiles shares each weight tile (VALUE_TILES). The
weight is the MMA's left operand (out^T = B A^T), so that a weight decoded in registers is the
tensor cores' register operand and A's tile comes from shared memory. How it multiplies depends on
the layout family (GemmInput.family) and the tiling (DecodeConfig):

- FP8 codes (per-tensor, per-row, 1x128 / 128x128 blocks) go to the FP8 tensor cores as stored,
  with no conversion; the partial sums are promoted into the fp32 accumulator after every
  fp8.PROMOTED_PRODUCTS (128) products, or every K tile where a tile is shorter
  (``max_num_imprecise_acc``), and a block's sum is multiplied by its two block scales before it
  joins the accumulator. That is the contract of the FP8 GEMMs cuBLASLt runs with promotion:
  within fp8.accumulation_bound's bound for sums promoted every fp8.PROMOTED_PRODUCTS.
- MXFP8 codes times their power-of-two scales, and NVFP4's E2M1 codes times their E4M3 scales
  (times 2^-14), are exact in bf16 and fp16 respectively: both are dequantized in registers to
  those values and multiplied on the tensor cores, whose products are exact, summed in fp32; or
  (DecodeConfig.fma, a row of A a program) multiplied on the FMA units: MXFP8 dequantized into
  fp32, NVFP4's unscaled codes multiplied and summed a 16-code word at a time by f16x2 fma
  (exact: triton_dequantize.e2m1_block_dot), each word's sum times its two scales in fp32.
  Their result is the emulated product's up to the order of fp32 accumulation: within
  fp8.accumulation_bound's for fp32 sums, 4 u sum_k |a b| for the factors and u |out| (u = 2^-24)
  before the output's rounding. MXFP8's other ways
  (DecodeConfig.mx_products, and the FMA units' sums of 8 products scaled) keep that while
  values and sums stay in fp32's normal range. NVFP4's and MXFP8's codes are read as 64-bit words
  and decoded by inline PTX, several values an instruction (triton_dequantize.e2m1_block_values,
  e4m3_bf16_word_values, e4m3_word_values): at these sizes the decoding instructions, not the
  bytes, set the pace.

From Hopper (sm_90) on, every launch is a programmatic dependent launch (PDL): a program starts
while the kernel before it (A's quantize or producer) finishes and waits for it
(``griddepcontrol.wait``) before it reads A or writes anything. In a decode step's CUDA graph
that hides the launch between the two kernels. (Asking L2 for the weight's first steps before
the wait cost more than it hid.)

The same programs run over an expert stack (experts_gemm, the section at the end): the grouped
GEMM's tokens x experts product of MXFP8 or NVFP4 operands at few tokens an expert
(graphquant.kernels.grouped), each token's row times its expert's rows of the stack.

The per-tensor or per-row factors (Quantizer.emulated_factor) multiply each other once and then
the sum, as the emulated GEMM's alpha does, and the bias is added before the one rounding to the
output dtype.

A may also come in high precision (QuantizedOnLoad: an inference linear's activation, in FP8
current scaling), for these kernels to quantize it themselves with the reference's bits: per
tensor or per row as they load each tile, the scale made from the amaxes of A's rows, or 1x128
blocks in one small kernel first (_block_codes_kernel; in a graph an op of its own, which the GEMMs
that read one activation share). The product is then the one they compute on A quantized first,
bit for bit, without the quantize kernels a graph would run before them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional, Sequence

import torch
import triton
import triton.language as tl

from graphquant.formats import fp8, nvfp4
from graphquant.formats.groups import FEW_TOKENS_AN_EXPERT, GroupPadding
from graphquant.kernels import arrival_counters, devices
from graphquant.kernels.triton_dequantize import (
    e2m1_block_dot, e2m1_block_values, e2m1_pairs, e4m3_bf16_word_values, e4m3_word_values, e8m0_value,
)
from graphquant.kernels.triton_grouped_gemm import pad_rows_alone
from graphquant.kernels.triton_launch import ceil_div, dependent_launch, launch, wait_for_the_kernel_before
from graphquant.kernels.triton_scales import fp8_codes, fp8_scale, reciprocal
from graphquant.quantizers import ROWWISE, GemmInput, Quantizer, Representation, gemm_dims, reduced_extent

BACKEND = "triton decode gemm"
# The same kernels given A in high precision with the amaxes of its rows, which they quantize
# themselves: no quantize kernels in the graph before the GEMM (QuantizedOnLoad).
QUANTIZING_BACKEND = "triton decode gemm, quantizing A"

# K is split at multiples of this many columns: a multiple of every config's BLOCK_K, and of
# every block scale's length, so that no block straddles two programs.
K_CHUNK = 512


class _Layout(NamedTuple):
    """How the kernel reads one layout family: the tensor cores' operand it makes (FP8 codes as
    stored, or values dequantized exactly into bf16 or fp16), the (rows, cols) each block scale
    covers ((0, 0) where none), and the factor (none, one per tensor, one per row), from the
    representation's scale or amax, with the divisor that makes an amax a factor."""

    operand: int
    scale_block: tuple[int, int]
    factor: int
    factor_from_amax: bool
    divisor: float


FP8_CODES, BF16_VALUES, F16_VALUES = 0, 1, 2
NO_FACTOR, TENSOR_FACTOR, ROW_FACTOR = 0, 1, 2

_NVFP4_DIVISOR = nvfp4.GLOBAL_DIVISOR  # nvfp4.global_decode: amax / 2688, one IEEE division

LAYOUTS = {
    "fp8_tensorwise": _Layout(FP8_CODES, (0, 0), TENSOR_FACTOR, False, 1.0),
    "fp8_rowwise": _Layout(FP8_CODES, (0, 0), ROW_FACTOR, False, 1.0),
    "fp8_block_1x128": _Layout(FP8_CODES, (1, 128), NO_FACTOR, False, 1.0),
    "fp8_block_128x128": _Layout(FP8_CODES, (128, 128), NO_FACTOR, False, 1.0),
    "mxfp8": _Layout(BF16_VALUES, (1, 32), NO_FACTOR, False, 1.0),
    "nvfp4": _Layout(F16_VALUES, (1, 16), TENSOR_FACTOR, True, _NVFP4_DIVISOR),
    "nvfp4_row_scaled": _Layout(F16_VALUES, (1, 16), ROW_FACTOR, True, _NVFP4_DIVISOR),
}

# The operand pairs (A's family, B's family) it multiplies, each recipe's activation x weight,
# and the most rows of A it takes for each. Both sides of a pair make the same kind of operand
# with block scales of the same length in K. FP8 codes up to one tile of rows (the tensor cores'
# smallest): past it cuBLASLt's FP8 GEMMs read FP8 weights as fast. MXFP8 and NVFP4, which no
# tensor core of Hopper takes, up to VALUE_ROWS: their weight decoded in registers a tile at a
# time, shared by one tile of up to 128 of A's rows, in place of the emulation's whole weight
# dequantized into memory on every call; past it the products, not the bytes, set the pace, and
# the emulation's bf16 GEMM runs them faster than these kernels (benchmarks/NOTES.md,
# decode_gemm.py). A call given its tiling (DecodeConfig) takes any rows.
ONE_TILE_ROWS = 16
VALUE_ROWS = 128
MAX_ROWS = {
    ("fp8_tensorwise", "fp8_tensorwise"): ONE_TILE_ROWS,
    ("fp8_rowwise", "fp8_rowwise"): ONE_TILE_ROWS,
    ("fp8_block_1x128", "fp8_block_1x128"): ONE_TILE_ROWS,
    ("fp8_block_1x128", "fp8_block_128x128"): ONE_TILE_ROWS,
    ("mxfp8", "mxfp8"): VALUE_ROWS,
    ("nvfp4", "nvfp4"): VALUE_ROWS,
    ("nvfp4_row_scaled", "nvfp4"): VALUE_ROWS,
}
# The A families whose FP8 current scaling it applies to A itself: KernelEncoding (scaling, block)
# of each, and the pairs of MAX_ROWS it then multiplies. Per tensor and per row as it loads A;
# 1x128 blocks in a kernel of their own first (_block_codes_kernel): loaded, each 128-column
# block's codes would go from registers to the tensor cores' shared memory on their own, which
# made the GEMM 1.5-3x slower than reading codes quantized before it (decode_gemm.py).
QUANTIZED_ON_LOAD = {("tensor", (0, 0)): "fp8_tensorwise", ("row", (1, -1)): "fp8_rowwise", ("block", (1, 128)): "fp8_block_1x128"}
# The formats (KernelEncoding.scaling) whose activations are quantized first: quantized in each
# program as it loaded its tile of A (each block's scale from its amax, the codes packed into the
# words a stored A has), the GEMM lost more time than the launches it saved (benchmarks/NOTES.md,
# decode_gemm.py).
MEASURED_SLOWER = ("mxfp8", "nvfp4")
QUANTIZING_PAIRS = frozenset(pair for pair in MAX_ROWS if pair[0] in QUANTIZED_ON_LOAD.values())
# The weight families whose GEMMs that read one A run in one launch (gemms_sharing_a): FP8 codes,
# multiplied as stored on the tensor cores by one kernel (_decode_kernel's GEMMS) at every row
# count it takes. MXFP8 shares a launch at one row only (on the FMA units' kernel): at more it runs
# on tilings (VALUE_TILES) whose A may be decoded by a kernel of its own first.
SHARED_FAMILIES = ("fp8_tensorwise", "fp8_rowwise", "fp8_block_128x128", "fp8_block_1x128")
# The weight families whose GEMMs that read one A run in one launch at one row of A alone: the
# FMA units' program (_fma_kernel's GEMMS). MXFP8's pair of FFN weights ran 1.45x faster in one
# launch; NVFP4's 1.21x slower under its one-row tiling (benchmarks/NOTES.md, decode_gemm.py).
ONE_ROW_SHARED_FAMILIES = ("mxfp8",)


def shares_launch(family: str, rows: Optional[int]) -> bool:
    """Whether GEMMs of weights of this family that read one A of ``rows`` rows (None: not known)
    run in one launch (gemms_sharing_a)."""
    return family in SHARED_FAMILIES or (family in ONE_ROW_SHARED_FAMILIES and rows == 1)


# The most GEMMs that read one A one launch runs (gemms_sharing_a: the kernels' GEMMS): an
# attention layer's q, k and v projections (a SwiGLU's gate and up take two).
SHARED_LAUNCH = 3
_FP8 = ("e4m3", "e5m2")
ELEMENT_PAIRS = frozenset({(x, y) for x in _FP8 for y in _FP8} | {("e2m1", "e2m1")})
# The elements each family's codes are read as, where the pairs above admit more: MXFP8's words
# are decoded as E4M3 (e4m3_bf16_word_values, e4m3_word_values), so an E5M2 MXFP8 operand (a
# HYBRID recipe's gradient) is not this GEMM's.
FAMILY_ELEMENTS = {"mxfp8": ("e4m3",)}


def reads(operand: GemmInput) -> bool:
    """Whether the kernels read an operand of this family in this element encoding."""
    return operand.element in FAMILY_ELEMENTS.get(operand.family, (operand.element,))

MX_PRODUCTS = ("values", "block sums", "dot scaled")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """How one decode GEMM call is tiled: BLOCK_N rows of the weight against BLOCK_M rows of A
    per program, BLOCK_K columns a step, its warps and pipeline stages, how many programs an SM
    gets (the K split follows from it), and how MXFP8's products are made (MX_PRODUCTS): codes
    times scales dequantized to bf16 ("values"), each 32-block's sum of fp16 codes scaled
    ("block sums"), or Triton's tl.dot_scaled ("dot scaled"). ``fma``: MXFP8 and NVFP4
    multiplied on the FMA units (_fma_kernel), one row of A a program (block_m 1), instead of
    the tensor cores. ``a_first``: MXFP8's and NVFP4's A decoded once by a kernel of its own
    (_a_values_kernel) into the tensor cores' order of K, which each program then copies as it
    is, instead of every program decoding its tile of A again: for many rows, where A's tiles
    are as large as the weight's. ``one_dot``: with A decoded first, each step's weight tile
    decoded in K's own order and multiplied in one dot: it goes through shared memory, and the
    tensor cores' products run while the next tile is decoded (a register operand, as the pairs
    are, makes each dot wait for its products)."""

    block_n: int = 64
    block_k: int = 256
    block_m: int = 16
    warps: int = 4
    stages: int = 3
    tiles_per_sm: int = 2
    mx_products: str = "values"
    fma: bool = False
    a_first: bool = False
    one_dot: bool = False

    def __post_init__(self) -> None:
        sizes = {"block_n": self.block_n, "block_k": self.block_k, "block_m": self.block_m, "warps": self.warps}
        problems = [f"{name}={value} is not a power of two" for name, value in sizes.items() if value < 1 or value & (value - 1)]
        if not 32 <= self.block_k <= K_CHUNK:
            problems.append(f"block_k={self.block_k} is not from 32 to {K_CHUNK} (K is split at multiples of {K_CHUNK})")
        if self.mx_products not in MX_PRODUCTS:
            problems.append(f"mx_products={self.mx_products!r} is not one of {MX_PRODUCTS}")
        if min(self.stages, self.tiles_per_sm) < 1:
            problems.append("stages and tiles_per_sm must be at least 1")
        if self.fma and self.block_m != 1:
            problems.append(f"the FMA units multiply one row of A a program (block_m={self.block_m})")
        if self.a_first and (self.fma or self.mx_products != "values"):
            problems.append("A is decoded first for the tensor cores' products of values alone (not fma, mx_products='values')")
        if self.one_dot and not self.a_first:
            problems.append("one_dot multiplies A decoded first (a_first)")
        if not self.fma and min(self.block_n, self.block_m) < 16:
            problems.append(f"the tensor cores multiply tiles of at least 16 rows (block_n={self.block_n}, block_m={self.block_m})")
        if problems:
            raise ValueError(f"{self}: " + "; ".join(problems))


_ELEMENT_FORMATS = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}

# The weight tiles (BLOCK_N, BLOCK_K, warps, stages) Triton's autotuner picks from, per weight
# shape on its first call, for FP8 codes and a tile of 16 rows of A on the tensor cores, two
# programs an SM (two fill the memory pipe); the interpreter runs a kernel's logic, not its
# speed, and takes the first alone.
AUTOTUNED_TILES = [(64, 256, 4, 3), (64, 128, 4, 4), (128, 256, 4, 3)]
if triton.knobs.runtime.interpret:
    AUTOTUNED_TILES = AUTOTUNED_TILES[:1]
AUTOTUNED_TILES_PER_SM = 2
# NVFP4 and MXFP8 at one row on the FMA units (no MMA tile of 16 rows to decode and fill)
# (benchmarks/decode_nvfp4.py).
_ONE_ROW = {
    F16_VALUES: DecodeConfig(block_n=64, block_k=512, block_m=1, warps=4, stages=1, tiles_per_sm=8, fma=True),
    BF16_VALUES: DecodeConfig(block_n=64, block_k=256, block_m=1, warps=4, stages=1, tiles_per_sm=4, fma=True),
}
# NVFP4 and MXFP8 on the tensor cores, by the most rows of A each tiling takes: a tile of rows
# sharing each decoded weight tile, the more rows the fewer times each weight tile is decoded;
# programs an SM to hide the decoding's latency while the weight is read (few rows), or a
# larger weight tile (8 warps, two of the tensor cores' 64-row tiles) against the most rows, A
# decoded first and one dot a step (where the products begin to set the pace).
VALUE_TILES = (
    (ONE_TILE_ROWS, DecodeConfig(block_n=64, block_k=256, block_m=ONE_TILE_ROWS, warps=4, stages=3, tiles_per_sm=8)),
    (64, DecodeConfig(block_n=64, block_k=128, block_m=64, warps=4, stages=4, tiles_per_sm=4)),
    (VALUE_ROWS, DecodeConfig(block_n=128, block_k=128, block_m=128, warps=8, stages=3, tiles_per_sm=2, a_first=True, one_dot=True)),
)


def default_config(operand: int, m: int) -> Optional[DecodeConfig]:
    """The tiling a call of ``m`` rows of A gets, for the weight's ``operand`` (FP8_CODES,
    BF16_VALUES, F16_VALUES): MXFP8 and NVFP4 at one row on the FMA units, else the first of
    VALUE_TILES that takes m rows (its row tile shrunk to the power of two past m, 16 at least);
    None for FP8 codes (a tile of 16 rows with the weight tile Triton's autotuner picks)."""
    if operand == FP8_CODES:
        return None
    if m == 1 and not triton.knobs.runtime.interpret:
        return _ONE_ROW[operand]
    config = next(config for rows, config in VALUE_TILES if m <= rows)
    return dataclasses.replace(config, block_m=min(config.block_m, max(triton.next_power_of_2(m), ONE_TILE_ROWS)))


@triton.jit
def _codes(data_ptr, row, rows, col, K, stride):
    """FP8 codes at (row, col) as stored, +0 outside the operand: loaded as bytes (a zero byte is
    +0 in both FP8 encodings), since an FP8 load's ``other`` would need a cast to FP8."""
    raw = tl.load(data_ptr.to(tl.pointer_type(tl.uint8)) + row.to(tl.int64) * stride + col, mask=(row < rows) & (col < K), other=0)
    return raw.to(data_ptr.dtype.element_ty, bitcast=True)


@triton.jit
def _block_scales(scale_ptr, row, rows, block, blocks, row_stride, col_stride, SCALE_ROWS: tl.constexpr, E8M0: tl.constexpr):
    """fp32 values of the scales (fp32, E4M3, or E8M0 where asked) of ``block`` (columns of
    blocks) for ``row``, 0 outside the operand (no ``other`` in the load: an E4M3 scale's would
    need a cast to FP8)."""
    inside = (row < rows) & (block < blocks)
    raw = tl.load(scale_ptr + (row.to(tl.int64) // SCALE_ROWS) * row_stride + block.to(tl.int64) * col_stride, mask=inside)
    if E8M0:
        value = e8m0_value(raw)
    else:
        value = raw.to(tl.float32)
    return tl.where(inside, value, 0.0)


@triton.jit
def _e8m0_bytes(scale_ptr, row, rows, block, blocks, row_stride, col_stride):
    """E8M0 scales of ``block`` for ``row`` as stored (bytes), 2^0 outside the operand."""
    inside = (row < rows) & (block < blocks)
    return tl.load(scale_ptr + row.to(tl.int64) * row_stride + block.to(tl.int64) * col_stride, mask=inside, other=127)


@triton.jit
def _mxfp8_words(
    data_ptr, scale_ptr, row, rows, k0, K, stride_words, scale_row_stride, scale_col_stride, BLOCK_K: tl.constexpr, INSIDE: tl.constexpr
):
    """MXFP8's codes from column k0 on as BLOCK_K / 8 64-bit words of 8 (0 outside the operand,
    or all INSIDE it: no masks), and each word's E8M0 scale as stored (its 32-block's, loaded once
    a block); ``stride_words``: the data's row stride in words."""
    word = k0 // 8 + tl.arange(0, BLOCK_K // 8)[None, :]
    block = k0 // 32 + tl.arange(0, BLOCK_K // 32)[None, :]
    at = data_ptr.to(tl.pointer_type(tl.int64)) + row.to(tl.int64) * stride_words + word
    scale_at = scale_ptr + row.to(tl.int64) * scale_row_stride + block.to(tl.int64) * scale_col_stride
    if INSIDE:
        codes, biased = tl.load(at), tl.load(scale_at)
    else:
        codes = tl.load(at, mask=(row < rows) & (word < tl.cdiv(K, 8)), other=0)
        biased = tl.load(scale_at, mask=(row < rows) & (block < tl.cdiv(K, 32)), other=127)
    return codes, tl.reshape(tl.broadcast_to(biased[:, :, None], (biased.shape[0], BLOCK_K // 32, 4)), codes.shape)


@triton.jit
def _mxfp8_blocks(
    data_ptr, scale_ptr, row, rows, block, blocks, stride_words, scale_row_stride, scale_col_stride, INSIDE: tl.constexpr
):
    """MXFP8's 32-code blocks at (row, block) (a trailing dim of 1) as their 4 64-bit words of 8
    codes (0 outside the operand, or all INSIDE it: no masks), and each block's power-of-two
    scale in fp32 (0 outside); ``stride_words``: the data's row stride in words."""
    word = block * 4 + tl.arange(0, 4)[None, None, :]
    at = data_ptr.to(tl.pointer_type(tl.int64)) + row.to(tl.int64) * stride_words + word
    if INSIDE:
        return tl.load(at), e8m0_value(tl.load(scale_ptr + row.to(tl.int64) * scale_row_stride + block.to(tl.int64) * scale_col_stride))
    scale = _block_scales(scale_ptr, row, rows, block, blocks, scale_row_stride, scale_col_stride, 1, True)
    return tl.load(at, mask=(row < rows) & (block < blocks), other=0), scale


@triton.jit
def _nvfp4_blocks(
    data_ptr, scale_ptr, row, rows, block, blocks, stride_blocks, scale_row_stride, scale_col_stride, INSIDE: tl.constexpr
):
    """NVFP4's 16-code blocks at (row, block) as 64-bit words (0 outside the operand, or all
    INSIDE it: no masks), and each block's E4M3 scale as an fp16 (exact); ``stride_blocks``: the
    data's row stride in blocks."""
    at = data_ptr.to(tl.pointer_type(tl.int64)) + row.to(tl.int64) * stride_blocks + block
    scale_at = scale_ptr + row.to(tl.int64) * scale_row_stride + block.to(tl.int64) * scale_col_stride
    if INSIDE:
        scale = tl.load(scale_at)
        return tl.load(at), scale.to(tl.float16)
    inside = (row < rows) & (block < blocks)
    scale = tl.load(scale_at.to(tl.pointer_type(tl.uint8)), mask=inside, other=0).to(scale_ptr.dtype.element_ty, bitcast=True)
    return tl.load(at, mask=inside, other=0), scale.to(tl.float16)  # a zero byte is +0 in E4M3, as _codes loads


@triton.jit
def _pair(low, high, TRANSPOSED: tl.constexpr):
    """(rows, words) ``low`` and ``high`` side by side in K: (rows, 2 * words), or (2 * words,
    rows) where TRANSPOSED. A transposed operand is made so, not by tl.trans after: Triton 3.6
    would move the shared-memory copy of the transposed tile above the reshape, into a layout it
    cannot make."""
    if TRANSPOSED:
        pair = tl.reshape(tl.permute(tl.join(low, high), (1, 2, 0)), (2 * low.shape[1], low.shape[0]))
    else:
        pair = tl.reshape(tl.join(low, high), (low.shape[0], 2 * low.shape[1]))
    return pair


@triton.jit
def _mxfp8_pairs(codes, scale, ASM: tl.constexpr, TRANSPOSED: tl.constexpr = False):
    """The words' values times their scales (e4m3_bf16_word_values) as 4 (rows, 2 * words)
    operands (_pair; TRANSPOSED for A): the p-th holds codes 2p and 2p + 1 of each word side by
    side in K, one bf16x2 register as decoded, so that the compiler loads the words straight into
    the tensor cores' operand layout and decodes them there. Both operands take K in this order."""
    v = e4m3_bf16_word_values(codes, scale, ASM)
    return (
        _pair(v[0], v[1], TRANSPOSED), _pair(v[2], v[3], TRANSPOSED), _pair(v[4], v[5], TRANSPOSED), _pair(v[6], v[7], TRANSPOSED),
    )


@triton.jit
def _nvfp4_pairs(codes, scale, ASM: tl.constexpr, TRANSPOSED: tl.constexpr = False):
    """The blocks' values (e2m1_block_values, times 2^-14) as 8 (rows, 2 * blocks) operands
    (_pair; TRANSPOSED for A): the k-th holds each block's k-th decoded f16x2 register (codes j
    and j + 4), its two values side by side in K, so that the compiler loads the codes straight
    into the tensor cores' operand layout and decodes them there (the decoded weight never passes
    through shared memory). Both operands take K in this same order."""
    v = e2m1_block_values(codes, scale, ASM)
    return (
        _pair(v[0], v[4], TRANSPOSED), _pair(v[1], v[5], TRANSPOSED), _pair(v[2], v[6], TRANSPOSED), _pair(v[3], v[7], TRANSPOSED),
        _pair(v[8], v[12], TRANSPOSED), _pair(v[9], v[13], TRANSPOSED), _pair(v[10], v[14], TRANSPOSED), _pair(v[11], v[15], TRANSPOSED),
    )


@triton.jit
def _in_order8(v0, v1, v2, v3, v4, v5, v6, v7):
    """Eight (rows, words) tensors, the j-th holding code j of each word, as (rows, words, 2, 2,
    2) whose flattening puts each word's codes in K's own order (tl.join adds the fastest axis:
    the evens' tree, then the odds')."""
    return tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))


@triton.jit
def _mxfp8_in_order(codes, scale, ASM: tl.constexpr):
    """The words' values times their scales as one (rows, 8 * words) operand in K's own order."""
    v = e4m3_bf16_word_values(codes, scale, ASM)
    return tl.reshape(_in_order8(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]), (codes.shape[0], 8 * codes.shape[1]))


@triton.jit
def _nvfp4_in_order(codes, scale, ASM: tl.constexpr):
    """The blocks' values (times 2^-14) as one (rows, 16 * blocks) operand in K's own order."""
    v = e2m1_block_values(codes, scale, ASM)
    evens = _in_order8(v[0], v[2], v[4], v[6], v[8], v[10], v[12], v[14])
    odds = _in_order8(v[1], v[3], v[5], v[7], v[9], v[11], v[13], v[15])
    return tl.reshape(tl.join(evens, odds), (codes.shape[0], 16 * codes.shape[1]))


@triton.jit
def _words(
    data_ptr, scale_ptr, row, rows, k0, K, stride_words, scale_row_stride, scale_col_stride,
    OPERAND: tl.constexpr, BLOCK_K: tl.constexpr, INSIDE: tl.constexpr,
):
    """MXFP8's (OPERAND 1) or NVFP4's codes from column k0 on as 64-bit words, and each word's
    scale (_mxfp8_words, _nvfp4_blocks)."""
    if OPERAND == 1:
        codes, scale = _mxfp8_words(data_ptr, scale_ptr, row, rows, k0, K, stride_words, scale_row_stride, scale_col_stride, BLOCK_K, INSIDE)
    else:
        block = k0 // 16 + tl.arange(0, BLOCK_K // 16)[None, :]
        codes, scale = _nvfp4_blocks(data_ptr, scale_ptr, row, rows, block, K // 16, stride_words, scale_row_stride, scale_col_stride, INSIDE)
    return codes, scale


@triton.jit
def _pairs(codes, scale, OPERAND: tl.constexpr, ASM: tl.constexpr, TRANSPOSED: tl.constexpr = False):
    """The words' pair operands (_mxfp8_pairs, _nvfp4_pairs)."""
    if OPERAND == 1:
        pairs = _mxfp8_pairs(codes, scale, ASM, TRANSPOSED)
    else:
        pairs = _nvfp4_pairs(codes, scale, ASM, TRANSPOSED)
    return pairs


@triton.jit
def _in_order(codes, scale, OPERAND: tl.constexpr, ASM: tl.constexpr):
    """The words' values as one operand in K's own order (_mxfp8_in_order, _nvfp4_in_order)."""
    if OPERAND == 1:
        values = _mxfp8_in_order(codes, scale, ASM)
    else:
        values = _nvfp4_in_order(codes, scale, ASM)
    return values


@triton.jit
def _a_tile(values_ptr, M, K, stride, k0, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """A's values in K's own order (_a_values_kernel, ONE_DOT) at columns k0 to k0 + BLOCK_K,
    transposed: (BLOCK_K, BLOCK_M), 0 outside A and past its values (the last K split's steps
    may reach past them)."""
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    col = k0 + tl.arange(0, BLOCK_K)[:, None]
    return tl.load(values_ptr + m.to(tl.int64) * stride + col, mask=(m < M) & (col < tl.cdiv(K, CHUNK) * CHUNK), other=0.0)


@triton.jit
def _a_pair(values_ptr, M, K, stride, j: tl.constexpr, first_word, CHUNK: tl.constexpr, WORD: tl.constexpr, BLOCK_M: tl.constexpr, WORDS: tl.constexpr):
    """The j-th pair operand of A's WORDS words (of WORD codes) from ``first_word`` on, (2 * WORDS,
    BLOCK_M), as _a_values_kernel laid it out (0 outside A and past its pair's values: the last K
    split's steps may reach past them)."""
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    at = 2 * first_word + tl.arange(0, 2 * WORDS)[:, None]
    length = 2 * _padded_words(K, CHUNK, WORD)
    return tl.load(values_ptr + m.to(tl.int64) * stride + j * length + at, mask=(m < M) & (at < length), other=0.0)


@triton.jit
def _padded_words(K, CHUNK: tl.constexpr, WORD: tl.constexpr):
    """The words of WORD codes in K rounded up to whole CHUNKs: each pair's length in A's values
    (_a_values_kernel), a multiple of 16 (so that a mask at it keeps 16-byte copies)."""
    return tl.cdiv(K, CHUNK) * (CHUNK // WORD)


@triton.jit
def _a_values_kernel(
    a_ptr, a_scale_ptr, values_ptr, M, K, a_stride, a_scale_row_stride, a_scale_col_stride, values_stride,
    OPERAND: tl.constexpr, ASM: tl.constexpr, ONE_DOT: tl.constexpr, CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, WORDS: tl.constexpr,
):
    """Program (r, w): MXFP8's or NVFP4's A (OPERAND), BLOCK_R rows and WORDS 64-bit words of
    codes, decoded as _decode_kernel decodes them, in the order its dots take K: in K's own order
    (ONE_DOT), or each pair operand (_mxfp8_pairs, _nvfp4_pairs) in its own range of a row's
    values, the j-th pair's of word w at j * 2 * padded words + 2 * w (_padded_words, zeros past
    K), so that a program's step copies each of its operands in one piece, 16 bytes at a time."""
    WORD: tl.constexpr = 8 if OPERAND == 1 else 16  # codes a word
    row = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    first_word = tl.program_id(1) * WORDS
    at = values_ptr + row.to(tl.int64) * values_stride
    codes, scale = _words(a_ptr, a_scale_ptr, row, M, first_word * WORD, K, a_stride, a_scale_row_stride, a_scale_col_stride, OPERAND, WORD * WORDS, False)
    if ONE_DOT:
        tl.store(at + first_word * WORD + tl.arange(0, WORD * WORDS)[None, :], _in_order(codes, scale, OPERAND, ASM), mask=row < M)
    else:
        pairs = _pairs(codes, scale, OPERAND, ASM)
        at = at + 2 * first_word + tl.arange(0, 2 * WORDS)[None, :]
        for j in tl.static_range(WORD // 2):
            tl.store(at + j * 2 * _padded_words(K, CHUNK, WORD), pairs[j], mask=row < M)


@triton.jit
def _factor(ptr, index, mask, KIND: tl.constexpr, DIVISOR: tl.constexpr):
    """An operand's factor: its one value, or its value at each row ``index``; an amax divided by
    DIVISOR with one IEEE division, as the format's reference does."""
    if KIND == 1:  # TENSOR_FACTOR
        factor = tl.load(ptr).to(tl.float32)
    else:
        factor = tl.load(ptr + index, mask=mask, other=1.0).to(tl.float32)
    if DIVISOR != 1.0:
        factor = tl.math.div_rn(factor, DIVISOR)
    return factor


@triton.jit
def _amax_of_a(ptr, index, mask, KIND: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_P2: tl.constexpr):
    """The amax of each row ``index`` of A (a column or a row of them), or (KIND 1,
    TENSOR_FACTOR) of all A, whose rows are all at ``index``, from the amaxes of CHUNKS chunks of
    each row at ``ptr`` (QuantizedOnLoad), loaded as one tile (CHUNKS_P2 wide, the power of two
    past CHUNKS): the max of their bits, as fp8.tensor_amax takes it (a NaN wins)."""
    axis: tl.constexpr = 1 if index.shape[1] == 1 else 0  # the chunks run across the rows' axis
    chunk = tl.arange(0, CHUNKS_P2)
    chunk = chunk[None, :] if axis == 1 else chunk[:, None]
    amaxes = tl.load(ptr + index * CHUNKS + chunk, mask=mask & (chunk < CHUNKS), other=0.0)
    bits = tl.max(amaxes.to(tl.int32, bitcast=True), axis, keep_dims=True)
    if KIND == 1:
        bits = tl.max(tl.reshape(bits, (bits.numel,)), 0)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _scale(amax, RULE: tl.constexpr):
    """The scale FP8 current scaling's RULE (QuantizedOnLoad.rule) gives ``amax``."""
    return fp8_scale(amax, RULE[1], RULE[2], RULE[3])


@triton.jit
def _quantized(ptr, row, rows, col, K, stride, scale, RULE: tl.constexpr):
    """The FP8 codes (RULE's element) of the high-precision values at (row, col) under ``scale``
    (broadcast over them), +0 outside the operand."""
    return _encoded(tl.load(ptr + row.to(tl.int64) * stride + col, mask=(row < rows) & (col < K), other=0.0), scale, RULE)


@triton.jit
def _encoded(x, scale, RULE: tl.constexpr):
    """x's FP8 codes (RULE's element) under ``scale``."""
    if RULE[0] == "e4m3":
        codes = fp8_codes(x, scale, tl.float8e4nv)
    else:
        codes = fp8_codes(x, scale, tl.float8e5)
    return codes


@triton.jit
def _block_codes_kernel(x_ptr, codes_ptr, scale_ptr, rows, K, x_stride, RULE: tl.constexpr, BLOCKS: tl.constexpr):
    """Program (r, j): the 1x128 blocks j * BLOCKS to (j + 1) * BLOCKS - 1 of row r of x, each
    block's FP8 codes under the scale RULE gives its amax (the max of its magnitudes' bits, as
    the reference's: a NaN wins), and that scale's reciprocal (scale_ptr: (blocks, rows), the
    spec's outer-dim-major layout)."""
    row = tl.program_id(0)
    block = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)[:, None]
    col = block * 128 + tl.arange(0, 128)[None, :]
    x = tl.load(x_ptr + row.to(tl.int64) * x_stride + col, mask=col < K, other=0.0)
    bits = tl.max(x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF, 1, keep_dims=True)
    scale = _scale(bits.to(tl.float32, bitcast=True), RULE)
    tl.store(codes_ptr + row.to(tl.int64) * K + col, _encoded(x, scale, RULE), mask=col < K)
    tl.store(scale_ptr + block.to(tl.int64) * rows + row, reciprocal(scale), mask=block < tl.cdiv(K, 128))


@triton.jit
def _factored(
    total, n, m, N, M, a_factor_ptr, b_factor_ptr, A_FACTOR: tl.constexpr, A_DIVISOR: tl.constexpr, B_FACTOR: tl.constexpr,
    B_DIVISOR: tl.constexpr, a_factor=None,
):
    """total[n, m] times both factors, their product first, as one alpha (_factor: at the
    pointers, one value or one at each row ``m`` of A and ``n`` of B). ``a_factor``: A's factor
    where the program made it (A quantized as it was loaded: one value, or one a row of A as a
    column), else read at a_factor_ptr."""
    if A_FACTOR != 0:
        if a_factor is None:
            factor = _factor(a_factor_ptr, m, m < M, A_FACTOR, A_DIVISOR)
        elif A_FACTOR == 1:  # TENSOR_FACTOR
            factor = a_factor
        else:
            factor = tl.reshape(a_factor, m.shape)
        if B_FACTOR != 0:
            factor = factor * _factor(b_factor_ptr, n, n < N, B_FACTOR, B_DIVISOR)
        total = total * factor
    elif B_FACTOR != 0:
        total = total * _factor(b_factor_ptr, n, n < N, B_FACTOR, B_DIVISOR)
    return total


@triton.jit
def _finish(
    total, n, m, N, M, a_factor_ptr, b_factor_ptr, bias_ptr, out_ptr,
    A_FACTOR: tl.constexpr, A_DIVISOR: tl.constexpr, B_FACTOR: tl.constexpr, B_DIVISOR: tl.constexpr,
    has_bias, a_factor=None,
):
    """out[m, n] = total[n, m] times both factors (_factored), plus the bias, rounded once to
    out's dtype."""
    total = _factored(total, n, m, N, M, a_factor_ptr, b_factor_ptr, A_FACTOR, A_DIVISOR, B_FACTOR, B_DIVISOR, a_factor)
    if has_bias:
        total = total + tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * N + n, total.to(out_ptr.dtype.element_ty), mask=(n < N) & (m < M))


@triton.jit
def _write(
    total, n, m, N, M, a_factor_ptr, b_factor_ptr, bias_ptr, out_ptr, partial_ptr, arrivals_ptr,
    A_FACTOR: tl.constexpr, A_DIVISOR: tl.constexpr, B_FACTOR: tl.constexpr, B_DIVISOR: tl.constexpr, has_bias, SPLIT: tl.constexpr,
    split, splits, arrival, a_factor=None,
):
    """A program's (BLOCK_N, BLOCK_M) sums finished into out (_finish); where K is SPLIT, its
    partial sums written to partial[split] instead, and the last of the ``splits`` programs of its
    output tile to arrive (its counter at arrivals_ptr + ``arrival``, one a tile) adds every
    split's in split order (the same bits whichever program arrives last), finishes them and sets
    the counter back to zero for the next launch."""
    if not SPLIT:
        _finish(total, n, m, N, M, a_factor_ptr, b_factor_ptr, bias_ptr, out_ptr, A_FACTOR, A_DIVISOR, B_FACTOR, B_DIVISOR, has_bias, a_factor)
    else:
        inside = (n < N) & (m < M)
        tl.store(partial_ptr + (split * M + m).to(tl.int64) * N + n, total, mask=inside)
        # every thread's partial sums are stored before the arrival that releases them
        tl.debug_barrier()
        arrivals = arrivals_ptr + arrival
        if tl.atomic_add(arrivals, 1, sem="acq_rel") == splits - 1:
            summed = tl.zeros(total.shape, dtype=tl.float32)
            for each in tl.range(0, splits, loop_unroll_factor=4):  # unrolled: the loads of four splits in flight at once
                summed += tl.load(partial_ptr + (each * M + m).to(tl.int64) * N + n, mask=inside, other=0.0)
            _finish(summed, n, m, N, M, a_factor_ptr, b_factor_ptr, bias_ptr, out_ptr, A_FACTOR, A_DIVISOR, B_FACTOR, B_DIVISOR, has_bias, a_factor)
            tl.store(arrivals, 0)


@triton.jit
def _a_scale(a_factor_ptr, m, M, A_FACTOR: tl.constexpr, A_RULE: tl.constexpr):
    """A's one scale, or one a row (rows ``m``, a column), where it is quantized as it is loaded
    under A_RULE (the amaxes of its rows at a_factor_ptr); else None."""
    if A_RULE is not None:
        scale = _scale(_amax_of_a(a_factor_ptr, m, m < M, A_FACTOR, A_RULE[4], A_RULE[5]), A_RULE)
    else:
        scale = None
    return scale


@triton.jit
def _steps_in_k(K, k_start, span, BLOCK_K: tl.constexpr):
    """(where a split's steps from k_start stop lying wholly inside K, where they stop reaching
    into it), each at most ``span``: the unmasked steps, then the masked ones; steps wholly past K
    add nothing and are not run."""
    return tl.minimum(span, (K - k_start) // BLOCK_K * BLOCK_K), tl.minimum(span, tl.cdiv(K - k_start, BLOCK_K) * BLOCK_K)


@triton.jit
def _tile_step(
    total, a_ptr, a_scale_ptr, a_stride, a_scale_row_stride, a_scale_col_stride, b_ptr, b_scale_ptr, b_stride, b_scale_row_stride,
    b_scale_col_stride, n, m, N, M, K, k0, quantizing_scale, CHUNK: tl.constexpr, OPERAND: tl.constexpr, SCALE_COLS: tl.constexpr,
    A_SCALE_ROWS: tl.constexpr, B_SCALE_ROWS: tl.constexpr, PROMOTE_EVERY: tl.constexpr, MX: tl.constexpr, A_FORMAT: tl.constexpr,
    B_FORMAT: tl.constexpr, ASM: tl.constexpr, INSIDE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, A_RULE: tl.constexpr, A_VALUES: tl.constexpr, ONE_DOT: tl.constexpr,
):
    """_tile_sums' ``total`` with the BLOCK_K columns from k0 added (INSIDE: the weight's words all
    inside K, loaded without masks)."""
    if OPERAND == 0 and SCALE_COLS == 0:  # FP8_CODES, no block scales
        col = k0 + tl.arange(0, BLOCK_K)[None, :]
        b = _codes(b_ptr, n, N, col, K, b_stride)
        if A_RULE is None:
            a = _codes(a_ptr, m, M, col, K, a_stride)
        else:
            a = _quantized(a_ptr, m, M, col, K, a_stride, quantizing_scale, A_RULE)
        total = tl.dot(b, tl.trans(a), total, max_num_imprecise_acc=min(PROMOTE_EVERY, BLOCK_K))
    elif OPERAND == 1 and MX == 2:
        col = k0 + tl.arange(0, BLOCK_K)[None, :]
        block = k0 // 32 + tl.arange(0, BLOCK_K // 32)[None, :]
        b = _codes(b_ptr, n, N, col, K, b_stride)
        a = _codes(a_ptr, m, M, col, K, a_stride)
        b_scale = _e8m0_bytes(b_scale_ptr, n, N, block, tl.cdiv(K, 32), b_scale_row_stride, b_scale_col_stride)
        a_scale = _e8m0_bytes(a_scale_ptr, m, M, block, tl.cdiv(K, 32), a_scale_row_stride, a_scale_col_stride)
        total = tl.dot_scaled(b, b_scale, B_FORMAT, tl.trans(a), a_scale, A_FORMAT, total)
    elif OPERAND == 0 or MX == 1:  # each block's sum times its two scales joins the accumulator
        for j in tl.static_range(BLOCK_K // SCALE_COLS):
            col = k0 + j * SCALE_COLS + tl.arange(0, SCALE_COLS)[None, :]
            b = _codes(b_ptr, n, N, col, K, b_stride)
            a = _codes(a_ptr, m, M, col, K, a_stride)
            # The scales are loaded before the product so that their latency passes under it:
            # loaded after, they wait for the tensor cores to finish on every block.
            block = k0 // SCALE_COLS + j
            blocks = tl.cdiv(K, SCALE_COLS)
            b_scale = _block_scales(b_scale_ptr, n, N, block, blocks, b_scale_row_stride, b_scale_col_stride, B_SCALE_ROWS, OPERAND == 1)
            a_scale = _block_scales(a_scale_ptr, m, M, block, blocks, a_scale_row_stride, a_scale_col_stride, A_SCALE_ROWS, OPERAND == 1)
            if OPERAND == 0:
                block_sum = tl.dot(b, tl.trans(a), max_num_imprecise_acc=min(PROMOTE_EVERY, SCALE_COLS))
            else:
                block_sum = tl.dot(b.to(tl.float16), tl.trans(a.to(tl.float16)))
            total += block_sum * b_scale * tl.trans(a_scale)
    else:  # MXFP8 and NVFP4 (BF16_VALUES, F16_VALUES): their codes as 64-bit words of WORD
        WORD: tl.constexpr = 8 if OPERAND == 1 else 16
        b_codes, b_scale = _words(b_ptr, b_scale_ptr, n, N, k0, K, b_stride, b_scale_row_stride, b_scale_col_stride, OPERAND, BLOCK_K, INSIDE)
        if ONE_DOT:
            total = tl.dot(_in_order(b_codes, b_scale, OPERAND, ASM), _a_tile(a_ptr, M, K, a_stride, k0, CHUNK, BLOCK_M, BLOCK_K), total)
        else:
            b = _pairs(b_codes, b_scale, OPERAND, ASM)
            if not A_VALUES:
                a_codes, a_scale = _words(a_ptr, a_scale_ptr, m, M, k0, K, a_stride, a_scale_row_stride, a_scale_col_stride, OPERAND, BLOCK_K, False)
                a_t = _pairs(a_codes, a_scale, OPERAND, ASM, TRANSPOSED=True)
            for j in tl.static_range(WORD // 2):
                if A_VALUES:
                    a_j = _a_pair(a_ptr, M, K, a_stride, j, k0 // WORD, CHUNK, WORD, BLOCK_M, BLOCK_K // WORD)
                else:
                    a_j = a_t[j]
                total = tl.dot(b[j], a_j, total)
    return total


@triton.jit
def _tile_sums(
    a_ptr, a_scale_ptr, a_stride, a_scale_row_stride, a_scale_col_stride, b_ptr, b_scale_ptr, b_stride, b_scale_row_stride,
    b_scale_col_stride, n, m, N, M, K, k_start, k_chunks, quantizing_scale, CHUNK: tl.constexpr, OPERAND: tl.constexpr,
    SCALE_COLS: tl.constexpr, A_SCALE_ROWS: tl.constexpr, B_SCALE_ROWS: tl.constexpr, PROMOTE_EVERY: tl.constexpr, MX: tl.constexpr,
    A_FORMAT: tl.constexpr, B_FORMAT: tl.constexpr, ASM: tl.constexpr, WHOLE_TILES: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, A_RULE: tl.constexpr, A_VALUES: tl.constexpr, ONE_DOT: tl.constexpr,
):
    """_decode_kernel's sums of one output tile over one K split: rows ``n`` of B (a column)
    against rows ``m`` of A (a column), over the k_chunks * CHUNK columns from k_start;
    ``quantizing_scale``: the scale A is quantized under as it is loaded (A_RULE), else None.
    Also _expert_tiles_kernel's, whose ``n`` are one expert's rows of a stack. Where NVFP4's
    weight words may pass K (not WHOLE_TILES), the steps wholly inside K load them unmasked and the
    rest, after them, masked: the same sums in the same order. Not MXFP8's, whose tiles ran slower
    so though their main loop is shorter, nor ONE_DOT's 128-row tiles (benchmarks/NOTES.md,
    grouped_decode.py and sass_per_value.py sections)."""
    PEELED: tl.constexpr = not WHOLE_TILES and OPERAND == 2 and not ONE_DOT
    total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    span = k_chunks * CHUNK
    inside, reaching = _steps_in_k(K, k_start, span, BLOCK_K) if PEELED else (span, span)
    for step in range(0, inside, BLOCK_K):  # other operands' columns past K load as zeros
        total = _tile_step(
            total, a_ptr, a_scale_ptr, a_stride, a_scale_row_stride, a_scale_col_stride, b_ptr, b_scale_ptr, b_stride,
            b_scale_row_stride, b_scale_col_stride, n, m, N, M, K, k_start + step, quantizing_scale, CHUNK, OPERAND, SCALE_COLS,
            A_SCALE_ROWS, B_SCALE_ROWS, PROMOTE_EVERY, MX, A_FORMAT, B_FORMAT, ASM, WHOLE_TILES or PEELED, BLOCK_M, BLOCK_N,
            BLOCK_K, A_RULE, A_VALUES, ONE_DOT,
        )
    if PEELED:
        for step in tl.range(inside, reaching, BLOCK_K, num_stages=1):
            total = _tile_step(
                total, a_ptr, a_scale_ptr, a_stride, a_scale_row_stride, a_scale_col_stride, b_ptr, b_scale_ptr, b_stride,
                b_scale_row_stride, b_scale_col_stride, n, m, N, M, K, k_start + step, quantizing_scale, CHUNK, OPERAND, SCALE_COLS,
                A_SCALE_ROWS, B_SCALE_ROWS, PROMOTE_EVERY, MX, A_FORMAT, B_FORMAT, ASM, False, BLOCK_M, BLOCK_N, BLOCK_K, A_RULE,
                A_VALUES, ONE_DOT,
            )
    if OPERAND == 2:
        total = total * 268435456.0  # 2^28: the E2M1 values' 2^-14 (e2m1_block_values) on both sides, undone exactly
    return total


@triton.jit
def _of_gemm(second, third, value, value2, value3, GEMMS: tl.constexpr):
    """Of the values of a launch's first, second and third GEMMs (GEMMS of them), its program's
    GEMM's (``second``, ``third``: whether the program is that GEMM's, _shared_b)."""
    value = tl.where(second, value2, value)
    if GEMMS == 3:
        value = tl.where(third, value3, value)
    return value


@triton.jit
def _shared_b(
    tile, BLOCK_N: tl.constexpr, GEMMS: tl.constexpr, N, b_ptr, b_scale_ptr, b_stride, b_scale_row_stride, b_scale_col_stride,
    N2, b2_ptr, b2_scale_ptr, b2_stride, b2_scale_row_stride, b2_scale_col_stride,
    N3, b3_ptr, b3_scale_ptr, b3_stride, b3_scale_row_stride, b3_scale_col_stride,
):
    """A launch of GEMMS GEMMs' program ``tile`` of the grid's first axis, which takes the first
    GEMM's tiles, then the second's, then the third's: whether it is the second's or the third's,
    its tile there, and that GEMM's rows and B."""
    second_start = tl.cdiv(N, BLOCK_N)
    third_start = second_start + tl.cdiv(N2, BLOCK_N)
    second, third = tile >= second_start, False
    if GEMMS == 3:
        third = tile >= third_start
    return (
        second, third, _of_gemm(second, third, tile, tile - second_start, tile - third_start, GEMMS),
        _of_gemm(second, third, N, N2, N3, GEMMS), _of_gemm(second, third, b_ptr, b2_ptr, b3_ptr, GEMMS),
        _of_gemm(second, third, b_scale_ptr, b2_scale_ptr, b3_scale_ptr, GEMMS), _of_gemm(second, third, b_stride, b2_stride, b3_stride, GEMMS),
        _of_gemm(second, third, b_scale_row_stride, b2_scale_row_stride, b3_scale_row_stride, GEMMS),
        _of_gemm(second, third, b_scale_col_stride, b2_scale_col_stride, b3_scale_col_stride, GEMMS),
    )


@triton.jit
def _write_shared(
    total, n, m, N, M, GEMMS: tl.constexpr, second, third, a_factor_ptr, b_factor_ptr, bias_ptr, out_ptr, partial_ptr, has_bias,
    b2_factor_ptr, bias2_ptr, out2_ptr, partial2_ptr, has_bias2, b3_factor_ptr, bias3_ptr, out3_ptr, partial3_ptr, has_bias3,
    arrivals_ptr, A_FACTOR: tl.constexpr, A_DIVISOR: tl.constexpr, B_FACTOR: tl.constexpr, B_DIVISOR: tl.constexpr,
    SPLIT: tl.constexpr, split, splits, arrival, a_factor=None,
):
    """_write into the factor, bias and output of the program's GEMM of the GEMMS (_shared_b: a
    bias may differ from another's in dtype, so each GEMM writes in a branch of its own). The
    branches are static apart from GEMMS: a lone GEMM's later arguments are None."""
    if GEMMS == 3 and third:
        _write(
            total, n, m, N, M, a_factor_ptr, b3_factor_ptr, bias3_ptr, out3_ptr, partial3_ptr, arrivals_ptr, A_FACTOR, A_DIVISOR,
            B_FACTOR, B_DIVISOR, has_bias3, SPLIT, split, splits, arrival, a_factor,
        )
    elif GEMMS > 1 and second:
        _write(
            total, n, m, N, M, a_factor_ptr, b2_factor_ptr, bias2_ptr, out2_ptr, partial2_ptr, arrivals_ptr, A_FACTOR, A_DIVISOR,
            B_FACTOR, B_DIVISOR, has_bias2, SPLIT, split, splits, arrival, a_factor,
        )
    else:
        _write(
            total, n, m, N, M, a_factor_ptr, b_factor_ptr, bias_ptr, out_ptr, partial_ptr, arrivals_ptr, A_FACTOR, A_DIVISOR,
            B_FACTOR, B_DIVISOR, has_bias, SPLIT, split, splits, arrival, a_factor,
        )


@triton.jit
def _fma_row_step(
    sums, a_ptr, a_scale_ptr, a_stride, a_scale_row_stride, a_scale_col_stride, b_ptr, b_scale_ptr, b_stride, b_scale_row_stride,
    b_scale_col_stride, n, m, N, M, K, k0, OPERAND: tl.constexpr, ASM: tl.constexpr, INSIDE: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """_fma_row_sums' ``sums`` with the BLOCK_K columns from k0 added (INSIDE: all inside K, no masks)."""
    runs: tl.constexpr = BLOCK_K // 32  # a run: an MXFP8 block, or two NVFP4 blocks
    if OPERAND == 1:  # MXFP8
        block = k0 // 32 + tl.arange(0, runs)[:, None, None]
        b_codes, b_scale = _mxfp8_blocks(b_ptr, b_scale_ptr, n, N, block, K // 32, b_stride, b_scale_row_stride, b_scale_col_stride, INSIDE)
        a_codes, a_scale = _mxfp8_blocks(a_ptr, a_scale_ptr, m, M, block, K // 32, a_stride, a_scale_row_stride, a_scale_col_stride, INSIDE)
        b = e4m3_word_values(b_codes, ASM)
        a = e4m3_word_values(a_codes, ASM)
        products = b[0] * (a[0] * a_scale)
        for j in tl.static_range(1, 8):
            products += b[j] * (a[j] * a_scale)
        sums += tl.sum(products, axis=2, keep_dims=True) * b_scale
    else:  # NVFP4
        word = k0 // 16 + tl.arange(0, runs)[:, None, None] * 2 + tl.arange(0, 2)[None, None, :]
        b_codes, b_scale = _nvfp4_blocks(b_ptr, b_scale_ptr, n, N, word, K // 16, b_stride, b_scale_row_stride, b_scale_col_stride, INSIDE)
        a_codes, a_scale = _nvfp4_blocks(a_ptr, a_scale_ptr, m, M, word, K // 16, a_stride, a_scale_row_stride, a_scale_col_stride, INSIDE)
        a = e2m1_pairs(a_codes, ASM)
        sums += e2m1_block_dot(b_codes, a, ASM) * (b_scale.to(tl.float32) * a_scale.to(tl.float32))
    return sums


@triton.jit
def _fma_row_sums(
    a_ptr, a_scale_ptr, a_stride, a_scale_row_stride, a_scale_col_stride, b_ptr, b_scale_ptr, b_stride, b_scale_row_stride,
    b_scale_col_stride, n, m, N, M, K, k_start, k_chunks, CHUNK: tl.constexpr, OPERAND: tl.constexpr, ASM: tl.constexpr,
    WHOLE_TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
):
    """_fma_kernel's sums of row ``m`` of A ((1, 1, 1)) against rows ``n`` of B ((1, BLOCK_N, 1))
    over the k_chunks * CHUNK columns from k_start, (BLOCK_N, 1); also one token's against its
    expert's rows of a stack (_expert_rows_kernel). Where a tile may pass K (not WHOLE_TILES), the
    steps wholly inside K run unmasked and the rest after them masked, in the same order."""
    sums = tl.zeros((BLOCK_K // 32, BLOCK_N, 1 if OPERAND == 1 else 2), dtype=tl.float32)
    span = k_chunks * CHUNK
    inside, reaching = (span, span) if WHOLE_TILES else _steps_in_k(K, k_start, span, BLOCK_K)
    # Copied ahead STAGES - 1 steps (asynchronously, through shared memory): no dot here to make
    # Triton pipeline the loop by itself.
    for step in tl.range(0, inside, BLOCK_K, num_stages=STAGES):
        sums = _fma_row_step(
            sums, a_ptr, a_scale_ptr, a_stride, a_scale_row_stride, a_scale_col_stride, b_ptr, b_scale_ptr, b_stride,
            b_scale_row_stride, b_scale_col_stride, n, m, N, M, K, k_start + step, OPERAND, ASM, True, BLOCK_K,
        )
    if not WHOLE_TILES:
        for step in tl.range(inside, reaching, BLOCK_K, num_stages=1):
            sums = _fma_row_step(
                sums, a_ptr, a_scale_ptr, a_stride, a_scale_row_stride, a_scale_col_stride, b_ptr, b_scale_ptr, b_stride,
                b_scale_row_stride, b_scale_col_stride, n, m, N, M, K, k_start + step, OPERAND, ASM, False, BLOCK_K,
            )
    total = tl.reshape(tl.sum(tl.sum(sums, axis=2), axis=0), (BLOCK_N, 1))
    if OPERAND == 2:
        total = total * 16384.0  # 2^14: e2m1_block_dot's 2^-14, undone exactly
    return total


# M and has_bias stay runtime values (not specialized when 1), so that every row count and both
# bias cases share one compiled kernel per format and tiling; so does every K split, given as its
# number of CHUNK columns (k_chunks): a split's columns start at a multiple of CHUNK the compiler
# sees, so that its loads (codes and scales) are aligned, vectorized and pipelined.
@triton.jit(do_not_specialize=["M", "has_bias", "k_chunks", "has_bias2", "has_bias3"])
def _decode_kernel(
    a_ptr, a_scale_ptr, a_factor_ptr, a_stride, a_scale_row_stride, a_scale_col_stride,
    b_ptr, b_scale_ptr, b_factor_ptr, b_stride, b_scale_row_stride, b_scale_col_stride,
    bias_ptr, has_bias, out_ptr, partial_ptr, arrivals_ptr, M, N, K, k_chunks, CHUNK: tl.constexpr,
    OPERAND: tl.constexpr, SCALE_COLS: tl.constexpr, A_SCALE_ROWS: tl.constexpr, B_SCALE_ROWS: tl.constexpr,
    A_FACTOR: tl.constexpr, A_DIVISOR: tl.constexpr, B_FACTOR: tl.constexpr, B_DIVISOR: tl.constexpr,
    SPLIT: tl.constexpr, PROMOTE_EVERY: tl.constexpr, MX: tl.constexpr, A_FORMAT: tl.constexpr, B_FORMAT: tl.constexpr,
    ASM: tl.constexpr, WHOLE_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, A_RULE: tl.constexpr = None, A_VALUES: tl.constexpr = False,
    ONE_DOT: tl.constexpr = False, GEMMS: tl.constexpr = 1, DEPENDENT: tl.constexpr = False,
    b2_ptr=None, b2_scale_ptr=None, b2_factor_ptr=None, b2_stride=0, b2_scale_row_stride=0, b2_scale_col_stride=0,
    bias2_ptr=None, has_bias2=0, out2_ptr=None, partial2_ptr=None, N2=0,
    b3_ptr=None, b3_scale_ptr=None, b3_factor_ptr=None, b3_stride=0, b3_scale_row_stride=0, b3_scale_col_stride=0,
    bias3_ptr=None, has_bias3=0, out3_ptr=None, partial3_ptr=None, N3=0,
):
    """Program (i, s, j): the sums over the s-th k_chunks * CHUNK columns of BLOCK_N rows of B
    against BLOCK_M rows of A, finished into out where K is not SPLIT, else reduced by _write.
    The weight tile is the dot's left operand (A's rows are the short side, the MMA's N). MX,
    MXFP8's products (the index
    of DecodeConfig.mx_products): 1, codes multiplied as fp16 (exact) a 32-block at a time, each
    block's sum times its two power-of-two scales (exact in fp32's normal range); 2, the codes
    (A_FORMAT, B_FORMAT) and E8M0 scales handed to tl.dot_scaled. NVFP4's strides are counted in
    16-code blocks (8 bytes), which it reads as 64-bit words and decodes by inline PTX where ASM
    (not in Triton's interpreter), its weight tiles unmasked where WHOLE_TILES (every one lies
    inside the weight). A_RULE (QuantizedOnLoad.rule): A is high precision, FP8-quantized as it is
    loaded under the scale (per tensor or per row) that rule makes from the amaxes of A's rows,
    which stand in A's factor at a_factor_ptr. A_VALUES: MXFP8's or NVFP4's A decoded first
    (_a_values_kernel), its stride in values; ONE_DOT: in K's own order, as the weight's step is
    decoded then, one dot a step. GEMMS: the launch runs that many GEMMs (up to SHARED_LAUNCH) of
    the same A (FP8 codes) and kind of B, the second's and third's own arguments those named 2
    (b2_ptr to N2) and 3: the grid's first axis takes the first GEMM's tiles, then the second's,
    then the third's, all K-split alike, so that each output is its rows of one GEMM over the B's
    stacked, bit for bit."""
    second, third, tile, rows = False, False, tl.program_id(0), N
    if GEMMS > 1:  # the B and rows of this program's tile: its GEMM's
        second, third, tile, rows, b_ptr, b_scale_ptr, b_stride, b_scale_row_stride, b_scale_col_stride = _shared_b(
            tile, BLOCK_N, GEMMS, N, b_ptr, b_scale_ptr, b_stride, b_scale_row_stride, b_scale_col_stride,
            N2, b2_ptr, b2_scale_ptr, b2_stride, b2_scale_row_stride, b2_scale_col_stride,
            N3, b3_ptr, b3_scale_ptr, b3_stride, b3_scale_row_stride, b3_scale_col_stride,
        )
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    wait_for_the_kernel_before(DEPENDENT)
    a_scale = _a_scale(a_factor_ptr, m, M, A_FACTOR, A_RULE)
    total = _tile_sums(
        a_ptr, a_scale_ptr, a_stride, a_scale_row_stride, a_scale_col_stride, b_ptr, b_scale_ptr, b_stride, b_scale_row_stride,
        b_scale_col_stride, n, m, rows, M, K, tl.program_id(1) * k_chunks * CHUNK, k_chunks, a_scale, CHUNK, OPERAND, SCALE_COLS,
        A_SCALE_ROWS, B_SCALE_ROWS, PROMOTE_EVERY, MX, A_FORMAT, B_FORMAT, ASM, WHOLE_TILES, BLOCK_M, BLOCK_N, BLOCK_K, A_RULE,
        A_VALUES, ONE_DOT,
    )
    m_row = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    a_factor = reciprocal(a_scale) if A_RULE is not None else None  # A's factor, as A was quantized
    split, splits, arrival = tl.program_id(1), tl.num_programs(1), tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
    _write_shared(
        total, n, m_row, rows, M, GEMMS, second, third, a_factor_ptr, b_factor_ptr, bias_ptr, out_ptr, partial_ptr, has_bias,
        b2_factor_ptr, bias2_ptr, out2_ptr, partial2_ptr, has_bias2, b3_factor_ptr, bias3_ptr, out3_ptr, partial3_ptr, has_bias3,
        arrivals_ptr, A_FACTOR, A_DIVISOR, B_FACTOR, B_DIVISOR, SPLIT, split, splits, arrival, a_factor,
    )


_autotuned = triton.autotune(
    configs=[triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s) for n, k, w, s in AUTOTUNED_TILES],
    key=["N", "K", "k_chunks", "OPERAND", "SCALE_COLS", "SPLIT", "N2", "N3"],
)(_decode_kernel)


@triton.jit(do_not_specialize=["M", "has_bias", "k_chunks", "has_bias2", "has_bias3"])  # as _decode_kernel
def _fma_kernel(
    a_ptr, a_scale_ptr, a_factor_ptr, a_stride, a_scale_row_stride, a_scale_col_stride,
    b_ptr, b_scale_ptr, b_factor_ptr, b_stride, b_scale_row_stride, b_scale_col_stride,
    bias_ptr, has_bias, out_ptr, partial_ptr, arrivals_ptr, M, N, K, k_chunks, CHUNK: tl.constexpr,
    OPERAND: tl.constexpr, A_FACTOR: tl.constexpr, A_DIVISOR: tl.constexpr, B_FACTOR: tl.constexpr, B_DIVISOR: tl.constexpr,
    SPLIT: tl.constexpr, ASM: tl.constexpr, WHOLE_TILES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr, GEMMS: tl.constexpr = 1, DEPENDENT: tl.constexpr = False,
    b2_ptr=None, b2_scale_ptr=None, b2_factor_ptr=None, b2_stride=0, b2_scale_row_stride=0, b2_scale_col_stride=0,
    bias2_ptr=None, has_bias2=0, out2_ptr=None, partial2_ptr=None, N2=0,
    b3_ptr=None, b3_scale_ptr=None, b3_factor_ptr=None, b3_stride=0, b3_scale_row_stride=0, b3_scale_col_stride=0,
    bias3_ptr=None, has_bias3=0, out3_ptr=None, partial3_ptr=None, N3=0,
):
    """_decode_kernel's program for MXFP8 and NVFP4 on the FMA units, one row of A (program
    (i, s, j) takes row j): the codes read as 64-bit words (8 E4M3 or 16 E2M1 codes; strides
    counted in words), decoded exactly (by inline PTX where ASM) and multiplied. A tile is (runs
    of words, weight rows, words of a run): a run (two NVFP4 blocks, or one MXFP8 block of four
    words) is contiguous, and the runs go to a warp's threads first and the weight rows to each
    thread's registers, so that a thread decodes A's words once for all its rows. NVFP4: each
    word's 16 products of unscaled codes summed exactly (e2m1_block_dot: two an f16x2 fma), times
    both blocks' scales (exact), into one partial sum per (run, row, word); MXFP8: A's values
    times their scale (exact), each block's 32 products summed in fp32, then times the weight's
    power-of-two scale (exact in fp32's normal range) into one partial sum per (run, row). All
    summed at the end. WHOLE_TILES: every tile lies inside both operands (no masks). GEMMS: as
    _decode_kernel's, GEMMs of the same A."""
    second, third, tile = False, False, tl.program_id(0)
    if GEMMS > 1:
        second, third, tile, N, b_ptr, b_scale_ptr, b_stride, b_scale_row_stride, b_scale_col_stride = _shared_b(
            tile, BLOCK_N, GEMMS, N, b_ptr, b_scale_ptr, b_stride, b_scale_row_stride, b_scale_col_stride,
            N2, b2_ptr, b2_scale_ptr, b2_stride, b2_scale_row_stride, b2_scale_col_stride,
            N3, b3_ptr, b3_scale_ptr, b3_stride, b3_scale_row_stride, b3_scale_col_stride,
        )
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)[None, :, None]
    m = tl.program_id(2) + tl.zeros((1, 1, 1), tl.int32)
    wait_for_the_kernel_before(DEPENDENT)
    total = _fma_row_sums(
        a_ptr, a_scale_ptr, a_stride, a_scale_row_stride, a_scale_col_stride, b_ptr, b_scale_ptr, b_stride, b_scale_row_stride,
        b_scale_col_stride, n, m, N, M, K, tl.program_id(1) * k_chunks * CHUNK, k_chunks, CHUNK, OPERAND, ASM, WHOLE_TILES,
        BLOCK_N, BLOCK_K, STAGES,
    )
    _write_shared(
        total, tile * BLOCK_N + tl.arange(0, BLOCK_N)[:, None], tl.program_id(2) + tl.zeros((1, 1), tl.int32), N, M, GEMMS, second,
        third, a_factor_ptr, b_factor_ptr, bias_ptr, out_ptr, partial_ptr, has_bias, b2_factor_ptr, bias2_ptr, out2_ptr, partial2_ptr,
        has_bias2, b3_factor_ptr, bias3_ptr, out3_ptr, partial3_ptr, has_bias3, arrivals_ptr, A_FACTOR, A_DIVISOR, B_FACTOR,
        B_DIVISOR, SPLIT, tl.program_id(1), tl.num_programs(1), tl.program_id(2) * tl.num_programs(0) + tl.program_id(0),
    )


class QuantizedOnLoad(NamedTuple):
    """A, (m, k) in high precision, for the kernels to quantize rowwise as ``quantizer`` does
    (QUANTIZING_BACKEND): per tensor or per row as they load it, ``amax`` (m, chunks) holding the
    amax of each chunk of each row (fp8.row_chunk_amax), one reduction the graph fuses into A's
    producer; the kernels take the max of a row's (a per-row format's amax) or of all (a
    per-tensor one's) and make the scale from it by the format's rule. All of A's rows lie in one
    tile of rows of the kernels (m is at most ONE_TILE_ROWS). 1x128 blocks take none (``amaxes``):
    the kernel that quantizes them before the GEMM takes each block's (_block_codes_kernel)."""

    data: torch.Tensor
    amax: torch.Tensor
    quantizer: Quantizer

    @property
    def direction(self) -> str:
        return ROWWISE

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.data.shape[1])

    @property
    def stored_k_last(self) -> bool:
        return True

    @property
    def rule(self) -> tuple[str, float, float, bool, int, int]:
        """How _decode_kernel quantizes A (A_RULE): (the element, its largest finite value,
        amax_epsilon, pow2_scales, the chunks of a row in ``amax`` and the power of two past them)."""
        return _rule(self.quantizer, self.amax.shape[1])


@functools.lru_cache(maxsize=None)
def _rule(quantizer: Quantizer, chunks: int) -> tuple[str, float, float, bool, int, int]:
    """QuantizedOnLoad.rule, made once per quantizer and chunk count (a decode call's host time counts)."""
    encoding = quantizer.kernel_encoding(ROWWISE)
    element, pow2 = encoding.element, bool(encoding.pow2_scales)
    return (element, fp8.fp8_max(element), float(encoding.amax_epsilon), pow2, chunks, triton.next_power_of_2(max(chunks, 1)))


@functools.lru_cache(maxsize=None)
def quantize_on_load_refusal(quantizer: Quantizer) -> str:
    """Why the kernels cannot quantize A rowwise as ``quantizer`` does ("" where they can): FP8
    current scaling per tensor, per row or per 1x128 block, from the amax of this tensor alone;
    MXFP8 and NVFP4 are quantized first (MEASURED_SLOWER)."""
    encoding = quantizer.kernel_encoding(ROWWISE)
    if encoding is not None and encoding.scaling in MEASURED_SLOWER:
        return f"the decode GEMM quantizing {encoding.scaling} activations itself was measured slower than quantizing them first"
    if encoding is None or (encoding.scaling, encoding.block) not in QUANTIZED_ON_LOAD or encoding.transposed:
        return f"the decode GEMM quantizes A itself in FP8 current scaling per {', '.join(QUANTIZED_ON_LOAD.values())}, not {quantizer}"
    if encoding.delayed_scaling or quantizer.reduces_amax:
        return f"the decode GEMM quantizes A itself from the amax of A alone, not {quantizer}'s"
    return ""


def amaxes(x: torch.Tensor, quantizer: Quantizer) -> torch.Tensor:
    """What QuantizedOnLoad takes as ``amax`` for 2-D ``x`` in ``quantizer``'s format: the amaxes
    of x's rows in chunks (fp8.row_chunk_amax), or none ((m, 0)) for 1x128 blocks, whose kernel
    takes each block's own."""
    if quantizer.kernel_encoding(ROWWISE).scaling == "block":
        return x.new_empty((x.shape[0], 0), dtype=torch.float32)
    return fp8.row_chunk_amax(x)


@functools.lru_cache(maxsize=None)
def quantizes_first(quantizer: Quantizer) -> bool:
    """Whether the kernels quantize an A in ``quantizer``'s format by a kernel of its own before
    the GEMM (``block_codes``: 1x128 blocks), not as they load it. A graph runs it as an op of its
    own (graphquant::block_codes), so that the GEMMs that read one A share its codes."""
    encoding = quantizer.kernel_encoding(ROWWISE)
    return encoding is not None and (encoding.scaling, encoding.block) == ("block", (1, 128))


def block_codes(x: torch.Tensor, quantizer: Quantizer) -> Representation:
    """2-D ``x``'s 1x128 blocks quantized rowwise by _block_codes_kernel: ``quantizer``'s
    representation, bit for bit the reference's."""
    m, k = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    blocks = ceil_div(k, 128)
    rule = _rule(quantizer, 0)
    codes = torch.empty((m, k), dtype=fp8.FP8_DTYPES[rule[0]], device=x.device)
    scale = torch.empty((blocks, m), dtype=torch.float32, device=x.device)
    launch(_block_codes_kernel, (m, ceil_div(blocks, 8)), x, codes, scale, m, k, x.stride(0), RULE=rule, BLOCKS=8)
    return quantizer.representation(ROWWISE, (m, k), x.dtype, codes, scale.t())


def _layout(rep: Representation, operand: str) -> _Layout:
    gemm_input = rep.quantizer.gemm_input(rep.direction)
    family = None if gemm_input is None else gemm_input.family
    if family not in LAYOUTS:
        raise ValueError(
            f"the decode GEMM reads operands of the families {sorted(LAYOUTS)}; {operand} is {rep.quantizer} "
            f"({rep.direction}), of family {family}"
        )
    if not rep.stored_k_last:
        raise ValueError(
            f"the decode GEMM reads operands stored with the reduction dim last; {operand} is {rep.quantizer} "
            f"({rep.direction}), stored with it first"
        )
    return LAYOUTS[family]


def _operand(rep: Representation, operand: str) -> tuple[_Layout, tuple]:
    """(layout, pointer and stride arguments) of one operand of _decode_kernel."""
    layout = _layout(rep, operand)
    data = rep.data if rep.data.stride(-1) == 1 else rep.data.contiguous()
    scale = rep.scale if layout.scale_block != (0, 0) else data
    factor = (rep.amax if layout.factor_from_amax or isinstance(rep, QuantizedOnLoad) else rep.scale) if layout.factor else data
    if layout.factor == ROW_FACTOR or isinstance(rep, QuantizedOnLoad):  # (rows,) or (rows, chunks), contiguous
        factor = factor.reshape(-1).contiguous()
    scale_strides = scale.stride() if scale is not data else (0, 0)
    return layout, (data, scale, factor, data.stride(0), *scale_strides)


def _in_words(args: tuple) -> tuple:
    """An operand's arguments (_operand) with its data read as 64-bit words: its row stride in
    words, its data copied where it is not aligned to them (zeros past its columns: a word's
    codes past K are multiplied with the block's scale)."""
    data, *rest = args
    if data.data_ptr() % 16 or data.stride(0) % 8:
        data = torch.zeros((data.shape[0], ceil_div(data.shape[1], 16) * 16), dtype=data.dtype, device=data.device)[:, : data.shape[1]].copy_(args[0])
    return (data, *rest[:2], data.stride(0) // 8, *rest[3:])


def _a_values(args: tuple, m: int, k: int, operand: int, one_dot: bool) -> tuple:
    """MXFP8's or NVFP4's A (its arguments in words, _in_words) decoded by _a_values_kernel: the
    same arguments with the values (bf16 or fp16, as the kernels decode them: MXFP8's fp32 in
    Triton's interpreter) in place of the codes, their row stride in values."""
    data, scale, factor, stride_words, *scale_strides = args
    padded = ceil_div(k, K_CHUNK) * K_CHUNK  # values a row: every pair's words, padded (_padded_words)
    dtype = torch.float16 if operand == F16_VALUES else torch.float32 if triton.knobs.runtime.interpret else torch.bfloat16
    values = torch.empty((m, padded), dtype=dtype, device=data.device)
    launch(
        _a_values_kernel, (ceil_div(m, 16), padded // (16 * (8 if operand == BF16_VALUES else 16))),
        data, scale, values, m, k, stride_words, *scale_strides, values.stride(0),
        OPERAND=operand, ASM=not triton.knobs.runtime.interpret, ONE_DOT=one_dot, CHUNK=K_CHUNK, BLOCK_R=16, WORDS=16,
    )
    return (values, scale, factor, values.stride(0), *scale_strides)


# The least BLOCK_K of MXFP8's and NVFP4's pair operands on the tensor cores: each of a step's 4
# or 8 dots takes BLOCK_K / 4 or / 8 of K, and a dot at least 16.
_LEAST_PAIRS_BLOCK_K = {BF16_VALUES: 64, F16_VALUES: 128}


def _check_tiling(config: DecodeConfig, operand: int, families: tuple[str, str]) -> None:
    """Raise where ``config`` cannot multiply the weight's ``operand`` (families: A's and B's)."""
    if operand == FP8_CODES and (config.fma or config.a_first):
        raise ValueError(f"the decode GEMM multiplies FP8 codes on the tensor cores only, as they load; got {config} for {families}")
    pairs = not config.fma and not config.one_dot and config.mx_products == "values"
    if operand in _LEAST_PAIRS_BLOCK_K and pairs and config.block_k < _LEAST_PAIRS_BLOCK_K[operand]:
        raise ValueError(
            f"the decode GEMM's {families[1]} pair operands take block_k >= {_LEAST_PAIRS_BLOCK_K[operand]} "
            f"(each of a step's dots at least 16 deep); got {config}"
        )


def _factors(a: _Layout, b: _Layout) -> dict:
    """The factor constexprs of A and B of these layouts, as the kernels take them."""
    return {"A_FACTOR": a.factor, "A_DIVISOR": a.divisor, "B_FACTOR": b.factor, "B_DIVISOR": b.divisor}


def split_k(n: int, k: int, device: torch.device, tiles_per_sm: int = 2, block_n: int = 64, row_tiles: int = 1) -> int:
    """How many programs share each tile's K: enough for about ``tiles_per_sm`` programs per SM
    (each BLOCK_N rows of B against a tile of A's rows), each split at least K_CHUNK columns."""
    sms = devices.multiprocessors(device)
    wanted = ceil_div(tiles_per_sm * sms, ceil_div(n, block_n) * row_tiles)
    return max(1, min(wanted, ceil_div(k, K_CHUNK)))


def gemm(
    a: Representation | QuantizedOnLoad, b: Representation, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None,
    config: Optional[DecodeConfig] = None,
) -> torch.Tensor:
    """(m, n) = A @ B^T (+ bias), both operands stored with the reduction dim last, A quantized or
    to be quantized here (QuantizedOnLoad); ``config``: the tiling, or None for default_config's
    (then m at most the pair's MAX_ROWS)."""
    a, rule = _a_as_read(a, config)
    m, n, k = gemm_dims(a, b)
    (a_layout, a_args), (b_layout, b_args) = _operand(a, "A"), _operand(b, "B")
    families = _families(a, b, m, config)
    config = config or default_config(b_layout.operand, m)
    if config is not None:
        _check_tiling(config, b_layout.operand, families)
    block_m = config.block_m if config else ONE_TILE_ROWS
    row_tiles = ceil_div(m, block_m)
    splits, k_chunks = _k_split(n, k, a.data.device, config, row_tiles)
    ends = _ends(bias, torch.empty((m, n), dtype=out_dtype, device=a.data.device), splits)
    out = arrivals = ends[2]  # no counters where K is not split
    if splits > 1:
        block_n = config.block_n if config else min(tile[0] for tile in AUTOTUNED_TILES)
        arrivals = arrival_counters.zeroed(out.device, ceil_div(n, block_n) * row_tiles)
    factors = _factors(a_layout, b_layout)
    # NVFP4's codes, and MXFP8's as values (on the tensor cores or the FMA units), are read as
    # 64-bit words (strides in words), decoded by inline PTX except in Triton's interpreter,
    # which runs none; unmasked where every weight tile lies inside the weight.
    in_words = config is not None and b_layout.operand != FP8_CODES and (config.fma or config.mx_products == "values")
    if in_words:
        a_args, b_args = _in_words(a_args), _in_words(b_args)
    a_first = config is not None and config.a_first and b_layout.operand != FP8_CODES
    if a_first:
        a_args = _a_values(a_args, m, k, b_layout.operand, config.one_dot)
    asm = not triton.knobs.runtime.interpret
    whole_tiles = in_words and k % (k_chunks * K_CHUNK) == 0 and n % config.block_n == 0
    if config is None:
        _launch_autotuned(
            lambda meta: (ceil_div(n, meta["BLOCK_N"]), splits, row_tiles), a_layout, a_args, b_layout,
            (*b_args, *ends), arrivals, m, n, k, k_chunks, splits > 1, rule,
        )
    elif config.fma:
        _launch_fma(config, (ceil_div(n, config.block_n), splits, row_tiles), a_args, b_layout, b_args, ends, arrivals, m, n, k, k_chunks,
                    factors, whole_tiles)
    else:
        launch(
            _decode_kernel, (ceil_div(n, config.block_n), splits, row_tiles),
            *a_args, *b_args, *ends, arrivals, m, n, k, k_chunks, K_CHUNK,
            OPERAND=b_layout.operand, SCALE_COLS=b_layout.scale_block[1],
            A_SCALE_ROWS=max(a_layout.scale_block[0], 1), B_SCALE_ROWS=max(b_layout.scale_block[0], 1),
            **factors, SPLIT=splits > 1, PROMOTE_EVERY=fp8.PROMOTED_PRODUCTS,
            MX=MX_PRODUCTS.index(config.mx_products) if b_layout.operand == BF16_VALUES else 0, A_FORMAT=_ELEMENT_FORMATS.get(a.data.dtype, ""),
            B_FORMAT=_ELEMENT_FORMATS.get(b.data.dtype, ""), ASM=asm, WHOLE_TILES=whole_tiles,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, A_RULE=rule, A_VALUES=a_first,
            ONE_DOT=a_first and config.one_dot,
            num_warps=config.warps, num_stages=config.stages, **dependent_launch(a.data.device),
        )
    return out


def gemms_sharing_a(
    a: Representation | QuantizedOnLoad, bs: Sequence[Representation], out_dtype: torch.dtype, biases: Sequence[Optional[torch.Tensor]],
) -> list[torch.Tensor]:
    """[A @ B^T (+ bias) for each B and bias], for one to SHARED_LAUNCH B's that read one A (a
    SwiGLU's gate and up projections, an attention layer's q, k and v): several run in one launch
    of _decode_kernel (GEMMS) whose grid covers all their weights' tiles, K split once for all
    their rows, so that the outputs are, bit for bit, ``gemm`` of A and the B's stacked (one B of
    all their rows), split apart. All B's of one layout family of FP8 codes (SHARED_FAMILIES) and
    one element, A at most one tile of rows (MAX_ROWS), as ``gemm`` takes them with no config; or
    of MXFP8 against one row of A (ONE_ROW_SHARED_FAMILIES: _fma_kernel's GEMMS, under the one-row
    tiling)."""
    if len(bs) != len(biases) or not 1 <= len(bs) <= SHARED_LAUNCH:
        raise ValueError(
            f"the decode GEMM runs one to {SHARED_LAUNCH} GEMMs that read one A in a launch, each with its bias or None; "
            f"got {len(bs)} B's and {len(biases)} biases"
        )
    if len(bs) == 1:
        return [gemm(a, bs[0], out_dtype, biases[0])]
    a, rule = _a_as_read(a, None)
    (a_layout, a_args), operands = _operand(a, "A"), [_operand(b, "B") for b in bs]
    kinds = [(b.quantizer.gemm_input(b.direction).family, b.data.dtype) for b in bs]
    dims = [gemm_dims(a, b) for b in bs]
    (m, _, k), rows = dims[0], [n for _, n, _ in dims]
    if len(set(kinds)) > 1 or not shares_launch(kinds[0][0], m):
        got = ", ".join(f"{b.quantizer} ({kind})" for b, kind in zip(bs, kinds))
        raise ValueError(
            f"the decode GEMM runs GEMMs in one launch where all B's are of one family of {SHARED_FAMILIES} "
            f"(or of {ONE_ROW_SHARED_FAMILIES} against one row of A) and one element dtype; got {got} against {m} rows"
        )
    if any(reduced_extent(b.direction, b.shape) != k for b in bs):
        raise ValueError(f"the B's of one A reduce over its {k} columns; got B's of shapes {[tuple(b.shape) for b in bs]}")
    _families(a, bs[0], m, None)
    if kinds[0][0] not in SHARED_FAMILIES:
        return _one_row_shared(a_layout, a_args, operands, out_dtype, biases, rows, k)
    row_tiles = ceil_div(m, ONE_TILE_ROWS)
    splits, k_chunks = _k_split(sum(rows), k, a.data.device, None, row_tiles)
    ends = [_ends(bias, torch.empty((m, n), dtype=out_dtype, device=a.data.device), splits) for bias, n in zip(biases, rows)]
    least_block_n = min(tile[0] for tile in AUTOTUNED_TILES)
    arrivals = arrival_counters.zeroed(a.data.device, _tiles(rows, least_block_n) * row_tiles)
    _launch_autotuned(
        lambda meta: (_tiles(rows, meta["BLOCK_N"]), splits, row_tiles), a_layout, a_args, operands[0][0],
        (*operands[0][1], *ends[0]), arrivals, m, rows[0], k, k_chunks, splits > 1, rule,
        **_later_gemms([args for _, args in operands[1:]], ends[1:], rows[1:]),
    )
    return [out for _, _, out, _ in ends]


def _one_row_shared(
    a_layout: _Layout, a_args: tuple, operands: list, out_dtype: torch.dtype, biases: Sequence[Optional[torch.Tensor]],
    rows: list[int], k: int,
) -> list[torch.Tensor]:
    """gemms_sharing_a's GEMMs of one row of A (ONE_ROW_SHARED_FAMILIES): one launch of
    _fma_kernel's GEMMS under the one-row tiling, K split once for all their weights' rows."""
    b_layout = operands[0][0]
    config = _ONE_ROW[b_layout.operand]
    device = a_args[0].device
    splits, k_chunks = _k_split(sum(rows), k, device, config, 1)
    ends = [_ends(bias, torch.empty((1, n), dtype=out_dtype, device=device), splits) for bias, n in zip(biases, rows)]
    tiles = _tiles(rows, config.block_n)
    arrivals = arrival_counters.zeroed(device, tiles) if splits > 1 else ends[0][2]
    whole_tiles = k % (k_chunks * K_CHUNK) == 0 and all(n % config.block_n == 0 for n in rows)
    b_args = [_in_words(args) for _, args in operands]
    _launch_fma(
        config, (tiles, splits, 1), _in_words(a_args), b_layout, b_args[0], ends[0], arrivals, 1, rows[0], k, k_chunks,
        _factors(a_layout, b_layout), whole_tiles, **_later_gemms(b_args[1:], ends[1:], rows[1:]),
    )
    return [out for _, _, out, _ in ends]


def _launch_fma(
    config: DecodeConfig, grid: tuple, a_args: tuple, b_layout: _Layout, b_args: tuple, ends: tuple, arrivals: torch.Tensor,
    m: int, n: int, k: int, k_chunks: int, factors: dict, whole_tiles: bool, **later,
) -> None:
    """One launch of _fma_kernel under ``config`` (operands read as words: _in_words); ``later``:
    its later GEMMs' arguments (_later_gemms)."""
    launch(
        _fma_kernel, grid, *a_args, *b_args, *ends, arrivals, m, n, k, k_chunks, K_CHUNK, OPERAND=b_layout.operand,
        **factors, SPLIT=grid[1] > 1, ASM=not triton.knobs.runtime.interpret, WHOLE_TILES=whole_tiles, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, STAGES=config.stages, **later,
        num_warps=config.warps, num_stages=config.stages, **dependent_launch(a_args[0].device),
    )


def _tiles(rows: Sequence[int], block_n: int) -> int:
    """The grid's first axis for GEMMs of weights of these ``rows``, each in tiles of block_n rows."""
    return sum(ceil_div(n, block_n) for n in rows)


# _decode_kernel's and _fma_kernel's arguments of a launch's second GEMM and third (GEMMS), each in
# the order of the first's (_operand, _ends), then its rows.
_LATER_GEMMS_ARGUMENTS = tuple(
    tuple(
        name.format(i) for name in (
            "b{}_ptr", "b{}_scale_ptr", "b{}_factor_ptr", "b{}_stride", "b{}_scale_row_stride", "b{}_scale_col_stride",
            "bias{}_ptr", "has_bias{}", "out{}_ptr", "partial{}_ptr", "N{}",
        )
    )
    for i in (2, 3)
)


def _later_gemms(b_args: Sequence[tuple], ends: Sequence[tuple], rows: Sequence[int]) -> dict:
    """The kernels' GEMMS and the arguments of a launch's later GEMMs (_LATER_GEMMS_ARGUMENTS)
    from each one's B (_operand's arguments), ends (_ends) and rows."""
    later = {"GEMMS": 1 + len(rows)}
    for names, b, end, n in zip(_LATER_GEMMS_ARGUMENTS, b_args, ends, rows):
        later.update(zip(names, (*b, *end, n), strict=True))
    return later


def _ends(bias: Optional[torch.Tensor], out: torch.Tensor, splits: int) -> tuple:
    """A GEMM's arguments after its B's: its bias (its output where it has none), whether it has
    one, its output, and where its K splits' partial sums go (its output where K is not split)."""
    partial = torch.empty(splits * out.numel(), dtype=torch.float32, device=out.device) if splits > 1 else out
    return (out if bias is None else bias.contiguous(), int(bias is not None), out, partial)


def _a_as_read(
    a: Representation | QuantizedOnLoad, config: Optional[DecodeConfig]
) -> tuple[Representation | QuantizedOnLoad, Optional[tuple]]:
    """(A as the kernels read it, the rule they quantize it by as they load it, or None): a
    QuantizedOnLoad in 1x128 blocks quantized first (block_codes), else checked to fit one tile
    of rows."""
    if not isinstance(a, QuantizedOnLoad):
        return a, None
    refusal = quantize_on_load_refusal(a.quantizer)
    if refusal:
        raise ValueError(refusal)
    if quantizes_first(a.quantizer):
        return block_codes(a.data, a.quantizer), None
    if a.shape[0] > ONE_TILE_ROWS or (config is not None and config.block_m < a.shape[0]):
        raise ValueError(f"the decode GEMM quantizes A as it loads it in one tile of its rows; got {a.shape[0]} rows and {config}")
    return a, a.rule


def _families(a: Representation | QuantizedOnLoad, b: Representation, m: int, config: Optional[DecodeConfig]) -> tuple[str, str]:
    """The operands' families (A's, B's), checked to take A's ``m`` rows where no ``config`` tiles them."""
    families = (a.quantizer.gemm_input(a.direction).family, b.quantizer.gemm_input(b.direction).family)
    most = MAX_ROWS.get(families, 0)
    if m > most and config is None:
        raise ValueError(
            f"the decode GEMM multiplies at most {most} rows of A for {families[0]} x {families[1]}; "
            f"got A of {m} rows ({a.quantizer})"
        )
    return families


def _k_split(n: int, k: int, device: torch.device, config: Optional[DecodeConfig], row_tiles: int) -> tuple[int, int]:
    """(the K splits of a call of ``n`` rows of B tiled by ``config`` (None: autotuned), the
    K_CHUNKs of each)."""
    if config:
        splits = split_k(n, k, device, config.tiles_per_sm, config.block_n, row_tiles)
    else:
        splits = split_k(n, k, device, AUTOTUNED_TILES_PER_SM, 64, row_tiles)
    k_chunks = ceil_div(ceil_div(k, splits), K_CHUNK)
    return ceil_div(k, k_chunks * K_CHUNK), k_chunks


def _launch_autotuned(
    grid, a_layout: _Layout, a_args: tuple, b_layout: _Layout, b_and_ends: tuple, arrivals: torch.Tensor,
    m: int, n: int, k: int, k_chunks: int, split: bool, rule: Optional[tuple], **later,
) -> None:
    """_decode_kernel on FP8 codes, its weight tile autotuned: A's arguments, the first B's with
    its bias, has_bias, out and partial sums (``b_and_ends``), and ``later``, the later GEMMs'
    (_later_gemms)."""
    launch(
        _autotuned, grid, *a_args, *b_and_ends, arrivals, m, n, k, k_chunks, K_CHUNK,
        OPERAND=b_layout.operand, SCALE_COLS=b_layout.scale_block[1],
        A_SCALE_ROWS=max(a_layout.scale_block[0], 1), B_SCALE_ROWS=max(b_layout.scale_block[0], 1),
        **_factors(a_layout, b_layout), SPLIT=split, PROMOTE_EVERY=fp8.PROMOTED_PRODUCTS, MX=0, A_FORMAT="", B_FORMAT="",
        ASM=not triton.knobs.runtime.interpret, WHOLE_TILES=False, BLOCK_M=ONE_TILE_ROWS, A_RULE=rule,
        **dependent_launch(a_args[0].device), **later,
    )


# -- The same programs over an expert stack -----------------------------------------------------
#
# graphquant.kernels.grouped's tokens x experts product of MXFP8 or NVFP4 operands, few tokens an
# expert: each token's padded row of A (graphquant.formats.groups' layout) times its group's rows
# of the stack B, both decoded in registers as the dense programs decode them, with the factors
# their values leave out (NVFP4's global decode: a group's, or a row's) applied once. A decode
# step's tokens run one a program on the one-row FMA program (_expert_rows_kernel); more run in
# tiles of 16 tokens on the tensor-core program (_expert_tiles_kernel), whose tiles of pad rows
# alone return at once. Either way an expert no token was routed to is not read.

# The tokens' tiles: the 16-row tiling, so that a few tokens' groups multiply 16 rows, not 64.
EXPERT_TILING = VALUE_TILES[0][1]
# The most routed rows an expert, on average, that take one token a program (MXFP8 and NVFP4
# alike), and that take 16-token tiles; past those the routed experts' values are written first.
# Each is the largest count timed at which that way made an expert layer's two products (gate and
# up, then down) the faster (benchmarks/grouped_decode.py); the tiles' is the few tokens an
# inference graph pads to 16 rows an expert.
ONE_TOKEN_ROWS_AN_EXPERT = 2
TILED_ROWS_AN_EXPERT = FEW_TOKENS_AN_EXPERT


@triton.jit
def _expert_tiles_kernel(
    a_ptr, a_scale_ptr, a_factor_ptr, a_stride, a_scale_row_stride, a_scale_col_stride,
    b_ptr, b_scale_ptr, b_factor_ptr, b_stride, b_scale_row_stride, b_scale_col_stride,
    out_ptr, row_group_ptr, source_ptr, ends_ptr, groups, per_group, n_out, padded_rows, stack_rows, K, k_chunks,
    CHUNK: tl.constexpr, OPERAND: tl.constexpr, SCALE_COLS: tl.constexpr, A_FACTOR: tl.constexpr, A_DIVISOR: tl.constexpr,
    B_FACTOR: tl.constexpr, B_DIVISOR: tl.constexpr, ASM: tl.constexpr, WHOLE_TILES: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (i, j): out[source[r], c] = (A[r] . B_g[c]) * fa * fb for the BLOCK_M padded rows r
    of tile i (g their group) and BLOCK_N columns c, over all of K (_tile_sums: the weights the
    left operand, the tokens' few rows the tensor cores' other); a tile of pad rows alone returns
    at once."""
    first = tl.program_id(0) * BLOCK_M
    if pad_rows_alone(first, source_ptr, ends_ptr, groups):
        return
    rows = (first + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < n_out
    group = tl.load(row_group_ptr + first).to(tl.int64)
    b_rows = group * per_group + tl.where(in_cols, cols, 0)
    total = _tile_sums(
        a_ptr, a_scale_ptr, a_stride, a_scale_row_stride, a_scale_col_stride, b_ptr, b_scale_ptr, b_stride, b_scale_row_stride,
        b_scale_col_stride, b_rows[:, None], rows[:, None], stack_rows, padded_rows, K, 0, k_chunks, None, CHUNK, OPERAND,
        SCALE_COLS, 1, 1, 0, 0, "", "", ASM, WHOLE_TILES, BLOCK_M, BLOCK_N, BLOCK_K, None, False, False,
    )
    # A group's factor (TENSOR_FACTOR) at its group's pointer, a row's at the row.
    a_factor_ptr = a_factor_ptr + group if A_FACTOR == 1 else a_factor_ptr
    b_factor_ptr = b_factor_ptr + group if B_FACTOR == 1 else b_factor_ptr
    total = _factored(
        total, b_rows[:, None], rows[None, :], stack_rows, padded_rows, a_factor_ptr, b_factor_ptr, A_FACTOR, A_DIVISOR, B_FACTOR, B_DIVISOR
    )
    source = tl.load(source_ptr + rows)
    tl.store(out_ptr + source[None, :] * n_out + cols[:, None], total.to(out_ptr.dtype.element_ty),
             mask=(source[None, :] >= 0) & in_cols[:, None])


@triton.jit(do_not_specialize=["tokens", "k_chunks"])
def _expert_rows_kernel(
    a_ptr, a_scale_ptr, a_factor_ptr, a_stride, a_scale_row_stride, a_scale_col_stride,
    b_ptr, b_scale_ptr, b_factor_ptr, b_stride, b_scale_row_stride, b_scale_col_stride,
    out_ptr, partial_ptr, arrivals_ptr, position_ptr, row_group_ptr, per_group, n_out, padded_rows, stack_rows, tokens, K,
    k_chunks, CHUNK: tl.constexpr, OPERAND: tl.constexpr, A_FACTOR: tl.constexpr, A_DIVISOR: tl.constexpr,
    B_FACTOR: tl.constexpr, B_DIVISOR: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr, WHOLE_TILES: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
):
    """Program (i, s, t): BLOCK_N columns of token t's row, its padded row position[t] of A times
    its group's rows of B, as _fma_kernel's program for one row of A makes them (_fma_row_sums), K
    split and finished as there (_write). The factors go to _write at pointers it reads by output
    column and token: a group's (TENSOR_FACTOR), or the rows' of the group's expert and of A's
    padded row."""
    t = tl.program_id(2)
    row = tl.load(position_ptr + t).to(tl.int64)
    group = tl.load(row_group_ptr + row).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    b_rows = group * per_group + tl.where(cols < n_out, cols, 0)
    total = _fma_row_sums(
        a_ptr, a_scale_ptr, a_stride, a_scale_row_stride, a_scale_col_stride, b_ptr, b_scale_ptr, b_stride, b_scale_row_stride,
        b_scale_col_stride, b_rows[None, :, None], row + tl.zeros((1, 1, 1), tl.int64), stack_rows, padded_rows, K,
        tl.program_id(1) * k_chunks * CHUNK, k_chunks, CHUNK, OPERAND, ASM, WHOLE_TILES, BLOCK_N, BLOCK_K, STAGES,
    )
    a_factor_ptr = a_factor_ptr + group if A_FACTOR == 1 else a_factor_ptr + (row - t)
    b_factor_ptr = b_factor_ptr + group if B_FACTOR == 1 else b_factor_ptr + group * per_group
    _write(
        total, cols[:, None], t + tl.zeros((1, 1), tl.int32), n_out, tokens, a_factor_ptr, b_factor_ptr, out_ptr, out_ptr,
        partial_ptr, arrivals_ptr, A_FACTOR, A_DIVISOR, B_FACTOR, B_DIVISOR, 0, SPLIT, tl.program_id(1), tl.num_programs(1),
        t * tl.num_programs(0) + tl.program_id(0),
    )


def _expert_layout(rep: Representation) -> Optional[_Layout]:
    """The layout of a k-last MXFP8 (E4M3) or NVFP4 operand, or None."""
    gemm_input = rep.quantizer.gemm_input(rep.direction)
    layout = None if gemm_input is None else LAYOUTS.get(gemm_input.family)
    coded = layout is not None and layout.operand != FP8_CODES and rep.stored_k_last and reads(gemm_input)
    return layout if coded else None


def decodes_experts(a: Representation, b: Representation, tokens: int, groups: int) -> bool:
    """Whether ``experts_gemm`` multiplies A (``tokens`` rows, rowwise) by the stack B of
    ``groups`` experts: both MXFP8 (E4M3) or both NVFP4, each with its reduction dim stored last,
    B's rows its experts' GEMM rows, and few enough tokens an expert (TILED_ROWS_AN_EXPERT)."""
    la, lb = _expert_layout(a), _expert_layout(b)
    return (
        la is not None and lb is not None and la.operand == lb.operand and a.direction == ROWWISE and b.direction == ROWWISE
        and tokens <= TILED_ROWS_AN_EXPERT * groups
    )


def one_token_a_program(tokens: int, groups: int) -> bool:
    """Whether ``experts_gemm`` runs one token a program (ONE_TOKEN_ROWS_AN_EXPERT)."""
    return tokens <= ONE_TOKEN_ROWS_AN_EXPERT * groups


def experts_gemm(a: Representation, b: Representation, tokens: GroupPadding, n: int, out_dtype: torch.dtype) -> torch.Tensor:
    """(tokens, n): row t is A's padded row tokens.position[t] (in the layout ``tokens``) times
    the first n rows of its group's expert in the stack B (its experts of equal rows), for
    operands that ``decodes_experts`` takes."""
    (a_layout, a_args), (b_layout, b_args) = _operand(a, "A"), _operand(b, "B")
    count, groups, k = tokens.position.shape[0], tokens.groups, a.shape[1]
    out = torch.empty((count, n), dtype=out_dtype, device=a.data.device)
    if count == 0:  # no program to launch
        return out
    per_group, padded_rows, stack_rows = b.data.shape[0] // groups, a.data.shape[0], b.data.shape[0]
    operands = (*_in_words(a_args), *_in_words(b_args))
    common = dict(OPERAND=b_layout.operand, **_factors(a_layout, b_layout), ASM=not triton.knobs.runtime.interpret)
    if one_token_a_program(count, groups):
        config = _ONE_ROW[b_layout.operand]
        splits, k_chunks = _k_split(n, k, out.device, config, count)
        *_, partial = _ends(None, out, splits)
        arrivals = arrival_counters.zeroed(out.device, ceil_div(n, config.block_n) * count) if splits > 1 else out
        launch(
            _expert_rows_kernel, (ceil_div(n, config.block_n), splits, count), *operands, out, partial, arrivals, tokens.position,
            tokens.row_group, per_group, n, padded_rows, stack_rows, count, k, k_chunks, K_CHUNK, **common, SPLIT=splits > 1,
            WHOLE_TILES=k % (k_chunks * K_CHUNK) == 0, BLOCK_N=config.block_n, BLOCK_K=config.block_k, STAGES=config.stages,
            num_warps=config.warps, num_stages=config.stages,
        )
        return out
    config, k_chunks = EXPERT_TILING, ceil_div(k, K_CHUNK)
    launch(
        _expert_tiles_kernel, (ceil_div(padded_rows, config.block_m), ceil_div(n, config.block_n)), *operands, out, tokens.row_group,
        tokens.source, tokens.ends, groups, per_group, n, padded_rows, stack_rows, k, k_chunks, K_CHUNK, **common,
        SCALE_COLS=b_layout.scale_block[1], WHOLE_TILES=k == k_chunks * K_CHUNK, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, num_warps=config.warps, num_stages=config.stages,
    )
    return out
