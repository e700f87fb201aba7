"""The autograd formula of a quantized GEMM, and the functions a rewritten graph calls.

For y = x @ w^T (batched over groups when ``batch`` > 1):

    fprop  y  = x.rowwise          @ w.rowwise^T
    dgrad  dx = grad_output.rowwise @ w.columnwise^T
    wgrad  dw = grad_output.columnwise @ x.columnwise^T

Only the representations a pass needs are made: no columnwise ones when nothing needs a gradient
(inference), and backward keeps the quantized columnwise representations, never the
high-precision originals, unless the recipe holds that direction in high precision (Identity).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable, Iterator, Optional

import torch

from graphquant.kernels import native
from graphquant.ops.library import quantizer_of
from graphquant.quantizers import (
    COLUMNWISE,
    ROWWISE,
    Float8CurrentScalingQuantizer,
    Float8DelayedScalingQuantizer,
    HybridQuantizer,
    IdentityQuantizer,
    QuantizeContext,
    Quantizer,
)
from graphquant.recipes import DEFAULT_FAST_ACCUMULATION


@dataclasses.dataclass(frozen=True)
class Operand:
    """One direction of one quantized tensor as the ops carry it."""

    tensors: list[torch.Tensor]
    spec: str
    direction: str
    shape: tuple[int, int]


@dataclasses.dataclass(frozen=True)
class SlotState:
    """The tensors a slot's quantize may need: delayed-scaling state and the random stream."""

    delayed: Optional[torch.Tensor]  # float32 [scale, amax_history...]
    rng: Optional[torch.Tensor]  # int64 [seed, step]
    stream: int
    amax_group: Optional[str] = None  # the process group of amax reductions (graphquant.distributed)


def hybrid_directions(
    x: torch.Tensor,
    quantizer: Quantizer,
    directions: tuple[str, ...],
    encode: Callable[[torch.Tensor, Quantizer, str], Operand],
    rowwise_values: Callable[[Operand], torch.Tensor],
) -> dict[str, Operand]:
    """The representations of ``x`` in ``directions``: each made by ``encode(source, child,
    direction)``, the columnwise source being x or, for a rowwise_dequantized hybrid,
    ``rowwise_values`` of the rowwise representation (made for it even when not wanted)."""
    made: dict[str, Operand] = {}
    from_rowwise = COLUMNWISE in directions and feeds_columnwise_of(quantizer)
    for direction in (ROWWISE, COLUMNWISE):
        if direction in directions or (direction == ROWWISE and from_rowwise):
            source = rowwise_values(made[ROWWISE]) if direction == COLUMNWISE and from_rowwise else x
            made[direction] = encode(source, quantizer.child(direction), direction)
    return {d: made[d] for d in directions}


def quantize_tensor(
    x: torch.Tensor,
    quantizer: Quantizer,
    directions: tuple[str, ...],
    state: SlotState,
    *,
    dbias: bool = False,
    one_read: bool = True,
) -> tuple[dict[str, Operand], Optional[torch.Tensor]]:
    """The representations of 2-D ``x`` in ``directions``, honouring hybrid children and sources,
    and with ``dbias`` x's column sums (the bias gradient of a linear whose grad_output is x).

    Formats a kernel makes (not traceable) take one graphquant::quantize call for everything;
    traceable ones are traced, so Inductor fuses them (and the sums) with their neighbours. With
    ``one_read``, directions that scale over different blocks (1x128 and 128x1, MXFP8's 1x32 and
    32x1, rows and columns) take the one call too: traced, each is an Inductor reduction of its own
    that recomputes x's producer (a SwiGLU backward's three inputs read three times), and a
    forward's columnwise copy is recomputed in backward from the values it came from, alive at the
    backward's peak; the kernel reads each tile once for both.
    A linear's weight is quantized without it (``quantize_weight``).
    """
    if directions and (_untraceable(quantizer, directions) or (one_read and _blockings_differ(quantizer, directions))):
        return _quantize_op(x, quantizer, directions, state, dbias)
    operands = hybrid_directions(
        x,
        quantizer,
        directions,
        lambda source, child, direction: _quantize_direction(source, child, direction, state),
        lambda row: torch.ops.graphquant.dequantize(row.tensors, row.spec, ROWWISE, row.shape, x.dtype),
    )
    return operands, native.reference_dbias(x) if dbias else None


