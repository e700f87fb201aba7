"""Where quantize and dequantize run: the native extension when it has a kernel, else the reference.

The op layer calls only the functions here, so native kernels plug in without touching the
passes or the ops. A kernel is used only for a CUDA tensor (2-D, bf16/fp16/fp32, not empty) and
a format the extension implements; everything else runs ``graphquant.formats`` (the numerics
contract), and the native results are bit-identical to it (tests/test_kernels_gpu.py).

A format runs natively where its quantizer answers ``kernel_encoding`` (a KernelEncoding, handed
to the extension field by field by name): per-tensor FP8 (current and delayed scaling), FP8
blocks (1x16 to 1x128, 16x1 to 128x1, 128x128), FP8 rowwise, MXFP8 and NVFP4 (1x16 / 16x16, RHT,
stochastic rounding, row-scaled), a user's format among them, in either direction or both in one
pass; a HybridQuantizer's two children fused into one pass (either columnwise source); the bias
gradient fused into the quantize; grouped (MoE) quantize.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple, Optional

import torch

from graphquant.formats import groups, nvfp4
from graphquant.kernels import devices
from graphquant.quantizers import (
    COLUMNWISE,
    ROWWISE,
    KernelEncoding,
    QuantizeContext,
    Quantizer,
    Representation,
)

_FP8 = {"e4m3": 0, "e5m2": 1}
_DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
# The dequantize kernel's kinds (csrc/cuda/params.h DequantKind).
_DEQUANT_SCALED, _DEQUANT_MX, _DEQUANT_NV = 0, 1, 2
_M32 = 0xFFFFFFFF


@functools.lru_cache(maxsize=None)
def extension() -> Optional[Any]:
    """graphquant._C if it was built with CUDA kernels, else None."""
    try:
        from graphquant import _C
    except ImportError:
        return None
    return _C if getattr(_C, "cuda_built", False) else None


def extension_for(device: torch.device) -> Optional[Any]:
    """The extension where its kernels run on ``device``: a GPU of a compute capability it was
    built for (``cuda_archs``: arch-specific targets, each of which runs on its own capability
    alone), else None, and the reference runs; the CPU test build (``emulated``) runs anywhere."""
    ext = extension()
    if ext is None or getattr(ext, "emulated", False):
        return ext
    sm = devices.capability(device)
    return ext if sm is not None and sm[0] * 10 + sm[1] in ext.cuda_archs else None


def has_sm90_kernel(ext: Optional[Any], name: str) -> bool:
    """Whether ``ext`` (extension_for's) has its Hopper kernel ``name``, built for sm_90 (sm_90a:
    wgmma), so that it runs there."""
    return ext is not None and hasattr(ext, name) and 90 in getattr(ext, "cuda_archs", ())


def sr_key(seed: int, offset: int, stream: int) -> int:
    """The key of ``nvfp4.random_bits(seed, offset, stream, ...)``: the kernels hash indices with it."""
    key = nvfp4._HASH_IV
    for word in (seed & _M32, (seed >> 32) & _M32, offset & _M32, (offset >> 32) & _M32, stream & _M32):
        key = nvfp4._fmix32(key ^ word)
    return key


class _Encoding(NamedTuple):
    """A quantizer's KernelEncoding of one direction, and the extension's Encoding made from it."""

    described: KernelEncoding
    native: Any


@functools.lru_cache(maxsize=None)
def _encoding(ext: Any, quantizer: Quantizer, direction: str) -> Optional[_Encoding]:
    """``quantizer``'s encoding of ``direction``, handed to the extension field by field by name,
    once per quantizer; None where the quantizer has none."""
    encoding = quantizer.kernel_encoding(direction)
    if encoding is None:
        return None
    if encoding.transposed != quantizer.transposed(direction):
        raise ValueError(
            f"{quantizer}: kernel_encoding({direction!r}) says transposed={encoding.transposed}, but its "
            f"representations say transposed({direction!r}) = {quantizer.transposed(direction)}; make the two agree"
        )
    return _Encoding(encoding, ext.Encoding(**{field.name: getattr(encoding, field.name) for field in dataclasses.fields(encoding)}))


class _Side(NamedTuple):
    """One direction of a native pass: the extension's Encoding, this call's stochastic-rounding
    key, and delayed scaling's current scale."""

    encoding: Any
    key: int
    scale: Optional[torch.Tensor]


