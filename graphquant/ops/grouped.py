"""torch._grouped_mm(x (T, K), w (E, K, N), offs) quantized as TE's GroupedLinear.

Expert g owns rows offs[g-1]:offs[g] of x (offs: int32 cumulative end rows, offs[-1] == T) and
w[g] (K, N); each expert is its own GEMM of the design's table, with y = x @ W^T for W = w[g]^T:

    fprop  y_g      = x_g.rowwise           @ W_g.rowwise^T
    dgrad  dx_g     = grad_output_g.rowwise @ W_g.columnwise
    wgrad  dW_g^T   = grad_output_g.columnwise^T @ x_g.columnwise

Every group is quantized as if alone, zero-padded to whole blocks: the ops work on
graphquant.formats.groups' padded layout, in which every group of tokens, and every expert's N
rows of W, start at a multiple of ``GROUP_ROWS`` rows (a graph's fprop alone of few tokens an
expert, where the format allows: FEW_TOKEN_ROWS, Site.token_rows). So groups of any size, empty ones
included, run every groupable format, per-tensor formats get one scale per group (delayed
scaling: one slot per group, each with its own history), and no scale block spans two groups.
The offsets never leave the device: the layout's shapes are static bounds, and bad offsets fail
by a device-side assert.

Stochastic rounding draws from the slot's stream of the step, as a dense site's slot does, and
each group draws what the plain quantize, with that stream, draws for the group's part of the
padded layout taken alone: its rows and the zero rows after it, up to the next group's start (the
last group: up to the layout's end, ``padded_bound`` rows in all), and the tensor's columns
(grad_output's padded to W's padded rows). So a group's numbers depend on its own size, never on
the other groups' values; ``native.reference_grouped_quantize`` of the padded layout gives them,
as the native kernel and ``Quantizer.quantize_groups`` do.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from graphquant.formats import groups
from graphquant.formats.groups import GROUP_ROWS
from graphquant.kernels import backends, native
from graphquant.kernels import grouped as grouped_kernels
from graphquant.ops import recording, registry
from graphquant.ops.frozen import refuse_backward
from graphquant.ops.library import distinct_contiguous, kept_layout, layout_key, quantizer_of, unflatten
from graphquant.ops.operands import Operand, save_columnwise, saved_columnwise
from graphquant.ops.quantize import hybrid_directions, update_delayed_scaling
from graphquant.ops.site import Site
from graphquant.quantizers import COLUMNWISE, ROWWISE, IdentityQuantizer, QuantizeContext, Quantizer

@registry.op("grouped_quantize")
def grouped_quantize(
    x: torch.Tensor, row_group: torch.Tensor, bounds: torch.Tensor, source: Optional[torch.Tensor], runs: Optional[torch.Tensor],
    spec: str, rowwise: bool, columnwise: bool, rng: Optional[torch.Tensor], rng_stream: int,
    columnwise_amax: Optional[torch.Tensor], take_columnwise_amax: bool, amax_group: Optional[str], scale: Optional[torch.Tensor],
) -> list[torch.Tensor]:
    """The wanted directions of ``x`` in the padded layout (``row_group``: each padded row's
    group; ``bounds``: each group's first padded row, then the padded rows, GroupPadding.bounds;
    ``source``: the row of x each padded row holds, -1 a zero row, or None where x is in the
    layout already, and ``runs``, its GroupPadding.runs), each group quantized as if alone, in one
    read of x where a kernel makes both (native.grouped_quantize_pass, which reads x's rows
    through ``source``: no padded copy of x): [data, scale, amax] of the rowwise representation if
    wanted, then of the columnwise one, then with ``take_columnwise_amax`` (rowwise alone) the
    amaxes the columnwise side scales from, which a later call for the same x's columnwise
    representation takes as ``columnwise_amax`` instead of reading x for them. rng: int64 [seed,
    step] and rng_stream pick the stochastic-rounding stream, as for graphquant::quantize; a format
    that reduces its amaxes all-reduces each group's over the process group ``amax_group``;
    ``scale``: a delayed-scaling format's current scales, one a group."""
    ctx = QuantizeContext(scale=scale, rng=rng, offset=rng_stream, amax_group=amax_group)
    made = native.grouped_quantize_pass(
        quantizer_of(spec), x, row_group, bounds, ctx, rowwise=rowwise, columnwise=columnwise, source=source, runs=runs,
        columnwise_amax=columnwise_amax, take_columnwise_amax=take_columnwise_amax,
    )
    tensors = [t for rep in (made.rowwise, made.columnwise) if rep is not None for t in rep.tensors()]
    return distinct_contiguous(tensors + ([made.columnwise_amax] if take_columnwise_amax else []), x)


