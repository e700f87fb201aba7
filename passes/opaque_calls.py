"""Pass 1c (annotate): the calls Dynamo keeps whole whose matrix products graphquant cannot see.

A function given to ``torch.compiler.allow_in_graph`` (einops does it to its own functions, its
einsum among them) is one node of the Dynamo graph: the passes never see its code, so its products
would run in high precision without a word. Running it on the node's fake example values under a
dispatch mode finds them; its node carries ``"graphquant_skip"`` with what it multiplies, for the
plan's "not quantized" list, and the compiler warns of it.

A custom torch.autograd.Function in a training graph is one call too (Dynamo keeps its forward
and the backward the model wrote as the bodies of one higher-order op, which graphquant does not
rewrite): where its forward multiplies matrices, it is listed and warned of alike. One given to
``torch.compiler.allow_in_graph`` is one call in any graph, run on fake values as a function is;
one that a torchao module calls (Float8Linear: torchao allows its Functions in graphs) runs
torchao's low-precision linear, not the recipe's, and is listed and warned of so.

A custom op of another library (``torch.library``; transformers' ``grouped_mm_fallback`` runs
Mixtral's float32 experts) is one node too, and its fake implementation computes nothing, so
running it tells nothing: one that takes a floating-point matrix is listed as not quantized, as
something graphquant cannot see into, without a warning (most such ops multiply nothing).

Expects: a Dynamo graph whose nodes carry ``example_value``. Guarantees: the graph is unchanged.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
from typing import Optional

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from graphquant.passes import matrix_products
from graphquant.passes.find_gemms import first_subgraph, from_torchao, nodes_and_bodies, product_form


def mark_opaque_products(gm: fx.GraphModule) -> list[fx.Node]:
    """Give each opaque call that multiplies matrices (or cannot be run to tell) its reason to be
    listed as not quantized; returns those nodes."""
    marked = []
    for node in nodes_and_bodies(gm):
        if node.op != "call_function":
            continue
        if _foreign_op(node.target) and _takes_a_matrix(node):
            node.meta["graphquant_skip"] = (
                f"{_op_name(node.target)} is a custom op whose code graphquant does not see: any product inside it runs in high precision"
            )
            continue
        allowed = _allowed_function(node.target)
        if _opaque(node.target):
            reason = _hidden_products(node, node.target.__qualname__)
        elif allowed is not None:
            reason = _torchao_function(node) or _hidden_products(node, f"{allowed.__qualname__}.apply")
        elif node.target is torch.ops.higher_order.autograd_function_apply:
            reason = _custom_function_products(node)
        else:
            continue
        if reason is not None:
            node.meta["graphquant_skip"] = reason
            marked.append(node)
    return marked


def _opaque(target: object) -> bool:
    """Whether a graph node's target is a Python function of the user's or a library's, which Dynamo
    put in the graph as it is (torch's own functions are torch's ops, which the passes know)."""
    return inspect.isfunction(target) and not (target.__module__ or "").startswith("torch")


# graphquant's ops and torch's own (the namespaces of torch._C._dispatch_get_all_op_names() after
# importing torch, torch.distributed and torch._dynamo), which are not another library's code.
_KNOWN_NAMESPACES = frozenset({
    "graphquant", "aten", "prims", "_c10d_functional", "_c10d_functional_autograd", "c10d", "c10d_functional", "_dtensor",
    "_native", "_quantized", "quantized", "quantization", "debug_mode_ops", "debugprims", "export", "flex_lib", "fsdp",
    "inductor", "inductor_prims", "mkl", "mkldnn", "mkldnn_prepacked", "onednn", "onnx", "onnx_symbolic", "prepacked", "profiler",
    "rngprims", "sparse", "static_runtime", "streams", "symm_mem",
})


def _foreign_op(target: object) -> bool:
    """Whether a graph node's target is an op another library registered with torch.library (Dynamo
    puts an op called without its overload in the graph as its packet)."""
    if not isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return False
    return _op_name(target).split("::")[0] not in _KNOWN_NAMESPACES


def _op_name(target: torch._ops.OpOverload | torch._ops.OpOverloadPacket) -> str:
    """"namespace::name" of an op or its packet."""
    return (target if isinstance(target, torch._ops.OpOverloadPacket) else target.overloadpacket)._qualified_op_name


def _takes_a_matrix(node: fx.Node) -> bool:
    """Whether any of ``node``'s tensor inputs is a floating-point matrix (or a stack of them)."""
    values = [a.meta.get("example_value") for a in node.all_input_nodes]
    return any(isinstance(v, torch.Tensor) and v.dim() >= 2 and v.is_floating_point() for v in values)


