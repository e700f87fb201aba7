"""A graphquant model's other methods: torch.compile's wrapper quantizes the module's forward
(graphquant wraps generate too), but hands every other attribute to the module itself, so that
``compiled.encode_text(x)`` (a two-tower model trained through its encoders) runs the module's own
code eagerly, unquantized, with no graph compiled and no check run.

watch_methods puts, in the graphquant model's own attributes (which come before those it hands
on), each method of the module's class bound to the module, run by a function that at the
method's first call with grad enabled counts the matrix products its outputs' autograd graph
holds, warns of them saying how to quantize the method, and takes itself away. It reads the
autograd graph after the call, not the ops as they run: a dispatch mode around the call would make
Dynamo skip, for good, any compiled code the method reaches (a tower compiled by itself).
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch

from graphquant import user_stack
from graphquant.eager_products import eager_products, next_node_number
from graphquant.passes import matrix_products


def watch_methods(compiled: torch.nn.Module, module: torch.nn.Module, quantized: str, attention: bool) -> None:
    """Watch each method of ``module``'s class (and its bases short of nn.Module) that
    ``compiled``, torch.compile's wrapper, does not run itself; ``quantized`` says what it does run
    ("forward and generate"); ``attention``: the recipe quantizes attention too."""
    for name, function in _own_methods(type(module)).items():
        if not hasattr(type(compiled), name) and name not in compiled.__dict__:
            compiled.__dict__[name] = types.MethodType(_watched(name, function, compiled.__dict__, quantized, attention), module)


def _own_methods(module_class: type) -> dict[str, Callable]:
    """The plain functions ``module_class`` and its bases short of nn.Module define, a subclass's
    over its base's."""
    return {
        name: function for klass in reversed(module_class.__mro__) if not issubclass(torch.nn.Module, klass)
        for name, function in vars(klass).items() if isinstance(function, types.FunctionType) and not name.startswith("__")
    }


def _watched(name: str, method: Callable, attributes: dict, quantized: str, attention: bool) -> Callable:
    """``method``, which at its first call with grad enabled warns of the products it ran and takes
    itself out of ``attributes`` (the graphquant model's own), so later calls reach the module's."""

    def first_call_watched(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():  # under no_grad there is no autograd graph to read
            return method(module, *args, **kwargs)
        since = next_node_number()
        result = method(module, *args, **kwargs)
        attributes.pop(name, None)
        eager = eager_products(result, since, attention)
        if eager:
            user_stack.warn(
                f"graphquant: {name} ran {matrix_products.described(eager)} in high precision: a graphquant model quantizes "
                f"{type(module).__name__}'s {quantized} alone, and runs its other methods as the module's own code, "
                f"eagerly; call the model itself, or quantize the method: graphquant.compile(module.{name}, recipe)"
            )
        return result

    first_call_watched.__name__ = first_call_watched.__qualname__ = name
    first_call_watched.__doc__ = method.__doc__
    return first_call_watched