def quantize_weight(w: torch.Tensor, quantizer: Quantizer, directions: tuple[str, ...], state: SlotState) -> dict[str, Operand]:
    """A linear's weight in ``directions``, each representation traced so that its backward copy
    is recomputed from the parameter (which lives anyway) instead of kept from forward to backward.

    Per-tensor current scaling takes its amax and rowwise copy from one graphquant::quantize call
    instead: traced, a parameter's amax and cast fuse with nothing, and as Inductor kernels of
    their own they run well below the native kernels' bandwidth. Its columnwise copy stays traced,
    from that amax.
    """
    per_tensor = isinstance(quantizer, Float8CurrentScalingQuantizer) and not quantizer.with_amax_reduction
    if not (per_tensor and w.is_contiguous()):  # a transposed view would be copied first
        return quantize_tensor(w, quantizer, directions, state, one_read=False)[0]
    operands, _ = _quantize_op(w, quantizer, (ROWWISE,), state)
    if COLUMNWISE in directions:
        amax = operands[ROWWISE].tensors[2]
        columnwise = quantizer.quantize_from_amax(w, amax, COLUMNWISE).tensors()
        operands[COLUMNWISE] = Operand(columnwise, quantizer.spec, COLUMNWISE, (w.shape[0], w.shape[1]))
    return {d: operands[d] for d in directions}


def _quantize_op(
    x: torch.Tensor, quantizer: Quantizer, directions: tuple[str, ...], state: SlotState, dbias: bool = False
) -> tuple[dict[str, Operand], Optional[torch.Tensor]]:
    """``directions`` of x (and with ``dbias`` its column sums) from one graphquant::quantize call.

    Only a quantizer that draws random numbers gets the slot's stream: the calls of slots that
    quantize one tensor alike (q, k and v of one input) are then equal, and the graph keeps one.
    Only one that reduces its amax gets the process group.
    """
    shape = (x.shape[0], x.shape[1])
    rowwise, columnwise = ROWWISE in directions, COLUMNWISE in directions
    rng, stream = (state.rng, state.stream) if quantizer.stochastic else (None, 0)
    amax_group = state.amax_group if quantizer.reduces_amax else None
    tensors = torch.ops.graphquant.quantize(
        x, quantizer.spec, rowwise, columnwise, _delayed_scale(quantizer, state), rng, stream, dbias, amax_group
    )
    made = [d for d, wanted in ((ROWWISE, rowwise), (COLUMNWISE, columnwise)) if wanted]  # the op's order
    operands = {d: Operand(list(tensors[3 * i : 3 * i + 3]), quantizer.child(d).spec, d, shape) for i, d in enumerate(made)}
    return operands, tensors[-1] if dbias else None


def _made_directions(quantizer: Quantizer, directions: tuple[str, ...]) -> set[str]:
    """``directions`` and the rowwise one a rowwise_dequantized columnwise is made from."""
    return set(directions) | ({ROWWISE} if COLUMNWISE in directions and feeds_columnwise_of(quantizer) else set())


def _untraceable(quantizer: Quantizer, directions: tuple[str, ...]) -> bool:
    """Whether no format the directions need is traceable (so one kernel call makes them all)."""
    return not any(quantizer.child(d).traceable for d in _made_directions(quantizer, directions))


def _blockings_differ(quantizer: Quantizer, directions: tuple[str, ...]) -> bool:
    """Whether two of the directions' scales cover different blocks (Identity has none)."""
    made = _made_directions(quantizer, directions)
    return len({quantizer.block(d) for d in made if not isinstance(quantizer.child(d), IdentityQuantizer)}) > 1


