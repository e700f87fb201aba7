"""Pass 0 (normalise): fold a linear spelled as a product with a transposed weight,
``x @ W.T``, into the ``F.linear(x, W)`` it computes, so that it is a linear site (roles input,
weight, grad_output) like an nn.Linear's, not a matmul of an activation (roles input, other).

Expects: a GraphModule captured by Dynamo (torch IR), nodes carrying ``example_value``.
Guarantees: every matrix product (torch.matmul, torch.mm, ``@``, Tensor.matmul / mm) whose second
operand is a 2-D parameter transposed (``W.T``, ``W.mT``, ``W.t()``, ``W.transpose(0, 1)``, in
either dim order, as a method or a torch function) is replaced by ``F.linear(x, W)``, carrying
the product's meta (so it keeps its owner); in the bodies of higher-order ops (body_of) too.
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
            hoisted = {p for p, arg in inner if isinstance(arg, fx.Node) and _transposed_weight_of(arg, parameters) is not None}
            _fold(body, {p for p, arg in inner if arg in parameters}, hoisted)
            continue
        weight = _transposed_weight(node, parameters)
        if weight is None and _is_product(node) and node.args[1] in transposed:
            with gm.graph.inserting_before(node):
                weight = gm.graph.call_method("t", (node.args[1],))
            weight.meta.update({k: v.t() for k, v in node.args[1].meta.items() if k in ("example_value", "val")})
        if weight is None:
            continue
        with gm.graph.inserting_before(node):
            linear = gm.graph.call_function(F.linear, (node.args[0], weight))
        linear.meta.update(node.meta)
        node.replace_all_uses_with(linear)
        transpose = node.args[1]
        gm.graph.erase_node(node)
        if isinstance(transpose, fx.Node) and transpose.op != "placeholder" and not transpose.users:
            gm.graph.erase_node(transpose)  # that node alone: FX's dead-code pass would take in-place updates too
        folded = True
    if folded:
        gm.recompile()


def _is_product(node: fx.Node) -> bool:
    """Whether ``node`` is a two-operand matrix product x @ other, without keywords."""
    is_product = (node.op == "call_function" and node.target in _PRODUCTS) or (node.op == "call_method" and node.target in _PRODUCT_METHODS)
    return is_product and len(node.args) == 2 and not node.kwargs


def _transposed_weight(node: fx.Node, parameters: set[fx.Node]) -> Optional[fx.Node]:
    """W where ``node`` is a product x @ W^T of a 2-D parameter W, else None."""
    return _transposed_weight_of(node.args[1], parameters) if _is_product(node) else None


def _transposed_weight_of(other: object, parameters: set[fx.Node]) -> Optional[fx.Node]:
    """W where ``other`` is a 2-D parameter W transposed, else None."""
    if not isinstance(other, fx.Node) or not other.args:
        return None
    weight = other.args[0]
    if weight not in parameters or getattr(weight.meta.get("example_value"), "ndim", None) != 2:
        return None
    return weight if _transposes(other) else None


def _transposes(node: fx.Node) -> bool:
    """Whether ``node`` is a transposed view of its 2-D first argument."""
    args = node.args[1:]
    if node.op == "call_function" and node.target is getattr:
        return args in (("T",), ("mT",))
    if (node.op == "call_method" and node.target == "t") or (node.op == "call_function" and node.target is torch.t):
        return not args and not node.kwargs
    is_transpose = (node.op == "call_method" and node.target == "transpose") or (node.op == "call_function" and node.target is torch.transpose)
    return is_transpose and not node.kwargs and len(args) == 2 and all(isinstance(d, int) for d in args) and {d % 2 for d in args} == {0, 1}
