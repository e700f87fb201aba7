"""Pass 0 (normalise, only under ``CustomRecipe(fp8_dpa=True)``): fold attention spelled as
matmul-softmax-matmul into the F.scaled_dot_product_attention it computes, so that it becomes a
``dpa`` site (passes.find_attention) like any other attention.

Expects: a GraphModule captured by Dynamo (torch IR), nodes carrying ``example_value``.
Guarantees: every chain of exactly this form, each intermediate used once, on 4-D (batch, heads,
length, dim) tensors with equal heads, is replaced by one F.scaled_dot_product_attention node
carrying the meta of the chain's last product (so it keeps its owner)::

    s = q @ k.transpose(-2, -1)        torch.matmul, operator.matmul or Tensor.matmul
    s = s * c   or   s = s / c         optional, c a Python number: scale=c or 1/c (else 1.0)
    s = s + mask                       optional, a fixed float mask of q's dtype, float32 or the
                                       products' (autocast's): attn_mask=mask
      or s.masked_fill(m, -inf)        optional, m a bool mask: attn_mask=~m
      or torch.where(m, s, -inf)       optional, m a bool mask: attn_mask=m (torch.where(m, -inf, s): ~m;
                                       s.where(m, -inf): m)
    s = s.float()                      optional, any cast to float32 (.to, .type, .type_as)
    p = softmax(s, dim=-1)             F.softmax, torch.softmax or Tensor.softmax, dtype None or float32
    p = p.type_as(q)                   optional, any cast (.to, .type, .half, .bfloat16...)
    p = F.dropout(p, dropout, train)   optional: dropout_p=dropout where training
    out = p @ v

A softmax between two matmuls that is not of this form is left as it is (its matmuls stay
matmul sites) and carries ``"graphquant_skip"`` saying why, for the plan's "not quantized" list.
Under autocast q, k and v may differ in dtype (a float32 rotary table times a bfloat16
projection): autocast runs both products in its dtype, as it runs sdpa, and the chain folds where
they compute in one. Grouped-query attention spelled with repeat_kv (k and v expanded to the
query heads before the products) folds as multi-head attention over the repeated k and v: the
same attention, but it quantizes and keeps the repeated copies.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import fx

from graphquant.passes.find_gemms import body_of, target_name, traced_number

_MATMULS = (torch.matmul, operator.matmul)
# Products attention is also spelled with, which are not folded, and why.
_BATCHED = "multiply 3-D (batch * heads, length, dim) tensors; attention folds matmuls of 4-D ones"  # BLOOM's, DeBERTa's
_UNFOLDED_PRODUCTS = {
    torch.bmm: _BATCHED,
    torch.baddbmm: _BATCHED,
    torch.einsum: "are einsums, whose subscripts may order and name the dims any way; attention folds matmuls (torch.matmul or @)",
}
_CAST_METHODS = ("float", "half", "bfloat16", "double")  # the casts a tensor method spells with no argument
# A step's arithmetic as an operator, a torch function or a method.
_MULTIPLIES = (operator.mul, torch.mul, "mul")
_DIVIDES = (operator.truediv, torch.div, "div")
_ADDS = (operator.add, torch.add, "add")
_SOFTMAXES = (F.softmax, torch.softmax)
# The steps allowed between the scores product and the softmax, in the order they must come.
_ORDER = ("scale", "mask", "cast")


@dataclasses.dataclass
class _Chain:
    """One matched spelling: the nodes it replaces, first to last, and sdpa's arguments."""

    nodes: list
    q: fx.Node
    k: fx.Node
    v: fx.Node
    scale: float = 1.0
    mask: Optional[fx.Node] = None
    negate_mask: bool = False
    dropout_p: float = 0.0


def fold_attention(gm: fx.GraphModule) -> None:
    """Fold every matmul-softmax-matmul attention of ``gm`` (and of its bodies) into sdpa."""
    for node in list(gm.graph.nodes):
        body = body_of(gm, node)
        if body is not None:
            fold_attention(body)
        elif _is_softmax(node):
            chain = _match(node)
            if isinstance(chain, str):
                node.meta["graphquant_skip"] = f"matmul-softmax-matmul not folded into attention ({chain}); its matmuls stay matmul sites, in the formats the recipe gives matmul roles (the table's rows), not the dpa roles"
            elif chain is not None:
                _fold(gm.graph, chain)
    gm.recompile()


