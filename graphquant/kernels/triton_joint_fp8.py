"""CUDA kernels of graphquant::joint_amax and graphquant::joint_cast: several tensors in
per-tensor FP8 under one joint scale, without joining them (attention's Q, K and V; dO alone).

The reference (graphquant.ops.attention.quantize_qkv) concatenates Q, K and V, takes the amax of
the whole and casts it, then transposes V: a copy of all three before two passes over them, and
a third over V. Here the amax pass reads each tensor once into one shared maximum, and the cast
pass reads each once more, writing its codes and, as a by-product, the amax again (what a delayed-scaling slot records,
whose scale is known before any pass). Every number is the reference's: the amax is an integer
max of the float32 bit patterns with the sign cleared (graphquant.formats.fp8.tensor_amax:
exact, NaN above infinity), and each code is one fp32 product with the scale, clamped to the
format's largest finite value and rounded to nearest even (graphquant.formats.per_tensor.quantize).
Transposed codes, where asked, are the codes transposed by graphquant::transposed's kernel: the
cast pass writing them beside the codes from the same tile came out with wrong bytes on the H200
for float32 input (Triton 3.6's ptxas, triton-lang/triton#11111, which a kernel storing only the
transposed bytes does not hit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphquant.formats import fp8
from graphquant.kernels import triton_transpose
from graphquant.kernels.triton_scales import fp8_codes

_ROWS = 64  # rows of one tile: 64 x 128 bf16 is 16 KiB
_CODES = {"e4m3": tl.float8e4nv, "e5m2": tl.float8e5}


@triton.jit
def _pass_kernel(
    X, CODES, SCALE, AMAX_BITS, rows, COLS: tl.constexpr, BLOCK: tl.constexpr,
    CAST: tl.constexpr, FP8_MAX: tl.constexpr, CODE: tl.constexpr,
):
    """One tile of BLOCK rows of a (rows, COLS) tensor: its amax into AMAX_BITS (atomic max of
    the magnitude bits) and, with CAST, its codes."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    c = tl.arange(0, COLS)
    inside = (r < rows)[:, None]
    offsets = r[:, None].to(tl.int64) * COLS + c[None, :]
    x = tl.load(X + offsets, mask=inside, other=0.0).to(tl.float32)
    tl.atomic_max(AMAX_BITS, tl.max(tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 1), 0))
    if CAST:
        codes = fp8_codes(x, tl.load(SCALE), FP8_MAX, CODE)
        tl.store(CODES + offsets, codes, mask=inside)


def _launch(x, amax_bits, codes=None, scale=None, fp8_dtype="e4m3") -> None:
    rows, cols = x.shape
    if rows:
        _pass_kernel[(triton.cdiv(rows, _ROWS),)](
            x, codes, scale, amax_bits, rows, cols, _ROWS, codes is not None,
            fp8.fp8_max(fp8_dtype), _CODES[fp8_dtype], num_warps=4,
        )


def joint_amax(tensors: list[torch.Tensor]) -> torch.Tensor:
    bits = torch.zeros((), dtype=torch.int32, device=tensors[0].device)
    for x in tensors:
        _launch(_rows(x), bits)
    return bits.view(torch.float32)


def joint_cast(tensors: list[torch.Tensor], scale: torch.Tensor, fp8_dtype: str, transposed: list[bool]):
    bits = torch.zeros((), dtype=torch.int32, device=tensors[0].device)
    dtype = fp8.FP8_DTYPES[fp8_dtype]
    scale = scale.reshape(1).float()
    codes, codes_t = [], []
    for x, t in zip(tensors, transposed):
        codes.append(torch.empty(x.shape, dtype=dtype, device=x.device))
        _launch(_rows(x), bits, codes[-1], scale, fp8_dtype)
        if t:
            codes_t.append(triton_transpose.transposed(codes[-1]))
    return codes, codes_t, bits.view(torch.float32)


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] not in (16, 32, 64, 128, 256):
        raise ValueError(f"joint FP8 quantize kernels take 2-D (rows, cols) tensors of 16-256 columns, a power of two; got {tuple(x.shape)}")
    return x.contiguous()
