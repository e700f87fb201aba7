"""Recipe zoo: factories that mix formats per role and direction.

The first seven are TransformerEngine's zoo (illustrative, not validated by TE either); then a
DeepSeek-style blockwise recipe and three torchao-equivalent FP8 recipes. Every factory builds
fresh quantizers per call, accepts role=None, and is module level so recipes pickle. "linear"
below means module_type "linear" or "grouped_linear". TE has no activation x activation matmul;
the recipes that name their forward's and backward's formats give one the roles of a linear, its
right operand (other) the weight's (_as_linear), so that its dgrad and wgrad run the formats the
recipe names for them.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from typing import Optional

from graphquant.factories import GEMM_MODULES, is_gradient, nvfp4_factory
from graphquant.quantizers import (
    DelayedScalingRequest,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8RowwiseQuantizer,
    HybridQuantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    Quantizer,
)
from graphquant import recipes
from graphquant.recipes import CustomRecipe
from graphquant.roles import QuantizerRole


def _tensor_type(role: Optional[QuantizerRole], module_types: tuple[str, ...] = GEMM_MODULES) -> str:
    """The role's tensor_type if it belongs to one of ``module_types``, else ""."""
    return role.tensor_type if role is not None and role.module_type in module_types else ""


def _as_linear(role: Optional[QuantizerRole]) -> str:
    """The tensor type ``role`` plays in a linear's terms: a linear's or grouped linear's own, and
    an activation x activation matmul's with its right operand (other) as the weight, so that a
    recipe's fprop, dgrad and wgrad mean the same GEMMs there ("" for other module types)."""
    if role is not None and role.module_type == "matmul":
        return "weight" if role.tensor_type == "other" else role.tensor_type
    return _tensor_type(role)


def _plain_nvfp4(row_scaled: bool = False) -> NVFP4Quantizer:
    return NVFP4Quantizer(row_scaled_nvfp4=row_scaled)


def high_precision_fwd_mxfp8_bwd_factory(role: Optional[QuantizerRole]) -> Quantizer:
    """BF16 fprop, MXFP8 dgrad and wgrad.

    linear grad_output: MXFP8 both directions. Every other role: rowwise Identity (fprop in high
    precision), columnwise MXFP8 from the original tensor.
    """
    if _as_linear(role) == "grad_output":
        return MXFP8Quantizer()
    return HybridQuantizer(
        rowwise_quantizer=IdentityQuantizer(), columnwise_quantizer=MXFP8Quantizer(), columnwise_source="original"
    )


def mxfp8_fwd_nvfp4_bwd_factory(role: Optional[QuantizerRole]) -> Quantizer:
    """MXFP8 fprop, NVFP4 dgrad and wgrad.

    input: rowwise MXFP8 (fprop), columnwise NVFP4 with RHT (wgrad), from the original.
    weight: rowwise MXFP8 (fprop), columnwise plain NVFP4 (dgrad) from the dequantized MXFP8.
    grad_output: nvfp4_factory (rowwise plain for dgrad; columnwise RHT + stochastic rounding).
    Other roles: MXFP8.
    """
    tensor_type = _as_linear(role)
    if tensor_type == "input":
        return HybridQuantizer(
            rowwise_quantizer=MXFP8Quantizer(), columnwise_quantizer=nvfp4_factory(role), columnwise_source="original"
        )
    if tensor_type == "weight":
        return HybridQuantizer(
            rowwise_quantizer=MXFP8Quantizer(),
            columnwise_quantizer=_plain_nvfp4(),
            columnwise_source="rowwise_dequantized",
        )
    if tensor_type == "grad_output":
        return nvfp4_factory(role)
    return MXFP8Quantizer()


def nvfp4_1d_weight_factory(role: Optional[QuantizerRole]) -> Quantizer:
    """NVFP4 with 1x16 weight blocks instead of 16x16 tiles.

    weight: plain NVFP4 rowwise, and the columnwise NVFP4 quantized again from the dequantized
    rowwise (double quantization of W^T). Everything else: nvfp4_factory.
    """
    if _tensor_type(role) == "weight":
        return HybridQuantizer(
            rowwise_quantizer=_plain_nvfp4(), columnwise_quantizer=_plain_nvfp4(), columnwise_source="rowwise_dequantized"
        )
    return nvfp4_factory(role)


