"""MXFP8 and NVFP4 GEMMs on Hopper's bf16 tensor cores, the weight decoded in registers.

Hopper has no tensor core for either format, so the emulation dequantizes the whole weight to
bf16 at every call and multiplies it by cuBLAS, and Triton's decode GEMM waits for its own
decoding before each product. graphquant._C.mixed_gemm (csrc/cuda/mixed_gemm.cu) decodes the next
K step of each warpgroup's weight rows while this step's wgmmas run, reading the weight once, as
stored; x's values come in bf16, in the order the kernel reads (graphquant::mixed_input_gemms):
in inference made from x by one op (``operand_of_x``, graphquant::mixed_input_operand), else from
x's representation by torch ops (``operand``).
The numerics are the emulation's (graphquant.kernels.emulation): exact bf16 values, fp32 sums,
NVFP4's global factors as alpha (made in the kernel from the amaxes, so that a call launches
nothing for it), the bias before the one rounding.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from graphquant.formats import fp8, mxfp8, nvfp4
from graphquant.kernels import arrival_counters, native
from graphquant.kernels.native import has_sm90_kernel
from graphquant.quantizers import ROWWISE, QuantizeContext, Quantizer, Representation
from graphquant.quantizers.descriptions import KernelEncoding

BACKEND = "wgmma mixed-input gemm"
FORMATS = {"mxfp8": 0, "nvfp4": 1}  # GemmInput.family -> the extension's format number
K_MULTIPLE = 128  # the K the kernel multiplies a pipeline step (or two): k must be a multiple
PLANNED_FAMILIES = frozenset((family, family) for family in FORMATS)
ELEMENTS = frozenset({("e4m3", "e4m3"), ("e2m1", "e2m1")})
# The rows of A the plan gives it, (fewest, most) a format (benchmarks/NOTES.md, decode_gemm.py):
# from 2 (to 16 rows both it, in tiles of 16 tokens, and the decode GEMM run one tile of rows, and
# it was the faster for both formats); one row stays on the decode GEMM's FMA program. To 1024:
# from 2048 the emulation's bf16 GEMM was as fast, the products setting the pace.
ROWS = {"mxfp8": (2, 1024), "nvfp4": (2, 1024)}
# The rows of A a CTA may multiply: a small tile where m is small, since its wgmmas are shorter and
# x's bf16 values fill less of each stage (a 16-token tile ran 1.2x faster than a 64-token one at 16 rows).
TOKENS = (16, 32, 64, 128, 256)
WEIGHT_ROWS = 128  # of an output tile, a CTA's (mixed_gemm.cu's ROWS): a K split counts arrivals one a tile
# The most GEMMs reading one x a launch runs (mixed_gemm.cu's GEMMS): a layer's q, k and v, or its
# gate and up (passes/gemms_sharing_x.py).
SHARED_LAUNCH = 3
ATOM = 64  # the K whose order the kernel permutes as one piece (DIGITS)
# The rowwise encodings of x whose values one op makes from x (graphquant::mixed_input_operand; on
# CUDA one kernel, triton_mixed_operand): MXFP8's E4M3 in 1x32 blocks, NVFP4's E2M1 in 1x16 blocks
# from one global amax (not row-scaled, transformed or rounded stochastically).
X_ENCODINGS = frozenset({KernelEncoding("mxfp8", "e4m3", block=(1, mxfp8.BLOCK_LEN)), KernelEncoding("nvfp4", "e2m1", block=(1, nvfp4.BLOCK_LEN))})


def extension_runs(device: torch.device) -> bool:
    """Whether graphquant's extension runs the kernel on ``device`` (built for its sm_90: sm_90a, wgmma)."""
    return has_sm90_kernel(native.extension_for(device), "mixed_gemm")


# Where the kernel reads x's value of K offset k within its 64-wide atom (mixed_gemm.cu): thread t
# of a quad decodes the weight's K 16t..16t+15, which the wgmma's register fragment holds at columns
# 2t, 2t+1, 2t+8, 2t+9 of each k16 slice, a bf16 pair the two values one decoding step makes
# (MXFP8's bytes (0 2)(1 3) of a word, NVFP4's nibbles (0 4)(1 5)... of a word). So K = 16t + 4a +
# 2b + c lies at 16a + 8c + 2t + b for MXFP8, K = 16t + 8d + 4e + f at 16f + 8d + 2t + e for NVFP4:
# a reordering of K's digits (their sizes as the atom's view, then their order where they go), which
# a graph writes as a permute.
DIGITS = {"mxfp8": ((4, 4, 2, 2), (1, 3, 0, 2)), "nvfp4": ((4, 2, 2, 4), (3, 1, 0, 2))}


def operand(a: Representation) -> torch.Tensor:
    """x's values as the kernel reads them: the emulation's (bf16, exact: E4M3 times E8M0, E2M1
    times E4M3), each 64-wide atom permuted; torch ops, which Inductor compiles with the graph's
    other pointwise work rather than a kernel of the extension's of their own."""
    return atoms_permuted(a.quantizer.emulated_values(a).to(torch.bfloat16), _family(a))


def values_from_x(quantizer: Quantizer) -> bool:
    """Whether x's values for an x that ``quantizer`` (x's) encodes rowwise are made from x by
    one op, graphquant::mixed_input_operand (``operand_of_x``), rather than from its representation."""
    return quantizer.kernel_encoding(ROWWISE) in X_ENCODINGS and not quantizer.reduces_amax


