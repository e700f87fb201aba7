"""Bad input: each case gives a clear error or a documented, tested behaviour.

A plan that fails compiles to a graph that raises its PlanError, so the error reaches the caller
as itself (raised inside the backend, Dynamo would wrap it in BackendCompilerFailed).
"""

import copy
import pathlib
import re
import sys
import traceback
import warnings

import models
import pytest
import torch
from reference import (  # noqa: F401
    GemmTape,
    Reference,
    assert_same_results,
    forward_backward,
    fresh_dynamo,
)

import graphquant
from graphquant import CustomRecipe, PlanError, factories, recipes, zoo
from graphquant.passes.result_extraction import ResultExtraction
from graphquant.passes.saturating_cast import SaturatingCast
from graphquant.quantizers import (
    MXFP8Quantizer,
    NVFP4Quantizer,
)


def x3(batch=2, seq=32, dim=64):
    return torch.randn(batch, seq, dim, generator=torch.Generator().manual_seed(0))


def plan_error(model, recipe, x, **kwargs) -> PlanError:
    """Compile and run one training step, which must fail with a PlanError; return it."""
    compiled = graphquant.compile(model, recipe, backend="aot_eager", **kwargs)
    with pytest.raises(PlanError) as info:
        compiled(x.clone().requires_grad_()).sum().backward()
    return info.value


def gemm(a, b):
    return a @ b


@pytest.mark.parametrize("what", ["module", "function"])
def test_a_plan_error_is_raised_as_itself_from_the_call_that_compiles(what):
    """Not as Dynamo's BackendCompilerFailed under PyTorch's advice to report a bug: ``except
    PlanError`` catches it, and its traceback leads from this call to graphquant's compiled graph."""
    if what == "module":
        compiled, args = graphquant.compile(models.MLP(d_in=48), recipes.mxfp8_block_scaling(), backend="aot_eager"), (x3(dim=48),)
        site = "fc1#0 (linear)"
    else:
        compiled, args = graphquant.compile(gemm, recipes.mxfp8_block_scaling(), backend="aot_eager"), (x3(dim=48), torch.randn(48, 32))
        site = "matmul.0#0 (matmul)"
    with pytest.raises(PlanError, match=re.escape(site) + r" input: .*dim 1 of the 64x48 tensor must be a multiple of 32") as info:
        compiled(*args)
    shown = "".join(traceback.format_exception(info.value))
    assert "BackendCompilerFailed" not in shown and "report" not in shown and "TORCHDYNAMO" not in shown, shown
    frames = [frame.filename for frame in traceback.extract_tb(info.value.__traceback__)]
    assert frames[0] == __file__ and "graphquant" in pathlib.PurePath(frames[-1]).parts, frames


def test_model_without_gemm_warns_at_the_users_call_and_runs_unchanged():
    model = models.seeded(models.NoGemm())
    x = x3()
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend="aot_eager", fullgraph=True)
    with pytest.warns(UserWarning, match="no GEMM") as record:
        y = compiled(x)
    assert [w.filename for w in record] == [__file__]  # this line, not a frame inside torch.compile
    assert torch.equal(y, model(x))
    assert compiled.graphquant.plan.gemms == ()
    assert compiled.graphquant.planner.factory_calls == 0


@pytest.mark.parametrize(
    "recipe, meant",
    [
        (recipes.mxfp8_block_scaling, "a preset, which makes one: call it, recipes.mxfp8_block_scaling()"),
        (factories.mxfp8_factory, "make it a recipe: CustomRecipe(mxfp8_factory)"),
        (zoo.tensorwise_factory, "zoo.recipe('tensorwise')"),
        (zoo.recipe, "zoo.recipe(NAME)"),
        ("mxfp8_block_scaling", "call recipes.mxfp8_block_scaling()"),
        ("tensorwise", "call zoo.recipe('tensorwise')"),
        ("mxfp8(fp8_dtype=e4m3)", "returns graphquant.parse_spec('mxfp8(fp8_dtype=e4m3)')"),
        ("fp8_everything", "preset names: delayed_scaling,"),
        (MXFP8Quantizer, "a factory(role) that returns MXFP8Quantizer(...)"),
        (MXFP8Quantizer(), "a factory(role) that returns it"),
        (CustomRecipe, "make one: CustomRecipe(factory)"),
        (3, "recipes.NAME() (a preset), zoo.recipe(NAME) or CustomRecipe(factory)"),
    ],
    ids=[
        "uncalled_preset", "bare_factory", "zoo_factory", "zoo_recipe_function", "preset_name", "zoo_name",
        "spec_string", "unknown_name", "quantizer_class", "quantizer", "recipe_class", "number",
    ],
)
def test_a_recipe_of_the_wrong_type_says_which_call_was_meant(recipe, meant):
    with pytest.raises(TypeError, match=r"graphquant needs a CustomRecipe, got .*" + re.escape(meant)):
        graphquant.compile(models.MLP(), recipe)