def _side(
    ext: Any, quantizer: Quantizer, direction: str, ctx: QuantizeContext, x: torch.Tensor, device_rng: Optional[torch.Tensor],
    groups: int,
) -> Optional[_Side]:
    """How the kernels make ``quantizer``'s ``direction`` in this call of ``groups`` row groups,
    or None where they cannot; with ``device_rng`` the kernels make the stochastic-rounding key
    themselves."""
    if quantizer.reduces_amax and ctx.amax_group is not None:
        return None  # a kernel encodes with the amax it takes of x in the same pass: none to all-reduce first
    encoding = _encoding(ext, quantizer, direction)
    if encoding is None:
        return None
    scale = None
    if encoding.described.delayed_scaling:
        scale = ctx.scale
        if scale is None or scale.dtype != torch.float32 or scale.numel() != groups or scale.device != x.device:
            return None  # the reference raises the error, or handles the odd scale (one a group)
        scale = scale.contiguous()
    host_key = encoding.described.stochastic_rounding and device_rng is None
    key = sr_key(*ctx.random_stream(), int(direction == COLUMNWISE)) if host_key else 0
    return _Side(encoding.native, key, scale)


def _device_rng(ctx: QuantizeContext, x: torch.Tensor) -> Optional[torch.Tensor]:
    """ctx.rng where the kernels can read it themselves (int64 [seed, step] beside x), else None."""
    rng = ctx.rng
    if rng is None or rng.dtype != torch.int64 or rng.numel() != 2 or rng.device != x.device:
        return None
    return rng.contiguous()


class Quantized(NamedTuple):
    """What one quantize pass made: the wanted directions and the column sums (dbias)."""

    rowwise: Optional[Representation]
    columnwise: Optional[Representation]
    dbias: Optional[torch.Tensor]


class GroupedQuantized(NamedTuple):
    """What one grouped quantize pass made: the wanted directions and, where asked for
    (``take_columnwise_amax``), the amaxes the columnwise side scales from."""

    rowwise: Optional[Representation]
    columnwise: Optional[Representation]
    columnwise_amax: Optional[torch.Tensor] = None