def x_amax(x: torch.Tensor, quantizer: Quantizer) -> Optional[torch.Tensor]:
    """What ``operand_of_x`` takes of x besides x: NVFP4's global amax, none for MXFP8. Taken as
    fp8.tensor_amax takes it (nvfp4.global_amax's number: max is exact in any order), row maxima
    first, which Inductor fuses into x's producer (a SwiGLU's kernel) where a flat amax is a
    reduction of its own that reads x again."""
    return fp8.tensor_amax(x) if quantizer.kernel_encoding(ROWWISE).scaling == "nvfp4" else None


def operand_of_x(x: torch.Tensor, amax: Optional[torch.Tensor], quantizer: Quantizer) -> torch.Tensor:
    """``operand`` of 2-D ``x`` quantized rowwise by ``quantizer`` (NVFP4's from ``x_amax``)."""
    rep = quantizer.quantize_rowwise(x, QuantizeContext()) if amax is None else quantizer.quantize_from_amax(x, amax, ROWWISE)
    return operand(rep)


def atoms_permuted(values: torch.Tensor, family: str) -> torch.Tensor:
    """``values`` (m, k) with each 64-wide atom in the order the kernel reads ``family``'s x (DIGITS)."""
    m, k = values.shape
    sizes, order = DIGITS[family]
    return values.reshape(m, k // ATOM, *sizes).permute(0, 1, *(2 + d for d in order)).reshape(m, k)


def _family(rep: Representation) -> str:
    return rep.quantizer.gemm_input(rep.direction).family


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def gemm(
    a: Representation, b: Representation, out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None, tokens: int = 0, splits: int = 0
) -> torch.Tensor:
    """out (m, n) = A @ B^T (+ bias) for A and B of one format (MXFP8 or NVFP4, rowwise, the
    reduction dim last), B the weight. ``tokens``: rows of A a CTA multiplies (one of TOKENS; 0:
    the fewest that hold m, up to 256); ``splits``: K's split (0: the extension's choice for the SMs)."""
    if _family(a) != _family(b):
        raise ValueError(f"{BACKEND} multiplies MXFP8 by MXFP8 or NVFP4 by NVFP4, not {_family(a)} by {_family(b)}")
    (out,) = multiply(operand(a), a_amax(a), [b], out_dtype, [bias], tokens, splits)
    return out


def a_amax(a: Representation) -> Optional[torch.Tensor]:
    """The amax of A that the product's alpha takes: NVFP4's global one (a factor a row is another
    family, nvfp4_row_scaled), none for MXFP8."""
    return a.amax if _family(a) == "nvfp4" else None


def multiply(
    values: torch.Tensor, a_amax: Optional[torch.Tensor], bs: Sequence[Representation], out_dtype: torch.dtype,
    biases: Optional[Sequence[Optional[torch.Tensor]]] = None, tokens: int = 0, splits: int = 0, stored_weight: bool = False,
) -> list[torch.Tensor]:
    """[(m, n_i) = A @ B_i^T (+ bias_i)] for one to SHARED_LAUNCH weights of one format, in one
    launch; A given as ``operand(A)`` and its ``a_amax``; as ``gemm``. The launch lays their row
    tiles side by side and splits K for all of them together (``splits``), so each product has the
    bits of one GEMM over the B's stacked. ``stored_weight``: no kernel writes
    the B's (a frozen model's weights), so the kernel, a dependent launch, copies their first steps
    before the kernel before it has finished (mixed_gemm.cu)."""
    biases = [None] * len(bs) if biases is None else list(biases)
    if not 1 <= len(bs) <= SHARED_LAUNCH or len(biases) != len(bs):
        raise ValueError(f"{BACKEND} runs 1 to {SHARED_LAUNCH} weights that read one A a launch, each with its bias or None; got {len(bs)} and {len(biases)} biases")
    family = _family(bs[0]) if len({_family(b) for b in bs}) == 1 else None
    if family not in FORMATS:
        raise ValueError(f"{BACKEND} multiplies MXFP8 or NVFP4 weights, all of one format, not {[str(b.quantizer) for b in bs]}")
    if (a_amax is None) != (family != "nvfp4"):
        raise ValueError(f"{BACKEND}: NVFP4 products take A's global amax, MXFP8 products none; got {bs[0].quantizer} and a_amax {a_amax}")
    ext = native.extension_for(bs[0].data.device)
    m = values.shape[0]
    tokens = tokens or next(t for t in TOKENS if t >= m or t == TOKENS[-1])
    tiles = sum(-(-b.data.shape[0] // WEIGHT_ROWS) for b in bs) * -(-m // tokens)
    return ext.mixed_gemm(
        values, [_bytes(b.data) for b in bs], [_scale_bytes(b, family) for b in bs], FORMATS[family],
        None if a_amax is None else a_amax.float(), [b.amax.float() if family == "nvfp4" else None for b in bs], nvfp4.GLOBAL_DIVISOR,
        biases, out_dtype, tokens, splits, arrival_counters.zeroed(values.device, tiles), stored_weight,
    )


def _scale_bytes(b: Representation, family: str) -> torch.Tensor:
    """B's block scales as the kernel copies them: as each format's representation lays them
    (MXFP8's block-major, NVFP4's row-major), by TMA, whose rows must be 16-byte aligned."""
    w_scale = _bytes(b.scale).t() if family == "mxfp8" else _bytes(b.scale)
    if w_scale.stride(1) != 1 or w_scale.stride(0) % 16 or w_scale.data_ptr() % 16:
        rows, cols = w_scale.shape
        padded = torch.empty(rows, -(-cols // 16) * 16, dtype=torch.uint8, device=w_scale.device)
        w_scale = padded[:, :cols].copy_(w_scale)
    return w_scale
