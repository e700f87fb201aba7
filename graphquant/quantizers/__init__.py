"""Quantizers: frozen, hashable, printable descriptions of a format (see base.py for the contract).

The traceable ones compute their scales so that a graph compiler fusing them into the quantize
cannot change a bit: FP8's as plain ops that compile exactly (float8.traced_scales: integer ops on
the amax's bits for power-of-two scales, float64 divisions for the others), MXFP8's through the op
torch.ops.graphquant.e8m0_scales (defined in graphquant.ops.scales, registered on importing
graphquant).
"""

from graphquant.quantizers.base import (
    COLUMNWISE,
    ROWWISE,
    STREAMS_PER_STEP,
    QuantizeContext,
    QuantizedTensor,
    Quantizer,
    Representation,
    gemm_dims,
    mistyped_fields,
    output_rows,
    reduced_extent,
    parse_spec,
    quantizer_classes,
    quantizer_of,
    undeclared_fields,
    unspecced_fields,
)
from graphquant.quantizers.block import Float8BlockQuantizer
from graphquant.quantizers.descriptions import GEMM_FAMILIES, SCALINGS, GemmInput, KernelEncoding
from graphquant.quantizers.float8 import (
    DelayedScalingRequest,
    Float8CurrentScalingQuantizer,
    Float8DelayedScalingQuantizer,
)
from graphquant.quantizers.hybrid import HybridQuantizer
from graphquant.quantizers.identity import IdentityQuantizer
from graphquant.quantizers.mxfp8 import MXFP8Quantizer
from graphquant.quantizers.nvfp4 import NVFP4Quantizer
from graphquant.quantizers.rowwise import Float8RowwiseQuantizer

__all__ = [
    "COLUMNWISE",
    "GEMM_FAMILIES",
    "ROWWISE",
    "SCALINGS",
    "STREAMS_PER_STEP",
    "DelayedScalingRequest",
    "Float8BlockQuantizer",
    "Float8CurrentScalingQuantizer",
    "Float8DelayedScalingQuantizer",
    "Float8RowwiseQuantizer",
    "GemmInput",
    "HybridQuantizer",
    "IdentityQuantizer",
    "KernelEncoding",
    "MXFP8Quantizer",
    "NVFP4Quantizer",
    "QuantizeContext",
    "QuantizedTensor",
    "Quantizer",
    "Representation",
    "gemm_dims",
    "mistyped_fields",
    "output_rows",
    "reduced_extent",
    "parse_spec",
    "quantizer_classes",
    "quantizer_of",
    "undeclared_fields",
    "unspecced_fields",
]
