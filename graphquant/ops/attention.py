"""FP8 attention: what a rewritten graph calls in place of F.scaled_dot_product_attention under
``CustomRecipe(fp8_dpa=True)``, with TransformerEngine's dpa roles.

Per (batch, head), with P the softmax of the scaled, masked scores and dS the gradient of those
scores:

    forward   S  = Q.rowwise @ K.rowwise^T (fp32)   P = softmax(scale * S + mask)
              O  = s(P).rowwise @ V.columnwise
    backward  dV = s(P).columnwise^T @ do(dO).columnwise
              dP = do(dO).rowwise @ V.rowwise^T      D = rowsum(do(dO) * O)
              dS = P * (dP - D)
              dQ = scale * dp(dS).rowwise @ K.columnwise
              dK = scale * dp(dS).columnwise^T @ Q.columnwise

Q, K and V take the qkv quantizer, P the s quantizer, dO the do quantizer and dS the dp
quantizer; each product reads the direction that reduces over its inner dim, and accumulates in
fp32. As TE does, a per-tensor format gives Q, K and V one scale (their joint amax), and a block
format quantizes each alone. O and dQ, dK, dV stay in high precision: their quantizers
(``<name>.dpa_output``, ``<name>.dpa_grad_input``) are hints that the plan checks and nothing
applies. Grouped-query attention repeats each key/value head for its query heads (the same codes
as K and V themselves) and sums dK and dV over the group in fp32. Dropout is not supported.

P is a probability, at most 1, so its range is known before it is computed: the plan gives the s
slot a per-tensor format that scales P as an amax of 1 would (``backends.softmax_output_format``)
in place of a scale carried between calls. A delayed history carries one call's P amax into the
next call of another shape (a decode step's one query row over many keys peaks far under 1, and
the next prefill's first row, which is 1, saturates), and a fresh slot's scale of 1 flushes P
below 2^-9.

The emulation materialises S and P and multiplies dequantized operands (graphquant::gemm). Where
the plan chose an FP8 flash forward (graphquant.kernels.triton_attention, or its Gluon twin
graphquant.kernels.gluon_attention with the same bits: ``FlashAttention``), it replaces
``emulated_forward``: it receives the same quantized Q, K and V (bit for bit) but
quantizes P tile by tile as its online softmax sees it, so O can differ from the emulation's
(within the bound tests/test_triton_attention.py derives). Its backward is the FP8 flash backward
(graphquant.kernels.triton_attention_backward, or its Gluon twin
graphquant.kernels.gluon_attention_backward with the same bits but for the order of dQ's atomic
adds: ``FLASH_BACKWARDS``) where the plan chose it (dp under delayed scaling): the same codes of
Q, K, V and dO and the same D, but P recomputed from the forward's logsumexp and P and dS quantized as the tiles see them, so dQ, dK, dV and dp's recorded amax can
differ from the emulation's (within the bound ``backward_bound`` there derives); elsewhere the
backward recomputes S and P through the emulation.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from graphquant.formats import fp8, per_tensor
from graphquant.kernels import backends
from graphquant.ops import autocast, recording, registry
from graphquant.ops.library import quantizer_of, unflatten
from graphquant.ops.operands import Operand, gemm
from graphquant.ops.site import rebuilding_repr
from graphquant.ops.quantize import SlotState, quantize_tensor, record_amax, transposed_operand, update_delayed_scaling
from graphquant.quantizers import COLUMNWISE, ROWWISE, QuantizeContext, Quantizer
from graphquant.quantizers.float8 import traced_scales

SLOTS = ("qkv", "s", "do", "dp")
# The emulation's backend: its products (and those of the flash path's backward) on the emulated GEMM.
_EMULATED = backends.GemmBackend(backends.ATTENTION_EMULATION)
NO_STATES = (None, None, None, None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionSite:
    """One attention call as the rewritten graph tells it: its owner and the format of each
    applied role (qkv, s, do, dp), as specs. Prints as the call that rebuilds it."""

    name: str
    call: int
    qkv: str
    s: str
    do: str
    dp: str
    backend: backends.GemmBackend = _EMULATED  # how the forward runs, as the plan chose (backends.select_attention)
    backward_backend: backends.GemmBackend = _EMULATED  # how the backward runs (on a flash forward's site only)
    amax_group: Optional[str] = None  # the process group of amax reductions (graphquant.distributed)
    # The plan runs no backward product here (mode="inference", or no input gets a gradient): the
    # inputs are taken detached, so that no gradient flows where the plan lists none.
    forward_only: bool = False
    # The delayed-scaling slots (qkv, do, dp) whose step another call of this graph ends (quantize.SlotState.ends_step).
    records_amax_only: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        planned = backends.softmax_output_format(self.quantizer("s"))
        if planned.spec != self.s:
            raise ValueError(
                f"{self.label}: s={self.s} would scale P by its own amax or a history; give s "
                f"{planned.spec!r} (softmax_output_format: P's scale is that of its bound, 1)"
            )
        if self.backward_backend.name in backends.ATTENTION_KERNELS:
            flash_forward = self.backend.name in backends.ATTENTION_KERNELS
            why = "its forward does not run on a flash kernel" if not flash_forward else backends.flash_backward_refusal(
                self.quantizer("s"), self.quantizer("do"), self.quantizer("dp")
            )
            if why:
                raise ValueError(f"{self.label}: the FP8 flash backward cannot run this site ({why}); leave backward_backend at {_EMULATED!r}")

    def __repr__(self) -> str:
        return rebuilding_repr(self)

    @property
    def label(self) -> str:
        return f"{self.name or 'dpa'}#{self.call}"

    def quantizer(self, slot: str) -> Quantizer:
        return quantizer_of(getattr(self, slot))

    def slot_state(self, slot: str, delayed: Optional[torch.Tensor]) -> SlotState:
        """The state of ``slot`` as this call reads and updates it."""
        return SlotState(delayed, None, 0, self.amax_group, ends_step=slot not in self.records_amax_only)


@autocast.operands_cast
def quantized_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
    site: AttentionSite, states=NO_STATES,
):
    """F.scaled_dot_product_attention in the site's formats; ``states`` is the delayed-scaling
    state of qkv, s, do and dp (None where a format keeps none: always for s). Fewer key/value
    heads than query heads are grouped whatever ``enable_gqa`` says (F.scaled_dot_product_attention
    would have refused them without it when the graph was captured)."""
    if dropout_p:
        raise ValueError(
            f"{site.label}: FP8 attention runs without dropout, got dropout_p={dropout_p}; pass dropout_p=0.0, or build "
            "the recipe with fp8_dpa=False"
        )
    lq, lk = query.shape[-2], key.shape[-2]
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if site.backend.name in backends.ATTENTION_KERNELS and attn_mask is not None:
        raise ValueError(
            f"{site.label}: the FP8 flash-attention kernel takes is_causal or no mask, not an attn_mask of shape "
            f"{tuple(attn_mask.shape)}; a site with a mask runs the emulation (backend={_EMULATED!r})"
        )
    qkv_delayed, _, do_delayed, dp_delayed = states
    if site.forward_only:
        query, key, value = query.detach(), key.detach(), value.detach()
    if site.backend.name in backends.ATTENTION_KERNELS:
        return FlashAttention.apply(query, key, value, qkv_delayed, do_delayed, dp_delayed, site, scale, bool(is_causal))
    mask = _additive_mask(attn_mask, is_causal, lq, lk, query.device)
    return QuantizedAttention.apply(query, key, value, mask, qkv_delayed, do_delayed, dp_delayed, site, scale)


def _additive_mask(attn_mask, is_causal: bool, lq: int, lk: int, device) -> Optional[torch.Tensor]:
    """The mask as float32 added to the scores (-inf where a boolean mask says no, the causal mask
    aligned top left as F.scaled_dot_product_attention does), or None."""
    mask = None
    if attn_mask is not None:
        mask = torch.zeros(attn_mask.shape, device=device).masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else attn_mask.float()
    if is_causal:
        causal = torch.ones(lq, lk, dtype=torch.bool, device=device).tril()
        causal = torch.zeros(lq, lk, device=device).masked_fill(~causal, -math.inf)
        mask = causal if mask is None else mask + causal
    return mask


class QuantizedAttention(torch.autograd.Function):
    """Attention of 4-D (batch, heads, length, dim) query, key and value in the site's formats."""

    @staticmethod
    def forward(ctx, q, k, v, mask, qkv_delayed, do_delayed, dp_delayed, site: AttentionSite, scale: float):
        training = any(ctx.needs_input_grad[:3])
        groups = q.shape[1] // k.shape[1]
        k, v = (k, v) if groups == 1 else (k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1))
        b, h, lq, d = q.shape
        lk, dv = k.shape[2], v.shape[3]
        tensors = {"Q": q.reshape(-1, d), "K": k.reshape(-1, d), "V": v.reshape(-1, dv)}
        directions = {"Q": (ROWWISE, COLUMNWISE), "K": (ROWWISE, COLUMNWISE), "V": (COLUMNWISE, ROWWISE)}
        directions = {t: ds if training else ds[:1] for t, ds in directions.items()}
        qkv_state = site.slot_state("qkv", qkv_delayed)
        made = quantize_qkv(tensors, site.quantizer("qkv"), directions, qkv_state)
        o, p, p_made = emulated_forward(site, tensors, made, mask, scale, (b, h, lq, lk), training)

        ctx.site, ctx.scale, ctx.groups, ctx.shapes = site, scale, groups, (b, h, lq, lk, d, dv)
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        kept = (made["Q"][COLUMNWISE], made["K"][COLUMNWISE], made["V"][ROWWISE], p_made[COLUMNWISE]) if training else ()
        ctx.metas = [(len(op.tensors), op.spec, op.direction, op.shape) for op in kept]
        ctx.originals = tensors if recording.listening() else {}
        ctx.save_for_backward(*[t for op in kept for t in op.tensors], p, o)
        ctx.delayed = (do_delayed, dp_delayed)  # not saved: see quantize.SlotState
        return o.view(b, h, lq, dv)

    @staticmethod
    def backward(ctx, do):
        site, (b, h, lq, lk, d, dv) = ctx.site, ctx.shapes
        *flat, p, o = ctx.saved_tensors
        do_delayed, dp_delayed = ctx.delayed
        kept, start = [], 0
        for count, *meta in ctx.metas:
            kept.append(Operand(flat[start : start + count], *meta))
            start += count
        q_col, k_col, v_row, p_col = kept
        made = {"Q": {COLUMNWISE: q_col}, "K": {COLUMNWISE: k_col}, "V": {ROWWISE: v_row}}
        do_state, dp_state = site.slot_state("do", do_delayed), site.slot_state("dp", dp_delayed)
        dq, dk, dv_ = emulated_backward(
            site, ctx.originals, made, p, p_col, o, do.reshape(-1, dv), ctx.scale, do_state, dp_state, b * h, ctx.needs_input_grad[:3]
        )
        dq = None if dq is None else dq.view(b, h, lq, d)
        return (*_gradients(dq, dk, dv_, ctx.dtypes, b, h, ctx.groups, lk), None, None, None, None, None, None)


