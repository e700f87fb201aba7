"""GEMM backends: how a pair of representations is multiplied on this device.

The emulated backend dequantizes both operands exactly and multiplies them in float32; it runs
every pair the planner admits, on any device, and is what CPU always uses.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from graphquant.quantizers import ROWWISE, IdentityQuantizer, Quantizer, Representation


def output_rows(direction: str, shape: Sequence[int], batch: int) -> int:
    """Rows an operand contributes to each group's output (its non-reduced extent)."""
    return int(shape[0]) // batch if direction == ROWWISE else int(shape[1])


def grouped_operand(rep: Representation, batch: int) -> torch.Tensor:
    """(batch, rows, K): a rowwise operand groups its rows, a columnwise one its reduction dim."""
    values = rep.gemm_operand(torch.float32)
    rows, k = values.shape
    if rep.direction == ROWWISE:
        return values.reshape(batch, rows // batch, k)
    return values.reshape(rows, batch, k // batch).permute(1, 0, 2)


def emulated_gemm(a: Representation, b: Representation, batch: int, out_dtype: torch.dtype) -> torch.Tensor:
    return torch.bmm(grouped_operand(a, batch), grouped_operand(b, batch).transpose(1, 2)).to(out_dtype)


def gemm(a: Representation, b: Representation, batch: int, out_dtype: torch.dtype) -> torch.Tensor:
    return emulated_gemm(a, b, batch, out_dtype)


NATIVE = "native"
EMULATED = "emulated"
REJECTED = "rejected"


@dataclasses.dataclass(frozen=True)
class Selection:
    """How one GEMM will run: its bucket, the backend's name, and why when it is not native."""

    bucket: str
    backend: str
    reason: str = ""


def select(a: Quantizer, a_direction: str, b: Quantizer, b_direction: str, device: torch.device) -> Selection:
    """Classify the operand pair (each the quantizer that makes that direction) for ``device``."""
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
        return Selection(NATIVE, "high-precision matmul")
    return Selection(EMULATED, "dequantize + fp32 matmul", _why_emulated(a, b, device))


def _why_emulated(a: Quantizer, b: Quantizer, device: torch.device) -> str:
    if device.type != "cuda":
        return f"no low-precision GEMM on {device.type}"
    if type(a) is not type(b):
        return f"no GEMM multiplies {a.tag} by {b.tag}"
    return f"no native {a.tag} GEMM on this device"