@pytest.mark.parametrize("entry", [graphquant.explain, graphquant.numerics])
def test_explain_and_numerics_say_the_same(entry):
    with pytest.raises(TypeError, match=re.escape("call it, recipes.current_scaling()")):
        entry(models.MLP(), recipes.current_scaling, x3())


def test_a_preset_given_as_a_factory_and_a_preset_name_given_to_the_zoo_point_at_the_preset():
    with pytest.raises(ValueError, match=re.escape("does not take; if it makes a recipe, call it instead: recipes.mxfp8_block_scaling()")):
        CustomRecipe(recipes.mxfp8_block_scaling)
    # A quantizer takes one argument too (a tensor): it was taken, and the first call failed inside the factory's call.
    with pytest.raises(ValueError, match=re.escape("got the quantizer mxfp8(fp8_dtype=e4m3) itself: CustomRecipe(lambda role: MXFP8Quantizer(fp8_dtype='e4m3'))")):
        CustomRecipe(MXFP8Quantizer())
    with pytest.raises(ValueError, match=re.escape("a preset of graphquant.recipes: call recipes.mxfp8_block_scaling()")):
        zoo.recipe("mxfp8_block_scaling")
    with pytest.raises(ValueError, match="unknown zoo recipe 'tensorwize'; did you mean 'tensorwise'"):
        zoo.recipe("tensorwize")
    with pytest.raises(AttributeError, match=re.escape("tensorwise is a zoo recipe: zoo.recipe('tensorwise')")):
        recipes.tensorwise()


@pytest.mark.parametrize(
    "seed, error, said",
    [
        ("a", TypeError, "got str 'a'"), (None, TypeError, "got NoneType None"), (1.5, TypeError, "got float 1.5"),
        (True, TypeError, "got bool True"), (2**63, ValueError, f"from -2\\*\\*63 to 2\\*\\*63 - 1 .*got {2**63}"),
    ],
)
def test_a_seed_that_is_no_int64_is_refused_at_compile(seed, error, said):
    """It failed only at the first call that drew random bits, inside Dynamo (an inference model
    took it silently), and 1.5 drew as 1."""
    with pytest.raises(error, match=r"graphquant.compile: seed is an int.*" + said):
        graphquant.compile(models.MLP(), recipes.nvfp4_block_scaling(), seed=seed)


def test_every_int64_seed_draws_a_stream_of_its_own():
    """The accepted range is the state's: negative seeds and the int64 extremes too."""
    grads = []
    for seed in (0, -1, -(2**63), 2**63 - 1):
        model = models.seeded(models.MLP())
        compiled = graphquant.compile(model, recipes.nvfp4_block_scaling(), backend="aot_eager", seed=seed)
        compiled(x3()).sum().backward()
        assert compiled.graphquant.state_dict()["rng"].tolist() == [seed, 1]
        grads.append(model.fc1.weight.grad)
    assert not any(torch.equal(grads[0], grad) for grad in grads[1:])


def test_inference_mode_under_grad_warns_at_the_call_that_no_gradient_will_flow():
    """mode="inference" makes no backward: a call with grad enabled on parameters that require it
    would return outputs whose backward fails with torch's generic message, so graphquant says so
    on that call (not an error: evaluating with grad mode on is a common, harmless oversight)."""
    compiled = graphquant.compile(models.MLP(), recipes.mxfp8_block_scaling(), backend="aot_eager", mode="inference")
    with pytest.warns(UserWarning, match=r"mode='inference'\) makes no backward.*torch.no_grad\(\).*mode=None") as record:
        y = compiled(x3())
    assert not y.requires_grad
    assert [w.filename for w in record] == [__file__]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled(x3())


