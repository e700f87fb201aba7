"""Per-tensor FP8: current scaling, delayed scaling, and the delayed-scaling request form."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from graphquant.formats import fp8, per_tensor
from graphquant.formats.groups import group_amax
from graphquant.quantizers.base import COLUMNWISE, ROWWISE, QuantizeContext, Quantizer, Representation
from graphquant.quantizers.descriptions import GemmInput, KernelEncoding

FP8_FORMATS = tuple(fp8.FP8_DTYPES)
_NAMES = {dtype: name for name, dtype in fp8.FP8_DTYPES.items()}


def normalize_fp8_dtype(owner: object) -> None:
    """Accept ``owner.fp8_dtype`` as a name ("e4m3") or as the torch dtype (torch.float8_e4m3fn),
    and keep the name, so that equal quantizers compare, hash and print alike."""
    fp8_dtype = owner.fp8_dtype
    name = _NAMES.get(fp8_dtype) if isinstance(fp8_dtype, torch.dtype) else fp8_dtype
    if not isinstance(name, str) or name not in fp8.FP8_DTYPES:
        accepted = ", ".join([*map(repr, FP8_FORMATS), *map(str, _NAMES)])
        raise ValueError(f"{type(owner).__name__}: fp8_dtype must be one of {accepted}, got {fp8_dtype!r}")
    object.__setattr__(owner, "fp8_dtype", name)


def traced_scales(
    amax: torch.Tensor, fp8_dtype: str, epsilon: float, pow2: bool, *, blocks_in_rows: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, scale_inv) of each amax for a quantize traced into a graph, the bits of fp8.scales,
    spelled for the graph compiler:

    - power-of-two scales by integer ops on the amax's bits (fp8.pow2_scales), and the others by
      fp8.scales' float64 divisions where each is a tensor's one scale or one of blocks along
      rows (``blocks_in_rows``): plain ops the compiler fuses with the amax and the cast, so that
      a row block's amax, scale and cast run in one pass, and a backward recomputes a per-tensor
      quantize instead of saving its codes;
    - scales of 2-D tiles or of groups by the op graphquant::fp8_scales, once per scale: their
      cast runs in a kernel apart from the amax, which would divide in float64 for every element
      and cost a training step more than the fusion saves (benchmarks/NOTES.md, train_step.py).
    """
    if pow2:
        return fp8.pow2_scales(amax, fp8_dtype, epsilon)
    if blocks_in_rows or amax.dim() == 0:
        return fp8.scales(amax, fp8_dtype, epsilon, pow2)
    return torch.ops.graphquant.fp8_scales(amax, fp8_dtype, epsilon, pow2)


