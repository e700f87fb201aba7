"""The Quantizer value object and the Representation it produces.

A quantizer is a frozen, hashable, printable description of a format. It carries no usage flags
and no state: the compiler decides per GEMM direction which representations to make, and stateful
numerics (delayed scaling, stochastic rounding) receive their state through ``QuantizeContext``.

Every quantizer works on 2-D tensors (rows = flattened leading dims, cols = the reduction dim of
the GEMM that consumes the rowwise representation) and makes

- a *rowwise* representation, blocked along the last dim, consumed as a GEMM operand as it is;
- a *columnwise* representation, blocked along the first dim, consumed for the transposed use.
  Where a Hopper GEMM needs it (per-tensor FP8, FP8 block, NVFP4), its data is stored transposed.

``str(quantizer)`` is its spec: a stable, readable string that names every non-default field
(it appears in plans and graph dumps) and that ``parse_spec`` turns back into an equal quantizer.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import math
from typing import Any, ClassVar, Optional, Sequence

import torch

from graphquant.quantizers.descriptions import GemmInput, KernelEncoding

ROWWISE = "rowwise"
COLUMNWISE = "columnwise"

_REGISTRY: dict[str, type["Quantizer"]] = {}


# Random streams per step: with a step counter, a quantize call's stream offset is
# step * STREAMS_PER_STEP + its stream within the step.
STREAMS_PER_STEP = 1 << 16


@dataclasses.dataclass(frozen=True)
class QuantizeContext:
    """State a quantize call may need but that does not belong to the format's value.

    scale: the current FP8 scale of a delayed-scaling slot (float32, one element).
    seed, offset: the counter-based random stream of stochastic rounding. The same seed and
        offset give the same bits on every device.
    rng: int64 [seed, step], as a compiled model keeps it on the device; when given it replaces
        seed, and offset counts within the step (see random_stream).
    amax_group: the name of the process group over which a quantizer that asks for it
        (with_amax_reduction) all-reduces its amax (graphquant.distributed); None: no reduction.
    """

    scale: Optional[torch.Tensor] = None
    seed: int = 0
    offset: int = 0
    amax_group: Optional[str] = None
    rng: Optional[torch.Tensor] = None

    def random_stream(self) -> tuple[int, int]:
        """(seed, offset) of stochastic rounding: with ``rng``, (rng[0], rng[1] * STREAMS_PER_STEP +
        offset), read on the host (a device sync; the native kernels read rng where it lies)."""
        if self.rng is None:
            return self.seed, self.offset
        seed, step = self.rng.tolist()
        return int(seed), int(step) * STREAMS_PER_STEP + self.offset

    def reduced_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """``amax``, all-reduced (MAX) over ``amax_group`` where there is one, so that every rank
        encodes with the same scale."""
        if self.amax_group is None:
            return amax
        from graphquant.distributed import all_reduce_amax

        return all_reduce_amax(amax, self.amax_group)


@dataclasses.dataclass(frozen=True, eq=False)
class Representation:
    """One direction of a quantized tensor, laid out as the GEMM consumes it.

    data: the encoded values (FP8, packed E2M1 in uint8, or the high-precision tensor).
    scale: decode scales (float32 per tensor or per block, uint8 E8M0, or float8_e4m3fn), or None.
    amax: the FP32 amax the encoding used (per tensor, or per row for row-scaled NVFP4), or None.
    shape: the logical (rows, cols) of the source tensor.
    transposed: data holds the transpose of the logical tensor (shape[1], shape[0]).
    hadamard: a random Hadamard transform was applied along the blocked dimension.
    dtype: the nominal high-precision dtype (what dequantize returns by default).
    """

    quantizer: "Quantizer"
    direction: str
    data: torch.Tensor
    scale: Optional[torch.Tensor]
    amax: Optional[torch.Tensor]
    shape: tuple[int, int]
    transposed: bool
    dtype: torch.dtype
    hadamard: bool = False

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The values this representation stands for, in stored orientation, as ``dtype``."""
        values = self.quantizer.dequantize(self)
        stored = tuple(self.shape[::-1]) if self.transposed else tuple(self.shape)
        if tuple(values.shape) != stored:
            raise ValueError(
                f"{type(self.quantizer).__name__}.dequantize returned a tensor of shape {tuple(values.shape)} for a "
                f"{self.direction} representation of a {self.shape[0]}x{self.shape[1]} tensor; it must return "
                f"{stored[0]}x{stored[1]}, the values in stored orientation{' (transposed)' if self.transposed else ''}"
            )
        return values.to(dtype or self.dtype)

    @property
    def stored_k_last(self) -> bool:
        """Whether the stored data has the GEMM's reduction dim last, so that its stored rows are
        the GEMM's rows: a rowwise representation reduces over its columns, a columnwise one over
        its rows, so this holds for rowwise data as is and columnwise data stored transposed."""
        return self.transposed == (self.direction == COLUMNWISE)

    def gemm_operand(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The dequantized values with the reduction dim last, as a TN GEMM reads them."""
        values = self.dequantize(dtype)
        return values if self.stored_k_last else values.t()

    def tensors(self) -> list[torch.Tensor]:
        """data, scale and amax as a fixed-length list (empty tensors for absent parts), as they
        are stored: an outer-dim-major scale as its transpose, so that it crosses an op boundary
        (which makes every tensor contiguous) without a copy. ``Quantizer.stored_representation``
        inverts this."""
        def part(t: Optional[torch.Tensor]) -> torch.Tensor:
            return self.data.new_empty(0, dtype=torch.float32) if t is None else t

        scale = self.scale.t() if self.scale is not None and self.quantizer.scale_outer_major(self.direction) else self.scale
        return [self.data, part(scale), part(self.amax)]


def output_rows(direction: str, shape: Sequence[int], batch: int = 1) -> int:
    """Rows an operand of logical ``shape`` contributes to each group's product (its extent that
    is not reduced): a rowwise one reduces over its columns, a columnwise one over its rows."""
    return shape[0] // batch if direction == ROWWISE else shape[1]


def reduced_extent(direction: str, shape: Sequence[int], batch: int = 1) -> int:
    """The extent an operand of logical ``shape`` reduces over in each group's product."""
    return shape[1] if direction == ROWWISE else shape[0] // batch


