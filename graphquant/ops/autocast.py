"""torch.autocast for the functions a rewritten graph calls in place of GEMMs and attention.

Autocast casts a matmul's or attention's floating operands to its dtype (bf16 or fp16) and the
result comes out in it. The graph's custom ops have no autocast kernels, so the functions do it
themselves: the operands are cast before they are quantized (TransformerEngine quantizes the
cast values too), and autocast is off inside, so that nothing the function runs is cast again.
It is read while the graph is traced: Dynamo guards the compiled graph on the autocast state.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch


def dtype_for(x: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype autocast casts a GEMM's operands on x's device to, or None where it is off."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` with its rounding made in integer and fp32 ops Inductor keeps: Inductor
    fuses a ``.to(bf16)`` into the quantize that reads it and leaves the value in fp32 (unless
    emulate_precision_casts), which would quantize float32 master weights other than their bf16
    copy. The gradient passes as ``.to``'s does, rounded to ``dtype`` as eagerly."""
    if x.dtype == dtype or dtype not in _ROUNDED or not x.is_floating_point():
        return x.to(dtype)
    return _RoundedCast.apply(x, dtype)


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


class _RoundedCast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.dtype = x.dtype
        return _ROUNDED[dtype](x.float()).to(dtype)  # exact: the value is one of dtype's

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # grad is of the cast's dtype, but where Inductor made it (a bias gradient's sum) it may
        # hold its fp32 value unrounded: rounded here, so that float32 master weights get the
        # bits of their bf16 copy's gradient
        return _ROUNDED[grad.dtype](grad.float()).to(ctx.dtype), None


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, tuple):
        return tuple(_cast(v, dtype) for v in value)
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64:  # autocast leaves float64 as it is
        return cast(value, dtype)
    return value


def operands_cast(fn: Callable) -> Callable:
    """``fn`` with every floating tensor among its positional arguments, in tuples too, cast as
    autocast casts a GEMM's (on the first tensor's device), and autocast off inside."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        first = next(a for a in args if isinstance(a, torch.Tensor))
        dtype = dtype_for(first)
        if dtype is None:
            return fn(*args, **kwargs)
        with torch.autocast(first.device.type, enabled=False):
            return fn(*_cast(args, dtype), **kwargs)

    return run
