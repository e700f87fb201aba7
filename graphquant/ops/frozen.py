"""The ops of a linear whose weight graphquant.freeze stores quantized (graphquant.freezing).

``graphquant::frozen_linear`` is what a FrozenLinear's forward puts in the graph: one node that
find_gemms takes for a linear site and the rewrite replaces with
graphquant.ops.functional.quantized_frozen_linear, so it never runs itself. A frozen model has no
backward: ``refuse_backward`` gives a product a backward that fails when it runs, naming the
module (aot_autograd traces that backward without running it).

``graphquant::frozen_weight_stand_in`` is what a FrozenLinear's ``weight`` gives compiled code: a
tensor of the weight's shape and dtype on the stored weight's device, so that model code reading
its ``.device`` (``x.to(self.fc.weight.device)``), ``.dtype`` or ``.shape`` traces as before. The
backend removes the node where nothing uses it and refuses the graph where something reads its
values (compiler.drop_frozen_weight_stand_ins).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from graphquant.ops import registry

# The stored parts of a frozen weight's rowwise representation (Representation.tensors' order).
STORED_PARTS = ("codes", "scale", "amax")


@registry.op("frozen_linear")
def frozen_linear(
    x: torch.Tensor,
    weight: list[torch.Tensor],
    spec: str,
    shape: Sequence[int],
    dtype: torch.dtype,
    bias: Optional[torch.Tensor],
    name: str,
) -> torch.Tensor:
    """F.linear(x, w, bias) with w, of logical ``shape`` and dtype ``dtype``, stored as ``weight``:
    the tensors of its rowwise representation in the format ``spec``. Only its graph node is used."""
    raise RuntimeError(
        f"graphquant: {name} is a frozen linear (graphquant.freeze, weight {spec}) and runs only inside the "
        "graphquant.compile'd model it was frozen in; it was called outside it (the module called directly, or "
        "Dynamo ran its code eagerly). Call the model graphquant.compile returned"
    )


@registry.fake("frozen_linear")
def _(x, weight, spec, shape, dtype, bias, name):
    return x.new_empty((*x.shape[:-1], shape[0]), dtype=torch.promote_types(x.dtype, dtype))


@registry.op("frozen_weight_stand_in")
def frozen_weight_stand_in(codes: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, name: str) -> torch.Tensor:
    """Zeros of ``shape`` and ``dtype`` on ``codes``' device in one element's memory (every stride 0):
    frozen linear ``name``'s weight as compiled code sees it. Only its graph node is used, for its
    metadata; the backend refuses a graph that reads its values."""
    return torch.empty_strided(tuple(shape), (0,) * len(shape), dtype=dtype, device=codes.device).zero_()


@registry.fake("frozen_weight_stand_in")
def _(codes, shape, dtype, name):
    return torch.empty_strided(tuple(shape), (0,) * len(shape), dtype=dtype, device=codes.device)


@registry.op("refused_backward")
def refused_backward(grad: torch.Tensor, shape: Sequence[int], message: str) -> torch.Tensor:
    """The gradient of a tensor of ``shape`` that has none: raises ``message``."""
    raise RuntimeError(message)


@registry.fake("refused_backward")
def _(grad, shape, message):
    return grad.new_empty(tuple(shape))


class _RefusedBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, y: torch.Tensor, message: str, bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.x_shape, ctx.message = tuple(x.shape), message
        ctx.bias_shape = None if bias is None else tuple(bias.shape)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x_grad = torch.ops.graphquant.refused_backward(grad, ctx.x_shape, ctx.message)
        bias_grad = None if ctx.bias_shape is None else torch.ops.graphquant.refused_backward(grad, ctx.bias_shape, ctx.message)
        return x_grad, None, None, bias_grad


def refuse_backward(x: torch.Tensor, y: torch.Tensor, label: str, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``y``, computed from ``x`` (and ``bias``, which y's product read detached) at the frozen site
    ``label`` (a linear or an expert stack), with a backward into x and the bias that fails: a
    bias that requires grad makes y require it too, so that a backward from an input that does
    not fails here, naming the site, and not with autograd's "does not require grad"."""
    message = (
        f"graphquant: backward through {label}, whose weight graphquant.freeze stored quantized for "
        "the forward alone (no high-precision weight, no columnwise copy), so a frozen model has no backward. Train "
        "the model with its high-precision weights (graphquant.compile without freeze), or call it under "
        "torch.no_grad()"
    )
    return _RefusedBackward.apply(x, y, message, bias)
