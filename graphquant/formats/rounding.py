"""fp32 values rounded to bf16's or fp16's, in integer and fp32 ops that Inductor keeps.

Inductor fuses a ``.to(bf16)`` into the kernel that reads it and leaves the value unrounded in
fp32 (unless emulate_precision_casts), so a reference that rounds to a narrower dtype on the way
(autocast's operand casts, the Hadamard transform's output) spells the rounding out: compiled and
eager then give the same bits.
"""

from __future__ import annotations

import torch


def rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``x`` rounded to ``dtype``'s values, to nearest even (NaN kept), as fp32: bf16 and
    fp16 round; float32 and float64 hold every fp32 value, so x is as it is."""
    if dtype in (torch.float32, torch.float64):
        return x
    if dtype not in _ROUNDED:
        raise ValueError(f"graphquant rounds float32 values to bfloat16, float16, float32 or float64, not {dtype}")
    return _ROUNDED[dtype](x)


def rounds_to(dtype: torch.dtype) -> bool:
    """Whether ``rounded`` spells out the rounding to ``dtype``."""
    return dtype in _ROUNDED


def _significand_rounded(x: torch.Tensor, dropped: int) -> torch.Tensor:
    """fp32 x with its ``dropped`` low significand bits rounded away, to nearest even, as fp32
    (a carry into the exponent rounds up a binade, or to infinity)."""
    bits = x.view(torch.int32)
    half = (1 << (dropped - 1)) - 1
    return ((bits + half + ((bits >> dropped) & 1)) & -(1 << dropped)).view(torch.float32)


def _bf16_rounded(x: torch.Tensor) -> torch.Tensor:
    """fp32 x rounded to bf16's 8 significant bits (NaN kept), as fp32."""
    return torch.where(x.isnan(), x, _significand_rounded(x, 16))


def _fp16_rounded(x: torch.Tensor) -> torch.Tensor:
    """fp32 x rounded to fp16's values, to nearest even, as fp32: 11 significant bits in its
    normal range, steps of 2^-24 below it, infinity past its largest finite value (NaN kept)."""
    subnormal = torch.round(x * 2.0**24) * 2.0**-24
    rounded = torch.where(x.abs() < 2.0**-14, subnormal, _significand_rounded(x, 13))
    rounded = torch.where(rounded.abs() > torch.finfo(torch.float16).max, rounded.sign() * torch.inf, rounded)
    return torch.where(x.isnan(), x, rounded)


_ROUNDED = {torch.bfloat16: _bf16_rounded, torch.float16: _fp16_rounded}
