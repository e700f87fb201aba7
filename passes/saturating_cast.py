"""Pass 4 (Inductor, post-grad): drop the clamp in front of a float32 -> FP8 cast that saturates.

The reference casts as ``clamp(x, -max, max).to(fp8)`` (formats.fp8.cast_to_fp8), because torch's
own conversion overflows (e5m2 to inf, e4m3fn to NaN). On CUDA devices of compute capability 8.9
and later, Inductor's Triton code converts float32 to FP8 with PTX's ``cvt.rn.satfinite`` (the only
form PTX has for FP8): beyond +-max, infinities included, it gives +-max and NaN stays NaN, which
is what the clamp does. The clamp costs Triton a NaN-propagating max and min (compare, NaN test
and select, twice) an element, in kernels that the GPU's power cap makes compute-bound, such as
a SwiGLU's gradient casts between FP8 GEMMs (benchmarks/saturating_cast.py times them).

Expects: a post-grad ATen graph (the graph Inductor lowers), nodes carrying ``meta["val"]``.
Guarantees: every ``prims.convert_element_type(clamp(x, -max, max), fp8)`` whose x is float32 on a
CUDA device that saturates reads x instead; clamps left without users are erased. Nothing else
changes, and the bits the graph computes are the same.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from graphquant.formats.fp8 import FP8_DTYPES, fp8_max
from graphquant.passes.chained_pass import ChainedPass

aten, prims = torch.ops.aten, torch.ops.prims
_LIMITS = {dtype: fp8_max(name) for name, dtype in FP8_DTYPES.items()}


def cuda_saturates(device: torch.device) -> bool:
    """Whether Inductor's code converts float32 to FP8 on ``device`` with PTX's saturating cvt."""
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device) >= (8, 9)


def _unclamped(node: fx.Node, limit: float) -> Optional[fx.Node]:
    """x where ``node`` is clamp(x, -limit, limit), in any of the forms decompositions leave."""
    if node.op != "call_function":
        return None
    if node.target == aten.clamp.default and tuple(node.args[1:]) == (-limit, limit):
        return node.args[0]
    bounds = {aten.clamp_min.default: -limit, aten.clamp_max.default: limit}
    if node.target not in bounds or node.args[1] != bounds[node.target]:
        return None
    inner = node.args[0]
    if not isinstance(inner, fx.Node) or inner.op != "call_function":
        return None
    other = aten.clamp_max.default if node.target == aten.clamp_min.default else aten.clamp_min.default
    if inner.target == other and inner.args[1] == bounds[other]:
        return inner.args[0]
    return None


def drop_saturated_clamps(graph: fx.Graph, saturates: Callable[[torch.device], bool] = cuda_saturates) -> int:
    """The pass itself; returns how many casts now read their input unclamped."""
    dropped = 0
    for cast in graph.find_nodes(op="call_function", target=prims.convert_element_type.default):
        limit = _LIMITS.get(cast.args[1])
        clamped = cast.args[0]
        source = _unclamped(clamped, limit) if limit is not None and isinstance(clamped, fx.Node) else None
        value = source.meta.get("val") if isinstance(source, fx.Node) else None
        if not isinstance(value, torch.Tensor) or value.dtype != torch.float32 or not saturates(value.device):
            continue
        cast.replace_input_with(clamped, source)
        dropped += 1
        while clamped is not source and not clamped.users:
            inner = clamped.args[0]
            graph.erase_node(clamped)
            clamped = inner
    return dropped


class SaturatingCast(ChainedPass, CustomGraphPass):
    """``drop_saturated_clamps`` as Inductor's post-grad custom pass, then ``then`` (a pass the user
    configured there, kept)."""

    def __call__(self, graph: fx.Graph) -> None:
        drop_saturated_clamps(graph)
        if self.then is not None:
            self.then(graph)