def mxfp8_fwd_high_precision_bwd_factory(role: Optional[QuantizerRole]) -> Quantizer:
    """MXFP8 fprop; dgrad and wgrad in high precision on the values the forward used.

    input, weight: rowwise MXFP8, columnwise Identity of the dequantized MXFP8.
    grad_output: Identity. Other roles: MXFP8.
    """
    tensor_type = _as_linear(role)
    if tensor_type in ("input", "weight"):
        return HybridQuantizer(
            rowwise_quantizer=MXFP8Quantizer(), columnwise_quantizer=IdentityQuantizer(), columnwise_source="rowwise_dequantized"
        )
    if tensor_type == "grad_output":
        return IdentityQuantizer()
    return MXFP8Quantizer()


def nvfp4_row_scaled_fwd_mxfp8_bwd_factory(role: Optional[QuantizerRole]) -> Quantizer:
    """Row-scaled NVFP4 fprop and MXFP8 backward for MoE experts (grouped_linear only).

    grouped_linear input: rowwise row-scaled NVFP4, columnwise MXFP8 of the dequantized rowwise.
    grouped_linear weight: rowwise plain NVFP4, columnwise MXFP8 of the dequantized rowwise.
    grouped_linear grad_output, plain linear and every other role: MXFP8.
    """
    tensor_type = _tensor_type(role, ("grouped_linear",))
    if tensor_type in ("input", "weight"):
        return HybridQuantizer(
            rowwise_quantizer=_plain_nvfp4(row_scaled=tensor_type == "input"),
            columnwise_quantizer=MXFP8Quantizer(),
            columnwise_source="rowwise_dequantized",
        )
    return MXFP8Quantizer()


def nvfp4_row_scaled_fwd_high_precision_bwd_factory(role: Optional[QuantizerRole]) -> Quantizer:
    """Row-scaled NVFP4 fprop; backward in high precision on the values the forward used.

    input: rowwise row-scaled NVFP4, columnwise Identity of the dequantized rowwise.
    weight: rowwise plain NVFP4, columnwise Identity of the dequantized rowwise.
    grad_output: Identity. Other roles: plain NVFP4.
    """
    tensor_type = _as_linear(role)
    if tensor_type in ("input", "weight"):
        return HybridQuantizer(
            rowwise_quantizer=_plain_nvfp4(row_scaled=tensor_type == "input"),
            columnwise_quantizer=IdentityQuantizer(),
            columnwise_source="rowwise_dequantized",
        )
    if tensor_type == "grad_output":
        return IdentityQuantizer()
    return _plain_nvfp4()


def is_attention(role: Optional[QuantizerRole]) -> bool:
    """Whether ``role`` is one of attention's: a dpa role, or a hint-only boundary role."""
    return role is not None and (role.module_type == "dpa" or bool(role.hint))


def fp8_attention_factory(role: Optional[QuantizerRole]) -> Quantizer | DelayedScalingRequest:
    """Attention as TE's validated combination quantizes it (asked only for attention's roles).

    s and dp: delayed scaling (history 1, most recent; the plan scales P, s's tensor, by its
    bound instead: kernels.backends.softmax_output_format). qkv, do and the dpa_output /
    dpa_grad_input hint roles: FP8 current scaling, E5M2 for do, dp, dqkv and dpa_grad_input,
    E4M3 otherwise.
    """
    if role is not None and role.module_type == "dpa" and role.tensor_type in ("s", "dp"):
        return DelayedScalingRequest(fp8_format="HYBRID", amax_history_len=1, amax_compute_algo="most_recent")
    backward = role is not None and (role.backward or role.tensor_type == "dqkv")
    return Float8CurrentScalingQuantizer(fp8_dtype="e5m2" if backward else "e4m3")


def nvfp4_linear_fp8_dpa_factory(role: Optional[QuantizerRole]) -> Quantizer | DelayedScalingRequest:
    """NVFP4 linears with FP8 attention (TE's validated combination): attention's roles as
    fp8_attention_factory, everything else nvfp4_factory. The dpa roles are asked for only under
    CustomRecipe(fp8_dpa=True), which ``recipe("nvfp4_linear_fp8_dpa")`` sets.
    """
    return fp8_attention_factory(role) if is_attention(role) else nvfp4_factory(role)


def with_fp8_attention_factory(role: Optional[QuantizerRole], *, factory) -> Quantizer | DelayedScalingRequest:
    """Attention's roles as fp8_attention_factory, every other role as ``factory``."""
    return fp8_attention_factory(role) if is_attention(role) else factory(role)


