"""graphquant.explain: the training plan without a training step, its table and JSON, and the
warnings a recipe that silently does nothing deserves."""

import inspect
import json
import warnings

import pytest
import torch
from torch import nn

import graphquant
from graphquant import factories, recipes, zoo
from graphquant import Plan
from graphquant.quantizers import HybridQuantizer, IdentityQuantizer, MXFP8Quantizer, NVFP4Quantizer

from explain_models import MLP, TinyAttention


def x_mlp():
    return torch.randn(32, 64)


def test_training_plan_lists_the_gemms_a_backward_runs_without_running_it():
    """fprop, dgrad and wgrad per site, but the dgrad of an input that needs no gradient (the
    model's own input here) and the wgrad of a frozen weight, which no backward runs."""
    model = MLP()
    plan = graphquant.explain(model, zoo.recipe("tensorwise"), x_mlp().requires_grad_())
    assert [(g.site, g.gemm) for g in plan.gemms] == [
        (site, gemm) for site in ("fc1#0", "fc2#0") for gemm in ("fprop", "dgrad", "wgrad")
    ]
    model.fc2.weight.requires_grad_(False)
    frozen = graphquant.explain(model, zoo.recipe("tensorwise"), x_mlp())
    assert [(g.site, g.gemm) for g in frozen.gemms] == [("fc1#0", "fprop"), ("fc1#0", "wgrad"), ("fc2#0", "fprop"), ("fc2#0", "dgrad")]
    model.fc2.weight.requires_grad_(True)
    assert {g.module_type for g in plan.gemms} == {"linear"}
    wgrad = next(g for g in plan.gemms if g.site == "fc2#0" and g.gemm == "wgrad")
    assert (wgrad.a, wgrad.a_format) == ("grad_output.columnwise", "fp8_current(fp8_dtype=e5m2)")
    assert (wgrad.b, wgrad.b_format) == ("input.columnwise", "fp8_current(fp8_dtype=e4m3)")
    assert all(p.grad is None for p in model.parameters())


def test_a_plan_names_nvfp4s_hadamard_transform_only_on_the_operands_it_applies_to():
    """TE's NVFP4 recipe gives input and grad_output the random Hadamard transform, which applies to
    their columnwise side alone (wgrad's operands): fprop's and dgrad's rowwise operands are
    plain NVFP4, though the plan named them with_rht=True. The slots keep the whole quantizer."""
    plan = graphquant.explain(MLP(), recipes.nvfp4_block_scaling(), x_mlp().requires_grad_())
    formats = {(g.site, g.gemm, operand): fmt for g in plan.gemms for operand, fmt in ((g.a, g.a_format), (g.b, g.b_format))}
    assert formats[("fc2#0", "fprop", "input.rowwise")] == "nvfp4()"
    assert formats[("fc2#0", "dgrad", "grad_output.rowwise")] == "nvfp4(stochastic_rounding=True)"
    assert formats[("fc2#0", "wgrad", "grad_output.columnwise")] == "nvfp4(with_rht=True, with_post_rht_amax=True, stochastic_rounding=True)"
    assert formats[("fc2#0", "wgrad", "input.columnwise")] == "nvfp4(with_rht=True, with_post_rht_amax=True)"
    slots = {(role.name, role.tensor_type): q for role, q in plan.slots}
    for (site, _, operand), fmt in formats.items():
        tensor_type, direction = operand.split(".")
        assert ("with_rht=True" in fmt) == slots[(site.split("#")[0], tensor_type)].hadamard(direction), (site, operand, fmt)
    assert str(slots[("fc2", "grad_output")]) == "nvfp4(with_rht=True, with_post_rht_amax=True, stochastic_rounding=True)"
    assert "grad_output.rowwise: nvfp4(stochastic_rounding=True) " in str(plan)
    assert Plan.from_json(plan.to_json()) == plan


