"""Quantizers, roles and recipes as values: specs, hashing, hybrid semantics, errors, plug-ins."""

import dataclasses
import pickle

import pytest
import torch

import graphquant
from graphquant import factories, zoo
from graphquant.formats import mxfp8
from graphquant.passes.plan import FactoryTypeError, Planner
from graphquant.quantizers import (
    COLUMNWISE,
    ROWWISE,
    DelayedScalingRequest,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8DelayedScalingQuantizer,
    Float8RowwiseQuantizer,
    HybridQuantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    QuantizeContext,
    Quantizer,
    Representation,
    parse_spec,
)
from graphquant.roles import QuantizerRole

QUANTIZERS = [
    Float8CurrentScalingQuantizer("e5m2", force_pow_2_scales=True, amax_epsilon=1e-12),
    Float8DelayedScalingQuantizer("e4m3", margin=1, amax_history_len=16, amax_compute_algo="most_recent"),
    Float8BlockQuantizer(block_scaling_dim=1, force_pow_2_scales=False),
    Float8RowwiseQuantizer("e4m3"),
    MXFP8Quantizer("e5m2"),
    NVFP4Quantizer(with_rht=True, with_post_rht_amax=True, stochastic_rounding=True, with_random_sign_mask=False),
    IdentityQuantizer(dtype=torch.bfloat16),
    IdentityQuantizer(),
]


