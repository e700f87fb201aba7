"""Which parameters a graph's grouped sites read as their expert stacks, and how.

graphquant.freeze stores an expert stack quantized as its grouped GEMM reads it (each expert's
W_g = w[g]^T, rowwise), so it must know for each parameter the site that reads it and whether
through a transpose of its last two dims; it learns that from the graphs compiled before it. A
frozen parameter's place then holds a stand-in (graphquant.freezing.FrozenExperts) that only
grouped sites may read, and this pass finds their reads of it for the rewrite.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import torch
from torch import fx

from graphquant.passes.find_gemms import GROUPED, GemmSite, written_at
from graphquant.passes.plan import PlanError

# How a grouped site may reach its weight: the placeholder itself, or a swap of its last two dims.
_SWAPS = {(1, 2), (2, 1), (-1, -2), (-2, -1), (1, -1), (-1, 1), (-2, 2), (2, -2)}
_TRANSPOSES = ("transpose", "swapaxes", "swapdims")


@dataclasses.dataclass(frozen=True)
class ExpertWeight:
    """How one grouped site reads a parameter: the site's name (its roles') and whether it reads
    the parameter's last two dims swapped (an (E, N, K) stack stored as nn.Linear stores one)."""

    site: str
    transposed: bool

    @property
    def sites(self) -> tuple[str, ...]:
        return (self.site,)


@dataclasses.dataclass(frozen=True)
class UnfreezableStack:
    """Why graphquant.freeze cannot store a parameter read as an expert stack, and the grouped
    sites that read it (told of once, with this reason)."""

    sites: tuple[str, ...]
    why: str


@dataclasses.dataclass(frozen=True)
class FrozenStack:
    """A frozen expert stack as the rewrite reads it: the FrozenExperts module's qualified name,
    its stored format, the GEMM's (E, K, N) and the weight's dtype, and the transposition it was
    frozen for."""

    module: str
    spec: str
    shape: tuple[int, int, int]
    dtype: torch.dtype
    transposed: bool


def weight_source(node: fx.Node) -> Optional[tuple[fx.Node, bool]]:
    """(the placeholder, transposed) that a grouped site's w node reads, or None where it is
    anything else (an activation, a slice, a copy)."""
    args = dict(zip(("mat_a", "mat_b"), node.args)) | dict(node.kwargs)
    w = args.get("mat_b")
    if not isinstance(w, fx.Node):
        return None
    if w.op == "placeholder":
        return w, False
    swap = _swapped(w)
    if swap is not None and swap.op == "placeholder":
        return swap, True
    return None


def _swapped(node: fx.Node) -> Optional[fx.Node]:
    """The tensor ``node`` is a swap of the last two dims of (of three), else None."""
    target = node.target
    if node.op == "call_function" and target is getattr and node.args[1:] == ("mT",):
        return node.args[0]
    if node.op == "call_method" and target in _TRANSPOSES or node.op == "call_function" and target in (torch.transpose, torch.swapaxes, torch.swapdims):
        source, *dims = node.args
        return source if tuple(dims) in _SWAPS else None
    if node.op == "call_method" and target == "permute" or node.op == "call_function" and target is torch.permute:
        source, *dims = node.args
        dims = tuple(dims[0]) if len(dims) == 1 and isinstance(dims[0], (list, tuple)) else tuple(dims)
        return source if dims in ((0, 2, 1), (0, -1, -2), (0, -1, 1), (0, 2, -2)) else None
    return None


def _grouped_reads(gm: fx.GraphModule, example_inputs: Sequence[object]) -> list[tuple[fx.Node, GemmSite, fx.Node, object, bool]]:
    """(node, site, placeholder, its example value, transposed) of each grouped site of ``gm``
    whose weight is a placeholder or a swap of one."""
    placeholders = dict(zip(gm.graph.find_nodes(op="placeholder"), example_inputs))
    reads = []
    for node in gm.graph.nodes:
        site = node.meta.get("graphquant_site")
        source = weight_source(node) if site is not None and site.form == GROUPED else None
        if source is not None:
            reads.append((node, site, source[0], placeholders.get(source[0]), source[1]))
    return reads