def test_a_plan_lists_no_backward_gemms_of_a_product_under_no_grad():
    """A distillation step runs its teacher under torch.no_grad: no backward runs its GEMMs, though
    its weight requires a gradient; the plan listed its dgrad and wgrad as if one did."""

    class Distilling(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.teacher, self.student = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

        def forward(self, x):
            with torch.no_grad():
                target = self.teacher(x)
            return ((self.student(x) - target) ** 2).mean()

    compiled = graphquant.compile(Distilling(), zoo.recipe("tensorwise"), backend="aot_eager")
    compiled(x_mlp().requires_grad_()).backward()
    (plan,) = compiled.graphquant.plans
    assert [(g.site, g.gemm) for g in plan.gemms] == [("teacher#0", "fprop")] + [("student#0", gemm) for gemm in ("fprop", "dgrad", "wgrad")]


def test_a_plan_lists_no_backward_gemms_of_a_detached_product():
    """A target network's (an EMA teacher's) output detached: no backward reaches its GEMMs, though
    its weight requires a gradient; the plan listed its dgrad and wgrad as under no_grad it does not."""

    class Target(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.target, self.online = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

        def forward(self, x):
            return ((self.online(x) - self.target(x).detach()) ** 2).mean()

    plan = graphquant.explain(Target(), zoo.recipe("tensorwise"), x_mlp().requires_grad_())
    assert [(g.site, g.gemm) for g in plan.gemms] == [("online#0", g) for g in ("fprop", "dgrad", "wgrad")] + [("target#0", "fprop")]


class FrozenEncoder(torch.nn.Module):
    """A frozen conditioning encoder (a text tower's 2 x 77 prompt tokens) beside a trainable linear,
    and a stem of 200 outputs whose weight is frozen, on an input that needs no gradient: no backward
    makes the encoder's or the stem's operands columnwise (the stem's bias alone trains)."""

    def __init__(self):
        super().__init__()
        self.encoder, self.stem, self.fc = torch.nn.Linear(256, 256), torch.nn.Linear(256, 200), torch.nn.Linear(256, 256)
        self.encoder.requires_grad_(False)
        self.stem.weight.requires_grad_(False)

    def forward(self, x, prompt):
        return self.fc(x) + self.stem(x).mean(-1, keepdim=True) + self.encoder(prompt).mean(1, keepdim=True)


@pytest.mark.parametrize("recipe", ["mxfp8_block_scaling", "nvfp4_block_scaling"])
def test_a_training_call_tiles_only_the_representations_its_backward_makes(recipe):
    """A frozen encoder's 154 prompt rows tile MXFP8's 1x32 rowwise blocks but not the 32x1
    columnwise ones only a wgrad would make, and the stem's 200 output rows not the columnwise ones
    only a dgrad would (its input needs no gradient): the training call failed the plan for representations
    nothing makes; it runs, planning what its backward runs."""
    model = FrozenEncoder()
    compiled = graphquant.compile(model, getattr(recipes, recipe)(), backend="aot_eager")
    compiled(torch.randn(2, 64, 256), torch.randn(2, 77, 256)).sum().backward()
    (plan,) = compiled.graphquant.plans
    assert sorted((g.site, g.gemm) for g in plan.gemms) == sorted([("encoder#0", "fprop"), ("stem#0", "fprop"), ("fc#0", "fprop"), ("fc#0", "wgrad")])
    assert model.stem.weight.grad is None and model.fc.weight.grad is not None


def test_what_explain_and_compile_do_not_take_is_refused_naming_it():
    with pytest.raises(TypeError, match=r"run the rewritten graph eagerly.*take no backend \(got backend='aot_eager'\)"):
        graphquant.explain(MLP(), zoo.recipe("tensorwise"), x_mlp(), backend="aot_eager")
    with pytest.raises(TypeError, match=r"take no backend"):
        graphquant.numerics(MLP(), zoo.recipe("tensorwise"), x_mlp(), backend="aot_eager")
    with pytest.raises(TypeError, match=r"takes the nn.Module or function to compile, got NoneType"):
        graphquant.compile(None, zoo.recipe("tensorwise"))


def test_plan_prints_as_a_table_with_a_summary_line():
    text = str(graphquant.explain(MLP(), zoo.recipe("mxfp8_fwd_high_precision_bwd"), x_mlp()))
    lines = text.splitlines()
    assert lines[0] == "graphquant plan on cpu: 2 GEMM sites, 5 GEMMs (3 native (3 in high precision), 2 emulated)"  # no dgrad of x
    assert lines[2].split() == ["site", "module_type", "gemm", "operand", "a", "operand", "b", "backend", "bucket", "why"]
    assert "input.columnwise: identity() of rowwise_dequantized" in text
    assert all(line == line.rstrip() for line in lines)


def test_matmul_sites_are_named_by_owner_and_index():
    plan = graphquant.explain(TinyAttention(), zoo.recipe("tensorwise"), torch.randn(2, 32, 32))
    assert [g.site for g in plan.gemms if g.gemm == "fprop"] == ["qkv#0", "matmul.0#0", "matmul.1#0"]
    assert [g.b for g in plan.gemms if g.site == "matmul.0#0"] == ["other.rowwise", "other.columnwise", "input.columnwise"]


def test_explain_matches_the_plan_a_compiled_model_makes():
    model, recipe = MLP(), zoo.recipe("mxfp8_fwd_nvfp4_bwd")
    compiled = graphquant.compile(model, recipe, backend="aot_eager")
    compiled(x_mlp()).sum().backward()
    assert graphquant.explain(model, recipe, x_mlp()) == compiled.graphquant.plan


def test_inference_mode_plans_fprop_only():
    plan = graphquant.explain(MLP(), zoo.recipe("tensorwise"), x_mlp(), mode="inference")
    assert [g.gemm for g in plan.gemms] == ["fprop", "fprop"]


@pytest.mark.parametrize("recipe", ["mxfp8_fwd_nvfp4_bwd", "mxfp8_fwd_high_precision_bwd", "deepseek_blockwise"])
def test_json_round_trips(recipe):
    plan = graphquant.explain(MLP(), zoo.recipe(recipe), torch.randn(128, 64))
    assert Plan.from_json(plan.to_json()) == plan
    assert json.loads(plan.to_json())["gemms"][0]["site"] == "fc1#0"


def test_json_round_trips_identity_dtypes_and_skipped_products():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(32, 32)

        def forward(self, x):
            return self.fc(x) @ torch.ones(32)  # a matrix-vector product: skipped

    recipe = graphquant.CustomRecipe(lambda role: IdentityQuantizer(dtype=torch.bfloat16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = graphquant.explain(Model(), recipe, torch.randn(32, 32))
    assert plan.skipped and "1-D operand" in plan.skipped[0][1] and "not quantized:" in str(plan)
    assert Plan.from_json(plan.to_json()) == plan


def test_graph_breaks_give_one_plan_in_graph_order():
    class Broken(MLP):
        def forward(self, x):
            h = torch.relu(self.fc1(x))
            torch._dynamo.graph_break()
            return self.fc2(h)

    plan = graphquant.explain(Broken(), zoo.recipe("tensorwise"), x_mlp())
    assert [g.site for g in plan.gemms if g.gemm == "fprop"] == ["fc1#0", "fc2#0"]


def test_graph_break_inside_a_submodule_keeps_names_from_the_root_per_module():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x):
            h = torch.relu(self.fc1(x))
            torch._dynamo.graph_break()
            return self.fc2(h)

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Block(), Block()])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    plan = graphquant.explain(Stack(), zoo.recipe("tensorwise"), torch.randn(16, 32))
    # Dynamo compiles each block's code, before and after the break, for that block alone.
    sites = ["layers.0.fc1#0", "layers.0.fc2#0", "layers.1.fc1#0", "layers.1.fc2#0"]
    assert [g.site for g in plan.gemms if g.gemm == "fprop"] == sites


class BreakingBody(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        torch._dynamo.graph_break()  # a print, a .item(), transformers' logger.warning_once
        return h


def test_functional_products_are_numbered_across_graph_breaks_and_kept_by_recompiles():
    """One owner's functional products on both sides of a graph break are linear.0 and linear.1,
    not linear.0 twice (one slot for two weights); a recompile for a new shape names them again
    so, and so continues their delayed-scaling state."""

    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = nn.Parameter(torch.randn(32, 32) / 8), nn.Parameter(torch.randn(32, 32) / 8)

        def forward(self, x):
            h = x @ self.w1.T
            torch._dynamo.graph_break()
            return torch.relu(h) @ self.w2.T

    compiled = graphquant.compile(Functional(), recipes.delayed_scaling(amax_history_len=4), backend="aot_eager")
    for rows in (16, 24, 40):  # the second compiles the dynamic graphs
        compiled(torch.randn(rows, 32)).sum().backward()
    names = [[g.site for g in plan.gemms if g.gemm == "fprop"] for plan in compiled.graphquant.plans]
    assert names == [["linear.0#0"], ["linear.1#0"]] * 2
    assert len(compiled.graphquant.state_dict()) == 8  # input, weight, grad_output of each, the numbers and the scalings


def test_a_module_under_two_names_or_two_modules_sharing_a_weight_are_told_apart_across_a_break():
    """The parameters a resumed frame lifts fit several modules here: one block registered under
    two names (named as named_modules() spells it, the first) and a second block of its class;
    two linears sharing one weight. Each graph is still the module's own, named after it."""

    class Block(nn.Module):
        def __init__(self, lin=None):
            super().__init__()
            self.lin = lin or nn.Linear(32, 32)

        def forward(self, x):
            torch._dynamo.graph_break()
            return self.lin(x)

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = self.again = Block()
            self.other = Block()
            self.a = Block()
            self.b = Block(nn.Linear(32, 32))
            self.b.lin.weight = self.a.lin.weight

        def forward(self, x):
            return self.b(self.a(self.other(self.again(x))))

    plan = graphquant.explain(Shared(), zoo.recipe("tensorwise"), torch.randn(16, 32))
    assert [g.site for g in plan.gemms if g.gemm == "fprop"] == ["first.lin#0", "other.lin#0", "a.lin#0", "b.lin#0"]


def test_modules_a_frame_holds_in_a_list_or_dict_across_a_graph_break_are_named_as_themselves():
    class Held(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x):
            listed, named = [self.a, self.b], {"q": self.c}
            torch._dynamo.graph_break()
            return named["q"](listed[1](listed[0](x)))

    plan = graphquant.explain(Held(), zoo.recipe("tensorwise"), torch.randn(16, 32))
    assert [g.site for g in plan.gemms if g.gemm == "fprop"] == ["a#0", "b#0", "c#0"]


@pytest.mark.parametrize("tied", [False, True])
def test_the_callers_code_resumed_after_a_submodules_graph_break_names_each_module(tied):
    """Dynamo resumes the caller after the break with the modules it still calls as locals of
    their own (L['stack0'], L['stack1']): each is named as named_modules() spells it, and a weight
    tied to an embedding (named twice in the model) names its own module, not the embedding's."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, 32)
            self.body = BreakingBody()
            self.fc = nn.Linear(32, 32)
            self.lm_head = nn.Linear(32, 64, bias=False)
            if tied:
                self.lm_head.weight = self.embed.weight

        def forward(self, tokens):
            return self.lm_head(torch.relu(self.fc(self.body(self.embed(tokens)))))

    asked = []

    def factory(role):
        asked.append(role.name)
        return IdentityQuantizer() if role.name == "lm_head" else MXFP8Quantizer()

    plans = []
    messages = graphquant_warnings(lambda: plans.append(graphquant.explain(Net(), graphquant.CustomRecipe(factory), torch.randint(0, 64, (2, 16)))))
    assert messages == []  # the embedding's graph holds no GEMM, the model's others do
    [plan] = plans
    assert [g.site for g in plan.gemms if g.gemm == "fprop"] == ["body.fc#0", "fc#0", "lm_head#0"]
    assert sorted(set(asked)) == ["body.fc", "fc", "lm_head"]
    assert {g.a_format for g in plan.gemms if g.site == "lm_head#0"} == {"identity()"}


@torch.compiler.disable
def eager_gelu(x):  # a print, a logger call, attention under torch.compiler.disable
    return torch.nn.functional.gelu(x)


def test_a_method_resumed_after_a_graph_break_inside_an_expression_names_its_modules_per_layer():
    """A break inside ``self.merge(eager_gelu(...))`` leaves the bound method self.merge on the
    stack: the resumed frame reaches the block as L['___stack0'].__self__. Its linear and its
    functional products were named __self__.o.linear.0 and matmul.0, one slot for both layers'
    (delayed scaling mixed their amaxes) that a rule for "layers.0.o" did not reach."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.o = nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x):
            return self.merge(eager_gelu(self.fc(x)))

        def merge(self, h):
            return self.o(h) @ (h.transpose(-1, -2) @ h)

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Block(), Block()])

        def forward(self, x):
            return self.layers[1](self.layers[0](x))

    def factory(role):
        return IdentityQuantizer() if role.name == "layers.0.o" else factories.delayed_scaling_factory(role, amax_history_len=4)

    compiled = graphquant.compile(Stack(), graphquant.CustomRecipe(factory), backend="aot_eager")
    messages = graphquant_warnings(lambda: compiled(torch.randn(2, 16, 32)).sum().backward())
    assert messages == []
    plan = Plan.combine(compiled.graphquant.plans)
    names = [f"layers.{i}.{site}#0" for i in (0, 1) for site in ("fc", "o", "matmul.0", "matmul.1")]
    assert sorted({g.site for g in plan.gemms}) == sorted(names)
    assert {g.a_format for g in plan.gemms if g.site == "layers.0.o#0"} == {"identity()"}
    assert "identity()" not in {g.a_format for g in plan.gemms if g.site == "layers.1.o#0"}


