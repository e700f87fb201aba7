"""Pass 5 (Inductor, the ATen graph of each compile): one node for a computation done twice.

AOTAutograd merges repeated computations (torch's fx_graph_cse) only in a graph it partitions into
forward and backward, for training. A graph that runs no backward (torch.no_grad, mode="inference")
reaches Inductor as traced, so two linears that read one tensor (a SwiGLU's gate and up
projections) would each quantize it at every call: its amax, scales and cast twice, and twice the
kernels to compile. graphquant's ops are functional, so merging their calls keeps every bit.

Expects: the ATen graph AOTAutograd hands Inductor's inner compile (``is_inference`` says whether
it is a graph that runs no backward; the others were merged already, so they pass as they are).
Guarantees: in an inference graph, nodes that apply one op to the same arguments are one; random
ops, aten.empty and the tensors the graph returns stay apart, and mutations keep their order
(fx_graph_cse's rules).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from torch import fx
from torch._functorch.compile_utils import fx_graph_cse


def merging_common_subexpressions(inner_compile: Callable[..., Any]) -> Callable[..., Any]:
    """``inner_compile`` (Inductor's compile_fx_inner) of an inference graph with its repeated
    computations merged."""

    @functools.wraps(inner_compile)
    def compile_merged(gm: fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        if kwargs.get("is_inference", False):
            gm.graph = fx_graph_cse(gm.graph)
            gm.recompile()
        return inner_compile(gm, example_inputs, **kwargs)

    return compile_merged
