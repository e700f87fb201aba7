"""The decode GEMM: out (m, n) = A @ B^T (+ bias) for at most 16 rows of A, a Triton kernel that
reads both quantized operands as they are stored and dequantizes them in registers.

At decode sizes the product costs nothing beside reading the weight (B) once, so each program
takes a BLOCK_N x BLOCK_K tile of B at a time against all of A's rows, and K is split across
programs (each writes an fp32 partial sum; a second kernel adds them in a fixed order), enough
programs to keep every SM reading. Each operand is read by the layout family it belongs to
(GemmInput.family): codes times their block scales are the values the emulated GEMM multiplies
(Quantizer.emulated_values), exact in bf16 where the format says so (then multiplied on the
tensor cores in bf16, as the emulated GEMM's cuBLASLt GEMM does, else in fp32 IEEE), summed in
fp32; the per-tensor or per-row factors
(Quantizer.emulated_factor) multiply each other once and then the sum, as the emulated GEMM's
alpha does, and the bias is added before the one rounding to the output dtype.

So the result is the emulated product's up to the order of fp32 accumulation: with u = 2^-24,
against the exact product of the dequantized operands, |error| <= (K + 3) u sum_k |a b| + u |out|
before the rounding to the output dtype: K - 1 additions in any order, the factors' product and
its product with the sum, one rounding of each operand's fp32 dequantized value (the reference's,
where it multiplies a factor in), and the bias's addition.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from graphquant.formats import nvfp4
from graphquant.kernels.triton_dequantize import e2m1_value_over_2_14, e8m0_value
from graphquant.quantizers import Representation, gemm_dims

BACKEND = "triton decode gemm"

# The most rows of A: one tile of rows (the tensor cores' smallest), so the weight is read once.
MAX_ROWS = 16

# K is split at multiples of this many columns: a multiple of every config's BLOCK_K, and of
# every block scale's length, so that no block straddles two programs.
K_CHUNK = 512


class _Layout(NamedTuple):
    """How the kernel reads one layout family: codes packed two per byte (E2M1) or one FP8 code
    each; the (rows, cols) each block scale covers, (0, 0) where none, and the scale's encoding;
    the factor (none, one per tensor, one per row), from the representation's scale or amax, and
    the divisor that makes an amax a factor."""

    packed: bool
    scale_block: tuple[int, int]
    scale_encoding: int
    factor: int
    factor_from_amax: bool
    divisor: float


FP32, E8M0, E4M3 = 0, 1, 2
NO_FACTOR, TENSOR_FACTOR, ROW_FACTOR = 0, 1, 2

_NVFP4_DIVISOR = nvfp4.E4M3_MAX * nvfp4.E2M1_MAX  # nvfp4.global_decode: amax / 2688, one IEEE division

LAYOUTS = {
    "fp8_tensorwise": _Layout(False, (0, 0), FP32, TENSOR_FACTOR, False, 1.0),
    "fp8_rowwise": _Layout(False, (0, 0), FP32, ROW_FACTOR, False, 1.0),
    "fp8_block_1x128": _Layout(False, (1, 128), FP32, NO_FACTOR, False, 1.0),
    "fp8_block_128x128": _Layout(False, (128, 128), FP32, NO_FACTOR, False, 1.0),
    "mxfp8": _Layout(False, (1, 32), E8M0, NO_FACTOR, False, 1.0),
    "nvfp4": _Layout(True, (1, 16), E4M3, TENSOR_FACTOR, True, _NVFP4_DIVISOR),
    "nvfp4_row_scaled": _Layout(True, (1, 16), E4M3, ROW_FACTOR, True, _NVFP4_DIVISOR),
}

# The operand pairs (A's family, B's family) it multiplies: each recipe's activation x weight.
FAMILY_PAIRS = frozenset(
    {
        ("fp8_tensorwise", "fp8_tensorwise"),
        ("fp8_rowwise", "fp8_rowwise"),
        ("fp8_block_1x128", "fp8_block_1x128"),
        ("fp8_block_1x128", "fp8_block_128x128"),
        ("mxfp8", "mxfp8"),
        ("nvfp4", "nvfp4"),
        ("nvfp4_row_scaled", "nvfp4"),
    }
)
_FP8 = ("e4m3", "e5m2")
ELEMENT_PAIRS = frozenset({(x, y) for x in _FP8 for y in _FP8} | {("e2m1", "e2m1")})

# Tiles of the weight, each read whole per step, for N and K of 4096 to 14336; the interpreter
# runs a kernel's logic, not its speed, so it takes the first alone.
_CONFIGS = [
    triton.Config({"BLOCK_N": 64, "BLOCK_K": 256}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_N": 128, "BLOCK_K": 128}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_N": 128, "BLOCK_K": 256}, num_warps=8, num_stages=3),
]
if triton.knobs.runtime.interpret:
    _CONFIGS = _CONFIGS[:1]


@triton.jit
def _values(
    data_ptr, scale_ptr, row, rows, k0, K, data_stride, scale_row_stride, scale_col_stride,
    PACKED: tl.constexpr, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr, SCALE_ENCODING: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """fp32 (len(row), BLOCK_K) codes times their block scales from column k0 on: the values the
    emulated GEMM multiplies. Rows and columns past the operand's are zeros."""
    in_rows = row < rows
    row64 = row.to(tl.int64)
    if PACKED:  # E2M1, two a byte; the 2^-14 of the decoded codes goes into the scales
        byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)[None, :]
        codes = tl.load(data_ptr + row64 * data_stride + byte, mask=in_rows & (byte < K // 2), other=0).to(tl.int32)
        values = tl.interleave(e2m1_value_over_2_14(codes & 0xF), e2m1_value_over_2_14(codes >> 4))
    else:
        col = k0 + tl.arange(0, BLOCK_K)[None, :]
        inside = in_rows & (col < K)
        # No ``other`` in loads of FP8: it would be cast to FP8, which Triton's interpreter cannot do.
        values = tl.where(inside, tl.load(data_ptr + row64 * data_stride + col, mask=inside).to(tl.float32), 0.0)
    if SCALE_COLS != 0:
        # One scale a block, loaded once and broadcast over its columns.
        block = k0 // SCALE_COLS + tl.arange(0, BLOCK_K // SCALE_COLS)[None, :]
        at = (row64 // SCALE_ROWS) * scale_row_stride + block.to(tl.int64) * scale_col_stride
        inside = in_rows & (block < tl.cdiv(K, SCALE_COLS))
        raw = tl.load(scale_ptr + at, mask=inside)
        if SCALE_ENCODING == 1:  # E8M0
            scale = e8m0_value(raw)
        else:
            scale = raw.to(tl.float32)
        scale = tl.where(inside, scale, 0.0)
        if PACKED:
            scale = scale * 16384.0  # exact: E4M3 times a power of two
        scale = tl.reshape(
            tl.broadcast_to(scale[:, :, None], (values.shape[0], BLOCK_K // SCALE_COLS, SCALE_COLS)),
            (values.shape[0], BLOCK_K),
        )
        values = values * scale
    return values


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
def _finish(
    total, n, m, N, M, a_factor_ptr, b_factor_ptr, bias_ptr, out_ptr,
    A_FACTOR: tl.constexpr, A_DIVISOR: tl.constexpr, B_FACTOR: tl.constexpr, B_DIVISOR: tl.constexpr,
    has_bias,
):
    """out[m, n] = total[n, m] times both factors (their product first, as one alpha), plus the
    bias, rounded once to out's dtype."""
    if A_FACTOR != 0:
        factor = _factor(a_factor_ptr, m, m < M, A_FACTOR, A_DIVISOR)
        if B_FACTOR != 0:
            factor = factor * _factor(b_factor_ptr, n, n < N, B_FACTOR, B_DIVISOR)
        total = total * factor
    elif B_FACTOR != 0:
        total = total * _factor(b_factor_ptr, n, n < N, B_FACTOR, B_DIVISOR)
    if has_bias:
        total = total + tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * N + n, total.to(out_ptr.dtype.element_ty), mask=(n < N) & (m < M))


# M and has_bias stay runtime values (not specialized when 1), so that every row count and
# both bias cases share one compiled kernel per format.
@triton.autotune(configs=_CONFIGS, key=["N", "K", "SPLIT_K", "B_PACKED", "B_SCALE_COLS", "DOT_DTYPE"])
@triton.jit(do_not_specialize=["M", "has_bias"])
def _decode_kernel(
    a_ptr, a_scale_ptr, a_factor_ptr, a_stride, a_scale_row_stride, a_scale_col_stride,
    b_ptr, b_scale_ptr, b_factor_ptr, b_stride, b_scale_row_stride, b_scale_col_stride,
    bias_ptr, has_bias, out_ptr, partial_ptr, M, N, K,
    A_PACKED: tl.constexpr, A_SCALE_ROWS: tl.constexpr, A_SCALE_COLS: tl.constexpr, A_SCALE_ENCODING: tl.constexpr,
    A_FACTOR: tl.constexpr, A_DIVISOR: tl.constexpr,
    B_PACKED: tl.constexpr, B_SCALE_ROWS: tl.constexpr, B_SCALE_COLS: tl.constexpr, B_SCALE_ENCODING: tl.constexpr,
    B_FACTOR: tl.constexpr, B_DIVISOR: tl.constexpr,
    SPLIT_K: tl.constexpr, K_PER_SPLIT: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (i, s): the sums over K split s of BLOCK_N rows of B against all rows of A,
    finished into out where K is not split, else written to partial[s]. The weight tile is the
    dot's left operand (it is dequantized in registers; A's rows are the short side)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    m = tl.arange(0, BLOCK_M)[:, None]
    k_start = tl.program_id(1) * K_PER_SPLIT
    total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for step in range(0, K_PER_SPLIT, BLOCK_K):  # columns past K load as zeros
        k0 = k_start + step
        b = _values(
            b_ptr, b_scale_ptr, n, N, k0, K, b_stride, b_scale_row_stride, b_scale_col_stride,
            B_PACKED, B_SCALE_ROWS, B_SCALE_COLS, B_SCALE_ENCODING, BLOCK_K,
        )
        a = _values(
            a_ptr, a_scale_ptr, m, M, k0, K, a_stride, a_scale_row_stride, a_scale_col_stride,
            A_PACKED, A_SCALE_ROWS, A_SCALE_COLS, A_SCALE_ENCODING, BLOCK_K,
        )
        total = tl.dot(b.to(DOT_DTYPE), tl.trans(a.to(DOT_DTYPE)), total, input_precision="ieee")
    m = tl.arange(0, BLOCK_M)[None, :]
    if SPLIT_K == 1:
        _finish(total, n, m, N, M, a_factor_ptr, b_factor_ptr, bias_ptr, out_ptr, A_FACTOR, A_DIVISOR, B_FACTOR, B_DIVISOR, has_bias)
    else:
        at = (tl.program_id(1) * M + m).to(tl.int64) * N + n
        tl.store(partial_ptr + at, total, mask=(n < N) & (m < M))


@triton.jit(do_not_specialize=["M", "has_bias"])
def _reduce_kernel(
    partial_ptr, a_factor_ptr, b_factor_ptr, bias_ptr, has_bias, out_ptr, M, N,
    A_FACTOR: tl.constexpr, A_DIVISOR: tl.constexpr, B_FACTOR: tl.constexpr, B_DIVISOR: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out = the sum of the K splits' partial sums, in split order (the same bits every run), finished."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    m = tl.arange(0, BLOCK_M)[None, :]
    mask = (n < N) & (m < M)
    total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for split in range(SPLIT_K):
        total += tl.load(partial_ptr + (split * M + m).to(tl.int64) * N + n, mask=mask, other=0.0)
    _finish(total, n, m, N, M, a_factor_ptr, b_factor_ptr, bias_ptr, out_ptr, A_FACTOR, A_DIVISOR, B_FACTOR, B_DIVISOR, has_bias)


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


def _operand(rep: Representation, operand: str) -> tuple[tuple, dict]:
    """(pointer and stride arguments, constexpr arguments) of one operand of _decode_kernel."""
    layout = _layout(rep, operand)
    data = rep.data if rep.data.stride(-1) == 1 else rep.data.contiguous()
    scale = rep.scale if layout.scale_block != (0, 0) else data
    factor = (rep.amax if layout.factor_from_amax else rep.scale) if layout.factor else data
    if layout.factor == ROW_FACTOR:
        factor = factor.reshape(-1).contiguous()
    scale_strides = scale.stride() if scale is not data else (0, 0)
    args = (data, scale, factor, data.stride(0), *scale_strides)
    prefix = operand + "_"
    constants = {
        prefix + "PACKED": layout.packed,
        prefix + "SCALE_ROWS": max(layout.scale_block[0], 1),
        prefix + "SCALE_COLS": layout.scale_block[1],
        prefix + "SCALE_ENCODING": layout.scale_encoding,
        prefix + "FACTOR": layout.factor,
        prefix + "DIVISOR": layout.divisor,
    }
    return args, constants


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def split_k(n: int, k: int, device: torch.device) -> int:
    """How many programs share each tile's K: enough for about four 64-row tiles of B per SM,
    each split at least K_CHUNK columns."""
    sms = _multiprocessors(device)
    wanted = triton.cdiv(4 * sms, triton.cdiv(n, 64))
    return max(1, min(wanted, triton.cdiv(k, K_CHUNK)))


def gemm(a: Representation, b: Representation, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(m, n) = A @ B^T (+ bias), m <= MAX_ROWS, both operands stored with the reduction dim last."""
    m, n, k = gemm_dims(a, b)
    if m > MAX_ROWS:
        raise ValueError(f"the decode GEMM multiplies at most {MAX_ROWS} rows of A; got A of {m} rows ({a.quantizer})")
    (a_args, a_constants), (b_args, b_constants) = _operand(a, "A"), _operand(b, "B")
    # Values exact in bf16 are multiplied as bf16 (the same products); not in Triton's interpreter,
    # whose dot multiplies bf16 bit patterns as integers.
    exact = a.quantizer.values_exact_in_bf16(a) and b.quantizer.values_exact_in_bf16(b)
    exact = exact and not triton.knobs.runtime.interpret
    out = torch.empty((m, n), dtype=out_dtype, device=a.data.device)
    splits = split_k(n, k, a.data.device)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), K_CHUNK) * K_CHUNK
    splits = triton.cdiv(k, k_per_split)
    partial = torch.empty((splits, m, n), dtype=torch.float32, device=out.device) if splits > 1 else out
    bias_arg = out if bias is None else bias.contiguous()
    finish = {key: value for key, value in {**a_constants, **b_constants}.items() if key.endswith(("FACTOR", "DIVISOR"))}
    _decode_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), splits)](
        *a_args, *b_args, bias_arg, int(bias is not None), out, partial, m, n, k,
        **a_constants, **b_constants, SPLIT_K=splits, K_PER_SPLIT=k_per_split,
        DOT_DTYPE=tl.bfloat16 if exact else tl.float32, BLOCK_M=MAX_ROWS,
    )
    if splits > 1:
        _reduce_kernel[(triton.cdiv(n, 128),)](
            partial, a_args[2], b_args[2], bias_arg, int(bias is not None), out, m, n, **finish,
            SPLIT_K=splits, BLOCK_M=MAX_ROWS, BLOCK_N=128,
        )
    return out
