"""graphquant's custom ops (torch.library, namespace ``graphquant``; see graphquant.ops.registry).

A representation crosses the op boundary as three tensors (data, scale, amax; empty where absent)
plus its quantizer spec, direction and logical shape, all visible as op arguments in a graph.
The ops are not differentiable themselves: ``graphquant.ops.quantized_gemm`` composes them into
the autograd formula of a GEMM.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from graphquant.kernels import backends, mixed_input, native
from graphquant.ops import registry
from graphquant.quantizers import ROWWISE, COLUMNWISE, QuantizeContext, Representation, output_rows, quantizer_of


def unflatten(tensors: Sequence[torch.Tensor], spec: str, direction: str, shape: Sequence[int], dtype: torch.dtype) -> Representation:
    """The Representation behind the op-level tensors of one direction."""
    return quantizer_of(spec).stored_representation(direction, (shape[0], shape[1]), dtype, tensors)


def _context(
    scale: Optional[torch.Tensor], rng: Optional[torch.Tensor], stream: int, amax_group: Optional[str]
) -> QuantizeContext:
    """The context of stream ``stream`` of the step that ``rng`` (int64 [seed, step]) holds; the
    kernels read rng on the device, so the hot path never waits for it."""
    return QuantizeContext(scale=scale, rng=rng, offset=stream, amax_group=amax_group)


@registry.op("quantize")
def quantize(
    x: torch.Tensor,
    spec: str,
    rowwise: bool,
    columnwise: bool,
    scale: Optional[torch.Tensor],
    rng: Optional[torch.Tensor],
    rng_stream: int,
    dbias: bool = False,
    amax_group: Optional[str] = None,
) -> list[torch.Tensor]:
    """``x`` (2-D) in the format ``spec``, in one pass over x where a kernel makes it all:
    [data, scale, amax] of the rowwise representation if wanted, then of the columnwise one (a
    HybridQuantizer's spec gives each direction its child's format), then, with ``dbias``, x's
    column sums (the bias gradient of a linear whose grad_output is x).

    scale: the slot's current scale (delayed scaling). rng: int64 [seed, step] and rng_stream
    pick the stochastic-rounding stream, so every step and slot draws its own numbers.
    amax_group: the process group over which a format that asks for it (with_amax_reduction)
    all-reduces its amax, inside this op (graphquant.distributed).
    """
    ctx = _context(scale, rng, rng_stream, amax_group)
    made = native.quantize_pass(quantizer_of(spec), x, ctx, rowwise=rowwise, columnwise=columnwise, dbias=dbias)
    tensors = [t for rep in (made.rowwise, made.columnwise) if rep is not None for t in rep.tensors()]
    return distinct_contiguous(tensors + ([made.dbias] if dbias else []), x)


def distinct_contiguous(tensors: list[torch.Tensor], x: torch.Tensor) -> list[torch.Tensor]:
    """``tensors`` contiguous, as the fake promises, and none sharing memory with x or an earlier
    one (a custom op's outputs may not alias; both directions of NVFP4 share one global amax)."""
    seen, out = {x.untyped_storage().data_ptr()}, []
    for t in tensors:
        t = t.contiguous()
        if t.numel() and t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out.append(t)
    return out


# The (shape, dtype) of each tensor a fake returns, by what those depend on (the op, the quantizer,
# the shapes and dtypes of its inputs): a fake that runs the reference (a few hundred fake tensor
# ops) runs it once a key, not at every traced call of a model's many layers of one shape, which
# took most of graphquant's part of a first call. The quantizer, not its spec: a format defined
# again under its name has the same spec, and its reference is run (and checked) anew.
_LAYOUTS: dict[tuple, tuple[tuple[tuple[int, ...], torch.dtype], ...]] = {}


def kept_layout(key: tuple, x: torch.Tensor, make: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
    """Empty tensors on x's device shaped as the tensors ``make()`` returns, made once a ``key``
    (one that cannot be hashed, as a symbolic size cannot: at each call)."""
    try:
        layout = _LAYOUTS.get(key)
    except TypeError:
        layout, key = None, None
    if layout is None:
        layout = tuple((tuple(t.shape), t.dtype) for t in make())
        if key is not None:
            _LAYOUTS[key] = layout
    return [x.new_empty(shape, dtype=dtype) for shape, dtype in layout]


def layout_key(t: Optional[torch.Tensor]) -> Optional[tuple]:
    """What a fake's outputs may take of an input tensor for kept_layout's key: its shape and dtype."""
    return None if t is None else (tuple(t.shape), t.dtype)


def _representation_like(x: torch.Tensor, spec: str, direction: str, scale: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
    """Empty tensors shaped as the reference's representation of ``x`` in ``spec``'s ``direction``."""
    quantizer, ctx = quantizer_of(spec), QuantizeContext(scale=scale)
    key = ("quantize", quantizer, direction, layout_key(x), layout_key(scale))
    return kept_layout(key, x, lambda: native.reference_quantize(quantizer, x, direction, ctx).tensors())


@registry.fake("quantize")
def _(x, spec, rowwise, columnwise, scale, rng, rng_stream, dbias=False, amax_group=None):
    directions = [d for d, wanted in ((ROWWISE, rowwise), (COLUMNWISE, columnwise)) if wanted]
    return [t for d in directions for t in _representation_like(x, spec, d, scale)] + ([x.new_empty(x.shape[1:])] if dbias else [])


@registry.op("transposed", tags=(torch.Tag.flexible_layout,))
def transposed(data: torch.Tensor) -> torch.Tensor:
    """The contiguous transpose of 2-D ``data``: the columnwise copy of a per-tensor FP8
    representation from its rowwise bits, and MXFP8 columnwise data as torch._scaled_mm takes it
    (graphquant.kernels.scaled_mm)."""
    return data.t().contiguous()


@registry.fake("transposed")
def _(data):
    return data.new_empty((data.shape[1], data.shape[0]))


try:
    from graphquant.kernels import triton_transpose
except ImportError:  # no Triton: CUDA tensors run the reference
    pass
else:
    registry.cuda_kernel("transposed")(triton_transpose.transposed)


@registry.op("dequantize")
def dequantize(
    tensors: list[torch.Tensor], spec: str, direction: str, shape: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """The logical (rows, cols) values of one representation, as ``dtype``."""
    rep = unflatten(tensors, spec, direction, shape, dtype)
    values = native.dequantize(rep)
    return (values.t() if rep.transposed else values).contiguous()


@registry.fake("dequantize")
def _(tensors, spec, direction, shape, dtype):
    return tensors[0].new_empty(tuple(shape), dtype=dtype)


@registry.op("gemm")
def gemm(
    a: list[torch.Tensor],
    a_spec: str,
    a_direction: str,
    a_shape: Sequence[int],
    b: list[torch.Tensor],
    b_spec: str,
    b_direction: str,
    b_shape: Sequence[int],
    batch: int,
    out_dtype: torch.dtype,
    backend: str,
    fast_accumulation: bool,
    site: str,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """out[g] = A[g] @ B[g]^T (+ bias) for each of ``batch`` groups, both operands reduced over their K.

    A rowwise operand splits its rows into groups; a columnwise operand (a wgrad or dgrad
    operand, reduced over the logical rows) splits its reduction dim. Returns (batch, m, n).
    backend, fast_accumulation: the fields of the GemmBackend the plan chose for this GEMM, which
    runs it (graphquant.kernels.backends.gemm); site names the GEMM in errors ("fc1#0 dgrad").
    bias (n,), one group only: added to the fp32 product before its one rounding to out_dtype.
    """
    rep_a = unflatten(a, a_spec, a_direction, a_shape, out_dtype)
    rep_b = unflatten(b, b_spec, b_direction, b_shape, out_dtype)
    return backends.gemm(rep_a, rep_b, batch, out_dtype, backends.named(backend, fast_accumulation), site, bias)


@registry.fake("gemm")
def _(a, a_spec, a_direction, a_shape, b, b_spec, b_direction, b_shape, batch, out_dtype, backend, fast_accumulation, site, bias=None):
    m = output_rows(a_direction, a_shape, batch)
    n = output_rows(b_direction, b_shape, batch)
    return a[0].new_empty((batch, m, n), dtype=out_dtype)


@registry.op("gemm_quantizing_a")
def gemm_quantizing_a(
    x: torch.Tensor,
    amax: torch.Tensor,
    x_spec: str,
    b: list[torch.Tensor],
    b_spec: str,
    b_direction: str,
    b_shape: Sequence[int],
    out_dtype: torch.dtype,
    backend: str,
    site: str,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """(1, m, n) = A @ B^T (+ bias), A being x (m, k) in high precision, quantized rowwise in the
    format ``x_spec`` by the GEMM itself, its scale made from ``amax``, the amaxes of x's rows in
    chunks (graphquant.kernels.triton_decode.amaxes), so that no quantize runs in the graph before it.
    backend: the GemmBackend the plan chose, one that quantizes A (GemmBackend.quantizes_a)."""
    chosen = backends.named(backend, False)
    a = backends.triton_decode.QuantizedOnLoad(x, amax, quantizer_of(x_spec))
    return backends.gemm(a, unflatten(b, b_spec, b_direction, b_shape, out_dtype), 1, out_dtype, chosen, site, bias)


@registry.fake("gemm_quantizing_a")
def _(x, amax, x_spec, b, b_spec, b_direction, b_shape, out_dtype, backend, site, bias=None):
    return x.new_empty((1, x.shape[0], output_rows(b_direction, b_shape, 1)), dtype=out_dtype)


@registry.op("mixed_input_gemms")
def mixed_input_gemms(
    values: torch.Tensor,
    a_amax: Optional[torch.Tensor],
    b: list[torch.Tensor],
    b_spec: str,
    b_direction: str,
    b_shapes: Sequence[int],
    out_dtype: torch.dtype,
    sites: str,
    biases: list[Optional[torch.Tensor]],
    stored_weight: bool = False,
) -> list[torch.Tensor]:
    """[(1, m, n_i) = A @ B_i^T (+ bias_i)] on the mixed-input GEMM, which the plan chose for the
    GEMMs ``sites`` names (graphquant.kernels.mixed_input), one launch for all: A given as its
    bf16 values in the kernel's order (graphquant::mixed_input_operand, or mixed_input.operand of
    its representation) and, for NVFP4, its global amax; the B's in the format ``b_spec`` and
    direction ``b_direction``, flattened as graphquant::gemms_sharing_a's; ``stored_weight``: the
    B's are frozen weights, which no kernel writes."""
    bs = _weights(b, b_spec, b_shapes, out_dtype, b_direction)
    outs = backends.mixed_input_gemm(values, a_amax, bs, out_dtype, sites.split(SITES_SEPARATOR), biases, stored_weight)
    return [out.unsqueeze(0) for out in outs]


@registry.fake("mixed_input_gemms")
def _(values, a_amax, b, b_spec, b_direction, b_shapes, out_dtype, sites, biases, stored_weight=False):
    rows = [output_rows(b_direction, b_shapes[i : i + 2], 1) for i in range(0, len(b_shapes), 2)]
    return [values.new_empty((1, values.shape[0], n), dtype=out_dtype) for n in rows]


@registry.op("mixed_input_operand")
def mixed_input_operand(x: torch.Tensor, amax: Optional[torch.Tensor], spec: str) -> torch.Tensor:
    """x's values as the mixed-input GEMM reads them, made from 2-D ``x`` and (NVFP4) its global
    amax by one op (mixed_input.operand_of_x): on CUDA one kernel that reads x once
    (graphquant.kernels.triton_mixed_operand, the same bits)."""
    return mixed_input.operand_of_x(x, amax, quantizer_of(spec))


@registry.fake("mixed_input_operand")
def _(x, amax, spec):
    return x.new_empty(x.shape, dtype=torch.bfloat16)


if backends.HAS_TRITON:
    from graphquant.kernels import triton_mixed_operand

    @registry.cuda_kernel("mixed_input_operand")
    def _(x: torch.Tensor, amax: Optional[torch.Tensor], spec: str) -> torch.Tensor:
        return triton_mixed_operand.values(x, amax, quantizer_of(spec))


@registry.op("block_codes")
def block_codes(x: torch.Tensor, spec: str) -> list[torch.Tensor]:
    """x's rowwise representation in ``spec``'s 1x128 blocks, as the decode GEMM that quantizes A
    makes it before it multiplies (graphquant.kernels.triton_decode.quantizes_first): an op of its
    own, so that the GEMMs that read one x (a SwiGLU's gate and up projections) share one call
    where passes/common_subexpressions.py merges theirs. The reference here; CUDA tensors run
    the decode GEMM's kernel (the same bits)."""
    return distinct_contiguous(native.reference_quantize(quantizer_of(spec), x, ROWWISE, QuantizeContext()).tensors(), x)


@registry.fake("block_codes")
def _(x, spec):
    return _representation_like(x, spec, ROWWISE)


if backends.triton_decode is not None:

    @registry.cuda_kernel("block_codes")
    def _(x: torch.Tensor, spec: str) -> list[torch.Tensor]:
        return distinct_contiguous(backends.triton_decode.block_codes(x, quantizer_of(spec)).tensors(), x)


# Between the GEMMs' names in one string argument of the ops that share A (a schema has no list of
# strings): Inductor writes a string argument into its Python wrapper as it is, so no newline.
SITES_SEPARATOR = ", "


@registry.op("gemms_sharing_a")
def gemms_sharing_a(
    a: list[torch.Tensor],
    a_spec: str,
    a_direction: str,
    a_shape: Sequence[int],
    b: list[torch.Tensor],
    b_spec: str,
    b_shapes: Sequence[int],
    out_dtype: torch.dtype,
    backend: str,
    sites: str,
    biases: list[Optional[torch.Tensor]],
) -> list[torch.Tensor]:
    """[(1, m, n_i) = A @ B_i^T (+ bias_i)] for GEMMs that read one quantized A, in one launch of
    the decode GEMM (graphquant.kernels.triton_decode.gemms_sharing_a), with the bits of one
    graphquant::gemm over the B's stacked. ``b``: each B's rowwise tensors in turn (as many
    each), all in the format ``b_spec``; ``b_shapes``: their logical (rows, cols) in turn,
    flattened; ``sites``: the GEMMs' names joined by SITES_SEPARATOR; ``biases``: one each."""
    rep_a = unflatten(a, a_spec, a_direction, a_shape, out_dtype)
    return _gemms_sharing(rep_a, b, b_spec, b_shapes, out_dtype, backend, sites, biases)


@registry.fake("gemms_sharing_a")
def _(a, a_spec, a_direction, a_shape, b, b_spec, b_shapes, out_dtype, backend, sites, biases):
    m = output_rows(a_direction, a_shape, 1)
    return [a[0].new_empty((1, m, n), dtype=out_dtype) for n in b_shapes[::2]]


@registry.op("gemms_quantizing_a")
def gemms_quantizing_a(
    x: torch.Tensor,
    amax: torch.Tensor,
    x_spec: str,
    b: list[torch.Tensor],
    b_spec: str,
    b_shapes: Sequence[int],
    out_dtype: torch.dtype,
    backend: str,
    sites: str,
    biases: list[Optional[torch.Tensor]],
) -> list[torch.Tensor]:
    """graphquant::gemm_quantizing_a for several B's that read one x, in one launch of the decode
    GEMM that quantizes x as it loads it; arguments as graphquant::gemms_sharing_a's."""
    a = backends.triton_decode.QuantizedOnLoad(x, amax, quantizer_of(x_spec))
    return _gemms_sharing(a, b, b_spec, b_shapes, out_dtype, backend, sites, biases)


def _gemms_sharing(a, b, b_spec, b_shapes, out_dtype, backend, sites, biases) -> list[torch.Tensor]:
    """The GEMMs of the ops that share A, from their flattened B's, backend name and joined sites."""
    bs = _weights(b, b_spec, b_shapes, out_dtype)
    return backends.gemms_sharing_a(a, bs, out_dtype, backends.named(backend, False), sites.split(SITES_SEPARATOR), biases)


@registry.fake("gemms_quantizing_a")
def _(x, amax, x_spec, b, b_spec, b_shapes, out_dtype, backend, sites, biases):
    return [x.new_empty((1, x.shape[0], n), dtype=out_dtype) for n in b_shapes[::2]]


def _weights(b: list[torch.Tensor], spec: str, shapes: Sequence[int], dtype: torch.dtype, direction: str = ROWWISE) -> list[Representation]:
    """The Representations (rowwise, or ``direction``) of several B's in the format ``spec``, given
    as their tensors in turn (as many each) and their logical shapes flattened."""
    count = len(shapes) // 2
    each = len(b) // count
    return [unflatten(b[i * each : (i + 1) * each], spec, direction, shapes[2 * i : 2 * i + 2], dtype) for i in range(count)]
