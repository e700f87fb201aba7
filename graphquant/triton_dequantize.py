"""CUDA dequantization of MXFP8 and NVFP4 for the emulated GEMM, one Triton launch each.

Each writes bf16 values that are exactly the reference's (see graphquant.emulation.factored):
MXFP8 codes times their power-of-two scale, NVFP4 E2M1 codes times their E4M3 block scale (the
global amax stays out, applied to the product). Products of so few significant bits are exact
in fp32 and in bf16, so no rounding happens anywhere here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048


@triton.jit
def _mxfp8_kernel(data_ptr, scale_ptr, out_ptr, n, cols, ROWWISE: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    row, col = offsets // cols, offsets % cols
    if ROWWISE:
        scale_index = row * (cols // 32) + col // 32
    else:
        scale_index = (row // 32) * cols + col
    biased = tl.load(scale_ptr + scale_index, mask=mask, other=127).to(tl.int32)
    scale = tl.where(biased == 0, 0x00400000, biased << 23).to(tl.float32, bitcast=True)
    scale = tl.where(biased == 255, float("nan"), scale)
    values = tl.load(data_ptr + offsets, mask=mask, other=0.0).to(tl.float32) * scale
    tl.store(out_ptr + offsets, values.to(tl.bfloat16), mask=mask)


@triton.jit
def _nvfp4_kernel(packed_ptr, scale_ptr, out_ptr, n, cols, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    row, col = offsets // cols, offsets % cols
    byte = tl.load(packed_ptr + row * (cols // 2) + col // 2, mask=mask, other=0).to(tl.int32)
    code = tl.where(col % 2 == 0, byte & 0xF, byte >> 4)
    exponent, mantissa = (code >> 1) & 3, code & 1
    magnitude = tl.where(exponent == 0, mantissa * 0.5, (1.0 + mantissa * 0.5) * (1 << (exponent - 1)).to(tl.float32))
    value = tl.where(code >= 8, -magnitude, magnitude)
    scale = tl.load(scale_ptr + row * (cols // 16) + col // 16, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, (value * scale).to(tl.bfloat16), mask=mask)


def mxfp8_values(data: torch.Tensor, scale: torch.Tensor, *, rowwise: bool) -> torch.Tensor:
    """bf16 values of MXFP8 ``data`` (stored orientation) with E8M0 ``scale``."""
    data, scale = data.contiguous(), scale.contiguous()
    out = torch.empty(data.shape, dtype=torch.bfloat16, device=data.device)
    n = data.numel()
    _mxfp8_kernel[(triton.cdiv(n, _BLOCK),)](data, scale, out, n, data.shape[1], ROWWISE=rowwise, BLOCK=_BLOCK)
    return out


def nvfp4_block_values(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """bf16 q * s of NVFP4 ``packed`` codes with E4M3 block ``scale`` (no global factor)."""
    packed, scale = packed.contiguous(), scale.contiguous()
    rows, cols = packed.shape[0], packed.shape[1] * 2
    out = torch.empty((rows, cols), dtype=torch.bfloat16, device=packed.device)
    n = rows * cols
    _nvfp4_kernel[(triton.cdiv(n, _BLOCK),)](packed, scale, out, n, cols, BLOCK=_BLOCK)
    return out
