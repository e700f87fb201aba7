"""What kernels need to know of a format, as values the format answers: how GEMM kernels read a
direction of it (GemmInput) and how graphquant's native quantize kernels encode it
(KernelEncoding). Neither knows a quantizer class: graphquant.kernels reads them instead."""

from __future__ import annotations

import dataclasses


# The layout families of GemmInput: each names a layout of codes and scales that GEMM kernels
# (cuBLASLt's, and the emulated GEMM's dequantize kernels) are written for;
# graphquant.kernels.backends says which native GEMM takes which pair of them on which device.
GEMM_FAMILIES = (
    "fp8_tensorwise",  # FP8 codes and one float32 decode scale
    "fp8_rowwise",  # FP8 codes and one float32 decode scale per GEMM row
    "fp8_block_1x128",  # FP8 codes, float32 decode scales per 128 along the reduction, outer-dim-major
    "fp8_block_128x128",  # FP8 codes, float32 decode scales per 128x128 tile
    "mxfp8",  # FP8 codes, E8M0 scales per 32 along the reduction
    "nvfp4",  # packed E2M1 codes, E4M3 scales per 16 along the reduction, a float32 global amax
    "nvfp4_row_scaled",  # nvfp4 with a global amax per GEMM row, which no GEMM takes as its alpha
)
ELEMENTS = ("e4m3", "e5m2", "e2m1")


@dataclasses.dataclass(frozen=True)
class GemmInput:
    """How GEMM kernels read one direction of a format: the family of its layout (one of
    GEMM_FAMILIES; a native one stored as graphquant.kernels.scaled_mm passes it to cuBLASLt)
    and the encoding of its elements (one of ELEMENTS)."""

    family: str
    element: str

    def __post_init__(self) -> None:
        if self.family not in GEMM_FAMILIES:
            raise ValueError(f"GemmInput.family must be one of {GEMM_FAMILIES}, got {self.family!r}")
        if self.element not in ELEMENTS:
            raise ValueError(f"GemmInput.element must be one of {ELEMENTS}, got {self.element!r}")


# What one scale covers in the native quantize kernels' encodings (KernelEncoding.scaling).
SCALINGS = (
    "tensor",  # one float32 scale for the tensor
    "row",  # one float32 scale per stored row (a column of x, columnwise)
    "block",  # one float32 scale per block
    "mxfp8",  # one E8M0 scale per 32 elements
    "nvfp4",  # one E4M3 scale per 16 elements (or 16x16) under a float32 global amax
)
# The blocks each scaling's kernel encodes, as (rows, cols) in the direction's logical orientation.
_KERNEL_BLOCKS = {
    "tensor": {(0, 0)},
    "row": {(1, -1), (-1, 1)},
    "block": {(1, n) for n in (16, 32, 64, 128)} | {(n, 1) for n in (16, 32, 64, 128)} | {(128, 128)},
    "mxfp8": {(1, 32), (32, 1)},
    "nvfp4": {(1, 16), (16, 1), (16, 16)},
}


@dataclasses.dataclass(frozen=True)
class KernelEncoding:
    """How graphquant's native quantize kernels (csrc/cuda's tile program) encode one direction of
    a format. graphquant.kernels.native hands the fields to the C++ ``Encoding`` by name, so a
    format of the user's own that answers ``Quantizer.kernel_encoding`` quantizes natively too.

    scaling: what one scale covers (one of SCALINGS); element: the code (one of ELEMENTS);
    block: the (rows, cols) a scale covers in the direction's logical orientation, as
    ``Quantizer.block`` says; transposed: the data is stored (cols, rows);
    delayed_scaling: the scale is the slot's current one (QuantizeContext.scale), not made from
    this tensor's amax; amax_epsilon, pow2_scales: the FP8 scale rule's floor and power-of-two
    rounding; hadamard, random_sign_mask, stochastic_rounding, row_scaled: NVFP4's random Hadamard
    transform (and its random signs), stochastic rounding, and a global amax per row.
    """

    scaling: str
    element: str
    block: tuple[int, int] = (0, 0)
    transposed: bool = False
    delayed_scaling: bool = False
    amax_epsilon: float = 0.0
    pow2_scales: bool = False
    hadamard: bool = False
    random_sign_mask: bool = False
    stochastic_rounding: bool = False
    row_scaled: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "block", tuple(self.block))
        if self.scaling not in SCALINGS:
            raise ValueError(f"KernelEncoding.scaling must be one of {SCALINGS}, got {self.scaling!r}")
        fp4 = self.scaling == "nvfp4"
        elements = ("e2m1",) if fp4 else ("e4m3", "e5m2")
        if self.element not in elements:
            raise ValueError(f"KernelEncoding: {self.scaling} scaling encodes {' or '.join(elements)} elements, got {self.element!r}")
        blocks = _KERNEL_BLOCKS[self.scaling]
        if self.block not in blocks:
            raise ValueError(f"KernelEncoding: the kernels encode {self.scaling} scaling in blocks of {sorted(blocks)}, got {self.block}")
        if self.delayed_scaling and self.scaling != "tensor":
            raise ValueError(f"KernelEncoding: delayed_scaling is per-tensor FP8's, not {self.scaling} scaling's")
        if self.scaling in ("mxfp8", "nvfp4") and (self.amax_epsilon or self.pow2_scales):
            raise ValueError(f"KernelEncoding: {self.scaling} has its own scale rule; amax_epsilon and pow2_scales are FP8's")
        options = ("hadamard", "random_sign_mask", "stochastic_rounding", "row_scaled")
        if not fp4 and any(getattr(self, name) for name in options):
            raise ValueError(f"KernelEncoding: {', '.join(options)} are NVFP4's, not {self.scaling} scaling's")
        if self.random_sign_mask and not self.hadamard:
            raise ValueError("KernelEncoding: random_sign_mask is the Hadamard transform's; set hadamard too")

    def __repr__(self) -> str:
        """The scaling, the element and the fields that differ from their defaults."""
        rest = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)[2:] if getattr(self, f.name) != f.default]
        return f"KernelEncoding({', '.join([repr(self.scaling), repr(self.element), *rest])})"