def rht_on_grad_output_only(role):
    """wgrad multiplies grad_output through a Hadamard transform by input without one: rejected."""
    if role.tensor_type == "grad_output":
        return NVFP4Quantizer(with_rht=True, with_post_rht_amax=True)
    return MXFP8Quantizer()


def test_rejected_gemms_are_shown_with_their_reason_instead_of_failing():
    plan = graphquant.explain(MLP(), graphquant.CustomRecipe(rht_on_grad_output_only), x_mlp())
    rejected = [g for g in plan.gemms if g.bucket == "rejected"]
    assert [(g.site, g.gemm) for g in rejected] == [("fc1#0", "wgrad"), ("fc2#0", "wgrad")]
    assert "Hadamard" in rejected[0].reason
    assert "2 rejected" in plan.summary()
    compiled = graphquant.compile(MLP(), graphquant.CustomRecipe(rht_on_grad_output_only), backend="aot_eager")
    with pytest.raises(Exception, match="Hadamard"):
        compiled(x_mlp())


def test_strict_shows_every_gemm_it_would_reject():
    """On a device without native low-precision GEMMs (this CPU), strict=True rejects every
    quantized GEMM: explain lists them all with the reason, where compile fails on the first."""
    recipe = zoo.recipe("mxfp8_fwd_high_precision_bwd")  # fprop in MXFP8, dgrad and wgrad in high precision
    plan = graphquant.explain(MLP(), recipe, x_mlp(), strict=True)
    assert {(g.gemm, g.bucket) for g in plan.gemms} == {("fprop", "rejected"), ("dgrad", "native"), ("wgrad", "native")}
    assert plan.summary() == "graphquant plan on cpu: 2 GEMM sites, 5 GEMMs (3 native (3 in high precision), 2 rejected)"
    fprop = next(g for g in plan.gemms if g.gemm == "fprop")
    assert fprop.reason == (  # not "give this GEMM a pair with a native GEMM on cpu": the CPU has none
        "strict=True rejects emulated GEMMs, and cpu runs every low-precision GEMM emulated: compile without strict, "
        "or on a GPU with native GEMMs (Hopper: FP8)"
    )
    compiled = graphquant.compile(MLP(), recipe, backend="aot_eager", strict=True)
    with pytest.raises(graphquant.PlanError, match=r"^fc1#0 \(linear\) fprop: .*: rejected: strict=True rejects"):
        compiled(x_mlp())


