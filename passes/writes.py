"""Which tensors a node of a Dynamo graph may write, for a pass that moves a read later.

Dynamo's graph is not functionalized: x.mul_(2), torch.relu_(x), x[i] = v, x += y, out= and
inplace=True write their operands where they stand, and a write to a view (x.view(...),
x[0], x.T, x.data) writes every tensor that shares its storage. A pass that has a node read a
tensor later than the graph reads it (rewrite's gather, read by the grouped GEMM that follows)
must not move that read past such a write.

Expects: nodes whose tensors carry their fake values (meta "example_value", Dynamo's, or "val").
Guarantees: ``write_between`` names a node that may write a tensor sharing storage with the ones
asked about wherever one stands between the two nodes; a node whose writes are not known here (a
module call, a higher-order op, a function from outside torch), or a tensor whose storage is not
known, counts as such a write.
"""

from __future__ import annotations

import inspect
import operator
from typing import Iterable, Optional

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

_IN_PLACE_OPERATORS = frozenset({
    operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul, operator.imatmul, operator.itruediv,
    operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
    operator.irshift,
})
_IN_PLACE_DUNDERS = frozenset(f"__{op.__name__}__" for op in _IN_PLACE_OPERATORS)
# Modules whose functions write only as the rules below say (a trailing _, out=, inplace=True);
# graphquant's calls, put in by earlier rewrites, write their own state alone, never an operand.
# torch.distributed's collectives write their tensor in place under plain names (all_reduce).
_KNOWN_MODULES = ("torch", "graphquant", "operator", "_operator", "builtins", "math")
_UNKNOWN_MODULES = ("torch.distributed",)
# Torch functions that write an argument other than their first under a plain name: an
# embedding's max_norm renormalizes the weight's rows, a training batch norm (instance norm with
# running stats) updates its running statistics. They count as writing whatever they are given.
_WRITING_OTHERS = frozenset({
    torch.nn.functional.embedding, torch.embedding, torch.nn.functional.batch_norm, torch.batch_norm,
    torch.nn.functional.instance_norm, torch.instance_norm,
})


def written_operands(node: fx.Node) -> Optional[list[object]]:
    """The operands of ``node`` it may write (as passed: nodes, or tuples of them), or None where
    it may write any tensor it is given."""
    if node.op in ("placeholder", "get_attr", "output"):
        return []
    if node.op == "call_module" or isinstance(node.target, torch._ops.HigherOrderOperator) or node.target in _WRITING_OTHERS:
        return None
    args, kwargs = node.args, node.kwargs
    written = [kwargs["out"]] if "out" in kwargs else []
    if isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return written + _schema_writes(node.target, args, kwargs)
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if node.target in _IN_PLACE_OPERATORS or _in_place_name(name) or (node.op == "call_function" and _inplace_flag(node.target, args, kwargs)):
        first = args[0] if args else next((kwargs[k] for k in ("self", "input", "tensor") if k in kwargs), None)
        return None if first is None else [*written, first]
    if node.op == "call_method" or _known(node.target):
        return written
    return None


def write_between(first: fx.Node, last: fx.Node, read: Iterable[fx.Node]) -> Optional[fx.Node]:
    """The first node after ``first`` and before ``last`` in graph order that may write a tensor
    sharing storage with one of ``read``, or None where none may (``last`` must follow ``first``)."""
    storages: Optional[set[StorageWeakRef]] = set()
    for node in read:
        known = _storages(node)
        storages = None if known is None or storages is None else storages | known
    node = first.next
    while node is not last:
        written = written_operands(node)
        if written is None:  # its writes are not known: it may write what it holds, given or not
            return node
        for operand in (a for a in tree_flatten(written)[0] if isinstance(a, fx.Node)):
            known = _storages(operand)
            if known is None or storages is None or known & storages:  # unknown: it may alias what is read
                return node
        node = node.next
    return None


def _storages(node: fx.Node) -> Optional[set[StorageWeakRef]]:
    """The storages of the tensors ``node`` holds (none for a number), or None where unknown."""
    value = node.meta.get("example_value", node.meta.get("val"))
    if value is None:
        return None
    found = set()
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, torch.Tensor):
            try:
                found.add(StorageWeakRef(leaf.untyped_storage()))
            except (RuntimeError, NotImplementedError):  # a tensor of no plain storage (sparse, nested)
                return None
    return found


def _in_place_name(name: object) -> bool:
    """Torch's naming of an in-place op: add_, relu_, _foreach_mul_, __setitem__, __iadd__,
    all_reduce_inplace."""
    if not isinstance(name, str):
        return False
    return name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.startswith("__")) or "inplace" in name


def _inplace_flag(target: object, args: tuple, kwargs: dict) -> bool:
    """Whether a call passes inplace=True (torch.nn.functional.relu(x, inplace=True), by position too)."""
    try:
        bound = inspect.signature(target).bind(*args, **kwargs)
    except (TypeError, ValueError):  # a builtin of no signature, or not these arguments
        return kwargs.get("inplace") is True
    return bound.arguments.get("inplace") is True


def _schema_writes(op: object, args: tuple, kwargs: dict) -> list[object]:
    """The arguments an operator's schema marks written (Tensor(a!)), of any of its overloads for a packet."""
    overloads = [getattr(op, name) for name in op.overloads()] if isinstance(op, torch._ops.OpOverloadPacket) else [op]
    written = []
    for overload in overloads:
        positional = [a for a in overload._schema.arguments if not a.kwarg_only]
        for argument in overload._schema.arguments:
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            if argument.name in kwargs:
                written.append(kwargs[argument.name])
            elif not argument.kwarg_only and (place := positional.index(argument)) < len(args):
                written.append(args[place])
    return written


def _known(target: object) -> bool:
    """A function whose writes the naming rules tell: torch's, a Tensor method's, an operator."""
    if getattr(target, "__objclass__", None) in (torch.Tensor, torch._C.TensorBase):
        return True
    module = getattr(target, "__module__", None) or ""
    within = lambda names: any(module == name or module.startswith(name + ".") for name in names)  # noqa: E731
    return within(_KNOWN_MODULES) and not within(_UNKNOWN_MODULES)