def _run(
    quantizer: Quantizer,
    x: torch.Tensor,
    ctx: QuantizeContext,
    *,
    rowwise: bool,
    columnwise: bool,
    dbias: bool = False,
    group_bounds: Optional[torch.Tensor] = None,
    source: Optional[torch.Tensor] = None,
    runs: Optional[torch.Tensor] = None,
    columnwise_amax: Optional[torch.Tensor] = None,
    take_columnwise_amax: bool = False,
) -> Optional[tuple[Quantized, Optional[torch.Tensor]]]:
    """(both wanted directions and dbias, the columnwise side's amaxes where
    ``take_columnwise_amax``) from one native pass, or None where a kernel is missing.
    group_bounds: each group's first row, then the rows, int64 (GroupPadding.bounds), where x's
    row groups are each quantized alone. source: a padded layout's (groups.padding) row of x for
    each row to quantize (-1: a zero row), read by the kernel as ``runs`` of x's rows
    (GroupPadding.runs), a tile of GROUP_ROWS rows each.
    Without ``runs`` the kernel reads each row through ``source`` itself (a gather whose rows
    make no runs: an MoE layer's tokens sorted by expert).
    columnwise_amax: the amaxes the columnwise side scales from, as an earlier pass took them
    of the same x (``take_columnwise_amax``, with columnwise False: taken in the rowwise's read).
    """
    ext = extension_for(x.device)
    if ext is None or x.dim() != 2 or x.dtype not in _DTYPES or x.numel() == 0:
        return None
    row_q, col_q = quantizer.child(ROWWISE), quantizer.child(COLUMNWISE)
    dq_source = columnwise and quantizer.columnwise_from_rowwise()
    rng = _device_rng(ctx, x)
    groups = 1 if group_bounds is None else group_bounds.shape[0] - 1
    row = _side(ext, row_q, ROWWISE, ctx, x, rng, groups) if rowwise or dq_source else None
    if (rowwise or dq_source) and row is None:
        return None  # before the other side is asked of the extension
    col = _side(ext, col_q, COLUMNWISE, ctx, x, rng, groups) if columnwise or take_columnwise_amax else None
    if (columnwise or take_columnwise_amax) and col is None:
        return None
    out = ext.quantize(
        x,
        row.encoding if row else None,
        col.encoding if col else None,
        row.key if row else 0,
        col.key if col else 0,
        dq_source,
        rowwise,
        row.scale if row else None,
        col.scale if col else None,
        None if group_bounds is None else group_bounds.contiguous(),  # as a compiler may lay it out otherwise
        dbias,
        rng,
        ctx.offset,
        None if runs is None else runs.contiguous(),  # as a compiler may lay it out otherwise
        columnwise_amax,
        not take_columnwise_amax,
        None if source is None or runs is not None else source.contiguous(),
    )
    shape = x.shape if source is None else (source.shape[0], x.shape[1])
    made = Quantized(
        row_q.representation(ROWWISE, shape, x.dtype, *out[0:3]) if rowwise else None,
        col_q.representation(COLUMNWISE, shape, x.dtype, *out[3:6]) if columnwise else None,
        out[6],
    )
    return made, out[7]


def reference_quantize(quantizer: Quantizer, x: torch.Tensor, direction: str, ctx: QuantizeContext) -> Representation:
    made = quantizer.quantize_rowwise(x, ctx) if direction == ROWWISE else quantizer.quantize_columnwise(x, ctx)
    if not isinstance(made, Representation):
        raise TypeError(
            f"{type(quantizer).__name__}.quantize_{direction} returned an object of type {type(made).__name__}; it must return a "
            f"Representation (Quantizer.representation(direction, x.shape, x.dtype, data, scale, ...))"
        )
    for name in ("data", "scale", "amax"):
        value = getattr(made, name)
        if not isinstance(value, torch.Tensor) and (value is not None or name == "data"):
            raise TypeError(
                f"{type(quantizer).__name__}.quantize_{direction} returned a Representation whose {name} is "
                f"{type(value).__name__} {value!r:.40}; the ops carry it as a tensor (torch.tensor({value!r:.20}) for a number)"
            )
    return made


def quantize(quantizer: Quantizer, x: torch.Tensor, direction: str, ctx: QuantizeContext) -> Representation:
    """One direction of ``x``."""
    made = quantize_pass(quantizer, x, ctx, rowwise=direction == ROWWISE, columnwise=direction != ROWWISE)
    return made.rowwise if direction == ROWWISE else made.columnwise


def quantize_hybrid(quantizer: Quantizer, x: torch.Tensor, ctx: QuantizeContext) -> tuple[Representation, Representation]:
    """(rowwise, columnwise) of ``x`` from one read of it: a HybridQuantizer's two children (either
    columnwise source), or both directions of a plain quantizer.

    Equal to ``(quantize(q, x, ROWWISE, ctx), quantize(q, x, COLUMNWISE, ctx))``.
    """
    made = quantize_pass(quantizer, x, ctx)
    return made.rowwise, made.columnwise


def reference_dbias(x: torch.Tensor) -> torch.Tensor:
    """The bias gradient of a linear whose grad_output is ``x`` (2-D): column sums, fp32 accumulated."""
    return x.float().sum(0).to(x.dtype)