def test_plan_errors_surface_as_themselves():
    with pytest.raises(graphquant.PlanError, match="multiple of 32"):
        graphquant.explain(MLP(), graphquant.recipes.mxfp8_block_scaling(), torch.randn(4, 64))


def graphquant_warnings(run):
    """The warnings that ``run`` raised at its caller's line in this file, as graphquant's do."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if w.filename == __file__]


def test_a_recipe_that_quantizes_nothing_warns():
    recipe = graphquant.CustomRecipe(factories.high_precision_factory)
    messages = graphquant_warnings(lambda: graphquant.explain(MLP(), recipe, x_mlp()))
    assert any("quantizes no GEMM" in m for m in messages)


def test_one_quantizer_for_every_role_is_fine():
    recipe = graphquant.CustomRecipe(factories.mxfp8_factory)
    assert graphquant_warnings(lambda: graphquant.explain(MLP(), recipe, x_mlp())) == []


def test_a_backward_only_recipe_does_not_warn_in_training():
    recipe = zoo.recipe("high_precision_fwd_mxfp8_bwd")
    assert graphquant_warnings(lambda: graphquant.explain(MLP(), recipe, x_mlp())) == []


def test_expected_names_that_match_no_module_warn_with_suggestions():
    def factory(role):
        if role.name in ("fc3", "lm_head"):
            return HybridQuantizer(rowwise_quantizer=MXFP8Quantizer(), columnwise_quantizer=IdentityQuantizer())
        return MXFP8Quantizer()

    recipe = graphquant.CustomRecipe(factory, expected_names=("fc3", "lm_head", "fc1"))
    messages = graphquant_warnings(lambda: graphquant.explain(MLP(), recipe, x_mlp()))
    assert len(messages) == 2
    assert "'fc3'" in messages[0] and "did you mean 'fc2' or 'fc1'?" in messages[0]
    assert "'lm_head'" in messages[1] and "did you mean" not in messages[1] and "fc1, fc2" in messages[1]


def test_expected_names_match_whole_modules_and_their_children():
    model = nn.Sequential(MLP(), MLP(d_in=32))
    recipe = graphquant.CustomRecipe(factories.mxfp8_factory, expected_names=("0", "1.fc2"))
    assert graphquant_warnings(lambda: graphquant.explain(model, recipe, x_mlp())) == []


@pytest.mark.parametrize("names", ["lm_head", ["lm_head"], ("lm_head", 3)])
def test_expected_names_are_a_tuple_of_names(names):
    with pytest.raises(ValueError, match=r"expected_names must be a tuple of module names, e\.g\. \('lm_head',"):
        graphquant.CustomRecipe(factories.mxfp8_factory, expected_names=names)


class BrokenMLP(MLP):
    """MLP whose forward Dynamo compiles as two graphs, fc1's and fc2's."""

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        torch._dynamo.graph_break()
        return self.fc2(h)


@pytest.mark.parametrize("how", ["explain", "compile", "function"])
def test_expected_names_are_checked_against_every_graph_of_the_first_call(how):
    """Each of two graphs holds one expected name; neither is missing from the model."""
    model, recipe = BrokenMLP(), graphquant.CustomRecipe(factories.mxfp8_factory, expected_names=("fc1", "fc2", "fc3"))
    if how == "explain":
        run = lambda: graphquant.explain(model, recipe, x_mlp())
    else:
        compiled = graphquant.compile(model if how == "compile" else model.forward, recipe, backend="aot_eager")
        run = lambda: compiled(x_mlp())
    messages = graphquant_warnings(run)
    assert len(messages) == 1 and "'fc3'" in messages[0] and "fc1, fc2" in messages[0], messages
    if how != "explain":
        assert graphquant_warnings(run) == []  # said once, by the call that compiled


@pytest.mark.skipif(
    "isolate_recompiles" not in inspect.signature(torch.compile).parameters,
    reason="torch.compile(isolate_recompiles=...) arrived in torch 2.13",
)
def test_repeated_explains_do_not_use_up_the_recompile_limit():
    for _ in range(torch._dynamo.config.recompile_limit + 2):
        model = nn.Sequential(nn.Linear(64, 32))
        assert len(graphquant.explain(model, zoo.recipe("tensorwise"), x_mlp().requires_grad_()).gemms) == 3


def test_the_models_keyword_inputs_reach_it():
    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(64, 64)

        def forward(self, x, *, mask):
            return self.fc(x * mask)

    x = x_mlp()
    plan = graphquant.explain(Masked(), zoo.recipe("tensorwise"), x, example_kwargs={"mask": torch.ones_like(x)})
    assert {(g.site, g.gemm) for g in plan.gemms} == {("fc#0", "fprop"), ("fc#0", "wgrad")}  # x needs no gradient
    report = graphquant.numerics(Masked(), zoo.recipe("tensorwise"), x, example_kwargs={"mask": torch.ones_like(x)})
    assert {g.site for g in report.gemms} == {"fc#0"}


def test_json_that_is_no_plan_is_refused_saying_so():
    with pytest.raises(ValueError, match="not the JSON of a graphquant plan .* it has no device, slots, gemms, skipped"):
        graphquant.Plan.from_json("{}")
