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


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, tuple):
        return tuple(_cast(v, dtype) for v in value)
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
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
