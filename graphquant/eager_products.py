"""The matrix products a model's call ran outside its compiled graphs, read off its outputs'
autograd graph.

Code torch.compile runs eagerly (under torch.compiler.disable, or a call past a graph break it could
not take) leaves its products in the autograd graph as MmBackward0 and its kind, while a graph
compiled through AOT autograd is one node whose products are its own: so the nodes the call made
tell the products graphquant never saw, which ran in high precision, in modules with parameters or
without.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Iterator, Mapping, Optional

import torch

from graphquant.passes import matrix_products


def next_node_number() -> int:
    """The sequence number the autograd graph's next node takes: a call's nodes take this one on,
    what its inputs (in whatever container, or closed over) came from took earlier ones."""
    with torch.enable_grad():
        return torch.zeros((), requires_grad=True).clone().grad_fn._sequence_nr() + 1


def eager_products(outputs: Any, since: int, attention: bool) -> Optional[collections.Counter]:
    """The products, by op, among the autograd nodes numbered ``since`` on that produced
    ``outputs`` (F.scaled_dot_product_attention among them where ``attention``: a recipe that
    quantizes it); None where no output carries an autograd graph (a call under no_grad, a model
    with nothing to train), which tells nothing."""
    todo = [t.grad_fn for t in _tensors(outputs) if t.grad_fn is not None]
    if not todo:
        return None
    seen, found = set(), collections.Counter()
    while todo:
        node = todo.pop()
        if node in seen or node._sequence_nr() < since:
            continue
        seen.add(node)
        if node.name() in matrix_products.OP_OF_NODE:
            found[matrix_products.OP_OF_NODE[node.name()]] += 1
        elif attention and node.name().startswith(matrix_products.ATTENTION_NODE_PREFIX):
            found[matrix_products.ATTENTION] += 1
        todo.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return found


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a call's outputs: nested tuples, lists, mappings (a transformers ModelOutput
    is one) and dataclasses."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _tensors(getattr(value, field.name))
