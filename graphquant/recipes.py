"""CustomRecipe and the built-in recipe presets."""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import pickle
from typing import Any, Callable, Optional, Union

from graphquant import factories
from graphquant.quantizers import DelayedScalingRequest, Quantizer, parse_spec
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
        only, is TE's and torchao's. FP8 block GEMMs always promote (cuBLAS requires it). On Hopper
        an inference graph's MXFP8 expert products of few tokens take the FP8 tensor cores where
        this allows their fprop, each 32-block's sum in their accumulator (elsewhere MXFP8 sums in
        fp32).
    fp8_dpa: quantize attention too: every F.scaled_dot_product_attention becomes a ``dpa`` site
        whose roles (qkv, s, do, dp and the hint-only dpa_output / dpa_grad_input) the factory is
        asked for (TE's fp8_dpa). False leaves attention in high precision and asks for no dpa role.
    small_gemms_in_high_precision: a GEMM site with fewer than 128 output features or a
        reduction shorter than 16, which that (and maybe its rows) keeps from tiling its formats'
        blocks (an MoE router's 8 experts under MXFP8 at any token count, a rotary embedding's
        outer product of frequencies and positions), runs in high precision, with the reason in
        the plan, instead of failing the compile. The
        built-in recipes (presets and zoo) set it; a factory of your own decides per slot, so
        there it stays an error.
    """

    qfactory: QuantizerFactory
    expected_names: tuple[str, ...] = ()
    amax_reduction_group: object = dataclasses.field(default=None, compare=False)
    fast_accumulation: tuple[str, ...] = DEFAULT_FAST_ACCUMULATION
    fp8_dpa: bool = False
    small_gemms_in_high_precision: bool = False

    def __post_init__(self) -> None:
        if self.qfactory is None or not callable(self.qfactory):
            raise ValueError("CustomRecipe requires a callable qfactory(role) -> Quantizer")
        if isinstance(self.qfactory, Quantizer):  # callable on a tensor, not on a role
            raise ValueError(
                f"CustomRecipe's qfactory is a factory(role) that returns a quantizer, got the quantizer {self.qfactory} "
                f"itself: CustomRecipe(lambda role: {self.qfactory!r}) gives it every slot"
            )
        if not accepts(self.qfactory, 1):
            advice = f"; if it makes a recipe, call it instead: {_call_name(self.qfactory)}()" if accepts(self.qfactory, 0) else ""
            raise ValueError(f"CustomRecipe's qfactory is called with one argument, the role, which {_name(self.qfactory)} does not take{advice}")
        if not isinstance(self.expected_names, tuple) or not all(isinstance(name, str) for name in self.expected_names):
            example = (self.expected_names,) if isinstance(self.expected_names, str) else tuple(map(str, self.expected_names))
            raise ValueError(f"CustomRecipe's expected_names must be a tuple of module names, e.g. {example!r}; got {self.expected_names!r}")
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
        # A process group does not pickle (its name does): restored, such a recipe reduces over
        # nothing until given a group.
        group = self.amax_reduction_group
        return {**self.__dict__, "amax_reduction_group": group if isinstance(group, str) else None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __copy__(self) -> "CustomRecipe":
        """A copy in this process keeps the process group itself (pickling's state drops it)."""
        copied = object.__new__(type(self))
        copied.__dict__.update(self.__dict__)
        return copied

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._value() == other._value()

    def __hash__(self) -> int:
        return hash(self._value())

    def _value(self) -> tuple:
        """The fields it compares by, a factory made by functools.partial (a preset's) by its function
        and arguments: partials compare by identity, so two calls of one preset were unequal."""
        return tuple(_factory_value(getattr(self, f.name)) for f in dataclasses.fields(self) if f.compare)

    def __deepcopy__(self, memo: dict) -> "CustomRecipe":
        copied = memo[id(self)] = object.__new__(type(self))
        copied.__dict__.update({name: value if name == "amax_reduction_group" else copy.deepcopy(value, memo) for name, value in self.__dict__.items()})
        return copied


def _factory_value(factory: object) -> object:
    """A functools.partial as its function and arguments (each such a value too); anything else as it is."""
    if not isinstance(factory, functools.partial):
        return factory
    return (_factory_value(factory.func), tuple(map(_factory_value, factory.args)), tuple(sorted((k, _factory_value(v)) for k, v in factory.keywords.items())))


def delayed_scaling(*, margin: int = 0, amax_history_len: int = 1024, amax_compute_algo: str = "max") -> CustomRecipe:
    """TE's DelayedScaling: per-tensor FP8 from the amax history, E4M3 forward and E5M2 backward."""
    return CustomRecipe(
        functools.partial(
            factories.delayed_scaling_factory,
            margin=margin,
            amax_history_len=amax_history_len,
            amax_compute_algo=amax_compute_algo,
        ),
        small_gemms_in_high_precision=True,
    )


def current_scaling() -> CustomRecipe:
    """TE's Float8CurrentScaling: per-tensor FP8 from this tensor's amax, E5M2 for gradients."""
    return CustomRecipe(factories.current_scaling_factory, small_gemms_in_high_precision=True)


def mxfp8_block_scaling() -> CustomRecipe:
    """TE's MXFP8BlockScaling: MXFP8 (E4M3, 1x32 / 32x1 blocks) for every tensor."""
    return CustomRecipe(factories.mxfp8_factory, small_gemms_in_high_precision=True)


def float8_block_scaling() -> CustomRecipe:
    """TE's Float8BlockScaling: 1x128 blocks for activations and gradients, 128x128 for weights."""
    return CustomRecipe(factories.float8_block_scaling_factory, small_gemms_in_high_precision=True)


def nvfp4_block_scaling() -> CustomRecipe:
    """TE's NVFP4BlockScaling: 2D weights; RHT on the wgrad side; stochastic rounding for gradients."""
    return CustomRecipe(factories.nvfp4_factory, small_gemms_in_high_precision=True)


PRESETS = {
    "delayed_scaling": delayed_scaling,
    "current_scaling": current_scaling,
    "mxfp8_block_scaling": mxfp8_block_scaling,
    "float8_block_scaling": float8_block_scaling,
    "nvfp4_block_scaling": nvfp4_block_scaling,
}


def require(recipe: object) -> CustomRecipe:
    """``recipe`` itself if it is a CustomRecipe; else a TypeError that says which call was meant."""
    if isinstance(recipe, CustomRecipe):
        return recipe
    raise TypeError(f"graphquant needs a CustomRecipe, got {_name(recipe)}; {_meant(recipe)}")


def accepts(fn: Callable, count: int) -> bool:
    """Whether ``fn`` can be called with ``count`` positional arguments (True where Python cannot tell)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    try:
        signature.bind(*[None] * count)
    except TypeError:
        return False
    return True


def _meant(recipe: object) -> str:
    """The call that makes the CustomRecipe the user most likely meant by ``recipe``."""
    from graphquant import zoo  # the zoo builds on this module

    make = "recipes.NAME() (a preset), zoo.recipe(NAME) or CustomRecipe(factory) make one"
    if isinstance(recipe, str):
        if recipe in PRESETS:
            return f"a preset's name: call recipes.{recipe}()"
        if recipe in zoo.FACTORIES:
            return f"a zoo recipe's name: call zoo.recipe({recipe!r})"
        try:
            spec = parse_spec(recipe)
        except ValueError:
            spec = None
        if isinstance(spec, Quantizer):
            return (
                "that is one quantizer's spec, and a recipe picks a quantizer for every slot: CustomRecipe(factory) "
                f"with a factory(role) that returns graphquant.parse_spec({recipe!r}) for the slots that want it"
            )
        return f"{make}; preset names: {', '.join(PRESETS)}; zoo names: {', '.join(zoo.FACTORIES)}"
    if isinstance(recipe, type):
        if issubclass(recipe, CustomRecipe):
            return "make one: CustomRecipe(factory), with a factory(role) that returns a quantizer"
        if issubclass(recipe, Quantizer):
            return (
                f"a recipe picks a quantizer for every slot: CustomRecipe(factory) with a factory(role) that returns "
                f"{recipe.__name__}(...) (graphquant.factories has one per format)"
            )
        return make
    if isinstance(recipe, Quantizer):
        return "a recipe picks a quantizer for every slot: CustomRecipe(factory) with a factory(role) that returns it"
    if recipe is zoo.recipe:
        return f"call it with a zoo name: zoo.recipe(NAME), NAME one of {', '.join(zoo.FACTORIES)}"
    if callable(recipe):
        zoo_name = next((name for name, factory in zoo.FACTORIES.items() if factory is recipe), None)
        if zoo_name is not None:
            return f"a zoo factory: call zoo.recipe({zoo_name!r}) (or CustomRecipe({recipe.__name__}))"
        if recipe in PRESETS.values():
            return f"a preset, which makes one: call it, {_call_name(recipe)}()"
        if accepts(recipe, 1):
            return f"if it is a factory(role) that returns a quantizer, make it a recipe: CustomRecipe({_call_name(recipe)})"
        if accepts(recipe, 0):
            return f"if it makes a recipe, call it: {_call_name(recipe)}()"
    return make


def _name(value: Any) -> str:
    """``value`` as an error message names it: a function or class by its qualified name."""
    if isinstance(value, type):
        return f"the class {value.__module__}.{value.__qualname__}"
    if inspect.isfunction(value) or inspect.ismethod(value) or inspect.isbuiltin(value):
        return f"the function {value.__module__}.{value.__qualname__}"
    if isinstance(value, (str, Quantizer)):
        return f"the {type(value).__name__} {str(value)!r}"
    return f"{value!r}, of type {type(value).__name__}"


def _call_name(fn: Callable) -> str:
    """How user code would spell ``fn``: recipes.x for a preset, else its own name."""
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"recipes.{name}" if getattr(fn, "__module__", None) == __name__ else name


def __getattr__(name: str) -> Any:
    """A zoo recipe's name asked of this module points at graphquant.zoo."""
    from graphquant import zoo

    hint = f"; {name} is a zoo recipe: zoo.recipe({name!r})" if not name.startswith("__") and name in zoo.FACTORIES else ""
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}{hint}")
