"""Pass 3 (convert): replace every annotated GEMM with graphquant's quantized functions.

Expects: nodes annotated by find_gemms and a Plan for them (every slot has a quantizer).
Guarantees: each such node is replaced by a call of graphquant.ops.functional
(graphquant.ops.grouped for torch._grouped_mm, graphquant.ops.attention for an attention site of
passes.find_attention) whose ``site`` argument (a graphquant.ops.site.Site)
names the site and spells out the format of input, weight/other and grad_output and the backend
the plan chose for each of its GEMMs; slot state
(delayed scaling, the stochastic-rounding step) enters as extra placeholders, in the order of the
returned keys. In an inference graph, each linear runs the inference formula (fprop alone, its
weight quantized from its current value on every call); a frozen linear (graphquant.freeze) reads
its stored quantized weight, which must be in the plan's format, and so does a grouped site that
passes/expert_weights.py found reading a frozen expert stack (its stored tensors enter as extra
placeholders too, read from its FrozenExperts at each call). An einsum's equation becomes the layout
find_gemms worked out for it. A grouped site's tokens gathered by indexing for it alone (x =
source[index], a 1-D integer index of a 2-D source: an MoE layer's tokens sorted by expert) are read
through that index by the site (its ``rows``), and the gather goes, where no node between the two
may write source, index or a tensor sharing their storage (passes/writes.py); else the site reads
the gathered copy. Nothing else in the graph changes.
"""

from __future__ import annotations

import itertools
import operator
from typing import Callable, Optional

import torch
from torch import fx

from graphquant.formats.groups import GROUP_ROWS
from graphquant.ops import attention, functional, grouped
from graphquant.ops.frozen import STORED_PARTS as FROZEN_PARTS
from graphquant.ops.site import Site
from graphquant.passes.find_gemms import ADDMM, EINSUM, FROZEN, GROUPED, LINEAR, TENSOR_TYPES, GemmSite, addmm_operands, body_of
from graphquant.passes.plan import FORWARD_GEMMS, Plan, PlanError, empty_dims
from graphquant.passes.writes import write_between
from graphquant.quantizers import ROWWISE, IdentityQuantizer
from graphquant.recipes import GEMM_NAMES
from graphquant.roles import QuantizerRole

IDENTITY = IdentityQuantizer().spec  # the formats of a call the plan keeps in high precision

_TARGETS = {
    LINEAR: functional.quantized_linear,
    ADDMM: functional.quantized_addmm,
    EINSUM: functional.quantized_einsum,
    GROUPED: grouped.quantized_grouped_mm,
    FROZEN: functional.quantized_frozen_linear,
}


def rewrite(
    gm: fx.GraphModule,
    plan: Plan,
    needs_delayed_state: Callable[[QuantizerRole], bool],
    needs_rng: bool,
    inference: bool = False,
    amax_group: Optional[str] = None,
) -> list[object]:
    """Rewrite ``gm`` in place; returns the keys of the placeholders it appended: "rng", the str
    of a delayed-scaling role, or ("frozen", a FrozenExperts' name, a stored part).

    ``inference``: the graph never runs backward (torch.no_grad or mode="inference"). Sites inside
    a body (find_gemms.body_of: activation checkpointing) are rewritten in the body, with the
    training formula; the state they need enters the body as extra arguments of the higher-order
    op. ``amax_group``, where given, names the process
    group of amax reductions (graphquant.distributed) in every call.
    """
    graph = gm.graph
    extra: dict[object, fx.Node] = {}
    placeholders = graph.find_nodes(op="placeholder")
    last_placeholder = placeholders[-1] if placeholders else None

    def placeholder(key: object) -> fx.Node:
        nonlocal last_placeholder
        if key not in extra:
            # After the graph's inputs; first, in a graph of none (a piece before a graph break that
            # builds a tensor from constants).
            at = graph.inserting_after(last_placeholder) if last_placeholder is not None else graph.inserting_before(next(iter(graph.nodes)))
            with at:
                node = graph.placeholder(f"graphquant_state_{len(extra)}")
            node._dynamo_source = None  # not from user code: the compiled wrapper supplies it
            node.meta["graphquant_state"] = key
            if key != "rng":  # a stored stack or a slot's state keeps its tensor for the model's life: CUDA graphs read it in place, not a copy
                node.meta["tensor_dict"] = {"_dynamo_static_input_type": "unguarded"}
            extra[key] = last_placeholder = node
        return extra[key]

    recording_only = _calls_recording_only(gm, plan, needs_delayed_state)
    _rewrite_sites(gm, plan, placeholder, needs_delayed_state, needs_rng, inference, itertools.count(), amax_group, recording_only)
    return list(extra)


