"""A format of the user's own, defined here and nowhere else, plans, trains and is explained like a
built-in one: graphquant asks the quantizer about itself, so no other module needs an edit.

Float8Block64 (FP8 with one float32 scale per 1x64 block, 64x1 columnwise) says only how the native
quantize kernels encode it (``kernel_encoding``), so that it quantizes in the generic tile program
(tests/test_kernels_gpu.py checks it bit for bit); no GEMM family reads it, so its GEMMs are
emulated. TensorwiseCopy lays out per-tensor FP8 exactly as the built-in format does and says so
(``gemm_input``), which makes its GEMMs native where a per-tensor FP8 GEMM runs.
"""

import dataclasses
import math

import pytest
import torch
from torch import nn

from reference import fresh_dynamo  # noqa: F401  (autouse: before torch 2.13, compiles of nn.Linear share one recompile count)
from user_formats import Bf16Codes, Clipped

import graphquant
from graphquant.formats import block, fp8, per_tensor
from graphquant.kernels import backends, scaled_mm
from graphquant.quantizers import (
    COLUMNWISE,
    ROWWISE,
    Float8CurrentScalingQuantizer,
    GemmInput,
    KernelEncoding,
    QuantizeContext,
    Quantizer,
    Representation,
    parse_spec,
)

BLOCK = 64


@dataclasses.dataclass(frozen=True)
class Float8Block64(Quantizer):
    """FP8 with one float32 scale per 64 elements along the blocked dim; partial blocks allowed."""

    tag = "test_fp8_block64"

    fp8_dtype: str = "e4m3"

    def block(self, direction):
        return (1, BLOCK) if direction == ROWWISE else (BLOCK, 1)

    def _encode(self, x, direction):
        data, scale_inv = block.quantize(x, self.fp8_dtype, block=self.block(direction), epsilon=0.0, pow2=False)
        return self.representation(direction, x.shape, x.dtype, data, scale_inv)

    def quantize_rowwise(self, x, ctx):
        return self._encode(x, ROWWISE)

    def quantize_columnwise(self, x, ctx):
        return self._encode(x, COLUMNWISE)

    def dequantize(self, rep: Representation):
        return block.dequantize(rep.data, rep.scale, block=self.block(rep.direction))

    def kernel_encoding(self, direction):
        return KernelEncoding("block", self.fp8_dtype, block=self.block(direction))


@dataclasses.dataclass(frozen=True)
class TensorwiseCopy(Quantizer):
    """Per-tensor current-scaling FP8 laid out as cuBLASLt's tensorwise GEMM reads it: columnwise
    data stored transposed, one float32 decode scale."""

    tag = "test_tensorwise_copy"

    def transposed(self, direction):
        return direction == COLUMNWISE

    def _encode(self, x, direction):
        amax = fp8.tensor_amax(x)
        scale, scale_inv = fp8.scales(amax, "e4m3", 0.0, False)
        data = per_tensor.quantize(x, scale, "e4m3", transpose=self.transposed(direction))
        return self.representation(direction, x.shape, x.dtype, data, scale_inv, amax)

    def quantize_rowwise(self, x, ctx):
        return self._encode(x, ROWWISE)

    def quantize_columnwise(self, x, ctx):
        return self._encode(x, COLUMNWISE)

    def dequantize(self, rep: Representation):
        return per_tensor.dequantize(rep.data, rep.scale)

    def gemm_input(self, direction):
        return GemmInput("fp8_tensorwise", "e4m3")


def recipe():
    return graphquant.CustomRecipe(lambda role: Float8Block64())


def values(x, direction):
    """x through Float8Block64 in ``direction`` and back, in x's orientation."""
    return Float8Block64()(x, rowwise=direction == ROWWISE, columnwise=direction == COLUMNWISE).get(direction).dequantize()


def test_a_user_format_gets_the_defaults_of_a_format_no_gemm_knows():
    q = Float8Block64()
    assert parse_spec(str(q)) == q
    assert [q.gemm_input(d) for d in (ROWWISE, COLUMNWISE)] == [None, None]
    assert not (q.high_precision or q.keeps_state or q.groupable)
    assert q.direction_spec(COLUMNWISE) == "test_fp8_block64()"
    rep = q(torch.randn(8, 96)).rowwise
    assert torch.equal(q.emulated_values(rep), rep.dequantize(torch.float32)) and q.emulated_factor(rep) is None
    assert not q.values_exact_in_bf16(rep)


