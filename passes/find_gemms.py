"""Pass 1 (annotate): find every GEMM in a Dynamo graph and give it a site and its roles.

Expects: a GraphModule captured by Dynamo (torch IR), nodes carrying ``example_value`` and, for
code inside modules, ``nn_module_stack``.
Guarantees: every node that computes a matrix product graphquant can quantize carries
``node.meta["graphquant_site"]`` (a GemmSite); the graph itself is unchanged. Products it cannot
quantize (a 1-D operand, batch dims that broadcast) carry ``"graphquant_skip"`` with the reason.

torch._grouped_mm in its MoE form (x (T, K), w (E, K, N), offs) is a ``grouped_linear`` site
whatever w is (a parameter, a view of one, or an activation): the design gives _grouped_mm one
module_type, and its roles (input, weight, grad_output) fit every MoE expert layer. Its name is
the owner's plus ``grouped_linear.<i>``, as for other functional GEMMs.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import math
import os
import operator
import re
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import fx

from graphquant.passes import matrix_products
from graphquant.passes.einsum import EinsumLayout, einsum_layout
from graphquant.roles import QuantizerRole

# Graph targets by form. A form says how the site's operands map onto y = x @ w^T.
LINEAR = "linear"  # F.linear(x, weight, bias)
MATMUL = "matmul"  # a @ b: matmul, mm, bmm, operator.matmul
ADDMM = "addmm"  # beta * c + alpha * (a @ b): addmm, baddbmm
EINSUM = "einsum"  # einsum with two operands that reduces to a batched matmul
GROUPED = "grouped"  # torch._grouped_mm(x, w, offs): one x @ w[g] per row group of x
FROZEN = "frozen"  # graphquant::frozen_linear(x, weight, ...): a linear whose weight is stored quantized

_FUNCTIONS = {
    F.linear: LINEAR,
    torch.matmul: MATMUL,
    torch.mm: MATMUL,
    torch.bmm: MATMUL,
    operator.matmul: MATMUL,
    torch.addmm: ADDMM,
    torch.baddbmm: ADDMM,
    torch.einsum: EINSUM,
    torch.linalg.matmul: MATMUL,
}
if hasattr(torch, "_grouped_mm"):
    _FUNCTIONS[torch._grouped_mm] = GROUPED
_METHODS = {"matmul": MATMUL, "mm": MATMUL, "bmm": MATMUL, "__matmul__": MATMUL, "addmm": ADDMM, "baddbmm": ADDMM}

# Products graphquant makes no site of: listed as not quantized, each with what to write instead.
_RESPELL = "spell it as F.linear, torch.matmul / @, torch.addmm / baddbmm or a two-operand torch.einsum, which graphquant quantizes"
_UNQUANTIZED_FUNCTIONS = {
    F.multi_head_attention_forward: (
        "nn.MultiheadAttention: Dynamo keeps F.multi_head_attention_forward as one call, so its input and output "
        "projections and its attention run in high precision"
    ),
    torch._transformer_encoder_layer_fwd: (
        "nn.TransformerEncoderLayer's fast path (an evaluation without gradients) is one call, "
        "torch._transformer_encoder_layer_fwd, so the layer's projections, attention and feed-forward run in high "
        "precision; torch.backends.mha.set_fastpath_enabled(False) has the layer run its modules, which graphquant quantizes"
    ),
    **{
        function: f"torch.{name} runs in high precision: {_RESPELL}"
        for function, name in (
            (torch.tensordot, "tensordot"), (torch.inner, "inner"), (torch.addbmm, "addbmm"), (torch.chain_matmul, "chain_matmul"),
            (torch.linalg.multi_dot, "linalg.multi_dot"), (F.bilinear, "nn.functional.bilinear (nn.Bilinear)"),
        )
    },
    **dict.fromkeys(
        (F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d),
        "a convolution (nn.Conv1d, Conv2d, Conv3d and their transposes: a ViT's patch embedding, an audio model's stem) runs in "
        "high precision: graphquant quantizes matrix products, not convolutions",
    ),
}
_UNQUANTIZED_METHODS = frozenset({"inner", "addbmm"})

TENSOR_TYPES = {
    "linear": ("input", "weight", "grad_output"),
    "grouped_linear": ("input", "weight", "grad_output"),
    "matmul": ("input", "other", "grad_output"),
}


@dataclasses.dataclass(frozen=True)
class GemmSite:
    """One GEMM call in the graph: what it is, who owns it, and the shapes it multiplies.

    x_shape is (batch, m, k) and w_shape (batch, n, k) of y[b] = x[b] @ w[b]^T, with batch 1 for
    a linear; dims that are symbolic (dynamic shapes) are None. A grouped site has x_shape
    (1, T, K) with its rows split among the experts at run time, and w_shape (E, N, K).
    x_sizes and w_sizes are the same shapes with each symbolic dim as its torch.SymInt: checked
    through them, a dynamic size's check becomes a guard of the compiled graph. An einsum site
    carries its layout as a batched product (rewrite passes it on to the op). in_body: the site
    is in a body (body_of), whose sites run the training formula (runs_inference_product).
    gradients: whether x and w get a gradient as the graph was traced (each requires one and so
    does the product: none under no_grad; Dynamo guards on both), so whether a backward runs
    dgrad and wgrad: a frozen weight's wgrad never runs, nor a no_grad teacher's backward.
    """

    form: str
    module_type: str
    name: str
    call: int
    batched: bool
    x_shape: tuple[Optional[int], Optional[int], Optional[int]]
    w_shape: tuple[Optional[int], Optional[int], Optional[int]]
    x_sizes: tuple = dataclasses.field(compare=False, repr=False)
    w_sizes: tuple = dataclasses.field(compare=False, repr=False)
    einsum: Optional[EinsumLayout] = None
    in_body: bool = False
    stored_stack: bool = False  # a grouped site whose expert stack graphquant.freeze stored (passes/expert_weights.py)
    gradients: tuple[bool, bool] = (True, True)

    @property
    def weight_frozen(self) -> bool:
        """Whether the site reads a weight graphquant.freeze stored quantized, not a parameter."""
        return self.form == FROZEN or self.stored_stack

    @property
    def label(self) -> str:
        """The site's name in plans, dumps and errors: the owner's name and the call index,
        "fc1#0", since a module called twice in one forward is one role but two sites."""
        return f"{self.name}#{self.call}"

    def runs_inference_product(self, inference: bool) -> bool:
        """Whether, in a graph that never runs backward where ``inference``, the site runs the
        inference formula (fprop alone, x and the weight quantized for it alone:
        graphquant.ops.inference, graphquant.ops.grouped): a frozen linear, or a linear or an
        expert stack outside a body (a body's sites keep the training formula). The rewrite gives
        it that formula and the plan picks a linear's fprop backend for it."""
        return inference and (self.form == FROZEN or (self.form in (LINEAR, GROUPED) and not self.in_body))

    def role(self, tensor_type: str) -> QuantizerRole:
        return QuantizerRole(self.module_type, tensor_type, self.name)

    def roles(self) -> tuple[QuantizerRole, ...]:
        return tuple(self.role(t) for t in TENSOR_TYPES[self.module_type])


@dataclasses.dataclass(frozen=True)
class Frame:
    """Where the modules that a graph's code reaches through its frame's locals sit in the model, so
    that site names count from the model's root: ``modules`` pairs a local (L['self'], or, in the
    code Dynamo resumes after a graph break inside a submodule, L['stack0'] and the like: the
    modules the caller still calls) with the module's qualified name; ``own`` names the module of
    the frame's own code (a product no module call encloses), and any local not paired."""

    modules: tuple[tuple[str, str], ...] = ()
    own: str = ""
    # A module registered under several names (one instance placed twice in a ModuleList): each of
    # its names, the first (as named_modules() names it), the names' count and the name's place.
    aliases: tuple[tuple[str, str, int, int], ...] = ()
    # Each parameter the graph lifts (its placeholder's name) with its names in the model (a tied
    # one has several).
    weights: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # Each module (by its first name) with the calls of it that earlier graphs of the same forward
    # hold (a graph break's: GraphquantBackend._counting_on): its calls in this graph count on from
    # there, as the module stack counts them within one graph. The products of the frame's own
    # module that no module call encloses take none: they go on with the call in progress.
    offsets: tuple[tuple[str, int], ...] = ()

    def name(self, path: str) -> str:
        """The qualified name of the module at Dynamo's ``path`` ("L['stack1'].proj")."""
        prefix = dict(self.modules).get(root_local(path) or "", self.own)
        return ".".join(p for p in (prefix, fqn_from_stack_path(path)) if p)

    def call_of(self, name: str, call: int) -> tuple[str, int]:
        """(name, call) of a module's call as its first name counts it, after its calls in earlier
        graphs (``offsets``): a call through a later name is a call of the same module (one slot a
        role, as for a module called twice); the k-th call through a module's i-th of n names is its
        call k * n + i, distinct from every other."""
        for alias, first, names, place in self.aliases:
            if name == alias:
                name, call = first, call * names + place
                break
        return name, call + dict(self.offsets).get(name, 0)

    def multiplies_own_weight(self, w: fx.Node, owner: str) -> bool:
        """Whether ``w``, the weight a product in nn.Linear ``owner``'s code multiplies, is the
        module's own (through views and casts): a subclass may multiply other parameters too (a
        LoRA adapter's), each a product of its own. A weight the frame cannot name counts as its own."""
        while target_name(w) in VIEWS_AND_CASTS and w.args and isinstance(w.args[0], fx.Node):
            w = w.args[0]
        names = dict(self.weights).get(w.name) if w.op == "placeholder" else None
        return names is None or ".".join(p for p in (owner, "weight") if p) in names


# Ops that only reshape, transpose or cast a tensor: a weight read through them is still read as itself.
VIEWS_AND_CASTS = {
    "t", "transpose", "permute", "view", "reshape", "contiguous", "T", "mT", "view_as", "reshape_as",
    "to", "float", "half", "bfloat16", "type_as",
}


class FunctionalNumbers:
    """The index in a functional product's name ("attn.matmul.1"), per owner, call and kind, in the
    order first seen over all of a model's graphs, each product known by its place in the source
    (its stack trace, and which of the products with that trace it is in its graph): the graphs
    of a graph break number on from each other, and a recompile of the same code finds the same
    names. ``graph()`` numbers one graph's products."""

    def __init__(self) -> None:
        self._numbers: dict[tuple, int] = {}
        self._next: collections.Counter = collections.Counter()

    def saved(self) -> list:
        """The numbers given so far, as JSON values: what a resumed run starts from (``restore``)."""
        return [[list(key), place if isinstance(place, (str, type(None))) else [list(f) for f in place], seen, number]
                for (key, place, seen), number in self._numbers.items()]

    def restore(self, saved: list) -> None:
        """Start from a saved run's numbers (before this run's graphs give any), so that each
        product the saving run had met keeps its number whichever graph meets it first here (an
        evaluation that skips a training-only product before it)."""
        for key, place, seen, number in saved:
            key = tuple(key)
            self._numbers[(key, place if isinstance(place, (str, type(None))) else tuple(map(tuple, place)), seen)] = number
            self._next[key] = max(self._next[key], number + 1)

    def graph(self) -> Callable[[tuple, fx.Node], int]:
        seen: collections.Counter = collections.Counter()

        def number(key: tuple, node: fx.Node) -> int:
            trace = _place_in_owner(node)
            place = (key, trace, seen[(key, trace)])
            seen[(key, trace)] += 1
            if place not in self._numbers:
                self._numbers[place] = self._next[key]
                self._next[key] += 1
            return self._numbers[place]

        return number


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def written_at(node: fx.Node) -> str:
    """What a node calls and the line of the user's code that made it, where its trace says."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    return f"{target_name(node)} at {os.path.basename(frames[-1][0])}:{frames[-1][1]}" if frames else target_name(node)


def _place_in_owner(node: fx.Node) -> object:
    """A product's place in the source as its owner module's code sees it: the frames of its
    stack trace ((file, line, function) each) from the owner's forward on, so that the frames of
    whatever called the owner (a decorator's wrapper, or a checkpointing layer's line, that one
    graph entered through and another did not: transformers' training and evaluation) do not make
    the same product another; the whole trace where the owner's forward is not in it."""
    trace = node.meta.get("stack_trace")
    stack = node.meta.get("nn_module_stack") or {}
    forward = _forward_lines(list(stack.values())[-1][1]) if trace and stack else None
    if forward is None:
        return trace
    frames = _FRAME.findall(trace)
    file, first, last = forward
    inside = [i for i, (f, line, _) in enumerate(frames) if f == file and first <= int(line) <= last]
    # Files by their names alone: a run resumed from another checkout finds the same places.
    return tuple((os.path.basename(f), line, function) for f, line, function in frames[inside[-1]:]) if inside else trace


@functools.cache
def _forward_lines(owner: object) -> Optional[tuple[str, int, int]]:
    """(file, first line, last line) of the forward a module class runs (its own or inherited;
    a resumed frame's code lies within it too), or None where it has no source."""
    try:
        forward = inspect.unwrap(owner.forward)
        lines, first = inspect.getsourcelines(forward)
        return inspect.getsourcefile(forward), first, first + len(lines) - 1
    except (AttributeError, TypeError, OSError):  # not a class with a forward, or one of no file
        return None


def find_gemms(
    gm: fx.GraphModule, example_inputs: Sequence[object], frame: Frame = Frame(), numbers: Optional[FunctionalNumbers] = None
) -> list[GemmSite]:
    """Annotate and return the GEMM sites of ``gm`` in graph order, those of bodies (body_of) included,
    named from the model's root by ``frame``, functional products numbered by ``numbers`` (the
    model's, across its graphs)."""
    sites: list[GemmSite] = []
    _find(gm, parameter_nodes(gm, example_inputs), (numbers or FunctionalNumbers()).graph(), sites, frame)
    return sites


def parameter_path(source: str) -> str:
    """A lifted parameter's Dynamo source ("L['self']._modules['fc1']._parameters['weight']") as
    named_parameters spells it relative to the frame's module ("fc1.weight")."""
    return re.sub(r"(^|\.)_(modules|parameters)(?=\.)", "", fqn_from_stack_path(source)).strip(".")


def nodes_and_bodies(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes of ``gm`` and of the graphs its higher-order ops call (a checkpointed block's)."""
    return [node for module in gm.modules() if isinstance(module, fx.GraphModule) for node in module.graph.nodes]


def number_module_calls(gm: fx.GraphModule) -> None:
    """Number a module's calls per path as Dynamo does, with the paths that name one place
    counted as one: Dynamo counts "L['self'].blocks.1" and get_submodule's "getattr(L['self'].blocks,
    '1')" apart, each from 0, which gave two calls of blocks.1 one call index, so one site label.
    Calls through one spelling keep Dynamo's numbers."""
    stacks = [node for node in nodes_and_bodies(gm) if node.meta.get("nn_module_stack")]
    spellings = collections.defaultdict(set)
    for node in stacks:
        for key, (path, _) in node.meta["nn_module_stack"].items():
            spellings[str(key).split("@")[0], _attributes(path)].add(path)
    numbers: dict[tuple[object, str], str] = {}
    calls: collections.Counter = collections.Counter()
    for node in stacks:
        stack = {}
        for key, (path, kind) in node.meta["nn_module_stack"].items():
            place = (str(key).split("@")[0], _attributes(path))
            if len(spellings[place]) > 1 and (key, path) not in numbers:
                numbers[key, path] = f"{place[0]}@{calls[place]}" if calls[place] else place[0]
                calls[place] += 1
            stack[numbers.get((key, path), key)] = (path, kind)
        node.meta["nn_module_stack"] = stack  # a new dict: Dynamo's graph shares the old one


def body_of(gm: fx.GraphModule, node: fx.Node) -> Optional[fx.GraphModule]:
    """The subgraph a higher-order op calls on its other arguments, for the ops whose GEMMs are
    sites like any other (torch.utils.checkpoint's tag_activation_checkpoint); else None."""
    if node.op == "call_function" and node.target is torch.ops.higher_order.tag_activation_checkpoint:
        return first_subgraph(gm, node)
    return None


def first_subgraph(gm: fx.GraphModule, node: fx.Node) -> Optional[fx.GraphModule]:
    """The graph of ``gm`` that higher-order op ``node`` names first (a checkpoint's body, a custom
    autograd.Function's forward), else None."""
    body = node.args[0] if node.args else None
    return getattr(gm, body.target) if isinstance(body, fx.Node) and body.op == "get_attr" else None


# The meta key of an nn.Linear's own product that is no site (an integer input's), naming the module.
UNQUANTIZED_LINEAR = "graphquant_unquantized_linear"


def _find(
    gm: fx.GraphModule, parameters: set[fx.Node], number: Callable[[tuple, fx.Node], int], sites: list[GemmSite], frame: Frame,
    in_body: bool = False,
) -> None:
    transformed, reaching = inside_transforms(gm), gradient_reaching(gm.graph)
    for node in gm.graph.nodes:
        body = body_of(gm, node)
        if body is not None:
            inner = zip(body.graph.find_nodes(op="placeholder"), node.args[1:])
            _find(body, {p for p, arg in inner if arg in parameters}, number, sites, frame, in_body=True)
            continue
        form = product_form(node)
        if form is None:
            why = _unquantized_product(node)
            if why is not None:
                node.meta["graphquant_skip"] = why
            continue
        if node in transformed:
            node.meta["graphquant_skip"] = transformed[node]
            continue
        if form == GROUPED:
            _find_grouped(node, number, sites, frame, backward=_requires_grad(node) and node in reaching)
            continue
        if form == FROZEN:
            _find_frozen(node, sites, frame)
            continue
        operands = _operands(node, form)
        if operands is None:
            node.meta["graphquant_skip"] = "not a two-operand product graphquant can express as x @ w^T"
            continue
        a, b, w_is_transposed = operands
        shapes = _torchao_operand(a, b) or _shapes(node, form, a, b, w_is_transposed)
        owner, call, module_is_linear = owner_of(node, frame)
        if isinstance(shapes, str):
            node.meta["graphquant_skip"] = shapes
            if form == LINEAR and module_is_linear and frame.multiplies_own_weight(b, owner):
                node.meta[UNQUANTIZED_LINEAR] = owner  # the module's own product, listed unquantized: no other code reads its weight
            continue
        x_sizes, w_sizes, batched, einsum = shapes
        is_linear = form == LINEAR or (form in (MATMUL, ADDMM, EINSUM) and not batched and b in parameters)
        backward = _requires_grad(node) and node in reaching  # not under no_grad, nor cut off by detach (a teacher)
        if is_linear and module_is_linear and frame.multiplies_own_weight(b, owner):
            name = owner
        else:
            kind = "linear" if is_linear else "matmul"
            name = ".".join(p for p in (owner, kind, str(number((owner, call, kind), node))) if p)
        site = GemmSite(
            form=form,
            module_type="linear" if is_linear else "matmul",
            name=name,
            call=call,
            batched=batched,
            x_shape=_static_shape(x_sizes),
            w_shape=_static_shape(w_sizes),
            x_sizes=x_sizes,
            w_sizes=w_sizes,
            einsum=einsum,
            in_body=in_body,
            gradients=(backward and _requires_grad(a), backward and _requires_grad(b)),
        )
        node.meta["graphquant_site"] = site
        sites.append(site)


def _find_grouped(node: fx.Node, number: Callable[[tuple, fx.Node], int], sites: list[GemmSite], frame: Frame, backward: bool) -> None:
    """Annotate a torch._grouped_mm node: a site in its MoE form, else the reason it is skipped;
    ``backward``: whether a backward reaches it (its operands' gradients as a linear's)."""
    args = dict(zip(("mat_a", "mat_b", "offs", "bias", "out_dtype"), node.args)) | dict(node.kwargs)
    va, vb = _value(args.get("mat_a")), _value(args.get("mat_b"))
    if va is None or vb is None or va.dim() != 2 or vb.dim() != 3 or args.get("offs") is None:
        batched = va is not None and vb is not None and va.dim() == vb.dim() == 3 and args.get("offs") is None
        node.meta["graphquant_skip"] = "torch._grouped_mm: only x (T, K) with w (E, K, N) and offs is quantized" + (
            "; x (E, C, K) with w (E, K, N) is torch.bmm's product, which is quantized (a matmul site) spelled torch.bmm(x, w) or x @ w"
            if batched else ""
        )
        return
    if args.get("bias") is not None or args.get("out_dtype") not in (None, va.dtype):
        node.meta["graphquant_skip"] = "torch._grouped_mm with bias or out_dtype is not quantized"
        return
    if not (va.dtype.is_floating_point and vb.dtype.is_floating_point):
        node.meta["graphquant_skip"] = f"{va.dtype} x {vb.dtype} is not a floating-point product; it runs exactly, unquantized"
        return
    owner, call, _ = owner_of(node, frame)
    name = ".".join(p for p in (owner, "grouped_linear", str(number((owner, call, "grouped_linear"), node))) if p)
    experts, k, n = vb.shape
    x_sizes, w_sizes = (1, va.shape[0], k), (experts, n, k)
    site = GemmSite(
        GROUPED, "grouped_linear", name, call, False, _static_shape(x_sizes), _static_shape(w_sizes), x_sizes, w_sizes,
        gradients=(backward and _requires_grad(args["mat_a"]), backward and _requires_grad(args["mat_b"])),
    )
    node.meta["graphquant_site"] = site
    sites.append(site)


def _find_frozen(node: fx.Node, sites: list[GemmSite], frame: Frame) -> None:
    """Annotate a graphquant::frozen_linear node: a linear site named after the FrozenLinear that
    called it (graphquant.freeze put it where an nn.Linear was), its weight shape from the op."""
    x = _value(node.args[0])
    n, k = node.args[3]
    owner, call, _ = owner_of(node, frame)
    x_sizes, w_sizes = (1, math.prod(x.shape[:-1]), k), (1, n, k)
    site = GemmSite(FROZEN, "linear", owner, call, False, _static_shape(x_sizes), _static_shape(w_sizes), x_sizes, w_sizes)
    node.meta["graphquant_site"] = site
    sites.append(site)


# By name: graphquant.ops.frozen registers the op, and this pass only reads graphs (imports no ops).
_FROZEN_OP = "graphquant::frozen_linear"


def product_form(node: fx.Node) -> Optional[str]:
    """The form of site a Dynamo graph's ``node`` is (LINEAR, MATMUL, ...), None for other nodes."""
    if node.op == "call_function":
        if getattr(getattr(node.target, "_schema", None), "name", None) == _FROZEN_OP:
            return FROZEN
        return _FUNCTIONS.get(node.target)
    if node.op == "call_method":
        return _METHODS.get(node.target)
    return None


def inside_transforms(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """The nodes of ``gm`` that run inside a torch.func transform (vmap, grad, jvp), which
    graphquant's quantized products and attention do not run under, each with that reason."""
    transforms: list[str] = []
    inside = {}
    for node in gm.graph.nodes:
        entered = _transform_entered(node)
        if entered:
            transforms.append(entered)
        elif entered == "" and transforms:  # a graph may start inside one (a graph break in its function)
            transforms.pop()
        elif transforms:
            inside[node] = f"inside torch.func's {transforms[-1]}, which graphquant's quantized ops do not run under: it runs in high precision"
    return inside


def _transform_entered(node: fx.Node) -> Optional[str]:
    """The torch.func transform ("vmap", "grad", "jvp") whose level ``node`` enters as Dynamo
    traces it, "" where it leaves one, None for any other node."""
    name = getattr(node.target, "__name__", "") if node.op == "call_function" else ""
    for suffix, entering in (("_increment_nesting", True), ("_decrement_nesting", False)):
        if name.startswith("_") and name.endswith(suffix) and "functorch" in (getattr(node.target, "__module__", None) or ""):
            return name[1 : -len(suffix)] if entering else ""
    return None


def _unquantized_product(node: fx.Node) -> Optional[str]:
    """Why ``node``, a matrix product of floating-point values graphquant has no site for, runs in
    high precision; None for others (vector products, as a rotary embedding's torch.outer, are no
    GEMMs; integer products run exactly)."""
    value = _value(node)
    if isinstance(value, torch.Tensor) and not value.is_floating_point():
        return None
    if node.op == "call_function":
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            target = target.overloadpacket
        if target in matrix_products.OPS or target in (torch.ops.aten.matmul, torch.ops.aten.linear):
            return f"torch.ops.aten.{target.__name__} called as an op runs in high precision: {_RESPELL}"
        return _UNQUANTIZED_FUNCTIONS.get(node.target)
    if node.op == "call_method" and node.target in _UNQUANTIZED_METHODS:
        return f"Tensor.{node.target} runs in high precision: {_RESPELL}"
    return None


def _operands(node: fx.Node, form: str) -> Optional[tuple[fx.Node, fx.Node, bool]]:
    """(x, w-or-b, whether w is b transposed) as graph nodes."""
    args = list(node.args)
    if form == LINEAR:
        return args[0], node.kwargs.get("weight", args[1] if len(args) > 1 else None), False
    if form == MATMUL:
        return args[0], node.kwargs.get("other", args[1] if len(args) > 1 else node.kwargs.get("mat2")), True
    if form == ADDMM:
        _, a, b = addmm_operands(node)
        return a, b, True
    if form == EINSUM:
        operands = args[1:] if len(args) > 2 else (args[1] if len(args) > 1 else [])
        if len(operands) != 2 or not isinstance(args[0], str):
            return None
        return operands[0], operands[1], True
    return None


def site_weight(node: fx.Node) -> Optional[fx.Node]:
    """The node a site reads as its weight (or other operand), as the site's form says."""
    operands = _operands(node, node.meta["graphquant_site"].form)
    return operands[1] if operands is not None else None


def addmm_operands(node: fx.Node) -> tuple[object, object, object]:
    """(c, a, b) of an addmm or baddbmm node, beta * c + alpha * (a @ b), however they are passed:
    torch.addmm(c, a, b), c.addmm(a, b), or by keyword (mat1 / mat2, batch1 / batch2; BLOOM's
    alibi.baddbmm(batch1=q, batch2=k))."""
    args, kwargs = list(node.args), node.kwargs
    names = ("input", "batch1", "batch2") if "batch1" in kwargs or "batch2" in kwargs else ("input", "mat1", "mat2")
    given = dict(zip(names, args)) | {name: kwargs[name] for name in names if name in kwargs}
    return given.get("input"), given.get("mat1", given.get("batch1")), given.get("mat2", given.get("batch2"))


def _requires_grad(node: object) -> bool:
    value = _value(node)
    return value is None or value.requires_grad


_DETACH = {torch.detach, torch.Tensor.detach, torch.ops.aten.detach, torch.ops.aten.detach.default}


def gradient_reaching(graph: fx.Graph) -> set[fx.Node]:
    """The nodes a backward can reach: those with a path of users to the graph's output, or to a
    node of no users (an effect: assumed to), that no detach cuts (a target network's or an EMA
    teacher's output, detached, gets no gradient, so its product runs no dgrad or wgrad)."""
    todo = [node for node in graph.nodes if node.op == "output" or not node.users]
    reached = set(todo)
    while todo:
        node = todo.pop()
        if (node.op == "call_method" and node.target == "detach") or (node.op == "call_function" and node.target in _DETACH):
            continue  # its input gets no gradient through it
        for source in node.all_input_nodes:
            if source not in reached:
                reached.add(source)
                todo.append(source)
    return reached


def _value(node: object) -> Optional[torch.Tensor]:
    return node.meta.get("example_value") if isinstance(node, fx.Node) else None


def traced_number(arg: object) -> object:
    """``arg`` as the Python number it is where Dynamo traced a model's number as a symbol (a float
    attribute under dynamic=True, as transformers' scaling and attention_dropout): read as a
    constant, guarded on, so that another value recompiles; any other argument as it is."""
    value = _value(arg)
    if isinstance(value, torch.SymFloat):
        return float(value)
    return int(value) if isinstance(value, torch.SymInt) else arg


def _torchao_operand(a: fx.Node, b: fx.Node) -> Optional[str]:
    """Why a product of a torchao tensor subclass (a weight torchao.quantization.quantize_ made an
    Int8Tensor or Float8Tensor) is no site: the subclass runs torchao's own quantized product,
    which graphquant cannot quantize again; None for others."""
    for value in (_value(a), _value(b)):
        kind = type(value)
        if from_torchao(kind):
            return (
                f"an operand is a torchao tensor subclass ({kind.__module__}.{kind.__name__}), which runs torchao's own "
                "quantized product, not the recipe's: graphquant cannot quantize it again (leave the module out of "
                "torchao's quantize_, through its filter_fn, for the recipe to quantize it)"
            )
    return None


def from_torchao(kind: object) -> bool:
    """Whether a class is torchao's, known by its module: torchao is no dependency of graphquant."""
    return isinstance(kind, type) and kind.__module__.split(".")[0] == "torchao"


def _static_shape(sizes: Sequence[object]) -> tuple[Optional[int], ...]:
    """``sizes`` with each symbolic one (a torch.SymInt) as None."""
    return tuple(size if isinstance(size, int) else None for size in sizes)


def _shapes(node: fx.Node, form: str, a: fx.Node, b: fx.Node, w_is_transposed: bool):
    """(x_sizes, w_sizes, batched, an einsum's layout) for y = x @ w^T, or the reason the product
    is not quantized."""
    va, vb = _value(a), _value(b)
    if va is None or vb is None:
        return "operand shapes unknown"
    if not (va.dtype.is_floating_point and vb.dtype.is_floating_point):
        outcome = "torch refuses operands of different dtypes" if va.dtype != vb.dtype else "it runs exactly, unquantized"
        return f"{va.dtype} x {vb.dtype} is not a floating-point product; {outcome}"
    if form == EINSUM:
        layout = einsum_layout(node.args[0], tuple(va.shape), tuple(vb.shape))
        if layout is None:
            return f"einsum {node.args[0]!r} is not a single (batched) matrix product"
        x_sizes, w_sizes, _ = layout.shapes(va.shape, vb.shape)
        return x_sizes, w_sizes, layout.batch_dims > 0, layout
    if va.dim() < 2 or vb.dim() < 2:
        return "a 1-D operand (matrix-vector product)"
    k = va.shape[-1]
    if vb.dim() == 2:
        n = vb.shape[-1] if w_is_transposed else vb.shape[0]
        return (1, math.prod(va.shape[:-1]), k), (1, n, k), False, None
    if tuple(va.shape[:-2]) != tuple(vb.shape[:-2]):
        return f"batch dims {tuple(va.shape[:-2])} and {tuple(vb.shape[:-2])} broadcast: {_unbroadcast(va.shape, vb.shape)}"
    batch = math.prod(va.shape[:-2])
    return (batch, va.shape[-2], k), (batch, vb.shape[-1], k), True, None


def _unbroadcast(a_shape: Sequence, b_shape: Sequence) -> str:
    """How to write a matmul whose batch dims broadcast as a site: the einsum that spells it where
    no dim broadcasts from size 1 (an operand lacks the other's leading batch dims: per-head
    weights), else one batch shape."""
    batch = max(len(a_shape), len(b_shape)) - 2
    a_batch, b_batch = a_shape[:-2], b_shape[:-2]
    if batch > 8 or any(x != y for x, y in zip(reversed(a_batch), reversed(b_batch))):
        return "expand the operands to one batch shape, which graphquant quantizes"
    letters = "abcdefgh"[:batch]
    equation = f"{letters[batch - len(a_batch):]}mk,{letters[batch - len(b_batch):]}kn->{letters}mn"
    return f"expand the operands to one batch shape, or spell the product as a two-operand torch.einsum ({equation!r}), which graphquant quantizes"


# A frame's local and the subscripts that pick a module out of it: L['self'], L['fn'], L['args'][0]
# where a decorator wraps forward(*args) (HuggingFace models), a list or dict of modules that a
# frame resumed after a graph break holds (L['mods'][1], L['heads']['q']), and the module of a bound
# method it holds (L['___stack0'].__self__: a break inside ``self.merge(f(x))`` leaves self.merge
# on the stack).
_ROOT_PREFIX = re.compile(r"^L\['[^']*'\](?:\[(?:\d+|'[^']*')\])*(?:\.__self__)?\.?")


_GETATTR = re.compile(r"getattr\((.*), '([^']*)'\)")


def _attributes(path: str) -> str:
    """``path`` with each ``getattr(X, 'name')`` (a module that get_submodule returned) as X.name."""
    while _GETATTR.search(path):
        path = _GETATTR.sub(r"\1.\2", path)
    return path


def fqn_from_stack_path(path: str) -> str:
    """Dynamo's module path ("L['self'].layers[0].fc1", "L['self'].layers.0.fc1", "L['args'][0].layers.0.fc1"
    or "getattr(L['self'].layers, '0')") as named_modules spells it; a global module's ("G['model'].fc1")
    after its variable's name."""
    path = _ROOT_PREFIX.sub("", _attributes(path))
    path = re.sub(r"^G\['([^']*)'\]", r"\1", path)  # a global module a compiled function calls: its variable's name
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']*)'\]", r".\1", path)
    return without_compile_wrappers(path).strip(".")


def without_compile_wrappers(name: str) -> str:
    """A module's name without the ``_orig_mod`` of the torch.compile wrappers on its path: the
    name its sites take ("a.fc1" for named_modules' "a._orig_mod.fc1")."""
    return name.replace("._orig_mod", "").removeprefix("_orig_mod.")


def root_local(path: str) -> Optional[str]:
    """The frame's local a Dynamo path starts from ("L['self']", "L['args'][0]"), or None."""
    match = _ROOT_PREFIX.match(_attributes(path))
    return match.group(0).rstrip(".") if match else None


def target_name(node: fx.Node) -> str:
    """What a node calls as a reader knows it: a method's name, a function's ("softmax")."""
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))


def owner_of(node: fx.Node, frame: Frame) -> tuple[str, int, bool]:
    """(owner's qualified name, which call of the owner this is, whether the owner is an nn.Linear)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return frame.own, 0, False
    key, (path, module_type) = list(stack.items())[-1]
    call = int(key.rsplit("@", 1)[1]) if "@" in str(key) else 0
    is_linear = isinstance(module_type, type) and issubclass(module_type, torch.nn.Linear)
    return *frame.call_of(frame.name(path), call), is_linear


def parameter_nodes(gm: fx.GraphModule, example_inputs: Sequence[object]) -> set[fx.Node]:
    """Graph nodes that are module parameters (lifted placeholders, or get_attr of a Parameter)."""
    parameters = set()
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        if isinstance(value, torch.nn.Parameter):
            parameters.add(node)
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(_get_attr(gm, node.target), torch.nn.Parameter):
            parameters.add(node)
    return parameters


def _get_attr(gm: fx.GraphModule, target: str) -> object:
    value: object = gm
    for part in target.split("."):
        value = getattr(value, part, None)
    return value