def _calls_recording_only(gm: fx.GraphModule, plan: Plan, needs_delayed_state: Callable[[QuantizerRole], bool]) -> dict[fx.Node, tuple[str, ...]]:
    """For each call that shares a delayed-scaling slot with another call of the step (a module
    called more than once in the graph), the slots it only records its amax in: all calls of a
    step quantize with the scale the last one then rolls, as TE's. The last is the slot's last
    call in the graph, or for a gradient's slot its first that runs a backward: the backward runs
    the calls in reverse order."""
    backward = {g.site for g in plan.gemms if g.gemm not in FORWARD_GEMMS}
    calls: dict[QuantizerRole, list[tuple[fx.Node, str]]] = {}

    def visit(graph_module: fx.GraphModule) -> None:
        for node in graph_module.graph.nodes:
            body = body_of(graph_module, node)
            if body is not None:
                visit(body)
            for slot, role, label in _slots(node, plan):
                if needs_delayed_state(role) and (not role.backward or label in backward):
                    calls.setdefault(role, []).append((node, slot))

    visit(gm)
    recording: dict[fx.Node, tuple[str, ...]] = {}
    for role, users in calls.items():
        last = users[0] if role.backward else users[-1]
        for node, slot in users:
            if (node, slot) != last:
                recording[node] = (*recording.get(node, ()), slot)
    return recording


def _slots(node: fx.Node, plan: Plan) -> list[tuple[str, QuantizerRole, str]]:
    """(slot, role, the call's label) of each operand an attention or GEMM site quantizes (none
    for a call the plan keeps in high precision, or a node of no site)."""
    if "graphquant_attention" in node.meta:
        site = node.meta["graphquant_attention"]
        return [(slot, site.role(slot), site.label) for slot in attention.SLOTS]
    site = node.meta.get("graphquant_site")
    if site is None or site.label in plan.high_precision_calls:
        return []
    return [(slot, role, site.label) for slot, role in zip(TENSOR_TYPES[site.module_type], site.roles())]


