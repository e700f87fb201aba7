"""A graphquant model's other methods: torch.compile's wrapper quantizes the module's forward
(graphquant wraps generate too), but hands every other attribute to the module itself, so that
``compiled.encode_text(x)`` (a two-tower model trained through its encoders) runs the module's own
code eagerly, unquantized, with no graph compiled and no check run.

GraphquantModule is that wrapper, whose methods of the model's own given tensors count the matrix
products their first call runs and warn of them, saying how to quantize the method.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable

import torch

from graphquant import user_stack
from graphquant.passes.opaque_calls import ProductCounter


class GraphquantModule(torch._dynamo.eval_frame.OptimizedModule):
    """The model graphquant.compile returns: torch.compile's wrapper, whose own methods the
    module's class defines (not nn.Module's) are watched at their first call with tensors."""

    def __getattr__(self, name: str) -> Any:
        value = super().__getattr__(name)
        module = self.__dict__["_modules"]["_orig_mod"]
        if isinstance(value, types.MethodType) and value.__self__ is module and not hasattr(torch.nn.Module, name):
            return _watched(value, name, self.__dict__["graphquant"].methods_watched)
        return value


def _watched(method: Callable, name: str, watched: set[str]) -> Callable:
    """``method``, whose first call given a tensor counts the products it runs (eagerly: the module's
    own code) and warns of them; later calls run it as it is."""

    @functools.wraps(method)
    def first_call_watched(*args: Any, **kwargs: Any) -> Any:
        given_tensors = any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values()))
        if name in watched or not given_tensors:
            return method(*args, **kwargs)
        watched.add(name)
        with ProductCounter() as counter:
            result = method(*args, **kwargs)
        if counter.seen:
            products = ", ".join(f"{count} {op}" for op, count in sorted(counter.seen.items()))
            owner = type(method.__self__).__name__
            user_stack.warn(
                f"graphquant: {name} ran {sum(counter.seen.values())} matrix product(s) in high precision ({products}): a "
                f"graphquant model quantizes {owner}'s forward (and generate) alone, and runs its other methods as the "
                f"module's own code, eagerly; call the model itself, or quantize the method: "
                f"graphquant.compile(module.{name}, recipe)"
            )
        return result

    return first_call_watched
