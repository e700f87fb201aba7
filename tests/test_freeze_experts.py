"""graphquant.freeze of expert stacks: 3-D parameters that torch._grouped_mm reads, stored quantized.

An expert layer (two chained grouped GEMMs, one reading its stack transposed as nn.Linear stores a
weight, one as stored) must compute the per-call inference path's bits from its stored stacks for
every groupable recipe family, quantize no stack in its graph, round-trip through a weights-only
checkpoint, and refuse what it cannot freeze with an error or a warning that says why.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from reference import StaticInputs, fresh_dynamo  # noqa: F401
from test_freeze import FAMILIES

import graphquant
from graphquant import factories, zoo
from graphquant.ops import grouped
from graphquant.passes.plan import PlanError
from graphquant.quantizers import NVFP4Quantizer

E, K, N = 4, 128, 256


class Experts(torch.nn.Module):
    """up: (E, N, K) read transposed; down: (E, N, K), read as stored (K_in = N, N_out = K)."""

    def __init__(self, seed=0, square=False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        n = K if square else N
        self.up = torch.nn.Parameter((torch.randn(E, n, K, generator=g) / K**0.5).to(torch.bfloat16))
        self.down = torch.nn.Parameter((torch.randn(E, n, K, generator=g) / n**0.5).to(torch.bfloat16))
        self.peek = False  # read down's values outside a grouped GEMM
        self.swap = False  # read up as stored (square stacks only)
        self.down_alone = False  # read down outside a grouped GEMM and nowhere else

    def forward(self, x, offs):
        if self.down_alone:
            return x + self.down.mean()
        up = self.up if self.swap else self.up.transpose(-2, -1)
        y = torch._grouped_mm(F.silu(torch._grouped_mm(x, up, offs=offs)), self.down, offs=offs)
        return y + self.down.mean() if self.peek else y


def tokens(seed=0):
    return torch.randn(64, K, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


OFFS = torch.tensor([16, 16, 40, 64], dtype=torch.int32)  # an empty group, ragged ones


def inference_model(model, recipe, backend="aot_eager"):
    """fullgraph: a frozen stack's path, transformers' included, has no graph break (nothing reads
    the offsets on the host)."""
    return graphquant.compile(model, recipe, mode="inference", backend=backend, fullgraph=True)


def called_then_frozen(model, recipe):
    compiled = inference_model(model, recipe)
    with torch.no_grad():
        per_call = compiled(tokens(), OFFS)
    graphquant.freeze(compiled)
    return compiled, per_call


def never_quantize_a_stack(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("an expert stack was quantized")

    monkeypatch.setattr(grouped, "_expert_stack", refuse)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_frozen_experts_compute_the_per_call_bits_from_stored_stacks(family, monkeypatch):
    model = Experts()
    compiled, per_call = called_then_frozen(model, FAMILIES[family]())
    never_quantize_a_stack(monkeypatch)
    with torch.no_grad():
        frozen = compiled(tokens(), OFFS)
    assert torch.equal(per_call, frozen)

    assert list(model.parameters()) == []
    assert [(type(m).__name__, m.parameter, m.transposed) for m in (model.frozen_up, model.frozen_down)] == [
        ("FrozenExperts", "up", True), ("FrozenExperts", "down", False)
    ]
    plan = compiled.graphquant.plan
    assert [(g.site, g.gemm, g.b.split(":")[0]) for g in plan.gemms] == [
        (f"grouped_linear.{i}#0", "fprop", "weight.rowwise (frozen)") for i in (0, 1)
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_frozen_experts_compute_the_per_call_bits_with_inductor_on_cuda(family):
    model = Experts().cuda()
    compiled = inference_model(model, FAMILIES[family](), backend="inductor")
    x, offs = tokens().cuda(), OFFS.cuda()
    with torch.no_grad():
        per_call = compiled(x, offs)
        graphquant.freeze(compiled)
        frozen = compiled(x, offs)
    assert torch.equal(per_call, frozen)


def test_stored_stacks_are_static_inputs_that_cuda_graphs_read_in_place():
    """CUDA graph trees copy every input AOT does not call static into the graph's own memory at
    each replay: for a stored stack, all of the experts' bytes."""
    static = StaticInputs()
    model = Experts()
    compiled = graphquant.compile(model, FAMILIES["rowwise"](), mode="inference", backend=static.backend)
    x = tokens()
    with torch.no_grad():
        compiled(x, OFFS)
        graphquant.freeze(compiled)
        static.clear()
        compiled(x, OFFS)
    stored = [getattr(m, f"weight_{part}") for m in (model.frozen_up, model.frozen_down) for part in ("codes", "scale")]
    assert {t.data_ptr() for t in stored} <= static.static and x.data_ptr() in static.given - static.static


