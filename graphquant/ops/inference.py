"""A linear in a graph that never runs backward: fprop alone, nothing kept for a backward."""

from __future__ import annotations

from typing import Optional

import torch

from graphquant.ops.operands import gemm
from graphquant.ops.quantize import SlotState, quantize_tensor, quantize_weight, update_delayed_scaling
from graphquant.ops.site import Site
from graphquant.quantizers import ROWWISE


def inference_product(
    x2d: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], site: Site, states: tuple, rng: Optional[torch.Tensor]
) -> torch.Tensor:
    """(1, m, n) = x2d @ w^T (+ bias) with x and w quantized rowwise only.

    The weight is quantized from its value at this call, never kept from an earlier one: PyTorch
    has no cheap sign that a tensor's memory was written (writes through ``.data`` move no version
    counter; fused and foreach optimizer steps on CUDA move neither the version counter nor a
    copy-on-write mark), so a kept copy could outlive the values it was made from.
    """
    x_quantizer, w_quantizer, _ = site.quantizers
    x_state = SlotState(states[0], rng, site.streams[0], site.amax_group)
    w_state = SlotState(states[1], rng, site.streams[1], site.amax_group)
    xq, _ = quantize_tensor(x2d.detach(), x_quantizer, (ROWWISE,), x_state)
    wq = quantize_weight(w.detach(), w_quantizer, (ROWWISE,), w_state)
    update_delayed_scaling(x_quantizer, x_state, xq)
    update_delayed_scaling(w_quantizer, w_state, wq)
    bias = None if bias is None else bias.detach()
    return gemm(xq[ROWWISE], wq[ROWWISE], 1, torch.promote_types(x2d.dtype, w.dtype), *site.runs("fprop"), bias)