def with_fp8_attention(recipe: CustomRecipe) -> CustomRecipe:
    """``recipe`` with attention quantized too (fp8_dpa=True), its roles as fp8_attention_factory
    (whose s and dp requests, delayed scaling with history 1, are attention's own: a recipe's
    requests must agree only within a module)."""
    return dataclasses.replace(
        recipe, qfactory=functools.partial(with_fp8_attention_factory, factory=recipe.qfactory), fp8_dpa=True
    )


def deepseek_blockwise_factory(role: Optional[QuantizerRole]) -> Float8BlockQuantizer:
    """DeepSeek-V3 blockwise FP8: E4M3 1x128 blocks for activations and gradients, 128x128 tiles
    for linear weights, FP32 (not power-of-two) scales."""
    dim = 2 if _tensor_type(role) == "weight" else 1
    return Float8BlockQuantizer(fp8_dtype="e4m3", block_scaling_dim=dim, force_pow_2_scales=False)


def tensorwise_factory(role: Optional[QuantizerRole]) -> Float8CurrentScalingQuantizer:
    """torchao "tensorwise": dynamic per-tensor FP8, E4M3 input and weight, E5M2 grad_output."""
    return Float8CurrentScalingQuantizer(fp8_dtype="e5m2" if is_gradient(role) else "e4m3")


def rowwise_factory(role: Optional[QuantizerRole]) -> Float8RowwiseQuantizer:
    """torchao "rowwise": per-row E4M3 scales on every operand of fprop, dgrad and wgrad,
    rounded down to powers of two."""
    return Float8RowwiseQuantizer(fp8_dtype="e4m3")


def rowwise_with_gw_hp_factory(role: Optional[QuantizerRole]) -> Quantizer:
    """torchao "rowwise_with_gw_hp": rowwise E4M3 fprop and dgrad, wgrad in high precision.

    weight, and an activation x activation matmul's right operand (``other``, in its place):
    rowwise FP8 both directions (fprop, dgrad). input and grad_output: rowwise FP8 for the GEMM
    they feed rowwise, columnwise Identity (the original) for wgrad.
    """
    if _as_linear(role) == "weight":
        return Float8RowwiseQuantizer(fp8_dtype="e4m3")
    return HybridQuantizer(
        rowwise_quantizer=Float8RowwiseQuantizer(fp8_dtype="e4m3"),
        columnwise_quantizer=IdentityQuantizer(),
        columnwise_source="original",
    )


FACTORIES = {
    "high_precision_fwd_mxfp8_bwd": high_precision_fwd_mxfp8_bwd_factory,
    "mxfp8_fwd_nvfp4_bwd": mxfp8_fwd_nvfp4_bwd_factory,
    "nvfp4_1d_weight": nvfp4_1d_weight_factory,
    "mxfp8_fwd_high_precision_bwd": mxfp8_fwd_high_precision_bwd_factory,
    "nvfp4_row_scaled_fwd_mxfp8_bwd": nvfp4_row_scaled_fwd_mxfp8_bwd_factory,
    "nvfp4_row_scaled_fwd_high_precision_bwd": nvfp4_row_scaled_fwd_high_precision_bwd_factory,
    "nvfp4_linear_fp8_dpa": nvfp4_linear_fp8_dpa_factory,
    "deepseek_blockwise": deepseek_blockwise_factory,
    "tensorwise": tensorwise_factory,
    "rowwise": rowwise_factory,
    "rowwise_with_gw_hp": rowwise_with_gw_hp_factory,
}

# The zoo recipes whose factories assign attention roles, built with fp8_dpa=True.
FP8_DPA = ("nvfp4_linear_fp8_dpa",)


def recipe(name: str) -> CustomRecipe:
    """The zoo recipe called ``name`` (see FACTORIES), e.g. recipe("tensorwise")."""
    if name in recipes.PRESETS:
        raise ValueError(f"{name!r} is not in the zoo but a preset of graphquant.recipes: call recipes.{name}()")
    if name not in FACTORIES:
        close = difflib.get_close_matches(name, [*FACTORIES, *recipes.PRESETS], n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"unknown zoo recipe {name!r}; {hint}known: {', '.join(FACTORIES)} (and the presets of graphquant.recipes: {', '.join(recipes.PRESETS)})")
    return CustomRecipe(FACTORIES[name], fp8_dpa=name in FP8_DPA, small_gemms_in_high_precision=True)