def test_a_user_format_describes_an_encoding_the_generic_tile_program_runs():
    """FP8 in 1x64 blocks with float32 scales: the tile program's FP8 blocks span 16 to 128 along
    the blocked dim, the columnwise data kept in x's layout as this format stores it."""
    q = Float8Block64()
    assert repr(q.kernel_encoding(ROWWISE)) == "KernelEncoding('block', 'e4m3', block=(1, 64))"
    assert repr(q.kernel_encoding(COLUMNWISE)) == "KernelEncoding('block', 'e4m3', block=(64, 1))"
    assert not q.kernel_encoding(COLUMNWISE).transposed and not q.transposed(COLUMNWISE)
    assert q.kernel_encoding(ROWWISE).block == q.block(ROWWISE)


@pytest.mark.parametrize("capability", [None, (9, 0), (10, 0)])
def test_a_user_format_plans_emulated_on_every_capability(capability, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    backends.select.cache_clear()
    try:
        device = torch.device("cpu" if capability is None else "cuda")
        for da, db in ((ROWWISE, ROWWISE), (ROWWISE, COLUMNWISE), (COLUMNWISE, COLUMNWISE)):
            selection = backends.select(Float8Block64(), da, Float8Block64(), db, device, (256, 256, 256))
            assert (selection.bucket, selection.backend.name) == (backends.EMULATED, backends.EMULATION)
    finally:
        backends.select.cache_clear()


def test_a_user_format_is_explained_like_a_built_in_one():
    plan = graphquant.explain(nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32)), recipe(), torch.randn(96, 128))
    assert len(plan.gemms) == 5  # the input needs no gradient: no dgrad of the first linear
    assert {(g.a_format, g.b_format, g.bucket) for g in plan.gemms} == {("test_fp8_block64()", "test_fp8_block64()", "emulated")}

    report = graphquant.numerics(nn.Linear(128, 64), recipe(), torch.randn(96, 128, requires_grad=True))
    assert {g.gemm for g in report.gemms} == {"fprop", "dgrad", "wgrad"}
    assert all(g.a.format == g.b.format == "test_fp8_block64()" for g in report.gemms)
    assert all(25 < g.sqnr_db < 60 for g in report.gemms)  # FP8 E4M3 with fine scales: about 30 dB


def assert_fp32_product(actual, a, b, bias=0.0):
    """``actual`` is a @ b (+ bias) of fp32 values as an fp32 GEMM makes it: within its sums'
    bound (fp8.accumulation_bound) and one rounding of each product and of the bias's addition."""
    a, b = a.double(), b.double()
    exact = a @ b + bias
    bound = fp8.accumulation_bound(a, b, fp8.FP32) + 2.0**-24 * (a.abs() @ b.abs() + exact.abs())
    assert ((actual.double() - exact).abs() <= bound).all(), ((actual.double() - exact).abs() / bound).max()


def test_a_user_format_trains_on_the_representations_it_makes():
    """fprop, dgrad and wgrad multiply the format's own representations (96 rows: a partial
    64-row block columnwise), and a few steps of SGD lower the loss."""
    torch.manual_seed(0)
    layer = nn.Linear(128, 64)
    x = torch.randn(96, 128, requires_grad=True)
    target = torch.randn(96, 64)
    compiled = graphquant.compile(layer, recipe(), backend="aot_eager")
    y = compiled(x)
    (y * target).sum().backward()

    w, b = layer.weight.detach(), layer.bias.detach()
    assert_fp32_product(y, values(x.detach(), ROWWISE), values(w, ROWWISE).t(), b)
    assert_fp32_product(x.grad, values(target, ROWWISE), values(w, COLUMNWISE))
    assert_fp32_product(layer.weight.grad, values(target, COLUMNWISE).t(), values(x.detach(), COLUMNWISE))
    assert {g.bucket for g in compiled.graphquant.plan.gemms} == {"emulated"}

    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32))
    inputs = torch.randn(96, 128)
    labels = inputs @ torch.randn(128, 32) / 128**0.5  # a map the model can learn
    compiled = graphquant.compile(model, recipe(), backend="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(6):
        loss = nn.functional.mse_loss(compiled(inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])) and losses[-1] < 0.9 * losses[0]