def test_numerics_refuses_inference_mode_and_says_what_to_read_instead():
    with pytest.raises(ValueError, match=r"mode='inference' makes no backward: leave mode out; the fprop rows"):
        graphquant.numerics(models.MLP(), recipes.mxfp8_block_scaling(), x3(), mode="inference")


def failing_factory(role):
    if role.name == "fc2" and role.tensor_type == "weight":
        raise RuntimeError("no format for this one")
    return factories.mxfp8_factory(role)


def test_factory_that_raises_names_the_role():
    error = plan_error(models.MLP(), CustomRecipe(failing_factory), x3())
    assert "name=fc2" in str(error) and "tensor_type=weight" in str(error)
    assert "RuntimeError: no format for this one" in str(error)
    assert isinstance(error.__cause__, RuntimeError)


def none_factory(role):
    return None if role.name == "fc2" else factories.mxfp8_factory(role)


def test_factory_returning_none_advises_identity():
    error = plan_error(models.MLP(), CustomRecipe(none_factory), x3())
    assert isinstance(error, ValueError)
    assert "None" in str(error) and "name=fc2" in str(error)
    assert "IdentityQuantizer()" in str(error)


def string_factory(role):
    return "mxfp8" if role.tensor_type == "grad_output" else factories.mxfp8_factory(role)


def test_factory_returning_a_non_quantizer_names_role_and_type():
    error = plan_error(models.MLP(), CustomRecipe(string_factory), x3())
    assert isinstance(error, TypeError)
    assert "tensor_type=grad_output" in str(error) and "name=fc1" in str(error)
    assert "returned a str" in str(error)
    assert "to build one from its spec string, return graphquant.parse_spec('mxfp8')" in str(error)


@pytest.mark.parametrize(
    "make, said",
    [
        (lambda: graphquant.Float8CurrentScalingQuantizer("e4m3", torch.device("cpu")), "force_pow_2_scales must be a bool, got device(type='cpu')"),
        (lambda: graphquant.Float8CurrentScalingQuantizer("e4m3", "cuda"), "force_pow_2_scales must be a bool, got 'cuda'"),
        (lambda: graphquant.NVFP4Quantizer(stochastic_rounding="no"), "stochastic_rounding must be a bool, got 'no'"),
        (lambda: graphquant.Float8BlockQuantizer(block_scaling_dim=True), "block_scaling_dim must be an int, got True"),
    ],
)
def test_a_quantizer_of_a_mistyped_field_is_refused_where_it_is_made(make, said):
    """TransformerEngine's positional (fp8_dtype, device) put a device in a bool field, which was
    refused only at a factory's answer: made directly, a truthy "cuda" turned power-of-two scales
    on, stochastic_rounding="no" turned rounding on and block_scaling_dim=True ran 1x128 blocks.
    The quantizer is refused when made, and a factory making one names the role."""
    with pytest.raises(TypeError, match=re.escape(said)) as made:
        make()
    assert "take no device" in str(made.value)
    error = plan_error(models.MLP(), CustomRecipe(lambda role: make()), x3())
    assert "the recipe's factory raised for role" in str(error) and said in str(error)


@pytest.mark.parametrize(
    "d_in, seq, tensor, dim, size, remedy",
    [
        # K = 48: rowwise 1x32 blocks along K, this module's own
        (48, 32, "input", "dim 1", "64x48", "return IdentityQuantizer() for roles named 'fc1'"),
        # 2 x 24 tokens: columnwise 32x1 blocks along the tokens, which every linear takes
        (64, 24, "input", "dim 0", "48x64", "IdentityQuantizer() for the input and grad_output roles of every linear they reach"),
    ],
)
def test_dims_that_do_not_tile_name_module_tensor_and_dim(d_in, seq, tensor, dim, size, remedy):
    error = plan_error(models.MLP(d_in=d_in), recipes.mxfp8_block_scaling(), x3(seq=seq, dim=d_in))
    message = str(error)
    assert message.startswith("fc1#0 (linear) input:"), message
    assert f"{tensor}:" in message and dim in message and size in message and "multiple of 32" in message
    assert message.endswith(remedy), message