def _rewrite_sites(gm, plan, state, needs_delayed_state, needs_rng, inference, counter, amax_group, recording_only) -> None:
    """Rewrite the sites of ``gm`` and of its bodies; ``state(key)`` gives the node holding a state."""
    graph = gm.graph
    chosen = {(g.site, g.gemm): g.backend for g in plan.gemms}
    token_rows = {g.site: g.token_rows for g in plan.gemms if g.token_rows is not None}
    for node in list(graph.nodes):
        body = body_of(gm, node)
        if body is not None:
            body_state = _body_state(body, node, state)
            _rewrite_sites(body, plan, body_state, needs_delayed_state, needs_rng, inference, counter, amax_group, recording_only)
            continue
        if "graphquant_attention" in node.meta:
            _rewrite_attention(graph, node, plan, state, needs_delayed_state, amax_group, recording_only.get(node, ()))
            continue
        if "graphquant_site" not in node.meta:
            continue
        site: GemmSite = node.meta["graphquant_site"]
        index = next(counter)
        roles = site.roles()
        high_precision = site.label in plan.high_precision_calls
        formats = {t: (IDENTITY if high_precision else plan.quantizer(r).spec) for t, r in zip(TENSOR_TYPES[site.module_type], roles)}
        if site.form == FROZEN:
            _check_stored_format(site, node.args[2], plan, high_precision)
        carried = Site(
            name=site.name,
            call=site.call,
            **formats,
            streams=tuple(3 * index + i for i in range(3)),
            amax_group=amax_group,
            **{gemm: chosen.get((site.label, gemm)) for gemm in GEMM_NAMES},
            # Which of quantized_linear's (or quantized_grouped_mm's) formulas runs; a frozen site's function has the inference one alone.
            inference=site.form in (LINEAR, GROUPED) and site.runs_inference_product(inference),
            token_rows=token_rows.get(site.label, GROUP_ROWS),
            records_amax_only=recording_only.get(node, ()),
        )
        states = tuple(state(str(r)) if needs_delayed_state(r) and not high_precision else None for r in roles)
        kwargs = dict(site=carried, states=states, rng=state("rng") if needs_rng else None)
        args, form_kwargs = _arguments(node, site)
        gather = _tokens_gather(args[0]) if site.form == GROUPED else None
        if gather is not None:
            args, form_kwargs = (gather.args[0], *args[1:]), {**form_kwargs, "rows": gather.args[1]}
        target = _TARGETS.get(site.form, functional.quantized_matmul)
        stack = node.meta.get("graphquant_frozen_stack")
        if stack is not None:  # a frozen expert stack (graphquant.freeze): its stored tensors in w's place
            _check_stored_format(site, stack.spec, plan, high_precision)
            x, _, offs = args
            args, target = (x, [state(("frozen", stack.module, part)) for part in FROZEN_PARTS], offs), grouped.quantized_frozen_grouped_mm
            form_kwargs = {**form_kwargs, "shape": stack.shape, "dtype": stack.dtype}
        with graph.inserting_before(node):
            replacement = graph.call_function(target, args, {**form_kwargs, **kwargs})
        replacement.meta.update(node.meta)
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
        if gather is not None:
            graph.erase_node(gather)
    graph.lint()
    gm.recompile()


def _rewrite_attention(graph, node, plan, state, needs_delayed_state, amax_group, records_amax_only) -> None:
    """Replace one F.scaled_dot_product_attention with graphquant.ops.attention's, its arguments
    unchanged and its applied roles' formats and state added."""
    site = node.meta["graphquant_attention"]
    roles = [site.role(slot) for slot in attention.SLOTS]
    formats = {slot: plan.quantizer(role).spec for slot, role in zip(attention.SLOTS, roles)}
    forward = next(g.backend for g in plan.gemms if g.site == site.label and g.gemm == "qk")
    # The backward's backend where the plan has one (none where nothing runs backward), the same for each of its products.
    backward = {"backward_backend": g.backend for g in plan.gemms if g.site == site.label and g.gemm not in FORWARD_GEMMS}
    carried = attention.AttentionSite(
        name=site.name, call=site.call, **formats, backend=forward, amax_group=amax_group, **backward, forward_only=not backward,
        records_amax_only=records_amax_only,
    )
    states = tuple(state(str(r)) if needs_delayed_state(r) else None for r in roles)
    with graph.inserting_before(node):
        replacement = graph.call_function(
            attention.quantized_attention, node.args, {**node.kwargs, "site": carried, "states": states}
        )
    replacement.meta.update(node.meta)
    node.replace_all_uses_with(replacement)
    graph.erase_node(node)


def _check_stored_format(site: GemmSite, stored: str, plan: Plan, kept: bool) -> None:
    """A frozen weight's stored format must be the one this call's plan multiplies it in: its
    weight quantizer's for fprop, or high precision where the plan ``kept`` the call so; an empty
    call reads none of it."""
    if empty_dims(site):
        return
    planned = (IdentityQuantizer() if kept else plan.quantizer(site.roles()[1])).child(ROWWISE).spec
    if stored != planned:
        runs = "this call's plan keeps it in high precision (too small for the recipe's blocks)" if kept else f"the recipe gives this slot {planned} for fprop"
        raise PlanError(
            f"{site.label} ({site.module_type}) weight: stored frozen as {stored}, but {runs}; compile with the recipe the "
            "model was frozen under, or freeze its high-precision weights under this one"
        )