def quantize_pass(
    quantizer: Quantizer, x: torch.Tensor, ctx: QuantizeContext, *, rowwise: bool = True, columnwise: bool = True, dbias: bool = False
) -> Quantized:
    """The wanted directions of ``x`` and, with ``dbias``, its column sums (the bias gradient of a
    linear whose grad_output is x, fp32 accumulated in a fixed order, in x's dtype): one read of x
    where a kernel makes them all, else the reference."""
    for direction, wanted in ((ROWWISE, rowwise), (COLUMNWISE, columnwise)):
        if wanted:
            quantizer.check_shape(tuple(x.shape), direction)
    made = _run(quantizer, x, ctx, rowwise=rowwise, columnwise=columnwise, dbias=dbias)
    if made is not None:
        return made[0]
    return Quantized(
        reference_quantize(quantizer, x, ROWWISE, ctx) if rowwise else None,
        reference_quantize(quantizer, x, COLUMNWISE, ctx) if columnwise else None,
        reference_dbias(x) if dbias else None,
    )


def grouped_quantize(
    quantizer: Quantizer, x: torch.Tensor, row_group: torch.Tensor, group_bounds: torch.Tensor, direction: str, ctx: QuantizeContext
) -> Representation:
    """One representation of ``x`` whose row groups (MoE experts; ``group_bounds``, int64 on the
    device: each group's first row, then x's rows, and ``row_group``, each row's group) are each
    quantized as if alone: ``reference_grouped_quantize`` says how they combine.

    The native kernel reads the bounds on the device and never waits for them; it needs every
    group's rows a multiple of 128 (every tile in one group), which graphquant.formats.groups'
    padded layout gives (GroupPadding.bounds). Elsewhere ``Quantizer.quantize_groups``,
    vectorised over the groups, runs.
    """
    made = grouped_quantize_pass(quantizer, x, row_group, group_bounds, ctx, rowwise=direction == ROWWISE, columnwise=direction != ROWWISE)
    return made.rowwise if direction == ROWWISE else made.columnwise


def _two_formats(quantizer: Quantizer) -> bool:
    """Whether the native kernels encode ``quantizer``'s rowwise and columnwise in two formats."""
    rowwise, columnwise = (quantizer.child(d).kernel_encoding(d) for d in (ROWWISE, COLUMNWISE))
    return rowwise is not None and columnwise is not None and rowwise.scaling != columnwise.scaling


