"""Pass 1b (annotate): find every F.scaled_dot_product_attention of a Dynamo graph and give it a
``dpa`` site, as TransformerEngine's DotProductAttention has one, under
``CustomRecipe(fp8_dpa=True)``; without it, mark each for the plan's "not quantized" list
(leave_attention_in_high_precision).

Expects: a GraphModule captured by Dynamo, nodes carrying ``example_value`` and, inside modules,
``nn_module_stack``.
Guarantees: every attention graphquant can quantize carries ``node.meta["graphquant_attention"]``
(a DpaSite); one it cannot (not 4-D, not floating point, empty, a mask that learns) carries
``"graphquant_skip"`` with the reason; a call that asks for dropout, which FP8 attention cannot
give, raises a PlanError that names its module. The graph itself is unchanged.

A site is named after its owner as ``named_modules()`` spells it (TE names its DPA module), the
first attention of an owner's call by the owner's name alone and a further one in the same call
``<owner>.dpa.<i>``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import fx

from graphquant import user_stack
from graphquant.passes.find_gemms import (
    Frame, FunctionalNumbers, body_of, gradient_reaching, inside_transforms, nodes_and_bodies, owner_of, traced_number,
)
from graphquant.passes.plan import EMPTY_PRODUCT, PlanError
from graphquant.quantizers import COLUMNWISE, ROWWISE
from graphquant.roles import HINTS, QuantizerRole

ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}

# TE's slots of one DotProductAttention: forward Q, K, V (qkv), the output boundary and the
# softmax output (s), three each; backward the grad_input boundary, do and dp, two each.
FORWARD_SLOTS = ("qkv",) * 3 + ("dpa_output",) * 3 + ("s",) * 3
BACKWARD_SLOTS = ("dpa_grad_input",) * 2 + ("do",) * 2 + ("dp",) * 2
# The products of one attention (out = a @ b^T per head), each operand as (tensor, direction):
# forward S = Q K^T and O = P V, backward dV = P^T dO, dP = dO V^T, dQ = dS K and dK = dS^T Q.
FORWARD_PRODUCTS = (
    ("qk", ("Q", ROWWISE), ("K", ROWWISE)),
    ("pv", ("P", ROWWISE), ("V", COLUMNWISE)),
)
BACKWARD_PRODUCTS = (
    ("dv", ("P", COLUMNWISE), ("dO", COLUMNWISE)),
    ("dp", ("dO", ROWWISE), ("V", ROWWISE)),
    ("dq", ("dS", ROWWISE), ("K", COLUMNWISE)),
    ("dk", ("dS", COLUMNWISE), ("Q", COLUMNWISE)),
)


@dataclasses.dataclass(frozen=True)
class DpaSite:
    """One F.scaled_dot_product_attention call: its owner, its shapes, its mask.

    q_sizes is (batch, query heads, query length, head dim), k_sizes and v_sizes the same of key
    and value, each symbolic dim as its torch.SymInt (a check on it becomes a guard). gradients:
    whether Q, K and V get a gradient as the graph was traced (each requires one and so does the
    output: none under no_grad), so which backward products run.
    """

    name: str
    call: int
    q_sizes: tuple = dataclasses.field(compare=False)
    k_sizes: tuple = dataclasses.field(compare=False)
    v_sizes: tuple = dataclasses.field(compare=False)
    causal: bool = False
    masked: bool = False
    gradients: tuple[bool, bool, bool] = (True, True, True)

    module_type = "dpa"

    @property
    def label(self) -> str:
        return label(self.name, self.call)

    def role(self, slot: str) -> QuantizerRole:
        """The role of one of TE's slots: a hint-only boundary role has only a name (bare where
        the attention belongs to the compiled module itself)."""
        if slot in HINTS:
            return QuantizerRole(name=".".join(p for p in (self.name, slot) if p))
        return QuantizerRole(self.module_type, slot, self.name)

    def roles(self) -> tuple[QuantizerRole, ...]:
        """TE's slots in TE's order, one role per slot (so roles repeat): 9 forward, 6 backward,
        all of them asked for even where nothing runs backward (as TE builds both states)."""
        return tuple(self.role(slot) for slot in FORWARD_SLOTS + BACKWARD_SLOTS)

    def products(self, training: bool = True) -> tuple:
        """The products that run: (name, (tensor, direction) of a, of b), out = a @ b^T per head;
        of the backward's, dV's where V gets a gradient, dP's where Q or K does (dS needs it), dQ's
        and dK's where theirs do."""
        dq, dk, dv = self.gradients if training else (False, False, False)
        runs = {"dv": dv, "dp": dq or dk, "dq": dq, "dk": dk}
        return FORWARD_PRODUCTS + tuple(product for product in BACKWARD_PRODUCTS if runs[product[0]])

    def tensors(self) -> dict[str, tuple[str, int, tuple]]:
        """Each tensor the site quantizes: (its slot, the groups its rows fall in, its 2-D (rows,
        cols) as quantized: one row per token and head, the reduction dim of its rowwise use last)."""
        b, hq, lq, d = self.q_sizes
        _, hkv, lk, _ = self.k_sizes
        dv = self.v_sizes[3]
        return {
            "Q": ("qkv", b * hq, (b * hq * lq, d)),
            "K": ("qkv", b * hkv, (b * hkv * lk, d)),
            "V": ("qkv", b * hkv, (b * hkv * lk, dv)),
            "P": ("s", b * hq, (b * hq * lq, lk)),
            "dO": ("do", b * hq, (b * hq * lq, dv)),
            "dS": ("dp", b * hq, (b * hq * lq, lk)),
        }


