"""A graphquant model among torch's own wrappers: a torch.compile around it (a trainer's
torch_compile=True), a torch.compile'd module given to it, and copy.deepcopy of it.

Each must run quantized as graphquant.compile planned, name sites as the user's module names
them, and keep its state its own: none of them may run the model unquantized without a word.
"""

import copy
import re
import warnings

import models
import pytest
import torch
from reference import fresh_dynamo  # noqa: F401

import graphquant
from graphquant import recipes


def mlp():
    return models.seeded(models.MLP())


def x2(seed=0):
    return torch.randn(32, 64, generator=torch.Generator().manual_seed(seed))


def quantized(model, recipe=None):
    return graphquant.compile(model, recipe or recipes.mxfp8_block_scaling(), backend="aot_eager")


@pytest.mark.parametrize("first_call", ["direct", "through the torch.compile"])
@pytest.mark.parametrize("around", ["the model", "a module holding it"])
def test_a_torch_compile_around_a_graphquant_model_runs_it_quantized(around, first_call):
    """Also where the enclosing torch.compile makes the model's first call (a trainer wraps the
    model before any step): its frame then held graphquant's first-call wrapper, which Dynamo
    inlined, and the model ran unquantized at every call."""
    x = x2()
    expected = quantized(mlp())(x)
    assert not torch.equal(expected, mlp()(x))  # quantized, not the plain model's bits
    model = quantized(mlp())
    if first_call == "direct":
        model(x)
    outer = model if around == "the model" else torch.nn.Sequential(model, torch.nn.Identity())
    assert torch.equal(torch.compile(outer, backend="aot_eager")(x), expected)
    assert len(model.graphquant.plans) == 1


def test_a_graphquant_compiled_function_inside_a_torch_compile_runs_quantized():
    weight = mlp().fc1.weight.detach()
    product = graphquant.compile(lambda a, w: a @ w.t(), recipes.mxfp8_block_scaling(), backend="aot_eager")
    x = x2()
    expected = product(x, weight)
    assert not torch.equal(expected, x @ weight.t())
    assert torch.equal(torch.compile(lambda a, w: product(a, w) * 2, backend="aot_eager")(x, weight), expected * 2)
    fresh = graphquant.compile(lambda a, w: a @ w.t(), recipes.mxfp8_block_scaling(), backend="aot_eager")
    assert torch.equal(torch.compile(fresh, backend="aot_eager")(x, weight), expected)  # torch.compile of it, its first call
    assert len(fresh.graphquant.plans) == 1


def test_a_graphquant_model_inside_another_keeps_its_own_recipe_when_the_outer_calls_it_first():
    """A model of one recipe held by a model compiled under another: the inner one runs its own
    recipe and names its own sites, even when the outer model's first call makes its first."""
    x = x2()
    inner = quantized(mlp())
    outer = graphquant.compile(torch.nn.Sequential(inner, torch.nn.Identity()), recipes.current_scaling(), backend="aot_eager")
    assert torch.equal(outer(x), quantized(mlp())(x))
    assert [g.site for g in inner.graphquant.plan.gemms if g.gemm == "fprop"] == ["fc1#0", "fc2#0"]


def test_a_torch_compiled_module_is_compiled_as_the_module_it_wraps():
    names = []

    def high_precision_fc2(role):
        names.append(role.name)
        return graphquant.IdentityQuantizer() if role.name == "fc2" else graphquant.MXFP8Quantizer()

    x = x2()
    model = graphquant.compile(torch.compile(mlp()), graphquant.CustomRecipe(high_precision_fc2), backend="aot_eager")
    direct = graphquant.compile(mlp(), graphquant.CustomRecipe(high_precision_fc2), backend="aot_eager")
    assert torch.equal(model(x), direct(x))
    assert set(names) == {"fc1", "fc2"}