def _delayed_scale(quantizer: Quantizer, state: SlotState) -> Optional[torch.Tensor]:
    """The slot's current scale where a delayed-scaling format reads it.

    A copy, not a view of the state: the forward updates the state in place, and a backward that
    recomputes this quantize must see the scale the forward used.
    """
    delayed = any(isinstance(quantizer.child(d), Float8DelayedScalingQuantizer) for d in (ROWWISE, COLUMNWISE))
    return state.delayed[:1].clone() if delayed else None


def feeds_columnwise_of(quantizer: Quantizer) -> bool:
    return isinstance(quantizer, HybridQuantizer) and quantizer.columnwise_source == "rowwise_dequantized"


def transposed_operand(rowwise: Operand) -> Operand:
    """The columnwise operand of a quantizer whose ``columnwise_is_rowwise_transposed``, from its
    rowwise one."""
    data, scale_inv, amax = rowwise.tensors
    return Operand([torch.ops.graphquant.transposed(data), scale_inv, amax], rowwise.spec, COLUMNWISE, rowwise.shape)


def _quantize_direction(x: torch.Tensor, quantizer: Quantizer, direction: str, state: SlotState) -> Operand:
    if quantizer.traceable:
        quantize = quantizer.quantize_rowwise if direction == ROWWISE else quantizer.quantize_columnwise
        tensors = quantize(x, QuantizeContext(amax_group=state.amax_group)).tensors()
        return Operand(tensors, quantizer.spec, direction, (x.shape[0], x.shape[1]))
    return _quantize_op(x, quantizer, (direction,), state)[0][direction]


def save_columnwise(ctx, x_col: Optional[Operand], w_col: Optional[Operand], *others: Optional[torch.Tensor]) -> None:
    """Save what a backward needs: the columnwise operands that exist (x's for wgrad, w's for
    dgrad), then ``others``; ``saved_columnwise`` gives them back."""
    kept = [op for op in (x_col, w_col) if op is not None]
    ctx.kept = [(x_col is not None, w_col is not None), [(len(op.tensors), op.spec, op.direction, op.shape) for op in kept]]
    ctx.save_for_backward(*[t for op in kept for t in op.tensors], *others)


def saved_columnwise(ctx) -> tuple[Optional[Operand], Optional[Operand], list[Optional[torch.Tensor]]]:
    """(x's columnwise operand or None, w's or None, the others) as ``save_columnwise`` saved them."""
    (has_x, has_w), metas = ctx.kept
    saved, start, kept = list(ctx.saved_tensors), 0, []
    for count, *meta in metas:
        kept.append(Operand(saved[start : start + count], *meta))
        start += count
    x_col = kept.pop(0) if has_x else None
    w_col = kept.pop(0) if has_w else None
    return x_col, w_col, saved[start:]


def update_delayed_scaling(quantizer: Quantizer, state: SlotState, operands: dict[str, Operand]) -> None:
    """Roll the slot's amax history with this call's amax and store the next scale, in place."""
    if not isinstance(quantizer, Float8DelayedScalingQuantizer) or not operands:
        return
    amax = next(iter(operands.values())).tensors[2]
    if quantizer.reduce_amax and state.amax_group is not None:
        from graphquant.distributed import all_reduce_amax

        amax = all_reduce_amax(amax, state.amax_group)
    with torch.no_grad():
        scale, history = quantizer.update(state.delayed[:1], state.delayed[1:], amax)
        state.delayed.copy_(torch.cat([scale, history]))


def _gemm(
    a: Operand, b: Operand, batch: int, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None, fast: bool = False
) -> torch.Tensor:
    return torch.ops.graphquant.gemm(
        a.tensors, a.spec, a.direction, a.shape, b.tensors, b.spec, b.direction, b.shape, batch, out_dtype, bias, fast
    )