def _hidden_products(node: fx.Node, name: str) -> Optional[str]:
    """Why ``node``'s products (a call of ``name``) run in high precision, or None where it
    multiplies no matrices."""
    whole = f"{name} is one call in the graph (torch.compiler.allow_in_graph), whose code graphquant does not see"
    args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), lambda a: a.meta.get("example_value") if isinstance(a, fx.Node) else a)
    values = [v for v in tree_leaves((args, kwargs)) if isinstance(v, FakeTensor)]
    # The example values' own fake mode (the backend's is another); a call given no tensor, the graph's.
    fake_mode = values[0].fake_mode if values else getattr(torch._guards.TracingContext.try_get(), "fake_mode", None)
    if fake_mode is None:
        return f"{whole}; it has no example values to run on, so any product inside it runs in high precision"
    products = _ProductCounter()
    try:
        with fake_mode, _no_new_symbols(fake_mode.shape_env), products, torch.no_grad():
            node.target(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - any failure means we cannot tell
        return f"{whole}; running it on fake tensors to find its products failed ({type(error).__name__}), so any product inside it runs in high precision"
    if not products.seen:
        return None
    return (
        f"{whole}: its {matrix_products.described(products.seen)} run in high precision; graphquant quantizes them where "
        "Dynamo traces the code (a function not given to allow_in_graph; torch.einsum in place of einops.einsum)"
    )


def _custom_function_products(node: fx.Node) -> Optional[str]:
    """Why the products of a custom torch.autograd.Function's forward (the first body of
    ``node``) run in high precision, or None where it multiplies no matrices."""
    forward = first_subgraph(node.graph.owning_module, node)
    if not isinstance(forward, fx.GraphModule):
        return None
    products = collections.Counter(getattr(n.target, "__name__", str(n.target)) for n in forward.graph.nodes if product_form(n) is not None)
    if not products:
        return None
    return (
        f"a custom torch.autograd.Function is one call in a training graph, whose code graphquant does not rewrite: its "
        f"forward's {matrix_products.described(products)} run in high precision (without gradients Dynamo traces the "
        "forward as the model's own code, quantized); multiply outside the Function, or through an nn.Linear, to quantize it"
    )


def _allowed_function(target: object) -> Optional[type]:
    """The custom torch.autograd.Function given to torch.compiler.allow_in_graph (as torchao's
    are) that a graph node calls whole, through the function Dynamo makes for it, or None."""
    if not (inspect.isfunction(target) and target.__name__ == "trampoline_autograd_apply" and target.__closure__):
        return None
    function = target.__closure__[0].cell_contents  # the Function class, the one variable the trampoline closes over
    return function if isinstance(function, type) and issubclass(function, torch.autograd.Function) else None


def _torchao_function(node: fx.Node) -> Optional[str]:
    """Why a custom torch.autograd.Function that one of torchao's modules calls (the Float8Linear
    of torchao.float8.convert_to_float8_training) is not quantized: it is torchao's own
    low-precision linear, which the recipe does not reach; None for a call in any other module."""
    stack = node.meta.get("nn_module_stack") or {}
    kind = list(stack.values())[-1][1] if stack else None
    if not from_torchao(kind):
        return None
    return (
        f"{kind.__module__}.{kind.__name__} runs torchao's own low-precision linear (its autograd Function), not the "
        "recipe's formats: leave the module out of torchao's conversion (convert_to_float8_training's module_filter_fn) "
        "for the recipe to quantize it"
    )


def _no_new_symbols(shape_env: Optional[ShapeEnv]) -> contextlib.AbstractContextManager:
    """A run that adds no guard and leaves no unbacked symbol (a data-dependent size) to the graph's
    shape environment: the graph's own trace already took its call."""
    if shape_env is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(shape_env.suppress_guards())
    stack.enter_context(shape_env.ignore_fresh_unbacked_symbols())
    return stack


class _ProductCounter(TorchDispatchMode):
    """Counts the matrix products that run under it, by aten op name."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in matrix_products.OPS:
            self.seen[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))
