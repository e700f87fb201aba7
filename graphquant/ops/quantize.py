"""How a GEMM site makes its operands from its tensors: the representations each direction
needs (hybrid children and sources), traced or from one graphquant::quantize call, and the
delayed-scaling state a quantize reads and updates."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from graphquant.kernels import native
from graphquant.ops.operands import Operand
from graphquant.quantizers import (
    COLUMNWISE,
    ROWWISE,
    QuantizeContext,
    Quantizer,
)


@dataclasses.dataclass(frozen=True)
class SlotState:
    """The tensors a slot's quantize may need: delayed-scaling state and the random stream.

    A backward's delayed state (grad_output's) rides on its autograd ctx, not in
    save_for_backward: each backward quantize updates it in place, and where the slot's GEMM ran
    twice before its backwards (a module called twice in one forward), autograd's check that a
    saved tensor is unchanged would fail the second."""

    delayed: Optional[torch.Tensor]  # float32 [scale, amax_history...]
    rng: Optional[torch.Tensor]  # int64 [seed, step]
    stream: int
    amax_group: Optional[str] = None  # the process group of amax reductions (graphquant.distributed)
    # Whether this call ends its slot's step (a delayed-scaling slot's last call in the graph; in
    # backward its first): it rolls the history and rescales. Earlier calls of the step (a module
    # called twice) record their amax into the history's newest entry and keep the scale, so
    # every call of a step quantizes with one scale and the step takes one history entry, as TE's.
    ends_step: bool = True


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
    from_rowwise = COLUMNWISE in directions and quantizer.columnwise_from_rowwise()
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
    """A linear's weight in ``directions``, its columnwise (backward) copy traced so that the
    backward recomputes it from the parameter (which lives anyway) instead of keeping it from
    forward to backward (or made there by the backward itself: ``columnwise_in_backward``).

    Its rowwise (forward) copy comes from one graphquant::quantize call where w's device has the
    kernel that makes it in one read of w (block-local scales, ``made_in_one_read``), or with w's
    per-tensor amax: traced, a parameter's amax and cast fuse with nothing, and as Inductor
    kernels of their own they run well below the native kernels' bandwidth. Per-tensor scaling's
    columnwise copy is traced from that amax, the others' whole. (Without the kernel the op runs
    the reference eagerly, slower than Inductor's traced copy.)
    """
    per_tensor = quantizer.encodes_from_tensor_amax()
    if ROWWISE not in directions or not (per_tensor or made_in_one_read(w, quantizer)) or not w.is_contiguous():  # a transposed view would be copied first
        return quantize_tensor(w, quantizer, directions, state, one_read=False)[0]
    operands, _ = _quantize_op(w, quantizer, (ROWWISE,), state)
    if COLUMNWISE in directions and per_tensor:
        amax = operands[ROWWISE].tensors[2]
        columnwise = quantizer.quantize_from_amax(w, amax, COLUMNWISE).tensors()
        operands[COLUMNWISE] = Operand(columnwise, quantizer.spec, COLUMNWISE, (w.shape[0], w.shape[1]))
    elif COLUMNWISE in directions:
        operands[COLUMNWISE] = quantize_tensor(w, quantizer, (COLUMNWISE,), state, one_read=False)[0][COLUMNWISE]
    return {d: operands[d] for d in directions}


def made_in_one_read(w: torch.Tensor, quantizer: Quantizer) -> bool:
    """Whether the kernel makes a weight's rowwise copy in one read of w: its scales are
    block-local and w's device has the kernel."""
    return (
        quantizer.child(ROWWISE).block_local_scales
        and not quantizer.columnwise_from_rowwise()
        and w.is_contiguous()
        and native.extension_for(w.device) is not None
    )


def columnwise_in_backward(w: torch.Tensor, quantizer: Quantizer) -> bool:
    """Whether a linear's backward makes the weight's columnwise copy from the parameter, in one
    graphquant::quantize call (``weight_columnwise``): where the kernel makes the rowwise one and
    the two directions scale different blocks (MXFP8's 1x32 and 32x1), so that the traced copy
    is an amax and a cast of its own. A 128x128 tile's copy stays traced, where the kernel's
    measured slower (benchmarks/NOTES.md, train_step.py's section)."""
    return made_in_one_read(w, quantizer) and _blockings_differ(quantizer, (ROWWISE, COLUMNWISE))