@dataclasses.dataclass(frozen=True)
class Site:
    """What the autograd formula needs to know about one GEMM call: its formats and its state."""

    name: str
    x: Quantizer
    w: Quantizer
    grad_output: Quantizer
    batch: int
    call: int = 0
    amax_group: Optional[str] = None
    fast_accumulation: tuple[str, ...] = DEFAULT_FAST_ACCUMULATION  # CustomRecipe.fast_accumulation
    w_is_parameter: bool = False  # w is a linear's weight (quantize_weight), not an activation

    @property
    def label(self) -> str:
        return f"{self.name}#{self.call}"

    def fast(self, gemm: str) -> bool:
        """Whether ``gemm`` ("fprop", "dgrad", "wgrad") may sum in the tensor cores' accumulator."""
        return gemm in self.fast_accumulation


@dataclasses.dataclass(frozen=True)
class RecordedGemm:
    """One GEMM as it ran: the high-precision 2-D tensors that entered the quantizers (a, b), the
    Operands the GEMM read, the bias it added (fprop of a biased linear) and its result."""

    site: Site
    gemm: str  # "fprop", "dgrad" or "wgrad"
    a: torch.Tensor
    a_operand: Operand
    b: torch.Tensor
    b_operand: Operand
    bias: Optional[torch.Tensor]
    out: torch.Tensor


# graphquant.numerics listens here: while ``recording(fn)`` is active, each GEMM calls fn with its
# RecordedGemm after it ran, and runs exactly as it does unobserved. Only eager execution reports
# real tensors, so numerics runs the rewritten graph eagerly. Inactive, a GEMM pays one global read.
_recorder: Optional[Callable[[RecordedGemm], None]] = None


@contextlib.contextmanager
def recording(recorder: Callable[[RecordedGemm], None]) -> Iterator[None]:
    global _recorder
    previous, _recorder = _recorder, recorder
    try:
        yield
    finally:
        _recorder = previous


def _record(site, gemm, a, a_operand, b, b_operand, out, bias=None) -> None:
    if _recorder is not None and a is not None and b is not None:
        _recorder(RecordedGemm(site, gemm, a, a_operand, b, b_operand, bias, out))