def test_a_torch_compiled_submodule_runs_quantized_and_is_not_named_as_in_no_graph():
    """A submodule torch.compile'd before graphquant.compile of its model: its linears are
    quantized under its own name (no _orig_mod), and the check for linears in no compiled graph
    reads them so too (it named them as run in high precision)."""

    class Pair(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = mlp(), mlp()

        def forward(self, x):
            return self.b(self.a(x))

    x = x2()
    expected = quantized(Pair())(x)
    pair = Pair()
    pair.a = torch.compile(pair.a)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = quantized(pair)
        assert torch.equal(model(x), expected)
    assert not [str(w.message) for w in caught if "graphquant" in str(w.message)]
    assert sorted({g.site for g in model.graphquant.plan.gemms}) == ["a.fc1#0", "a.fc2#0", "b.fc1#0", "b.fc2#0"]


def test_a_graphquant_model_is_not_compiled_or_explained_again():
    """The message named graphquant.compile where graphquant.explain was called."""
    with pytest.raises(TypeError, match=r"^graphquant: this MLP is already a graphquant model.*model._orig_mod"):
        quantized(quantized(mlp()))
    with pytest.raises(TypeError, match=r"^graphquant: this MLP is already a graphquant model; to compile, explain"):
        graphquant.explain(quantized(mlp()), recipes.current_scaling(), x2())


def test_disable_true_returns_the_model_itself_as_torch_compile_does():
    """torch.compile's switch (``disable=not args.compile``) returns the model, which runs in high
    precision; graphquant.compile failed on it with an AttributeError about dynamo_ctx."""
    model, x = mlp(), x2()
    assert graphquant.compile(model, recipes.mxfp8_block_scaling(), disable=True) is model
    assert torch.equal(model(x), mlp()(x))
    forward = mlp().forward
    assert graphquant.compile(forward, recipes.mxfp8_block_scaling(), disable=True) is forward
    with pytest.raises(TypeError, match=r"graphquant needs a CustomRecipe"):  # the switch hides no mistake in the rest
        graphquant.compile(mlp(), "mxfp8", disable=True)
    with pytest.raises(TypeError, match=r"graphquant.explain and graphquant.numerics plan .* disable=True switches off"):
        graphquant.explain(mlp(), recipes.mxfp8_block_scaling(), x, disable=True)


def test_a_deep_copy_is_a_graphquant_model_of_its_own_that_continues_from_the_original():
    x = x2()
    reference = quantized(mlp(), recipes.delayed_scaling())
    reference(x)
    second = reference(x)

    original = quantized(mlp(), recipes.delayed_scaling())
    original(x)
    twin = copy.deepcopy(original)
    assert torch.equal(twin(x), second)  # the amax history carried over
    twin(10 * x)  # the twin's own history, not the original's
    assert torch.equal(original(x), second)
    assert len(original.graphquant.plans) == 1 and len(twin.graphquant.plans) == 1
    assert twin._orig_mod.fc1.weight is not original._orig_mod.fc1.weight


def test_a_deep_copy_of_a_model_not_called_yet_starts_afresh_saying_nothing():
    """Copied before its first call, the model has no state to carry: its copy's first call said
    that a loaded state had no entry for its slots, so that the run did not continue the saved one."""
    twin = copy.deepcopy(quantized(mlp(), recipes.delayed_scaling()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        twin(x2())
    assert not [str(w.message) for w in caught if "graphquant" in str(w.message)]


def test_linears_in_no_graph_are_named_after_the_first_compile():
    """A module run outside any graph (here disabled for torch.compile: as a graph break torch
    cannot take inside a checkpointed block leaves it) runs in high precision: said once."""

    class Skipping(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

        def forward(self, x):
            return self.fc2(torch.compiler.disable(self.fc1)(x))

    model = quantized(models.seeded(Skipping()))
    with pytest.warns(UserWarning, match=r"1 of the model's 2 nn.Linear modules are in no compiled graph \(fc1\)"):
        model(x2())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x2())


def test_the_linears_of_a_graphquant_model_inside_the_model_are_its_own():
    """A block compiled by graphquant.compile on its own, then the model around it: the block's
    linears run quantized under the block's recipe, in its own graphs; the outer model's first call
    said they were in no compiled graph, "eagerly, in high precision"."""

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block, self.head = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64)), torch.nn.Linear(64, 64)

        def forward(self, x):
            return self.head(self.block(x))

    model = models.seeded(Outer())
    model.block = graphquant.compile(model.block, recipes.mxfp8_block_scaling(), backend="aot_eager")
    outer = graphquant.compile(model, recipes.current_scaling(), backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outer(x2())
    assert not [w for w in caught if "graphquant" in str(w.message)], [str(w.message) for w in caught]
    assert [g.site for g in outer.graphquant.plan.gemms] == ["head#0"] * 3
    assert {g.site for g in model.block.graphquant.plan.gemms} == {"0#0", "2#0"}


@pytest.mark.parametrize("spelling", ["F.linear", "weight * mask"])
def test_a_linear_whose_weight_the_model_multiplies_itself_is_named_with_its_sites(spelling):
    """A model that reads a head's weight itself (``F.linear(h, self.head.weight)``, as fused-loss
    code does) never calls the head: its product is planned by the site that multiplies it, which
    a recipe's rule for "head" does not reach. The warning said the head ran eagerly in high
    precision, the opposite of what happened; it says where the weight is read now."""

    class ReadingItsHeadsWeight(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.head = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64, bias=False)
            self.register_buffer("mask", torch.ones(64, 64))

        def forward(self, x):
            h = self.fc1(x)
            return torch.nn.functional.linear(h, self.head.weight if spelling == "F.linear" else self.head.weight * self.mask)

    model = quantized(models.seeded(ReadingItsHeadsWeight()))
    where = r"multiplied in linear\.0" if spelling == "F.linear" else r"read by other ops, or multiplied after them"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(x2())
    messages = [str(w.message) for w in caught]
    assert any(re.search(rf"reads these nn.Linear modules' weights itself, without calling them: head \({where}\)", m) for m in messages), messages
    assert not any("in no compiled graph" in m for m in messages), messages


@pytest.mark.parametrize("evaluated_first", [False, True])
@pytest.mark.parametrize("call", ["a graphquant model", "a graphquant function"])
def test_products_of_parameterless_code_run_eagerly_are_counted_at_the_first_training_call(call, evaluated_first):
    """Attention's products in a module of no parameters, under torch.compiler.disable, ran in
    high precision where no check of modules or parameters sees them: the first training call
    counts the products its outputs' autograd graph holds outside the compiled graphs (not those
    of the inputs' own history), once, also where an evaluation under no_grad (which makes no
    autograd graph) came first; a model whose products are all in its graphs says nothing."""

    class Scores(torch.nn.Module):
        def forward(self, q, k):
            return q @ k.transpose(-1, -2)

    class Attention(torch.nn.Module):
        def __init__(self, disabled):
            super().__init__()
            self.q, self.k, self.scores = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), Scores()
            self.disabled = disabled

        def forward(self, x):
            q, k = (p(x).view(2, 16, 4, 16).transpose(1, 2) for p in (self.q, self.k))
            return (torch.compiler.disable(self.scores) if self.disabled else self.scores)(q, k)

    def compiled(disabled):
        model = models.seeded(Attention(disabled))
        recipe = recipes.current_scaling()  # no blocks for the heads' 16 dims to fill
        return quantized(model, recipe) if call == "a graphquant model" else quantized(model.forward, recipe)

    x = torch.randn(32, 64, requires_grad=True) @ torch.randn(64, 64)  # an input with a product of its own
    model = compiled(disabled=True)
    if evaluated_first:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("error", message="graphquant")
            model(x)
    with pytest.warns(UserWarning, match=r"training call ran 1 matrix product\(s\) \(1 bmm\) outside the compiled graphs, in high precision"):
        model(x)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="graphquant")
        model(x)
        compiled(disabled=False)(x)