@pytest.mark.slow
def test_dynamic_rows_that_stop_tiling_fail_as_static_ones_do():
    """32 then 64 rows make the row count dynamic under Inductor; 96 runs in that graph, and 40
    (which MXFP8's 32-row columnwise blocks cannot tile) raises the static check's PlanError,
    as itself, instead of failing inside Inductor; the divisible sizes still run afterwards."""
    compiled = graphquant.compile(models.MLP(), recipes.mxfp8_block_scaling(), backend="inductor")

    def step(rows):
        compiled(torch.randn(rows, 64, requires_grad=True)).sum().backward()

    for rows in (32, 64, 96):
        step(rows)
    assert len(compiled.graphquant.plans) == 2  # 96 ran in the dynamic graph made for 64
    with pytest.raises(PlanError) as info:
        step(40)
    assert str(info.value) == str(plan_error(models.MLP(), recipes.mxfp8_block_scaling(), torch.randn(40, 64)))
    assert str(info.value).startswith("fc1#0 (linear) input: mxfp8(fp8_dtype=e4m3): the columnwise representation")
    assert "40x64" in str(info.value) and "multiple of 32" in str(info.value)
    step(128)
    assert len(compiled.graphquant.plans) == 2


def test_stochastic_rounding_keeps_the_row_count_dynamic():
    """NVFP4 draws grad_output's random bits over its element count: a symbolic count, so that a
    new sequence length runs in the dynamic graph instead of compiling one more (past eight, the
    recompile limit)."""
    compiled = graphquant.compile(models.MLP(), recipes.nvfp4_block_scaling(), backend="aot_eager", dynamic=True)
    for rows in (32, 48, 64, 80):
        compiled(torch.randn(rows, 64, requires_grad=True)).sum().backward()
    assert len(compiled.graphquant.plans) == 1


def unmatched_rht_factory(role):
    """wgrad operands under different Hadamard transforms: input columnwise NVFP4 with RHT,
    grad_output columnwise NVFP4 without."""
    if role.tensor_type == "input":
        return NVFP4Quantizer(with_rht=True, with_post_rht_amax=True)
    return NVFP4Quantizer()


def test_rejected_gemm_names_module_gemm_and_both_formats():
    error = plan_error(models.MLP(), CustomRecipe(unmatched_rht_factory), x3())
    message = str(error)
    assert message.startswith("fc1#0 (linear) wgrad:"), message
    assert "grad_output.columnwise is nvfp4()" in message
    assert "input.columnwise is nvfp4(with_rht=True, with_post_rht_amax=True)" in message
    assert "rejected" in message and "Hadamard" in message
    assert "both operands" in message  # what would be accepted


def test_rht_on_every_role_is_rejected_in_dgrad_naming_the_side_that_has_it():
    """NVFP4 with RHT for every role: dgrad meets grad_output's rowwise side (no transform) with the
    weight's columnwise one (transformed); the message says which operand and side has it, and
    to leave it off the weight (asking for it on both, which the user did, would not help)."""
    recipe = CustomRecipe(lambda role: NVFP4Quantizer(with_rht=True, with_post_rht_amax=True))
    message = str(plan_error(models.MLP(), recipe, x3()))
    assert message.startswith("fc1#0 (linear) dgrad:"), message
    assert "only the second operand (its columnwise side) went through the 16-point Hadamard transform" in message
    assert "leave it off this tensor (a linear's weight" in message and "both operands" not in message


def test_wgrad_operands_under_different_sign_masks_are_rejected():
    """Both wgrad operands through the Hadamard transform, one with its random sign mask and one
    without: H_a^T H_b is no identity, so the product would be wrong by far more than rounding."""

    def factory(role):
        if role.tensor_type in ("input", "grad_output"):
            return NVFP4Quantizer(with_rht=True, with_post_rht_amax=True, with_random_sign_mask=role.tensor_type == "input")
        return NVFP4Quantizer()

    message = str(plan_error(models.MLP(), CustomRecipe(factory), x3()))
    assert message.startswith("fc1#0 (linear) wgrad:") and "rejected: its operands went through different transforms" in message
    assert "with its random sign mask" in message and "without its random sign mask" in message


def rht_everywhere_but_weights(role):
    """Every non-weight slot NVFP4 with RHT, a matmul's ``other`` included."""
    if factories.is_weight(role):
        return NVFP4Quantizer(with_2d_quantization=True)
    return NVFP4Quantizer(with_rht=True, with_post_rht_amax=True)


