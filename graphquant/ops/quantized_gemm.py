"""The autograd formula of a quantized GEMM. For y = x @ w^T (batched over groups when ``batch`` > 1):

    fprop  y  = x.rowwise          @ w.rowwise^T
    dgrad  dx = grad_output.rowwise @ w.columnwise^T
    wgrad  dw = grad_output.columnwise @ x.columnwise^T

Only the representations a pass needs are made: no columnwise ones when nothing needs a gradient,
and backward keeps the quantized columnwise representations, never the high-precision
originals, unless the recipe holds that direction in high precision (Identity).
"""

from __future__ import annotations

from typing import Sequence

import torch

from graphquant.ops import recording
from graphquant.ops.frozen import refused_backward
from graphquant.ops.operands import gemm, save_columnwise, saved_columnwise
from graphquant.ops.quantize import (
    columnwise_in_backward,
    quantize_tensor,
    quantize_weight,
    transposed_operand,
    update_delayed_scaling,
    weight_columnwise,
)
from graphquant.ops.site import Site
from graphquant.quantizers import COLUMNWISE, ROWWISE


class QuantizedGemm(torch.autograd.Function):
    """y (batch, m, n) = x (batch*m, k) @ w (batch*n, k)^T (+ bias, one group), per group, in the
    site's formats; the bias is added in the GEMM, and its gradient comes from grad_output's quantize."""

    @staticmethod
    def forward(ctx, x, w, bias, x_delayed, w_delayed, g_delayed, rng, site: Site, batch: int):
        # A graph planned to run no backward (no_grad, mode="inference") has no dgrad or wgrad, so
        # no columnwise copy is made for them, though a parameter operand asks for a gradient.
        need_dx = ctx.needs_input_grad[0] and site.dgrad is not None
        need_dw = ctx.needs_input_grad[1] and site.wgrad is not None
        x_quantizer, w_quantizer, _ = site.quantizers
        x_state, w_state = site.slot_state(0, x_delayed, rng), site.slot_state(1, w_delayed, rng)
        xq, _ = quantize_tensor(x, x_quantizer, (ROWWISE, COLUMNWISE) if need_dw else (ROWWISE,), x_state)
        w_later = need_dx and site.weight is not None and columnwise_in_backward(w, w_quantizer)
        w_directions = (ROWWISE, COLUMNWISE) if need_dx and not w_later else (ROWWISE,)
        if site.weight is not None:
            wq = quantize_weight(w, w_quantizer, w_directions, w_state)
        else:
            wq, _ = quantize_tensor(w, w_quantizer, w_directions, w_state, one_read=False)
        update_delayed_scaling(x_quantizer, x_state, xq)
        update_delayed_scaling(w_quantizer, w_state, wq)
        y = gemm(xq[ROWWISE], wq[ROWWISE], batch, torch.promote_types(x.dtype, w.dtype), *site.runs("fprop"), bias)

        # rng is this call's own [seed, step] (the compiled wrapper never writes into one it handed
        # out), so keeping it gives the backward its forward's step in whatever order backwards run.
        save_columnwise(ctx, xq.get(COLUMNWISE), wq.get(COLUMNWISE), rng, w if w_later else None)
        ctx.g_delayed = g_delayed  # not saved: see quantize.SlotState
        ctx.site, ctx.batch = site, batch
        ctx.shapes = (x.shape, w.shape, None if bias is None else bias.shape)
        ctx.dtypes = (x.dtype, w.dtype)
        ctx.originals = (x, w) if recording.listening() else (None, None)
        recording.record(site, "fprop", batch, x, xq[ROWWISE], w, wq[ROWWISE], bias, y)
        return y

    @staticmethod
    def backward(ctx, dy):
        need_dx, need_dw, need_dbias = ctx.needs_input_grad[:3]
        x_col, w_col, (rng, w_later) = saved_columnwise(ctx)
        g_delayed = ctx.g_delayed
        site, batch = ctx.site, ctx.batch
        if (need_dx and site.dgrad is None) or (need_dw and site.wgrad is None):
            return (*(_refused(dy, shape, site) if need else None for need, shape in zip(ctx.needs_input_grad, ctx.shapes)), *(None,) * 6)
        g_quantizer = site.quantizers[2]
        x, w = ctx.originals
        dy2d = dy.flatten(0, -2)
        g_state = site.slot_state(2, g_delayed, rng)
        # Where the columnwise copy is the rowwise bits transposed, an op makes it from them:
        # traced together, Inductor wrote both copies in one kernel while grad_output's inputs (a
        # SwiGLU's gate, up and dh) were still alive, a decoder's memory peak.
        late = need_dx and need_dw and g_quantizer.columnwise_is_rowwise_transposed()
        directions = ((ROWWISE,) if need_dx else ()) + ((COLUMNWISE,) if need_dw and not late else ())
        gq, dbias = quantize_tensor(dy2d, g_quantizer, directions, g_state, dbias=need_dbias)
        if late:
            gq[COLUMNWISE] = transposed_operand(gq[ROWWISE])
        update_delayed_scaling(g_quantizer, g_state, gq)
        dx = dw = None
        # wgrad first: its input operand (a SwiGLU's h, or h's FP8 copy) is then freed before
        # dgrad's output (as large, for a down projection) is allocated.
        if need_dw:
            dw = gemm(gq[COLUMNWISE], x_col, batch, ctx.dtypes[1], *site.runs("wgrad"))
            dw = dw.flatten(0, -2)
            recording.record(site, "wgrad", batch, dy2d, gq[COLUMNWISE], x, x_col, None, dw)
        if need_dx:
            if w_later is not None:
                w_col = weight_columnwise(w_later, site.quantizers[1], site.slot_state(1, None, rng))
            dx = gemm(gq[ROWWISE], w_col, batch, ctx.dtypes[0], *site.runs("dgrad"))
            dx = dx.flatten(0, -2)
            recording.record(site, "dgrad", batch, dy2d, gq[ROWWISE], w, w_col, None, dx)
        return dx, dw, dbias, None, None, None, None, None, None


def _refused(dy: torch.Tensor, shape: Sequence[int], site: Site) -> torch.Tensor:
    """The gradient of an operand of ``shape`` of a GEMM whose graph was planned without backward:
    an op that raises when the backward runs (traced, it is a tensor of that shape)."""
    return refused_backward(
        dy, tuple(shape), f"graphquant: backward through {site.label}, a GEMM of a graph compiled to run no backward (called "
        "under torch.no_grad or compiled with mode='inference'); call the model with grad enabled, and without "
        "mode='inference', to train it",
    )
