"""The matrix products a model's call ran outside its compiled graphs, read off its outputs'
autograd graph.

Code torch.compile runs eagerly (under torch.compiler.disable, or a call past a graph break it could
not take) leaves its products in the autograd graph as MmBackward0 and its kind, while a graph
compiled through AOT autograd is one node whose products are its own: so the nodes between the
call's inputs and its outputs tell the products graphquant never saw, which ran in high precision,
in modules with parameters or without.
"""

from __future__ import annotations

import collections
from typing import Any, Iterator, Mapping, Optional

import torch

# What linear, matmul, einsum and the grouped product leave in an eager autograd graph.
_PRODUCT_NODES = {"MmBackward0": "mm", "BmmBackward0": "bmm", "AddmmBackward0": "addmm", "BaddbmmBackward0": "baddbmm", "GroupedMmBackward0": "_grouped_mm"}


def eager_products(outputs: Any, inputs: Any) -> Optional[collections.Counter]:
    """The products, by op, that produced ``outputs`` from ``inputs`` outside compiled graphs (the
    inputs' own history is not the call's); None where no output carries an autograd graph (a
    call under no_grad), which tells nothing."""
    before = {t.grad_fn for t in _tensors(inputs) if t.grad_fn is not None}
    todo = [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]
    if not todo:
        return None
    seen, found = set(), collections.Counter()
    while todo:
        node = todo.pop()
        if node in seen or node in before:
            continue
        seen.add(node)
        if node.name() in _PRODUCT_NODES:
            found[_PRODUCT_NODES[node.name()]] += 1
        todo.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return found


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a call's arguments or outputs: nested tuples, lists and mappings (a
    transformers ModelOutput is one)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
