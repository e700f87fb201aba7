"""Factories that mirror TransformerEngine's built-in recipes, role by role.

Each returns a fresh quantizer per call, accepts ``role=None``, and is a module-level function so
recipes built from it pickle. They also serve as children of HybridQuantizers.
"""

from __future__ import annotations

from typing import Optional

from graphquant.quantizers import (
    DelayedScalingRequest,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)
from graphquant.roles import QuantizerRole

GEMM_MODULES = ("linear", "grouped_linear")


def is_weight(role: Optional[QuantizerRole]) -> bool:
    return role is not None and role.module_type in GEMM_MODULES and role.tensor_type == "weight"


def is_gradient(role: Optional[QuantizerRole]) -> bool:
    return role is not None and role.tensor_type == "grad_output"


def high_precision_factory(role: Optional[QuantizerRole]) -> IdentityQuantizer:
    """Every slot in high precision."""
    return IdentityQuantizer()


def delayed_scaling_factory(
    role: Optional[QuantizerRole],
    *,
    margin: int = 0,
    amax_history_len: int = 1024,
    amax_compute_algo: str = "max",
) -> DelayedScalingRequest:
    """Per-tensor FP8 with delayed scaling; E4M3 forward, E5M2 grad_output (HYBRID)."""
    return DelayedScalingRequest(
        fp8_format="HYBRID", margin=margin, amax_history_len=amax_history_len, amax_compute_algo=amax_compute_algo
    )


def current_scaling_factory(role: Optional[QuantizerRole]) -> Float8CurrentScalingQuantizer:
    """Per-tensor FP8 with current scaling: E5M2 for grad_output, E4M3 otherwise."""
    return Float8CurrentScalingQuantizer(fp8_dtype="e5m2" if is_gradient(role) else "e4m3")


def float8_block_scaling_factory(role: Optional[QuantizerRole]) -> Float8BlockQuantizer:
    """E4M3 blocks with power-of-two scales: 128x128 tiles for weights, 1x128 for everything else."""
    return Float8BlockQuantizer(fp8_dtype="e4m3", block_scaling_dim=2 if is_weight(role) else 1)


def mxfp8_factory(role: Optional[QuantizerRole]) -> MXFP8Quantizer:
    """MXFP8 E4M3 for every slot."""
    return MXFP8Quantizer(fp8_dtype="e4m3")


def nvfp4_factory(role: Optional[QuantizerRole]) -> NVFP4Quantizer:
    """NVFP4 as TE's recipe sets it: weights 16x16 tiles without RHT; grad_output 1x16 with RHT and
    stochastic rounding; every other slot 1x16 with RHT (applied to the columnwise side only).

    The right operand of an activation x activation matmul (``other``, graphquant's own role)
    feeds dgrad with its columnwise side, opposite grad_output's rowwise one, so like a weight it
    gets no transform there: 1x16 blocks, no RHT.
    """
    if is_weight(role):
        return NVFP4Quantizer(with_2d_quantization=True)
    if role is not None and role.module_type == "matmul" and role.tensor_type == "other":
        return NVFP4Quantizer()
    return NVFP4Quantizer(with_rht=True, with_post_rht_amax=True, stochastic_rounding=is_gradient(role))