def test_parameters_a_model_multiplies_itself_in_no_graph_are_named():
    """A weight of the model's own module (not nn.Linear) whose product runs outside any graph is
    named once; torch.nn's own modules (an embedding) are not, nor a weight a graph reads."""

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.b = torch.nn.Parameter(torch.randn(64, 64) / 8), torch.nn.Parameter(torch.zeros(64))

        def forward(self, x):
            return x @ self.w.T + self.b

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.skipped, self.compiled, self.embedding = Experts(), Experts(), torch.nn.Embedding(8, 64)

        def forward(self, x):
            return self.compiled(torch.compiler.disable(self.skipped)(x))

    model = quantized(models.seeded(Model()))
    with pytest.warns(UserWarning, match=r"1 parameter\(s\) of 2 or more dims that no compiled graph reads \(skipped\.w\)"):
        model(x2())


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_torch_func_transforms_are_refused_and_leave_the_model_quantized(transform):
    """Under torch.func's grad or vmap Dynamo runs a model's code eagerly, unquantized, and skips
    that code for good: graphquant refuses the call instead, and the model's later calls (and a
    first call after the refusal) run quantized."""
    x = x2()
    expected = quantized(mlp())(x)
    model = quantized(mlp())
    transformed = torch.func.grad(lambda t: model(t).sum()) if transform == "grad" else torch.func.vmap(model)
    with pytest.raises(RuntimeError, match=r"^graphquant: MLP does not run under torch.func transforms"):
        transformed(x if transform == "grad" else x[None])
    assert torch.equal(model(x), expected)


