"""Pass 0 (normalise): fold a linear spelled as a product with a transposed weight,
``x @ W.T`` (or ``torch.addmm(b, x, W.T)``), into the ``F.linear(x, W)`` (``F.linear(x, W, b)``)
it computes, so that it is a linear site (roles input, weight, grad_output) like an nn.Linear's,
not a matmul of an activation (roles input, other).

Expects: a GraphModule captured by Dynamo (torch IR), nodes carrying ``example_value``.
Guarantees: every matrix product (torch.matmul, torch.mm, ``@``, Tensor.matmul / mm) whose second
operand is a 2-D parameter transposed (``W.T``, ``W.mT``, ``W.t()``, ``W.transpose(0, 1)``, in
either dim order, as a method or a torch function) is replaced by ``F.linear(x, W)``, and every
``torch.addmm(b, x, W.T)`` (Tensor.addmm too, with beta and alpha 1) of a 1-D b by
``F.linear(x, W, b)``, carrying the product's meta (so it keeps its owner); in the bodies of higher-order ops (body_of) too. A
chain of such views counts by its parity: transposed twice (a tied decoder's ``W.t()`` of an
encoder's ``W.t()``) is ``x @ W``, which is a linear site as it stands, and multiplies W itself.
The values are the same: F.linear multiplies by the same transposed view.
"""

from __future__ import annotations

import operator
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import fx

from graphquant.passes.find_gemms import body_of, parameter_nodes

_PRODUCTS = (torch.matmul, torch.linalg.matmul, torch.mm, operator.matmul)
_PRODUCT_METHODS = ("matmul", "mm", "__matmul__")


def fold_linears(gm: fx.GraphModule, example_inputs: Sequence[object]) -> None:
    """Fold every ``x @ W.T`` of ``gm`` (see the module docstring) in place."""
    _fold(gm, parameter_nodes(gm, example_inputs), set())


def _fold(gm: fx.GraphModule, parameters: set[fx.Node], transposed: set[fx.Node]) -> None:
    """``transposed``: a body's inputs that are a parameter transposed outside it (Dynamo hoists
    a checkpointed ``W.T`` out of the body), whose products are x @ (their transpose)^T."""
    folded = False
    for node in list(gm.graph.nodes):
        body = body_of(gm, node)
        if body is not None:
            inner = list(zip(body.graph.find_nodes(op="placeholder"), node.args[1:]))
            hoisted = {p for p, arg in inner if _parameter_under_transposes(arg, parameters)[1]}
            _fold(body, {p for p, arg in inner if arg in parameters}, hoisted)
            continue
        if _is_product(node):
            x, views, bias = *node.args, None
        elif _is_addmm(node):
            bias, x, views = node.args
        else:
            continue
        weight, odd = _parameter_under_transposes(views, parameters)
        if weight is None and views in transposed:
            with gm.graph.inserting_before(node):
                weight, odd = gm.graph.call_method("t", (views,)), True
            weight.meta.update({k: v.t() for k, v in views.meta.items() if k in ("example_value", "val")})
        if weight is None or weight is views or (bias is not None and not odd):
            continue
        if odd:
            with gm.graph.inserting_before(node):
                linear = gm.graph.call_function(F.linear, (x, weight) if bias is None else (x, weight, bias))
            linear.meta.update(node.meta)
            node.replace_all_uses_with(linear)
            gm.graph.erase_node(node)
        else:
            node.replace_input_with(views, weight)
        while isinstance(views, fx.Node) and views.op != "placeholder" and not views.users:
            # the views alone: FX's dead-code pass would take in-place updates too
            unused, views = views, views.args[0]
            gm.graph.erase_node(unused)
        folded = True
    if folded:
        gm.recompile()


def _is_product(node: fx.Node) -> bool:
    """Whether ``node`` is a two-operand matrix product x @ other, without keywords."""
    is_product = (node.op == "call_function" and node.target in _PRODUCTS) or (node.op == "call_method" and node.target in _PRODUCT_METHODS)
    return is_product and len(node.args) == 2 and not node.kwargs


def _is_addmm(node: fx.Node) -> bool:
    """Whether ``node`` is addmm(b, x, other) of a 1-D b, without keywords (beta and alpha 1):
    F.linear's x @ other + b."""
    is_addmm = (node.op == "call_function" and node.target is torch.addmm) or (node.op == "call_method" and node.target == "addmm")
    if not (is_addmm and len(node.args) == 3 and not node.kwargs and isinstance(node.args[0], fx.Node)):
        return False
    bias = node.args[0].meta.get("example_value")
    return isinstance(bias, torch.Tensor) and bias.dim() == 1


def _parameter_under_transposes(other: object, parameters: set[fx.Node]) -> tuple[Optional[fx.Node], bool]:
    """(W, odd) where ``other`` is a 2-D parameter W under a chain of transposed views (none: W
    itself), ``odd`` where the chain transposes it; (None, False) where it is not."""
    odd = False
    while isinstance(other, fx.Node) and other not in parameters:
        if not other.args or not _transposes(other):
            return None, False
        other, odd = other.args[0], not odd
    if not isinstance(other, fx.Node) or getattr(other.meta.get("example_value"), "ndim", None) != 2:
        return None, False
    return other, odd


def _transposes(node: fx.Node) -> bool:
    """Whether ``node`` is a transposed view of its 2-D first argument."""
    args = node.args[1:]
    if node.op == "call_function" and node.target is getattr:
        return args in (("T",), ("mT",))
    if (node.op == "call_method" and node.target == "t") or (node.op == "call_function" and node.target is torch.t):
        return not args and not node.kwargs
    is_transpose = (node.op == "call_method" and node.target == "transpose") or (node.op == "call_function" and node.target is torch.transpose)
    return is_transpose and not node.kwargs and len(args) == 2 and all(isinstance(d, int) for d in args) and {d % 2 for d in args} == {0, 1}