def test_rht_on_one_dgrad_operand_is_rejected():
    """The dgrad of attention's q @ k^T pairs grad_output.rowwise (no RHT) with other.columnwise:
    RHT on the latter alone would give a wrong product, so the compile fails naming the GEMM."""
    error = plan_error(models.DecoderBlock(attention="matmul"), CustomRecipe(rht_everywhere_but_weights), x3())
    message = str(error)
    assert message.startswith("attn.matmul.0#0 (matmul) dgrad:"), message
    assert "grad_output.rowwise" in message and "other.columnwise" in message and "Hadamard" in message


def test_nvfp4_preset_runs_activation_matmuls():
    """nvfp4_factory gives a matmul's ``other`` no RHT, so attention written with matmul plans cleanly."""
    compiled = graphquant.compile(models.DecoderBlock(attention="matmul"), recipes.nvfp4_block_scaling(), backend="aot_eager")
    compiled(x3().requires_grad_()).sum().backward()
    assert "rejected" not in {g.bucket for g in compiled.graphquant.plan.gemms}


def test_strict_makes_emulated_gemms_errors():
    error = plan_error(models.MLP(), recipes.mxfp8_block_scaling(), x3(), strict=True)
    message = str(error)
    assert message.startswith("fc1#0 (linear) fprop:") and "strict=True" in message and "emulated" in message
    # without strict the same model runs, every GEMM emulated on this CPU
    torch._dynamo.reset()
    compiled = graphquant.compile(models.MLP(), recipes.mxfp8_block_scaling(), backend="aot_eager")
    compiled(x3())
    assert {g.bucket for g in compiled.graphquant.plan.gemms} == {"emulated"}


def test_strict_accepts_an_all_native_plan():
    """All-Identity GEMMs are native everywhere, so strict=True compiles them."""
    compiled = graphquant.compile(
        models.MLP(), CustomRecipe(factories.high_precision_factory), backend="aot_eager", strict=True
    )
    with pytest.warns(UserWarning):  # graphquant notes that the recipe quantizes nothing
        compiled(x3())
    assert {g.bucket for g in compiled.graphquant.plan.gemms} == {"native"}


def test_integer_operands_are_not_quantized():
    """An integer matmul cannot be quantized (no format encodes int64, IdentityQuantizer holds
    floats only). Documented behaviour, as for other products graphquant cannot quantize
    (find_gemms: a 1-D operand, broadcast batch dims): the product is left as it is, listed in
    the plan as not quantized, and the factory is not asked about it."""
    a = torch.randint(1000, 2000, (32, 64), generator=torch.Generator().manual_seed(0))
    b = torch.randint(1000, 2000, (64, 32), generator=torch.Generator().manual_seed(1))
    compiled = graphquant.compile(models.IntegerGemm(), recipes.mxfp8_block_scaling(), backend="aot_eager", fullgraph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = compiled(a, b)
    unchanged = torch.equal(y, a @ b)
    assert unchanged, f"the integer product was quantized: it changed by up to {(y - a @ b).abs().max().item()}"
    assert compiled.graphquant.plan.gemms == (), compiled.graphquant.plan
    assert len(compiled.graphquant.plan.skipped) == 1
    assert "int64" in compiled.graphquant.plan.skipped[0][1]
    assert compiled.graphquant.planner.factory_calls == 0
    assert any("no GEMM" in str(w.message) for w in caught)


def test_an_integer_input_to_a_linear_draws_torchs_error_alone():
    """An integer input reaching nn.Linear: its product is no site (the plan lists it unquantized)
    and torch refuses it. graphquant first warned, falsely, that the model's code read the
    linear's weight itself (or that the linear was in no compiled graph)."""
    model = models.seeded(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)))
    compiled = graphquant.compile(model, recipes.current_scaling(), backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="same dtype"):
            compiled(torch.randint(0, 5, (4, 64)))
    graphquant_warnings = [str(w.message) for w in caught if "graphquant" in str(w.message)]
    assert not any("nn.Linear" in w for w in graphquant_warnings), graphquant_warnings


def test_quantizers_refuse_integer_tensors():
    with pytest.raises(TypeError, match="int64"):
        MXFP8Quantizer()(torch.ones(32, 32, dtype=torch.int64))