@pytest.mark.parametrize("called_before", [False, True])
@pytest.mark.parametrize("exported", ["the model", "a module holding it", "a graphquant function"])
def test_torch_export_of_a_graphquant_model_is_refused(exported, called_before):
    """torch.export (non-strict, its default) runs a compiled model's code as it is, not through
    graphquant's backend, and gave an unquantized program without a word; ONNX and AOTInductor
    export through it. It is refused at any call, and the model runs quantized after."""
    x = x2()
    expected = quantized(mlp())(x)
    model = quantized(mlp())
    if exported == "a graphquant function":
        model = quantized(mlp().forward)
        expected = quantized(mlp().forward)(x)

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model if isinstance(model, torch.nn.Module) else None

        def forward(self, t):
            return model(t)

    if called_before:
        model(x)
    with pytest.raises(RuntimeError, match=r"^graphquant: torch.export of (MLP|forward) would export its code unquantized"):
        torch.export.export(Holder() if exported != "the model" else model, (x,))
    assert torch.equal(model(x), expected)


@pytest.mark.parametrize("scripted", ["the model", "a module holding it"])
def test_torch_jit_script_of_a_graphquant_model_says_why_it_cannot(scripted):
    """TorchScript compiles a module's own code (unquantized) and failed on the compiled wrapper
    with inspect's message about a module, class or method it expected."""
    model = quantized(mlp())
    with pytest.raises(TypeError, match=r"^graphquant: torch.jit.script cannot take the graphquant model of MLP"):
        torch.jit.script(torch.nn.Sequential(model) if scripted == "a module holding it" else model)


def test_a_method_of_the_model_called_through_it_says_it_ran_unquantized():
    """torch.compile's wrapper hands every attribute but forward to the module, so a two-tower
    model trained through compiled.encode_a(x) ran the module's own code eagerly, unquantized,
    with no graph and no check: the method's first call with grad enabled counts the products its
    outputs' autograd graph holds and says so, once (a call under no_grad first does not end the
    watch); the method stays a bound method of the module, equal at each access."""

    class TwoTower(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = models.MLP(), models.MLP()

        def encode_a(self, x):
            return self.a(x)

        def forward(self, x):
            return self.encode_a(x) + self.b(x)

    module = models.seeded(TwoTower())
    model = quantized(module)
    x = x2()
    assert model.encode_a == model.encode_a and model.encode_a.__self__ is module
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message="graphquant")
        model.encode_a(x)
    with pytest.warns(UserWarning, match=r"^graphquant: encode_a ran 2 matrix product\(s\) \(2 addmm\) in high precision.*"
                                         r"graphquant.compile\(module.encode_a, recipe\)"):
        assert torch.equal(model.encode_a(x), module.encode_a(x))  # unquantized: the module's own code
    assert "encode_a" not in model.__dict__ and model.encode_a == module.encode_a
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="graphquant")
        model.encode_a(x)
        assert not model.graphquant.plans
        assert not torch.equal(model(x), module(x))  # the forward, quantized


def test_a_method_reaching_a_compiled_tower_leaves_it_compiled():
    """The watch reads the autograd graph after the call: a dispatch mode around it made Dynamo
    skip, for good, a tower the method calls that graphquant compiled by itself."""

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tower = quantized(models.seeded(models.MLP()))

        def encode(self, x):
            return self.tower(x)

        def forward(self, x):
            return self.encode(x)

    holder = quantized(Holder())
    x = x2()
    expected = quantized(models.seeded(models.MLP()))(x)
    assert torch.equal(holder.encode(x), expected)
    assert torch.equal(holder._orig_mod.tower(x), expected)


@pytest.mark.parametrize("fp8_dpa", [False, True])
def test_attention_run_eagerly_counts_as_a_product_where_the_recipe_quantizes_attention(fp8_dpa):
    """F.scaled_dot_product_attention under torch.compiler.disable runs as torch's: in high
    precision, which only a recipe with fp8_dpa asked otherwise, so only there is it counted."""

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(64, 192)

        def forward(self, x):
            q, k, v = self.qkv(x).view(2, 16, 3, 2, 32).permute(2, 0, 3, 1, 4)
            return torch.compiler.disable(torch.nn.functional.scaled_dot_product_attention)(q, k, v)

    recipe = graphquant.CustomRecipe(graphquant.factories.current_scaling_factory, fp8_dpa=fp8_dpa)
    model = quantized(models.seeded(Attention()), recipe)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(x2()).sum().backward()
    counted = [str(w.message) for w in caught if "outside the compiled graphs" in str(w.message)]
    assert counted == ([
        "graphquant: this training call ran 1 matrix product(s) (1 scaled_dot_product_attention) outside the compiled graphs, "
        "in high precision: torch.compile ran the code computing them eagerly (under torch.compiler.disable, or past a graph "
        "break it could not take; TORCH_LOGS=graph_breaks says where)"
    ] if fp8_dpa else [])
