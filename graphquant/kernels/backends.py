"""GEMM backends: how a pair of representations is multiplied on this device.

``select`` classifies an operand pair (each operand given as the quantizer that makes its
direction) into native / emulated / rejected and names the backend, a GemmBackend; the planner
shows that choice, the rewritten graph carries it to every GEMM call, and ``gemm`` runs exactly
it or, where the call cannot run on it, fails. Native backends are cuBLASLt (scaled_mm: through
torch._scaled_mm, and per-tensor FP8 through graphquant's own call with a timed algorithm
choice), Triton's decode GEMM for few rows (graphquant.kernels.triton_decode), and graphquant's
CUDA GEMMs on Hopper (graphquant.kernels.mixed_input, block_scaled). The
emulated backend dequantizes both operands exactly and multiplies them in high precision; it runs
every pair the planner admits, on any device.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import itertools
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from graphquant.formats.groups import FEW_TOKEN_ROWS, GROUP_ROWS
from graphquant.kernels import block_scaled, emulation, grouped_fp8, grouped_operands, mixed_input, scaled_mm
from graphquant.kernels.devices import capability
from graphquant.quantizers import (
    COLUMNWISE,
    ROWWISE,
    Float8CurrentScalingQuantizer,
    Float8DelayedScalingQuantizer,
    GemmInput,
    Quantizer,
    Representation,
    gemm_dims,
    output_rows,
    reduced_extent,
    quantizer_classes,
)

NATIVE = "native"
EMULATED = "emulated"
REJECTED = "rejected"

HIGH_PRECISION = "high-precision matmul"
EMULATION = "dequantize + high-precision matmul"
ATTENTION_EMULATION = "attention emulation"  # FP8 attention, S and P materialised: its products on the emulated GEMM
NONE = "none"  # a rejected GEMM's: it must not run
# The backends that run the emulated GEMM (it takes high-precision operands as they are).
ON_EMULATION = (HIGH_PRECISION, EMULATION, ATTENTION_EMULATION)
# The attention kernels that run a site's products themselves (no GEMM call runs them): the Triton
# forward and backward, and the Gluon forward and backward (graphquant.kernels.gluon_attention and
# gluon_attention_backward, the Triton kernels' bits).
FLASH_ATTENTION = "triton fp8 flash attention"
GLUON_FLASH_ATTENTION = "gluon fp8 flash attention"
ATTENTION_KERNELS = (FLASH_ATTENTION, GLUON_FLASH_ATTENTION)
FLASH_HEAD_DIMS = (64, 128)  # the head dims graphquant.kernels.triton_attention is built for
GLUON_LENGTH_MULTIPLE = 16  # the query and key lengths the Gluon kernels take are its multiples (gluon_attention.forward says why)
HAS_TRITON = importlib.util.find_spec("triton") is not None


def empty_attention(shape: Sequence[int], dtype: torch.dtype, device: torch.device, token_major: bool) -> torch.Tensor:
    """An empty (batch, heads, L, D) tensor of attention (a flash forward's O, a gradient), token by
    token in memory ((batch, L, heads, D), as a model's projection gives Q, K and V, so that the
    model's transpose back is a view) where ``token_major`` says."""
    if token_major:
        b, heads, seq_q, head_dim = shape
        return torch.empty((b, seq_q, heads, head_dim), device=device, dtype=dtype).transpose(1, 2)
    return torch.empty(shape, device=device, dtype=dtype)


def _imports(module: str) -> bool:
    """Whether ``module`` imports here."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


# Whether the Gluon kernels import: Triton with the Gluon API they are written in.
HAS_GLUON = HAS_TRITON and _imports("graphquant.kernels.gluon_attention") and _imports("graphquant.kernels.gluon_attention_backward")
# The decode GEMM's kernels where Triton is installed; None elsewhere (no decode GEMM).
triton_decode = importlib.import_module("graphquant.kernels.triton_decode") if HAS_TRITON else None
# The native FP8 grouped GEMM's kernels where Triton is installed; None elsewhere.
triton_grouped_fp8 = importlib.import_module("graphquant.kernels.triton_grouped_fp8") if HAS_TRITON else None


@dataclasses.dataclass(frozen=True)
class GemmBackend:
    """The backend one GEMM runs on, as the plan chose it: the graph carries it to the GEMM call.

    name: a native GEMM's (NATIVE_GEMMS, NATIVE_GROUPED_GEMMS), one of ON_EMULATION or
    ATTENTION_KERNELS, or NONE. fast_accumulation: the product sums in the tensor cores'
    accumulator, which only some native GEMMs offer (and one that never promotes always does).
    """

    name: str
    fast_accumulation: bool = False

    def __post_init__(self) -> None:
        native = NATIVE_BY_NAME.get(self.name)
        if native is None and self.name not in (*ON_EMULATION, *ATTENTION_KERNELS, NONE):
            names = ", ".join(map(repr, [*NATIVE_BY_NAME, *ON_EMULATION, *ATTENTION_KERNELS, NONE]))
            raise ValueError(f"unknown GEMM backend {self.name!r}; one of {names}")
        if self.fast_accumulation and not (native and native.fast_accumulation):
            raise ValueError(f"the GEMM backend {self.name!r} has no fast accumulation")
        if not self.fast_accumulation and native and not native.promotes:
            raise ValueError(f"the GEMM backend {self.name!r} sums only in the tensor cores' accumulator: give it fast_accumulation=True")

    @property
    def native(self) -> Optional["NativeGemm"]:
        """The native GEMM it runs, or None where it runs the emulated one (or none)."""
        return NATIVE_BY_NAME.get(self.name)

    @property
    def quantizes_a(self) -> bool:
        """Whether it takes A in high precision and quantizes it itself (NativeGemm.quantizes_a)."""
        return self.native is not None and self.native.quantizes_a

    def __str__(self) -> str:
        return self.name + (" (fast accumulation)" if self.fast_accumulation else "")

    def __repr__(self) -> str:
        """The call that rebuilds it (a graph dump prints it in each GEMM's Site)."""
        return f"GemmBackend({self.name!r}{', fast_accumulation=True' if self.fast_accumulation else ''})"


@functools.lru_cache(maxsize=None)
def named(name: str, fast_accumulation: bool) -> GemmBackend:
    """The GemmBackend that a GEMM op's arguments name, made once per value: its checks would
    otherwise be host time on every GEMM call."""
    return GemmBackend(name, fast_accumulation)


@dataclasses.dataclass(frozen=True)
class Selection:
    """How one GEMM will run: its bucket, its backend, and why when it is not native."""

    bucket: str
    backend: GemmBackend
    reason: str = ""


class NativeGemm(NamedTuple):
    """A native GEMM: its backend name, the pairs of operand families (GemmInput.family) and of
    element encodings it multiplies, the multiple m, n and k must be (1 where it pads what its
    kernel needs itself: scaled_mm.block_scaled_rows, whole_reduction, whole_rows), the compute
    capabilities it runs on, whether it can sum in the tensor cores' accumulator (fast
    accumulation), and for a skinny GEMM the rows of A it takes, ((A's family, B's family), (fewest,
    most)) for each pair (m, known when the plan is made; fewer run faster on another), both
    operands stored with the reduction dim last. ``quantizes_a``: it takes A in high precision and
    quantizes it itself (triton_decode.QuantizedOnLoad; 1x128 blocks by its kernel that runs first,
    as a graph op of its own: triton_decode.quantizes_first), where A is made for this GEMM alone.
    ``fast_families``: the families it sums fast where the recipe allows (None: every family it
    takes); ``promotes``: it can also promote its sums into fp32 (one that cannot runs only the
    GEMMs a recipe lets accumulate fast); ``token_tiles``: a grouped GEMM that multiplies only tiles
    of few tokens an expert, in groups of FEW_TOKEN_ROWS (a graph's fprop alone:
    graphquant.formats.groups) and more than a decode step's, which one token a program multiplies
    faster (triton_decode.one_token_a_program); ``whole_tiles``: one that multiplies only groups of
    tokens that start at multiples of GROUP_ROWS. ``k_multiple``: the multiple k must be where m and
    n may be any; ``k_left``: a multiple of k it leaves to the next GEMM, for the element pairs
    ``k_left_elements`` that one takes (faster where k is such a multiple, padding k otherwise; 0:
    none); ``splits_k``: the rule by which its kernel splits K, (m, n, k, device) -> bool, where it
    keeps such a k, m, n and k known when the plan is made (the next GEMM leaves most SMs idle
    there; None: it never splits); ``available``: whether it runs on a device of a capability it
    runs on (a kernel of graphquant's extension: whether the extension has it there)."""

    backend: str
    families: frozenset[tuple[str, str]]
    elements: frozenset[tuple[str, str]]
    multiple: int
    runs_on: Callable[[tuple[int, int]], bool]
    fast_accumulation: bool = False
    rows: Optional[tuple[tuple[tuple[str, str], tuple[int, int]], ...]] = None
    quantizes_a: bool = False
    reads: Callable[[GemmInput], bool] = lambda operand: True
    fast_families: Optional[frozenset[str]] = None
    promotes: bool = True
    token_tiles: bool = False
    whole_tiles: bool = False
    k_multiple: int = 1
    k_left: int = 0
    k_left_elements: frozenset[tuple[str, str]] = frozenset()
    splits_k: Optional[Callable[[int, int, int, torch.device], bool]] = None
    available: Callable[[torch.device], bool] = lambda device: True

    def accumulates_fast(self, a: GemmInput, b: GemmInput, allowed: bool) -> bool:
        """Whether it sums a product of ``a`` and ``b`` in the tensor cores' accumulator where the
        recipe lets it (``allowed``): always where it cannot promote, never where it has no fast
        accumulation or not for these families."""
        if not self.promotes:
            return True
        families_fast = self.fast_families is None or {a.family, b.family} <= self.fast_families
        return allowed and self.fast_accumulation and families_fast

    def token_block(self) -> Optional[int]:
        """The rows a grouped GEMM's groups of tokens must start at multiples of, where it takes only
        such (token_tiles: FEW_TOKEN_ROWS, whole_tiles: GROUP_ROWS); None: any."""
        return FEW_TOKEN_ROWS if self.token_tiles else GROUP_ROWS if self.whole_tiles else None

    def takes(self, a: Optional[GemmInput], b: Optional[GemmInput]) -> bool:
        """Whether it multiplies operands read as ``a`` and ``b`` (None: no kernel reads it);
        ``reads``: whether its kernels read one operand's family in its element encoding, where
        the pairs of families and of elements admit more than it reads."""
        if a is None or b is None:
            return False
        pairs = (a.family, b.family) in self.families and (a.element, b.element) in self.elements
        return pairs and self.reads(a) and self.reads(b)

    def splits(self, dims: Sequence[Any], device: Optional[torch.device]) -> bool:
        """Whether its kernel splits K for ``dims`` (m, n, k) on ``device``: all of them known."""
        if self.splits_k is None or device is None or len(dims) != 3 or not all(isinstance(d, int) for d in dims):
            return False
        return self.splits_k(*dims, device)

    def misfit(
        self, dims: Sequence[Any], batch: Any = 1, k_last: bool = True, families: tuple[str, str] = ("", ""),
        elements: tuple[str, str] = ("", ""), device: Optional[torch.device] = None,
    ) -> str:
        """Why it cannot multiply ``batch`` products of ``dims`` (m, n, k) of operands of
        ``families`` and ``elements`` (GemmInput.family and .element of A and B), both stored with
        the reduction dim last or not (``k_last``), on ``device`` (None: any), or "" where it can. A
        dim may be None (unknown: not tested, except m by a skinny GEMM, which needs it known) or a
        torch.SymInt, whose test becomes a guard of the graph being compiled, so that a size that
        fails it compiles (and plans) a graph of its own."""
        if batch != 1:
            return f"{self.backend} multiplies one matrix pair, not a batch of {batch}"
        if any(d is not None and d % self.multiple != 0 for d in dims):
            return f"{self.backend} needs m, n, k multiples of {self.multiple}; got {tuple(dims)}"
        k = dims[2] if len(dims) == 3 else None
        if k is not None and k % self.k_multiple != 0:
            return f"{self.backend} needs k a multiple of {self.k_multiple}; got (m, n, k) = {tuple(dims)}"
        if k is not None and self.k_left and k % self.k_left == 0 and tuple(elements) in self.k_left_elements and not self.splits(dims, device):
            few = " unless it splits K (an output of few tiles)" if self.splits_k else ""
            return f"{self.backend} leaves a k that is a multiple of {self.k_left} to the next GEMM{few}; got (m, n, k) = {tuple(dims)}"
        if self.rows is not None:
            m = dims[0] if dims else None
            fewest, most = dict(self.rows).get(tuple(families), (1, 0))
            if not isinstance(m, int) or not fewest <= m <= most:
                span = f"{fewest} to {most}" if fewest > 1 else f"at most {most}"
                return (
                    f"{self.backend} multiplies {span} rows of A for {families[0]} x {families[1]}, "
                    f"a number known when the plan is made; got m = {m}"
                )
            if not k_last:
                return f"{self.backend} reads operands stored with the reduction dim last"
        return ""


BOTH_E4M3 = frozenset({("e4m3", "e4m3")})

# Triton's decode GEMM, where Triton is installed, for few rows (triton_decode.MAX_ROWS: 16 for
# FP8, more for MXFP8 and NVFP4, which it dequantizes per weight tile): the weight's bytes are most
# of the cost there, and it reads them once, as stored (FP8 codes straight into the tensor cores,
# which need sm89), at about twice bf16's speed and ahead of cuBLASLt's FP8 GEMMs at those row
# counts (benchmarks/decode_gemm.py), but behind Blackwell's block-scaled tensor cores. It promotes
# FP8 sums into fp32 as cuBLASLt does without fast accumulation and sums MXFP8's and NVFP4's exact
# products in fp32, so it has no fast accumulation: a recipe that allows it gets the promoted sum
# here. It serves training GEMMs of as many rows too (fprop, dgrad). Where A is quantized for the
# GEMM alone (an inference linear's x), in FP8 current scaling, the same kernels quantize it
# themselves, first: a decode step's quantize kernels around each GEMM cost more than the GEMM
# saves over bf16 (benchmarks/NOTES.md, decode_profile.py).
DECODE_GEMMS = () if triton_decode is None else (
    NativeGemm(
        triton_decode.QUANTIZING_BACKEND,
        triton_decode.QUANTIZING_PAIRS,
        triton_decode.ELEMENT_PAIRS,
        1,
        lambda sm: sm >= (8, 9),
        rows=tuple((pair, (1, most)) for pair, most in triton_decode.MAX_ROWS.items()),
        quantizes_a=True,
        reads=triton_decode.reads,
    ),
    NativeGemm(
        triton_decode.BACKEND,
        frozenset(triton_decode.MAX_ROWS),
        triton_decode.ELEMENT_PAIRS,
        1,
        lambda sm: sm >= (8, 9),
        fast_accumulation=False,
        rows=tuple((pair, (1, most)) for pair, most in triton_decode.MAX_ROWS.items()),
        reads=triton_decode.reads,
    ),
)

# graphquant's CUDA GEMM of an MXFP8 or NVFP4 weight decoded in registers as the register operand of
# Hopper's bf16 wgmma (graphquant.kernels.mixed_input), where the extension has it: the weight's
# bytes read once, as stored, between the decode GEMM's rows (one tile of A, its tensor cores
# waiting for its decoding) and the emulation's (the whole weight dequantized into memory each
# call), faster than both there (benchmarks/NOTES.md, decode_gemm.py). Its sums are the
# emulation's exact bf16 products in fp32, so it has no fast accumulation.
MIXED_INPUT_GEMM = NativeGemm(
    mixed_input.BACKEND,
    mixed_input.PLANNED_FAMILIES,
    mixed_input.ELEMENTS,
    1,
    lambda sm: sm == (9, 0),
    rows=tuple(((family, family), mixed_input.ROWS[family]) for family in mixed_input.FORMATS),
    k_multiple=mixed_input.K_MULTIPLE,
    available=lambda device: mixed_input.extension_runs(device),
)

# graphquant's CUDA GEMM of DeepSeek-V3's block-scaled FP8 fprop and dgrad (1x128 by 128x128) on
# Hopper, where the extension has it (graphquant.kernels.block_scaled), for the k that cuBLASLt's
# blockwise GEMM takes only padded each call (scaled_mm.TILE_SCALED_K), and for E5M2 gradients,
# which that one does not take: faster than the padded call, slower than cuBLASLt's where it takes
# k as it is, which it is left, unless the output's tiles fill at most half the SMs (a few rows
# of A: 64 by 4096 columns are 32 tiles), where this kernel splits K and cuBLASLt's leaves most
# SMs idle (benchmarks/NOTES.md, block_gemm.py). Each block's
# partial sum is promoted into fp32, as the recipe asks, so it has no fast accumulation.
BLOCK_SCALED_GEMM = NativeGemm(
    block_scaled.BACKEND,
    block_scaled.FAMILIES,
    block_scaled.ELEMENTS,
    1,
    lambda sm: sm == (9, 0),
    k_multiple=block_scaled.K_MULTIPLE,
    k_left=scaled_mm.TILE_SCALED_K,
    k_left_elements=BOTH_E4M3,  # cuBLASLt's blockwise GEMM's
    splits_k=block_scaled.splits_k,
    available=lambda device: block_scaled.extension_runs(device),
)

# torch._scaled_mm runs per-tensor and per-row FP8 from Hopper on (per-tensor with E5M2 on at most
# one side) and DeepSeek-style block scales on sm90 alone, 1x128 blocks on the left, at any m, n and
# k (a call of 100 rows, a wgrad over 1000 tokens or an LM head of 32001 rows is no reason for the
# emulation, 5-20x slower); the block-scaled MXFP8 and NVFP4 paths from Blackwell on (sm100, sm120).
# The first that fits a GEMM runs it: Blackwell's MXFP8 and NVFP4, then Hopper's mixed-input
# MXFP8 GEMM, then the decode GEMM, then graphquant's block-scaled GEMM, then cuBLASLt's FP8.
NATIVE_GEMMS = (
    NativeGemm(scaled_mm.MXFP8, frozenset({("mxfp8", "mxfp8")}), BOTH_E4M3, 128, lambda sm: sm >= (10, 0)),
    NativeGemm(scaled_mm.NVFP4, frozenset({("nvfp4", "nvfp4")}), frozenset({("e2m1", "e2m1")}), 128, lambda sm: sm >= (10, 0)),
    MIXED_INPUT_GEMM,
    *DECODE_GEMMS,
    BLOCK_SCALED_GEMM,
    NativeGemm(
        scaled_mm.TENSORWISE,
        frozenset({("fp8_tensorwise", "fp8_tensorwise")}),
        BOTH_E4M3 | {("e4m3", "e5m2"), ("e5m2", "e4m3")},
        1,  # any shape: scaled_mm pads what cuBLASLt needs
        lambda sm: sm >= (9, 0),
        fast_accumulation=True,
    ),
    NativeGemm(
        scaled_mm.ROWWISE_SCALED,
        frozenset({("fp8_rowwise", "fp8_rowwise")}),
        BOTH_E4M3,
        1,  # any shape: scaled_mm pads what cuBLASLt needs
        lambda sm: sm >= (9, 0),
        fast_accumulation=True,
    ),
    NativeGemm(
        scaled_mm.BLOCKWISE,
        frozenset({("fp8_block_1x128", "fp8_block_1x128"), ("fp8_block_1x128", "fp8_block_128x128")}),
        BOTH_E4M3,
        1,  # any shape: scaled_mm pads what cuBLASLt needs
        lambda sm: sm[0] == 9,
    ),
)

# Triton's FP8 grouped GEMM (graphquant.kernels.triton_grouped_fp8), where Triton is installed:
# per-tensor, per-row and DeepSeek's block scales, E4M3 or E5M2, writing the unpadded output
# itself. It promotes its partial sums into fp32, or, for per-tensor and per-row scales where the
# recipe lets the GEMM accumulate fast, leaves the whole sum in the tensor cores' accumulator. It
# masks every edge: no multiple. Its FP8 products need sm89.
# On Hopper, which has no MX tensor cores, the same kernel multiplies MXFP8's E4M3 codes of few
# tokens an expert on the FP8 tensor cores a 32-long block a wgmma, each block's sum in their
# accumulator: so only where the recipe lets the GEMM accumulate fast (elsewhere, the emulation's
# fp32 sums), and promoted into fp32 every block, more often than a promoted FP8 GEMM is. Its
# tiles run no K split: a decode step's tokens (one a program) take the decoding programs.
TRITON_GROUPED_GEMMS = () if triton_grouped_fp8 is None else (
    NativeGemm(
        triton_grouped_fp8.BACKEND, triton_grouped_fp8.FAMILY_PAIRS, triton_grouped_fp8.ELEMENT_PAIRS, 1, lambda sm: sm >= (8, 9),
        fast_accumulation=True, fast_families=triton_grouped_fp8.FAST_FAMILIES,
    ),
    NativeGemm(
        triton_grouped_fp8.MX_BACKEND, triton_grouped_fp8.MX_FAMILY_PAIRS, BOTH_E4M3, 1, lambda sm: sm[0] == 9,
        fast_accumulation=True, promotes=False, token_tiles=True,
    ),
)
# graphquant's CUDA FP8 grouped GEMM (graphquant.kernels.grouped_fp8) on Hopper, where the extension
# has it: the Triton kernel's products with promoted sums, and its bits (per-tensor and per-row
# scales; DeepSeek-V3's blocks, 1x128 by 128x128 in fprop and dgrad, 1x128 by 1x128 in wgrad),
# persistent, a warpgroup copying by TMA beside two multiplying, so faster (benchmarks/NOTES.md,
# grouped_gemm.py): faster too than the Triton kernel's sums left in the accumulator, so it also
# takes, promoted, the GEMMs a recipe lets accumulate fast. The Triton kernel keeps an inference
# graph's few tokens an expert (groups of less than a whole tile) and the GPUs it does not run on.
WGMMA_GROUPED_GEMM = NativeGemm(
    grouped_fp8.BACKEND, grouped_fp8.FAMILY_PAIRS, grouped_fp8.ELEMENT_PAIRS, 1, lambda sm: sm == (9, 0),
    whole_tiles=True, k_multiple=grouped_fp8.K_MULTIPLE,
    available=lambda device: grouped_fp8.extension_runs(device),
)
# torch._scaled_grouped_mm (sm90, sm100) multiplies the groups of a torch._grouped_mm site, E4M3
# with one scale per row of each group (a per-tensor format's group scale repeated over its rows).
# The grouped layout pads every group's rows to whole 128-row blocks, so of each product's m, n
# and k only x's columns can miss its multiple of 16. Its Hopper kernel sums in the tensor cores'
# accumulator, never promoted to fp32, so it serves only the GEMMs a recipe lets accumulate fast;
# its padded products need passes of their own (the rows and columns un-padded, empty groups'
# weight gradients zeroed, the experts' weights made column-major), so it runs only where the
# Triton GEMM, which takes every pair it takes, is not installed.
NATIVE_GROUPED_GEMM = NativeGemm(
    "torch._scaled_grouped_mm fp8 rowwise",
    frozenset(itertools.product(grouped_operands.ROW_SCALED, repeat=2)),
    BOTH_E4M3,
    16,
    lambda sm: sm[0] in (9, 10) and hasattr(torch, "_scaled_grouped_mm"),
    fast_accumulation=True,
    promotes=False,
)
SCALED_GROUPED_MM = NATIVE_GROUPED_GEMM.backend
# In the order select_grouped tries them: the first that takes a GEMM runs it.
NATIVE_GROUPED_GEMMS = (WGMMA_GROUPED_GEMM, *TRITON_GROUPED_GEMMS, NATIVE_GROUPED_GEMM)
NATIVE_BY_NAME = {native.backend: native for native in (*NATIVE_GEMMS, *NATIVE_GROUPED_GEMMS)}


def grouped_unsupported(quantizer: Quantizer) -> Optional[str]:
    """Why ``quantizer`` cannot quantize a grouped_linear slot yet, or None if it can."""
    for child in dict.fromkeys(quantizer.child(direction) for direction in (ROWWISE, COLUMNWISE)):
        if not child.groupable:
            names = ", ".join(cls.__name__ for cls in quantizer_classes() if cls.groupable)
            return (
                f"{child} is not supported for torch._grouped_mm yet; use {names} (or a HybridQuantizer of them); a format "
                "of one's own takes it with groupable = True, each group quantized alone (Quantizer.quantize_groups)"
            )
    return None


def grouped_rowwise_traced(rowwise: Quantizer) -> bool:
    """Whether a grouped rowwise representation alone of this format is traced (stateless and
    deterministic: graphquant.ops.grouped.quantize_grouped), which Inductor then fuses with its
    producer, rather than made by the native grouped quantize."""
    return rowwise.traceable and not (rowwise.keeps_state or rowwise.stochastic)


def token_rows(x_quantizer: Quantizer, fprop_alone: bool) -> int:
    """The rows each group of a grouped site's few tokens is padded to a multiple of (the plan's,
    carried as Site.token_rows; many take GROUP_ROWS: formats.groups.token_block): FEW_TOKEN_ROWS
    for a site that runs fprop alone where x's rowwise format is traced and its blocks span no more
    rows (padding rows then changes no value: the zero rows raise no amax); GROUP_ROWS everywhere
    else, whose tiles the native grouped quantize and the columnwise blocks of training need."""
    rowwise = x_quantizer.child(ROWWISE)
    fits = rowwise.block(ROWWISE)[0] <= FEW_TOKEN_ROWS
    return FEW_TOKEN_ROWS if fprop_alone and grouped_rowwise_traced(rowwise) and fits else GROUP_ROWS


# Formats whose emulated values leave out a per-group or per-row factor (Quantizer.grouped_factor).
_FACTORED_FAMILIES = (*grouped_operands.ROW_SCALED, "nvfp4", "nvfp4_row_scaled")


def select_grouped(
    a: Quantizer, a_direction: str, b: Quantizer, b_direction: str, device: torch.device, k: Any, fast_accumulation: bool = False,
    token_tiles: bool = False, token_rows: int = GROUP_ROWS,
) -> Selection:
    """``select`` for a GEMM of a torch._grouped_mm site whose x has ``k`` columns (None where
    unknown; a torch.SymInt is tested on its symbol, as NativeGemm.misfit does): native on the
    first of NATIVE_GROUPED_GEMMS that multiplies the pair on ``device`` and may sum as the recipe
    lets this GEMM (``fast_accumulation``: the tensor cores' accumulator allowed) and, for one of
    tiles of few tokens alone (NativeGemm.token_tiles), whose tokens are such (``token_tiles``),
    for one of whole tiles alone (NativeGemm.whole_tiles), whose groups of tokens start at
    multiples of GROUP_ROWS (``token_rows``: formats.groups.token_block's); otherwise emulated,
    one grouped product."""
    selection = select(a, a_direction, b, b_direction, device)
    if selection.bucket == REJECTED or selection.backend.name == HIGH_PRECISION:
        return selection
    sm = capability(device)
    if sm is None:
        return Selection(EMULATED, GemmBackend(EMULATION), selection.reason)
    inputs = (a.gemm_input(a_direction), b.gemm_input(b_direction))
    reasons = []
    for native in NATIVE_GROUPED_GEMMS:
        if not native.takes(*inputs):
            reasons.append(f"{native.backend} does not multiply {a.direction_spec(a_direction)} by {b.direction_spec(b_direction)}")
        elif not native.runs_on(sm):
            reasons.append(f"{native.backend} does not run on sm_{sm[0]}{sm[1]}")
        elif not native.available(device):
            reasons.append(f"graphquant's extension does not run {native.backend} on {device}")
        elif k is not None and k % max(native.multiple, native.k_multiple) != 0:
            reasons.append(f"{native.backend} needs x's columns a multiple of {max(native.multiple, native.k_multiple)}; got {k}")
        elif not native.promotes and not fast_accumulation:
            reasons.append(
                f"{native.backend} sums in the tensor cores' accumulator, and the recipe keeps this GEMM's sums in fp32 "
                "(CustomRecipe.fast_accumulation)"
            )
        elif native.whole_tiles and token_rows != GROUP_ROWS:
            reasons.append(
                f"{native.backend} multiplies groups of tokens that start at multiples of {GROUP_ROWS} rows; this site's few "
                f"tokens an expert start at multiples of {token_rows} (backends.token_rows)"
            )
        elif native.token_tiles and not token_tiles:
            reasons.append(
                f"{native.backend} multiplies only tiles of few tokens an expert (more than one token a program takes) of a "
                f"graph's fprop alone, padded to {FEW_TOKEN_ROWS} rows (backends.token_rows)"
            )
        else:
            return Selection(NATIVE, GemmBackend(native.backend, native.accumulates_fast(*inputs, fast_accumulation)))
    reason = "; ".join(reasons)
    if not HAS_TRITON and any(i is not None and i.family in _FACTORED_FAMILIES for i in inputs):
        reason += "; without Triton, the fp32 product its scales need reads the group offsets on the host (torch._grouped_mm)"
    return Selection(EMULATED, GemmBackend(EMULATION), reason)


@functools.lru_cache(maxsize=4096)
def select(
    a: Quantizer,
    a_direction: str,
    b: Quantizer,
    b_direction: str,
    device: torch.device,
    dims: Optional[tuple[Optional[int], Optional[int], Optional[int]]] = None,
    batch: Optional[int] = 1,
    fast_accumulation: bool = False,
    quantize_a: bool = False,
) -> Selection:
    """Classify the pair for ``device``; ``dims`` is (m, n, k) of each group's out[m, n] = A @ B^T
    (None where unknown: ``select_symbolic`` tests symbolic ones), ``batch`` the number of groups.
    ``fast_accumulation``: the recipe lets this GEMM sum in the tensor cores' accumulator
    (CustomRecipe.fast_accumulation), which the per-tensor and per-row FP8 GEMMs then do.
    ``quantize_a``: A is quantized from a high-precision tensor for this GEMM alone (an inference
    linear's x), so a GEMM that quantizes it itself (NativeGemm.quantizes_a) may run it."""
    a_transform, b_transform = a.transform(a_direction), b.transform(b_direction)
    if a_transform != b_transform:
        if a_transform is None or b_transform is None:
            which, direction, transform = ("first", a_direction, a_transform) if a_transform else ("second", b_direction, b_transform)
            if a_direction == b_direction == COLUMNWISE:
                remedy = "give both operands the transform or neither (nvfp4_factory gives it to input and grad_output)"
            else:  # a format applies it to its columnwise side alone, which here meets a rowwise one
                remedy = (
                    f"the transform applies to a {COLUMNWISE} side alone, so it is right only where two meet (wgrad): "
                    "leave it off this tensor (a linear's weight; nvfp4_factory gives it to input and grad_output alone)"
                )
            reason = f"only the {which} operand (its {direction} side) went through {transform}, so the product would be wrong; {remedy}"
        else:
            reason = (
                f"its operands went through different transforms ({a}: {a_transform}; {b}: {b_transform}), which "
                "cancel in the product only where they are the same; give both operands the same one"
            )
        return Selection(REJECTED, GemmBackend(NONE), reason)
    if a.high_precision and b.high_precision:
        return Selection(NATIVE, GemmBackend(HIGH_PRECISION))
    sm = capability(device)
    if sm is None:
        return Selection(EMULATED, GemmBackend(EMULATION), f"no low-precision GEMM on {device.type}")
    a_input, b_input = a.gemm_input(a_direction), b.gemm_input(b_direction)
    k_last = _stored_k_last(a, a_direction) and _stored_k_last(b, b_direction)
    misfits = []  # a pair may have several native GEMMs (cuBLASLt's, then the decode GEMM): the first that fits runs
    # Why the decode GEMM does not quantize this A itself, said where it then multiplies A quantized first.
    refusal = triton_decode.quantize_on_load_refusal(a) if quantize_a and triton_decode is not None else ""
    for native in NATIVE_GEMMS:
        if native.quantizes_a and (not quantize_a or refusal):
            continue
        if native.runs_on(sm) and native.available(device) and native.takes(a_input, b_input):
            misfit = native.misfit(dims or (), batch, k_last, (a_input.family, b_input.family), (a_input.element, b_input.element), device)
            if not misfit:
                reason = f"x quantized first: {refusal}" if refusal and native.backend == triton_decode.BACKEND else ""
                return Selection(NATIVE, GemmBackend(native.backend, native.accumulates_fast(a_input, b_input, fast_accumulation)), reason)
            misfits.append(misfit)
    if misfits:
        return Selection(EMULATED, GemmBackend(EMULATION), "; ".join(misfits))
    if type(a) is not type(b):
        return Selection(EMULATED, GemmBackend(EMULATION), f"no GEMM multiplies {a.tag} by {b.tag}")
    pair = f"{a.direction_spec(a_direction)} x {b.direction_spec(b_direction)}"  # the fields decide it, not the tags alone
    return Selection(EMULATED, GemmBackend(EMULATION), f"no native {pair} GEMM on sm_{sm[0]}{sm[1]}")


def select_symbolic(
    a: Quantizer,
    a_direction: str,
    b: Quantizer,
    b_direction: str,
    device: torch.device,
    sizes: Sequence[Any],
    batch: Optional[int] = 1,
    fast_accumulation: bool = False,
    quantize_a: bool = False,
) -> Selection:
    """``select`` for (m, n, k) ``sizes`` of which some may be symbolic (torch.SymInt, dynamic
    shapes): where the pair has a native GEMM, it is tested on the symbols, so the choice holds for
    every size the compiled graph runs (NativeGemm.misfit)."""
    static = tuple(d if isinstance(d, int) else None for d in sizes)
    selection = select(a, a_direction, b, b_direction, device, static, batch, fast_accumulation, quantize_a)
    native = selection.backend.native
    inputs = (a.gemm_input(a_direction), b.gemm_input(b_direction)) if native is not None else ()
    families, elements = tuple(i.family for i in inputs), tuple(i.element for i in inputs)
    misfit = native.misfit(sizes, batch, True, families, elements, device) if native is not None and None in static else ""
    return Selection(EMULATED, GemmBackend(EMULATION), misfit) if misfit else selection


class GemmMismatch(RuntimeError):
    """A GEMM call that the backend its plan chose cannot run."""


@functools.lru_cache(maxsize=4096)
def _refusal(
    native: NativeGemm, a: Quantizer, a_direction: str, b: Quantizer, b_direction: str, device: torch.device, dims: tuple, batch: int
) -> str:
    """Why ``native`` cannot multiply the pair on ``device`` as ``batch`` products of ``dims``, or
    "" where it can; cached, as select's choices are, so that a GEMM call pays one lookup."""
    sm = capability(device)
    if sm is None or not native.runs_on(sm):
        return f"it does not run on {device.type if sm is None else f'sm_{sm[0]}{sm[1]}'}"
    if not native.available(device):
        return f"graphquant's extension does not run it on {device}"
    if not native.takes(a.gemm_input(a_direction), b.gemm_input(b_direction)):
        return f"it does not multiply {a.direction_spec(a_direction)} by {b.direction_spec(b_direction)}"
    inputs = (a.gemm_input(a_direction), b.gemm_input(b_direction))
    k_last = _stored_k_last(a, a_direction) and _stored_k_last(b, b_direction)
    return native.misfit(dims, batch, k_last, tuple(i.family for i in inputs), tuple(i.element for i in inputs), device)


def clear_caches() -> None:
    """Forget what was worked out per device (select's choices, gemm's checks), for a test that
    fakes a compute capability."""
    select.cache_clear()
    _refusal.cache_clear()


def _stored_k_last(quantizer: Quantizer, direction: str) -> bool:
    """Representation.stored_k_last of what ``quantizer`` makes for ``direction``."""
    return quantizer.transposed(direction) == (direction == COLUMNWISE)


def checked(
    backend: GemmBackend, a: Representation, b: Representation, dims: tuple, batch: int, site: str, natives: Sequence[NativeGemm]
) -> Optional[NativeGemm]:
    """The native GEMM that runs a call of the GEMM ``site`` names ("fc1#0 dgrad") on ``backend``,
    the plan's choice, or None where it runs the emulated GEMM. ``dims``: (m, n, k) of each of
    ``batch`` products; ``natives``: the native GEMMs the caller runs (NATIVE_GEMMS, or
    NATIVE_GROUPED_GEMMS for a grouped call). A call the backend cannot run (its plan was made for
    other shapes, another device or another site) raises GemmMismatch rather than run another backend."""
    native = backend.native
    if native is None:
        if backend.name == NONE:
            raise GemmMismatch(f"{site}: the plan rejected this GEMM ({a.quantizer} x {b.quantizer}); it cannot run")
        if backend.name in ATTENTION_KERNELS:
            raise GemmMismatch(f"{site}: its plan chose {backend}, which runs the attention's products itself, not as GEMM calls")
        return None
    if native not in natives:
        names = ", ".join(n.backend for n in natives)
        raise GemmMismatch(
            f"{site}: its plan chose {backend}, but this call runs {names} or the emulated GEMM; the plan was made for another site"
        )
    on_load = triton_decode is not None and isinstance(a, triton_decode.QuantizedOnLoad)
    if native.quantizes_a != on_load and not (native.quantizes_a and triton_decode.quantizes_first(a.quantizer)):
        given, taken = ("quantized", "in high precision, to quantize it itself") if native.quantizes_a else ("in high precision", "quantized")
        raise GemmMismatch(f"{site}: its plan chose {backend}, which takes A {taken}, but this call gives A {given}")
    refusal = _refusal(native, a.quantizer, a.direction, b.quantizer, b.direction, a.data.device, dims, batch)
    if refusal:
        raise GemmMismatch(
            f"{site}: its plan chose {backend}, which cannot run this call ({batch} x (m, n, k) = {dims}, "
            f"{a.quantizer.direction_spec(a.direction)} x {b.quantizer.direction_spec(b.direction)} on "
            f"{a.data.device}): {refusal}; the plan was made for other shapes or another device"
        )
    return native


def gemm(
    a: Representation,
    b: Representation,
    batch: int,
    out_dtype: torch.dtype,
    backend: GemmBackend,
    site: str,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """(batch, m, n): out[g] = A[g] @ B[g]^T (+ bias, one group only) on ``backend``, the plan's
    choice for the GEMM ``site`` names ("fc1#0 dgrad"), as ``checked`` admits it (A a
    triton_decode.QuantizedOnLoad where the backend quantizes A itself, or the codes of the kernel
    it quantizes A with first, triton_decode.quantizes_first); every backend adds the
    bias before rounding to out_dtype."""
    _check_operands(a, b, batch, site, bias)
    native = checked(backend, a, b, gemm_dims(a, b, batch), batch, site, NATIVE_GEMMS)
    if native is None:
        return emulation.gemm(a, b, batch, out_dtype, bias)
    if native in DECODE_GEMMS:
        return triton_decode.gemm(a, b, out_dtype, bias).unsqueeze(0)
    if native is MIXED_INPUT_GEMM:
        return mixed_input.gemm(a, b, out_dtype, bias).unsqueeze(0)
    if native is BLOCK_SCALED_GEMM:
        return block_scaled.gemm(a, b, out_dtype, bias).unsqueeze(0)
    return scaled_mm.run(backend, a, b, out_dtype, bias).unsqueeze(0)


def mixed_input_gemm(
    values: torch.Tensor, a_amax: Optional[torch.Tensor], bs: Sequence[Representation], out_dtype: torch.dtype, sites: Sequence[str],
    biases: Sequence[Optional[torch.Tensor]], stored_weight: bool = False,
) -> list[torch.Tensor]:
    """[(m, n_i) = A @ B_i^T (+ bias_i)] on the mixed-input GEMM the plan chose for the GEMMs
    ``sites`` names, one launch for all (weights that read one x: passes/gemms_sharing_x.py), A
    given as its values in the kernel's order (``mixed_input.operand_of_x`` or
    ``mixed_input.operand``) and NVFP4's global amax; the B's frozen weights where ``stored_weight``."""
    for b, site, bias in zip(bs, sites, biases, strict=True):
        _check_bias(b, 1, site, bias)
    if not MIXED_INPUT_GEMM.available(values.device):
        whose = "its" if len(sites) == 1 else "their"
        raise GemmMismatch(
            f"{', '.join(sites)}: {whose} plan chose {mixed_input.BACKEND}, which needs graphquant's extension built for sm_90a and an "
            f"sm_90 GPU; this call runs on {values.device}; the plan was made for another device"
        )
    return mixed_input.multiply(values, a_amax, bs, out_dtype, biases, stored_weight=stored_weight)


def gemms_sharing_a(
    a: Representation,
    bs: Sequence[Representation],
    out_dtype: torch.dtype,
    backend: GemmBackend,
    sites: Sequence[str],
    biases: Sequence[Optional[torch.Tensor]],
) -> list[torch.Tensor]:
    """[(1, m, n) = A @ B^T (+ bias)] for each B, bias and the GEMM its site names, GEMMs that
    read one A and that the graph runs in one launch of the decode GEMM
    (triton_decode.gemms_sharing_a; passes/gemms_sharing_x.py), ``backend`` the plan's choice for
    each, every call checked as ``gemm`` checks it."""
    for b, site, bias in zip(bs, sites, biases, strict=True):
        _check_operands(a, b, 1, site, bias)
        native = checked(backend, a, b, gemm_dims(a, b, 1), 1, site, NATIVE_GEMMS)
        if native not in DECODE_GEMMS:
            raise GemmMismatch(f"{site}: GEMMs that share a launch run on the decode GEMM; its plan chose {backend}")
    return [out.unsqueeze(0) for out in triton_decode.gemms_sharing_a(a, bs, out_dtype, biases)]


def _check_operands(a: Representation, b: Representation, batch: int, site: str, bias: Optional[torch.Tensor]) -> None:
    """A and B reduce over one extent (a native kernel would read past the shorter), and the bias
    fits the output."""
    k, b_k = (reduced_extent(r.direction, r.shape, batch) for r in (a, b))
    if k != b_k:
        raise ValueError(
            f"{site}: A @ B^T needs A and B to reduce over one extent; A {a.direction} of shape {tuple(a.shape)} "
            f"({a.quantizer.direction_spec(a.direction)}) reduces over {k}, B {b.direction} of shape {tuple(b.shape)} "
            f"({b.quantizer.direction_spec(b.direction)}) over {b_k}, in {batch} group(s)"
        )
    _check_bias(b, batch, site, bias)


def _check_bias(b: Representation, batch: int, site: str, bias: Optional[torch.Tensor]) -> None:
    n = output_rows(b.direction, b.shape, batch)
    if bias is not None and (batch != 1 or bias.shape != (n,)):
        raise ValueError(
            f"{site}: a GEMM's bias must have the shape ({n},) of its output's last dim, and the GEMM one group; "
            f"got a bias of shape {tuple(bias.shape)} for {batch} group(s)"
        )


def select_attention(
    device: torch.device, qkv: Quantizer, s: Quantizer, head_dims: tuple[int, int], masked: bool, backward: bool = False,
    do: Optional[Quantizer] = None, dp: Optional[Quantizer] = None, *, query_length: Any, key_length: Any,
) -> Selection:
    """How FP8 attention's forward (or, with ``backward``, its backward, whose do and dp formats
    it then takes) runs on ``device`` for the site's qkv and s formats, its (query/key, value) head
    dims, whether it has an arbitrary mask (causal is not one) and its query and key lengths
    (torch.SymInts where dynamic: their tests become guards of the graph). The FP8 flash
    forward (graphquant.kernels.triton_attention) runs per-tensor E4M3 qkv and s, causal or
    unmasked, head dim 64 or 128, on Hopper where Triton is installed; its Gluon twin
    (graphquant.kernels.gluon_attention: the same bits, faster there under either mask) runs it
    instead where Triton has Gluon and the key length is a multiple of GLUON_LENGTH_MULTIPLE, else
    the Triton forward does and says why. The backward is the FP8 flash backward where s and do are
    per-tensor FP8 and dp per-tensor FP8 under delayed scaling (P's and dS's scales known before
    the kernel sees them: P's is its bound's, softmax_output_format): the Gluon one
    (graphquant.kernels.gluon_attention_backward, the Triton backward's bits but for the order of dQ's atomic adds) under either mask where Triton has Gluon
    and both lengths are multiples of GLUON_LENGTH_MULTIPLE, else the Triton one
    (graphquant.kernels.triton_attention_backward), which says why; else it recomputes S and P
    through the emulation."""
    why = _no_flash_attention(device, qkv, s, head_dims, masked)
    if why:
        return Selection(EMULATED, GemmBackend(ATTENTION_EMULATION), f"{why}: S and P materialised")
    if backward:
        why = flash_backward_refusal(s, do, dp)
        if why:
            return Selection(EMULATED, GemmBackend(ATTENTION_EMULATION), f"{why}: S and P recomputed and materialised")
        return _gluon_or_triton("backward", {"query": query_length, "key": key_length})
    return _gluon_or_triton("forward", {"key": key_length})


def _gluon_or_triton(kernel: str, lengths: dict[str, Any]) -> Selection:
    """The Gluon ``kernel`` (forward or backward) where Triton has Gluon and ``lengths`` (what each
    is the length of) are multiples of GLUON_LENGTH_MULTIPLE, else the Triton one, saying why."""
    if not HAS_GLUON:
        return Selection(NATIVE, GemmBackend(FLASH_ATTENTION), f"the Gluon {kernel} needs Triton with Gluon (triton.experimental.gluon)")
    for what, length in lengths.items():
        if length % GLUON_LENGTH_MULTIPLE != 0:
            return Selection(
                NATIVE, GemmBackend(FLASH_ATTENTION), f"the Gluon {kernel} takes {what} lengths that are multiples of {GLUON_LENGTH_MULTIPLE}, not {length}"
            )
    return Selection(NATIVE, GemmBackend(GLUON_FLASH_ATTENTION))


def flash_backward_refusal(s: Quantizer, do: Optional[Quantizer], dp: Optional[Quantizer]) -> str:
    """Why the FP8 flash backward cannot run where the flash forward runs ('' where it can)."""
    for slot, quantizer, delayed in (("s", s, False), ("dp", dp, True), ("do", do, False)):
        if quantizer is None:
            return f"the FP8 flash backward needs the {slot} format"
        rowwise = quantizer.gemm_input(ROWWISE)
        per_tensor = rowwise.family == PER_TENSOR_E4M3.family and quantizer.gemm_input(COLUMNWISE) == rowwise and quantizer.columnwise_is_rowwise_transposed()
        if not per_tensor or (delayed and not quantizer.kernel_encoding(ROWWISE).delayed_scaling):
            needs = "per-tensor FP8 under delayed scaling" if delayed else "per-tensor FP8"
            return f"the FP8 flash backward takes {needs} {slot}, not {quantizer}"
    return ""


PER_TENSOR_E4M3 = GemmInput("fp8_tensorwise", "e4m3")
# The largest value of attention's P: a softmax output is a probability.
P_BOUND = 1.0


def softmax_output_format(quantizer: Quantizer) -> Quantizer:
    """The format P takes for the s slot's ``quantizer``: the built-in per-tensor ones (current or
    delayed scaling) become current scaling with the amax floored at P_BOUND, which for P is the
    scale of an amax of 1 at every call, with no state (a scale carried between calls saturates P
    after calls of another shape: graphquant.ops.attention); any other format scales P as it
    does, if it keeps no state (ValueError if it does)."""
    if type(quantizer) is Float8CurrentScalingQuantizer:
        return dataclasses.replace(quantizer, amax_epsilon=max(quantizer.amax_epsilon, P_BOUND), with_amax_reduction=False)
    if type(quantizer) is Float8DelayedScalingQuantizer:
        return Float8CurrentScalingQuantizer(fp8_dtype=quantizer.fp8_dtype, amax_epsilon=P_BOUND)
    if quantizer.keeps_state:
        raise ValueError(
            f"the s slot takes a format that keeps no state (P, at most 1, is scaled by that bound or by its own amax at "
            f"every call), not {quantizer}: give it Float8DelayedScalingQuantizer or Float8CurrentScalingQuantizer (both "
            "scaled as an amax of 1), MXFP8, or a stateless format of your own"
        )
    return quantizer


def _no_flash_attention(device, qkv: Quantizer, s: Quantizer, head_dims: tuple[int, int], masked: bool) -> str:
    """Why the FP8 flash forward cannot run this attention ('' where it can)."""
    sm = capability(device)
    if sm is None or sm[0] != 9:
        return f"the FP8 flash-attention kernel runs on Hopper (sm_90), not {device.type if sm is None else f'sm_{sm[0]}{sm[1]}'}"
    if not HAS_TRITON:
        return "the FP8 flash-attention kernel needs Triton, which is not installed"
    for slot, quantizer in (("qkv", qkv), ("s", s)):
        if quantizer.gemm_input(ROWWISE) != PER_TENSOR_E4M3:
            return f"the FP8 flash-attention kernel takes per-tensor E4M3 {slot}, not {quantizer}"
    if masked:
        return "the FP8 flash-attention kernel takes causal or no masks, not an attn_mask"
    if head_dims[0] != head_dims[1] or head_dims[0] not in FLASH_HEAD_DIMS:
        return f"the FP8 flash-attention kernel takes one head dim of {FLASH_HEAD_DIMS}, not {head_dims}"
    return ""