def test_role_is_a_frozen_printable_value():
    role = QuantizerRole("linear", "weight", "layers.0.fc1")
    assert str(role) == "module_type=linear|tensor_type=weight|name=layers.0.fc1"
    assert str(QuantizerRole()) == "QuantizerRole()"
    assert str(QuantizerRole(tensor_type="input")) == "tensor_type=input"
    assert role == QuantizerRole("linear", "weight", "layers.0.fc1") and len({role, QuantizerRole("linear", "weight", "layers.0.fc1")}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        role.name = "other"
    # The string reads back (a resume's state keys), a module name holding '|' or '=' included.
    for again in (role, QuantizerRole(), QuantizerRole(name="attn.dpa_output"), QuantizerRole("linear", "weight", "heads.q|k=v")):
        assert QuantizerRole.parse(str(again)) == again
    with pytest.raises(ValueError, match="is no QuantizerRole string"):
        QuantizerRole.parse("fc1.weight")


@pytest.mark.parametrize("quantizer", QUANTIZERS, ids=str)
def test_spec_round_trips_and_values_hash(quantizer):
    again = parse_spec(str(quantizer))
    assert again == quantizer and hash(again) == hash(quantizer) and str(again) == str(quantizer)
    assert pickle.loads(pickle.dumps(quantizer)) == quantizer


@pytest.mark.parametrize("quantizer", QUANTIZERS, ids=str)
def test_stored_tensors_round_trip_without_copies(quantizer):
    """Representation.tensors() is what crosses an op boundary (where every tensor is made
    contiguous): each part is stored contiguous, so nothing is copied there, and
    stored_representation gives back the same representation (outer-dim-major scales, 1x128 and
    MXFP8's 1x32, transposed there and back, their logical (rows, blocks) shape kept)."""
    x = torch.randn(256, 384)
    ctx = QuantizeContext(seed=3, offset=1, scale=torch.tensor([2.0]))
    for direction in (ROWWISE, COLUMNWISE):
        rep = quantizer.quantize_rowwise(x, ctx) if direction == ROWWISE else quantizer.quantize_columnwise(x, ctx)
        stored = rep.tensors()
        assert all(t.is_contiguous() for t in stored), f"{direction}: {[t.stride() for t in stored]}"
        again = quantizer.stored_representation(direction, rep.shape, rep.dtype, stored)
        for part in ("data", "scale", "amax"):
            a, b = getattr(rep, part), getattr(again, part)
            assert (a is None) == (b is None), part
            if a is not None:
                assert a.shape == b.shape and a.stride() == b.stride() and a.data_ptr() == b.data_ptr(), f"{direction} {part}"


PER_DIRECTION = [
    *QUANTIZERS,
    NVFP4Quantizer(with_rht=True, with_post_rht_amax=True, row_scaled_nvfp4=True),
    HybridQuantizer(rowwise_quantizer=NVFP4Quantizer(with_rht=True, with_post_rht_amax=True), columnwise_quantizer=NVFP4Quantizer(row_scaled_nvfp4=True)),
]


@pytest.mark.parametrize("quantizer", PER_DIRECTION, ids=str)
def test_for_direction_makes_that_direction_bit_for_bit_and_names_it_in_the_plan(quantizer):
    """What a plan names an operand by (direction_spec) is a quantizer value of its own, which
    reads back from its spec and makes that direction's bits as the slot's quantizer does."""
    x = torch.randn(64, 96) * 3
    ctx = QuantizeContext(seed=3, offset=1, scale=torch.tensor([2.0]))
    for direction in (ROWWISE, COLUMNWISE):
        seen = quantizer.for_direction(direction)
        assert hash(seen) == hash(parse_spec(seen.spec)) and parse_spec(seen.spec) == seen
        assert quantizer.direction_spec(direction).startswith(seen.spec)
        assert seen.hadamard(direction) == quantizer.hadamard(direction)
        made = [q(x, rowwise=direction == ROWWISE, columnwise=direction == COLUMNWISE, ctx=ctx).get(direction) for q in (quantizer, seen)]
        for part in ("data", "scale", "amax"):
            a, b = (getattr(rep, part) for rep in made)
            assert (a is None) == (b is None), f"{direction} {part}"
            if a is not None:
                as_bits = lambda t: t.view(torch.uint8) if t.dtype.itemsize == 1 else t  # noqa: E731
                assert torch.equal(as_bits(a), as_bits(b)), f"{direction} {part}"


def test_nvfp4_names_its_hadamard_transform_on_the_columnwise_side_alone():
    """TE's NVFP4 transforms the columnwise representation alone (wgrad's operands): a rowwise
    one, which fprop and dgrad read, is plain NVFP4, so the plan did not say RHT there."""
    gradient = NVFP4Quantizer(with_rht=True, with_post_rht_amax=True, stochastic_rounding=True, with_random_sign_mask=False)
    assert gradient.direction_spec(ROWWISE) == "nvfp4(stochastic_rounding=True)"
    assert gradient.direction_spec(COLUMNWISE) == str(gradient)
    row_scaled = NVFP4Quantizer(with_rht=True, with_post_rht_amax=True, row_scaled_nvfp4=True)
    assert row_scaled.direction_spec(ROWWISE) == "nvfp4(row_scaled_nvfp4=True)"
    assert row_scaled.direction_spec(COLUMNWISE) == "nvfp4(with_rht=True, with_post_rht_amax=True)"
    assert NVFP4Quantizer(with_random_sign_mask=False).direction_spec(COLUMNWISE) == "nvfp4()"  # no transform to mask
    hybrid = HybridQuantizer(
        rowwise_quantizer=NVFP4Quantizer(with_rht=True, with_post_rht_amax=True),
        columnwise_quantizer=NVFP4Quantizer(with_rht=True, with_post_rht_amax=True),
        columnwise_source="rowwise_dequantized",
    )
    assert (hybrid.direction_spec(ROWWISE), hybrid.direction_spec(COLUMNWISE)) == (
        "nvfp4()", "nvfp4(with_rht=True, with_post_rht_amax=True) of rowwise_dequantized"
    )


@pytest.mark.parametrize("shape", [(0, 64), (64, 0), (0, 0)])
@pytest.mark.parametrize("quantizer", [*QUANTIZERS, NVFP4Quantizer(row_scaled_nvfp4=True), NVFP4Quantizer(with_2d_quantization=True)], ids=str)
def test_an_empty_tensor_quantizes_to_an_empty_representation(quantizer, shape):
    """As a compiled model's empty GEMM operand does (no rows routed to a layer, say): nothing to
    scale, so an amax of 0 (scale 1), and values of the tensor's shape."""
    ctx = QuantizeContext(seed=3, offset=1, scale=torch.tensor([2.0]))
    for direction in (ROWWISE, COLUMNWISE):
        rep = quantizer.quantize_rowwise(torch.randn(shape), ctx) if direction == ROWWISE else quantizer.quantize_columnwise(torch.randn(shape), ctx)
        values = rep.dequantize(torch.float32)
        assert values.numel() == 0 and sorted(values.shape) == sorted(shape), direction


def test_hybrid_spec_round_trips_and_shows_both_children():
    hybrid = HybridQuantizer(
        rowwise_quantizer=MXFP8Quantizer(), columnwise_quantizer=NVFP4Quantizer(), columnwise_source="rowwise_dequantized"
    )
    assert str(hybrid) == (
        "hybrid(rowwise_quantizer=mxfp8(fp8_dtype=e4m3), columnwise_quantizer=nvfp4(), "
        "columnwise_source=rowwise_dequantized)"
    )
    assert parse_spec(str(hybrid)) == hybrid


def test_parse_spec_names_what_it_knows():
    with pytest.raises(ValueError, match="unknown quantizer tag 'fp16'.*mxfp8"):
        parse_spec("fp16()")


def test_hybrid_directions_use_their_own_children():
    x = torch.randn(64, 96)
    hybrid = HybridQuantizer(rowwise_quantizer=MXFP8Quantizer(), columnwise_quantizer=Float8BlockQuantizer(block_scaling_dim=1))
    qt = hybrid(x)
    assert qt.rowwise.quantizer == MXFP8Quantizer() and qt.columnwise.quantizer == Float8BlockQuantizer(block_scaling_dim=1)
    assert torch.equal(qt.rowwise.data.view(torch.uint8), MXFP8Quantizer()(x, columnwise=False).rowwise.data.view(torch.uint8))
    direct = Float8BlockQuantizer(block_scaling_dim=1)(x, rowwise=False).columnwise
    assert torch.equal(qt.columnwise.data.view(torch.uint8), direct.data.view(torch.uint8))


def test_rowwise_dequantized_feeds_the_columnwise_child_the_dequantized_rowwise_values():
    x = torch.randn(64, 96) * 3
    hybrid = HybridQuantizer(
        rowwise_quantizer=MXFP8Quantizer(), columnwise_quantizer=IdentityQuantizer(), columnwise_source="rowwise_dequantized"
    )
    columnwise = hybrid(x, rowwise=False).columnwise.data
    expected = mxfp8.dequantize(*mxfp8.quantize(x, "e4m3", axis=1), axis=1)
    assert torch.equal(columnwise, expected)
    original = HybridQuantizer(rowwise_quantizer=MXFP8Quantizer(), columnwise_quantizer=IdentityQuantizer())
    assert torch.equal(original(x, rowwise=False).columnwise.data, x)


def test_usage_flags_gate_the_children():
    x = torch.randn(32, 64)
    hybrid = HybridQuantizer(rowwise_quantizer=MXFP8Quantizer(), columnwise_quantizer=NVFP4Quantizer())
    assert hybrid(x, rowwise=True, columnwise=False).columnwise is None
    assert hybrid(x, rowwise=False, columnwise=True).rowwise is None
    with pytest.raises(RuntimeError, match="columnwise representation was requested but not made"):
        hybrid(x, columnwise=False).get(COLUMNWISE)


def test_hybrid_rejects_shared_children_bad_sources_and_delayed_scaling():
    child = MXFP8Quantizer()
    with pytest.raises(ValueError, match="same quantizer instance for both directions"):
        HybridQuantizer(rowwise_quantizer=child, columnwise_quantizer=child)
    HybridQuantizer(rowwise_quantizer=child, columnwise_quantizer=MXFP8Quantizer())
    with pytest.raises(ValueError, match="already belongs to another HybridQuantizer"):
        HybridQuantizer(rowwise_quantizer=child, columnwise_quantizer=IdentityQuantizer())
    with pytest.raises(ValueError, match="columnwise_source must be one of"):
        HybridQuantizer(rowwise_quantizer=MXFP8Quantizer(), columnwise_quantizer=MXFP8Quantizer(), columnwise_source="transposed")
    with pytest.raises(TypeError, match="delayed scaling inside a hybrid"):
        HybridQuantizer(rowwise_quantizer=DelayedScalingRequest(), columnwise_quantizer=MXFP8Quantizer())
    with pytest.raises(TypeError, match="must be a Quantizer, got str"):
        HybridQuantizer(rowwise_quantizer="mxfp8", columnwise_quantizer=MXFP8Quantizer())


def test_quantizers_reject_what_no_format_encodes():
    with pytest.raises(TypeError, match="quantizes float16, bfloat16 or float32 tensors, got torch.int32"):
        MXFP8Quantizer()(torch.ones(32, 32, dtype=torch.int32))
    with pytest.raises(TypeError, match="complex"):
        MXFP8Quantizer()(torch.ones(32, 32, dtype=torch.complex64))
    with pytest.raises(ValueError, match="dim 1 of the 32x48 tensor must be a multiple of 32"):
        MXFP8Quantizer()(torch.ones(32, 48), columnwise=False)
    with pytest.raises(ValueError, match="fp8_dtype must be one of"):
        MXFP8Quantizer("e3m4")
    with pytest.raises(ValueError, match="row_scaled_nvfp4 gives each row .* no global amax to all-reduce"):
        NVFP4Quantizer(row_scaled_nvfp4=True, with_amax_reduction=True)
    with pytest.raises(ValueError, match="pass with_rht=True, with_post_rht_amax=True"):
        NVFP4Quantizer(with_rht=True)


def test_a_hadamard_transformed_columnwise_representation_is_not_dequantized_as_the_tensor():
    """NVFP4's columnwise codes with RHT hold the transformed values: a columnwise-only quantize's
    dequantize gave them as the tensor's (max error 13 on values under 5.12). It is refused, as
    TransformerEngine refuses it; the rowwise values, and columnwise ones of no transform, come back."""
    x = torch.arange(512, dtype=torch.float32).reshape(32, 16) / 100
    rht = NVFP4Quantizer(with_rht=True, with_post_rht_amax=True)
    with pytest.raises(ValueError, match="went through the 16-point Hadamard transform .* quantize with rowwise=True"):
        rht(x, rowwise=False).dequantize()
    plain = NVFP4Quantizer()
    assert torch.equal(rht(x).dequantize(), plain(x).dequantize())  # the transform is the columnwise side's alone
    assert torch.equal(plain(x, rowwise=False).dequantize(), plain(x.t().contiguous(), columnwise=False).dequantize().t())


@pytest.mark.parametrize("cls", [Float8CurrentScalingQuantizer, Float8DelayedScalingQuantizer, Float8BlockQuantizer, Float8RowwiseQuantizer, MXFP8Quantizer])
def test_fp8_dtype_takes_torch_dtypes_too(cls):
    """torch.float8_e4m3fn / torch.float8_e5m2, as torchao and most PyTorch code spell them, make
    the same quantizer as the short names: equal, same hash, same spec."""
    for name, dtype in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        quantizer = cls(fp8_dtype=dtype)
        assert quantizer == cls(fp8_dtype=name) and hash(quantizer) == hash(cls(fp8_dtype=name))
        assert quantizer.fp8_dtype == name and f"fp8_dtype={name}" in str(quantizer)
    with pytest.raises(ValueError, match=r"fp8_dtype must be one of 'e4m3', 'e5m2', torch.float8_e4m3fn, torch.float8_e5m2, got torch.float8_e4m3fnuz"):
        cls(fp8_dtype=torch.float8_e4m3fnuz)


def test_the_package_says_its_version_and_exports_recipes():
    import importlib.metadata

    assert graphquant.__version__ == importlib.metadata.version("graphquant")
    assert "recipes" in graphquant.__all__ and graphquant.recipes.PRESETS["current_scaling"] is graphquant.recipes.current_scaling
    assert "model.graphquant.plan" in graphquant.compile.__doc__


def test_factory_answers_are_checked_and_name_the_role():
    role = QuantizerRole("linear", "weight", "fc1")
    with pytest.raises(ValueError, match="returned None for role module_type=linear.*IdentityQuantizer"):
        Planner(graphquant.CustomRecipe(lambda r: None)).quantizer(role)
    with pytest.raises(FactoryTypeError, match="returned a str for role module_type=linear.*name=fc1"):
        Planner(graphquant.CustomRecipe(lambda r: "mxfp8")).quantizer(role)
    assert isinstance(FactoryTypeError("x"), TypeError)


def test_delayed_scaling_requests_resolve_by_role_and_must_agree():
    planner = Planner(graphquant.recipes.delayed_scaling())
    assert planner.quantizer(QuantizerRole("linear", "grad_output", "a")).fp8_dtype == "e5m2"
    assert planner.quantizer(QuantizerRole("linear", "input", "a")).fp8_dtype == "e4m3"

    def disagreeing(role):
        return DelayedScalingRequest(margin=1 if role.tensor_type == "weight" else 0)

    planner = Planner(graphquant.CustomRecipe(disagreeing))
    planner.quantizer(QuantizerRole("linear", "input", "a"))
    with pytest.raises(ValueError, match=r"different margin for roles module_type=linear\|tensor_type=input\|name=a \(0\) and "
                                         r"module_type=linear\|tensor_type=weight\|name=a \(1\) of module 'a'"):
        planner.quantizer(QuantizerRole("linear", "weight", "a"))

    def per_module(role):  # TE keeps a recipe state a module: modules may differ
        return DelayedScalingRequest(amax_history_len=16 if role.owner == "attn" else 1024)

    planner = Planner(graphquant.CustomRecipe(per_module))
    assert planner.quantizer(QuantizerRole("linear", "input", "fc")).amax_history_len == 1024
    assert planner.quantizer(QuantizerRole("dpa", "s", "attn")).amax_history_len == 16
    assert planner.quantizer(QuantizerRole("", "", "attn.dpa_grad_input")).amax_history_len == 16


def test_recipes_from_module_level_factories_pickle():
    for recipe in (graphquant.recipes.delayed_scaling(margin=2), zoo.recipe("mxfp8_fwd_nvfp4_bwd"), graphquant.CustomRecipe(factories.nvfp4_factory)):
        again = pickle.loads(pickle.dumps(recipe))
        role = QuantizerRole("linear", "input", "x")
        assert again.qfactory(role) == recipe.qfactory(role)
    # A process group's name pickles (to spawned workers, which resolve it); a group object does not.
    named = graphquant.CustomRecipe(factories.nvfp4_factory, amax_reduction_group="0")
    assert pickle.loads(pickle.dumps(named)).amax_reduction_group == "0"


def test_a_rank_outside_the_recipes_group_is_told_so():
    from torch.distributed import GroupMember

    from graphquant import distributed

    with pytest.raises(ValueError, match="this rank is not a member of the group"):
        distributed.group_name(GroupMember.NON_GROUP_MEMBER)


@pytest.mark.parametrize("name", sorted(zoo.FACTORIES))
def test_every_zoo_factory_is_total_and_documented(name):
    factory = zoo.FACTORIES[name]
    assert factory.__doc__ and len(factory.__doc__) > 40
    for role in [None, QuantizerRole(), *(QuantizerRole(m, t, "x") for m in ("linear", "grouped_linear", "matmul", "dpa") for t in ("input", "weight", "other", "grad_output", "s", "dp"))]:
        assert isinstance(factory(role), (Quantizer, DelayedScalingRequest))


@dataclasses.dataclass(frozen=True)
class RoundToBF16(Quantizer):
    """A user-defined format for the plug-in test: values rounded to bfloat16, held in fp32."""

    tag = "test_round_to_bf16"

    def quantize_rowwise(self, x, ctx):
        return self.representation(ROWWISE, x.shape, x.dtype, x.to(torch.bfloat16).float())

    def quantize_columnwise(self, x, ctx):
        return self.representation(COLUMNWISE, x.shape, x.dtype, x.to(torch.bfloat16).float())

    def dequantize(self, rep: Representation):
        return rep.data


def user_factory(role):
    return RoundToBF16()


def test_a_user_defined_quantizer_plugs_into_compile():
    assert parse_spec(str(RoundToBF16())) == RoundToBF16()
    model = torch.nn.Linear(64, 32)
    x = torch.randn(8, 64, requires_grad=True)
    compiled = graphquant.compile(model, graphquant.CustomRecipe(user_factory), backend="aot_eager")
    y = compiled(x)
    expected = x.detach().bfloat16().float() @ model.weight.detach().bfloat16().float().t() + model.bias.detach()
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-5)
    y.sum().backward()
    assert {g.bucket for g in compiled.graphquant.plan.gemms} == {"emulated"}
    assert x.grad is not None


def test_quantize_context_carries_the_delayed_scale():
    with pytest.raises(ValueError, match="QuantizeContext\\(scale=...\\)"):
        Float8DelayedScalingQuantizer()(torch.randn(4, 4))
    qt = Float8DelayedScalingQuantizer()(torch.randn(4, 4), ctx=QuantizeContext(scale=torch.tensor([2.0])))
    assert qt.rowwise.scale.item() == 0.5