@registry.fake("grouped_quantize")
def _(x, row_group, bounds, source, runs, spec, rowwise, columnwise, rng, rng_stream, columnwise_amax, take_columnwise_amax, amax_group, scale):
    quantizer = quantizer_of(spec)
    padded = x if source is None else x.new_empty((source.shape[0], x.shape[1]))
    wanted = [d for d, want in ((ROWWISE, rowwise), (COLUMNWISE, columnwise)) if want]

    def made() -> list[torch.Tensor]:
        reps = [quantizer.child(d).quantize_groups(padded, row_group, bounds.shape[0] - 1, d, QuantizeContext(scale=scale)) for d in wanted]
        tensors = [t for rep in reps for t in rep.tensors()]
        if take_columnwise_amax:
            tensors.append(quantizer.child(COLUMNWISE).grouped_columnwise_amax(padded, row_group, bounds.shape[0] - 1))
        return tensors

    key = ("grouped_quantize", quantizer, tuple(wanted), take_columnwise_amax, *map(layout_key, (padded, row_group, bounds, scale)))
    return kept_layout(key, x, made)


@registry.op("grouped_dequantize")
def grouped_dequantize(
    tensors: list[torch.Tensor], spec: str, direction: str, shape: Sequence[int], row_group: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The logical (rows, cols) values of a grouped representation, as ``dtype``."""
    rep = unflatten(tensors, spec, direction, shape, dtype)
    return grouped_kernels.dequantize(rep, row_group, dtype).contiguous()


@registry.fake("grouped_dequantize")
def _(tensors, spec, direction, shape, row_group, dtype):
    return tensors[0].new_empty(tuple(shape), dtype=dtype)


@registry.op("grouped_gemm")
def grouped_gemm(
    a: list[torch.Tensor],
    a_spec: str,
    a_direction: str,
    a_shape: Sequence[int],
    a_group: torch.Tensor,
    b: list[torch.Tensor],
    b_spec: str,
    b_direction: str,
    b_shape: Sequence[int],
    b_group: torch.Tensor,
    ends: torch.Tensor,
    position: torch.Tensor,
    source: torch.Tensor,
    row_ends: torch.Tensor,
    n: int,
    out_dtype: torch.dtype,
    token_rows: int,
    backend: str,
    fast_accumulation: bool,
    site: str,
) -> torch.Tensor:
    """Each group's A_g @ B_g^T (graphquant.kernels.grouped.gemm), the padding dropped: A
    rowwise, tokens times an expert stack B, (tokens, n); A columnwise (wgrad), tokens times
    tokens, (groups, n, cols of B). a_group, ends, position, source, row_ends: the tokens' padded
    layout (groups.GroupPadding). backend, fast_accumulation: the fields of the GemmBackend the plan
    chose for this GEMM, which runs it; site names the GEMM in errors ("moe#0 wgrad")."""
    rep_a = unflatten(a, a_spec, a_direction, a_shape, out_dtype)
    rep_b = unflatten(b, b_spec, b_direction, b_shape, out_dtype)
    chosen = backends.named(backend, fast_accumulation)
    tokens = groups.GroupPadding(position, a_group, ends, source, row_ends)
    return grouped_kernels.gemm(rep_a, rep_b, b_group, tokens, token_rows, n, out_dtype, chosen, site)


@registry.fake("grouped_gemm")
def _(
    a, a_spec, a_direction, a_shape, a_group, b, b_spec, b_direction, b_shape, b_group, ends, position, source, row_ends, n,
    out_dtype, token_rows, backend, fast_accumulation, site,
):
    shape = (position.shape[0], n) if a_direction == ROWWISE else (ends.shape[0], n, b_shape[1])
    return a[0].new_empty(shape, dtype=out_dtype)


def quantize_grouped(
    x: torch.Tensor, layout: groups.GroupPadding, quantizer: Quantizer, directions: tuple[str, ...],
    rng: Optional[torch.Tensor], stream: int, amax_group: Optional[str], columnwise_amax: Optional[torch.Tensor] = None,
    scale: Optional[torch.Tensor] = None, rows: Optional[torch.Tensor] = None,
) -> dict[str, Operand]:
    """The grouped representations of ``x`` (its rows, which ``layout`` puts in the padded
    layout; with ``rows``, the rows x[rows], read through that gather rather than copied first)
    in ``directions``, honouring hybrid children and sources; a stochastic child draws
    from stream ``stream`` of the step ``rng``, and a child that reduces its amaxes all-reduces
    them over ``amax_group``. columnwise_amax: what ``rowwise_and_columnwise_amax`` took of the
    same x, for its columnwise representation; scale: a delayed-scaling child's current scales
    (``_slot_scales``)."""

    # x's row for each padded row: the layout's gather, composed with the model's where given. The
    # layout's zero rows (source -1) index the -1 put after rows, which an empty rows has too.
    through = layout.gather if rows is None else torch.cat((rows, rows.new_full((1,), -1)))[layout.source]

    def quantize(source: torch.Tensor, made: Quantizer, wanted: tuple[str, ...]) -> dict[str, Operand]:
        if wanted == (ROWWISE,) and backends.grouped_rowwise_traced(made):
            # Traced: Inductor fuses the rows' gather and amaxes with their producer, in place of
            # the kernel's own launches (which set a decode step's pace more than its bytes).
            padded = (source if through is None else groups.gather_rows(source, through)) if source is x else source
            ctx = QuantizeContext(amax_group=amax_group if made.reduces_amax else None)
            rep = made.quantize_groups(padded, layout.row_group, layout.groups, ROWWISE, ctx)
            return {ROWWISE: _operand(rep.tensors(), made, ROWWISE, layout, x)}
        made_rng, made_stream = (rng, stream) if made.stochastic else (None, 0)
        # x's rows are read into the layout by the quantize; the dequantized rowwise lies in it.
        gather, runs = (through, layout.runs if rows is None else None) if source is x else (None, None)
        given = columnwise_amax if source is x and COLUMNWISE in wanted else None
        tensors = torch.ops.graphquant.grouped_quantize(
            source, layout.row_group, layout.bounds, gather, runs, made.spec, ROWWISE in wanted, COLUMNWISE in wanted, made_rng,
            made_stream, given, False, amax_group if made.reduces_amax else None, scale if made.keeps_state else None,
        )
        order = [d for d in (ROWWISE, COLUMNWISE) if d in wanted]  # the op's
        return {d: _operand(tensors[3 * i : 3 * i + 3], made, d, layout, x) for i, d in enumerate(order)}

    def rowwise_values(row: Operand) -> torch.Tensor:
        return torch.ops.graphquant.grouped_dequantize(row.tensors, row.spec, ROWWISE, row.shape, layout.row_group, x.dtype)

    if len(directions) == 2 and not quantizer.columnwise_from_rowwise():
        return quantize(x, quantizer, directions)  # both from one read of x
    return hybrid_directions(x, quantizer, directions, lambda source, child, d: quantize(source, child, (d,))[d], rowwise_values)


def rowwise_and_columnwise_amax(
    x: torch.Tensor, layout: groups.GroupPadding, quantizer: Quantizer, rng: Optional[torch.Tensor], stream: int,
    amax_group: Optional[str], scale: Optional[torch.Tensor] = None,
) -> tuple[Operand, Optional[torch.Tensor]]:
    """(x's grouped rowwise representation, the amaxes its columnwise one scales from), both from
    one read of x, for a later ``quantize_grouped(..., columnwise_amax=...)`` of the same x that
    then reads x once, not twice; None for the amaxes of a columnwise made from the rowwise, or
    all-reduced (the reduction comes with the columnwise quantize, which takes them itself), or
    scaled from a delayed-scaling slot (``scale``: its current scales)."""
    reduced = quantizer.reduces_amax and amax_group is not None
    if quantizer.columnwise_from_rowwise() or reduced or quantizer.keeps_state:
        return quantize_grouped(x, layout, quantizer, (ROWWISE,), rng, stream, amax_group, scale=scale)[ROWWISE], None
    made_rng, made_stream = (rng, stream) if quantizer.stochastic else (None, 0)
    *tensors, amax = torch.ops.graphquant.grouped_quantize(
        x, layout.row_group, layout.bounds, layout.gather, layout.runs, quantizer.spec, True, False, made_rng, made_stream, None, True,
        None, None,
    )
    return _operand(tensors, quantizer, ROWWISE, layout, x), amax


def _operand(tensors: list[torch.Tensor], quantizer: Quantizer, direction: str, layout: groups.GroupPadding, x: torch.Tensor) -> Operand:
    """The ``direction`` operand of x in ``layout`` from a grouped_quantize's three tensors. An
    absent part (Representation.tensors' empty tensor) is made here, not taken from the op: a
    backward that quantizes a parameter again would otherwise let the partitioner keep that tensor
    of no bytes from a forward run of the whole quantize, which then runs twice."""
    tensors = [x.new_empty(0, dtype=torch.float32) if t.dim() == 1 and t.shape[0] == 0 else t for t in tensors]
    return Operand(tensors, quantizer.child(direction).spec, direction, (layout.padded_rows, x.shape[1]))


def _gemm(
    a: Operand, b: Operand, b_group: torch.Tensor, tokens: groups.GroupPadding, n: int, out_dtype: torch.dtype,
    site: Site, gemm: str, backend: Optional[backends.GemmBackend] = None,
) -> torch.Tensor:
    """A (tokens, padded layout) times B (an expert stack, or tokens for wgrad) on the backend the
    plan chose for ``gemm`` of ``site``, or on ``backend``: see grouped_gemm."""
    planned, name = site.runs(gemm)
    backend = backend or planned
    token_rows = groups.token_block(site.token_rows, tokens.position.shape[0], tokens.groups)
    return torch.ops.graphquant.grouped_gemm(
        a.tensors, a.spec, a.direction, a.shape, tokens.row_group, b.tensors, b.spec, b.direction, b.shape, b_group,
        tokens.ends, tokens.position, tokens.source, tokens.row_ends, n, out_dtype, token_rows, backend.name,
        backend.fast_accumulation, name,
    )


def _recorded_gemm(
    a_hp: torch.Tensor, a: Operand, a_layout: groups.GroupPadding, b_hp: torch.Tensor, b: Operand, b_layout: groups.GroupPadding,
    tokens: groups.GroupPadding, n: int, out_dtype: torch.dtype, site: Site, gemm: str,
) -> torch.Tensor:
    """``_gemm`` of a and b, which ``a_layout`` and ``b_layout`` made of the high-precision a_hp and
    b_hp, reported to a listening recorder (graphquant.numerics) with the same product of a_hp and
    b_hp held in high precision."""
    out = _gemm(a, b, b_layout.row_group, tokens, n, out_dtype, site, gemm)
    if recording.listening() and a_hp is not None and b_hp is not None:  # None: not kept from a forward run unobserved
        held = [
            quantize_grouped(t, layout, IdentityQuantizer(), (op.direction,), None, 0, None)[op.direction]
            for t, op, layout in ((a_hp, a, a_layout), (b_hp, b, b_layout))
        ]
        high_precision = _gemm(*held, b_layout.row_group, tokens, n, out_dtype, site, gemm, backends.GemmBackend(backends.HIGH_PRECISION))
        grouping = recording.Grouping(a_layout.row_group, b_layout.row_group, (a_hp.numel(), b_hp.numel()), high_precision)
        recording.record(site, gemm, 1, a_layout.pad(a_hp), a, b_layout.pad(b_hp), b, None, out, grouping)
    return out


def _padded(size: int) -> int:
    return -(-size // GROUP_ROWS) * GROUP_ROWS


def _expert_stack(w: torch.Tensor) -> tuple[groups.GroupPadding, torch.Tensor]:
    """(the layout of the expert stack, its rows): W_g = w[g]^T (n, k) for each expert, stacked,
    every expert's rows padded to whole blocks in the layout."""
    experts, k, n = w.shape
    return _stack_layout(experts, n, w.device), w.transpose(1, 2).reshape(experts * n, k)


def _stack_layout(experts: int, n: int, device: torch.device) -> groups.GroupPadding:
    return groups.uniform_padding(experts, n, GROUP_ROWS, device)


def frozen_expert_stack(w: torch.Tensor, quantizer: Quantizer, amax_group: Optional[str]) -> Operand:
    """The rowwise operand an inference call makes of expert stack ``w`` (E, K, N) with the weight
    quantizer of a stateless format, made once to be stored (graphquant.freeze): the same bits,
    from the native kernel where there is one (a call traces a traceable format's: its bits are
    the kernel's, tested so), whose memory is the stack's codes alone."""
    stack, w2d = _expert_stack(w.detach())
    rowwise, ctx = quantizer.child(ROWWISE), QuantizeContext(amax_group=amax_group)
    made = native.grouped_quantize_pass(
        rowwise, w2d, stack.row_group, stack.bounds, ctx, rowwise=True, columnwise=False, source=stack.gather, runs=stack.runs
    )
    return _operand(made.rowwise.tensors(), rowwise, ROWWISE, stack, w2d)


def stored_stack_layout(spec: str, shape: Sequence[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """Meta tensors of the shapes and dtypes ``frozen_expert_stack`` stores for a (E, K, N) stack
    of ``dtype`` in the rowwise format ``spec``, for a checkpoint to be loaded into."""
    experts, k, n = shape
    stack = _stack_layout(experts, n, torch.device("meta"))
    padded = torch.empty((stack.padded_rows, k), dtype=dtype, device="meta")
    return quantizer_of(spec).quantize_groups(padded, stack.row_group, experts, ROWWISE, QuantizeContext()).tensors()


def _slot_scales(quantizer: Quantizer, delayed: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A delayed-scaling slot's current scales, one a group (its state's first column), or None.

    A copy: the forward updates the state in place, and a backward that quantizes again must
    see the scales the forward used."""
    return delayed[:, 0].clone() if delayed is not None and quantizer.keeps_state else None


def _record_amax(quantizer: Quantizer, site: Site, slot: int, delayed: Optional[torch.Tensor], operands: dict[str, Operand]) -> None:
    """Record each group's amax of this call in a delayed-scaling slot's histories (in place)."""
    if delayed is not None:
        update_delayed_scaling(quantizer, site.slot_state(slot, delayed), operands)


def _tokens_quantized(
    x: torch.Tensor, offs: torch.Tensor, experts: int, directions: tuple[str, ...], x_delayed: Optional[torch.Tensor],
    rng: Optional[torch.Tensor], site: Site, rows: Optional[torch.Tensor] = None,
) -> tuple[groups.GroupPadding, dict[str, Operand]]:
    """(the tokens' padded layout, x's grouped representations in ``directions``), x's
    amax recorded in its delayed-scaling slot: what the forward and a frozen stack's product both do with x
    (with ``rows``, the tokens x[rows], read through that gather)."""
    count = x.shape[0] if rows is None else rows.shape[0]
    groups.check_offsets(offs, count, site.label)
    block = groups.token_block(site.token_rows, count, experts)
    tokens = groups.padding(offs, count, block, groups.padded_bound(count, experts, block))
    x_quantizer = site.quantizers[0]
    xq = quantize_grouped(
        x, tokens, x_quantizer, directions, rng, site.streams[0], site.amax_group, scale=_slot_scales(x_quantizer, x_delayed), rows=rows
    )
    _record_amax(x_quantizer, site, 0, x_delayed, xq)
    return tokens, xq


class QuantizedGroupedMM(torch.autograd.Function):
    """y (T, N) = torch._grouped_mm(x (T, K), w (E, K, N), offs), per expert in the site's formats.

    A delayed-scaling slot keeps a scale and an amax history per expert (TE's grouped linear keeps
    one slot per GEMM): its state is (E, 1 + history) float32, rolled once a step.

    With ``rows`` the tokens are x[rows] (an MoE layer's gather of its tokens sorted by expert),
    read through that gather by the quantize, so that no copy of them is written first; the
    gradient of x sums each token's rows as indexing's backward does (an accumulating index_put,
    which Inductor compiles where it leaves index_add to a slower eager kernel)."""

    @staticmethod
    def forward(ctx, x, w, offs, rows, x_delayed, w_delayed, g_delayed, rng, site: Site):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        experts, _, n = w.shape
        w_quantizer = site.quantizers[1]
        tokens, xq = _tokens_quantized(x, offs, experts, (ROWWISE, COLUMNWISE) if need_dw else (ROWWISE,), x_delayed, rng, site, rows)
        stack, w2d = _expert_stack(w)
        # The weights' columnwise copy is made in backward from w, which lives anyway (a
        # parameter): kept, it would hold the experts' weights once more from forward to backward.
        # Its amaxes are taken here, in the rowwise's read of w, so that backward reads w once.
        w_scale = _slot_scales(w_quantizer, w_delayed)
        if need_dx:
            wq, w_amax = rowwise_and_columnwise_amax(w2d, stack, w_quantizer, rng, site.streams[1], site.amax_group, w_scale)
        else:
            wq, w_amax = quantize_grouped(w2d, stack, w_quantizer, (ROWWISE,), rng, site.streams[1], site.amax_group, scale=w_scale)[ROWWISE], None
        _record_amax(w_quantizer, site, 1, w_delayed, {ROWWISE: wq})
        listening = recording.listening()
        x_rows = x if rows is None or not listening else x[rows]  # the high-precision tokens, for a recorder alone
        y = _recorded_gemm(x_rows, xq[ROWWISE], tokens, w2d, wq, stack, tokens, n, torch.promote_types(x.dtype, w.dtype), site, "fprop")

        # rng is this call's own [seed, step]: the backward draws from the forward's step.
        save_columnwise(ctx, xq.get(COLUMNWISE), None, *tokens, w if need_dx else None, w_amax, w_scale, rng, rows)
        ctx.g_delayed = g_delayed  # not saved: see quantize.SlotState
        ctx.site, ctx.dtypes, ctx.n, ctx.x_rows = site, (x.dtype, w.dtype), n, x.shape[0]
        ctx.originals = (x_rows, w) if listening else (None, None)
        return y

    @staticmethod
    def backward(ctx, dy):
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        x_col, _, (*token_layout, w, w_amax, w_scale, rng, rows) = saved_columnwise(ctx)
        g_delayed = ctx.g_delayed
        site = ctx.site
        tokens = groups.GroupPadding(*token_layout)
        directions = ((ROWWISE,) if need_dx else ()) + ((COLUMNWISE,) if need_dw else ())
        if ctx.n % GROUP_ROWS:
            dy = F.pad(dy, (0, _padded(ctx.n) - ctx.n))  # as many columns as W's padded rows
        g_quantizer = site.quantizers[2]
        gq = quantize_grouped(dy, tokens, g_quantizer, directions, rng, site.streams[2], site.amax_group, scale=_slot_scales(g_quantizer, g_delayed))
        _record_amax(g_quantizer, site, 2, g_delayed, gq)
        dx = dw = None
        # dgrad first: the weights' columnwise copy lives only for it, and the weight gradient
        # (as large as w, and kept to the end) is made once dgrad's operands are freed.
        x, _ = ctx.originals
        if need_dx:
            stack, w2d = _expert_stack(w)
            w_col = quantize_grouped(
                w2d, stack, site.quantizers[1], (COLUMNWISE,), rng, site.streams[1], site.amax_group, w_amax, w_scale
            )[COLUMNWISE]
            dx = _recorded_gemm(dy, gq[ROWWISE], tokens, w2d, w_col, stack, tokens, w_col.shape[1], ctx.dtypes[0], site, "dgrad")
            if rows is not None:
                dx = dx.new_zeros((ctx.x_rows, dx.shape[1])).index_put_((rows,), dx, accumulate=True)
        if need_dw:
            dw = _recorded_gemm(dy, gq[COLUMNWISE], tokens, x, x_col, tokens, tokens, ctx.n, ctx.dtypes[1], site, "wgrad").transpose(1, 2)
        return dx, dw, None, None, None, None, None, None, None


def _fprop_alone(
    x, offs, wq: Operand, stack: groups.GroupPadding, n: int, dtype: torch.dtype, site: Site, states, rng, rows=None
) -> torch.Tensor:
    """The forward's product of x (x[rows] with ``rows``), quantized rowwise alone as the forward
    quantizes it, and the expert stack's rowwise operand ``wq`` (of weights of ``dtype``): nothing
    kept for a backward."""
    tokens, xq = _tokens_quantized(x.detach(), offs, stack.groups, (ROWWISE,), states[0], rng, site, rows)
    return _gemm(xq[ROWWISE], wq, stack.row_group, tokens, n, torch.promote_types(x.dtype, dtype), site, "fprop")


def quantized_frozen_grouped_mm(
    x, weight, offs, *, site: Site, shape: Sequence[int], dtype: torch.dtype, states=(None, None, None), rng=None, rows=None
):
    """torch._grouped_mm(x, w, offs) (x[rows] with ``rows``) for a w (E, K, N) of ``dtype`` that
    graphquant.freeze stored as ``weight``, the tensors of its expert stack's rowwise
    representation; fprop alone, x quantized as QuantizedGroupedMM's forward quantizes it."""
    experts, k, n = shape
    if rows is not None:
        rows = groups.gather_index(rows, x.shape[0], site.label)
    if (x.shape[0] if rows is None else rows.shape[0]) == 0:  # no tokens: nothing reads the stored codes
        return x.new_empty((0, n), dtype=dtype)
    stack = _stack_layout(experts, n, x.device)
    wq = Operand(list(weight), site.quantizers[1].child(ROWWISE).spec, ROWWISE, (stack.padded_rows, k))
    return refuse_backward(x, _fprop_alone(x, offs, wq, stack, n, dtype, site, states, rng, rows), site.label)


def quantized_grouped_mm(x, w, offs, *, site: Site, states=(None, None, None), rng=None, rows=None):
    """torch._grouped_mm(x, w, offs=offs) in the site's formats; with ``rows``,
    torch._grouped_mm(x[rows], w, offs=offs), x's rows read through that gather. states: the delayed-scaling
    state of input, weight and grad_output (None where a slot keeps none), (E, 1 + history) each;
    rng: the step's int64 [seed, step], for stochastic rounding. Where ``site.inference`` (a graph
    that never runs backward), fprop alone: x and the weights quantized rowwise only (an autograd
    function's forward cannot tell, since a parameter asks for its gradient under no_grad too)."""
    if rows is not None:
        rows = groups.gather_index(rows, x.shape[0], site.label)
    if not site.inference:
        return QuantizedGroupedMM.apply(x, w, offs, rows, *states, rng, site)
    w_quantizer, n = site.quantizers[1], w.shape[2]
    stack, w2d = _expert_stack(w.detach())
    wq = quantize_grouped(w2d, stack, w_quantizer, (ROWWISE,), rng, site.streams[1], site.amax_group, scale=_slot_scales(w_quantizer, states[1]))
    _record_amax(w_quantizer, site, 1, states[1], wq)
    return _fprop_alone(x, offs, wq[ROWWISE], stack, n, w.dtype, site, states, rng, rows)
