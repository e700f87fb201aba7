"""graphquant.compile with the all-Identity recipe is a plain torch.compile of the same model."""

import copy

import models
import pytest
import torch
from reference import Reference, accumulation_tolerance, forward_backward, fresh_dynamo  # noqa: F401

import graphquant
from graphquant import CustomRecipe, factories

CASES = {
    "mlp": (models.MLP, lambda: torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(0))),
    "tiny_lm": (
        lambda: models.TinyLM(attention=("matmul",)),
        lambda: torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0)),
    ),
}


@pytest.mark.filterwarnings("ignore:the recipe quantizes no GEMM")
@pytest.mark.parametrize("name", sorted(CASES))
def test_identity_recipe_equals_plain_compile(name):
    make_model, make_input = CASES[name]
    model = models.seeded(make_model())
    x = make_input()
    recipe = CustomRecipe(factories.high_precision_factory)

    plain_model = copy.deepcopy(model)
    plain = forward_backward(torch.compile(plain_model, backend="aot_eager", fullgraph=True), plain_model, x)
    torch._dynamo.reset()
    gq_model = copy.deepcopy(model)
    compiled = graphquant.compile(gq_model, recipe, backend="aot_eager", fullgraph=True)
    actual = forward_backward(compiled, gq_model, x)
    assert all(g.backend.name == "high-precision matmul" for g in compiled.graphquant.plan.gemms)

    # Both are fp32 runs of the same computation; only the GEMM kernels may differ (graphquant's
    # gemm op vs aten.mm / addmm). Each fp32 GEMM is within (K + 4) 2^-24 sum|a||b| of the exact
    # product (reference.gemm_bound), so two of them differ by at most twice that; with no
    # quantizer in between, such differences travel on through the following layers, which
    # add, normalize or multiply them by weights (models.seeded: rows of norm about 1). We allow twice the
    # sum of every GEMM's bound (forward and backward), as logged by the float64 reference.
    reference = Reference(copy.deepcopy(model), recipe)
    forward_backward(reference, reference.model, x)
    tolerance = 2 * accumulation_tolerance(reference.gemm_log)
    assert actual.keys() == plain.keys()
    for key in plain:
        diff = (actual[key] - plain[key]).abs().max().item()
        assert diff <= tolerance, f"{key}: differs from plain torch.compile by {diff:.3g} > {tolerance:.3g}"