def gemm_dims(a: Representation, b: Representation, batch: int = 1) -> tuple[int, int, int]:
    """(m, n, k) of each group's product A @ B^T (k as A reduces: a grouped B, an expert stack,
    reduces over each expert's rows of its own)."""
    return output_rows(a.direction, a.shape, batch), output_rows(b.direction, b.shape, batch), reduced_extent(a.direction, a.shape, batch)


@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
    """The representations a quantize call made; a direction not asked for is None."""

    rowwise: Optional[Representation]
    columnwise: Optional[Representation]

    def get(self, direction: str) -> Representation:
        rep = self.rowwise if direction == ROWWISE else self.columnwise
        if rep is None:
            raise RuntimeError(
                f"the {direction} representation was requested but not made; "
                f"quantize with {direction}=True"
            )
        return rep

    def dequantize(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The rowwise values if present, else the columnwise ones, in the logical orientation.
        Columnwise values that went through a transform (NVFP4's Hadamard) are not the tensor's:
        only a GEMM whose other operand went through the same one undoes it, so those are refused
        (TransformerEngine refuses a columnwise-only NVFP4 dequantize)."""
        rep = self.rowwise or self.columnwise
        transform = rep.quantizer.transform(rep.direction)
        if transform is not None:
            raise ValueError(
                f"{rep.quantizer}: its {rep.direction} values went through {transform}, which only a GEMM of two "
                "operands of that transform undoes, so they are not the tensor's; quantize with rowwise=True to "
                "dequantize the tensor's values"
            )
        values = rep.dequantize(dtype)
        return values.t() if rep.transposed else values


@dataclasses.dataclass(frozen=True)
class Quantizer:
    """Base of every quantizer, built in or user-defined.

    To plug in a format of your own: subclass with ``@dataclasses.dataclass(frozen=True)``, give it
    a unique ``tag`` (registration happens on subclassing), and implement ``quantize_rowwise``,
    ``quantize_columnwise`` and ``dequantize``. Fields must be plain values (str, int, float, bool)
    so the spec round-trips. The defaults of the questions below make such a format's GEMMs
    emulated (dequantize both operands, high-precision GEMM); a format whose representations are
    laid out as a native GEMM family reads them says so in ``gemm_input``.
    """

    tag: ClassVar[str] = ""
    # Spec fields shown even at their default, because a reader needs them (e.g. the FP8 dtype).
    always_shown: ClassVar[tuple[str, ...]] = ()
    # False when quantizing the same tensor twice may give different bits (state or randomness).
    requantization_safe: ClassVar[bool] = True
    # True when quantizing draws random numbers (stochastic rounding), so a call needs its stream.
    stochastic: ClassVar[bool] = False
    # True when quantizing all-reduces its amax over QuantizeContext.amax_group (with_amax_reduction).
    reduces_amax: ClassVar[bool] = False
    # True when a whole tensor's scale comes from one amax, which processes may all-reduce.
    per_tensor_amax: ClassVar[bool] = False
    # True for the formats TE's FP8 attention takes in its dpa roles (per-tensor FP8, MXFP8).
    attention_format: ClassVar[bool] = False
    # True when quantize_* are torch ops a graph compiler may trace and fuse with their neighbours
    # without changing a bit (exact ops only; divisions isolated in custom ops).
    traceable: ClassVar[bool] = False
    # True when a slot of this format keeps state across steps (delayed scaling's scale and amax
    # history): ``initial_state`` makes it, ``update`` rolls it after each step, and the compiled
    # module owns it.
    keeps_state: ClassVar[bool] = False
    # The next two are asked of the quantizer that makes a direction (``child``: a HybridQuantizer's
    # children answer). high_precision: it keeps values as they are (IdentityQuantizer), so that a
    # pair of such operands runs the plain high-precision matmul.
    high_precision: ClassVar[bool] = False
    # groupable: each row group of a tensor (an MoE expert's) can be quantized alone and the parts
    # kept as one representation that splits back at the groups' rows, as torch._grouped_mm sites
    # need (one scale per group, or blocks along the rows).
    groupable: ClassVar[bool] = False
    # block_local_scales: every scale covers a block of the tensor alone (no amax of a whole tensor
    # or row first), so the native kernel makes a direction in one read of the tensor.
    block_local_scales: ClassVar[bool] = False

    def __post_init__(self) -> None:
        """Refuse a bool, int, float or str field holding a value of another type when the
        quantizer is made: TransformerEngine's positional (fp8_dtype, device) put a device in a
        bool field, which as a truthy value changed the numerics (a subclass's own __post_init__
        calls this, after turning a torch dtype given for fp8_dtype into its name)."""
        mistyped = mistyped_fields(self)
        if mistyped:
            raise TypeError(
                f"{type(self).__name__}: {'; '.join(mistyped)} (graphquant's quantizers take no device, "
                "TransformerEngine's second argument: pass options by keyword)"
            )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.tag:
            raise TypeError(f"{cls.__name__} needs a class attribute tag = '<short name>' for its spec")
        taken = _REGISTRY.get(cls.tag)
        if taken is not None and (taken.__module__, taken.__qualname__) != (cls.__module__, cls.__qualname__):
            raise TypeError(f"quantizer tag {cls.tag!r} is taken by {taken.__module__}.{taken.__qualname__}")
        if taken is not None:  # defined again (a notebook cell run again): its spec names the new class from now on
            quantizer_of.cache_clear()
        _REGISTRY[cls.tag] = cls

    @property
    def asks_amax_reduction(self) -> bool:
        """Whether its amaxes are to be all-reduced over the recipe's group: before it encodes
        (reduces_amax), or into a delayed-scaling history (reduce_amax)."""
        return self.reduces_amax

    # -- what subclasses implement -------------------------------------------------------------

    def quantize_rowwise(self, x: torch.Tensor, ctx: QuantizeContext) -> Representation:
        raise NotImplementedError(f"{type(self).__name__} does not implement quantize_rowwise")

    def quantize_columnwise(self, x: torch.Tensor, ctx: QuantizeContext) -> Representation:
        raise NotImplementedError(f"{type(self).__name__} does not implement quantize_columnwise")

    def dequantize(self, rep: Representation) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not implement dequantize")

    def block(self, direction: str) -> tuple[int, int]:
        """The (rows, cols) each scale covers for ``direction``; (0, 0) means one per tensor."""
        return (0, 0)

    def check_shape(self, shape: tuple[int, int], direction: str) -> None:
        """Raise ValueError if a (rows, cols) tensor cannot be quantized for ``direction``."""

    # -- row groups (MoE experts), for groupable formats ---------------------------------------

    def quantize_groups(
        self, x: torch.Tensor, row_group: torch.Tensor, groups: int, direction: str, ctx: QuantizeContext
    ) -> Representation:
        """``direction`` of x (padded_rows, cols) in graphquant.formats.groups' padded layout,
        each group as if alone. Here: x as one tensor, right for formats whose scales cover
        blocks of rows that the padding keeps within a group; a format with a scale over the whole
        tensor takes one per group instead."""
        return self.quantize_rowwise(x, ctx) if direction == ROWWISE else self.quantize_columnwise(x, ctx)

    def grouped_factor(self, rep: Representation, row_group: torch.Tensor) -> Optional[torch.Tensor]:
        """The factor of a grouped representation's values that ``emulated_values`` leaves out,
        along the GEMM rows of each group: (padded_rows, 1) for a rowwise representation (its
        GEMM rows are its rows), (groups, cols or 1) for a columnwise one (reduced over each
        group's rows); None where the values carry it all."""
        return None

    def grouped_columnwise_amax(self, x: torch.Tensor, row_group: torch.Tensor, groups: int) -> torch.Tensor:
        """The amaxes ``quantize_groups(x, row_group, groups, COLUMNWISE, ...)`` scales from, flat
        float32, so that the pass that reads x for the rowwise can take them for a later columnwise
        call (graphquant.kernels.native.grouped_quantize_pass). Here: none, right for formats whose
        scales come from their blocks alone; a format whose native kernel scales a group from an
        amax over its rows (a per-tensor scale, one per column) answers with them."""
        return x.new_empty(0, dtype=torch.float32)

    def child(self, direction: str) -> "Quantizer":
        """The quantizer that makes ``direction``: itself (a HybridQuantizer names one per direction)."""
        return self

    def transposed(self, direction: str) -> bool:
        """Whether ``direction``'s data is stored transposed (as Hopper's TN GEMM reads it)."""
        return False

    def hadamard(self, direction: str) -> bool:
        """Whether ``direction``'s values went through a random Hadamard transform."""
        return False

    def transform(self, direction: str) -> Optional[str]:
        """The transform ``direction``'s values went through, named so that two operands of one
        GEMM are right to multiply only where they name the same one (it then cancels in the
        product); None: none."""
        return "a Hadamard transform" if self.hadamard(direction) else None

    def transformed(self, source: torch.Tensor, direction: str) -> torch.Tensor:
        """``source`` (laid out as ``direction`` stores it) as the format transforms it before
        encoding ``direction``: itself, unless the direction has a Hadamard transform."""
        return source

    def scale_outer_major(self, direction: str) -> bool:
        """Whether ``direction``'s (rows, blocks) scale lies with its rows contiguous, as the
        spec stores 1x128 block scales and graphquant MXFP8's 1x32 ones (Representation.tensors
        gives such a scale transposed)."""
        return False

    def encodes_from_tensor_amax(self) -> bool:
        """Whether one amax of the whole tensor, taken by the pass that made the other direction,
        is all it needs to encode a direction (``quantize_from_amax``)."""
        return False

    def columnwise_from_rowwise(self) -> bool:
        """Whether the columnwise representation is made from the dequantized rowwise one (a
        hybrid's rowwise_dequantized source), so that making it needs the rowwise one first."""
        return False

    def columnwise_is_rowwise_transposed(self) -> bool:
        """Whether the columnwise representation is the rowwise one with its data transposed, so
        that a graph can make it from the rowwise copy instead of from x."""
        return False

    def for_direction(self, direction: str) -> "Quantizer":
        """The quantizer that makes ``direction`` (``child``) with every field that does nothing to
        ``direction`` at its default, so that its spec names what that direction's values go
        through and no more (NVFP4's Hadamard transform is its columnwise side's alone). It makes
        ``direction`` bit for bit as this quantizer does. Here: the child as it is, for formats
        whose every field acts on both directions."""
        return self.child(direction)

    def direction_spec(self, direction: str) -> str:
        """What makes ``direction``, as a plan names it: the spec of ``for_direction``."""
        return self.for_direction(direction).spec

    def at_largest_code(self, rep: Representation) -> Optional[torch.Tensor]:
        """Where ``rep``'s stored codes are the format's largest magnitude (values that may have
        saturated), in stored orientation; None where it cannot say (codes in no FP8 dtype, of a
        format of one's own that does not implement this: graphquant.numerics shows n/a)."""
        if rep.data.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            return rep.data.float().abs() == torch.finfo(rep.data.dtype).max
        return None

    def representation(
        self,
        direction: str,
        shape: tuple[int, int],
        dtype: torch.dtype,
        data: torch.Tensor,
        scale: Optional[torch.Tensor] = None,
        amax: Optional[torch.Tensor] = None,
    ) -> Representation:
        """A representation of a ``shape`` tensor of ``dtype`` made by this quantizer; the layout
        (transposed, hadamard) follows from the quantizer and the direction."""
        return Representation(
            quantizer=self,
            direction=direction,
            data=data,
            scale=scale,
            amax=amax,
            shape=(shape[0], shape[1]),
            transposed=self.transposed(direction),
            dtype=dtype,
            hadamard=self.hadamard(direction),
        )

    def stored_representation(
        self, direction: str, shape: tuple[int, int], dtype: torch.dtype, tensors: Sequence[torch.Tensor]
    ) -> Representation:
        """The representation behind ``Representation.tensors()``: data, scale and amax, empty
        where absent, an outer-dim-major scale transposed. Where the data is empty (an expert no
        token reached) so are its scales and amaxes, which are then kept: a GEMM of no rows still
        reads its operand's per-row scales."""
        data, scale, amax = tensors
        def part(t: torch.Tensor) -> Optional[torch.Tensor]:
            return t if t.numel() or not data.numel() else None

        scale = part(scale)
        if scale is not None and self.scale_outer_major(direction):
            scale = scale.t()
        return self.representation(direction, shape, dtype, data, scale, part(amax))

    # -- how GEMMs read it ---------------------------------------------------------------------

    def gemm_input(self, direction: str) -> Optional[GemmInput]:
        """The layout family and element encoding GEMM kernels know ``direction`` by
        (graphquant.kernels.backends matches a pair of them to a native GEMM); None where no kernel
        is written for its layout, so that its GEMMs are emulated from ``emulated_values``."""
        return None

    def emulated_values(self, rep: Representation) -> torch.Tensor:
        """The values an emulated GEMM multiplies, in stored orientation: ``rep``'s dequantized
        values without ``emulated_factor``, which the GEMM applies to its product once."""
        return rep.dequantize(torch.float32)

    def emulated_factor(self, rep: Representation) -> Optional[torch.Tensor]:
        """The per-tensor (scalar) or per-row ((stored rows, 1)) factor of ``rep``'s values that an
        emulated GEMM applies to its product, as a GPU GEMM's alpha; None: the values carry it all."""
        return None

    def values_exact_in_bf16(self, rep: Representation) -> bool:
        """Whether ``emulated_values(rep)`` are bfloat16 numbers, so that a bf16 GEMM loses nothing."""
        return False

    # -- how the native quantize kernels make it -----------------------------------------------

    def kernel_encoding(self, direction: str) -> Optional[KernelEncoding]:
        """How the native quantize kernels encode ``direction`` (graphquant.kernels.native runs
        them from it), bit for bit as ``quantize_rowwise`` / ``quantize_columnwise`` do; None
        where no kernel encodes the format, so that the reference numerics make it."""
        return None

    # -- common behaviour ----------------------------------------------------------------------

    def __call__(
        self,
        x: torch.Tensor,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
        ctx: Optional[QuantizeContext] = None,
    ) -> QuantizedTensor:
        """Quantize ``x`` (flattened to 2-D over its leading dims) in the directions asked for."""
        x2d = as_matrix(x, self)
        ctx = ctx or QuantizeContext()
        for direction, wanted in ((ROWWISE, rowwise), (COLUMNWISE, columnwise)):
            if wanted:
                self.check_shape(tuple(x2d.shape), direction)
        return QuantizedTensor(
            rowwise=self.quantize_rowwise(x2d, ctx) if rowwise else None,
            columnwise=self.quantize_columnwise(x2d, ctx) if columnwise else None,
        )

    def __str__(self) -> str:
        return self.spec

    @property
    def spec(self) -> str:
        """``tag(field=value, ...)`` naming the fields that differ from their defaults."""
        args = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in self.always_shown or value != field.default:
                args.append(f"{field.name}={_spec_value(value)}")
        return f"{self.tag}({', '.join(args)})"


_SCALAR_FIELDS = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,)}


def undeclared_fields(quantizer: Quantizer) -> list[str]:
    """Annotated attributes of its class, and attributes the instance holds (set in an __init__ of
    its own), that are no dataclass fields: a subclass without @dataclasses.dataclass(frozen=True),
    whose values would then be in no spec, so that a compiled graph, which rebuilds the quantizer
    from its spec, would run its defaults."""
    declared = {f.name for f in dataclasses.fields(quantizer)}
    annotations = type(quantizer).__dict__.get("__annotations__", {})
    annotated = [name for name, kind in annotations.items() if name not in declared and "ClassVar" not in str(kind)]
    return annotated + sorted(set(vars(quantizer)) - declared - set(annotated))


def mistyped_fields(quantizer: Quantizer) -> list[str]:
    """Its bool, int, float and str fields that hold a value of another type, as words: a bool
    taken for an int, or TransformerEngine's positional (fp8_dtype, device) putting a device in
    the second field, would otherwise fail only where the value is used."""
    problems = []
    for field in dataclasses.fields(quantizer):
        accepted = _SCALAR_FIELDS.get(field.type if isinstance(field.type, str) else getattr(field.type, "__name__", ""))
        value = getattr(quantizer, field.name)
        if accepted and (not isinstance(value, accepted) or (isinstance(value, bool) and bool not in accepted)):
            kind = field.type if isinstance(field.type, str) else field.type.__name__
            problems.append(f"{field.name} must be {'an' if kind[0] in 'aeiou' else 'a'} {kind}, got {value!r}")
    return problems


def quantizer_classes() -> tuple[type[Quantizer], ...]:
    """Every quantizer class defined so far, built in or user-defined, in the order of definition."""
    return tuple(_REGISTRY.values())


def _spec_value(value: Any) -> str:
    if isinstance(value, Quantizer):
        return value.spec
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, str) and value.isidentifier() and value not in ("True", "False", "None"):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        return repr(repr(value))  # 'inf': no literal, read back by _field_value
    return repr(value)