def test_a_user_format_that_declares_a_gemm_family_runs_on_that_native_gemm(monkeypatch):
    """On a Hopper (capability faked) the pair is native, with the built-in format too, and the
    GEMM call gets the same arguments as for the built-in per-tensor format."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    backends.select.cache_clear()
    try:
        cuda = torch.device("cuda")
        for other in (TensorwiseCopy(), Float8CurrentScalingQuantizer()):
            selection = backends.select(TensorwiseCopy(), ROWWISE, other, COLUMNWISE, cuda, (128, 64, 256))
            assert (selection.bucket, selection.backend.name) == (backends.NATIVE, scaled_mm.TENSORWISE)
    finally:
        backends.select.cache_clear()

    x, w = torch.randn(128, 256), torch.randn(256, 64)
    ours = scaled_mm.arguments(scaled_mm.TENSORWISE, TensorwiseCopy()(x).rowwise, TensorwiseCopy()(w).columnwise, torch.bfloat16)
    built_in = Float8CurrentScalingQuantizer()
    theirs = scaled_mm.arguments(scaled_mm.TENSORWISE, built_in(x).rowwise, built_in(w).columnwise, torch.bfloat16)
    assert ours[1] == theirs[1]
    for mine, reference in zip(ours[0], theirs[0]):
        assert mine.dtype == reference.dtype and mine.stride() == reference.stride()
        assert torch.equal(mine.float(), reference.float())


@dataclasses.dataclass(frozen=True)
class Flattening(Float8Block64):
    """Breaks the contract: dequantize returns the values flattened."""

    tag = "test_flattening"

    def dequantize(self, rep: Representation):
        return super().dequantize(rep).reshape(-1)


@dataclasses.dataclass(frozen=True)
class Unwrapped(Float8Block64):
    """Breaks the contract: quantize_rowwise returns the codes, not a Representation."""

    tag = "test_unwrapped"

    def quantize_rowwise(self, x, ctx):
        return self._encode(x, ROWWISE).data


@dataclasses.dataclass(frozen=True)
class NumberScaled(Float8Block64):
    """Its representation's scale a Python number."""

    tag = "test_number_scaled"

    def quantize_rowwise(self, x, ctx):
        return dataclasses.replace(self._encode(x, ROWWISE), scale=0.5)


def test_a_user_format_that_breaks_the_contract_is_named_with_what_it_must_return():
    x = torch.randn(96, 64)
    with pytest.raises(ValueError, match=r"Flattening.dequantize returned a tensor of shape \(6144,\) .* it must return 96x64"):
        Flattening()(x, rowwise=True, columnwise=False).rowwise.dequantize()
    from graphquant.kernels import native

    with pytest.raises(TypeError, match=r"Unwrapped.quantize_rowwise returned an object of type Tensor; it must return a Representation"):
        native.reference_quantize(Unwrapped(), x, ROWWISE, QuantizeContext())
    # A number for a scale failed inside the ops' fake implementation: "'float' object has no attribute 'new_empty'".
    with pytest.raises(TypeError, match=r"NumberScaled.quantize_rowwise returned a Representation whose scale is float 0.5; the ops carry it as a tensor \(torch.tensor\(0.5\)"):
        native.reference_quantize(NumberScaled(), x, ROWWISE, QuantizeContext())


def test_a_user_format_cannot_take_a_built_in_tag_even_under_the_built_in_name():
    with pytest.raises(TypeError, match=r"quantizer tag 'mxfp8' is taken by graphquant.quantizers.mxfp8.MXFP8Quantizer"):

        @dataclasses.dataclass(frozen=True)
        class MXFP8Quantizer(Float8Block64):
            __qualname__ = "MXFP8Quantizer"  # the built-in's own name, from another module
            tag = "mxfp8"

    assert type(parse_spec("mxfp8()")).__module__ == "graphquant.quantizers.mxfp8"


def test_a_user_format_without_the_dataclass_decorator_is_refused_at_the_factory():
    class Undecorated(Float8Block64):
        tag = "test_undecorated"
        margin: int = 1

    with pytest.raises(graphquant.PlanError, match=r"Undecorated for role .*whose attributes \(margin\) are not dataclass fields, so its spec \(test_undecorated\(\)\) does not hold them: decorate"):
        graphquant.explain(nn.Linear(64, 64), graphquant.CustomRecipe(lambda role: Undecorated()), torch.randn(32, 64))