def _match(softmax: fx.Node) -> Union[_Chain, str, None]:
    """The chain around ``softmax``, why it is not attention as sdpa computes it, or None where no
    matmul feeds it or takes its output (not a near-match)."""
    steps, scores = [], _input(softmax)
    while isinstance(scores, fx.Node) and _step(scores) is not None:
        steps.append(scores)
        scores = _input(scores)
    steps.reverse()
    after, probs = [], softmax
    while len(probs.users) == 1 and (_is_cast(_user(probs)) or _is_dropout(_user(probs))):
        probs = _user(probs)
        after.append(probs)
    out = next((user for user in probs.users if _is_matmul(user)), None)
    unfolded = [n for n in (scores, *probs.users) if isinstance(n, fx.Node) and n.op == "call_function" and n.target in _UNFOLDED_PRODUCTS]
    if unfolded and (out is not None or _is_matmul(scores) or len(unfolded) == 2):
        names = ", ".join(target_name(n) for n in unfolded)
        return f"its products ({names}) {_UNFOLDED_PRODUCTS[unfolded[0].target]}"
    if out is not None and isinstance(scores, fx.Node) and not _is_matmul(scores) and _product_before(scores):
        return f"{scores.name} ({target_name(scores)}) between the products is no step attention takes ({', '.join(_ORDER)}), a logit soft-cap's tanh, say"
    if not (isinstance(scores, fx.Node) and _is_matmul(scores)) or out is None:
        return None
    if out.args[0] is not probs:
        return "the probabilities are the right operand of the second matmul"
    kinds = [_step(s) for s in steps]
    if kinds != sorted(kinds, key=_ORDER.index) or len(set(kinds)) != len(kinds):
        return f"steps between the products in order {kinds}; attention takes {list(_ORDER)}, each at most once"
    for node in [scores, *steps, softmax, *after]:
        if len(node.users) != 1:
            return f"{node.name} has {len(node.users)} users; attention needs its scores and probabilities used once"
    q, k_t, v = scores.args[0], scores.args[1], out.args[1]
    k = _transposed_key(k_t)
    if k is None:
        return f"the second operand of {scores.name} is not k.transpose(-2, -1)"
    values = {name: _value(n) for name, n in (("q", q), ("k", k), ("v", v), ("out", out))}
    if any(t is None or t.dim() != 4 for t in values.values()):
        return "operands are not 4-D (batch, heads, length, dim)"
    qv, kv, vv = values["q"], values["k"], values["v"]
    if not (qv.shape[:2] == kv.shape[:2] == vv.shape[:2] and kv.shape[2] == vv.shape[2] and qv.shape[3] == kv.shape[3]):
        return f"q {tuple(qv.shape)}, k {tuple(kv.shape)}, v {tuple(vv.shape)} do not share batch and heads"
    if tuple(values["out"].shape) != (*qv.shape[:3], vv.shape[3]):
        return f"the output is {tuple(values['out'].shape)}: the mask broadcasts q {tuple(qv.shape)} up"
    computes = _value(scores).dtype
    if computes != values["out"].dtype:
        return f"the products compute in {computes} and {values['out'].dtype}; attention computes in one dtype"
    dim = softmax.kwargs.get("dim", softmax.args[1] if len(softmax.args) > 1 else None)
    if dim not in (-1, 3):
        return f"softmax over dim {dim}, not the last"
    if softmax.kwargs.get("dtype") not in (None, torch.float32):
        return f"softmax in {softmax.kwargs['dtype']}"
    chain = _Chain([scores, *steps, softmax, *after, out], q, k, v)
    for step in steps:
        reason = _take(step, chain, (qv.dtype, computes, torch.float32))
        if reason:
            return reason
    for node in after:
        if _is_dropout(node):
            p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else 0.5)
            training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
            if not isinstance(p, (int, float)) or not isinstance(training, bool):
                return f"dropout p={p!r}, training={training!r} not constant"
            chain.dropout_p = float(p) if training else 0.0
    return chain


def _take(step: fx.Node, chain: _Chain, mask_dtypes: tuple[torch.dtype, ...]) -> Optional[str]:
    """Record one step's argument in ``chain``, or say why sdpa cannot take it (``mask_dtypes``:
    an additive mask's, as sdpa takes one: the query's, float32, or the products' under autocast,
    which casts it)."""
    kind = _step(step)
    if kind == "scale":
        other = traced_number(_other(step))
        if not isinstance(other, (int, float)) or isinstance(other, bool) or other == 0:
            what = f"the tensor {other.name}" if isinstance(other, fx.Node) else repr(other)
            return f"the scores are scaled by {what}, not a nonzero constant"
        chain.scale = float(other) if step.target in _MULTIPLIES else 1.0 / other
    elif kind == "mask" and step.target in _ADDS:
        mask = _other(step)
        if _value(mask) is None or _value(mask).dtype not in mask_dtypes or _value(mask).requires_grad:
            return "the additive mask is not a fixed tensor of the query's dtype, float32 or the products' dtype"
        chain.mask = mask
    elif kind == "mask":
        # masked_fill(m, -inf) keeps the scores where m is False; s.where(m, -inf) and
        # torch.where(m, s, -inf) where m is True.
        where = step.target is torch.where
        mask, fill = (step.args[0], _other(step)) if where else step.args[1:]
        if _value(mask) is None or _value(mask).dtype != torch.bool or fill != -math.inf:
            return f"{'torch.where' if where else step.target} does not fill a bool mask with -inf"
        keeps = step.args[1] is _input(step) if where else step.target == "where"
        chain.mask, chain.negate_mask = mask, not keeps
    elif kind == "cast":
        cast = _value(step)
        if cast is None or cast.dtype != torch.float32:
            return f"the scores are cast to {cast.dtype if cast is not None else 'an unknown dtype'} by {step.name} ({target_name(step)}), not to float32"
    return None


