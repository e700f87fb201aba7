"""Native low-precision GEMMs through cuBLASLt: torch._scaled_mm, and for per-tensor and per-row
FP8 our own call of cuBLASLt (graphquant._C.fp8_gemm), which runs the fastest of its algorithms
that write the bits of the heuristic's first choice (per tensor, torch._scaled_mm's; per row,
where torch._scaled_mm runs CUTLASS's GEMM, slower from 1000 rows on the H200).

Every operand arrives with its reduction dim last, as the representations store it for Hopper's
TN GEMM; the second operand is passed transposed (a column-major view), and scales are laid out
as cuBLASLt wants them for each scaling mode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

from graphquant.kernels import devices, native
from graphquant.formats import nvfp4
from graphquant.quantizers import Representation, gemm_dims

if TYPE_CHECKING:
    from graphquant.kernels.backends import GemmBackend

TENSORWISE = "cublaslt fp8 tensorwise"
ROWWISE_SCALED = "cublaslt fp8 rowwise"
BLOCKWISE = "cublaslt fp8 blockwise"
MXFP8 = "cublaslt mxfp8 (sm100)"
NVFP4 = "cublaslt nvfp4 (sm100)"


def k_last(rep: Representation) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The stored data and scale with the reduction dim last: as they are where stored so
    (rowwise data, columnwise data stored transposed), else their contiguous transposes, whose
    blocks then lie along the rows as a rowwise representation's do."""
    if rep.stored_k_last:
        return rep.data, rep.scale
    return torch.ops.graphquant.transposed(rep.data), rep.scale.t()


def outer_major(scale: torch.Tensor) -> torch.Tensor:
    """The same (outer, k_blocks) scale with the outer dim contiguous, as 1x128 scaling wants."""
    return scale.t().contiguous().t()


# The multiple of n and k that cuBLASLt's FP8 GEMMs take: both are padded to it here
# (whole_reduction, whole_rows), so that they take any shape.
FP8_MULTIPLES = {TENSORWISE: 16, ROWWISE_SCALED: 16, BLOCKWISE: 128}
# cuBLASLt's 128x128 scaling (torch 2.11+cu130 on the H200) takes any k but, where k / 128 is not
# a multiple of 4 (a tile's row of scales not whole 16 bytes), multiplies by the wrong scales
# without an error: relative errors of 0.01 to 80 at k = 128 to 11008, depending on the kernel it
# picks. Such a reduction is padded to a multiple of TILE_SCALED_K instead, where graphquant's
# block-scaled GEMM (backends.BLOCK_SCALED_GEMM) does not run it.
TILE_SCALED_K = 512
# cuBLASLt's 1x128 scaling reads A's scales with the rows contiguous and refuses (NOT_SUPPORTED) an
# m that is not a multiple of 4: their columns are then not 16-byte aligned.
BLOCKWISE_ROWS = 4


def whole_reduction(data: torch.Tensor, multiple: int) -> torch.Tensor:
    """Codes (rows, k) with zero columns up to a multiple of ``multiple``: a zero code adds nothing
    to any sum, and a 1x128 or 128x128 block's scale covers the columns its partial block lacks
    (a training step of 1000 tokens reduces its wgrad over them)."""
    missing = -data.shape[1] % multiple
    return F.pad(data.view(torch.uint8), (0, missing)).view(data.dtype) if missing else data


def whole_rows(data: torch.Tensor, multiple: int) -> torch.Tensor:
    """Codes (rows, k) with zero rows up to a multiple of ``multiple``, whose outputs ``run`` drops:
    B's for n (an LM head of 32001 or 50257 rows is no reason for the emulation), A's for the
    blockwise GEMM's m (block_scaled_rows)."""
    missing = -data.shape[0] % multiple
    return F.pad(data.view(torch.uint8), (0, 0, 0, missing)).view(data.dtype) if missing else data


def whole_blocks(scale: torch.Tensor, blocks: int) -> torch.Tensor:
    """1x128 or 128x128 scales (outer, k blocks) with ones up to ``blocks`` of K, for
    whole_reduction's zero columns."""
    missing = blocks - scale.shape[1]
    return F.pad(scale, (0, missing), value=1.0) if missing else scale