def grouped_quantize_pass(
    quantizer: Quantizer, x: torch.Tensor, row_group: torch.Tensor, group_bounds: torch.Tensor, ctx: QuantizeContext, *,
    rowwise: bool, columnwise: bool, source: Optional[torch.Tensor] = None, runs: Optional[torch.Tensor] = None,
    columnwise_amax: Optional[torch.Tensor] = None, take_columnwise_amax: bool = False,
) -> GroupedQuantized:
    """``grouped_quantize`` of both wanted directions, each from x, in one read of x where the
    native kernel makes both (each direction as its own call would make it, random draws
    included); otherwise each as ``grouped_quantize`` makes it. A rowwise_dequantized hybrid's
    columnwise comes from the dequantized rowwise, not from x: it is not taken here.

    source: the rows to quantize are x's rows source[r], zeros where it is -1
    (``groups.gather_rows``), a padded layout's (``groups.padding`` with GROUP_ROWS), with
    ``runs``, its GroupPadding.runs, where its rows make runs of x's: the native kernel reads them
    from x, so no gathered copy is made (without runs, each row through source: bf16 and fp16
    rows, a direction a read where the two are of different formats; other rows are copied first).

    take_columnwise_amax (rowwise alone): also the amaxes the columnwise side scales from
    (``Quantizer.grouped_columnwise_amax``), taken in the rowwise's read of x where the kernel runs, as
    GroupedQuantized.columnwise_amax; a later call that makes the same x's columnwise representation
    takes them (``columnwise_amax``) instead of reading x for them again. The same numbers either
    way: an expert stack's weights, rowwise in forward and columnwise in backward, are read once
    fewer.
    """
    if columnwise and quantizer.columnwise_from_rowwise():
        raise ValueError(f"{quantizer}: a columnwise made from the dequantized rowwise is quantized from those values, one direction a call")
    if take_columnwise_amax and (columnwise or not rowwise or quantizer.columnwise_from_rowwise()):
        raise ValueError(f"{quantizer}: take_columnwise_amax goes with the rowwise alone, of a columnwise made from x")
    if source is None and runs is not None:
        raise ValueError("grouped_quantize_pass takes tile runs (GroupPadding.runs) with the layout's source rows they come from")
    shape = tuple(x.shape) if source is None else (source.shape[0], x.shape[1])
    for direction, wanted in ((ROWWISE, rowwise), (COLUMNWISE, columnwise)):
        if wanted:
            quantizer.child(direction).check_shape(shape, direction)
    # The kernels read through a gather of its own (source without runs) 2-byte rows, one format a
    # read (csrc/cuda/tile.cuh's kGathers), so that no other kernel is compiled twice.
    gathered = source is not None and runs is None
    if gathered and x.dtype not in (torch.bfloat16, torch.float16):
        x, source, gathered = groups.gather_rows(x, source), None, False
    grouped = dict(group_bounds=group_bounds, source=source, runs=runs)
    given = columnwise_amax if columnwise_amax is not None and columnwise_amax.numel() else None  # empty: the format has none
    if rowwise and (columnwise or take_columnwise_amax) and not (gathered and columnwise and _two_formats(quantizer)):
        both = _run(
            quantizer, x, ctx, rowwise=True, columnwise=columnwise, columnwise_amax=given, take_columnwise_amax=take_columnwise_amax,
            **grouped,
        )
        if both is not None:
            reps, amax = both
            if take_columnwise_amax and amax is None:  # a format whose scales come from blocks alone
                amax = x.new_empty(0, dtype=torch.float32)
            return GroupedQuantized(reps.rowwise, reps.columnwise, amax)

    @functools.cache
    def in_layout() -> torch.Tensor:  # x's rows in the layout, gathered once where the reference reads them
        return x if source is None else groups.gather_rows(x, source)

    made = {}
    for direction, wanted in ((ROWWISE, rowwise), (COLUMNWISE, columnwise)):
        if wanted:
            child, alone = quantizer.child(direction), direction == ROWWISE
            by_kernel = _run(child, x, ctx, rowwise=alone, columnwise=not alone, columnwise_amax=None if alone else given, **grouped)
            if by_kernel is None:
                made[direction] = child.quantize_groups(in_layout(), row_group, group_bounds.shape[0] - 1, direction, ctx)
            else:
                made[direction] = by_kernel[0].rowwise if alone else by_kernel[0].columnwise
    amax = None
    if take_columnwise_amax:
        amax = quantizer.child(COLUMNWISE).grouped_columnwise_amax(in_layout(), row_group, group_bounds.shape[0] - 1)
    return GroupedQuantized(made.get(ROWWISE), made.get(COLUMNWISE), amax)