def test_two_recipes_on_one_model_keep_their_own():
    """graphquant.compile(model, r1) and graphquant.compile(model, r2) give two modules that share
    the parameters and each keep their own recipe: Dynamo keys its cache on the backend, so
    calling one after the other never runs the other's graph (nor recompiles either)."""
    model = models.seeded(models.MLP())
    ref_models = {name: copy.deepcopy(model) for name in ("mxfp8", "current")}
    x = x3()
    tapes = {name: GemmTape() for name in ref_models}
    compiled = {
        "mxfp8": graphquant.compile(model, recipes.mxfp8_block_scaling(), backend=tapes["mxfp8"].backend),
        "current": graphquant.compile(model, recipes.current_scaling(), backend=tapes["current"].backend),
    }
    references = {
        "mxfp8": Reference(ref_models["mxfp8"], recipes.mxfp8_block_scaling(), tape=tapes["mxfp8"]),
        "current": Reference(ref_models["current"], recipes.current_scaling(), tape=tapes["current"]),
    }
    outputs = {}
    for name in ("mxfp8", "current", "mxfp8"):
        tapes[name].clear()
        actual = forward_backward(compiled[name], model, x)
        expected = forward_backward(references[name], ref_models[name], x)
        tapes[name].assert_all_taken()
        assert_same_results(actual, expected, what=f"{name}: ")
        outputs.setdefault(name, actual["output"])
    assert not torch.equal(outputs["mxfp8"], outputs["current"])
    assert [len(c.graphquant.plans) for c in compiled.values()] == [1, 1]
    assert compiled["mxfp8"].graphquant.plan.slots[0][1] == MXFP8Quantizer()


def test_compile_mode_and_options_reach_inductor():
    model = models.MLP()
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), compile_mode="reduce-overhead", options={"max_autotune": True})
    patches = compiled.graphquant._inner().keywords["config_patches"]
    assert isinstance(patches.pop("post_grad_custom_post_pass"), SaturatingCast)
    assert isinstance(patches.pop("_post_fusion_custom_pass"), ResultExtraction)
    assert patches == {"triton.cudagraphs": True, "max_autotune": True}
    default = graphquant.compile(model, recipes.mxfp8_block_scaling())
    assert list(default.graphquant._inner().keywords["config_patches"]) == ["post_grad_custom_post_pass", "_post_fusion_custom_pass"]


def test_inductor_options_with_another_backend_are_an_error():
    with pytest.raises(ValueError, match="configure Inductor"):
        graphquant.compile(models.MLP(), recipes.mxfp8_block_scaling(), backend="aot_eager", compile_mode="reduce-overhead")


@pytest.fixture(params=["isolated", "shared"])
def recompile_counts(request, monkeypatch):
    """How Dynamo counts the recompiles of graphquant models: "isolated", each graphquant.compile
    on its own (torch >= 2.13), or "shared" by every compile of the same code, as graphquant.compile
    leaves them on torch < 2.13, where torch.compile has no isolate_recompiles."""
    if request.param == "isolated" and not graphquant.compiler._ISOLATED:
        pytest.skip("torch.compile(isolate_recompiles=...) arrived in torch 2.13")
    if request.param == "shared":
        monkeypatch.setattr(graphquant.compiler, "_ISOLATED", {})
    return request.param


@pytest.mark.parametrize("make", [models.MLP, lambda: torch.nn.Sequential(models.MLP())], ids=["MLP", "Sequential"])
def test_models_of_one_class_each_keep_their_own_recompile_budget(recompile_counts, make):
    """A process that compiles more models of one class than Dynamo's recompile limit (a sweep
    over recipes, a notebook) gets every one of them quantized."""
    x = x3()
    with torch._dynamo.config.patch(recompile_limit=2):
        for recipe in (recipes.mxfp8_block_scaling(), recipes.current_scaling(), recipes.mxfp8_block_scaling()):
            model = models.seeded(make())
            compiled = graphquant.compile(model, recipe, backend="aot_eager")
            y = compiled(x)
            assert len(compiled.graphquant.plans) == 1
            assert not torch.equal(y, model(x))


