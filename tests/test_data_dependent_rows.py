"""Rows a data-dependent op chose: a per-expert loop over the token indices torch.where finds, which
Dynamo keeps in one graph under capture_dynamic_output_shape_ops, gives each expert's linears a
row count the graph does not know (an unbacked size), on which no guard can be taken."""

import pytest
import torch

import graphquant
from graphquant import recipes, zoo
from graphquant.passes.plan import PlanError
from graphquant.quantizers import COLUMNWISE, ROWWISE, Float8RowwiseQuantizer, QuantizeContext

import models
from reference import fresh_dynamo  # noqa: F401  (autouse)

EXPERTS, DIM, HIDDEN = 4, 64, 128


class Experts(torch.nn.Module):
    """Each expert an MLP of two linears over the tokens routed to it."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.ModuleList(torch.nn.Linear(DIM, HIDDEN, bias=False) for _ in range(EXPERTS))
        self.down = torch.nn.ModuleList(torch.nn.Linear(HIDDEN, DIM, bias=False) for _ in range(EXPERTS))

    def expert(self, e, x):
        return self.down[e](torch.relu(self.up[e](x)))


class LoopedExperts(Experts):
    """Tokens found by torch.where: each expert's row count is data-dependent."""

    def forward(self, x, choice):
        out = torch.zeros_like(x)
        for e in range(EXPERTS):
            (tokens,) = torch.where(choice == e)
            out = out.index_add(0, tokens, self.expert(e, x[tokens]))
        return out


class SlicedExperts(Experts):
    """The same experts over tokens already sorted by expert: static slices, sizes the graph knows."""

    def forward(self, x, bounds):
        return torch.cat([self.expert(e, x[start:stop]) for e, (start, stop) in enumerate(bounds)])


def routed_tokens():
    """Tokens sorted by their expert, the last expert reached by none."""
    sizes = [40, 56, 32, 0]
    choice = torch.repeat_interleave(torch.arange(EXPERTS), torch.tensor(sizes))
    starts = [sum(sizes[:e]) for e in range(EXPERTS)]
    return torch.randn(sum(sizes), DIM, generator=torch.Generator().manual_seed(3)), choice, [(s, s + n) for s, n in zip(starts, sizes)]


def step(model, recipe, *args):
    x = args[0].clone().requires_grad_()
    compiled = graphquant.compile(model, recipe, backend="aot_eager")
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        out = compiled(x, *args[1:])
        out.sum().backward()
    return out, x.grad, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "deepseek_blockwise", "delayed_scaling"])
def test_experts_over_rows_a_data_dependent_op_chose_equal_the_same_experts_over_static_slices(recipe):
    """The loop compiled to one graph (no eager fallback) and quantized as the static model is, bit for
    bit, an expert no token reached included: its amax, rowwise's per-column scales of no rows and
    a GEMM of no rows took a guard on the row count, or lost the scale of an empty operand."""
    make = recipes.delayed_scaling if recipe == "delayed_scaling" else lambda: zoo.recipe(recipe)
    x, choice, bounds = routed_tokens()
    looped = step(models.seeded(LoopedExperts()), make(), x, choice)
    sliced = step(models.seeded(SlicedExperts()), make(), x, bounds)
    for got, want in zip([looped[0], looped[1], *looped[2]], [sliced[0], sliced[1], *sliced[2]]):
        assert torch.equal(got, want)
    assert looped[2][-1].abs().sum() == 0  # the empty expert's weights: a zero gradient


@pytest.mark.parametrize("recipe", [recipes.mxfp8_block_scaling, recipes.nvfp4_block_scaling])
def test_block_formats_run_inference_over_rows_a_data_dependent_op_chose_as_over_static_slices(recipe):
    """Inference quantizes rowwise alone, whose blocks run along the columns: any row count tiles.
    NVFP4's global amax took a guard on the unbacked count and failed the compile."""
    x, choice, bounds = routed_tokens()
    outputs = []
    for model, routing in ((LoopedExperts(), choice), (SlicedExperts(), bounds)):
        compiled = graphquant.compile(models.seeded(model), recipe(), backend="aot_eager")
        with torch.no_grad(), torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
            outputs.append(compiled(x, routing))
    assert torch.equal(*outputs)


def test_a_block_format_on_rows_a_data_dependent_op_chose_is_refused_naming_the_site_and_the_remedies():
    x, choice, _ = routed_tokens()
    model = models.seeded(LoopedExperts())
    with pytest.raises(PlanError, match=r"up\.0#0 \(linear\) input: mxfp8.*32x1 blocks.*chosen at run time by a data-dependent op"
                                        r".*torch\._grouped_mm.*IdentityQuantizer\(\) for the input and grad_output roles of every such linear \(this one: 'up\.0'\)"):
        step(model, recipes.mxfp8_block_scaling(), x, choice)


def test_a_rowwise_operand_of_no_rows_keeps_its_scales_through_the_op_boundary():
    """A columnwise rowwise representation of no rows (a wgrad operand of an expert no token reached)
    has a scale per column; crossing an op boundary, its empty scale was taken for an absent one."""
    quantizer = Float8RowwiseQuantizer()
    for direction, quantize, scales in ((ROWWISE, quantizer.quantize_rowwise, (0, 1)), (COLUMNWISE, quantizer.quantize_columnwise, (DIM, 1))):
        made = quantize(torch.empty(0, DIM), QuantizeContext())
        assert tuple(made.scale.shape) == scales
        crossed = quantizer.stored_representation(direction, made.shape, made.dtype, made.tensors())
        assert crossed.scale is not None and tuple(crossed.scale.shape) == scales