def reference_grouped_quantize(
    quantizer: Quantizer, x: torch.Tensor, group_bounds: torch.Tensor, direction: str, ctx: QuantizeContext
) -> Representation:
    """Each group quantized alone by the reference (same ctx; a delayed-scaling format with its
    group's own scale, ctx.scale holding one a group), the parts combined: data and block scales
    concatenated along the split dim (columns where the data is transposed), per-tensor scales and
    amaxes (and a columnwise FP8 rowwise's per-column scales) stacked, one per group."""
    bounds = group_bounds.tolist()
    encode = quantizer.quantize_rowwise if direction == ROWWISE else quantizer.quantize_columnwise

    def group_ctx(g: int) -> QuantizeContext:
        return dataclasses.replace(ctx, scale=ctx.scale.reshape(-1)[g]) if quantizer.child(direction).keeps_state else ctx

    parts = [encode(x[a:b], group_ctx(g)) for g, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    first = parts[0]
    split_dim = 1 if first.transposed else 0
    child = quantizer.child(direction)

    def combine(tensors: list, stacked: bool) -> Optional[torch.Tensor]:
        if tensors[0] is None:
            return None
        if stacked or tensors[0].dim() == 0:
            return torch.stack(tensors)
        return torch.cat(tensors, dim=split_dim if tensors[0] is not first.amax else 0)

    # A scale that spans all of a group's rows (a per-column one) is one per group and column.
    stacked_scale = child.block(direction)[0] == -1
    return first.quantizer.representation(
        direction,
        x.shape,
        x.dtype,
        torch.cat([p.data for p in parts], dim=split_dim),
        combine([p.scale for p in parts], stacked_scale),
        combine([p.amax for p in parts], False),
    )


# -- dequantize --------------------------------------------------------------------------------


def _native_dequantize(rep: Representation, dtype: torch.dtype, with_global: bool) -> Optional[torch.Tensor]:
    ext = extension_for(rep.data.device)
    if ext is None or dtype not in _DTYPES or rep.data.dim() != 2 or rep.data.numel() == 0:
        return None
    made = _encoding(ext, rep.quantizer, rep.direction)
    if made is None:
        return None
    encoding = made.described
    rows, cols = rep.data.shape
    amax = None
    if encoding.scaling == "nvfp4":
        kind, fp8, block = _DEQUANT_NV, 0, (1, 1)
        amax = rep.amax if with_global else None
        if amax is not None and amax.numel() not in (1, rows):
            return None
    else:
        kind, fp8 = (_DEQUANT_MX if encoding.scaling == "mxfp8" else _DEQUANT_SCALED), _FP8[encoding.element]
        if encoding.scaling == "tensor":
            if rep.scale.numel() != 1:
                return None
            block = (rows, cols)
        elif encoding.scaling == "row":
            block = (1, cols)
        else:  # the block as stored
            block = encoding.block[::-1] if encoding.transposed else encoding.block
    # FP8 scales go by their strides; MXFP8's (a byte per 32 elements) are made row-major first:
    # read through outer-dim-major strides, one byte a chunk from rows far apart, they would slow
    # the kernel by more than the copy costs.
    scale = rep.scale if kind == _DEQUANT_SCALED else rep.scale.contiguous()
    scale_strides = (0, 0) if scale.dim() == 0 else (scale.stride(0), scale.stride(-1))
    return ext.dequantize(rep.data.contiguous(), scale, amax, kind, fp8, *block, *scale_strides, _DTYPES[dtype])


def dequantize(rep: Representation) -> torch.Tensor:
    """Stored-orientation values in the representation's nominal dtype."""
    values = _native_dequantize(rep, rep.dtype, with_global=True)
    return rep.dequantize() if values is None else values


def dequantize_for_gemm(rep: Representation, dtype: torch.dtype = torch.bfloat16, *, with_global: bool = True) -> torch.Tensor:
    """Stored-orientation values of ``rep`` as ``dtype``, for a high-precision GEMM.

    with_global=False (NVFP4 only) leaves out the global factor amax / 2688: the values are the
    E2M1 codes times their E4M3 block scales, exact in bf16, and the GEMM applies
    alpha = amax_a * amax_b / 2688**2 to the product.
    """
    if not with_global and getattr(rep.quantizer.kernel_encoding(rep.direction), "scaling", None) != "nvfp4":
        raise ValueError(f"with_global=False is for NVFP4 representations, not {rep.quantizer}")
    values = _native_dequantize(rep, dtype, with_global)
    if values is not None:
        return values
    if with_global:
        return rep.dequantize(dtype)
    rows, cols = rep.data.shape[0], rep.data.shape[1] * 2
    codes = nvfp4.e2m1_values(nvfp4.unpack(rep.data)).reshape(rows, cols // nvfp4.BLOCK_LEN, nvfp4.BLOCK_LEN)
    return (codes * rep.scale.float().unsqueeze(-1)).reshape(rows, cols).to(dtype)
