"""The functions a rewritten graph calls in place of each GEMM (passes/rewrite.py).

Each takes the GEMM's operands as the original call did, its ``site`` (a Site: formats by role
and how it runs), and the slot state the graph supplies: ``states``, the delayed-scaling state
of x, w and grad_output (None where a format keeps none), and ``rng``, the step's int64
[seed, step] where a format rounds stochastically.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from graphquant.ops import autocast
from graphquant.ops.frozen import refuse_backward
from graphquant.ops.inference import inference_products, quantized_weights_product
from graphquant.ops.operands import Operand
from graphquant.ops.quantized_gemm import QuantizedGemm
from graphquant.ops.site import Site
from graphquant.quantizers import ROWWISE

NO_STATES = (None, None, None)


@autocast.operands_cast
def quantized_linear(x, w, bias=None, *, site: Site, states=NO_STATES, rng=None):
    """F.linear(x, w, bias) in the site's formats; fprop alone where ``site.inference``."""
    if site.inference:
        (y,) = quantized_linears_sharing_x(x, (w,), (bias,), sites=(site,), states=(states,), rng=rng)
        return y
    y = _product(x.flatten(0, -2), w, 1, site, states, rng, bias)
    return y.reshape(*x.shape[:-1], w.shape[0])


@autocast.operands_cast
def quantized_linears_sharing_x(x, weights, biases, *, sites: tuple[Site, ...], states: tuple[tuple, ...], rng=None):
    """quantized_linear's inference formula for linears that read one x (a SwiGLU's gate and up
    projections), each with its weight (quantized from its value at this call), bias, site and
    slot states (``states``: one tuple each), their weights of one dtype; a tuple of their
    outputs. Several run their GEMMs in one launch of the decode or mixed-input GEMM, x quantized
    once (passes/gemms_sharing_x.py: x's format keeps no state there)."""
    for w, b, site in zip(weights, biases, sites):
        _same_dtype(site, input=x.dtype, weight=w.dtype, bias=_dtype(b))
    ys = inference_products(x.flatten(0, -2), weights, biases, sites, states, rng)
    return tuple(y.reshape(*x.shape[:-1], w.shape[0]) for y, w in zip(ys, weights))


def quantized_frozen_linear(x, weight, shape, dtype, bias=None, *, site: Site, states=NO_STATES, rng=None):
    """F.linear(x, w, bias) of a FrozenLinear (graphquant.freeze): w, of logical ``shape`` and dtype
    ``dtype``, stored as ``weight``, the tensors of its rowwise representation; fprop alone."""
    (y,) = quantized_frozen_linears_sharing_x(x, (weight,), (shape,), dtype, (bias,), sites=(site,), states=states, rng=rng)
    return y


def quantized_frozen_linears_sharing_x(x, weights, shapes, dtype, biases, *, sites: tuple[Site, ...], states=NO_STATES, rng=None):
    """quantized_frozen_linear of FrozenLinears that read one x (a SwiGLU's gate and up
    projections), each with its stored weight, logical shape, bias and site (their weights of one
    format and ``dtype``); a tuple of their outputs. Several run their GEMMs in one launch of the
    decode or mixed-input GEMM, x quantized once (passes/gemms_sharing_x.py: x's format keeps no state there, so
    ``states`` and ``rng`` are the first site's)."""
    cast = autocast.dtype_for(x)
    if cast is not None:  # x, the biases and the output in autocast's dtype; the weights stay as stored
        with torch.autocast(x.device.type, enabled=False):
            biases = tuple(None if b is None else autocast.cast(b, cast) for b in biases)
            return quantized_frozen_linears_sharing_x(autocast.cast(x, cast), weights, shapes, cast, biases, sites=sites, states=states, rng=rng)
    for b, site in zip(biases, sites):
        _same_dtype(site, input=x.dtype, weight=dtype, bias=_dtype(b))
    if math.prod(x.shape[:-1]) == 0:  # no rows: nothing reads the stored codes (which no high-precision format could)
        return tuple(x.new_empty((*x.shape[:-1], s[0])) for s in shapes)
    x2d = x.flatten(0, -2)
    ws = [Operand(list(w), site.quantizers[1].child(ROWWISE).spec, ROWWISE, (s[0], s[1]), stored=True) for w, s, site in zip(weights, shapes, sites)]
    ys = quantized_weights_product(x2d, ws, dtype, biases, sites, states, rng)
    return tuple(refuse_backward(x, y.reshape(*x.shape[:-1], s[0]), site.label, b) for y, s, site, b in zip(ys, shapes, sites, biases))


