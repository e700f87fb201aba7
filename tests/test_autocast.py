"""torch.autocast around a graphquant model: every GEMM and attention takes its operands cast to
autocast's dtype, as eager torch does, and quantizes those (as TransformerEngine does), so that a
model of float32 master weights under autocast computes the bits of its bf16 copy.
"""

import copy

import models
import pytest
import torch
from reference import fresh_dynamo  # noqa: F401

import graphquant
from graphquant import recipes, zoo
from graphquant.factories import high_precision_factory

RECIPES = {
    "high precision": lambda: graphquant.CustomRecipe(high_precision_factory),
    "mxfp8": recipes.mxfp8_block_scaling,
    "tensorwise": lambda: zoo.recipe("tensorwise"),
    "fp8 attention": lambda: zoo.with_fp8_attention(recipes.mxfp8_block_scaling()),
}


def block():
    """A linear, attention through F.scaled_dot_product_attention and a SwiGLU: x feeds one GEMM
    (several would sum its gradient in float32 under autocast, in bf16 in the copy), and there is
    no residual (its float32 input would keep the sum in float32 under autocast too)."""
    layers = (torch.nn.Linear(64, 64), models.Attention(64, 2, "sdpa", True), models.SwiGLU(64, 128))
    return models.seeded(torch.nn.Sequential(*layers))


def step(model, x, under_autocast):
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=under_autocast):
        y = model(x)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(y.dtype))
    return y, x.grad, {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_float32_weights_under_autocast_compute_their_bf16_copys_bits(recipe, backend):
    """Under Inductor too, which fuses a plain .to(bf16) into the quantize reading it and keeps
    the unrounded fp32 value there (autocast.cast rounds in ops it keeps)."""
    master = block()
    twin = copy.deepcopy(master).to(torch.bfloat16)
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(0))
    y, dx, grads = step(graphquant.compile(master, RECIPES[recipe](), backend=backend), x, True)
    y_twin, dx_twin, grads_twin = step(graphquant.compile(twin, RECIPES[recipe](), backend=backend), x.to(torch.bfloat16), False)
    assert y.dtype == torch.bfloat16 and torch.equal(y, y_twin)
    assert dx.dtype == torch.float32 and torch.equal(dx, dx_twin.float())
    for name, grad in grads.items():
        assert grad.dtype == torch.float32 and torch.equal(grad, grads_twin[name].float()), name


SPECIAL = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 65504.0, 65519.99, 65520.0, -65520.0, 2.0**-14, 2.0**-25,
           3 * 2.0**-26, 1.5 * 2.0**-24, 3.4e38, -3.4e38, 1e-45]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocasts_cast_rounds_as_to_does_eagerly_and_under_inductor(dtype):
    """Every float32 bit pattern class (normal, subnormal in the target, overflowing, NaNs of
    any payload, infinities, zeros) rounds to ``.to(dtype)``'s bits, also where Inductor fuses the
    cast into what reads it; the gradient passes as .to's."""
    from graphquant.ops.autocast import cast

    generator = torch.Generator().manual_seed(0)
    scaled = torch.randn(1 << 14, generator=generator) * 10.0 ** torch.randint(-9, 6, (1 << 14,), generator=generator)
    patterns = torch.randint(-(2**31), 2**31 - 1, (1 << 14,), generator=generator, dtype=torch.int32).view(torch.float32)
    x = torch.cat([scaled, patterns, torch.tensor(SPECIAL)])
    want = x.to(dtype)
    assert torch.equal(cast(x, dtype).view(torch.int16), want.view(torch.int16))
    fused = torch.compile(lambda t: cast(t, dtype).float() * 3.0, backend="inductor")(x)
    assert torch.equal(fused.isnan(), want.isnan()) and torch.equal(fused[~fused.isnan()], want.float()[~want.isnan()] * 3.0)
    leaf = torch.randn(8, requires_grad=True)
    cast(leaf, dtype).float().mul(2.0).sum().backward()
    assert torch.equal(leaf.grad, torch.full((8,), 2.0))


def test_a_frozen_model_under_autocast_takes_its_dtype_for_x_and_the_output():
    """Its weights stay as graphquant.freeze stored them; x is cast, and the product rounds once,
    to autocast's dtype."""
    linear = models.seeded(torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False)))
    model = graphquant.compile(linear, recipes.mxfp8_block_scaling(), mode="inference", backend="aot_eager")
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(x)
        graphquant.freeze(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x)
        expected = model(x.to(torch.bfloat16).float())  # the cast values, in the stored weights' dtype (one dtype outside autocast)
    assert y.dtype == torch.bfloat16 and torch.equal(y, expected.to(torch.bfloat16))


class Spelled(torch.nn.Module):
    """A linear, an activation product and attention with a float mask (an ALiBi-like bias, which
    transformers passes as attn_mask=), the operands passed by keyword or by position."""

    def __init__(self, by_keyword: bool):
        super().__init__()
        self.by_keyword = by_keyword
        self.weight, self.bias = torch.nn.Parameter(torch.randn(64, 64) / 8), torch.nn.Parameter(torch.randn(64))
        self.register_buffer("mask", torch.linspace(-1, 0, 32).expand(32, 32).clone())

    def forward(self, x):
        if self.by_keyword:
            h = torch.nn.functional.linear(input=x, weight=self.weight, bias=self.bias)
            h = torch.matmul(input=h, other=h.transpose(1, 2)) @ h / 64
            q = h.view(2, 32, 2, 32).transpose(1, 2)
            return torch.nn.functional.scaled_dot_product_attention(query=q, key=q, value=q, attn_mask=self.mask)
        h = torch.nn.functional.linear(x, self.weight, self.bias)
        h = torch.matmul(h, h.transpose(1, 2)) @ h / 64
        q = h.view(2, 32, 2, 32).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, self.mask)


def test_operands_given_by_keyword_are_quantized_and_cast_as_given_by_position():
    """F.linear(input=, weight=) and torch.matmul(input=, other=) failed planning (an IndexError),
    F.scaled_dot_product_attention(query=, ...) failed under fp8_dpa, and attn_mask= kept its
    float32 under autocast (torch casts it): the same bits as the positional spelling now."""
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(0))
    results = []
    for by_keyword in (True, False):
        model = models.seeded(Spelled(by_keyword))
        compiled = graphquant.compile(model, RECIPES["fp8 attention"](), backend="aot_eager")
        results.append(step(compiled, x, True))
        plan = compiled.graphquant.plan
        assert {g.module_type for g in plan.gemms} == {"linear", "matmul", "dpa"} and not plan.skipped
    (y, dx, grads), (y_positional, dx_positional, grads_positional) = results
    assert torch.equal(y, y_positional) and torch.equal(dx, dx_positional)
    for name, grad in grads.items():
        assert torch.equal(grad, grads_positional[name]), name


def test_autocast_leaves_float64_operands_as_eager_torch_does():
    """Autocast casts float32, float16 and bfloat16 operands, never float64: graphquant cast a
    float64 model's to bf16 (its output came back in bf16, where eager's stays float64) and ran a
    float64 input against float32 weights, which eager refuses."""
    model = models.seeded(torch.nn.Linear(64, 64)).double()
    x = torch.randn(32, 64, dtype=torch.float64)
    compiled = graphquant.compile(model, recipes.current_scaling(), backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compiled(x).dtype == model(x).dtype == torch.float64