def test_frozen_stacks_take_half_of_bf16_in_fp8_and_under_a_third_in_nvfp4():
    """The checkpoint's bytes; in memory each stack's stand-in adds one expert of one shape, shared."""
    ratios = {}
    for family, recipe in FAMILIES.items():
        model = Experts()
        bf16_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        called_then_frozen(model, recipe())
        frozen_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values() if isinstance(t, torch.Tensor))
        ratios[family] = frozen_bytes / bf16_bytes
        stand_ins = {model.up.untyped_storage().data_ptr(), model.down.untyped_storage().data_ptr()}
        assert len(stand_ins) == 1 and model.up.untyped_storage().nbytes() == N * K * 2  # one expert, both stacks
        assert model.up.stride()[0] == 0 and torch.isnan(model.up).all()
    assert all(0.5 <= ratios[f] <= 0.52 for f in ("tensorwise", "rowwise", "deepseek_blockwise", "mxfp8")), ratios
    assert 0.28 <= ratios["nvfp4"] <= 0.3, ratios


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_frozen_experts_checkpoint_loads_weights_only_without_quantizing(family, tmp_path, monkeypatch):
    compiled, _ = called_then_frozen(Experts(), FAMILIES[family]())
    with torch.no_grad():
        expected = compiled(tokens(), OFFS)
    torch.save(compiled.state_dict(), tmp_path / "frozen.pt")

    never_quantize_a_stack(monkeypatch)
    with torch.device("meta"):  # no high-precision stack is ever made
        skeleton = Experts()
    loaded = inference_model(skeleton, FAMILIES[family]())
    graphquant.freeze(loaded, state_dict=torch.load(tmp_path / "frozen.pt", weights_only=True))
    with torch.no_grad():
        assert torch.equal(loaded(tokens(), OFFS), expected)
    assert not any(t.is_meta for t in [*skeleton.state_dict().values(), skeleton.up, skeleton.down] if isinstance(t, torch.Tensor))


def test_a_stack_frozen_under_another_recipe_or_of_another_shape_is_refused(tmp_path):
    compiled, _ = called_then_frozen(Experts(), FAMILIES["tensorwise"]())
    torch.save(compiled.state_dict(), tmp_path / "frozen.pt")
    state = torch.load(tmp_path / "frozen.pt", weights_only=True)

    other_recipe = inference_model(Experts(), FAMILIES["mxfp8"]())
    graphquant.freeze(other_recipe, state_dict=state)
    with pytest.raises(PlanError, match=r"grouped_linear.0#0 \(grouped_linear\) weight: stored frozen as fp8_current.*gives this slot mxfp8"):
        with torch.no_grad():
            other_recipe(tokens(), OFFS)

    with pytest.raises(ValueError, match=r"stores (up|down) as an expert stack of shape \(4, 256, 128\), but the model has a parameter of shape \(4, 128, 128\)"):
        graphquant.freeze(inference_model(Experts(square=True), FAMILIES["tensorwise"]()), state_dict=state)


def test_freeze_leaves_a_stack_it_cannot_store_with_a_warning():
    never_called = inference_model(Experts(), FAMILIES["tensorwise"]())
    with pytest.warns(UserWarning, match=r"has not been called: its 3-D parameters keep their high-precision values"):
        graphquant.freeze(never_called)
    assert [name for name, _ in never_called._orig_mod.named_parameters()] == ["up", "down"]

    model = Experts()
    model.peek = True
    compiled = inference_model(model, FAMILIES["tensorwise"]())
    with torch.no_grad():
        per_call = compiled(tokens(), OFFS)
    with pytest.warns(UserWarning, match=r"leaves the expert stack down with its high-precision values: it is also read by mean at test_freeze_experts.py:\d+, "):
        graphquant.freeze(compiled)
    assert [name for name, _ in model.named_parameters()] == ["down"]
    with torch.no_grad():
        assert torch.equal(compiled(tokens(), OFFS), per_call)


