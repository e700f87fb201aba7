"""Slots, roles and names: what graphquant.compile asks the factory, and what it calls each GEMM.

Expected names are spelled out by hand from models.py (named_modules() spelling; functional
GEMMs as "<owner>.<linear|matmul>.<i>") and are also checked against the independent eager
reference (tests/reference.py), which finds GEMMs with a TorchFunctionMode and module hooks.
"""

import collections
import copy
import warnings

import models
import pytest
import torch
from reference import (  # noqa: F401  (fresh_dynamo is an autouse fixture)
    GemmTape,
    Reference,
    assert_same_results,
    forward_backward,
    fresh_dynamo,
)

import graphquant
from graphquant import CustomRecipe, Float8DelayedScalingQuantizer, IdentityQuantizer, Plan, factories, recipes, zoo


class CountingFactory:
    """A factory that records every role it is asked about."""

    def __init__(self, inner=factories.mxfp8_factory):
        self.inner = inner
        self.roles = []

    def __call__(self, role):
        self.roles.append(role)
        return self.inner(role)


def x3(batch=2, seq=32, dim=64):
    return torch.randn(batch, seq, dim, generator=torch.Generator().manual_seed(batch))


def train_step(compiled, x):
    compiled(x.clone().requires_grad_()).sum().backward()


def sites_of(plan):
    """(name, call, module_type) of each GEMM site of a plan, in graph order."""
    seen = []
    for g in plan.gemms:
        name, call = g.site.rsplit("#", 1)
        entry = (name, int(call), g.module_type)
        if entry not in seen:
            seen.append(entry)
    return seen


# -- the factory is asked once per slot ------------------------------------------------------------

def test_factory_called_once_per_slot_then_never_again():
    factory = CountingFactory()
    model = models.seeded(models.SharedLinear())
    compiled = graphquant.compile(model, CustomRecipe(factory), backend="aot_eager", fullgraph=True)
    train_step(compiled, x3())
    # fc (called twice, one name) and out: 2 names x (input, weight, grad_output)
    expected = {(t, n) for n in ("fc", "out") for t in ("input", "weight", "grad_output")}
    assert len(factory.roles) == 6
    assert {(r.tensor_type, r.name) for r in factory.roles} == expected
    assert all(r.module_type == "linear" for r in factory.roles)
    assert len(set(factory.roles)) == len(factory.roles)  # never the same slot twice
    assert compiled.graphquant.planner.factory_calls == 6

    train_step(compiled, x3())  # same shapes: no recompile, no factory call
    assert len(compiled.graphquant.plans) == 1
    with torch.no_grad():  # grad mode is guarded: a new (inference) graph, same slots
        compiled(x3())
    train_step(compiled, x3(batch=4))  # new batch size: recompile
    assert len(compiled.graphquant.plans) >= 2
    assert len(factory.roles) == 6


def test_one_module_placed_twice_in_a_module_list_is_one_module_called_twice():
    """ModuleList([block] * 2): named_modules() names the block once (layers.0), so its second place
    is its second call, layers.0#1, as for a module called twice, and shares its slots (a factory
    keeping layers.0 in high precision keeps both calls so; delayed scaling keeps one history). Its
    second call was named layers.1, a name no module has, and asked of the factory on its own."""

    class Repeated(torch.nn.Module):
        def __init__(self):
            super().__init__()
            block = torch.nn.Linear(64, 64)
            self.layers = torch.nn.ModuleList([block, block, torch.nn.Linear(64, 64)])

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x

    factory = CountingFactory()
    compiled = graphquant.compile(models.seeded(Repeated()), CustomRecipe(factory), backend="aot_eager", fullgraph=True)
    train_step(compiled, x3())
    assert {r.name for r in factory.roles} == {"layers.0", "layers.2"} and len(factory.roles) == 6
    assert sites_of(compiled.graphquant.plan) == [("layers.0", 0, "linear"), ("layers.0", 1, "linear"), ("layers.2", 0, "linear")]

    class FirstPlaceTwice(Repeated):  # layers[0] called twice, then layers[1]: three distinct calls
        def forward(self, x):
            return self.layers[1](torch.tanh(self.layers[0](torch.tanh(self.layers[0](x)))))

    plan = graphquant.explain(models.seeded(FirstPlaceTwice()), CustomRecipe(CountingFactory()), x3())
    assert sorted(sites_of(plan)) == [("layers.0", 0, "linear"), ("layers.0", 1, "linear"), ("layers.0", 2, "linear")]


@pytest.mark.parametrize("dynamic", [False, True])
def test_recompile_reuses_the_plan(dynamic):
    """A new batch size (a recompile with dynamic=False; a symbolic batch with dynamic=True) and a
    no_grad call ask the factory nothing new; each batch size computes the reference's numbers."""
    factory = CountingFactory()
    model = models.seeded(models.MLP())
    ref_model = copy.deepcopy(model)
    tape = GemmTape()
    compiled = graphquant.compile(model, CustomRecipe(factory), backend=tape.backend, dynamic=dynamic, fullgraph=True)
    reference = Reference(ref_model, CustomRecipe(CountingFactory()), tape=tape)
    for batch in (2, 4):
        _assert_step_is_the_reference(compiled, model, reference, ref_model, tape, x3(batch=batch), f"batch {batch}: ")
    with torch.no_grad():
        compiled(x3(batch=4))
    # fc1, fc2: 3 roles each
    assert len(factory.roles) == 6 == len(set(factory.roles)) == reference.factory_calls
    assert {role for role, _ in compiled.graphquant.plan.slots} == set(reference.quantizers)


def _assert_step_is_the_reference(compiled, model, reference, ref_model, tape, x, what):
    """One forward and backward of the compiled model computes the reference's numbers, every GEMM on the tape taken."""
    tape.clear()
    actual = forward_backward(compiled, model, x)
    expected = forward_backward(reference, ref_model, x)
    tape.assert_all_taken()
    assert_same_results(actual, expected, what=what)


def test_einsum_products_stay_sites_under_dynamic_shapes():
    """A sequence length that changes makes Dynamo's sizes symbolic (as it does by itself at the
    second length): an einsum's products are sites there too, computing the reference's numbers,
    not products left in high precision as "not a single (batched) matrix product"."""
    model = models.seeded(models.Attention(kind="einsum"))
    ref_model = copy.deepcopy(model)
    tape = GemmTape()
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend=tape.backend, dynamic=True, fullgraph=True)
    reference = Reference(ref_model, recipes.mxfp8_block_scaling(), tape=tape)
    for seq in (32, 64):
        _assert_step_is_the_reference(compiled, model, reference, ref_model, tape, x3(seq=seq), f"seq {seq}: ")
    assert not compiled.graphquant.plan.skipped
    assert {name for name, _, _ in sites_of(compiled.graphquant.plan)} >= {"matmul.0", "matmul.1"}


@pytest.mark.parametrize("equation", ["...qd,...kd->...qk", "...id,...jd", "bh...d,bhkd->bh...k"])
def test_einsums_with_an_ellipsis_or_an_implicit_output_are_the_products_they_spell(equation):
    """torch.einsum's ellipsis and its implicit output (the letters that occur once, in alphabetical
    order) spell the same batched product as ``q @ k.transpose(-2, -1)``: a site computing its bits."""

    class Scores(torch.nn.Module):
        def __init__(self, spelled):
            super().__init__()
            self.spelled = spelled

        def forward(self, q, k):
            return self.spelled(q, k)

    q, k = (torch.randn(2, 2, 32, 64, generator=torch.Generator().manual_seed(seed)) for seed in (1, 2))
    results = []
    for spelled in (lambda q, k: torch.einsum(equation, q, k), lambda q, k: q @ k.transpose(-2, -1)):
        compiled = graphquant.compile(Scores(spelled), recipes.mxfp8_block_scaling(), backend="aot_eager", fullgraph=True)
        leaves = (q.clone().requires_grad_(), k.clone().requires_grad_())
        out = compiled(*leaves)
        out.square().sum().backward()
        assert sites_of(compiled.graphquant.plan) == [("matmul.0", 0, "matmul")] and not compiled.graphquant.plan.skipped
        results.append((out, *(leaf.grad for leaf in leaves)))
    for einsum_result, matmul_result in zip(*results):
        torch.testing.assert_close(einsum_result, matmul_result, rtol=0, atol=0)


def test_the_plan_is_that_of_the_latest_graph_of_the_last_calls_kind():
    """A training call after a no_grad evaluation runs the training graph compiled first: ``plan``
    showed the evaluation's, compiled last, with fprop alone."""
    compiled = graphquant.compile(models.seeded(models.MLP()), recipes.current_scaling(), backend="aot_eager")
    compiled(x3()).sum().backward()
    training = compiled.graphquant.plan
    with torch.no_grad():
        compiled(x3())
    evaluation = compiled.graphquant.plan
    assert evaluation is compiled.graphquant.plans[-1] and {g.gemm for g in evaluation.gemms} == {"fprop"}
    compiled(x3()).sum().backward()
    assert compiled.graphquant.plan is training and {g.gemm for g in training.gemms} == {"fprop", "dgrad", "wgrad"}
    assert len(compiled.graphquant.plans) == 2