def _fold(graph: fx.Graph, chain: _Chain) -> None:
    out = chain.nodes[-1]
    with graph.inserting_before(out):
        mask = chain.mask
        if chain.negate_mask:
            value = _value(mask)
            mask = graph.call_function(torch.logical_not, (mask,))
            with value.fake_mode:
                mask.meta["example_value"] = torch.logical_not(value)
        kwargs = {"dropout_p": chain.dropout_p, "is_causal": False, "scale": chain.scale}  # the mask positional, as autocast casts it
        attention = graph.call_function(F.scaled_dot_product_attention, (chain.q, chain.k, chain.v, mask), kwargs)
    attention.meta.update(out.meta)
    if chain.dropout_p:  # what the code wrote, for find_attention's error (FP8 attention takes no dropout)
        attention.meta["graphquant_dropout"] = f"F.dropout(p={chain.dropout_p}) of the probabilities of its matmul-softmax-matmul attention"
    out.replace_all_uses_with(attention)
    transposed = chain.nodes[0].args[1]
    for node in reversed(chain.nodes):
        graph.erase_node(node)
    if not transposed.users:
        graph.erase_node(transposed)


def _is_matmul(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _MATMULS) or (node.op == "call_method" and node.target in ("matmul", "__matmul__"))


def _is_softmax(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in _SOFTMAXES) or (node.op == "call_method" and node.target == "softmax")


def _is_cast(node: fx.Node) -> bool:
    """A dtype cast: .float() (Meta's Llama code, before the softmax), .half(), .bfloat16(),
    .double(), .to(dtype), .type(dtype) (GPT-2's) or .type_as(t) (Meta's, after the softmax)."""
    if node.op != "call_method" or node.kwargs or node.target not in ("to", "type", "type_as", *_CAST_METHODS):
        return False
    if node.target in _CAST_METHODS:
        return len(node.args) == 1
    if node.target == "type_as":
        return len(node.args) == 2 and isinstance(node.args[1], fx.Node)
    return len(node.args) == 2 and isinstance(node.args[1], torch.dtype)


def _is_dropout(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is F.dropout


def _step(node: fx.Node) -> Optional[str]:
    """Which step between the products ``node`` is (scale, mask or cast), or None."""
    if node.op not in ("call_function", "call_method") or node.kwargs:
        return None
    target = node.target
    if target in (*_MULTIPLIES, *_DIVIDES) and len(node.args) == 2:
        return "scale"
    if target in _ADDS and len(node.args) == 2 and all(isinstance(a, fx.Node) for a in node.args):
        return "mask"
    if target in ("masked_fill", "where", torch.where) and len(node.args) == 3:
        return "mask"
    return "cast" if _is_cast(node) else None


def _product_before(node: fx.Node, reach: int = 4) -> bool:
    """Whether a matmul feeds ``node`` through at most ``reach`` single-path steps of any kind."""
    for _ in range(reach):
        node = _input(node)
        if not isinstance(node, fx.Node):
            return False
        if _is_matmul(node):
            return True
    return False


def _input(node: fx.Node) -> object:
    """The scores operand of a step or softmax (the scale or mask may come first in mul and add,
    the fill in torch.where)."""
    if node.target is torch.where and len(node.args) == 3:
        _, a, b = node.args
        return b if not isinstance(a, fx.Node) or (_is_products(b) and not _is_products(a)) else a
    if node.target in (*_MULTIPLIES, *_ADDS) and len(node.args) == 2:
        a, b = node.args
        if _is_products(b) and not _is_products(a):
            return b
    return node.args[0] if node.args else None


def _other(node: fx.Node) -> object:
    """The operand of a step that is not the scores (torch.where's fill), or None where it has none."""
    first = _input(node)
    operands = node.args[1:3] if node.target is torch.where else node.args[:2]
    return next((a for a in operands if a is not first), None)


def _is_products(node: object) -> bool:
    """Whether ``node`` is a product or a scaled one, as scores are where a mask is added."""
    return isinstance(node, fx.Node) and (_is_matmul(node) or node.target in (*_MULTIPLIES, *_DIVIDES))


def _transposed_key(node: object) -> Optional[fx.Node]:
    """k where ``node`` is k.transpose of its last two dims of a 4-D k, else None."""
    if not isinstance(node, fx.Node) or node.target not in ("transpose", torch.transpose) or len(node.args) != 3:
        return None
    k, dims = node.args[0], node.args[1:]
    return k if isinstance(k, fx.Node) and {d % 4 if isinstance(d, int) else d for d in dims} == {2, 3} else None


def _user(node: fx.Node) -> fx.Node:
    return next(iter(node.users))


def _value(node: object) -> Optional[torch.Tensor]:
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None
