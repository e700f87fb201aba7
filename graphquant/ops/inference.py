"""A linear in a graph that never runs backward: fprop alone, nothing kept for a backward; its
weight quantized at each call, or stored quantized once (graphquant.freeze)."""

from __future__ import annotations

from typing import Optional

import torch

from graphquant.kernels import backends
from graphquant.ops.operands import Operand, gemm
from graphquant.ops.quantize import SlotState, quantize_tensor, quantize_weight, update_delayed_scaling
from graphquant.ops.site import Site
from graphquant.quantizers import ROWWISE, Quantizer


def inference_product(
    x2d: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], site: Site, states: tuple, rng: Optional[torch.Tensor]
) -> torch.Tensor:
    """(1, m, n) = x2d @ w^T (+ bias) with x and w quantized rowwise only.

    The weight is quantized from its value at this call, never kept from an earlier one: PyTorch
    has no cheap sign that a tensor's memory was written (writes through ``.data`` move no version
    counter; fused and foreach optimizer steps on CUDA move neither the version counter nor a
    copy-on-write mark), so a kept copy could outlive the values it was made from. A model whose
    weights are final stores them quantized instead, without the high-precision ones
    (graphquant.freeze).
    """
    w_quantizer = site.quantizers[1]
    w_state = SlotState(states[1], rng, site.streams[1], site.amax_group)
    wq = quantize_weight(w.detach(), w_quantizer, (ROWWISE,), w_state)
    update_delayed_scaling(w_quantizer, w_state, wq)
    return quantized_weight_product(x2d, wq[ROWWISE], w.dtype, bias, site, states, rng)


def frozen_weight(w: torch.Tensor, quantizer: Quantizer, amax_group: Optional[str]) -> Operand:
    """The rowwise operand ``inference_product`` makes of weight ``w`` at each call, made once to be
    stored (graphquant.freeze): the same function, so the same bits."""
    return quantize_weight(w.detach(), quantizer, (ROWWISE,), SlotState(None, None, 0, amax_group))[ROWWISE]


def quantized_weight_product(
    x2d: torch.Tensor, w: Operand, w_dtype: torch.dtype, bias: Optional[torch.Tensor], site: Site, states: tuple, rng: Optional[torch.Tensor]
) -> torch.Tensor:
    """(1, m, n) = x2d @ w^T (+ bias) with x quantized rowwise here and w already the rowwise
    operand of a weight of dtype ``w_dtype`` (made at this call, or stored by graphquant.freeze).
    Where the plan chose a GEMM that quantizes x itself, the graph takes the amaxes of x's rows
    alone where it needs them (a reduction Inductor fuses into x's producer) and hands x over in
    high precision, or (1x128 blocks) quantizes x by that GEMM's kernel in an op of its own,
    which the GEMMs that read one x share."""
    x_quantizer = site.quantizers[0]
    backend, label = site.runs("fprop")
    bias = None if bias is None else bias.detach()
    out_dtype = torch.promote_types(x2d.dtype, w_dtype)
    if backend.quantizes_a:
        x_rowwise, x2d = x_quantizer.child(ROWWISE), x2d.detach()
        if backends.triton_decode.quantizes_first(x_rowwise):
            xq = Operand(torch.ops.graphquant.block_codes(x2d, x_rowwise.spec), x_rowwise.spec, ROWWISE, tuple(x2d.shape))
            return gemm(xq, w, 1, out_dtype, backend, label, bias)
        return torch.ops.graphquant.gemm_quantizing_a(
            x2d, backends.triton_decode.amaxes(x2d, x_rowwise), x_rowwise.spec, w.tensors, w.spec, w.direction, w.shape, out_dtype,
            backend.name, label, bias,
        )
    x_state = SlotState(states[0], rng, site.streams[0], site.amax_group)
    xq, _ = quantize_tensor(x2d.detach(), x_quantizer, (ROWWISE,), x_state)
    update_delayed_scaling(x_quantizer, x_state, xq)
    return gemm(xq[ROWWISE], w, 1, out_dtype, backend, label, bias)
