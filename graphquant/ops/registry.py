"""How graphquant's ops are registered: torch.library's dispatcher API, not torch.library.custom_op.

custom_op wraps every call in Python layers (autograd, a redispatch, output alias checks), host
time that a model of short GPU steps pays on every op call (benchmarks/host_overhead.py).
graphquant's ops are not differentiable (graphquant.ops.quantized_gemm composes them into a GEMM's
autograd formula), so the dispatcher's own autograd fallback (C++) serves their Autograd key, and
a call costs the dispatcher's conversion of its arguments and the kernel's own Python. Called
directly on tensors that require grad, an op records nothing through its internals, and a
backward through it gets PyTorch's warning that the op has no autograd kernel, and no gradient.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

LIBRARY = torch.library.Library("graphquant", "DEF")
OPS: list[torch._ops.OpOverloadPacket] = []  # every op defined here, in order


def _untracked(fn: Callable) -> Callable:
    """``fn`` run without autograd recording: the fallback runs a kernel with grad mode as the
    caller had it, so the torch ops inside (the reference numerics) would otherwise build a
    graph through it. In graphquant's compiled graphs grad mode is off and this costs one check."""

    @functools.wraps(fn)
    def kernel(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        with torch.no_grad():
            return fn(*args, **kwargs)

    return kernel


def op(name: str, *, tags: tuple[torch.Tag, ...] = ()) -> Callable[[Callable], torch._ops.OpOverloadPacket]:
    """Define graphquant::``name`` with the schema of the decorated function's annotations (no
    argument mutated) and the function as its kernel on every device; gives the op. Tagged
    pt2-compliant, as custom_op tags its ops: they trace through torch.compile."""

    def define(fn: Callable) -> torch._ops.OpOverloadPacket:
        schema = name + torch.library.infer_schema(fn, mutates_args=())
        LIBRARY.define(schema, tags=(torch.Tag.pt2_compliant_tag, *tags))
        LIBRARY.impl(name, _untracked(fn), "CompositeExplicitAutograd")
        OPS.append(getattr(torch.ops.graphquant, name))
        return OPS[-1]

    return define


def fake(name: str) -> Callable[[Callable], Callable]:
    """Register the decorated function as graphquant::``name``'s fake (shapes and dtypes only)."""
    return torch.library.register_fake(f"graphquant::{name}", lib=LIBRARY)


def cuda_kernel(name: str) -> Callable[[Callable], Callable]:
    """Register the decorated function as graphquant::``name``'s kernel for CUDA tensors."""

    def register(fn: Callable) -> Callable:
        LIBRARY.impl(name, _untracked(fn), "CUDA")
        return fn

    return register
