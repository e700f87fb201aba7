"""CustomRecipe and the built-in recipe presets."""

from __future__ import annotations

import dataclasses
import functools
import pickle
from typing import Callable, Optional, Union

from graphquant import factories
from graphquant.quantizers import DelayedScalingRequest, Quantizer
from graphquant.roles import QuantizerRole

QuantizerFactory = Callable[[Optional[QuantizerRole]], Union[Quantizer, DelayedScalingRequest]]

GEMM_NAMES = ("fprop", "dgrad", "wgrad")
DEFAULT_FAST_ACCUMULATION = ("fprop",)  # TE's and torchao's


@dataclasses.dataclass(frozen=True)
class CustomRecipe:
    """A recipe is a factory that picks a quantizer for every slot (module, tensor role, direction).

    graphquant calls ``qfactory(role)`` once per slot per compile and never per forward. Use a
    module-level function (or a functools.partial of one) so the recipe pickles.

    expected_names: module names the factory singles out; graphquant warns when one of them
        matches no GEMM of the compiled model (a filter that silently matches nothing).
    amax_reduction_group: the process group over which per-tensor scaling (FP8, and NVFP4's global
        amax) all-reduces its amax (quantizers with with_amax_reduction / reduce_amax); None means
        no reduction.
    fast_accumulation: the GEMMs (of "fprop", "dgrad", "wgrad") whose per-tensor and per-row FP8
        products sum in the tensor cores' own accumulator, never promoted to fp32: faster, and
        looser (TE's use_split_accumulator=False, torchao's use_fast_accum); the default, fprop
        only, is TE's and torchao's. FP8 block GEMMs always promote (cuBLAS requires it).
    """

    qfactory: QuantizerFactory
    expected_names: tuple[str, ...] = ()
    amax_reduction_group: object = dataclasses.field(default=None, compare=False)
    fast_accumulation: tuple[str, ...] = DEFAULT_FAST_ACCUMULATION

    def __post_init__(self) -> None:
        if self.qfactory is None or not callable(self.qfactory):
            raise ValueError("CustomRecipe requires a callable qfactory(role) -> Quantizer")
        if not isinstance(self.fast_accumulation, tuple) or not set(self.fast_accumulation) <= set(GEMM_NAMES):
            raise ValueError(
                f"CustomRecipe's fast_accumulation must be a tuple of GEMM names from {GEMM_NAMES}; "
                f"got {self.fast_accumulation!r}"
            )

    def __getstate__(self) -> dict:
        factory = self.qfactory.func if isinstance(self.qfactory, functools.partial) else self.qfactory
        qualname = getattr(factory, "__qualname__", "")
        if "<lambda>" in qualname or "<locals>" in qualname:
            raise pickle.PicklingError(
                f"this CustomRecipe's factory {qualname} is a lambda or a function defined inside another one, which "
                "pickle cannot store; define the factory at module level (or use a functools.partial of one) to pickle "
                "the recipe (torch.multiprocessing.spawn, checkpoints)"
            )
        # Process groups do not pickle; a restored recipe reduces over nothing until given a group.
        return {**self.__dict__, "amax_reduction_group": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


def delayed_scaling(*, margin: int = 0, amax_history_len: int = 1024, amax_compute_algo: str = "max") -> CustomRecipe:
    """TE's DelayedScaling: per-tensor FP8 from the amax history, E4M3 forward and E5M2 backward."""
    return CustomRecipe(
        functools.partial(
            factories.delayed_scaling_factory,
            margin=margin,
            amax_history_len=amax_history_len,
            amax_compute_algo=amax_compute_algo,
        )
    )


def current_scaling() -> CustomRecipe:
    """TE's Float8CurrentScaling: per-tensor FP8 from this tensor's amax, E5M2 for gradients."""
    return CustomRecipe(factories.current_scaling_factory)


def mxfp8_block_scaling() -> CustomRecipe:
    """TE's MXFP8BlockScaling: MXFP8 (E4M3, 1x32 / 32x1 blocks) for every tensor."""
    return CustomRecipe(factories.mxfp8_factory)


def float8_block_scaling() -> CustomRecipe:
    """TE's Float8BlockScaling: 1x128 blocks for activations and gradients, 128x128 for weights."""
    return CustomRecipe(factories.float8_block_scaling_factory)


def nvfp4_block_scaling() -> CustomRecipe:
    """TE's NVFP4BlockScaling: 2D weights; RHT on the wgrad side; stochastic rounding for gradients."""
    return CustomRecipe(factories.nvfp4_factory)
