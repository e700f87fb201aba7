"""graphquant: fine-grained FP8 / MXFP8 / NVFP4 for any PyTorch model, through torch.compile.

    model = graphquant.compile(model, recipe)
"""

from importlib import metadata as _metadata

import torch  # noqa: F401  (the native extension links against torch's libraries)

from graphquant import factories, recipes, zoo
from graphquant.compiler import RecompileLimitError, compile
from graphquant.ops.functional import MixedDtypesError
from graphquant.explainer import explain
from graphquant.freezing import FrozenExperts, FrozenLinear, freeze
from graphquant.ops import library as _library, scales as _scales  # noqa: F401  (registers the custom ops)
from graphquant.numerics_report import numerics
from graphquant.passes.plan import Plan, PlanError
from graphquant.quantizers import (
    DelayedScalingRequest,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8DelayedScalingQuantizer,
    Float8RowwiseQuantizer,
    HybridQuantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    QuantizeContext,
    Quantizer,
    Representation,
    parse_spec,
)
from graphquant.recipes import CustomRecipe
from graphquant.roles import QuantizerRole

try:  # pyproject.toml's version, as the installed package records it
    __version__ = _metadata.version("graphquant")
except _metadata.PackageNotFoundError:  # a source tree on the path, never installed
    __version__ = "0+unknown"

__all__ = [
    "CustomRecipe",
    "DelayedScalingRequest",
    "Float8BlockQuantizer",
    "Float8CurrentScalingQuantizer",
    "Float8DelayedScalingQuantizer",
    "Float8RowwiseQuantizer",
    "FrozenExperts",
    "FrozenLinear",
    "HybridQuantizer",
    "IdentityQuantizer",
    "MXFP8Quantizer",
    "MixedDtypesError",
    "NVFP4Quantizer",
    "Plan",
    "PlanError",
    "QuantizeContext",
    "Quantizer",
    "QuantizerRole",
    "RecompileLimitError",
    "Representation",
    "compile",
    "explain",
    "factories",
    "freeze",
    "numerics",
    "parse_spec",
    "recipes",
    "zoo",
]