def label(name: str, call: int) -> str:
    """An attention site's name in plans and errors: the owner's name and which of its calls."""
    return f"{name or 'dpa'}#{call}"


def find_attention(gm: fx.GraphModule, frame: Frame = Frame(), numbers: Optional[FunctionalNumbers] = None) -> list[DpaSite]:
    """Annotate and return the attention sites of ``gm`` (and of its bodies) in graph order, the
    second and later of one owner numbered by ``numbers`` (the model's, across its graphs)."""
    sites: list[DpaSite] = []
    _find(gm, (numbers or FunctionalNumbers()).graph(), sites, frame)
    return sites


def leave_attention_in_high_precision(gm: fx.GraphModule) -> None:
    """Mark each attention of ``gm`` for the plan's "not quantized" list, where the recipe does not
    ask for FP8 attention: it runs as torch's, which the plan would not otherwise show."""
    for node in nodes_and_bodies(gm):
        if is_attention(node) or _is_flex_attention(node) or _is_aten_attention(node):
            node.meta["graphquant_skip"] = "attention in high precision: the recipe has fp8_dpa=False (CustomRecipe(..., fp8_dpa=True) quantizes it)"


def is_attention(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is F.scaled_dot_product_attention


def _is_aten_attention(node: fx.Node) -> bool:
    """An aten attention op called as an op (torch.ops.aten.scaled_dot_product_attention, or a
    backend's, as _scaled_dot_product_flash_attention): no site, as torch.ops.aten.mm is none."""
    target = getattr(node.target, "overloadpacket", node.target)
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverloadPacket) and "scaled_dot_product" in target.__name__


def _is_flex_attention(node: fx.Node) -> bool:
    """flex_attention (transformers' attn_implementation="flex_attention"): Dynamo's higher-order op."""
    return node.op == "call_function" and node.target is getattr(torch.ops.higher_order, "flex_attention", None)


def arguments(node: fx.Node) -> dict[str, object]:
    """The call's arguments by name, defaults filled in."""
    return DEFAULTS | dict(zip(ARGUMENTS, node.args)) | dict(node.kwargs)