def weight_columnwise(w: torch.Tensor, quantizer: Quantizer, state: SlotState) -> Operand:
    """The columnwise copy of a weight ``columnwise_in_backward``, from the parameter."""
    return _quantize_op(w, quantizer, (COLUMNWISE,), state)[0][COLUMNWISE]


def transposed_operand(rowwise: Operand) -> Operand:
    """The columnwise operand of a quantizer whose ``columnwise_is_rowwise_transposed``, from its
    rowwise one."""
    data, scale_inv, amax = rowwise.tensors
    return Operand([torch.ops.graphquant.transposed(data), scale_inv, amax], rowwise.spec, COLUMNWISE, rowwise.shape)


def update_delayed_scaling(quantizer: Quantizer, state: SlotState, operands: dict[str, Operand]) -> None:
    """Record this call's amax in the slot's history (``record_amax``), in place."""
    if quantizer.keeps_state and operands:
        record_amax(quantizer, state, next(iter(operands.values())).tensors[2])


def record_amax(quantizer: Quantizer, state: SlotState, amax: torch.Tensor) -> None:
    """Record ``amax`` (reduced over the slot's process group where the format asks) in a
    delayed-scaling slot's history, with those of the step's earlier calls; where the call ends
    the step, roll the history and store the next scale. In place."""
    if quantizer.reduce_amax and state.amax_group is not None:
        from graphquant.distributed import all_reduce_amax

        amax = all_reduce_amax(amax, state.amax_group)
    with torch.no_grad():  # a grouped site's state has a row a group: [..., scale, history...]
        newest = state.delayed[..., 1:2]  # zero at a step's start: the update zeroes it
        amax = torch.maximum(newest, amax.reshape(newest.shape).to(newest.dtype))
        if not state.ends_step:
            newest.copy_(amax)
            return
        scale, history = quantizer.update(state.delayed[..., :1], state.delayed[..., 1:], amax)
        state.delayed.copy_(torch.cat([scale, history], -1))


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


def _quantize_direction(x: torch.Tensor, quantizer: Quantizer, direction: str, state: SlotState) -> Operand:
    if quantizer.traceable:
        quantize = quantizer.quantize_rowwise if direction == ROWWISE else quantizer.quantize_columnwise
        tensors = quantize(x, QuantizeContext(amax_group=state.amax_group)).tensors()
        return Operand(tensors, quantizer.spec, direction, (x.shape[0], x.shape[1]))
    return _quantize_op(x, quantizer, (direction,), state)[0][direction]


def _made_directions(quantizer: Quantizer, directions: tuple[str, ...]) -> set[str]:
    """``directions`` and the rowwise one a rowwise_dequantized columnwise is made from."""
    return set(directions) | ({ROWWISE} if COLUMNWISE in directions and quantizer.columnwise_from_rowwise() else set())


def _untraceable(quantizer: Quantizer, directions: tuple[str, ...]) -> bool:
    """Whether no format the directions need is traceable (so one kernel call makes them all)."""
    return not any(quantizer.child(d).traceable for d in _made_directions(quantizer, directions))


def _blockings_differ(quantizer: Quantizer, directions: tuple[str, ...]) -> bool:
    """Whether two of the directions' scales cover different blocks (Identity has none)."""
    made = _made_directions(quantizer, directions)
    return len({quantizer.block(d) for d in made if not quantizer.child(d).high_precision}) > 1


def _delayed_scale(quantizer: Quantizer, state: SlotState) -> Optional[torch.Tensor]:
    """The slot's current scale where a delayed-scaling format reads it.

    A copy, not a view of the state: the forward updates the state in place, and a backward that
    recomputes this quantize must see the scale the forward used.
    """
    delayed = any(quantizer.child(d).keeps_state for d in (ROWWISE, COLUMNWISE))
    return state.delayed[:1].clone() if delayed else None
