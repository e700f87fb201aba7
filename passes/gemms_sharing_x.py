"""Pass 3b (convert, inference graphs): frozen linears that read one x run their GEMMs in one launch.

A SwiGLU's gate and up projections read one activation. At decode sizes each GEMM's time is
mostly its weight's bytes plus the ramp and tail of its launch; one launch of the decode GEMM
whose grid covers both weights pays the latter once (graphquant.kernels.triton_decode.
gemms_sharing_a, each GEMM tiled and K-split as alone, so each output keeps its bits). The pass
makes that choice where the plan's choices allow it, so the graph (and its dump) carries it.

Expects: a rewritten inference graph (passes/rewrite.py), frozen linears as calls of
graphquant.ops.functional.quantized_frozen_linear.
Guarantees: calls that read the same x node, whose plan runs fprop on the same decode GEMM
backend, x's format keeping no state (no delayed scaling, no stochastic rounding: x quantized
once gives each the codes it would make), their stored weights of one format whose family the
kernel runs in a shared launch (triton_decode.SHARED_FAMILIES) and one dtype, become, two at a
time in graph order, one call of functional.quantized_frozen_linears_sharing_x whose ``sites``
name both (a graph dump prints them); each one's output is an item of that call's. Every other
node stays as it was.
"""

from __future__ import annotations

import operator
from typing import Optional

from torch import fx

from graphquant.kernels import backends
from graphquant.ops import functional
from graphquant.ops.library import quantizer_of
from graphquant.quantizers import ROWWISE

# The most GEMMs one launch of the decode GEMM runs (its PAIR).
SHARED_LAUNCH = 2


def merge_gemms_sharing_x(gm: fx.GraphModule) -> None:
    """Rewrite ``gm`` in place: each pair of frozen linears that may share a launch (the module's
    docstring) becomes one call."""
    graph = gm.graph
    order = {node: index for index, node in enumerate(graph.nodes)}
    groups: dict[tuple, list[fx.Node]] = {}
    for node in graph.nodes:
        key = _sharing_key(node)
        if key is not None:
            groups.setdefault(key, []).append(node)
    merged = False
    for nodes in groups.values():
        for start in range(0, len(nodes) - 1, SHARED_LAUNCH):
            pair = nodes[start : start + SHARED_LAUNCH]
            if all(order[arg] < order[pair[0]] for later in pair[1:] for arg in later.all_input_nodes):
                _merge(graph, pair)
                merged = True
    if merged:
        graph.lint()
        gm.recompile()


def _sharing_key(node: fx.Node) -> Optional[tuple]:
    """What calls that may share a launch have in common, or None where ``node`` shares none."""
    if node.op != "call_function" or node.target is not functional.quantized_frozen_linear:
        return None
    triton_decode = backends.triton_decode
    site = node.kwargs["site"]
    x_quantizer = site.quantizers[0]
    decode = triton_decode is not None and site.fprop.name in (triton_decode.BACKEND, triton_decode.QUANTIZING_BACKEND)
    if not decode or node.kwargs["states"][0] is not None or x_quantizer.stochastic or x_quantizer.keeps_state:
        return None
    x, _, _, dtype, _ = node.args
    weight_spec = site.quantizers[1].child(ROWWISE).spec
    if quantizer_of(weight_spec).gemm_input(ROWWISE).family not in triton_decode.SHARED_FAMILIES:
        return None
    return (x, site.fprop, site.input, weight_spec, dtype, site.amax_group)


def _merge(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """One quantized_frozen_linears_sharing_x call in place of ``nodes``, before the first."""
    x, _, _, dtype, _ = nodes[0].args
    weights, shapes, biases = (tuple(node.args[i] for node in nodes) for i in (1, 2, 4))
    sites = tuple(node.kwargs["site"] for node in nodes)
    with graph.inserting_before(nodes[0]):
        shared = graph.call_function(functional.quantized_frozen_linears_sharing_x, (x, weights, shapes, dtype, biases), {"sites": sites})
        shared.meta.update(nodes[0].meta)
        shared.meta.pop("val", None)
        shared.meta.pop("example_value", None)
        for index, node in enumerate(nodes):
            item = graph.call_function(operator.getitem, (shared, index))
            item.meta.update(node.meta)
            node.replace_all_uses_with(item)
    for node in nodes:
        graph.erase_node(node)