def _find(gm: fx.GraphModule, number: Callable, sites: list[DpaSite], frame: Frame) -> None:
    transformed, reaching = inside_transforms(gm), gradient_reaching(gm.graph)
    for node in gm.graph.nodes:
        body = body_of(gm, node)
        if body is not None:
            _find(body, number, sites, frame)
            continue
        if node in transformed and is_attention(node):
            node.meta["graphquant_skip"] = transformed[node]
            continue
        if _is_flex_attention(node):
            owner, _, _ = owner_of(node, frame)
            node.meta["graphquant_skip"] = "flex_attention runs in high precision: FP8 attention (fp8_dpa) takes F.scaled_dot_product_attention"
            user_stack.warn(
                f"graphquant: the recipe asks for FP8 attention (fp8_dpa), but {owner or 'the model'} calls flex_attention, "
                'which runs in high precision; FP8 attention takes F.scaled_dot_product_attention (transformers: attn_implementation="sdpa")'
            )
            continue
        if _is_aten_attention(node):
            node.meta["graphquant_skip"] = (
                f"torch.ops.aten.{getattr(node.target, 'overloadpacket', node.target).__name__} called as an op runs in high precision: "
                "call torch.nn.functional.scaled_dot_product_attention, which FP8 attention (fp8_dpa) quantizes"
            )
            continue
        if not is_attention(node):
            continue
        owner, call, _ = owner_of(node, frame)
        i = number((owner, call, "dpa"), node)
        name = owner if i == 0 else ".".join(p for p in (owner, "dpa", str(i)) if p)
        site = _site(node, name, call, node in reaching)
        if isinstance(site, str):
            node.meta["graphquant_skip"] = site
            continue
        node.meta["graphquant_attention"] = site
        sites.append(site)


def _site(node: fx.Node, name: str, call: int, reached: bool):
    """The node's DpaSite, or the reason it stays in high precision (``reached``: whether a backward
    can reach it: find_gemms.gradient_reaching)."""
    args = arguments(node)
    q, k, v = (_value(args[a]) for a in ("query", "key", "value"))
    if q is None or k is None or v is None:
        return "attention operand shapes unknown"
    if not (q.dim() == k.dim() == v.dim() == 4):
        return f"attention of {q.dim()}-D query, {k.dim()}-D key, {v.dim()}-D value: FP8 attention takes (batch, heads, length, dim)"
    dropout = traced_number(args["dropout_p"])
    if not isinstance(dropout, (int, float)) or dropout != 0:
        # A folded matmul-softmax-matmul (passes.attention_spelling) says what its dropout was.
        written = node.meta.get("graphquant_dropout", f"F.scaled_dot_product_attention(..., dropout_p={dropout!r})")
        raise PlanError(
            f"{label(name, call)}: {written} under fp8_dpa; FP8 attention runs without dropout: set the model's "
            "attention dropout to 0 (e.g. attention_dropout or attn_pdrop in a transformers config), or build the "
            "recipe with fp8_dpa=False to keep attention in high precision"
        )
    mask = _value(args["attn_mask"])
    if mask is not None and mask.requires_grad:
        return "its attn_mask requires grad (a learned attention bias, as T5's relative position bias), and FP8 attention takes a fixed mask"
    empty = [f"{t} {dim} = 0" for t, shape in (("q", q.shape), ("k", k.shape), ("v", v.shape))
             for dim, size in zip(("batch", "heads", "length", "head dim"), shape) if isinstance(size, int) and size == 0]
    if empty:
        return f"attention {EMPTY_PRODUCT} ({', '.join(empty)}), nothing to quantize"
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        return f"key and value of batch {k.shape[0]} and {v.shape[0]} broadcast against the query's {q.shape[0]}; FP8 attention takes one batch"
    if q.shape[1] == 1 < k.shape[1] == v.shape[1]:
        return f"a query of 1 head broadcast against {k.shape[1]} key and value heads; FP8 attention takes a query head or more a key head"
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise PlanError(
            f"{label(name, call)}: {q.shape[1]} query heads cannot share {k.shape[1]} key and {v.shape[1]} value heads; grouped-query "
            "attention needs as many key as value heads, dividing the query heads"
        )
    if not all(t.dtype.is_floating_point and t.dtype.itemsize > 1 for t in (q, k, v)):
        return f"attention of {q.dtype}, {k.dtype}, {v.dtype} operands is not quantized"
    output = _value(node)
    backward = (output is None or output.requires_grad) and reached  # none under no_grad, nor past a detach
    gradients = tuple(backward and t.requires_grad for t in (q, k, v))
    return DpaSite(name, call, tuple(q.shape), tuple(k.shape), tuple(v.shape), bool(args["is_causal"]), mask is not None, gradients)


def _value(node: object) -> Optional[torch.Tensor]:
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None