def test_a_user_format_keeping_its_options_in_an_init_of_its_own_is_refused_at_the_factory():
    """Its step, set in __init__, was in no spec: the compiled graph, which rebuilds each quantizer
    from its spec, ran the default step without a word."""

    class Stepped(Float8Block64):
        tag = "test_stepped"

        def __init__(self, step=0.5):
            object.__setattr__(self, "step", step)

    with pytest.raises(graphquant.PlanError, match=r"Stepped for role .*whose attributes \(step\) are not dataclass fields"):
        graphquant.explain(nn.Linear(64, 64), graphquant.CustomRecipe(lambda role: Stepped(step=0.25)), torch.randn(32, 64))


def _gridded(step: float, reads_a_value: bool = False) -> type:
    """A format of codes on a grid of ``step`` held in bf16, defined anew at each call as a notebook
    cell run again defines it (same module, name and tag); ``reads_a_value``: its quantize takes
    the grid from the tensor's amax on the host, as an eager quantize may."""

    @dataclasses.dataclass(frozen=True)
    class Gridded(Bf16Codes):
        tag = "test_gridded"

        def _codes(self, x):
            grid = x.abs().max().item() / 64 if reads_a_value else step
            return torch.round(x.float() / grid).to(torch.bfloat16), torch.tensor(grid)

    return Gridded


def test_a_format_defined_again_is_the_one_its_spec_names():
    """A model compiled after the class was defined again ran the first definition's quantize: the
    quantizers the ops make from a spec were cached by the spec alone."""
    x = torch.randn(64, 64)
    for step in (0.5, 0.125):
        gridded = _gridded(step)
        linear = nn.Linear(64, 64, bias=False)
        compiled = graphquant.compile(linear, graphquant.CustomRecipe(lambda role: gridded()), backend="aot_eager")
        with torch.no_grad():
            expected = gridded()(x).rowwise.dequantize() @ gridded()(linear.weight).rowwise.dequantize().t()
            torch.testing.assert_close(compiled(x), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("grad", [True, False], ids=["training", "no_grad"])
def test_a_format_whose_quantize_reads_a_value_on_the_host_fails_naming_its_method(grad):
    """graphquant traces a quantize on fake tensors: one that reads a value (.item()) failed there,
    and Dynamo took that for a graph break and ran the model eagerly, unquantized (under no_grad
    without a word)."""
    gridded = _gridded(0.5, reads_a_value=True)
    compiled = graphquant.compile(nn.Linear(64, 64), graphquant.CustomRecipe(lambda role: gridded()), backend="aot_eager")
    with torch.set_grad_enabled(grad), pytest.raises(graphquant.PlanError, match=r"^Gridded._codes \(test_user_format.py:\d+\) reads a tensor's value on the host .*must compute with tensor ops alone"):
        compiled(torch.randn(64, 64))


def test_a_non_finite_float_field_survives_its_spec():
    """clip=inf was written clip=inf and read back as the string 'inf', which the compiled graph's
    quantize then got (a TypeError inside BackendCompilerFailed)."""
    for clip in (math.inf, -math.inf):
        assert parse_spec(Clipped(clip=clip).spec) == Clipped(clip=clip)
    assert math.isnan(parse_spec(Clipped(clip=math.nan).spec).clip)
    linear = nn.Linear(64, 64)
    x = torch.randn(32, 64) * 4
    compiled = graphquant.compile(linear, graphquant.CustomRecipe(lambda role: Clipped(clip=math.inf)), backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), nn.functional.linear(x.bfloat16().float(), linear.weight.bfloat16().float(), linear.bias))


def test_a_field_no_spec_gives_back_is_refused_at_the_factory_naming_it():
    """A list field failed with a bare "unhashable type: 'list'" inside BackendCompilerFailed."""
    with pytest.raises(graphquant.PlanError, match=r"Clipped for role .* whose levels is \[0.5, 1.0\], which is unhashable \(a tuple is not\)"):
        graphquant.explain(nn.Linear(64, 64), graphquant.CustomRecipe(lambda role: Clipped(levels=[0.5, 1.0])), torch.randn(32, 64))