class _PerTensorFloat8(Quantizer):
    """Shared layout of per-tensor FP8: one scale, columnwise is the exact transpose."""

    tag = "_fp8_per_tensor"  # abstract; never in a spec
    per_tensor_amax = True

    def _encode(
        self, x: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor], direction: str, amax: torch.Tensor
    ) -> Representation:
        scale, scale_inv = scales
        transposed = self.transposed(direction)
        data = per_tensor.quantize(x, scale, self.fp8_dtype, transpose=transposed)
        return self.representation(direction, x.shape, x.dtype, data, scale_inv, amax)

    def transposed(self, direction: str) -> bool:
        return direction == COLUMNWISE

    def columnwise_is_rowwise_transposed(self) -> bool:
        return True

    def dequantize(self, rep: Representation) -> torch.Tensor:
        return per_tensor.dequantize(rep.data, rep.scale)

    def gemm_input(self, direction: str) -> GemmInput:
        return GemmInput("fp8_tensorwise", self.fp8_dtype)

    def emulated_values(self, rep: Representation) -> torch.Tensor:
        return rep.data  # the FP8 codes, no copy

    def emulated_factor(self, rep: Representation) -> torch.Tensor:
        return rep.scale.reshape(())

    def grouped_factor(self, rep: Representation, row_group: torch.Tensor) -> torch.Tensor:
        return rep.scale[row_group, None] if rep.direction == ROWWISE else rep.scale[:, None]

    def grouped_columnwise_amax(self, x: torch.Tensor, row_group: torch.Tensor, groups: int) -> torch.Tensor:
        return group_amax(x, row_group, groups)

    def values_exact_in_bf16(self, rep: Representation) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class Float8CurrentScalingQuantizer(_PerTensorFloat8):
    """FP8 with one scale computed from this tensor's amax (``fp8_max / amax``) at every call.

    amax_epsilon floors the amax; force_pow_2_scales rounds the scale down to a power of two.
    with_amax_reduction all-reduces the amax (MAX) over the recipe's process group first.
    """

    attention_format = True

    tag = "fp8_current"
    traceable = True
    groupable = True
    always_shown = ("fp8_dtype",)

    fp8_dtype: str = "e4m3"
    force_pow_2_scales: bool = False
    amax_epsilon: float = 0.0
    with_amax_reduction: bool = False

    def __post_init__(self) -> None:
        normalize_fp8_dtype(self)
        super().__post_init__()

    @property
    def reduces_amax(self) -> bool:  # type: ignore[override]
        return self.with_amax_reduction

    def amax(self, x: torch.Tensor, ctx: Optional[QuantizeContext] = None) -> torch.Tensor:
        """This tensor's amax, the MAX over ``ctx.amax_group`` with with_amax_reduction (every rank
        then gets the same scale)."""
        amax = fp8.tensor_amax(x)
        return ctx.reduced_amax(amax) if self.with_amax_reduction and ctx is not None else amax

    def quantize_rowwise(self, x: torch.Tensor, ctx: QuantizeContext) -> Representation:
        return self.quantize_from_amax(x, self.amax(x, ctx), ROWWISE)

    def quantize_columnwise(self, x: torch.Tensor, ctx: QuantizeContext) -> Representation:
        return self.quantize_from_amax(x, self.amax(x, ctx), COLUMNWISE)

    def kernel_encoding(self, direction: str) -> KernelEncoding:
        return KernelEncoding(
            "tensor",
            self.fp8_dtype,
            transposed=self.transposed(direction),
            amax_epsilon=self.amax_epsilon,
            pow2_scales=self.force_pow_2_scales,
        )

    def encodes_from_tensor_amax(self) -> bool:
        return not self.with_amax_reduction  # a reduced amax is all-reduced before it is known

    def scale_of_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """The scale this format gives a tensor whose amax is ``amax`` (float32, any shape), where
        the amax is known without reading the tensor (a flash-attention kernel's unnormalised
        softmax tiles have amax 1)."""
        return fp8.scale_from_amax(amax, self.fp8_dtype, epsilon=self.amax_epsilon, pow2=self.force_pow_2_scales)

    def quantize_from_amax(self, x: torch.Tensor, amax: torch.Tensor, direction: str) -> Representation:
        """x in ``direction`` with its amax already taken (by the kernel that made the other
        direction): the scale follows from it (traced_scales), and x is read once more
        for the cast alone."""
        scales = traced_scales(amax, self.fp8_dtype, self.amax_epsilon, self.force_pow_2_scales)
        return self._encode(x, scales, direction, amax)

    def quantize_groups(
        self, x: torch.Tensor, row_group: torch.Tensor, groups: int, direction: str, ctx: QuantizeContext
    ) -> Representation:
        """One scale per group, from the group's amax (each all-reduced with with_amax_reduction);
        the rows take their group's scale."""
        amax = group_amax(x, row_group, groups)
        if self.with_amax_reduction:
            amax = ctx.reduced_amax(amax)
        scale, scale_inv = traced_scales(amax, self.fp8_dtype, self.amax_epsilon, self.force_pow_2_scales)
        return self._encode(x, (scale[row_group, None], scale_inv), direction, amax)


