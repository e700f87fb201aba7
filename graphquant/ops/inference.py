"""A linear in a graph that never runs backward: fprop alone, nothing kept for a backward; its
weight quantized at each call, or stored quantized once (graphquant.freeze)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from graphquant.kernels import backends, mixed_input
from graphquant.kernels.backends import GemmBackend
from graphquant.ops.library import SITES_SEPARATOR
from graphquant.ops.operands import Operand, gemm
from graphquant.ops.quantize import SlotState, quantize_tensor, quantize_weight, update_delayed_scaling
from graphquant.ops.site import Site
from graphquant.quantizers import ROWWISE, Quantizer


def inference_products(
    x2d: torch.Tensor, ws: Sequence[torch.Tensor], biases: Sequence[Optional[torch.Tensor]], sites: Sequence[Site],
    states: Sequence[tuple], rng: Optional[torch.Tensor],
) -> list[torch.Tensor]:
    """[(1, m, n) = x2d @ w^T (+ bias)] for each weight of ``ws`` (of one dtype) with its bias,
    site and slot states, x and the weights quantized rowwise only, x once
    (quantized_weights_product: several weights that read one x run in one launch of the decode
    or mixed-input GEMM, passes/gemms_sharing_x.py).

    Each weight is quantized from its value at this call, never kept from an earlier one: PyTorch
    has no cheap sign that a tensor's memory was written (writes through ``.data`` move no version
    counter; fused and foreach optimizer steps on CUDA move neither the version counter nor a
    copy-on-write mark), so a kept copy could outlive the values it was made from. A model whose
    weights are final stores them quantized instead, without the high-precision ones
    (graphquant.freeze).
    """
    wqs = [_weight_at_call(w, site, w_states, rng) for w, site, w_states in zip(ws, sites, states, strict=True)]
    return quantized_weights_product(x2d, wqs, ws[0].dtype, biases, sites, states[0], rng)


def _weight_at_call(w: torch.Tensor, site: Site, states: tuple, rng: Optional[torch.Tensor]) -> Operand:
    """Weight ``w``'s rowwise operand in its site's format, made from its value at this call (its
    delayed scaling, where it keeps one, recorded: ``quantize.record_amax``)."""
    w_quantizer = site.quantizers[1]
    w_state = site.slot_state(1, states[1], rng)
    wq = quantize_weight(w.detach(), w_quantizer, (ROWWISE,), w_state)
    update_delayed_scaling(w_quantizer, w_state, wq)
    return wq[ROWWISE]


def frozen_weight(w: torch.Tensor, quantizer: Quantizer, amax_group: Optional[str]) -> Operand:
    """The rowwise operand ``inference_products`` makes of weight ``w`` at each call, made once to
    be stored (graphquant.freeze): the same function, so the same bits."""
    return quantize_weight(w.detach(), quantizer, (ROWWISE,), SlotState(None, None, 0, amax_group))[ROWWISE]


def quantized_weights_product(
    x2d: torch.Tensor, ws: Sequence[Operand], w_dtype: torch.dtype, biases: Sequence[Optional[torch.Tensor]], sites: Sequence[Site],
    states: tuple, rng: Optional[torch.Tensor],
) -> list[torch.Tensor]:
    """[(1, m, n) = x2d @ w^T (+ bias)] for each weight of ``ws`` with its bias and site, x
    quantized rowwise here, once, and each w already the rowwise operand of a weight of dtype
    ``w_dtype`` (made at this call, or stored by graphquant.freeze): one GEMM op for one weight;
    for several, which the graph runs in one launch of the decode or mixed-input GEMM
    (passes/gemms_sharing_x.py, x's format stateless there: ``states`` and ``rng`` are the first
    site's), one op for all (graphquant::gemms_sharing_a, gemms_quantizing_a, mixed_input_gemms).
    Where the plan chose a GEMM that quantizes x itself, the graph takes the amaxes of x's rows alone where it needs them (a reduction
    Inductor fuses into x's producer) and hands x over in high precision, or (1x128 blocks)
    quantizes x by that GEMM's kernel in an op of its own; for the mixed-input GEMM, x's values are
    made from x by an op of their own."""
    site = sites[0]
    x_quantizer = site.quantizers[0]
    backend, _ = site.runs("fprop")
    biases = [None if bias is None else bias.detach() for bias in biases]
    out_dtype = torch.promote_types(x2d.dtype, w_dtype)
    labels = [s.runs("fprop")[1] for s in sites]
    if backend.quantizes_a:
        x_rowwise, x2d = x_quantizer.child(ROWWISE), x2d.detach()
        if backends.triton_decode.quantizes_first(x_rowwise):
            xq = Operand(torch.ops.graphquant.block_codes(x2d, x_rowwise.spec), x_rowwise.spec, ROWWISE, tuple(x2d.shape))
            return _products(xq, ws, out_dtype, backend, labels, biases)
        amax = backends.triton_decode.amaxes(x2d, x_rowwise)
        if len(ws) > 1:
            return torch.ops.graphquant.gemms_quantizing_a(
                x2d, amax, x_rowwise.spec, *_weights(ws), out_dtype, backend.name, SITES_SEPARATOR.join(labels), biases,
            )
        (w,) = ws
        return [
            torch.ops.graphquant.gemm_quantizing_a(
                x2d, amax, x_rowwise.spec, w.tensors, w.spec, w.direction, w.shape, out_dtype, backend.name, labels[0], biases[0],
            )
        ]
    if backend.name == mixed_input.BACKEND and mixed_input.values_from_x(x_quantizer.child(ROWWISE)):
        return _mixed_input_products(x2d.detach(), x_quantizer.child(ROWWISE), ws, out_dtype, labels, biases)
    x_state = site.slot_state(0, states[0], rng)
    xq, _ = quantize_tensor(x2d.detach(), x_quantizer, (ROWWISE,), x_state)
    update_delayed_scaling(x_quantizer, x_state, xq)
    return _products(xq[ROWWISE], ws, out_dtype, backend, labels, biases)


def _products(
    xq: Operand, ws: Sequence[Operand], out_dtype: torch.dtype, backend: GemmBackend, labels: list[str], biases: list[Optional[torch.Tensor]]
) -> list[torch.Tensor]:
    """x quantized times each weight: graphquant::gemm for one, graphquant::gemms_sharing_a for several."""
    if len(ws) == 1:
        return [gemm(xq, ws[0], 1, out_dtype, backend, labels[0], biases[0])]
    return torch.ops.graphquant.gemms_sharing_a(
        xq.tensors, xq.spec, xq.direction, xq.shape, *_weights(ws), out_dtype, backend.name, SITES_SEPARATOR.join(labels), biases,
    )


def _mixed_input_products(
    x2d: torch.Tensor, x_quantizer: Quantizer, ws: Sequence[Operand], out_dtype: torch.dtype, labels: list[str], biases: list[Optional[torch.Tensor]]
) -> list[torch.Tensor]:
    """x times each weight on the mixed-input GEMM, in one launch (graphquant::mixed_input_gemms),
    x's values made from x by one op (graphquant::mixed_input_operand), with NVFP4's global amax
    taken beside x's producer."""
    amax = mixed_input.x_amax(x2d, x_quantizer)
    values = torch.ops.graphquant.mixed_input_operand(x2d, amax, x_quantizer.spec)
    tensors, spec, shapes = _weights(ws)
    (stored,) = {w.stored for w in ws}
    return torch.ops.graphquant.mixed_input_gemms(
        values, amax, tensors, spec, ROWWISE, shapes, out_dtype, SITES_SEPARATOR.join(labels), biases, stored
    )


def _weights(ws: Sequence[Operand]) -> tuple[list[torch.Tensor], str, list[int]]:
    """Several weights of one format as the ops that share A take them: their tensors in turn,
    the format, and their shapes flattened."""
    (spec,) = {w.spec for w in ws}
    return [t for w in ws for t in w.tensors], spec, [d for w in ws for d in w.shape]
