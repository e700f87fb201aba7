"""GEMM backends: how a pair of representations is multiplied on this device.

``select`` classifies an operand pair (each operand given as the quantizer that makes its
direction) into native / emulated / rejected and names the backend; the planner shows that
choice and ``gemm`` runs exactly it. Native backends are cuBLASLt (scaled_mm: through
torch._scaled_mm, and per-tensor FP8 through graphquant's own call with a timed algorithm
choice). The emulated backend dequantizes both operands exactly and multiplies them in high
precision; it runs every pair the planner admits, on any device.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple, Optional

import torch

from graphquant.kernels import emulation, scaled_mm
from graphquant.quantizers import (
    ROWWISE,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8DelayedScalingQuantizer,
    Float8RowwiseQuantizer,
    HybridQuantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    Quantizer,
    Representation,
    gemm_dims,
    output_rows,
)

NATIVE = "native"
EMULATED = "emulated"
REJECTED = "rejected"

HIGH_PRECISION = "high-precision matmul"
EMULATION = "dequantize + high-precision matmul"


@dataclasses.dataclass(frozen=True)
class Selection:
    """How one GEMM will run: its bucket, the backend's name, and why when it is not native."""

    bucket: str
    backend: str
    reason: str = ""


PER_TENSOR = (Float8CurrentScalingQuantizer, Float8DelayedScalingQuantizer)


class NativeGemm(NamedTuple):
    """A native GEMM: its backend name, the operand pairs it takes, the multiple every one of m, n
    and k must be, and the compute capabilities torch._scaled_mm runs it on."""

    backend: str
    fits: Callable[[Quantizer, str, Quantizer, str], bool]
    multiple: int
    runs_on: Callable[[tuple[int, int]], bool]


# torch._scaled_mm runs per-tensor and per-row FP8 from Hopper on; DeepSeek-style block scales
# on sm90 alone; the block-scaled MXFP8 and NVFP4 paths from Blackwell on (sm100, sm120).
NATIVE_GEMMS = (
    NativeGemm(
        scaled_mm.TENSORWISE,
        lambda a, da, b, db: isinstance(a, PER_TENSOR)
        and isinstance(b, PER_TENSOR)
        and not (a.fp8_dtype == b.fp8_dtype == "e5m2"),
        16,
        lambda sm: sm >= (9, 0),
    ),
    NativeGemm(
        scaled_mm.ROWWISE_SCALED,
        lambda a, da, b, db: isinstance(a, Float8RowwiseQuantizer)
        and isinstance(b, Float8RowwiseQuantizer)
        and a.fp8_dtype == b.fp8_dtype == "e4m3",
        16,
        lambda sm: sm >= (9, 0),
    ),
    NativeGemm(
        scaled_mm.BLOCKWISE,
        lambda a, da, b, db: isinstance(a, Float8BlockQuantizer)
        and isinstance(b, Float8BlockQuantizer)
        and a.block_scaling_dim == 1
        and a.fp8_dtype == b.fp8_dtype == "e4m3",
        128,
        lambda sm: sm[0] == 9,
    ),
    NativeGemm(
        scaled_mm.MXFP8,
        lambda a, da, b, db: isinstance(a, MXFP8Quantizer) and isinstance(b, MXFP8Quantizer) and a.fp8_dtype == b.fp8_dtype == "e4m3",
        128,
        lambda sm: sm >= (10, 0),
    ),
    NativeGemm(
        scaled_mm.NVFP4,
        lambda a, da, b, db: isinstance(a, NVFP4Quantizer)
        and isinstance(b, NVFP4Quantizer)
        and not (a.row_scaled_nvfp4 and da == ROWWISE)
        and not (b.row_scaled_nvfp4 and db == ROWWISE),
        128,
        lambda sm: sm >= (10, 0),
    ),
)


# The formats a grouped GEMM takes: per-tensor scales, or block scales along the rows, which split
# into the groups' rows as they are (graphquant.ops.grouped, native.grouped_quantize).
GROUPED_FORMATS = (IdentityQuantizer, Float8CurrentScalingQuantizer, MXFP8Quantizer)