@dataclasses.dataclass(frozen=True)
class Float8DelayedScalingQuantizer(_PerTensorFloat8):
    """FP8 whose scale comes from the amax history of earlier steps (TE's DelayedScaling).

    Quantizing uses the slot's current scale (``QuantizeContext.scale``) and reports this
    tensor's amax; ``per_tensor.delayed_scaling_update`` then rolls the history and computes the
    next scale: ``(fp8_max / amax) / 2**margin`` with amax the history's max ("max") or its
    newest entry ("most_recent"). The state lives in tensors owned by the compiled module.
    """

    attention_format = True

    tag = "fp8_delayed"
    always_shown = ("fp8_dtype",)
    requantization_safe = False
    keeps_state = True
    groupable = True

    fp8_dtype: str = "e4m3"
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True

    def __post_init__(self) -> None:
        normalize_fp8_dtype(self)
        super().__post_init__()
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                f"amax_compute_algo must be 'max' or 'most_recent', got {self.amax_compute_algo!r}"
            )
        if self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be at least 1, got {self.amax_history_len}")

    @property
    def asks_amax_reduction(self) -> bool:  # type: ignore[override]
        return self.reduce_amax

    def _scales(self, ctx: QuantizeContext) -> tuple[torch.Tensor, torch.Tensor]:
        if ctx.scale is None:
            raise ValueError(
                f"{self} quantizes with the slot's current scale: pass QuantizeContext(scale=...) "
                "(graphquant.compile keeps that state for you)"
            )
        return ctx.scale, torch.reciprocal(ctx.scale)

    def quantize_rowwise(self, x: torch.Tensor, ctx: QuantizeContext) -> Representation:
        return self._encode(x, self._scales(ctx), ROWWISE, fp8.tensor_amax(x))

    def quantize_columnwise(self, x: torch.Tensor, ctx: QuantizeContext) -> Representation:
        return self._encode(x, self._scales(ctx), COLUMNWISE, fp8.tensor_amax(x))

    def quantize_groups(
        self, x: torch.Tensor, row_group: torch.Tensor, groups: int, direction: str, ctx: QuantizeContext
    ) -> Representation:
        """Each group with its own slot's current scale (``ctx.scale``: one a group, as TE's
        grouped linear keeps one delayed-scaling slot per expert), reporting each group's amax."""
        scale, scale_inv = self._scales(ctx)
        if scale.numel() != groups:
            raise ValueError(f"{self} quantizes {groups} groups, each with its slot's scale: got {scale.numel()} scales")
        return self._encode(x, (scale.reshape(groups)[row_group, None], scale_inv.reshape(groups)), direction, group_amax(x, row_group, groups))

    def kernel_encoding(self, direction: str) -> KernelEncoding:
        return KernelEncoding("tensor", self.fp8_dtype, transposed=self.transposed(direction), delayed_scaling=True)

    @property
    def scaling(self) -> str:
        """What a slot's scale is computed for (its state's scale means nothing under another):
        kept beside the state in a checkpoint, so that a run resumed under another format refuses it."""
        return f"fp8_dtype={self.fp8_dtype}, margin={self.margin}, amax_compute_algo={self.amax_compute_algo}"

    def initial_state(self, device: Optional[torch.device] = None, groups: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A fresh (scale, amax_history): scale 1, history zeros, as TE starts; with ``groups``, one
        of each a group ((groups, 1), (groups, L)), for an MoE site's experts."""
        lead = () if groups is None else (groups,)
        return (
            torch.ones((*lead, 1), dtype=torch.float32, device=device),
            torch.zeros((*lead, self.amax_history_len), dtype=torch.float32, device=device),
        )

    def scale_of_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """The scale an amax history of ``amax`` (float32, shape (1,)) alone gives:
        ``(fp8_max / amax) / 2**margin``."""
        scale, _ = self.update(torch.ones_like(amax), torch.zeros_like(amax), amax)
        return scale

    def update(
        self, scale: torch.Tensor, amax_history: torch.Tensor, amax: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (scale, amax_history) after a step that saw ``amax``."""
        return per_tensor.delayed_scaling_update(
            scale,
            amax_history,
            amax,
            fp8_dtype=self.fp8_dtype,
            margin=self.margin,
            algo=self.amax_compute_algo,
        )


@dataclasses.dataclass(frozen=True)
class DelayedScalingRequest:
    """A factory's way to ask for delayed scaling without choosing the FP8 dtype (TE's request form).

    fp8_format "HYBRID" gives E4M3 to forward tensors (input, weight, other; attention's qkv and
    s) and E5M2 to backward ones (grad_output; attention's do and dp); "E4M3" gives E4M3 everywhere.
    The requests for one module's roles must be equal (TE keeps one recipe state a module).
    """

    fp8_format: str = "HYBRID"
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True

    def __post_init__(self) -> None:
        if self.fp8_format not in ("HYBRID", "E4M3"):
            raise ValueError(f"DelayedScalingRequest.fp8_format must be 'HYBRID' or 'E4M3', got {self.fp8_format!r}")

    def resolve(self, backward: bool) -> Float8DelayedScalingQuantizer:
        """The quantizer of a slot whose tensor is a gradient (``backward``: QuantizerRole.backward) or not."""
        return Float8DelayedScalingQuantizer(
            fp8_dtype="e5m2" if backward and self.fp8_format == "HYBRID" else "e4m3",
            margin=self.margin,
            amax_history_len=self.amax_history_len,
            amax_compute_algo=self.amax_compute_algo,
            reduce_amax=self.reduce_amax,
        )
