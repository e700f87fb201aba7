"""CUDA kernels of graphquant::joint_amax and graphquant::joint_cast: several tensors in
per-tensor FP8 under one joint scale, without joining them (attention's Q, K and V; dO alone).

The reference (graphquant.ops.attention.quantize_qkv) concatenates Q, K and V, takes the amax of
the whole and casts it, then transposes V: a copy of all three before two passes over them, and
a third over V. Here the amax pass reads each tensor once into one shared maximum, and the cast
pass reads each once more, writing its codes and, for a delayed-scaling slot (whose scale is
known before any pass), the amax it records. Each pass is one launch for up to three tensors,
which it reads where they lie: (batch, heads, length, dim) of any strides but the last (a
model's (batch, length, heads, dim) projections transposed, as attention takes them), without
the copy a reshape to rows would make; the codes are written contiguous. Every number is the reference's:
the amax is an integer max of the float32 bit patterns with the sign cleared
(graphquant.formats.fp8.tensor_amax: exact, NaN above infinity), and each code is one fp32
product with the scale, clamped to the format's largest finite value and rounded to nearest even
(graphquant.formats.per_tensor.quantize). Transposed codes, where asked, are the codes
transposed by graphquant::transposed's kernel: the cast pass writing them beside the codes from
the same tile came out with wrong bytes on the H200 for float32 input (Triton 3.6's ptxas,
triton-lang/triton#11111, which a kernel storing only the transposed bytes does not hit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphquant.formats import fp8
from graphquant.kernels import triton_transpose
from graphquant.kernels.triton_launch import ceil_div, launch
from graphquant.kernels.triton_scales import fp8_codes

_ROWS = 64  # rows of one tile: 64 x 128 bf16 is 16 KiB
_PER_LAUNCH = 3  # tensors one launch takes: Q, K and V
_CODES = {"e4m3": tl.float8e4nv, "e5m2": tl.float8e5}


@triton.jit
def _tile(
    X, CODES, SCALE, AMAX_BITS, tile, heads, length, stride_b, stride_h, stride_l,
    COLS: tl.constexpr, ROWS: tl.constexpr, CODE: tl.constexpr,
):
    """Tile ``tile`` of a (batch, heads, length, COLS) tensor, ROWS positions of one head: given
    AMAX_BITS, its amax there (atomic max of the magnitude bits); given CODES, its codes there
    (contiguous)."""
    per_head = tl.cdiv(length, ROWS)
    head = tile // per_head  # batch * heads + head
    l = (tile - head * per_head) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, COLS)
    inside = (l < length)[:, None]
    batch = head // heads
    origin = batch.to(tl.int64) * stride_b + (head - batch * heads).to(tl.int64) * stride_h
    x = tl.load(X + origin + l[:, None].to(tl.int64) * stride_l + c[None, :], mask=inside, other=0.0).to(tl.float32)
    if AMAX_BITS is not None:
        tl.atomic_max(AMAX_BITS, tl.max(tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 1), 0), sem="relaxed")
    if CODES is not None:
        codes = fp8_codes(x, tl.load(SCALE), CODE)
        tl.store(CODES + (head.to(tl.int64) * length + l[:, None]) * COLS + c[None, :], codes, mask=inside)


@triton.jit
def _pass_kernel(
    SCALE, AMAX_BITS,
    X0, CODES0, tiles0, heads0, length0, stride_b0, stride_h0, stride_l0,
    X1, CODES1, tiles1, heads1, length1, stride_b1, stride_h1, stride_l1,
    X2, CODES2, tiles2, heads2, length2, stride_b2, stride_h2, stride_l2,
    COLS0: tl.constexpr, COLS1: tl.constexpr, COLS2: tl.constexpr,
    ROWS: tl.constexpr, CODE: tl.constexpr,
):
    """One tile of up to three tensors (X1 and X2 None where absent): the first tiles0 programs
    take X0's tiles, the next tiles1 X1's, the rest X2's."""
    tile = tl.program_id(0)
    if tile < tiles0:
        _tile(X0, CODES0, SCALE, AMAX_BITS, tile, heads0, length0, stride_b0, stride_h0, stride_l0, COLS0, ROWS, CODE)
    elif X1 is not None:
        tile -= tiles0
        if tile < tiles1:
            _tile(X1, CODES1, SCALE, AMAX_BITS, tile, heads1, length1, stride_b1, stride_h1, stride_l1, COLS1, ROWS, CODE)
        elif X2 is not None:
            _tile(X2, CODES2, SCALE, AMAX_BITS, tile - tiles1, heads2, length2, stride_b2, stride_h2, stride_l2, COLS2, ROWS, CODE)


def _heads(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int, int, int, int]:
    """x (its last dim dense, else a copy) and its (batch, heads, length, dim) and the first three's
    strides, fewer dims counting as leading ones of one element; without a view, whose host time
    a call would pay per tensor."""
    if x.dim() < 2 or x.dim() > 4 or x.shape[-1] not in (16, 32, 64, 128, 256):
        raise ValueError(f"joint FP8 quantize kernels take tensors of 2 to 4 dims whose last has 16-256 elements, a power of two; got {tuple(x.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    leading = 4 - x.dim()
    shape, strides = (1,) * leading + tuple(x.shape), (0,) * leading + x.stride()
    return x, *shape, *strides[:3]


def _launch(tensors: list[torch.Tensor], amax_bits=None, codes=None, scale=None, fp8_dtype: str = "e4m3") -> None:
    """The pass over ``tensors`` that takes their amax into ``amax_bits`` and (or) casts them into
    ``codes``, ``_PER_LAUNCH`` a launch."""
    for start in range(0, len(tensors), _PER_LAUNCH):
        args, cols, programs = [], [], 0
        for i in range(start, start + _PER_LAUNCH):
            if i < len(tensors):
                x, b, h, length, d, *strides = _heads(tensors[i])
                tiles = b * h * ceil_div(length, _ROWS)
                args += [x, None if codes is None else codes[i], tiles, h, length, *strides]
                cols.append(d)
                programs += tiles
            else:
                args += [None, None, 0, 1, 1, 0, 0, 0]
                cols.append(16)
        if programs:
            launch(_pass_kernel, (programs,), scale, amax_bits, *args, *cols, _ROWS, _CODES[fp8_dtype], num_warps=4)


def joint_amax(tensors: list[torch.Tensor]) -> torch.Tensor:
    bits = torch.zeros((), dtype=torch.int32, device=tensors[0].device)
    _launch(tensors, bits)
    return bits.view(torch.float32)


def joint_cast(tensors: list[torch.Tensor], scale: torch.Tensor, fp8_dtype: str, transposed: list[bool], amax: bool):
    bits = torch.zeros((), dtype=torch.int32, device=tensors[0].device)
    dtype = fp8.FP8_DTYPES[fp8_dtype]
    codes = [torch.empty(x.shape, dtype=dtype, device=x.device) for x in tensors]
    _launch(tensors, bits if amax else None, codes, scale.reshape(1).float(), fp8_dtype)
    codes_t = [triton_transpose.transposed(c.view(-1, c.shape[-1])) for c, t in zip(codes, transposed) if t]
    return codes, codes_t, bits.view(torch.float32)