def expert_weights(gm: fx.GraphModule, example_inputs: Sequence[object], names: dict[int, str]) -> dict[str, Union[ExpertWeight, UnfreezableStack]]:
    """Each parameter (``names``: id -> qualified name) that a grouped site of ``gm`` reads as its
    expert stack: how, or why it cannot be frozen (read elsewhere too, or by two sites)."""
    reads: dict[fx.Node, list[tuple[fx.Node, ExpertWeight]]] = {}
    parameters: dict[fx.Node, str] = {}
    for node, site, placeholder, value, transposed in _grouped_reads(gm, example_inputs):
        if id(value) in names:
            parameters[placeholder] = names[id(value)]
            reads.setdefault(placeholder, []).append((node, ExpertWeight(site.name, transposed)))
    found = {}
    for placeholder, sites in reads.items():
        why = _unfreezable(placeholder, sites)
        found[parameters[placeholder]] = UnfreezableStack(tuple(sorted({read.site for _, read in sites})), why) if why else sites[0][1]
    return found


def _unfreezable(placeholder: fx.Node, sites: list[tuple[fx.Node, ExpertWeight]]) -> str:
    """Why a parameter read as an expert stack by ``sites`` cannot be stored for them ("" if it can)."""
    if len({read for _, read in sites}) > 1:
        return "read by " + " and ".join(sorted({f"{read.site} ({'transposed' if read.transposed else 'as stored'})" for _, read in sites}))
    other = _other_reader(placeholder, [node for node, _ in sites])
    return f"also read by {written_at(other)}, which would need its high-precision values" if other is not None else ""


def _other_reader(placeholder: fx.Node, site_nodes: list[fx.Node]) -> Optional[fx.Node]:
    """A node that reads ``placeholder`` other than as the weight of ``site_nodes``, else None."""
    for user in placeholder.users:
        if user in site_nodes:
            continue
        if _swapped(user) is placeholder and all(reader in site_nodes for reader in user.users):
            continue
        return user
    return None


def mark_frozen_stacks(
    gm: fx.GraphModule, example_inputs: Sequence[object], sites: list[GemmSite], frozen: dict[int, FrozenStack]
) -> list[GemmSite]:
    """``sites`` (find_gemms' of ``gm``) with each grouped site that reads a frozen stand-in
    (``frozen``: the stand-in's id -> its stack) marked ``stored_stack`` and its node annotated
    with ``graphquant_frozen_stack``; raises where the graph reads a stand-in any other way, since
    its values are NaN."""
    placeholders = zip(gm.graph.find_nodes(op="placeholder"), example_inputs)
    stands = {node: frozen[id(value)] for node, value in placeholders if id(value) in frozen}
    if not stands:
        return sites
    marked: dict[GemmSite, GemmSite] = {}
    readers: dict[fx.Node, list[fx.Node]] = {node: [] for node in stands}  # a stand-in no site reads is checked too
    for node, site, placeholder, _, transposed in _grouped_reads(gm, example_inputs):
        if placeholder not in stands:
            continue
        stack = stands[placeholder]
        if transposed != stack.transposed:
            how = "with its last two dims swapped" if transposed else "as stored"
            raise PlanError(
                f"{site.label} (grouped_linear) reads the frozen expert stack {stack.module} {how}, but graphquant.freeze "
                "stored it for a site that reads it the other way: freeze the model again from its high-precision weights"
            )
        node.meta["graphquant_frozen_stack"] = stack
        node.meta["graphquant_site"] = marked[site] = dataclasses.replace(site, stored_stack=True)
        readers[placeholder].append(node)
    for placeholder, site_nodes in readers.items():
        other = _other_reader(placeholder, site_nodes)
        if other is not None:
            raise PlanError(
                f"{written_at(other)} reads {stands[placeholder].module}'s parameter, an expert stack that graphquant.freeze "
                "stored quantized for torch._grouped_mm alone (its place holds NaN): only grouped GEMMs may read it; freeze "
                "the model again from its high-precision weights, after a call that runs this code"
            )
    return [marked.get(site, site) for site in sites]