def test_running_past_the_recompile_limit_is_an_error(recompile_counts):
    """Past Dynamo's recompile limit a model would run eagerly, in high precision: it fails instead,
    saying why and what to change, and runs once the limit allows it."""
    model = models.seeded(models.MLP())
    with torch._dynamo.config.patch(recompile_limit=1):
        compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend="aot_eager", dynamic=False)
        compiled(x3(batch=2))
        # A new batch size needs a recompile, and the one this model may have is spent.
        expected = r"MLP would run unquantized.*recompile_limit = 1 .*Raise torch\._dynamo\.config\.recompile_limit"
        with pytest.raises(graphquant.RecompileLimitError, match=expected) as info:
            compiled(x3(batch=3))
        if recompile_counts == "shared":
            assert "Before torch 2.13" in str(info.value)
        # The same module under another recipe: the code's own recompile count, not the model's,
        # is spent where compiles of the same code are counted together.
        other = graphquant.compile(model, recipes.current_scaling(), backend="aot_eager", dynamic=False)
        if recompile_counts == "shared":
            with pytest.raises(graphquant.RecompileLimitError):
                other(x3(batch=2))
        else:
            other(x3(batch=2))
    assert torch._dynamo.config.fail_on_recompile_limit_hit is False
    with torch._dynamo.config.patch(recompile_limit=2):
        y = compiled(x3(batch=3))
    assert not torch.equal(y, model(x3(batch=3))) and len(compiled.graphquant.plans) == 2


def test_the_recompile_limit_reached_by_refused_sizes_says_so_with_the_refusal(recompile_counts):
    """Each token count that tiles no MXFP8 block installs a graph that raises the plan's refusal
    for that count alone; the limit's error then said to raise the limit, which only brings the
    refusal back."""
    model = models.seeded(models.MLP())
    with torch._dynamo.config.patch(recompile_limit=3):
        compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend="aot_eager", dynamic=False)
        compiled(torch.randn(64, 64, requires_grad=True)).sum().backward()
        for tokens in (40, 48):
            with pytest.raises(graphquant.PlanError, match=f"{tokens}x64 tensor must be a multiple of 32"):
                compiled(torch.randn(tokens, 64, requires_grad=True))
        with pytest.raises(graphquant.RecompileLimitError, match=r"2 of this model's graphs only raise the plan's refusal .*48x64 tensor"):
            compiled(torch.randn(72, 64, requires_grad=True))


def test_dynamos_suppress_errors_does_not_run_a_graphquant_model_unquantized():
    """torch._dynamo.config.suppress_errors runs code eagerly, with a log line, where compiling it
    fails: for a graphquant model that is its products unquantized, so its compiles keep raising
    (past the recompile limit, and where the inner backend fails), and the flag is the user's again after."""
    model = models.seeded(models.MLP())
    with torch._dynamo.config.patch(suppress_errors=True, recompile_limit=1):
        compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend="aot_eager", dynamic=False)
        compiled(x3(batch=2))
        with pytest.raises(graphquant.RecompileLimitError):
            compiled(x3(batch=3))
        failing = graphquant.compile(models.seeded(models.MLP()), recipes.mxfp8_block_scaling(), options={"not_an_option": 1})
        with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="not_an_option"):
            failing(x3())
        assert torch._dynamo.config.suppress_errors is True


def test_a_function_running_past_the_recompile_limit_is_an_error():
    """A compiled function (no module whose Dynamo callback graphquant can wrap) fails the same way."""
    model = models.seeded(models.MLP())

    def forward(x):
        return model(x)

    with torch._dynamo.config.patch(recompile_limit=1):
        compiled = graphquant.compile(forward, recipes.mxfp8_block_scaling(), backend="aot_eager", dynamic=False)
        compiled(x3(batch=2))
        with pytest.raises(graphquant.RecompileLimitError, match="forward would run unquantized"):
            compiled(x3(batch=3))
    assert torch._dynamo.config.fail_on_recompile_limit_hit is False

def test_a_call_that_compiles_nothing_runs_no_python_of_graphquant_compile_but_its_entry_check():
    """Checking the recompile limit and feeding per-call state are compile-time matters where the
    graph keeps no state: a decode step under CUDA graphs, which Python sets the pace of, runs one
    frame of graphquant/compiler.py, the forward's two flag reads that refuse torch.export and
    torch.func, which may come at any call."""
    compiled = graphquant.compile(models.seeded(models.MLP()), recipes.mxfp8_block_scaling(), backend="aot_eager", mode="inference")
    x = x3()
    codes = []
    with torch.no_grad():
        compiled(x)
        sys.setprofile(lambda frame, event, arg: codes.append(frame.f_code) if event == "call" else None)
        try:
            compiled(x)
        finally:
            sys.setprofile(None)
    ours = [code for code in codes if code.co_filename == graphquant.compiler.__file__]
    assert len(codes) > 1 and ours == [compiled.forward.__code__]


