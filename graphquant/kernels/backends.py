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
import importlib.util
from typing import Callable, NamedTuple, Optional

import torch

from graphquant.kernels import emulation, scaled_mm
from graphquant.quantizers import (
    COLUMNWISE,
    ROWWISE,
    GemmInput,
    Quantizer,
    Representation,
    gemm_dims,
    output_rows,
    quantizer_classes,
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


class NativeGemm(NamedTuple):
    """A native GEMM: its backend name, the pairs of operand families (GemmInput.family) and of
    element encodings it multiplies, the multiple every one of m, n and k must be, and the compute
    capabilities torch._scaled_mm runs it on."""

    backend: str
    families: frozenset[tuple[str, str]]
    elements: frozenset[tuple[str, str]]
    multiple: int
    runs_on: Callable[[tuple[int, int]], bool]

    def takes(self, a: Optional[GemmInput], b: Optional[GemmInput]) -> bool:
        """Whether it multiplies operands read as ``a`` and ``b`` (None: no kernel reads it)."""
        if a is None or b is None:
            return False
        return (a.family, b.family) in self.families and (a.element, b.element) in self.elements


BOTH_E4M3 = frozenset({("e4m3", "e4m3")})

# torch._scaled_mm runs per-tensor and per-row FP8 from Hopper on (per-tensor with E5M2 on at most
# one side); DeepSeek-style block scales on sm90 alone, 1x128 blocks on the left; the
# block-scaled MXFP8 and NVFP4 paths from Blackwell on (sm100, sm120).
NATIVE_GEMMS = (
    NativeGemm(
        scaled_mm.TENSORWISE,
        frozenset({("fp8_tensorwise", "fp8_tensorwise")}),
        BOTH_E4M3 | {("e4m3", "e5m2"), ("e5m2", "e4m3")},
        16,
        lambda sm: sm >= (9, 0),
    ),
    NativeGemm(scaled_mm.ROWWISE_SCALED, frozenset({("fp8_rowwise", "fp8_rowwise")}), BOTH_E4M3, 16, lambda sm: sm >= (9, 0)),
    NativeGemm(
        scaled_mm.BLOCKWISE,
        frozenset({("fp8_block_1x128", "fp8_block_1x128"), ("fp8_block_1x128", "fp8_block_128x128")}),
        BOTH_E4M3,
        128,
        lambda sm: sm[0] == 9,
    ),
    NativeGemm(scaled_mm.MXFP8, frozenset({("mxfp8", "mxfp8")}), BOTH_E4M3, 128, lambda sm: sm >= (10, 0)),
    NativeGemm(scaled_mm.NVFP4, frozenset({("nvfp4", "nvfp4")}), frozenset({("e2m1", "e2m1")}), 128, lambda sm: sm >= (10, 0)),
)


def grouped_unsupported(quantizer: Quantizer) -> Optional[str]:
    """Why ``quantizer`` cannot quantize a grouped_linear slot yet, or None if it can."""
    for child in dict.fromkeys(quantizer.child(direction) for direction in (ROWWISE, COLUMNWISE)):
        if child.reduces_amax:
            return f"{child}: torch._grouped_mm does not all-reduce its per-group amaxes yet; use with_amax_reduction=False"
        if child.stochastic:
            return (
                f"{child}: stochastic rounding on torch._grouped_mm would draw other bits than each expert's "
                "tensor alone; use stochastic_rounding=False for grouped_linear slots"
            )
        if not child.groupable:
            names = ", ".join(cls.__name__ for cls in quantizer_classes() if cls.groupable)
            return f"{child} is not supported for torch._grouped_mm yet; use {names} (or a HybridQuantizer of them)"
    return None


SCALED_GROUPED_MM = "torch._scaled_grouped_mm fp8 rowwise"
_ROW_SCALED_FAMILIES = ("fp8_tensorwise", "fp8_rowwise")  # a per-tensor scale is a per-row one repeated
# Formats whose emulated values leave out a per-group or per-row factor (Quantizer.grouped_factor).
_FACTORED_FAMILIES = (*_ROW_SCALED_FAMILIES, "nvfp4", "nvfp4_row_scaled")


def select_grouped(
    a: Quantizer, a_direction: str, b: Quantizer, b_direction: str, device: torch.device, k: Optional[int]
) -> Selection:
    """``select`` for a GEMM of a torch._grouped_mm site whose x has ``k`` columns (None where
    unknown): native where torch._scaled_grouped_mm (sm90, sm100) multiplies the pair, E4M3 on
    both sides with per-tensor or per-row scales (each group's scale repeated over its rows) and
    k a multiple of 16 (its other dims are padded to 128); otherwise emulated, one grouped product."""
    selection = select(a, a_direction, b, b_direction, device)
    if selection.bucket == REJECTED or selection.backend == HIGH_PRECISION:
        return selection
    sm = capability(device)
    if sm is None:
        return Selection(EMULATED, EMULATION, selection.reason)
    inputs = (a.gemm_input(a_direction), b.gemm_input(b_direction))
    row_scaled = all(i is not None and i.family in _ROW_SCALED_FAMILIES and i.element == "e4m3" for i in inputs)
    if row_scaled and sm[0] in (9, 10) and hasattr(torch, "_scaled_grouped_mm"):
        if k is not None and k % 16 == 0:
            return Selection(NATIVE, SCALED_GROUPED_MM)
        return Selection(EMULATED, EMULATION, f"torch._scaled_grouped_mm needs x's columns a multiple of 16; got {k}")
    reason = f"torch._scaled_grouped_mm multiplies E4M3 with per-tensor or per-row scales only, not {a.tag} x {b.tag}"
    if importlib.util.find_spec("triton") is None and any(i is not None and i.family in _FACTORED_FAMILIES for i in inputs):
        reason += "; without Triton, the fp32 product its scales need reads the group offsets on the host (torch._grouped_mm)"
    return Selection(EMULATED, EMULATION, reason)


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
    if a.high_precision and b.high_precision:
        return Selection(NATIVE, HIGH_PRECISION)
    sm = capability(device)
    if sm is None:
        return Selection(EMULATED, EMULATION, f"no low-precision GEMM on {device.type}")
    a_input, b_input = a.gemm_input(a_direction), b.gemm_input(b_direction)
    for native in NATIVE_GEMMS:
        if native.runs_on(sm) and native.takes(a_input, b_input):
            backend, multiple = native.backend, native.multiple
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