def padded_scales(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """Per-row or 1x128 scales (rows', ...) with ones up to ``rows``, for whole_rows' zero rows."""
    missing = rows - scale.shape[0]
    return F.pad(scale, (0, 0, 0, missing), value=1.0) if missing else scale


def block_scaled_rows(data: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A's codes (m, k) and 1x128 scales (m, k / 128) for the blockwise GEMM: zero rows (scale 1)
    up to a multiple of BLOCKWISE_ROWS, whose products ``run`` drops, and the scales outer-major."""
    data = whole_rows(data, BLOCKWISE_ROWS)
    return data, outer_major(padded_scales(scale, data.shape[0]))


def per_row_scaled_after(m: int, n: int, device: torch.device) -> bool:
    """Whether a per-row GEMM of out (m, n) runs per tensor first, its scales after it: per-row
    scales keep cuBLASLt's FP8 GEMMs (and CUTLASS's) from splitting K, so a product whose 128x128
    output tiles fill at most half the SMs (a few rows of a 4096 x 14336 weight) ran at bf16's speed
    on the H200, against 1.6x per tensor (benchmarks/NOTES.md, decode_gemm.py)."""
    return devices.few_tiles(m, n, 128, device)


def _scaled_after(ext, data_a, data_b, scale_a, scale_b, out_dtype, fast_accumulation, bias):
    """A @ B^T per row as per_row_scaled_after says: the codes' product per tensor (unit scales, fp32),
    then times each row's scale (``scale_a``, (m, 1)) and each column's (``scale_b``, (1, n)) in
    place, plus the bias, rounded once."""
    one = torch.ones(1, device=data_a.device)
    out = ext.fp8_gemm(data_a, data_b, one, one, torch.float32, fast_accumulation, None).mul_(scale_a).mul_(scale_b)
    return (out if bias is None else out.add_(bias.float())).to(out_dtype)


def swizzled_block_scales(scale: torch.Tensor) -> torch.Tensor:
    """Block scales (rows, cols) in cuBLAS's block-scaled layout for sm100 (flattened).

    The matrix is padded to whole 128x4 tiles; inside a tile, scale (r, c) goes to byte
    (r % 32) * 16 + (r // 32) * 4 + c, and tiles are laid out row-tile-major.
    """
    rows, cols = scale.shape
    padded_rows, padded_cols = -(-rows // 128) * 128, -(-cols // 4) * 4
    padded = scale.new_zeros(padded_rows, padded_cols)
    padded[:rows, :cols] = scale
    tiles = padded.reshape(padded_rows // 128, 4, 32, padded_cols // 4, 4)  # (tile r, r // 32, r % 32, tile c, c)
    return tiles.permute(0, 3, 2, 1, 4).reshape(-1)


def arguments(
    backend: str, a: Representation, b: Representation, out_dtype: torch.dtype, fast_accumulation: bool = False
) -> tuple[tuple, dict]:
    """torch._scaled_mm's (args, kwargs) for out (m, n) = A @ B^T on the native GEMM named
    ``backend``: the operands, and the scales in the layout that scaling mode wants.
    fast_accumulation: sum in the tensor cores' accumulator throughout (TE's and torchao's default
    for per-tensor and per-row FP8 fprop: faster), rather than promote partial sums to fp32."""
    (data_a, k_scale_a), (data_b, k_scale_b) = k_last(a), k_last(b)
    tiles = backend == BLOCKWISE and b.quantizer.gemm_input(b.direction).family == "fp8_block_128x128"
    if backend in FP8_MULTIPLES:
        multiple = FP8_MULTIPLES[backend]
        k_multiple = TILE_SCALED_K if tiles else multiple
        data_a, data_b = whole_reduction(data_a, k_multiple), whole_rows(whole_reduction(data_b, k_multiple), multiple)
    rows_b = data_b.shape[0]
    data_b = data_b.t()
    if backend == TENSORWISE:
        scale_a, scale_b = a.scale.reshape(()), b.scale.reshape(())
    elif backend == ROWWISE_SCALED:  # cuBLASLt's rowwise scaling writes bf16 only
        scale_a, scale_b, out_dtype = a.scale.reshape(-1, 1), padded_scales(b.scale.reshape(-1, 1), rows_b).reshape(1, -1), torch.bfloat16
    elif backend == BLOCKWISE:
        blocks = data_a.shape[1] // 128
        data_a, scale_a = block_scaled_rows(data_a, whole_blocks(a.scale, blocks))
        scale_b = whole_blocks(b.scale, blocks).t() if tiles else padded_scales(b.scale, rows_b).t().contiguous()
    elif backend == MXFP8:
        scale_a = swizzled_block_scales(k_scale_a).view(torch.float8_e8m0fnu)
        scale_b = swizzled_block_scales(k_scale_b).view(torch.float8_e8m0fnu)
    elif backend == NVFP4:  # the global scales are applied to the fp32 product (run)
        data_a, data_b = data_a.view(torch.float4_e2m1fn_x2), data_b.view(torch.float4_e2m1fn_x2)
        scale_a, scale_b, out_dtype = swizzled_block_scales(a.scale), swizzled_block_scales(b.scale), torch.float32
    else:
        raise ValueError(f"unknown native backend {backend!r}")
    return (data_a, data_b, scale_a, scale_b), dict(out_dtype=out_dtype, use_fast_accum=fast_accumulation)


def run(backend: "GemmBackend", a: Representation, b: Representation, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out (m, n) = A @ B^T (+ bias) on ``backend``, a native one (graphquant.kernels.backends).

    The bias goes into cuBLASLt's epilogue where the call writes bf16 or fp16 and the bias has
    that dtype; otherwise it is added to the fp32 product, which is then rounded once. Where B's
    rows were padded (whole_rows), the bias is too, with zeros, and the padded columns are dropped.
    """
    args, kwargs = arguments(backend.name, a, b, out_dtype, backend.fast_accumulation)
    m, n, _ = gemm_dims(a, b)
    missing = args[1].shape[1] - n
    if missing and bias is not None:
        bias = F.pad(bias, (0, missing))
    out = _product(backend, a, b, m, args, kwargs, out_dtype, bias)
    return out[:, :n].contiguous() if missing else out


def _product(
    backend: "GemmBackend", a: Representation, b: Representation, m: int, args: tuple, kwargs: dict, out_dtype, bias
) -> torch.Tensor:
    """``run``'s product of the arguments it made (m rows of output), on the GEMM they are for."""
    epilogue_bias = bias if bias is not None and bias.dtype == kwargs["out_dtype"] != torch.float32 else None
    ext = native.extension_for(a.data.device)
    if ext is not None and backend.name in (TENSORWISE, ROWWISE_SCALED):
        data_a, data_b, scale_a, scale_b = args
        if backend.name == ROWWISE_SCALED and per_row_scaled_after(data_a.shape[0], data_b.shape[1], data_a.device):
            return _scaled_after(ext, data_a, data_b.t(), scale_a, scale_b, out_dtype, kwargs["use_fast_accum"], bias)
        out = ext.fp8_gemm(
            data_a, data_b.t(), scale_a.reshape(-1), scale_b.reshape(-1), kwargs["out_dtype"], kwargs["use_fast_accum"], epilogue_bias
        )
    else:
        out = torch._scaled_mm(*args, bias=epilogue_bias, **kwargs)
        if out.shape[0] != m:  # block_scaled_rows' zero rows
            out = out[:m]
    if epilogue_bias is not None:
        return out.to(out_dtype)
    if backend.name == NVFP4:
        out = out * (nvfp4.global_decode(a.amax) * nvfp4.global_decode(b.amax))
    if bias is not None:
        out = out.float() + bias.float()
    return out.to(out_dtype)


ALGORITHM_FIELDS = ("GEMM", "candidates", "bit-identical", "chosen", "first us", "chosen us", "tile", "stages", "cluster")


def algorithm_choices() -> list[tuple]:
    """The cuBLASLt algorithm graphquant's own GEMM calls (fp8_gemm, bf16_gemm) chose for each shape
    this process has run, as ALGORITHM_FIELDS: the candidates cuBLASLt offered, how many of them
    wrote the heuristic's first's bits, the index chosen, and the microseconds of the first and the
    chosen (0 where the shape was too small to time); cuBLASLt's tile, stages and cluster shape ids.
    Empty without the CUDA kernels."""
    ext = native.extension()
    return [] if ext is None else sorted(ext.gemm_algorithms())