def test_the_plan_combines_the_graphs_one_call_compiled():
    """A model whose loss follows a graph break (a transformers model given labels) compiles its
    layers' graph and then the loss's, which holds no GEMM: ``plan`` lists both graphs' sites, not
    the loss graph's none. A later call that recompiles (a new batch size) shows its own graphs."""

    class WithLoss(models.MLP):
        def forward(self, x):
            y = super().forward(x)
            torch._dynamo.graph_break()
            return torch.nn.functional.mse_loss(y, torch.zeros_like(y))

    compiled = graphquant.compile(models.seeded(WithLoss()), recipes.current_scaling(), backend="aot_eager")
    compiled(x3()).backward()
    assert len(compiled.graphquant.plans) == 2 and not compiled.graphquant.plans[-1].gemms
    assert compiled.graphquant.plan == Plan.combine(compiled.graphquant.plans)
    assert {g.site for g in compiled.graphquant.plan.gemms} == {"fc1#0", "fc2#0"}
    assert compiled.graphquant.plan.summary().startswith("graphquant plan on cpu: 2 GEMM sites")
    compiled(x3(batch=5)).backward()
    recompiled = compiled.graphquant.plans[2:]
    assert recompiled and compiled.graphquant.plan == (recompiled[0] if len(recompiled) == 1 else Plan.combine(recompiled))


def test_dynamic_batch_is_one_graph():
    """dynamic=True: several batch sizes run through one captured graph (no recompile)."""
    model = torch.nn.Linear(64, 64)
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend="aot_eager", dynamic=True, fullgraph=True)
    for batch in (2, 4):
        train_step(compiled, x3(batch=batch))
    assert len(compiled.graphquant.plans) == 1, (
        f"{len(compiled.graphquant.plans)} graphs for 2 batch sizes under dynamic=True: something in "
        "graphquant's graph specializes the batch size"
    )


# -- names and roles; one graph, no graph breaks -------------------------------------------------------

MODELS = {
    "decoder_matmul": lambda: models.DecoderBlock(attention="matmul"),
    "decoder_sdpa": lambda: models.DecoderBlock(attention="sdpa"),
    "decoder_einsum": lambda: models.DecoderBlock(attention="einsum"),
    "tiny_lm": lambda: models.TinyLM(attention=("matmul", "sdpa")),
    "mlp_stack": lambda: models.MLPStack(),
    "shared": lambda: models.SharedLinear(),
    "functional": lambda: models.Wrapped(models.FunctionalGemms()),
}


def model_input(name):
    if name == "tiny_lm":
        return torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    return x3()


class CountingBackend:
    """An inner backend that counts the graphs graphquant hands it."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


L, M = "linear", "matmul"
DECODER_SITES = [
    ("attn.q_proj", 0, L), ("attn.k_proj", 0, L), ("attn.v_proj", 0, L),
    ("attn.matmul.0", 0, M), ("attn.matmul.1", 0, M), ("attn.o_proj", 0, L),
    ("mlp.gate_proj", 0, L), ("mlp.up_proj", 0, L), ("mlp.down_proj", 0, L),
]  # fmt: skip


def prefixed(prefix, sites):
    return [(f"{prefix}.{n}", c, t) for n, c, t in sites]


EXPECTED_SITES = {
    "mlp_stack": [
        ("layers.0.mlp.fc1", 0, L), ("layers.0.mlp.fc2", 0, L),
        ("layers.1.mlp.fc1", 0, L), ("layers.1.mlp.fc2", 0, L),
    ],
    "shared": [("fc", 0, L), ("fc", 1, L), ("out", 0, L)],
    "decoder_matmul": DECODER_SITES,
    "decoder_einsum": DECODER_SITES,  # "bhqd,bhkd->bhqk" and "bhqk,bhkd->bhqd" are matmuls
    "decoder_sdpa": [s for s in DECODER_SITES if s[2] == L],  # SDPA is left alone
    "tiny_lm": prefixed("layers.0", DECODER_SITES) + prefixed("layers.1", [s for s in DECODER_SITES if s[2] == L])
    + [("lm_head", 0, L)],  # tied to embed.weight: still the lm_head module's GEMM
    "functional": [
        ("block.linear.0", 0, L),  # F.linear with the module's own Parameter
        ("block.matmul.0", 0, M),  # torch.mm of two activations
        ("block.matmul.1", 0, M),  # addmm
        ("block.matmul.2", 0, M),  # baddbmm
        ("block.matmul.3", 0, M),  # einsum "bsd,bed->bse"
        ("block.matmul.4", 0, M),  # einsum "bse,bed->bsd"
    ],
}  # fmt: skip


@pytest.mark.filterwarnings("ignore:the recipe quantizes no GEMM")
@pytest.mark.parametrize("name", sorted(EXPECTED_SITES))
def test_site_names_roles_and_one_graph(name):
    """fullgraph=True, one graph handed to the inner backend, and the sites, roles and GEMM
    operands the design prescribes. (The names do not depend on the formats: this uses the
    all-Identity recipe, the cheapest to trace; test_compile_numerics compiles these models with
    real formats, also with fullgraph=True.)"""
    model = models.seeded(MODELS[name]())
    x = model_input(name)
    factory = CountingFactory(factories.high_precision_factory)
    counter = CountingBackend()
    compiled = graphquant.compile(model, CustomRecipe(factory), backend=counter, fullgraph=True)
    compiled(x.clone().requires_grad_(x.is_floating_point())).sum().backward()
    assert counter.graphs == 1
    assert len(compiled.graphquant.plans) == 1
    assert all(p.grad is not None for p in model.parameters())
    plan = compiled.graphquant.plan
    assert sites_of(plan) == EXPECTED_SITES[name]

    # every name is a module of named_modules(), or one plus a functional suffix
    module_names = dict(model.named_modules())
    for site_name, _, module_type in EXPECTED_SITES[name]:
        owner = site_name if site_name in module_names else site_name.rsplit(".", 2)[0]
        assert owner in module_names, site_name

    # slots: one per (name, tensor type), with the design's tensor types; each asked for once
    tensor_types = {L: ("input", "weight", "grad_output"), M: ("input", "other", "grad_output")}
    expected_roles = {(t, n, tt) for n, _, t in EXPECTED_SITES[name] for tt in tensor_types[t]}
    assert {(r.module_type, r.name, r.tensor_type) for r, _ in plan.slots} == expected_roles
    assert sorted(map(str, factory.roles)) == sorted(map(str, {r for r, _ in plan.slots}))

    # each site has fprop, dgrad and wgrad with the design's operands
    for site_name, call, _ in EXPECTED_SITES[name]:
        rows = [(g.gemm, g.a, g.b) for g in plan.gemms if g.site == f"{site_name}#{call}"]
        w = "weight" if (site_name, call, L) in EXPECTED_SITES[name] else "other"
        assert rows == [
            ("fprop", "input.rowwise", f"{w}.rowwise"),
            ("dgrad", "grad_output.rowwise", f"{w}.columnwise"),
            ("wgrad", "grad_output.columnwise", "input.columnwise"),
        ], rows

    # the independent eager reference finds the same sites in the same order
    reference = Reference(copy.deepcopy(model), CustomRecipe(factories.mxfp8_factory))
    reference(x)
    assert reference.sites == EXPECTED_SITES[name]


def test_matmul_with_a_parameter_or_its_transpose_is_a_linear():
    """mm / matmul whose right operand is a 2-D Parameter is a linear (weight = its transpose), and
    so is one whose right operand is a 2-D Parameter transposed (x @ W.T is F.linear(x, W)), or
    transposed twice (a tied decoder's transpose of an encoder's W.t(): x @ W, which was a matmul of
    roles input and other); a product of an activation stays a matmul. Each computes what eager
    torch does."""

    class ParamMatmul(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Parameter(torch.randn(64, 32) / 8)

        def forward(self, x):
            h = torch.relu(x @ self.proj)
            encoder = self.proj.t()
            return (
                h @ self.proj.t() + torch.mm(h.flatten(0, 1), self.proj.T).view_as(x) + h @ self.proj.transpose(-1, -2)
                + torch.relu(x @ encoder.t()) @ encoder
            ) @ x.mT

    model = models.Wrapped(ParamMatmul())
    identity = CustomRecipe(lambda role: IdentityQuantizer())
    x = x3()
    with pytest.warns(UserWarning, match="quantizes no GEMM"):
        assert torch.equal(graphquant.compile(model, identity, backend="aot_eager", fullgraph=True)(x), model(x))
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend="aot_eager", fullgraph=True)
    compiled(x).sum().backward()
    linears = [(f"block.linear.{i}", 0, L) for i in range(6)]
    assert sites_of(compiled.graphquant.plan) == [*linears, ("block.matmul.0", 0, M)]


def test_an_einsum_with_a_parameter_second_and_no_batch_letter_is_a_linear():
    """einsum("bsd,fd->bsf", x, W) is F.linear(x, W), and einsum("bsd,dhe->bshe", x, W) a linear of
    (h e, d) weight rows: both linears (input, weight, grad_output), as design.md's roles make a
    product with a parameter operand, where they were matmuls (input, other); per-expert weights
    (a batch letter) and a parameter first stay matmuls. Each computes the reference's numbers."""

    class Einsums(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.out = torch.nn.Parameter(torch.randn(64, 64) / 8)  # (f, d)
            self.heads = torch.nn.Parameter(torch.randn(64, 2, 32) / 8)  # (d, h, e)
            self.experts = torch.nn.Parameter(torch.randn(2, 64, 64) / 8)  # (x, d, f): one a batch row

        def forward(self, x):  # (b, s, d)
            h = torch.einsum("bsd,fd->bsf", x, self.out) + torch.einsum("bsd,dhe->bshe", x, self.heads).flatten(2)
            return torch.einsum("xsd,xdf->xsf", h, self.experts) + torch.einsum("fd,bsd->bsf", self.out, h)

    model = models.seeded(Einsums())
    ref_model = copy.deepcopy(model)
    tape = GemmTape()
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend=tape.backend, fullgraph=True)
    reference = Reference(ref_model, recipes.mxfp8_block_scaling(), tape=tape)
    _assert_step_is_the_reference(compiled, model, reference, ref_model, tape, x3(), "")
    L, M = "linear", "matmul"
    assert sites_of(compiled.graphquant.plan) == [("linear.0", 0, L), ("linear.1", 0, L), ("matmul.0", 0, M), ("matmul.1", 0, M)]


