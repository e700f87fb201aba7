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

from graphquant.formats import rounding


def dtype_for(x: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype autocast casts a GEMM's operands on x's device to, or None where it is off."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` with its rounding made in integer and fp32 ops Inductor keeps: Inductor
    fuses a ``.to(bf16)`` into the quantize that reads it and leaves the value in fp32 (unless
    emulate_precision_casts), which would quantize float32 master weights other than their bf16
    copy. The gradient passes as ``.to``'s does, rounded to ``dtype`` as eagerly."""
    if x.dtype == dtype or not rounding.rounds_to(dtype) or not x.is_floating_point():
        return x.to(dtype)
    return _RoundedCast.apply(x, dtype)


class _RoundedCast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.dtype = x.dtype
        return rounding.rounded(x.float(), dtype).to(dtype)  # exact: the value is one of dtype's

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # grad is of the cast's dtype, but where Inductor made it (a bias gradient's sum) it may
        # hold its fp32 value unrounded: rounded here, so that float32 master weights get the
        # bits of their bf16 copy's gradient
        return rounding.rounded(grad.float(), grad.dtype).to(ctx.dtype), None


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