def parse_spec(spec: str) -> Quantizer:
    """The quantizer whose ``str`` is ``spec`` (the inverse of ``Quantizer.spec``)."""
    try:
        tree = ast.parse(spec, mode="eval").body
    except SyntaxError as error:
        raise ValueError(f"not a quantizer spec: {spec!r} ({error.msg})") from None
    return _build(tree, spec)


@functools.lru_cache(maxsize=None)
def quantizer_of(spec: str) -> Quantizer:
    """``parse_spec(spec)``, made once: the ops rebuild each call's quantizers from their specs."""
    return parse_spec(spec)


def _build(node: ast.AST, spec: str) -> Any:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args:
        cls = _REGISTRY.get(node.func.id)
        if cls is None:
            known = ", ".join(sorted(_REGISTRY))
            raise ValueError(f"unknown quantizer tag {node.func.id!r} in spec {spec!r}; known: {known}")
        kwargs = {kw.arg: _build(kw.value, spec) for kw in node.keywords}
        return cls(**{name: _field_value(cls, name, value) for name, value in kwargs.items()})
    if isinstance(node, ast.Name):
        return node.id
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise ValueError(f"cannot read {ast.unparse(node)!r} in quantizer spec {spec!r}") from None


def _field_value(cls: type, name: str, value: Any) -> Any:
    """Spec text gives dtypes as bare names and non-finite floats as strings ('inf'); turn them back
    where a field wants a torch dtype or a float."""
    field = {f.name: f for f in dataclasses.fields(cls)}.get(name)
    if field is not None and isinstance(value, str):
        if "dtype" in str(field.type) and "torch" in str(field.type):
            return getattr(torch, value)
        if "float" in str(field.type) and value in ("inf", "-inf", "nan"):
            return float(value)
    return value