class QuantizedGemm(torch.autograd.Function):
    """y (batch, m, n) = x (batch*m, k) @ w (batch*n, k)^T (+ bias, one group), per group, in the
    site's formats; the bias is added in the GEMM, and its gradient comes from grad_output's quantize."""

    @staticmethod
    def forward(ctx, x, w, bias, x_delayed, w_delayed, g_delayed, rng, site: Site, streams: tuple[int, int, int]):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        x_state = SlotState(x_delayed, rng, streams[0], site.amax_group)
        w_state = SlotState(w_delayed, rng, streams[1], site.amax_group)
        xq, _ = quantize_tensor(x, site.x, (ROWWISE, COLUMNWISE) if need_dw else (ROWWISE,), x_state)
        w_directions = (ROWWISE, COLUMNWISE) if need_dx else (ROWWISE,)
        if site.w_is_parameter:
            wq = quantize_weight(w, site.w, w_directions, w_state)
        else:
            wq, _ = quantize_tensor(w, site.w, w_directions, w_state, one_read=False)
        update_delayed_scaling(site.x, x_state, xq)
        update_delayed_scaling(site.w, w_state, wq)
        out_dtype = torch.promote_types(x.dtype, w.dtype)
        y = _gemm(xq[ROWWISE], wq[ROWWISE], site.batch, out_dtype, bias, site.fast("fprop"))

        # rng is this call's own [seed, step] (the compiled wrapper never writes into one it handed
        # out), so keeping it gives the backward its forward's step in whatever order backwards run.
        save_columnwise(ctx, xq.get(COLUMNWISE), wq.get(COLUMNWISE), g_delayed, rng)
        ctx.site, ctx.stream = site, streams[2]
        ctx.dtypes = (x.dtype, w.dtype)
        ctx.originals = (x, w) if _recorder is not None else (None, None)
        _record(site, "fprop", x, xq[ROWWISE], w, wq[ROWWISE], y, bias)
        return y

    @staticmethod
    def backward(ctx, dy):
        need_dx, need_dw, need_dbias = ctx.needs_input_grad[:3]
        x_col, w_col, (g_delayed, rng) = saved_columnwise(ctx)
        site = ctx.site
        x, w = ctx.originals
        dy2d = dy.reshape(-1, dy.shape[-1])
        g_state = SlotState(g_delayed, rng, ctx.stream, site.amax_group)
        # Where the columnwise copy is the rowwise bits transposed, an op makes it from them:
        # traced together, Inductor wrote both copies in one kernel while grad_output's inputs (a
        # SwiGLU's gate, up and dh) were still alive, a decoder's memory peak.
        late = need_dx and need_dw and site.grad_output.columnwise_is_rowwise_transposed()
        directions = ((ROWWISE,) if need_dx else ()) + ((COLUMNWISE,) if need_dw and not late else ())
        gq, dbias = quantize_tensor(dy2d, site.grad_output, directions, g_state, dbias=need_dbias)
        if late:
            gq[COLUMNWISE] = transposed_operand(gq[ROWWISE])
        update_delayed_scaling(site.grad_output, g_state, gq)
        dx = dw = None
        # wgrad first: its input operand (a SwiGLU's h, or h's FP8 copy) is then freed before
        # dgrad's output (as large, for a down projection) is allocated.
        if need_dw:
            dw = _gemm(gq[COLUMNWISE], x_col, site.batch, ctx.dtypes[1], fast=site.fast("wgrad"))
            dw = dw.reshape(-1, x_col.shape[1])
            _record(site, "wgrad", dy2d, gq[COLUMNWISE], x, x_col, dw)
        if need_dx:
            dx = _gemm(gq[ROWWISE], w_col, site.batch, ctx.dtypes[0], fast=site.fast("dgrad"))
            dx = dx.reshape(-1, w_col.shape[1])
            _record(site, "dgrad", dy2d, gq[ROWWISE], w, w_col, dx)
        return dx, dw, dbias, None, None, None, None, None, None


def _product(
    x2d, w2d, batch, *, name, call, input, weight, grad_output, states, rng, streams, amax_group=None, bias=None,
    fast_accumulation=DEFAULT_FAST_ACCUMULATION, w_is_parameter=False,
):
    site = Site(
        name, quantizer_of(input), quantizer_of(weight), quantizer_of(grad_output), batch, call, amax_group, fast_accumulation,
        w_is_parameter,
    )
    return QuantizedGemm.apply(x2d, w2d, bias, *states, rng, site, streams)


def quantized_linear(
    x,
    w,
    bias=None,
    *,
    name,
    call,
    input,
    weight,
    grad_output,
    states=(None, None, None),
    rng=None,
    streams=(0, 1, 2),
    inference=False,
    amax_group=None,
    fast_accumulation=DEFAULT_FAST_ACCUMULATION,
):
    """F.linear(x, w, bias) with input, weight and grad_output in the formats named.

    inference: the graph never runs backward, so no autograd formula is needed (``_inference_product``).
    fast_accumulation: the GEMMs that may sum in the tensor cores' accumulator (the recipe's).
    """
    x2d = x.reshape(-1, x.shape[-1])
    if inference:
        y = _inference_product(
            x2d, w, bias, input=input, weight=weight, states=states, rng=rng, streams=streams, amax_group=amax_group,
            fast="fprop" in fast_accumulation,
        )
    else:
        y = _product(
            x2d, w, 1, name=name, call=call, input=input, weight=weight, grad_output=grad_output, states=states, rng=rng,
            streams=streams, amax_group=amax_group, bias=bias, fast_accumulation=fast_accumulation, w_is_parameter=True,
        )
    return y.reshape(*x.shape[:-1], w.shape[0])