class FlashAttention(torch.autograd.Function):
    """Attention whose forward is the FP8 flash kernel the site's backend names
    (graphquant::flash_attention, or graphquant::gluon_flash_attention with the same bits:
    ``FLASH_FORWARDS``) and whose
    backward is the FP8 flash backward the site's backward_backend names (graphquant::flash_attention_backward,
    or graphquant::gluon_flash_attention_backward: ``FLASH_BACKWARDS``) where it names one, else the emulation's, recomputing S and P from the saved Q, K, V
    codes.

    Q, K and V are quantized as the emulation quantizes them (their joint per-tensor scale, the
    same codes: ``flash_qkv``); the kernel quantizes each P tile unnormalised (exp(logit - running
    max), amax 1) with the s format's scale, the one an amax of 1 gets. The recomputed P of the
    backward is quantized as the emulation's forward would have, so the gradients are the
    emulation's with the kernel's O in D = rowsum(dO * O). The flash backward gets the same codes
    of Q, K, V and dO and the same D, and quantizes P with the s format's scale and dS with the dp
    slot's delayed one, tile by tile (``flash_backward``).
    """

    @staticmethod
    def forward(ctx, q, k, v, qkv_delayed, do_delayed, dp_delayed, site: AttentionSite, scale: float, causal: bool):
        d = q.shape[-1]
        made = flash_qkv({"Q": q, "K": k, "V": v}, site.quantizer("qkv"), site.slot_state("qkv", qkv_delayed))
        q_row, k_row, v_row = made["Q"][ROWWISE], made["K"][ROWWISE], made["V"][ROWWISE]
        o, lse = FLASH_FORWARDS[site.backend.name](
            q_row.tensors[0].view(q.shape), k_row.tensors[0].view(k.shape), made["V"][COLUMNWISE].tensors[0],
            q_row.tensors[1], p_scale(site, q.device), scale, causal, q.dtype, _token_major(q),
        )
        ctx.site, ctx.scale, ctx.causal, ctx.shapes = site, scale, causal, (q.shape, k.shape)
        ctx.dtypes, ctx.token_major = (q.dtype, k.dtype, v.dtype), tuple(map(_token_major, (q, k, v)))
        ctx.metas = [(op.spec, op.shape) for op in (q_row, k_row, v_row)]
        ctx.originals = {t: x.reshape(-1, d) for t, x in zip("QKV", (q, k, v))} if recording.listening() else {}
        ctx.save_for_backward(q_row.tensors[0], k_row.tensors[0], v_row.tensors[0], *q_row.tensors[1:], o, lse)
        ctx.delayed = (do_delayed, dp_delayed)  # not saved: see quantize.SlotState
        return o

    @staticmethod
    def backward(ctx, do):
        site, (q_shape, k_shape) = ctx.site, ctx.shapes
        q_data, k_data, v_data, scale_inv, amax, o, lse = ctx.saved_tensors
        do_delayed, dp_delayed = ctx.delayed
        b, h, lq, d = q_shape
        groups, lk = h // k_shape[1], k_shape[2]
        do_state, dp_state = site.slot_state("do", do_delayed), site.slot_state("dp", dp_delayed)
        if site.backward_backend.name in backends.ATTENTION_KERNELS:
            codes = (q_data.view(q_shape), k_data.view(k_shape), v_data.view(k_shape))
            # dK and dV come in K's dtype (V's: F.scaled_dot_product_attention takes one) where they are not sums
            # over groups; the fp32 sums (dQ, grouped dK and dV) are rounded here, where Inductor can fuse it and its layout
            grads = flash_backward(site, codes, scale_inv, o, lse, do, ctx.scale, ctx.causal, do_state, dp_state, ctx.dtypes[1])
            return *map(_gradient, grads, ctx.dtypes, ctx.token_major), None, None, None, None, None, None
        made = {}
        for name, data, (spec, shape) in zip("QKV", (q_data, k_data, v_data), ctx.metas):
            if name != "Q" and groups != 1:  # the emulation's products take one key/value head per query head
                data = data.view(k_shape).repeat_interleave(groups, 1).reshape(-1, d)
                shape = (data.shape[0], d)
            row = Operand([data, scale_inv, amax], spec, ROWWISE, shape)
            made[name] = {ROWWISE: row, COLUMNWISE: transposed_operand(row)}
        originals = {t: x if t == "Q" or groups == 1 else x.view(k_shape).repeat_interleave(groups, 1).reshape(-1, d)
                     for t, x in ctx.originals.items()}
        mask = _additive_mask(None, ctx.causal, lq, lk, o.device)
        p, p_made = emulated_softmax(site, originals, made, mask, ctx.scale, (b, h, lq, lk), True)
        dq, dk, dv = emulated_backward(
            site, originals, made, p, p_made[COLUMNWISE], o.reshape(b * h, lq, d), do.reshape(-1, d), ctx.scale, do_state, dp_state, b * h,
            ctx.needs_input_grad[:3],
        )
        dq = None if dq is None else dq.view(q_shape)
        return (*_gradients(dq, dk, dv, ctx.dtypes, b, h, groups, lk), None, None, None, None, None, None)