def grouped_unsupported(quantizer: Quantizer) -> Optional[str]:
    """Why ``quantizer`` cannot quantize a grouped_linear slot yet, or None if it can."""
    children = (quantizer.rowwise_quantizer, quantizer.columnwise_quantizer) if isinstance(quantizer, HybridQuantizer) else (quantizer,)
    for child in children:
        if child.reduces_amax:
            return f"{child}: torch._grouped_mm does not all-reduce its per-group amaxes yet; use with_amax_reduction=False"
        if not isinstance(child, GROUPED_FORMATS):
            names = ", ".join(t.__name__ for t in GROUPED_FORMATS)
            return f"{child} is not supported for torch._grouped_mm yet; use {names} (or a HybridQuantizer of them)"
    return None


def capability(device: torch.device) -> Optional[tuple[int, int]]:
    """The compute capability whose low-precision GEMMs run on ``device``; None where none do."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


@functools.lru_cache(maxsize=4096)
def select(
    a: Quantizer,
    a_direction: str,
    b: Quantizer,
    b_direction: str,
    device: torch.device,
    dims: Optional[tuple[Optional[int], Optional[int], Optional[int]]] = None,
    batch: Optional[int] = 1,
    fast_accumulation: bool = False,
) -> Selection:
    """Classify the pair for ``device``; ``dims`` is (m, n, k) of each group's out[m, n] = A @ B^T
    (None where unknown), ``batch`` the number of groups. ``fast_accumulation``: the recipe lets
    this GEMM sum in the tensor cores' accumulator (CustomRecipe.fast_accumulation), which the
    per-tensor and per-row FP8 GEMMs then do."""
    if a.hadamard(a_direction) != b.hadamard(b_direction):
        with_rht = a if a.hadamard(a_direction) else b
        return Selection(
            REJECTED,
            "none",
            f"only one operand ({with_rht}) went through a Hadamard transform, so the product would be "
            "wrong; give both operands of this GEMM the transform (e.g. nvfp4_factory for input and "
            "grad_output) or neither",
        )
    if isinstance(a, IdentityQuantizer) and isinstance(b, IdentityQuantizer):
        return Selection(NATIVE, HIGH_PRECISION)
    sm = capability(device)
    if sm is None:
        return Selection(EMULATED, EMULATION, f"no low-precision GEMM on {device.type}")
    for backend, fits, multiple, runs_on in NATIVE_GEMMS:
        if runs_on(sm) and fits(a, a_direction, b, b_direction):
            if batch != 1:
                return Selection(EMULATED, EMULATION, f"{backend} multiplies one matrix pair, not a batch of {batch}")
            if dims is not None and any(d is not None and d % multiple for d in dims):
                return Selection(
                    EMULATED, EMULATION, f"{backend} needs m, n, k multiples of {multiple}; got {dims}"
                )
            if fast_accumulation and backend in (scaled_mm.TENSORWISE, scaled_mm.ROWWISE_SCALED):
                backend += scaled_mm.FAST_ACCUMULATION
            return Selection(NATIVE, backend)
    if type(a) is not type(b):
        return Selection(EMULATED, EMULATION, f"no GEMM multiplies {a.tag} by {b.tag}")
    return Selection(EMULATED, EMULATION, f"no native {a.tag} x {b.tag} GEMM on sm_{sm[0]}{sm[1]}")


def gemm(
    a: Representation,
    b: Representation,
    batch: int,
    out_dtype: torch.dtype,
    bias: Optional[torch.Tensor] = None,
    fast_accumulation: bool = False,
) -> torch.Tensor:
    """(batch, m, n): out[g] = A[g] @ B[g]^T (+ bias, one group only) on the backend ``select``
    names for this pair; every backend adds the bias before rounding to out_dtype."""
    n = output_rows(b.direction, b.shape, batch)
    if bias is not None and (batch != 1 or bias.shape != (n,)):
        raise ValueError(
            f"a GEMM's bias must have the shape ({n},) of its output's last dim, and the GEMM one group; "
            f"got a bias of shape {tuple(bias.shape)} for {batch} group(s)"
        )
    selection = select(
        a.quantizer, a.direction, b.quantizer, b.direction, a.data.device, gemm_dims(a, b, batch), batch, fast_accumulation
    )
    if selection.bucket == NATIVE and selection.backend != HIGH_PRECISION:
        return scaled_mm.run(selection.backend, a, b, out_dtype, bias).unsqueeze(0)
    return emulation.gemm(a, b, batch, out_dtype, bias)