@autocast.operands_cast
def quantized_matmul(a, b, *, site: Site, states=NO_STATES, rng=None):
    """a @ b (matmul, mm, bmm) with a as input and b as other (or weight, where b is a
    Parameter: a linear site); b is quantized as b^T (n, k)."""
    if b.dim() == 2:
        y = _product(a.flatten(0, -2), b.t(), 1, site, states, rng)
        return y.reshape(*a.shape[:-1], b.shape[-1])
    batch = math.prod(a.shape[:-2])
    if batch == 0:  # no matrices: nothing to quantize, and no rows a matrix to split the operands by
        return torch.matmul(a, b)
    y = _product(a.flatten(0, -2), b.transpose(-1, -2).flatten(0, -2), batch, site, states, rng)
    return y.reshape(*a.shape[:-2], a.shape[-2], b.shape[-1])


@autocast.operands_cast
def quantized_addmm(c, a, b, *, beta=1, alpha=1, site: Site, states=NO_STATES, rng=None):
    """beta * c + alpha * (a @ b) (addmm, baddbmm), the product quantized."""
    _same_dtype(site, input=a.dtype, added=c.dtype)  # a's and b's: the product's own check
    product = quantized_matmul(a, b, site=site, states=states, rng=rng)
    product = product if alpha == 1 else alpha * product
    return product + (c if beta == 1 else beta * c)


@autocast.operands_cast
def quantized_einsum(layout, a, b, *, site: Site, states=NO_STATES, rng=None):
    """A two-operand einsum that is one batched product, quantized like quantized_matmul; ``layout``
    (graphquant.passes.einsum.EinsumLayout, as find_gemms worked it out) says how it is one."""
    (batch, m, k), (_, n, _), y_shape = layout.shapes(a.shape, b.shape)
    if batch == 0:  # as quantized_matmul's
        return torch.einsum(layout.equation, a, b)
    x = a.permute(layout.a_perm).reshape(batch * m, k)
    w = b.permute(layout.b_perm).reshape(batch * n, k)
    y = _product(x, w, batch, site, states, rng)
    return y.reshape(y_shape).permute(layout.out_perm)


def _product(
    x2d: torch.Tensor, w2d: torch.Tensor, batch: int, site: Site, states: tuple, rng: Optional[torch.Tensor], bias=None
) -> torch.Tensor:
    second = "weight" if site.weight is not None else "other"  # a matmul of two activations has no weight
    _same_dtype(site, input=x2d.dtype, **{second: w2d.dtype}, bias=_dtype(bias))
    return QuantizedGemm.apply(x2d, w2d, bias, *states, rng, site, batch)


class MixedDtypesError(TypeError):
    """A product's operands are of different dtypes, which torch's products refuse outside
    autocast (the compiled model raises it at each call, as it does a PlanError)."""


def _dtype(t: Optional[torch.Tensor]) -> Optional[torch.dtype]:
    return None if t is None else t.dtype


def _same_dtype(site: Site, **operands: Optional[torch.dtype]) -> None:
    """torch's products refuse operands of different dtypes (outside autocast, which casts them
    first: autocast.operands_cast); so does a quantized one, rather than promote them silently
    (an input left in float32 after model.to(torch.bfloat16)). ``operands``: each one's dtype by
    its name, None where it is absent."""
    given = {name: dtype for name, dtype in operands.items() if dtype is not None}
    if len(set(given.values())) > 1:
        described = ", ".join(f"{name} {dtype}" for name, dtype in given.items())
        others = {dtype for name, dtype in given.items() if name != "input"}
        if "weight" not in given:  # a product of two activations (or addmm's added tensor): no parameter sets the dtype
            remedy = "cast one operand to the other's dtype"
        elif len(others) == 1:  # the input alone differs
            remedy = f"cast the input to the model's dtype ({others.pop()})"
        else:  # the operands besides the input differ (a bias left in another dtype)
            remedy = "give the module's parameters one dtype (model.to(dtype))"
        raise MixedDtypesError(
            f"{site.label if site.name else f'the compiled model itself ({site.label})'}: its operands are of different dtypes ({described}), which torch's products refuse (they take "
            f"operands of one dtype); {remedy}, or run the model under torch.autocast"
        )
