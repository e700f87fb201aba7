"""Quantizers: frozen, hashable, printable descriptions of a format (see base.py for the contract).

The traceable ones compute their scales through graphquant's exact scale ops
(torch.ops.graphquant.fp8_scales and e8m0_scales, defined in graphquant.ops.scales and registered
on importing graphquant), so that a quantize traced into a graph keeps each division one node;
FP8's power-of-two scales, a tensor's one and those of blocks along rows as plain ops that keep
their bits compiled (float8.traced_scales).
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
