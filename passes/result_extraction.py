"""Pass 6 (Inductor, scheduler, after fusion): take each multi-output op's results out where it runs.

Inductor's code keeps the list a multi-output op returns (every graphquant quantize: the rowwise
and the columnwise representation of one read) until its last result is taken out of it, and
takes a result out where the scheduler placed that extraction: next to its reader, if a fusion
pulled other kernels ahead of it. A wgrad left behind that way (a grouped GEMM's, behind a kernel
fused with the scatter of the next dgrad's output) kept grad_output's rowwise copy alive, with the
columnwise one it reads, long after dgrad, the rowwise copy's only reader. Taken out where the op
runs, each result lives from its op to its own last reader, wherever that reader is scheduled.

Expects: Inductor's scheduler nodes after fusion, in a valid order.
Guarantees: each extraction of a result (ir.MultiOutput) whose op is in the list comes right
after that op, nested ones after their parent; every other node keeps its order. The order stays
valid (an extraction reads only its op's list) and the kernels are the same.
"""

from __future__ import annotations

from typing import Any

from torch._inductor import custom_graph_pass, ir

from graphquant.passes.chained_pass import ChainedPass

# torch >= 2.12 caches a scheduler pass that gives a uuid; 2.11 has no such base and keys its
# FX graph cache by the pickled config, this object included.
_SchedulerPass: type = getattr(custom_graph_pass, "CustomSchedulerPass", object)


def extract_where_made(nodes: list[Any]) -> list[Any]:
    """``nodes`` with every result extraction moved right after the op whose list it reads."""
    producer_of = {name: node for node in nodes for name in node.get_buffer_names()}
    extractions: dict[Any, list[Any]] = {}
    for node in nodes:
        if isinstance(getattr(node, "node", None), ir.MultiOutput):
            op = producer_of.get(node.node.inputs[0].get_name())
            if op is not None:
                extractions.setdefault(op, []).append(node)
    moved = {node for taken in extractions.values() for node in taken}
    ordered: list[Any] = []

    def place(node: Any) -> None:
        ordered.append(node)
        for extraction in extractions.get(node, ()):
            place(extraction)

    for node in nodes:
        if node not in moved:
            place(node)
    return ordered


class ResultExtraction(ChainedPass, _SchedulerPass):
    """``then`` (a post-fusion pass the user configured, kept), then ``extract_where_made``."""

    def __call__(self, nodes: list[Any]) -> list[Any]:
        return extract_where_made(self.then(nodes) if self.then is not None else nodes)