def _inference_product(x2d, w, bias, *, input, weight, states, rng, streams, amax_group, fast):
    """fprop alone, nothing kept for a backward: x and w quantized rowwise only.

    The weight is quantized from its value at this call, never kept from an earlier one: PyTorch
    has no cheap sign that a tensor's memory was written (writes through ``.data`` move no version
    counter; fused and foreach optimizer steps on CUDA move neither the version counter nor a
    copy-on-write mark), so a kept copy could outlive the values it was made from.
    """
    x_quantizer, w_quantizer = quantizer_of(input), quantizer_of(weight)
    x_state = SlotState(states[0], rng, streams[0], amax_group)
    w_state = SlotState(states[1], rng, streams[1], amax_group)
    xq, _ = quantize_tensor(x2d.detach(), x_quantizer, (ROWWISE,), x_state)
    wq = quantize_weight(w.detach(), w_quantizer, (ROWWISE,), w_state)
    update_delayed_scaling(x_quantizer, x_state, xq)
    update_delayed_scaling(w_quantizer, w_state, wq)
    bias = None if bias is None else bias.detach()
    return _gemm(xq[ROWWISE], wq[ROWWISE], 1, torch.promote_types(x2d.dtype, w.dtype), bias, fast)


def quantized_matmul(
    a, b, *, name, call, input, grad_output, other=None, weight=None, states=(None, None, None), rng=None, streams=(0, 1, 2),
    amax_group=None, fast_accumulation=DEFAULT_FAST_ACCUMULATION,
):
    """a @ b (matmul, mm, bmm) with a as input and b as other; b is quantized as b^T (n, k).

    A product whose b is a Parameter is a linear site: its format then comes as ``weight``.
    """
    parameter, other = other is None, weight if other is None else other
    k = a.shape[-1]
    if b.dim() == 2:
        y = _product(
            a.reshape(-1, k), b.t(), 1, name=name, call=call, input=input, weight=other, grad_output=grad_output,
            states=states, rng=rng, streams=streams, amax_group=amax_group, fast_accumulation=fast_accumulation,
            w_is_parameter=parameter,
        )
        return y.reshape(*a.shape[:-1], b.shape[-1])
    batch_shape = a.shape[:-2]
    y = _product(
        a.reshape(-1, k), b.transpose(-1, -2).reshape(-1, k), math.prod(batch_shape), name=name, call=call, input=input,
        weight=other, grad_output=grad_output, states=states, rng=rng, streams=streams, amax_group=amax_group,
        fast_accumulation=fast_accumulation, w_is_parameter=parameter,
    )
    return y.reshape(*batch_shape, a.shape[-2], b.shape[-1])


def quantized_addmm(c, a, b, *, beta=1, alpha=1, **site):
    """beta * c + alpha * (a @ b) (addmm, baddbmm), the product quantized."""
    product = quantized_matmul(a, b, **site)
    product = product if alpha == 1 else alpha * product
    return product + (c if beta == 1 else beta * c)


def quantized_einsum(
    layout, a, b, *, name, call, input, other, grad_output, states=(None, None, None), rng=None, streams=(0, 1, 2), amax_group=None,
    fast_accumulation=DEFAULT_FAST_ACCUMULATION,
):
    """A two-operand einsum that is one batched product, quantized like quantized_matmul; ``layout``
    (graphquant.passes.einsum.EinsumLayout, as find_gemms worked it out) says how it is one."""
    batch, m, k = layout.x_shape
    x = a.permute(layout.a_perm).reshape(batch * m, k)
    w = b.permute(layout.b_perm).reshape(-1, k)
    y = _product(
        x, w, batch, name=name, call=call, input=input, weight=other, grad_output=grad_output, states=states, rng=rng,
        streams=streams, amax_group=amax_group, fast_accumulation=fast_accumulation,
    )
    return y.reshape(layout.y_shape).permute(layout.out_perm)
