"""Pass 0 (normalise): a product's or an attention's operands given by keyword become positional,
as the other passes read them (``F.linear(input=x, weight=w)``) and as graphquant's ops cast them
under autocast (an ``attn_mask=``, which torch casts too).

Expects: a GraphModule captured by Dynamo. Guarantees: in it and the bodies of its higher-order
ops, each call below has its leading operands positional (a keyword moves only where every
operand before it is positional, so the call means what it meant); nothing else changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import fx

from graphquant.passes.find_gemms import nodes_and_bodies

# The leading parameters of each call, in order, as torch names them.
_FUNCTIONS = {
    F.linear: ("input", "weight"),
    torch.matmul: ("input", "other"),
    torch.linalg.matmul: ("input", "other"),
    torch.mm: ("input", "mat2"),
    torch.bmm: ("input", "mat2"),
    F.scaled_dot_product_attention: ("query", "key", "value", "attn_mask"),
}
if hasattr(torch, "_grouped_mm"):
    _FUNCTIONS[torch._grouped_mm] = ("input", "mat2")
_METHODS = {"matmul": ("self", "other"), "mm": ("self", "mat2"), "bmm": ("self", "mat2")}


def make_operands_positional(gm: fx.GraphModule) -> None:
    """Move every call's leading keyword operands (see the module docstring) into its positional args."""
    for node in nodes_and_bodies(gm):
        names = _FUNCTIONS.get(node.target) if node.op == "call_function" else _METHODS.get(node.target) if node.op == "call_method" else None
        if names is None or not node.kwargs:
            continue
        args, kwargs = list(node.args), dict(node.kwargs)
        for name in names[len(args):]:
            if name not in kwargs:
                break
            args.append(kwargs.pop(name))
        node.args, node.kwargs = tuple(args), kwargs
