"""Pass 3b (convert, inference graphs): inference linears that read one x run their GEMMs in one launch.

A SwiGLU's gate and up projections read one activation, as an attention layer's q, k and v
projections do. At decode sizes each GEMM's time is mostly its weight's bytes plus the ramp and
tail of its launch; one launch whose grid covers all their weights pays the latter once, and
splits K for their rows together, so that its outputs are the bits of one GEMM over the weights
stacked: the decode GEMM's (graphquant.kernels.triton_decode.gemms_sharing_a) or the mixed-input
GEMM's (graphquant::mixed_input_gemms). The pass makes that choice where the plan's choices allow
it, so the graph (and its dump) carries it; frozen and per-call models make it alike, so they
compute the same bits.

Expects: a rewritten inference graph (passes/rewrite.py): frozen linears as calls of
graphquant.ops.functional.quantized_frozen_linear, the others as calls of quantized_linear with
its inference formula (``site.inference``).
Guarantees: calls of one of the two that read the same x node, whose plan runs fprop on the same
backend, one that shares launches (``_shared_launch``: the decode GEMM for weight families it
shares at x's rows, triton_decode.shares_launch; the mixed-input GEMM where x's values are made
from x), x's format keeping no state (no delayed scaling, no stochastic rounding: x quantized once
gives each the codes it would make), their weights of one format and one dtype, become, up to the
backend's most a launch at a time in graph order, one call of
functional.quantized_frozen_linears_sharing_x or quantized_linears_sharing_x whose ``sites`` name
them all (a graph dump prints them); each one's output is an item of that call's. Every other
node stays as it was.
"""

from __future__ import annotations

import math
import operator
from typing import Optional

from torch import fx

from graphquant.kernels import backends, mixed_input
from graphquant.ops import functional
from graphquant.ops.library import quantizer_of
from graphquant.quantizers import ROWWISE


def merge_gemms_sharing_x(gm: fx.GraphModule) -> None:
    """Rewrite ``gm`` in place: the linears that may share a launch (the module's docstring)
    become one call for each launch."""
    graph = gm.graph
    order = {node: index for index, node in enumerate(graph.nodes)}
    groups: dict[tuple, list[fx.Node]] = {}
    for node in graph.nodes:
        key = _sharing_key(node)
        if key is not None:
            groups.setdefault(key, []).append(node)
    merged = False
    for (launch, *_), nodes in groups.items():
        for start in range(0, len(nodes) - 1, launch):
            shared = nodes[start : start + launch]
            if all(order[arg] < order[shared[0]] for later in shared[1:] for arg in later.all_input_nodes):
                _merge(graph, shared)
                merged = True
    if merged:
        graph.lint()
        gm.recompile()


def _sharing_key(node: fx.Node) -> Optional[tuple]:
    """What calls that may share a launch have in common, the most GEMMs a launch runs first, or
    None where ``node`` shares none."""
    if node.op != "call_function" or node.target not in (functional.quantized_frozen_linear, functional.quantized_linear):
        return None
    site = node.kwargs["site"]
    x_quantizer = site.quantizers[0]
    frozen = node.target is functional.quantized_frozen_linear
    if not (frozen or site.inference) or node.kwargs["states"][0] is not None or x_quantizer.stochastic or x_quantizer.keeps_state:
        return None
    weight_spec = site.quantizers[1].child(ROWWISE).spec
    launch = _shared_launch(site, weight_spec, _rows(node.args[0]))
    # a frozen linear's call names its weight's dtype; a linear's weight is a node with its value
    dtype = node.args[3] if frozen else getattr(node.args[1].meta.get("example_value"), "dtype", None)
    if launch < 2 or dtype is None:
        return None
    return (launch, node.target, node.args[0], site.fprop, site.input, weight_spec, dtype, site.amax_group)


def _shared_launch(site, weight_spec: str, rows: Optional[int]) -> int:
    """The most GEMMs that read one x the kernel the plan chose for ``site``'s fprop runs in a
    launch at x's ``rows``, for a weight in the format ``weight_spec``: the decode GEMM's where it
    shares launches for the weight's family at those rows; the mixed-input GEMM's where x's values
    are made from x by one op (quantized_weights_product hands them over once); else one."""
    triton_decode = backends.triton_decode
    if triton_decode is not None and site.fprop.name in (triton_decode.BACKEND, triton_decode.QUANTIZING_BACKEND):
        family = quantizer_of(weight_spec).gemm_input(ROWWISE).family
        return triton_decode.SHARED_LAUNCH if triton_decode.shares_launch(family, rows) else 1
    if site.fprop.name == mixed_input.BACKEND and mixed_input.values_from_x(site.quantizers[0].child(ROWWISE)):
        return mixed_input.SHARED_LAUNCH
    return 1


def _rows(x: fx.Node) -> Optional[int]:
    """The rows of the 2-D x a linear multiplies (all its dims but the last), where its graph
    knows them."""
    value = x.meta.get("val", x.meta.get("example_value"))
    return None if value is None else math.prod(value.shape[:-1])


def _merge(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """One call in place of ``nodes`` (quantized_frozen_linears_sharing_x for frozen linears,
    quantized_linears_sharing_x for the others), before the first."""
    sites = tuple(node.kwargs["site"] for node in nodes)
    if nodes[0].target is functional.quantized_frozen_linear:
        x, _, _, dtype, _ = nodes[0].args
        weights, shapes, biases = (tuple(node.args[i] for node in nodes) for i in (1, 2, 4))
        target, args, kwargs = functional.quantized_frozen_linears_sharing_x, (x, weights, shapes, dtype, biases), {"sites": sites}
    else:
        x = nodes[0].args[0]
        weights, biases = (tuple(node.args[i] for node in nodes) for i in (1, 2))
        states = tuple(node.kwargs["states"] for node in nodes)
        kwargs = {"sites": sites, "states": states, "rng": nodes[0].kwargs["rng"]}
        target, args = functional.quantized_linears_sharing_x, (x, weights, biases)
    with graph.inserting_before(nodes[0]):
        shared = graph.call_function(target, args, kwargs)
        shared.meta.update(nodes[0].meta)
        shared.meta.pop("val", None)
        shared.meta.pop("example_value", None)
        for index, node in enumerate(nodes):
            item = graph.call_function(operator.getitem, (shared, index))
            item.meta.update(node.meta)
            node.replace_all_uses_with(item)
    for node in nodes:
        graph.erase_node(node)