def test_a_stack_two_sites_read_is_left_for_that_reason_alone():
    """One stack read by two grouped GEMMs is left with its high-precision values, saying so; it
    was said twice more, wrongly: as sites that read their stack "otherwise" (a slice, a cast),
    and as no expert stack read by torch._grouped_mm at all."""

    class TwoPasses(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, K, K, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) / 8)

        def forward(self, x, offs):
            return torch._grouped_mm(torch.relu(torch._grouped_mm(x, self.w, offs=offs)), self.w, offs=offs)

    compiled = inference_model(TwoPasses(), FAMILIES["rowwise"]())
    with torch.no_grad():
        per_call = compiled(tokens(), OFFS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphquant.freeze(compiled)
    said = [str(w.message) for w in caught]
    assert said == [
        "graphquant.freeze leaves the expert stack w with its high-precision values: it is read by grouped_linear.0 (as stored) and "
        "grouped_linear.1 (as stored)",
        "graphquant.freeze found nothing it can store in TwoPasses: nothing was frozen",
    ], said
    with torch.no_grad():
        assert torch.equal(compiled(tokens(), OFFS), per_call)


def test_freeze_names_the_grouped_sites_that_read_a_slice_of_a_fused_stack():
    """Gate and up fused in one stack, each grouped GEMM reading a slice of it: no parameter is
    a site's stack, so the fused one keeps its values, and freeze says which sites read it."""

    class Fused(Experts):
        def forward(self, x, offs):
            half = self.up.shape[1] // 2
            gate = torch._grouped_mm(x, self.up[:, :half].transpose(-2, -1), offs=offs)
            up = torch._grouped_mm(x, self.up[:, half:].transpose(-2, -1), offs=offs)
            return torch._grouped_mm(F.silu(gate) * up, self.down[:, :half], offs=offs)

    model = Fused(square=True)
    compiled = inference_model(model, FAMILIES["tensorwise"]())
    with torch.no_grad():
        per_call = compiled(tokens(), OFFS)
    with pytest.warns(UserWarning, match=r"3 grouped site\(s\) read theirs otherwise \(grouped_linear.0, grouped_linear.1, grouped_linear.2"):
        graphquant.freeze(compiled)
    assert isinstance(model.up, torch.nn.Parameter)
    with torch.no_grad():
        assert torch.equal(compiled(tokens(), OFFS), per_call)


def test_a_graph_that_reads_a_frozen_stack_otherwise_fails_to_compile():
    """Its place holds NaN: a new code path that reads it, or reads it the other way round, is an error."""
    model = Experts(square=True)
    compiled, _ = called_then_frozen(model, FAMILIES["rowwise"]())
    model.peek = True
    with pytest.raises(PlanError, match=r"^mean at test_freeze_experts.py:\d+ reads frozen_down's parameter, an expert stack that graphquant.freeze stored"):
        with torch.no_grad():
            compiled(tokens(), OFFS)
    model.peek, model.down_alone = False, True  # no grouped GEMM reads it in this graph
    with pytest.raises(PlanError, match=r"reads frozen_down's parameter, an expert stack that graphquant.freeze stored"):
        with torch.no_grad():
            compiled(tokens(), OFFS)
    model.down_alone, model.swap = False, True
    with pytest.raises(PlanError, match=r"grouped_linear.0#0 \(grouped_linear\) reads the frozen expert stack frozen_up as stored"):
        with torch.no_grad():
            compiled(tokens(), OFFS)


def test_freeze_refuses_a_stack_whose_quantize_draws_random_numbers():
    def stochastic_weights(role):
        if role.tensor_type == "weight":
            return NVFP4Quantizer(stochastic_rounding=True)
        return factories.nvfp4_factory(role)

    compiled = inference_model(Experts(), graphquant.CustomRecipe(stochastic_weights))
    with torch.no_grad():
        compiled(tokens(), OFFS)
    with pytest.raises(ValueError, match=r"graphquant.freeze: (up|down)'s weight format nvfp4.* rounds stochastically"):
        graphquant.freeze(compiled)


@pytest.mark.parametrize("family", ["tensorwise", "mxfp8", "nvfp4"])
def test_frozen_experts_called_on_no_tokens_give_an_empty_output(family):
    """An empty batch keeps its products in high precision for that call alone: the frozen stack's
    call refused it ("stored frozen as fp8_current ... the recipe gives this slot identity()"),
    where a frozen linear, and the stack per call, run it."""
    compiled, _ = called_then_frozen(Experts(), FAMILIES[family]())
    with torch.no_grad():
        assert compiled(tokens()[:0], torch.zeros(E, dtype=torch.int32)).shape == (0, K)


def test_frozen_experts_have_no_backward():
    compiled, _ = called_then_frozen(Experts(), FAMILIES["mxfp8"]())
    x = tokens().requires_grad_()
    with pytest.warns(UserWarning, match="makes no backward"):
        y = compiled(x, OFFS)
    with pytest.raises(RuntimeError, match=r"backward through grouped_linear.1#0, whose weight graphquant.freeze stored quantized"):
        y.sum().backward()


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_transformers_moe_experts_freeze(name):
    """transformers' experts (its default grouped_mm implementation) are stored quantized and give the per-call bits."""
    pytest.importorskip("transformers")
    from test_hf_moe import MODELS, token_ids

    model = MODELS[name]("grouped_mm", torch.bfloat16).eval()
    compiled = inference_model(model, zoo.recipe("deepseek_blockwise"))
    with torch.no_grad():
        per_call = compiled(token_ids()).logits
        graphquant.freeze(compiled)
        assert torch.equal(compiled(token_ids()).logits, per_call)
    assert [n for n, p in model.named_parameters() if p.dim() == 3] == []
    experts = model.model.layers[0].mlp.experts
    assert [(m.parameter, m.transposed) for m in (experts.frozen_gate_up_proj, experts.frozen_down_proj)] == [
        ("gate_up_proj", True), ("down_proj", True)
    ]


def test_a_cast_moves_stored_weights_without_casting_them():
    """model.to(dtype) keeps the codes and scales in their format's dtypes; it copies a stand-in to
    full size, which the next compile warns of and freeze again makes one expert's."""
    model = Experts()
    compiled, per_call = called_then_frozen(model, FAMILIES["tensorwise"]())
    dtypes = {name: t.dtype for name, t in model.state_dict().items() if isinstance(t, torch.Tensor)}
    model.to(torch.float32)
    assert {name: t.dtype for name, t in model.state_dict().items() if isinstance(t, torch.Tensor)} == dtypes
    model.to(torch.bfloat16)  # back to what torch._grouped_mm takes on the CPU; the stand-in stays full size
    assert model.up.stride()[0] != 0
    with pytest.warns(UserWarning, match=r"frozen_up's stand-in holds every expert .* call graphquant.freeze\(model\) again"):
        with torch.no_grad():
            assert torch.equal(compiled(tokens(), OFFS), per_call)
    graphquant.freeze(compiled)
    assert model.up.stride()[0] == 0 and model.up.untyped_storage().nbytes() == N * K * 2


SPELLINGS = {
    "w.transpose(-2, -1)": lambda w: w.transpose(-2, -1),
    "w.mT": lambda w: w.mT,
    "w.permute(0, 2, 1)": lambda w: w.permute(0, 2, 1),
    "w.swapaxes(1, 2)": lambda w: w.swapaxes(1, 2),
    "torch.transpose(w, 1, 2)": lambda w: torch.transpose(w, 1, 2),
}


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_every_spelling_of_the_transpose_freezes(spelling):
    """An (E, N, K) stack read through any common spelling of a swap of its last two dims."""

    class Spelled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = Experts().up

        def forward(self, x, offs):
            return torch._grouped_mm(x, SPELLINGS[spelling](self.w), offs=offs)

    model = Spelled()
    compiled, per_call = called_then_frozen(model, FAMILIES["deepseek_blockwise"]())
    assert isinstance(model.frozen_w, graphquant.FrozenExperts) and model.frozen_w.transposed
    with torch.no_grad():
        assert torch.equal(compiled(tokens(), OFFS), per_call)
