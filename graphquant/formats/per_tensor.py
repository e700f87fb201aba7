"""Per-tensor FP8 (current and delayed scaling): one float32 scale for the whole tensor."""

from __future__ import annotations

import torch

from graphquant.formats.fp8 import FLT_MAX, cast_to_fp8, fp8_max


def quantize(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: str, *, transpose: bool) -> torch.Tensor:
    """cast_to_fp8(fp32(x) * scale): one fp32 product per element, then RNE saturating cast.

    transpose=True returns the contiguous transpose of exactly those bits (Hopper's columnwise
    layout), so both directions are numerically identical.
    """
    data = cast_to_fp8(x.float() * scale, fp8_dtype)
    return data.t().contiguous() if transpose else data


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """fp32(data) * scale_inv, one fp32 product; scale_inv is reciprocal(scale) from the caller."""
    return data.float() * scale_inv


def delayed_scaling_update(
    scale: torch.Tensor,
    amax_history: torch.Tensor,
    amax: torch.Tensor,
    *,
    fp8_dtype: str,
    margin: int,
    algo: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The next (scale (..., 1), amax_history (..., L)) of a delayed-scaling slot, as TE's C++
    update, for every slot of the leading dims at once (an MoE site's experts: one each).

    amax (...) goes into history[0]; amax_used is the history's max ("max", skipping NaN as TE's
    fmaxf does, so that one NaN step does not keep the scale for L steps) or history[0]
    ("most_recent"); new scale = (fp8_max / amax_used) / 2**margin, both fp32 divisions correctly
    rounded; the previous scale is kept where amax_used <= 0 or is not finite; an infinite result
    becomes FLT_MAX. The history then rolls by -1 and slot 0 is zeroed, so it holds the last L
    amaxes. Pure (inputs untouched) and branch-free on values, for torch.compile.
    """
    history = torch.cat([amax.reshape(*amax_history.shape[:-1], 1).to(torch.float32), amax_history[..., 1:]], -1)
    if algo == "max":
        amax_used = torch.where(torch.isnan(history), 0.0, history).amax(-1, keepdim=True)
    else:
        amax_used = history[..., :1]
    new_scale = torch.div(torch.full_like(amax_used, fp8_max(fp8_dtype)), amax_used) / 2.0**margin
    valid = torch.isfinite(amax_used) & (amax_used > 0)
    new_scale = torch.where(valid, new_scale, scale)
    new_scale = torch.where(torch.isinf(new_scale), torch.full_like(new_scale, FLT_MAX), new_scale)
    rolled = torch.roll(history, -1, dims=-1)
    new_history = torch.cat([rolled.new_zeros((*rolled.shape[:-1], 1)), rolled[..., 1:]], -1)
    return new_scale, new_history