def unspecced_fields(quantizer: Quantizer) -> list[str]:
    """Its fields that its spec does not give back as they are, as words: an unhashable value (a
    list), or one no spec holds, which a compiled graph, rebuilding the quantizer from its spec,
    would not get."""
    unhashable = []
    for field in dataclasses.fields(quantizer):
        try:
            hash(getattr(quantizer, field.name))
        except TypeError:
            unhashable.append(f"{field.name} is {getattr(quantizer, field.name)!r}, which is unhashable (a tuple is not)")
    if unhashable:
        return unhashable
    try:
        rebuilt = parse_spec(quantizer.spec)
    except (ValueError, TypeError) as error:
        return [f"spec {quantizer.spec} does not read back ({error})"]
    return [
        f"{field.name} is {mine!r}, which its spec {quantizer.spec} gives back as {theirs!r}"
        for field in dataclasses.fields(quantizer)
        for mine, theirs in [(getattr(quantizer, field.name), getattr(rebuilt, field.name))]
        if not (mine == theirs or mine != mine and theirs != theirs)  # NaN is NaN's own
    ]


def as_matrix(x: torch.Tensor, quantizer: Quantizer) -> torch.Tensor:
    """``x`` flattened to 2-D over its leading dims; rejects what no format can encode."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{quantizer} quantizes tensors, got {type(x).__name__}")
    if not x.dtype.is_floating_point or x.dtype.itemsize == 1:
        raise TypeError(
            f"{quantizer} quantizes float16, bfloat16 or float32 tensors, got {x.dtype}; "
            "cast the tensor first or keep this slot in high precision with IdentityQuantizer()"
        )
    if x.dim() < 1:
        raise ValueError(f"{quantizer} needs a tensor with at least one dimension, got a scalar")
    return x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