def _token_major(x: torch.Tensor) -> bool:
    """Whether x (batch, heads, L, D) lies token by token in memory, as a model's projection viewed
    and transposed gives it (and not head by head as well, as one head or one token does)."""
    return not x.is_contiguous() and x.transpose(1, 2).is_contiguous()


def _gradient(grad: torch.Tensor, dtype: torch.dtype, token_major: bool) -> torch.Tensor:
    """A flash backward's gradient in its input's dtype. One that takes a conversion (an fp32 sum)
    lies token by token in memory where its input did, so that the model's transpose back is a
    view; one in its dtype already stays as the kernel wrote it (a layout alone is not worth a copy)."""
    if grad.dtype == dtype or not token_major:
        return grad.to(dtype)
    return backends.empty_attention(grad.shape, dtype, grad.device, True).copy_(grad)


def _summed_over_groups(grad: torch.Tensor, b: int, h: int, groups: int, lk: int) -> torch.Tensor:
    """dK or dV per query head (b * h * lk rows of D, any shape) as (b, h // groups, lk, D): summed
    over each key/value head's group of query heads, in fp32 as given; a view where each group is
    one head (a sum over one would only copy)."""
    grad = grad.view(b, h // groups, groups, lk, grad.shape[-1])
    return grad.squeeze(2) if groups == 1 else grad.sum(2)


def _flash_forward_elsewhere(
    q: torch.Tensor, k: torch.Tensor, vt: torch.Tensor, scale_inv: torch.Tensor, p_scale: torch.Tensor, softmax_scale: float,
    causal: bool, out_dtype: torch.dtype, token_major: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 flash-attention forward (graphquant.kernels.triton_attention.forward, or
    gluon_attention.forward): (O, token by token in memory where ``token_major`` says, and the
    logsumexp) of E4M3 codes under one scale, P tiles quantized with ``p_scale`` (one float32).
    CUDA with Triton only."""
    raise NotImplementedError(
        f"graphquant's FP8 flash-attention forwards run on CUDA (Hopper) with Triton; got {q.device.type} tensors. The plan selects "
        "them only there (graphquant.kernels.backends.select_attention); elsewhere attention runs the emulation"
    )


# The op of each flash forward's backend: the Triton forward's, and the Gluon forward's (its bits).
FLASH_FORWARDS = {
    backends.FLASH_ATTENTION: registry.op("flash_attention")(_flash_forward_elsewhere),
    backends.GLUON_FLASH_ATTENTION: registry.op("gluon_flash_attention")(_flash_forward_elsewhere),
}


def p_scale(site: AttentionSite, device: torch.device) -> torch.Tensor:
    """The scale of P's FP8 codes in a flash kernel (float32, (1,)): the s format's for an amax of
    1, which every unnormalised tile reaches and no normalised P exceeds."""
    return site.quantizer("s").scale_of_amax(torch.full((1,), backends.P_BOUND, device=device))


def flash_backward(site, codes, scale_inv, o, lse, do, softmax_scale, causal, do_state, dp_state, grad_dtype):
    """(dQ (batch, heads, Lq, D) in fp32, dK and dV (batch, kv heads, Lk, D) in ``grad_dtype``, fp32
    under grouped-query attention) from the FP8 flash backward:
    dO quantized (``joint_per_tensor``: quantize_do's codes) and D = rowsum(dO * O) taken as the
    emulation takes them, P quantized with ``p_scale`` and dS with the dp slot's delayed scale,
    whose history then records the largest |dS| the kernel saw."""
    q, k, v = codes
    b, h, lq, d = q.shape
    do_made = joint_per_tensor({"dO": do}, site.quantizer("do"), do_state, ("dO",))["dO"]
    do_row, do_col = do_made[ROWWISE], do_made[COLUMNWISE]
    delta = rowsum_do_o(do_made, o).view(b, h, lq)
    s_scale, dp_scale = p_scale(site, o.device), dp_state.delayed[:1].clone()
    scales = torch.cat([x.reshape(1) for x in (scale_inv, do_row.tensors[1], s_scale, torch.reciprocal(s_scale), dp_scale, torch.reciprocal(dp_scale))])
    transposed = lambda x: torch.ops.graphquant.transposed(x.reshape(-1, d))  # noqa: E731
    dp_quantizer = site.quantizer("dp")
    dq, dk, dv, ds_amax = FLASH_BACKWARDS[site.backward_backend.name](
        q, transposed(q), k, transposed(k), v, do_row.tensors[0].view(q.shape), do_col.tensors[0], lse, delta, scales,
        softmax_scale, causal, site.quantizer("s").kernel_encoding(ROWWISE).element, dp_quantizer.kernel_encoding(ROWWISE).element,
        grad_dtype,
    )
    record_amax(dp_quantizer, dp_state, ds_amax)
    return dq, dk, dv


def flash_attention_backward_reference(
    q: torch.Tensor, qt: torch.Tensor, k: torch.Tensor, kt: torch.Tensor, v: torch.Tensor, do: torch.Tensor, dot: torch.Tensor,
    lse: torch.Tensor, delta: torch.Tensor, scales: torch.Tensor, softmax_scale: float, causal: bool, p_dtype: str, ds_dtype: str,
    grad_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The FP8 flash-attention backward (graphquant.kernels.triton_attention_backward.backward):
    (dQ, dK and dV summed over each key/value head's query heads, all fp32 but dK and dV without
    groups, which are in ``grad_dtype``; the amax of dS). Its reference here is the kernel's
    arithmetic on whole matrices: products of the codes in fp32, P from the logsumexp in base 2,
    P and dS cast element by element as the kernel casts its tiles (the transposed codes qt, kt,
    dot are the kernel's operand layouts, unused here)."""
    b, h, lq, d = q.shape
    groups, lk = h // k.shape[1], k.shape[2]
    qkv_inv, do_inv, s_scale, s_inv, dp_scale, dp_inv = scales.unbind()
    qf, dof = q.float(), do.float()
    kf, vf = (x.float().repeat_interleave(groups, 1) for x in (k, v))
    log2e = torch.tensor(math.log2(math.e), dtype=torch.float32)
    qk_scale = qkv_inv * qkv_inv * torch.tensor(softmax_scale, dtype=torch.float32) * log2e
    p = torch.exp2(qf @ kf.transpose(-1, -2) * qk_scale - (lse * log2e)[..., None])
    if causal:
        p = p.masked_fill(~torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(), 0.0)
    p8 = per_tensor.quantize(p, s_scale, p_dtype, transpose=False).float()
    dv = p8.transpose(-1, -2) @ dof * (s_inv * do_inv)
    ds = p * ((dof @ vf.transpose(-1, -2)) * (do_inv * qkv_inv) - delta[..., None])
    ds8 = per_tensor.quantize(ds, dp_scale, ds_dtype, transpose=False).float()
    factor = dp_inv * qkv_inv * torch.tensor(softmax_scale, dtype=torch.float32)
    dk = ds8.transpose(-1, -2) @ qf * factor
    kv_dtype = grad_dtype if groups == 1 else torch.float32
    return ds8 @ kf * factor, *(_summed_over_groups(x, b, h, groups, lk).to(kv_dtype) for x in (dk, dv)), fp8.tensor_amax(ds)


# The op of each flash backward's backend: the Triton backward's, and the Gluon backward's (its bits
# but for the order of dQ's atomic adds).
FLASH_BACKWARDS = {
    backends.FLASH_ATTENTION: registry.op("flash_attention_backward")(flash_attention_backward_reference),
    backends.GLUON_FLASH_ATTENTION: registry.op("gluon_flash_attention_backward")(flash_attention_backward_reference),
}


@registry.fake("gluon_flash_attention_backward")
@registry.fake("flash_attention_backward")
def _(q, qt, k, kt, v, do, dot, lse, delta, scales, softmax_scale, causal, p_dtype, ds_dtype, grad_dtype):
    dk = q.new_empty(k.shape, dtype=grad_dtype if k.shape[1] == q.shape[1] else torch.float32)
    return q.new_empty(q.shape, dtype=torch.float32), dk, torch.empty_like(dk), q.new_empty((), dtype=torch.float32)


@registry.fake("gluon_flash_attention")
@registry.fake("flash_attention")
def _(q, k, vt, scale_inv, p_scale, softmax_scale, causal, out_dtype, token_major):
    b, h, lq, d = q.shape
    return backends.empty_attention(q.shape, out_dtype, q.device, token_major), q.new_empty((b, h, lq), dtype=torch.float32)


@registry.op("joint_amax")
def joint_amax(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The joint amax of tensors (0-dim float32): fp8.tensor_amax of them joined, without
    joining them."""
    return torch.stack([fp8.tensor_amax(x) for x in tensors]).amax()


@registry.fake("joint_amax")
def _(tensors):
    return tensors[0].new_empty((), dtype=torch.float32)


@registry.op("joint_cast")
def joint_cast(
    tensors: list[torch.Tensor], scale: torch.Tensor, fp8_dtype: str, transposed: list[bool], amax: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """The per-tensor FP8 codes of tensors of 2 to 4 dims (any strides) under one ``scale``
    (per_tensor.quantize), contiguous; the transposed codes (dim, rows) of those ``transposed``
    marks, rows being all the other dims; and, where ``amax`` asks (a delayed-scaling slot, whose
    scale came before any pass), their joint amax, else 0."""
    codes = [per_tensor.quantize(x, scale, fp8_dtype, transpose=False).contiguous() for x in tensors]
    seen = joint_amax(tensors) if amax else torch.zeros((), device=scale.device)
    return codes, [c.view(-1, c.shape[-1]).t().contiguous() for c, t in zip(codes, transposed) if t], seen


@registry.fake("joint_cast")
def _(tensors, scale, fp8_dtype, transposed, amax):
    dtype = fp8.FP8_DTYPES[fp8_dtype]
    codes = [x.new_empty(x.shape, dtype=dtype) for x in tensors]
    codes_t = [x.new_empty((x.shape[-1], x.numel() // x.shape[-1]), dtype=dtype) for x, t in zip(tensors, transposed) if t]
    return codes, codes_t, tensors[0].new_empty((), dtype=torch.float32)


try:
    from graphquant.kernels import triton_attention
except ImportError:  # no Triton: the plan never selects the flash kernels; the joint ops run their references
    pass
else:
    from graphquant.kernels import triton_attention_backward, triton_joint_fp8

    registry.cuda_kernel("flash_attention")(triton_attention.forward)
    if backends.HAS_GLUON:
        from graphquant.kernels import gluon_attention, gluon_attention_backward

        registry.cuda_kernel("gluon_flash_attention")(gluon_attention.forward)
        registry.cuda_kernel("gluon_flash_attention_backward")(gluon_attention_backward.backward)
    registry.cuda_kernel("flash_attention_backward")(triton_attention_backward.backward)
    registry.cuda_kernel("joint_amax")(triton_joint_fp8.joint_amax)
    registry.cuda_kernel("joint_cast")(triton_joint_fp8.joint_cast)


def flash_qkv(tensors: dict[str, torch.Tensor], quantizer: Quantizer, state: SlotState) -> dict[str, dict[str, Operand]]:
    """Q and K rowwise and V both ways in a per-tensor format, as the flash kernel takes them:
    ``quantize_qkv``'s codes, scale and amax (``joint_per_tensor``) of their rows."""
    return joint_per_tensor(tensors, quantizer, state, ("V",))


def joint_per_tensor(
    tensors: dict[str, torch.Tensor], quantizer: Quantizer, state: SlotState, transposed: tuple[str, ...]
) -> dict[str, dict[str, Operand]]:
    """Tensors of 2 to 4 dims (any strides; as (rows, last dim)) rowwise, and those ``transposed``
    names columnwise too, in a per-tensor format under one joint scale: what quantizing their
    rows joined gives (quantize_qkv; quantize_tensor for one tensor), in at most two passes over
    them that join nothing and copy nothing (graphquant::joint_amax, where the scale comes from
    their amax, then graphquant::joint_cast, which writes a columnwise copy beside the rowwise
    one and sees the amax a delayed-scaling slot records)."""
    rowwise = quantizer.child(ROWWISE)
    encoding = rowwise.kernel_encoding(ROWWISE)
    names, xs = list(tensors), list(tensors.values())
    if encoding.delayed_scaling:
        scale = state.delayed[:1].clone()  # a copy: the state is updated in place below
        scale_inv = torch.reciprocal(scale)
    else:
        amax = torch.ops.graphquant.joint_amax(xs)
        if rowwise.reduces_amax:
            amax = QuantizeContext(amax_group=state.amax_group).reduced_amax(amax)
        scale, scale_inv = traced_scales(amax, encoding.element, encoding.amax_epsilon, encoding.pow2_scales)
    codes, codes_t, seen = torch.ops.graphquant.joint_cast(xs, scale, encoding.element, [t in transposed for t in names], encoding.delayed_scaling)
    if encoding.delayed_scaling:
        amax = seen
        record_amax(rowwise, state, amax)
    shapes = {t: (x.numel() // x.shape[-1], x.shape[-1]) for t, x in tensors.items()}
    operand = lambda data, direction, t: Operand([data, scale_inv, amax], rowwise.spec, direction, shapes[t])  # noqa: E731
    made = {t: {ROWWISE: operand(c.view(shapes[t]), ROWWISE, t)} for t, c in zip(names, codes)}
    for t, c in zip([t for t in names if t in transposed], codes_t):
        made[t][COLUMNWISE] = operand(c, COLUMNWISE, t)
    return made


def quantize_qkv(
    tensors: dict[str, torch.Tensor], quantizer: Quantizer, directions: dict[str, tuple[str, ...]], state: SlotState
) -> dict[str, dict[str, Operand]]:
    """Q, K and V (2-D) in their directions. A per-tensor format quantizes them joined, one scale
    from their joint amax (TE's combined QKV quantize; a delayed-scaling slot records that amax),
    each columnwise copy the transpose of its rowwise one; a block format quantizes each alone."""
    if quantizer.block(ROWWISE) != (0, 0):
        made = {t: quantize_tensor(x, quantizer, directions[t], state)[0] for t, x in tensors.items()}
        for operands in made.values():
            update_delayed_scaling(quantizer, state, operands)
        return made
    joint = torch.cat([x.reshape(-1) for x in tensors.values()]).reshape(1, -1)
    rows, _ = quantize_tensor(joint, quantizer, (ROWWISE,), state)
    update_delayed_scaling(quantizer, state, rows)
    data, scale_inv, amax = rows[ROWWISE].tensors
    made = {}
    for (t, x), piece in zip(tensors.items(), data.reshape(-1).split([x.numel() for x in tensors.values()])):
        row = Operand([piece.view(x.shape), scale_inv, amax], rows[ROWWISE].spec, ROWWISE, (x.shape[0], x.shape[1]))
        made[t] = {ROWWISE: row, COLUMNWISE: transposed_operand(row)} if COLUMNWISE in directions[t] else {ROWWISE: row}
    return made


def emulated_forward(site, tensors, made, mask, scale, shape, training):
    """(O as (batch * heads, Lq, Dv) in the inputs' dtype, P in fp32 as (batch * heads * Lq, Lk),
    P's quantized directions) for ``shape`` (batch, heads, Lq, Lk)."""
    p, p_made = emulated_softmax(site, tensors, made, mask, scale, shape, training)
    o = _product(site, "pv", p, p_made[ROWWISE], tensors["V"], made["V"][COLUMNWISE], shape[0] * shape[1])
    return o.to(tensors["Q"].dtype), p, p_made


def emulated_softmax(site, tensors, made, mask, scale, shape, training):
    """(P in fp32 as (batch * heads * Lq, Lk), P's quantized directions): S materialised, softmax
    in fp32, P quantized whole (``tensors``, the originals, only for a listening recorder)."""
    s = _product(site, "qk", tensors.get("Q"), made["Q"][ROWWISE], tensors.get("K"), made["K"][ROWWISE], shape[0] * shape[1])
    logits = s.view(shape) * scale if mask is None else s.view(shape) * scale + mask
    p = _safe_softmax(logits).reshape(-1, shape[3])
    p_made, _ = quantize_tensor(p, site.quantizer("s"), (ROWWISE, COLUMNWISE) if training else (ROWWISE,), SlotState(None, None, 0))
    return p, p_made


def quantize_do(site, do: torch.Tensor, do_state: SlotState) -> dict[str, Operand]:
    """dO (2-D) in the do format, both directions; a delayed-scaling slot records its amax."""
    do_quantizer = site.quantizer("do")
    do_made, _ = quantize_tensor(do, do_quantizer, (ROWWISE, COLUMNWISE), do_state)
    update_delayed_scaling(do_quantizer, do_state, do_made)
    return do_made


def rowsum_do_o(do_made: dict[str, Operand], o: torch.Tensor) -> torch.Tensor:
    """D = rowsum(dO * O) in fp32, shaped as o (..., Lq, Dv; any strides) with a last dim of 1, with
    dO's rowwise values decoded by its format's reference numerics (graphquant::dequantize's values
    bit for bit) in plain ops, which Inductor fuses into the sum instead of writing the values out."""
    row = do_made[ROWWISE]
    do_values = unflatten(row.tensors, row.spec, ROWWISE, row.shape, torch.float32).dequantize()
    return (do_values.view(o.shape) * o.float()).sum(-1, keepdim=True)


def emulated_backward(site, originals, made, p, p_col, o, do, scale, do_state, dp_state, batch, needs=(True, True, True)):
    """(dQ, dK, dV) in fp32, per query head (batch, L, D), each where ``needs`` asks for it (None
    elsewhere): the products the plan lists (DpaSite.products), dS and its product dP only for dQ
    or dK."""
    need_dq, need_dk, need_dv = needs
    do_made = quantize_do(site, do, do_state)
    dv = _product(site, "dv", p, p_col, do, do_made[COLUMNWISE], batch) if need_dv else None
    if not (need_dq or need_dk):
        return None, None, dv
    dp_quantizer = site.quantizer("dp")
    dp = _product(site, "dp", do, do_made[ROWWISE], originals.get("V"), made["V"][ROWWISE], batch)
    d = rowsum_do_o(do_made, o)
    ds = (p.view(dp.shape) * (dp - d)).reshape(-1, dp.shape[-1])
    ds_made, _ = quantize_tensor(ds, dp_quantizer, (ROWWISE, COLUMNWISE), dp_state)
    update_delayed_scaling(dp_quantizer, dp_state, ds_made)
    dq = _product(site, "dq", ds, ds_made[ROWWISE], originals.get("K"), made["K"][COLUMNWISE], batch) * scale if need_dq else None
    dk = _product(site, "dk", ds, ds_made[COLUMNWISE], originals.get("Q"), made["Q"][COLUMNWISE], batch) * scale if need_dk else None
    return dq, dk, dv


def _gradients(dq, dk, dv, dtypes, b, h, groups, lk) -> tuple:
    """The emulated backward's gradients in their operands' dtypes, dK and dV summed over each
    key/value head's query heads, None where not asked for."""
    dk, dv = (None if x is None else _summed_over_groups(x, b, h, groups, lk) for x in (dk, dv))
    return tuple(None if x is None else x.to(dtype) for x, dtype in zip((dq, dk, dv), dtypes))


def _product(site, name, a, a_operand, b, b_operand, batch) -> torch.Tensor:
    """(batch, m, n) = a @ b^T per head in fp32, reported to a listening recorder (graphquant.numerics)."""
    out = gemm(a_operand, b_operand, batch, torch.float32, _EMULATED, f"{site.label} {name}")
    recording.record(site, name, batch, a, a_operand, b, b_operand, None, out)
    return out


def _safe_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over the keys in fp32, 0 in a row every key of which is masked (as
    F.scaled_dot_product_attention gives)."""
    p = torch.softmax(logits, dim=-1)
    return torch.where(torch.isneginf(logits).all(-1, keepdim=True), 0.0, p)


# FX writes an argument it has no rule for as its repr (see graphquant.ops.site).
torch.fx.graph._register_custom_builtin("AttentionSite", f"from {__name__} import AttentionSite", AttentionSite)