def moved_by_a_recompute(key: object) -> bool:
    """Whether a recompute of the forward (torch.utils.checkpoint's) would move the state ``key``
    (rewrite's placeholders') again: rng's step, and a forward slot's delayed scaling; a gradient's
    slot (grad_output, attention's do and dp) is moved by the backward alone, which runs once."""
    return key == "rng" or (isinstance(key, str) and not QuantizerRole.parse(key).backward)


def _body_state(body: fx.GraphModule, call: fx.Node, outer_state: Callable[[object], fx.Node]) -> Callable[[object], fx.Node]:
    """``state`` for a body: each state becomes one more placeholder of the body and one more
    argument of the higher-order op ``call`` that passes the outer graph's node for it."""
    nodes: dict[object, fx.Node] = {}

    def state(key: object) -> fx.Node:
        if key != "rng" and moved_by_a_recompute(key):  # the body's recompute takes the forward's rng step
            raise PlanError(
                f"{key} uses delayed scaling inside torch.utils.checkpoint: the recompute in backward would quantize "
                "with the scale this step's forward already updated. Give the checkpointed modules' forward slots "
                "(input, weight, other, qkv, s) a stateless quantizer (current scaling, MXFP8, blockwise) in the "
                "recipe's factory, or checkpoint other modules"
            )
        if key not in nodes:
            outer = outer_state(key)
            last = list(body.graph.find_nodes(op="placeholder"))[-1]
            with body.graph.inserting_after(last):
                nodes[key] = body.graph.placeholder(f"graphquant_state_{len(nodes)}")
            nodes[key].meta.update({k: v for k, v in outer.meta.items() if k in ("example_value", "val")})
            call.args = (*call.args, outer)
        return nodes[key]

    return state


def _tokens_gather(x: object) -> Optional[fx.Node]:
    """The node x = source[index] where a grouped site alone reads it, a 1-D integer index of a
    2-D source (an MoE layer's tokens sorted by expert): the site reads source through the index
    instead, so that no copy of the tokens is written first; else None.

    The site reads them where it stands, not where the gather stood: where a node between may
    write source or index (Dynamo's graph keeps in-place ops: h.mul_(0.5), h[i] = v, a write to a
    view of h), the gather's copy is what holds the values the model gathered."""
    if not (isinstance(x, fx.Node) and x.op == "call_function" and x.target is operator.getitem and len(x.users) == 1):
        return None
    source, index = x.args
    values = [a.meta.get("example_value") if isinstance(a, fx.Node) else None for a in (source, index)]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return None
    source_value, index_value = values
    if not (source_value.dim() == 2 and index_value.dim() == 1 and index_value.dtype in (torch.int32, torch.int64)):
        return None
    (site,) = x.users
    return x if write_between(x, site, (source, index)) is None else None


def _arguments(node: fx.Node, site: GemmSite) -> tuple[tuple, dict]:
    """The operands of ``node`` in the order its graphquant.ops.functional function takes them."""
    args, kwargs = list(node.args), dict(node.kwargs)
    if site.form == LINEAR:
        weight = kwargs.pop("weight", None) or args[1]
        bias: Optional[object] = kwargs.pop("bias", args[2] if len(args) > 2 else None)
        return (args[0], weight, bias), {}
    if site.form == FROZEN:
        x, weight, _, shape, dtype, bias, _ = node.args
        return (x, weight, shape, dtype, bias), {}
    if site.form == ADDMM:
        return addmm_operands(node), {"beta": kwargs.get("beta", 1), "alpha": kwargs.get("alpha", 1)}
    if site.form == GROUPED:
        named = dict(zip(("mat_a", "mat_b", "offs"), args)) | kwargs
        return (named["mat_a"], named["mat_b"], named["offs"]), {}
    if site.form == EINSUM:
        operands = args[1:] if len(args) > 2 else list(args[1])
        return (site.einsum, *operands), {}
    other = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("mat2"))
    return (args[0], other), {}