@pytest.mark.parametrize("weights, inputs", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.float32, torch.float64)])
def test_operands_of_different_dtypes_are_refused_as_torch_refuses_them(weights, inputs):
    """Outside autocast torch's linear refuses an input of another dtype than its weight (an
    input left in float32 after model.to(torch.bfloat16)); a quantized one says so, naming the
    site and both dtypes, rather than promote them. The same call with the input cast runs."""
    model = models.MLP().to(weights)
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend="aot_eager")
    x = x3().to(inputs)
    with pytest.raises(graphquant.MixedDtypesError, match=rf"^fc1#0: its operands are of different dtypes \(input {inputs}, weight {weights}.*cast the input to the model's dtype \({weights}\)"):
        compiled(x)
    assert compiled(x.to(weights)).dtype == weights


def test_a_bias_of_another_dtype_is_refused_naming_the_parameters_not_the_input():
    """The input matched the weight; the advice was still to cast the input."""
    linear = models.seeded(torch.nn.Sequential(torch.nn.Linear(64, 64)))
    linear[0].bias.data = linear[0].bias.data.double()
    compiled = graphquant.compile(linear, recipes.current_scaling(), backend="aot_eager")
    with pytest.raises(graphquant.MixedDtypesError, match=r"bias torch.float64\).*give the module's parameters one dtype \(model.to\(dtype\)\)"):
        compiled(torch.randn(4, 64))


def test_a_root_linear_of_mixed_dtypes_is_named_as_the_compiled_model():
    """A compiled nn.Linear is its own site, named "" ("#0" alone in the message)."""
    compiled = graphquant.compile(models.seeded(torch.nn.Linear(64, 64)), recipes.current_scaling(), backend="aot_eager")
    with pytest.raises(graphquant.MixedDtypesError, match=r"^the compiled model itself \(#0\): its operands are of different dtypes"):
        compiled(torch.randn(4, 64, dtype=torch.float64))


def test_a_frozen_model_and_addmm_refuse_operands_of_different_dtypes_too():
    """A frozen linear's input against the dtype its weight was frozen from, and addmm's added
    tensor against its product's operands."""
    model = models.seeded(torch.nn.Sequential(torch.nn.Linear(64, 64)))
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), mode="inference", backend="aot_eager")
    with torch.no_grad():
        compiled(x3())
        graphquant.freeze(compiled)
        with pytest.raises(graphquant.MixedDtypesError, match=r"input torch.bfloat16, weight torch.float32, bias torch.float32"):
            compiled(x3().bfloat16())

    class AddMm(torch.nn.Module):
        def forward(self, c, a, b):
            return torch.addmm(c, a, b)

    addmm = graphquant.compile(AddMm(), recipes.mxfp8_block_scaling(), backend="aot_eager")
    a, b = torch.randn(32, 64), torch.randn(64, 32)
    with pytest.raises(graphquant.MixedDtypesError, match=r"input torch.float32, added torch.bfloat16\).*cast one operand to the other's dtype"):
        addmm(torch.zeros(32, 32, dtype=torch.bfloat16), a, b)


def test_a_matmul_of_two_activations_names_its_operands_as_the_plan_does():
    """A matmul's right operand is an activation, the site's "other": the error called it the
    weight and advised casting the input to "the model's dtype", which no parameter sets here."""

    class MatMul(torch.nn.Module):
        def forward(self, a, b):
            return a @ b

    compiled = graphquant.compile(MatMul(), recipes.mxfp8_block_scaling(), backend="aot_eager")
    with pytest.raises(graphquant.MixedDtypesError, match=r"\(input torch.float32, other torch.bfloat16\).*; cast one operand to the other's dtype, or run"):
        compiled(torch.randn(32, 64), torch.randn(64, 32, dtype=torch.bfloat16))


def test_torch_compiles_mode_given_as_mode_points_to_compile_mode():
    with pytest.raises(ValueError, match=r"got 'max-autotune'; torch.compile's mode is graphquant.compile's compile_mode='max-autotune'"):
        graphquant.compile(models.MLP(), recipes.mxfp8_block_scaling(), mode="max-autotune")
