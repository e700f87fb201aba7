"""Pass 1b (annotate): the calls Dynamo keeps whole whose matrix products graphquant cannot see.

A function given to ``torch.compiler.allow_in_graph`` (einops does it to its own functions, its
einsum among them) is one node of the Dynamo graph: the passes never see its code, so its products
would run in high precision without a word. Running it on the node's fake example values under a
dispatch mode finds them; its node carries ``"graphquant_skip"`` with what it multiplies, for the
plan's "not quantized" list, and the compiler warns of it.

Expects: a Dynamo graph whose nodes carry ``example_value``. Guarantees: the graph is unchanged.
"""

from __future__ import annotations

import collections
import inspect
from typing import Optional

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# What linear, matmul, einsum and the grouped product reach at the dispatcher.
_PRODUCTS = {torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm, torch.ops.aten.baddbmm}
if hasattr(torch.ops.aten, "_grouped_mm"):
    _PRODUCTS.add(torch.ops.aten._grouped_mm)


def mark_opaque_products(gm: fx.GraphModule) -> list[fx.Node]:
    """Give each opaque call that multiplies matrices (or cannot be run to tell) its reason to be
    listed as not quantized; returns those nodes."""
    marked = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or not _opaque(node.target):
            continue
        reason = _hidden_products(node)
        if reason is not None:
            node.meta["graphquant_skip"] = reason
            marked.append(node)
    return marked


def _opaque(target: object) -> bool:
    """Whether a graph node's target is a Python function of the user's or a library's, which Dynamo
    put in the graph as it is (torch's own functions are torch's ops, which the passes know)."""
    return inspect.isfunction(target) and not (target.__module__ or "").startswith("torch")


def _hidden_products(node: fx.Node) -> Optional[str]:
    """Why ``node``'s products run in high precision, or None where it multiplies no matrices."""
    name = getattr(node.target, "__qualname__", node.target.__name__)
    whole = f"{name} is one call in the graph (torch.compiler.allow_in_graph), whose code graphquant does not see"
    args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), lambda a: a.meta.get("example_value") if isinstance(a, fx.Node) else a)
    values = [v for v in tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    fake_mode = next((v.fake_mode for v in values if isinstance(v, FakeTensor)), None)  # Dynamo's, not the backend's
    if fake_mode is None:
        return f"{whole}; it has no example values to run on, so any product inside it runs in high precision"
    products = ProductCounter()
    try:
        with fake_mode, products, torch.no_grad():
            node.target(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - any failure means we cannot tell
        return f"{whole}; running it on fake tensors to find its products failed ({type(error).__name__}), so any product inside it runs in high precision"
    if not products.seen:
        return None
    counts = ", ".join(f"{n} {op}" for op, n in sorted(products.seen.items()))
    return (
        f"{whole}: its matrix products ({counts}) run in high precision; graphquant quantizes them where Dynamo traces "
        "the code (a function not given to allow_in_graph; torch.einsum in place of einops.einsum)"
    )


class ProductCounter(TorchDispatchMode):
    """Counts the matrix products that run under it, by aten op name."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in _PRODUCTS:
            self.seen[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))