def test_addmm_of_a_bias_and_a_transposed_parameter_is_a_linear_with_its_bias():
    """torch.addmm(b, x, W.T) (and Tensor.addmm) is F.linear(x, W, b): a linear site, whose
    weight takes the weight role's format (NVFP4's 16x16 tiles), where it was a matmul whose
    right operand took the other role's; an addmm of a 2-D c stays an addmm. Each computes
    what eager torch does, within the product's rounding."""

    class Addmm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.b = torch.nn.Parameter(torch.randn(64, 64) / 8), torch.nn.Parameter(torch.randn(64))

        def forward(self, x, c):
            h = torch.addmm(self.b, x, self.w.T)
            return self.b.addmm(h, self.w.t()) + torch.addmm(c, h, self.w.T)

    model = models.seeded(Addmm())
    x, c = torch.randn(32, 64), torch.randn(32, 64)
    identity = CustomRecipe(lambda role: IdentityQuantizer())
    with pytest.warns(UserWarning, match="quantizes no GEMM"):
        torch.testing.assert_close(graphquant.compile(model, identity, backend="aot_eager", fullgraph=True)(x, c), model(x, c))
    compiled = graphquant.compile(model, recipes.nvfp4_block_scaling(), backend="aot_eager", fullgraph=True)
    compiled(x, c).sum().backward()
    assert sites_of(compiled.graphquant.plan) == [("linear.0", 0, L), ("linear.1", 0, L), ("matmul.0", 0, M)]
    weights = {g.b_format for g in compiled.graphquant.plan.gemms if g.gemm == "fprop" and g.site.startswith("linear")}
    assert weights == {"nvfp4(with_2d_quantization=True)"}


def test_folding_a_transposed_weight_keeps_the_graphs_in_place_updates():
    """BatchNorm's num_batches_tracked.add_(1) has no users, as any in-place update: folding
    x @ W.T into a linear must not take it with the transpose it drops."""

    class Normed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.bn = torch.nn.Parameter(torch.randn(32, 32) / 8), torch.nn.BatchNorm1d(32)

        def forward(self, x):
            return self.bn(x @ self.w.T)

    model = Normed()
    compiled = graphquant.compile(model, recipes.current_scaling(), backend="aot_eager", fullgraph=True)
    for _ in range(3):
        compiled(torch.randn(16, 32))
    assert model.bn.num_batches_tracked.item() == 3


def test_a_transposed_parameter_in_a_checkpointed_block_is_a_linear_too():
    """Dynamo hoists ``W.T`` out of a checkpoint's body and hands it in as an input: the product
    is a linear site there too, as without the checkpoint, computing what eager torch does."""

    class Checkpointed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(64, 64) / 8)

        def block(self, x):
            return torch.nn.functional.gelu(x) @ self.w.T

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)

    model, x = Checkpointed(), torch.randn(4, 8, 64, requires_grad=True)
    plan = graphquant.explain(model, recipes.mxfp8_block_scaling(), x)
    assert {(g.site, g.module_type) for g in plan.gemms} == {("linear.0#0", "linear")}
    with pytest.warns(UserWarning, match="quantizes no GEMM"):
        held = graphquant.compile(model, CustomRecipe(lambda role: IdentityQuantizer()), backend="aot_eager")(x)
    held.sum().backward()
    grad, model.w.grad = model.w.grad, None
    expected = model(x)
    expected.sum().backward()
    assert torch.equal(held, expected) and torch.equal(grad, model.w.grad)


@pytest.mark.parametrize("spelling", ["positional", "keywords", "method keywords"])
def test_addmm_and_baddbmm_take_their_operands_however_they_are_passed(spelling):
    """BLOOM's attention calls alibi.baddbmm(batch1=q, batch2=k, beta=..., alpha=...)."""

    class Products(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.b = torch.nn.Parameter(torch.randn(64, 32) / 8), torch.nn.Parameter(torch.randn(32))

        def forward(self, x, bias, q, k):
            if spelling == "positional":
                return torch.addmm(self.b, x, self.w, beta=0.5, alpha=2.0), torch.baddbmm(bias, q, k, alpha=0.125)
            if spelling == "keywords":
                return torch.addmm(self.b, mat1=x, mat2=self.w, beta=0.5, alpha=2.0), torch.baddbmm(bias, batch1=q, batch2=k, alpha=0.125)
            return self.b.addmm(mat1=x, mat2=self.w, beta=0.5, alpha=2.0), bias.baddbmm(batch1=q, batch2=k, alpha=0.125)

    model, inputs = Products(), (torch.randn(32, 64), torch.randn(4, 32, 32), torch.randn(4, 32, 16), torch.randn(4, 16, 32))
    with pytest.warns(UserWarning, match="quantizes no GEMM"):
        held = graphquant.compile(model, CustomRecipe(lambda role: IdentityQuantizer()), backend="aot_eager", fullgraph=True)(*inputs)
    assert all(torch.equal(a, b) for a, b in zip(held, model(*inputs)))
    assert [g.site for g in graphquant.explain(model, recipes.current_scaling(), *inputs).gemms if g.gemm == "fprop"] == ["linear.0#0", "matmul.0#0"]


def test_multihead_attention_is_listed_as_not_quantized():
    """Dynamo keeps nn.MultiheadAttention's F.multi_head_attention_forward as one call: its
    projections and attention run in high precision, which the plan says (and no warning calls
    its out_proj a linear in no graph)."""
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = graphquant.explain(layer, recipes.current_scaling(), torch.randn(2, 16, 64))
    assert {g.site for g in plan.gemms} == {"linear1#0", "linear2#0"}
    [(what, why)] = plan.skipped
    assert what.startswith("self_attn: ") and why.startswith("nn.MultiheadAttention: Dynamo keeps F.multi_head_attention_forward as one call")


def test_the_transformer_encoder_layers_fast_path_is_listed_as_not_quantized():
    """An nn.TransformerEncoder evaluated without gradients takes PyTorch's fast path, one
    torch._transformer_encoder_layer_fwd call a layer: its products ran in high precision while
    the plan listed nothing, and the warning said the model's code read the linears' weights
    itself. The plan lists each layer's call with the switch that turns it off, and nothing warns."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), torch.nn.Linear(64, 64)).eval()
    compiled = graphquant.compile(model, recipes.current_scaling(), backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            compiled(torch.randn(2, 16, 64))
    plan = compiled.graphquant.plan
    assert {g.site for g in plan.gemms} == {"1#0"}
    assert [what.split(":")[0] for what, _ in plan.skipped] == ["0.layers.0", "0.layers.1"]
    assert all("torch.backends.mha.set_fastpath_enabled(False)" in why for _, why in plan.skipped)


def test_attention_of_a_recipe_without_fp8_dpa_is_listed_as_not_quantized():
    """F.scaled_dot_product_attention (transformers' default attention) runs as torch's unless the
    recipe asks for FP8 attention: the plan said nothing of it, where an eager attention's
    matmuls are sites."""

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(64, 192)

        def forward(self, x):
            q, k, v = self.qkv(x).view(2, 32, 3, 2, 32).permute(2, 0, 3, 1, 4)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    plan = graphquant.explain(Attention(), recipes.current_scaling(), x3())
    [(what, why)] = plan.skipped
    assert what.startswith("the model: ") and "scaled_dot_product_attention(" in what
    assert why == "attention in high precision: the recipe has fp8_dpa=False (CustomRecipe(..., fp8_dpa=True) quantizes it)"


@torch.compiler.allow_in_graph
def _scores_in_one_call(q, k):
    return torch.einsum("bhid,bhjd->bhij", q, k)


@torch.compiler.allow_in_graph
def _heads_in_one_call(t):
    return t.view(2, 16, 4, 16).transpose(1, 2)


@pytest.mark.parametrize("dynamic", [False, True])
def test_products_inside_a_call_dynamo_keeps_whole_are_listed_and_warned_of(dynamic):
    """A function given to torch.compiler.allow_in_graph (as einops gives its einsum) is one node
    whose code the passes never see: its products ran in high precision without a word. The plan
    lists it with what it multiplies and the first call warns; one that multiplies nothing (a
    reshape) is neither listed nor warned of."""

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

        def forward(self, x):
            return _scores_in_one_call(_heads_in_one_call(self.q(x)), _heads_in_one_call(self.k(x)))

    compiled = graphquant.compile(models.seeded(Attention()), recipes.current_scaling(), backend="aot_eager", dynamic=dynamic)
    with pytest.warns(UserWarning, match=r"_scores_in_one_call is one call in the graph \(torch.compiler.allow_in_graph\)") as warned:
        compiled(torch.randn(2, 16, 64))
    assert len([w for w in warned if "is one call in the graph" in str(w.message)]) == 1
    assert {g.site for g in compiled.graphquant.plan.gemms} == {"q#0", "k#0"}
    [(what, why)] = compiled.graphquant.plan.skipped
    assert what.startswith("the model: ") and "_scores_in_one_call(" in what
    assert "its 1 matrix product(s) (1 bmm) run in high precision" in why


class _ProductOfItsOwn(torch.autograd.Function):
    """x @ w^T with the backward a model writes itself."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w, grad.transpose(-1, -2) @ x


def test_a_trace_dynamo_restarts_leaves_no_plan():
    """Under dynamic shapes an embedding's Python scalars made tensors have Dynamo abandon its
    first trace, which graphquant had already planned: every GEMM was listed twice."""

    class Embedded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.fc = torch.nn.Embedding(128, 64), torch.nn.Linear(64, 64)

        def forward(self, ids):
            return self.fc(self.emb(ids))

    compiled = graphquant.compile(models.seeded(Embedded()), recipes.current_scaling(), backend="aot_eager", dynamic=True)
    compiled(torch.randint(0, 128, (2, 64))).sum().backward()
    assert len(compiled.graphquant.plans) == 1
    assert [(g.site, g.gemm) for g in compiled.graphquant.plan.gemms] == [("fc#0", "fprop"), ("fc#0", "dgrad"), ("fc#0", "wgrad")]


class _FunctionThenLinear(torch.nn.Module):
    """x @ w^T through a custom Function, then a linear."""

    def __init__(self, function: type):
        super().__init__()
        self.function = function
        self.w, self.fc = torch.nn.Parameter(torch.randn(64, 64) / 8), torch.nn.Linear(64, 64)

    def forward(self, x):
        return self.fc(self.function.apply(x, self.w).relu())


def test_products_inside_a_custom_autograd_function_in_training_are_listed_and_warned_of():
    """A training graph holds a custom torch.autograd.Function as one call whose bodies (its
    forward and the model's backward) graphquant does not rewrite: its product ran in high
    precision without a word, where the same model evaluated without gradients quantizes it
    (Dynamo then traces the forward as plain code). The training plan lists it, and the first
    call warns."""

    compiled = graphquant.compile(models.seeded(_FunctionThenLinear(_ProductOfItsOwn)), recipes.current_scaling(), backend="aot_eager")
    with pytest.warns(UserWarning, match=r"a custom torch.autograd.Function is one call in a training graph"):
        compiled(torch.randn(2, 16, 64)).sum().backward()
    assert {g.site for g in compiled.graphquant.plan.gemms} == {"fc#0"}
    [(what, why)] = compiled.graphquant.plan.skipped
    assert "autograd_function_apply" in what and "its forward's 1 matrix product(s) (1 matmul) run in high precision" in why
    with torch.no_grad():
        compiled(torch.randn(2, 16, 64))
    assert {g.site for g in compiled.graphquant.plan.gemms} == {"fc#0", "linear.0#0"} and not compiled.graphquant.plan.skipped  # x @ w.t(): a linear


@torch.compiler.allow_in_graph
class _ProductAllowedInGraph(_ProductOfItsOwn):
    """The same Function given to torch.compiler.allow_in_graph: one call in every graph."""


@pytest.mark.parametrize("grad", [True, False])
def test_products_inside_a_custom_autograd_function_allowed_in_graph_are_listed_and_warned_of(grad):
    """Dynamo calls a Function given to allow_in_graph through a function of its own, with or
    without gradients, which graphquant neither listed nor warned of: its product ran in high
    precision without a word. It is run on fake values as an allowed function is."""

    compiled = graphquant.compile(models.seeded(_FunctionThenLinear(_ProductAllowedInGraph)), recipes.current_scaling(), backend="aot_eager")
    with torch.set_grad_enabled(grad), pytest.warns(UserWarning, match=r"_ProductAllowedInGraph.apply is one call in the graph"):
        compiled(torch.randn(2, 16, 64))
    assert {g.site for g in compiled.graphquant.plan.gemms} == {"fc#0"}
    [(_, why)] = compiled.graphquant.plan.skipped
    assert "its 1 matrix product(s) (1 mm) run in high precision" in why


@torch.library.custom_op("graphquant_test::scores", mutates_args=())
def _scores_in_a_custom_op(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return q @ k.transpose(-1, -2)


@_scores_in_a_custom_op.register_fake
def _(q, k):
    return q.new_empty(*q.shape[:-1], k.shape[-2])


@torch.library.custom_op("graphquant_test::scale", mutates_args=())
def _scale_in_a_custom_op(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


@_scale_in_a_custom_op.register_fake
def _(x, factor):
    return torch.empty_like(x)


def test_custom_ops_of_other_libraries_that_take_matrices_are_listed_as_not_seen():
    """A custom op another library registers (transformers' grouped_mm_fallback runs Mixtral's
    float32 experts) is one node whose code graphquant cannot run to tell what it multiplies (its
    fake implementation computes nothing): one that takes a matrix is listed as not seen into,
    without a warning; one that takes none (a scale) is not listed."""

    class Scores(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(64, 64)

        def forward(self, x, factor):
            q = self.q(x)
            return _scores_in_a_custom_op(q, q) + _scale_in_a_custom_op(factor, 2.0).sum()

    compiled = graphquant.compile(models.seeded(Scores()), recipes.current_scaling(), backend="aot_eager", fullgraph=True)
    with warnings.catch_warnings(), torch.no_grad():  # the ops have no autograd formula
        warnings.simplefilter("error")
        compiled(x3(), torch.ones(3))
    [(what, why)] = compiled.graphquant.plan.skipped
    assert what.startswith("the model: ") and "scores" in what
    assert why == "graphquant_test::scores is a custom op whose code graphquant does not see: any product inside it runs in high precision"


class _TwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _unplanned_linear_warnings(messages):
    return [m for m in messages if "nn.Linear modules" in m]


@pytest.mark.parametrize("config", ["Int8WeightOnlyConfig", "Float8WeightOnlyConfig"])
def test_a_linear_of_a_torchao_quantized_weight_is_left_to_torchao_and_listed_saying_so(config):
    """A weight torchao.quantization.quantize_ made a tensor subclass failed deep inside torchao
    (BackendCompilerFailed: the subclass cannot be quantized again). Its linear is no site now:
    it runs torchao's own product, listed with the subclass's type, and no warning says the
    model reads the module's weight itself."""
    quantization = pytest.importorskip("torchao.quantization")
    model = models.seeded(_TwoLinears())
    quantization.quantize_(model, getattr(quantization, config)(), filter_fn=lambda module, name: name == "fc1")
    x = x3(seq=16)
    with torch.no_grad():
        expected = model(x)
        high_precision = CustomRecipe(lambda role: IdentityQuantizer())  # fc2 as the model runs it: y is torchao's alone
        compiled = graphquant.compile(model, high_precision, backend="aot_eager", mode="inference")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = compiled(x)
    assert _unplanned_linear_warnings([str(w.message) for w in caught]) == []
    assert {g.site for g in compiled.graphquant.plan.gemms} == {"fc2#0"}
    [(what, why)] = compiled.graphquant.plan.skipped
    kind = type(model.fc1.weight)
    assert what.startswith("fc1: ") and f"torchao tensor subclass ({kind.__module__}.{kind.__name__})" in why
    torch.testing.assert_close(y, expected)


def test_a_torchao_float8_linear_is_listed_and_warned_of_as_running_torchaos_own_fp8():
    """torchao's Float8Linear (convert_to_float8_training) calls its own autograd Function, which
    Dynamo keeps whole: it bypassed the recipe with nothing in the plan, and the one warning said
    the model read fc1's weight itself. The plan lists it now, and a warning names it."""
    float8 = pytest.importorskip("torchao.float8")
    model = models.seeded(_TwoLinears())
    float8.convert_to_float8_training(model, module_filter_fn=lambda module, name: name == "fc1")
    compiled = graphquant.compile(model, recipes.current_scaling(), backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(x3(seq=16)).sum().backward()
    messages = [str(w.message) for w in caught]
    assert _unplanned_linear_warnings(messages) == []
    assert any("Float8Linear runs torchao's own low-precision linear" in m and "the first fc1: " in m for m in messages), messages
    assert {g.site for g in compiled.graphquant.plan.gemms} == {"fc2#0"}
    [(what, why)] = compiled.graphquant.plan.skipped
    assert what.startswith("fc1: ") and why.startswith("torchao.float8.float8_linear.Float8Linear runs torchao's own")
    assert model.fc1.weight.grad is not None


@pytest.mark.parametrize("conv", ["Conv1d", "Conv2d", "ConvTranspose2d"])
def test_convolutions_are_listed_as_left_in_high_precision(conv):
    """A ViT's patch embedding or Whisper's audio stem ran in high precision with nothing in the
    plan (convolutions are no sites): each is listed now, saying so."""
    layer, x = {"Conv1d": (torch.nn.Conv1d(8, 64, 3), torch.randn(2, 8, 32)), "Conv2d": (torch.nn.Conv2d(3, 64, 4, stride=4), torch.randn(2, 3, 16, 16)),
                "ConvTranspose2d": (torch.nn.ConvTranspose2d(3, 64, 2), torch.randn(2, 3, 8, 8))}[conv]

    class Stem(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.fc = layer, torch.nn.Linear(64, 64)

        def forward(self, x):
            return self.fc(self.stem(x).flatten(2).transpose(1, 2))

    plan = graphquant.explain(Stem(), recipes.current_scaling(), x)
    assert {g.site for g in plan.gemms} == {"fc#0"}
    [(what, why)] = plan.skipped
    assert "stem" in what and why.startswith("a convolution (nn.Conv1d") and "runs in high precision" in why, (what, why)
    assert "(l_x_, stem.weight, stem.bias" in what, f"the call's parameters as named_parameters() spells them: {what}"


_OTHER_SPELLINGS = {
    "torch.tensordot": lambda h, w: torch.tensordot(h, w, dims=([2], [1])),
    "torch.inner": lambda h, w: torch.inner(h, w),
    "torch.linalg.multi_dot": lambda h, w: torch.linalg.multi_dot([h.reshape(-1, 64), w.t()]),
    "Tensor.inner": lambda h, w: h.inner(w),
    "torch.ops.aten.mm": lambda h, w: torch.ops.aten.mm(h.reshape(-1, 64), w.t()),
}


@pytest.mark.parametrize("spelling", sorted(_OTHER_SPELLINGS))
def test_products_of_functions_with_no_site_are_listed_with_what_to_write(spelling):
    """Products written with torch functions graphquant makes no site of ran in high precision
    with nothing in the plan: each is listed now, saying how to spell it to be quantized."""

    class Product(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.w = torch.nn.Linear(64, 64), torch.nn.Parameter(torch.randn(64, 64))

        def forward(self, x):
            return _OTHER_SPELLINGS[spelling](self.fc(x), self.w)

    plan = graphquant.explain(Product(), recipes.current_scaling(), x3())
    assert {g.site for g in plan.gemms} == {"fc#0"}
    [(what, why)] = plan.skipped
    assert why.startswith(f"{spelling} ") and "runs in high precision: spell it as F.linear, torch.matmul / @" in why, why

    class Checkpointed(torch.nn.Module):  # inside a checkpointed block too, whose body the plan lists from
        def __init__(self):
            super().__init__()
            self.block = Product()

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)

    plan = graphquant.explain(Checkpointed(), recipes.current_scaling(), x3())
    [(what, why)] = plan.skipped
    assert what.startswith("block: ") and why.startswith(f"{spelling} "), (what, why)


def test_a_matmul_of_broadcast_batch_dims_is_listed_with_the_einsum_that_quantizes_it():
    """Per-head weights (heads, dim, out) against (batch, heads, seq, dim) activations: torch.matmul
    broadcasts the batch dims, which is no site; the plan said only "batch dims (2, 4) and (4,)
    broadcast". It says what to write, and that einsum is a site."""

    class PerHead(torch.nn.Module):
        def __init__(self, spelled):
            super().__init__()
            self.w, self.spelled = torch.nn.Parameter(torch.randn(4, 64, 128)), spelled

        def forward(self, x):
            return self.spelled(x, self.w)

    x = torch.randn(2, 4, 32, 64)
    plan = graphquant.explain(PerHead(torch.matmul), recipes.mxfp8_block_scaling(), x)
    [(what, why)] = plan.skipped
    assert why == (
        "batch dims (2, 4) and (4,) broadcast: expand the operands to one batch shape, or spell the product as a "
        "two-operand torch.einsum ('abmk,bkn->abmn'), which graphquant quantizes"
    ), why
    plan = graphquant.explain(PerHead(lambda x, w: torch.einsum("bhsd,hde->bhse", x, w)), recipes.mxfp8_block_scaling(), x)
    assert sites_of(plan) == [("matmul.0", 0, "matmul")] and not plan.skipped


def test_linalg_matmul_is_a_site_as_matmul_is():
    """torch.linalg.matmul is torch.matmul: a linear site with a transposed parameter, a matmul of
    activations otherwise (it ran in high precision, unlisted)."""

    class Products(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(64, 64))

        def forward(self, x):
            h = torch.linalg.matmul(x, self.w.t())
            return torch.linalg.matmul(h, h.transpose(1, 2))

    plan = graphquant.explain(Products(), recipes.current_scaling(), x3())
    assert sorted((g.site, g.module_type) for g in plan.gemms if g.gemm == "fprop") == [("linear.0#0", "linear"), ("matmul.0#0", "matmul")]
    assert not plan.skipped


def test_flex_attention_is_listed_and_under_fp8_dpa_warned_of():
    """flex_attention (transformers' attn_implementation="flex_attention") is no dpa site: it was in
    no list, and a recipe asking for FP8 attention said nothing of running it in high precision."""
    from torch.nn.attention.flex_attention import flex_attention

    class Flex(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(64, 192)

        def forward(self, x):
            q, k, v = self.qkv(x).view(2, 32, 3, 2, 32).permute(2, 0, 3, 1, 4)
            return flex_attention(q, k, v)

    def plan_of(recipe):
        compiled = graphquant.compile(Flex(), recipe, backend="aot_eager", mode="inference")
        with torch.no_grad():  # flex_attention has no backward on the CPU
            compiled(x3())
        [(_, why)] = compiled.graphquant.plan.skipped
        return why

    assert plan_of(recipes.current_scaling()).startswith("attention in high precision: the recipe has fp8_dpa=False")
    with pytest.warns(UserWarning, match=r"asks for FP8 attention \(fp8_dpa\), but the model calls flex_attention"):
        assert plan_of(zoo.with_fp8_attention(recipes.current_scaling())).startswith("flex_attention runs in high precision")


def test_products_inside_torch_vmap_run_in_high_precision_and_are_listed():
    """A product inside torch.vmap (an ensemble's linear over a stack of weights) failed at the first
    call with functorch's message about autograd.Function (graphquant's products do not run under
    vmap): it runs in high precision now, listed so, and the model trains."""

    class Ensemble(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.members = torch.nn.Linear(64, 64), torch.nn.Parameter(torch.randn(3, 64, 64) / 8)

        def forward(self, x):
            h = self.fc(x)
            return torch.vmap(lambda w: torch.nn.functional.linear(h, w))(self.members)

    model = models.seeded(Ensemble())
    compiled = graphquant.compile(model, recipes.current_scaling(), backend="aot_eager")
    x = x3()
    y = compiled(x)
    y.sum().backward()
    assert sites_of(compiled.graphquant.plan) == [("fc", 0, L)]
    [(what, why)] = compiled.graphquant.plan.skipped
    assert "linear(" in what and why.startswith("inside torch.func's vmap")
    assert model.members.grad is not None and y.shape == (3, 2, 32, 64)


def test_every_op_namespace_torch_registers_is_known_as_torchs_own():
    """torch's own ops (Dynamo's streams ops for user CUDA streams, FSDP2's) are no other library's
    custom ops to list: every namespace a bare torch registers is known as its own."""
    import subprocess
    import sys

    from graphquant.passes import opaque_calls

    code = ("import torch, torch.distributed, torch._dynamo; "
            "print(' '.join(sorted({n.split('::')[0] for n in torch._C._dispatch_get_all_op_names()})))")
    torchs = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split())
    assert torchs - {"_test", "_inductor_test"} <= opaque_calls._KNOWN_NAMESPACES


def test_not_quantized_products_are_listed():
    """A matrix-vector product is not a GEMM site; the plan lists it as not quantized."""

    class MatVec(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(64, 64)
            self.v = torch.nn.Parameter(torch.randn(64))

        def forward(self, x):
            return torch.matmul(self.fc(x), self.v)

    compiled = graphquant.compile(MatVec(), recipes.mxfp8_block_scaling(), backend="aot_eager", fullgraph=True)
    x = x3()
    y = compiled(x)
    assert sites_of(compiled.graphquant.plan) == [("fc", 0, L)]
    [(what, why)] = compiled.graphquant.plan.skipped
    assert what.startswith("the model: ") and "= matmul(" in what and "1-D" in why
    assert y.shape == (2, 32)


# -- a graph break inside a module ------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["current_scaling", "delayed_scaling"])
@pytest.mark.parametrize("mode", [None, "inference"])
def test_a_graph_of_no_inputs_before_a_graph_break_compiles(mode, recipe):
    """A piece of a forward that builds a tensor from constants alone, then breaks (Llama 4's first
    call does), is a graph with no placeholder: the rewrite's search for the last one failed with
    an IndexError. Under delayed scaling a product of constants there takes its state as the
    graph's first input."""

    class Masked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(64, 64)

        def forward(self, x):
            table = torch.ones(32, 64).cumsum(0) @ torch.ones(64, 32).cumsum(1)
            torch._dynamo.graph_break()
            return self.fc(x) + table.sum()

    x = x3()
    with torch.no_grad():
        y = graphquant.compile(models.seeded(Masked()), getattr(recipes, recipe)(), backend="aot_eager", mode=mode)(x)
        fc = graphquant.compile(models.seeded(Masked()).fc, getattr(recipes, recipe)(), backend="aot_eager", mode=mode)
        table = graphquant.compile(lambda: torch.ones(32, 64).cumsum(0) @ torch.ones(64, 32).cumsum(1), getattr(recipes, recipe)(), backend="aot_eager", mode=mode)()
    assert torch.equal(y, fc(x) + table.sum())


class BreakingBlock(torch.nn.Module):
    """fc1, then (if asked) a graph break, then fc2. With the break, Dynamo compiles this code
    on its own, and without a guard on the block it runs that graph for every BreakingBlock."""

    def __init__(self, graph_break: bool, dim: int = 64):
        super().__init__()
        self.graph_break = graph_break
        self.fc1, self.fc2 = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        if self.graph_break:
            torch._dynamo.graph_break()
        return self.fc2(h)


class BreakingStack(torch.nn.Module):
    def __init__(self, graph_break: bool):
        super().__init__()
        self.layers = torch.nn.ModuleList([BreakingBlock(graph_break), BreakingBlock(graph_break)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def fp8_block0_high_precision_block1(role):
    if role.name.startswith("layers.1."):
        return IdentityQuantizer()
    return factories.current_scaling_factory(role)


@pytest.mark.filterwarnings("ignore:the recipe quantizes no GEMM")  # block 1's graphs, all high precision
def test_a_graph_break_inside_a_block_keeps_names_and_formats_per_block():
    """Block 1 must not run block 0's graph: each block's GEMMs keep their own names and the
    formats the factory gave them, so the results are those of the same model without the break."""
    recipe = CustomRecipe(fp8_block0_high_precision_block1)
    x = x3()
    plans, results = {}, {}
    for graph_break in (False, True):
        model = models.seeded(BreakingStack(graph_break))
        compiled = graphquant.compile(model, recipe, backend="aot_eager")
        results[graph_break] = forward_backward(compiled, model, x)
        plans[graph_break] = Plan.combine(compiled.graphquant.plans)
    formats = {broken: {(g.site, g.gemm): (g.a_format, g.b_format) for g in plan.gemms} for broken, plan in plans.items()}
    sites = ["layers.0.fc1#0", "layers.0.fc2#0", "layers.1.fc1#0", "layers.1.fc2#0"]
    assert sorted({site for site, _ in formats[True]}) == sites
    assert formats[True] == formats[False]
    fp8, high = factories.current_scaling_factory(None).spec, IdentityQuantizer().spec
    assert formats[True][("layers.0.fc2#0", "fprop")] == (fp8, fp8)
    assert formats[True][("layers.1.fc2#0", "fprop")] == (high, high)
    assert_same_results(results[True], results[False], slack=0)


class CalledAcrossABreak(torch.nn.Module):
    """``a`` called before and after a graph break; ``b`` reads ``y``, which only the graph after
    the break takes, so a new shape of ``y`` recompiles that graph alone."""

    def __init__(self, dim: int = 64):
        super().__init__()
        self.a, self.b = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)

    def forward(self, x, y):
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.a(h).sum() + self.b(y).sum()


def test_a_module_called_on_both_sides_of_a_graph_break_is_numbered_across_the_graphs():
    """Each graph counted a module's calls from #0, so both calls of ``a`` were a#0: two rows of
    each of its GEMMs in the plan, and one row of both in graphquant.numerics. A recompile of the
    graph after the break, whose earlier graph runs from Dynamo's cache, keeps its numbers."""
    model, recipe = models.seeded(CalledAcrossABreak()), recipes.mxfp8_block_scaling()
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    compiled = graphquant.compile(model, recipe, backend="aot_eager")
    compiled(x, y).backward()
    plan = compiled.graphquant.plan
    rows = [(g.site, g.gemm) for g in plan.gemms]
    assert sorted({site for site, _ in rows}) == ["a#0", "a#1", "b#0"]
    assert len(rows) == len(set(rows)) == 2 + 3 + 2  # x and y take no gradient: no dgrad of a#0 or b#0
    report = graphquant.numerics(models.seeded(CalledAcrossABreak()), recipe, x, y)
    assert sorted((g.site, g.gemm) for g in report.gemms) == sorted(rows)

    compiled(x, torch.randn(64, 64)).backward()
    assert len(compiled.graphquant.plans) == 3  # the graph after the break, recompiled alone
    assert sorted({g.site for g in compiled.graphquant.plan.gemms}) == ["a#1", "b#0"]


class ScoresAfterABreak(torch.nn.Module):
    """Attention scores past a graph break (a logger call), reaching no module of the block's own
    after it: Dynamo resumes that code as one graph for every block, guarded on none."""

    def __init__(self, dim: int = 64):
        super().__init__()
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        torch._dynamo.graph_break()
        return (q @ k.transpose(-1, -2)).softmax(-1) @ v


class ScoresBeforeABreak(torch.nn.Module):
    """Scores then a graph break in a module of no parameters: Dynamo compiles its forward as a
    frame of its own, guarded on no module."""

    def forward(self, x):
        scores = x @ x.transpose(-1, -2)
        torch._dynamo.graph_break()
        return scores.softmax(-1) @ x


class ScoresStack(torch.nn.Module):
    def __init__(self, root_break: bool = False, layers: int = 2, kind: type = ScoresAfterABreak):
        super().__init__()
        self.root_break = root_break
        self.layers = torch.nn.ModuleList([kind() for _ in range(layers)])

    def forward(self, x):
        if self.root_break:  # the model's own code resumed, a helper method's too: the model's alone
            x = torch.relu(self.layers[0].qkv(x)[..., :64])
            torch._dynamo.graph_break()
            return x @ x.transpose(-1, -2) + self.helper(x)
        for layer in self.layers:
            x = x + layer(x)
        return x

    def helper(self, x):
        torch._dynamo.graph_break()
        return x @ x.transpose(-1, -2)


def delayed_products(role):
    return Float8DelayedScalingQuantizer() if role.module_type == "matmul" else factories.current_scaling_factory(role)


def test_delayed_state_in_code_several_blocks_run_through_one_graph_is_named():
    """The blocks' score products run in one graph whose delayed-scaling slots every block shares
    (a training step then fails in backward): the compile says so, naming the code and how many
    modules run it; the model's own resumed code (one instance runs it), and a stateless recipe,
    hear nothing."""
    for kind in (ScoresAfterABreak, ScoresBeforeABreak):
        torch._dynamo.reset()
        compiled = graphquant.compile(models.seeded(ScoresStack(kind=kind)), CustomRecipe(delayed_products), backend="aot_eager")
        with pytest.warns(UserWarning, match=rf"matmul\.\d#0.* keep delayed-scaling state in {kind.__name__}\.forward at "
                                             r"test_compile_plan\.py:\d+, which 2 modules of the model run through this one graph"):
            compiled(x3())
    for model, recipe in ((ScoresStack(root_break=True), CustomRecipe(delayed_products)), (ScoresStack(), recipes.current_scaling()),
                          (ScoresStack(layers=1), CustomRecipe(delayed_products))):
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            graphquant.compile(models.seeded(model), recipe, backend="aot_eager")(x3())
        assert not [w for w in caught if "keep delayed-scaling state" in str(w.message)]


class ScoresThenABreak(torch.nn.Module):
    """Scores, then a graph break (a logger call), in a module of no parameters."""

    def forward(self, x):
        scores = x @ x.transpose(-1, -2)
        torch._dynamo.graph_break()
        return scores.softmax(-1)


class ScoresAroundABreak(torch.nn.Module):
    """Scores on both sides of a graph break, in a method that calls its module ``s``: the frame
    before the break holds the module as L['s'], and so does the code resumed after it."""

    def forward(s, x):
        scores = x @ x.transpose(-1, -2)
        torch._dynamo.graph_break()
        return scores.softmax(-1) @ x if s.training else scores


@pytest.mark.parametrize("kind, products", [(ScoresThenABreak, 1), (ScoresAroundABreak, 2)])
def test_a_module_of_no_parameters_compiled_on_its_own_is_named_and_guarded_per_instance(kind, products):
    """Its frame lifts no parameter to name it by: the module itself names its products and
    guards its graph, so each instance keeps its own delayed-scaling slots and trains, whatever
    its method calls its first parameter."""
    class TwoScores(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = kind(), kind()

        def forward(self, x):
            return self.second(self.first(x))

    compiled = graphquant.compile(TwoScores(), CustomRecipe(delayed_products), backend="aot_eager")
    for _ in range(2):
        compiled(x3(dim=32).requires_grad_()).square().mean().backward()
    sites = sorted({g.site for plan in compiled.graphquant.plans for g in plan.gemms})
    assert sites == [f"{module}.matmul.{i}#0" for module in ("first", "second") for i in range(products)]
    assert {str(role) for role in compiled.graphquant.run_state.delayed} >= {
        "module_type=matmul|tensor_type=input|name=first.matmul.0", "module_type=matmul|tensor_type=input|name=second.matmul.0"}


def _scores_of(module, x):
    """A function of a module argument that breaks its graph (transformers' eager_attention_forward
    takes its attention module so): compiled as a frame of its own."""
    scores = x @ x.transpose(-1, -2) * module.scale
    torch._dynamo.graph_break()
    return scores.softmax(-1) @ x


def test_a_functions_module_argument_is_not_its_owner():
    """Only a method's first parameter is the module whose code the frame runs: a function called
    with each layer's module stays one graph for every layer, its products named as no module's,
    not compiled again for each module it is given."""
    class Layer(torch.nn.Module):
        scale = 0.125

        def forward(self, x):
            return _scores_of(self, x)

    compiled = graphquant.compile(models.Wrapped(torch.nn.Sequential(Layer(), Layer(), Layer())), recipes.mxfp8_block_scaling(), backend="aot_eager")
    compiled(x3(dim=32))
    assert sorted({g.site for plan in compiled.graphquant.plans for g in plan.gemms}) == ["matmul.0#0", "matmul.1#0"]
    assert len(compiled.graphquant.plans) == 2


class RotaryLinear(torch.nn.Module):
    """A rotary embedding's angles, frequencies times positions (an outer product: a matmul whose
    reduction is 1 long, as transformers' Llama computes them), then a linear."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 64, 2).float() / 64))
        self.proj = torch.nn.Linear(64, 64, dtype=torch.bfloat16)

    def forward(self, x):
        positions = torch.arange(x.shape[1], dtype=torch.float32)
        angles = (self.inv_freq[None, :, None] @ positions[None, None, :]).transpose(1, 2)
        return self.proj(x * torch.cat((angles, angles), -1).cos().to(x.dtype))


@pytest.mark.parametrize("recipe", [recipes.mxfp8_block_scaling, recipes.nvfp4_block_scaling])
def test_built_in_recipes_keep_a_short_reduction_in_high_precision_with_the_reason(recipe):
    """The rotary outer product tiles no block along its 1-long reduction: the built-in recipes
    run it in high precision and say why; a factory of the user's own still fails on it."""
    model, x = RotaryLinear(), torch.randn(2, 32, 64, dtype=torch.bfloat16)
    compiled = graphquant.compile(model, recipe(), backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        compiled(x)
    rotary = [g for g in compiled.graphquant.plan.gemms if g.module_type == "matmul"]
    assert rotary and all(g.backend.name == "high-precision matmul" for g in rotary)
    assert all("1-long reduction tile no block of the recipe's formats" in g.reason for g in rotary), rotary
    torch._dynamo.reset()
    own = graphquant.compile(RotaryLinear(), CustomRecipe(recipe().qfactory), backend="aot_eager", fullgraph=True)
    with pytest.raises(graphquant.PlanError, match=r"\(matmul\) .*multiple of"):
        with torch.no_grad():
            own(x)


@pytest.mark.parametrize("features", [96, 256])
def test_rows_alone_that_tile_no_block_are_the_error_they_are_for_a_narrow_linear_too(features):
    """A linear whose 96 outputs tile MXFP8's 32-blocks, trained on 8 rows (the input's columnwise
    32x1 blocks fail): its outputs do not keep it from tiling, so it is the error a 256-wide one
    gets, not high precision with a reason blaming its features. The model's only linear: the
    message said the tokens were "this call's tokens, which the model's other linears take too"."""
    model = torch.nn.Sequential(torch.nn.Linear(64, features))
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend="aot_eager")
    tokens = r"dim 0 of the 8x64 tensor must be a multiple of 32.*Its 8 rows are this call's tokens: .*pad the batch.*every linear"
    with pytest.raises(graphquant.PlanError, match=tokens) as error:
        compiled(torch.randn(8, 64, requires_grad=True)).sum().backward()
    assert "other linears" not in str(error.value)


@pytest.mark.parametrize(
    "name",
    ["rowwise_with_gw_hp", "high_precision_fwd_mxfp8_bwd", "mxfp8_fwd_high_precision_bwd", "mxfp8_fwd_nvfp4_bwd",
     "nvfp4_row_scaled_fwd_high_precision_bwd"],
)
def test_zoo_recipes_give_a_matmul_the_formats_of_a_linear(name):
    """A zoo recipe that names its forward's and backward's formats gives an activation x
    activation matmul's fprop, dgrad and wgrad the formats of a linear's beside it (its right
    operand, other, the weight's): TE's recipes have no matmul, and their "other roles" branch
    left, for example, a high-precision backward in MXFP8 and a dgrad of bf16 x MXFP8."""

    class Scores(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

        def forward(self, x):
            return self.q(x) @ self.k(x).t()

    plan = graphquant.explain(Scores(), zoo.recipe(name), torch.randn(64, 64, requires_grad=True))
    formats = {site: {g.gemm: (g.a_format, g.b_format) for g in plan.gemms if g.site == site} for site in ("q#0", "matmul.0#0")}
    assert formats["matmul.0#0"] == formats["q#0"] and len(formats["q#0"]) == 3, formats


@pytest.mark.parametrize("shape, dynamic", [((0, 64), False), ((2, 0, 64), True)])  # symbolic: rows 0 * s0
@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8", "nvfp4"])
def test_an_empty_batch_runs_its_gemms_in_high_precision_and_says_why(recipe, shape, dynamic):
    make = {"rowwise": lambda: zoo.recipe("rowwise"), "mxfp8": recipes.mxfp8_block_scaling, "nvfp4": recipes.nvfp4_block_scaling}
    linear = torch.nn.Linear(64, 128)
    compiled = graphquant.compile(linear, make[recipe](), backend="aot_eager", dynamic=dynamic)
    y = compiled(torch.zeros(shape))
    y.sum().backward()
    assert y.shape == (*shape[:-1], 128) and torch.equal(linear.weight.grad, torch.zeros(128, 64))
    assert {g.reason for g in compiled.graphquant.plan.gemms} == {"in high precision: it is empty (m = 0), nothing to quantize"}


@pytest.mark.parametrize("features", [(0, 128), (64, 0)], ids=["k=0", "n=0"])
def test_a_linear_of_no_input_or_no_output_features_computes_what_torch_does(features):
    """An nn.Linear(0, n) (its output the bias alone) or nn.Linear(k, 0) (an empty output) is an
    empty product the plan keeps in high precision; it failed inside the compile, reshaping 0
    elements to (-1, 0)."""
    linear = torch.nn.Linear(*features)
    torch.nn.init.normal_(linear.bias)
    reference = copy.deepcopy(linear)
    compiled = graphquant.compile(linear, recipes.mxfp8_block_scaling(), backend="aot_eager")
    x = torch.randn(2, 32, features[0], requires_grad=True)
    y, expected = compiled(x), reference(x.detach().clone().requires_grad_())
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    y.square().sum().backward()
    expected.square().sum().backward()
    for name, p in linear.named_parameters():
        torch.testing.assert_close(p.grad, getattr(reference, name).grad, rtol=0, atol=0)
    assert {g.reason.split(" (")[0] for g in compiled.graphquant.plan.gemms} == {"in high precision: it is empty"}


@pytest.mark.parametrize("spelling", ["bmm", "einsum"])
def test_a_batched_product_of_no_matrices_computes_what_torch_does(spelling):
    """A bmm or einsum over an empty batch is an empty product the plan keeps in high precision;
    it failed inside the compile, dividing the operand's rows by its batch of 0."""
    def product(a, b):
        return torch.bmm(a, b) if spelling == "bmm" else torch.einsum("bmk,bkn->bmn", a, b)

    a, b = torch.randn(0, 32, 64, requires_grad=True), torch.randn(0, 64, 128, requires_grad=True)
    compiled = graphquant.compile(product, recipes.mxfp8_block_scaling(), backend="aot_eager")
    y = compiled(a, b)
    torch.testing.assert_close(y, product(a, b), rtol=0, atol=0)
    y.sum().backward()
    assert a.grad.shape == a.shape and b.grad.shape == b.shape
    assert {g.reason for g in compiled.graphquant.plan.gemms} == {"in high precision: it is empty (batch = 0), nothing to quantize"}


class TwiceCalled(torch.nn.Module):
    """One module called on two shapes in a forward: both calls share its roles."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, first, second):
        return self.module(*first), self.module(*second)


class Product(torch.nn.Module):
    def forward(self, a, b):
        return a @ b


@pytest.mark.parametrize("small_first", [False, True])
def test_each_call_of_a_module_runs_the_formats_its_plan_row_names(small_first):
    """A matmul called with 128 outputs and with 8: the small call runs in high precision (its
    outputs tile no MXFP8 block), the other in MXFP8. The small call's high precision was written
    into the roles both calls share, so the other call ran in high precision too while the plan
    said MXFP8 (or failed, the small call first)."""
    big = (torch.randn(64, 64), torch.randn(64, 128))
    small = (torch.randn(64, 64), torch.randn(64, 8))
    calls = (small, big) if small_first else (big, small)
    compiled = graphquant.compile(TwiceCalled(Product()), recipes.mxfp8_block_scaling(), backend="aot_eager")
    with torch.no_grad():
        outputs = dict(zip(("small", "big") if small_first else ("big", "small"), compiled(*calls)))
    formats = {g.site: g.a_format for g in compiled.graphquant.plan.gemms}
    assert sorted(formats.values()) == ["identity()", "mxfp8(fp8_dtype=e4m3)"]
    mxfp8 = graphquant.MXFP8Quantizer()
    a, b = big
    assert torch.equal(outputs["big"], mxfp8(a).rowwise.dequantize() @ mxfp8(b.t().contiguous()).rowwise.dequantize().t())
    assert torch.equal(outputs["small"], small[0] @ small[1])


def test_a_linear_called_on_no_rows_and_on_rows_quantizes_the_call_with_rows():
    """An empty call keeps its product in high precision for that call alone, not for the call
    before it (the last call's choice was written into the roles both share)."""
    linear = models.seeded(torch.nn.Linear(64, 128))
    x = torch.randn(32, 64)
    both = graphquant.compile(TwiceCalled(linear), zoo.recipe("rowwise"), backend="aot_eager")
    with torch.no_grad():
        y, _ = both((x,), (torch.zeros(0, 64),))
    torch._dynamo.reset()
    alone = graphquant.compile(linear, zoo.recipe("rowwise"), backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(y, alone(x)) and not torch.equal(y, linear(x))


@pytest.mark.parametrize("training", [True, False])
def test_few_output_features_stay_in_high_precision_when_their_count_turns_dynamic(training):
    """8, then 16 output features: Dynamo recompiles the second with a symbolic count, which the
    tests for few features (an int's alone) did not take: training failed the plan, evaluation
    quantized what training keeps in high precision."""
    compiled = graphquant.compile(Product(), recipes.mxfp8_block_scaling(), backend="aot_eager")
    a = torch.randn(64, 64, requires_grad=training)
    for n in (8, 16, 24, 64):
        b = torch.randn(64, n, requires_grad=training)
        with torch.set_grad_enabled(training):
            y = compiled(a, b).detach()
        high_precision = (y - a.detach() @ b.detach()).abs().max() < 1e-4  # MXFP8's rounding errors are some 1e-2 of these products
        assert high_precision == (n < 32), n  # 64 tiles MXFP8's blocks: quantized
    reasons = [g.reason for g in compiled.graphquant.plans[1].gemms]
    assert reasons and all("output features tile no block" in why for why in reasons), reasons


def test_a_router_stays_in_high_precision_at_token_counts_that_turn_dynamic():
    """8 outputs under MXFP8 at 64, 96, then 40 tokens: the third compile has a symbolic count, for
    which the rows' multiple of 128 was not tried, so the router failed the plan; a fresh compile
    at 40 tokens keeps it in high precision."""
    router = models.seeded(torch.nn.Linear(64, 8, bias=False))
    compiled = graphquant.compile(router, recipes.mxfp8_block_scaling(), backend="aot_eager")
    for tokens in (64, 96, 40):
        x = torch.randn(tokens, 64, requires_grad=True)
        compiled(x).sum().backward()
        assert all(g.backend.name == "high-precision matmul" for g in compiled.graphquant.plans[-1].gemms)


class LowRankAdapted(torch.nn.Linear):
    """An nn.Linear subclass that multiplies a low-rank adapter's weights beside its own (LoRA)."""

    def __init__(self, features_in, features_out, rank=8):
        super().__init__(features_in, features_out)
        self.lora_a = torch.nn.Parameter(torch.randn(rank, features_in) / features_in**0.5)
        self.lora_b = torch.nn.Parameter(torch.randn(features_out, rank) / rank**0.5)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight, self.bias) + torch.nn.functional.linear(torch.nn.functional.linear(x, self.lora_a), self.lora_b)


def test_an_nn_linear_subclass_names_only_its_own_weights_product_after_itself():
    """Its adapter's products are products of the module's code, named as a module's functional
    products are: all three were "fc#0", one set of roles, and the rank-8 products' high precision
    was the main product's too."""
    model = models.seeded(torch.nn.Sequential(collections.OrderedDict(fc=LowRankAdapted(64, 128))))
    x = torch.randn(64, 64)
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend="aot_eager")
    with torch.no_grad():
        y = compiled(x)
    formats = {g.site: g.b_format for g in compiled.graphquant.plan.gemms}
    assert formats == {"fc#0": "mxfp8(fp8_dtype=e4m3)", "fc.linear.0#0": "identity()", "fc.linear.1#0": "identity()"}
    fc, mxfp8 = model.fc, graphquant.MXFP8Quantizer()
    main = torch.nn.functional.linear(mxfp8(x).rowwise.dequantize(), mxfp8(fc.weight.detach()).rowwise.dequantize(), fc.bias)
    with torch.no_grad():
        assert torch.equal(y, main + torch.nn.functional.linear(torch.nn.functional.linear(x, fc.lora_a), fc.lora_b))


def test_a_module_reached_through_get_submodule_is_named_as_named_modules_spells_it():
    """Dynamo's path of such a module is "getattr(L['self'].blocks, '1')": its product was named
    "getattr(L.self.blocks, '1').linear.0", a functional product of no module, not "blocks.1"."""

    class Blocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))

        def forward(self, x):
            return self.blocks[1](self.get_submodule("blocks.1")(self.blocks[0](x)))

    plan = graphquant.explain(models.seeded(Blocks()), recipes.mxfp8_block_scaling(), x3())
    # Dynamo counts calls per path, both blocks.1's from 0: they were one site label.
    assert sites_of(plan) == [("blocks.0", 0, "linear"), ("blocks.1", 0, "linear"), ("blocks.1", 1, "linear")]


MODULE_OF_A_FUNCTION = models.seeded(models.MLP())  # a global the compiled function below calls


def test_a_function_calling_a_global_module_names_its_sites_after_the_variable():
    compiled = graphquant.compile(lambda x: MODULE_OF_A_FUNCTION(x), recipes.mxfp8_block_scaling(), backend="aot_eager")
    compiled(torch.randn(32, 64))
    assert {g.site for g in compiled.graphquant.plan.gemms} == {"MODULE_OF_A_FUNCTION.fc1#0", "MODULE_OF_A_FUNCTION.fc2#0"}
