"""graphquant.freeze: linears that keep their weights only quantized, for inference.

A frozen model must compute the per-call inference path's bits for every recipe family, hold
no high-precision weight, quantize no weight in its graph, and round-trip through a weights-only
checkpoint without quantizing anything.
"""

import copy
import warnings

import models
import pytest
import torch
from reference import fresh_dynamo  # noqa: F401
from test_compile_inference import KeepGraphs

import graphquant
from graphquant import recipes, zoo
from graphquant.ops import inference

FAMILIES = {
    "tensorwise": lambda: zoo.recipe("tensorwise"),
    "rowwise": lambda: zoo.recipe("rowwise"),
    "deepseek_blockwise": lambda: zoo.recipe("deepseek_blockwise"),
    "mxfp8": recipes.mxfp8_block_scaling,
    "nvfp4": recipes.nvfp4_block_scaling,
}


def quantize_calls(gm):
    return sum(str(n.target).startswith("graphquant.quantize") for n in gm.graph.nodes)


def mlp(dtype=torch.bfloat16, hidden=128):
    return models.seeded(models.MLP(hidden=hidden)).to(dtype)


def x3(dtype=torch.bfloat16, seed=0):
    return torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(seed)).to(dtype)


def inference_model(model, recipe, **kwargs):
    return graphquant.compile(model, recipe, mode="inference", backend=kwargs.pop("backend", "aot_eager"), **kwargs)


def never_quantize_a_weight(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a weight was quantized")

    monkeypatch.setattr(inference, "quantize_weight", refuse)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_frozen_model_computes_the_per_call_bits_from_stored_weights(family):
    keep = KeepGraphs()
    compiled = inference_model(mlp(), FAMILIES[family](), backend=keep.backend)
    with torch.no_grad():
        per_call = compiled(x3())
        graphquant.freeze(compiled)  # after a first call: the model recompiles for its new modules
        frozen = compiled(x3())
    assert torch.equal(per_call, frozen)

    assert [name for name, _ in compiled.named_parameters()] == ["_orig_mod.fc1.bias", "_orig_mod.fc2.bias"]
    assert isinstance(compiled._orig_mod.fc1, graphquant.FrozenLinear)
    graph = keep.graphs[-1]
    inputs = [n.meta["val"] for n in graph.graph.find_nodes(op="placeholder")]
    weight_shaped = [t for t in inputs if t.dtype == torch.bfloat16 and tuple(t.shape) in ((128, 64), (64, 128))]
    assert weight_shaped == [], "a high-precision weight entered the frozen graph"
    if family == "tensorwise":  # a per-tensor FP8 weight's quantize is a graphquant::quantize call, its input's traced
        assert [quantize_calls(g) for g in keep.graphs] == [2, 0]
    plan = compiled.graphquant.plan
    assert [(g.site, g.gemm, g.b) for g in plan.gemms] == [("fc1#0", "fprop", "weight.rowwise (frozen)"), ("fc2#0", "fprop", "weight.rowwise (frozen)")]


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_frozen_model_computes_the_per_call_bits_with_inductor_on_cuda(family):
    """Inductor compiles the per-call path's traced weight quantizes; freeze runs them eagerly. Both
    stay near the bf16 model's output: a GEMM that misreads its scales can give equal bits twice
    (cuBLASLt's 128x128 scaling at k = 256 did: scaled_mm.TILE_SCALED_K)."""
    model = models.seeded(models.MLP(d_in=256, hidden=512, d_out=256)).to(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 32, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        bf16 = model(x).float()
    compiled = graphquant.compile(model, FAMILIES[family](), mode="inference")
    with torch.no_grad():
        per_call = compiled(x)
        graphquant.freeze(compiled)
        frozen = compiled(x)
    assert torch.equal(per_call, frozen)
    assert (per_call.float() - bf16).abs().max() <= 0.5 * bf16.abs().max()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_frozen_graph_never_quantizes_a_weight(family, monkeypatch):
    compiled = inference_model(mlp(), FAMILIES[family]())
    graphquant.freeze(compiled)
    never_quantize_a_weight(monkeypatch)
    with torch.no_grad():
        compiled(x3())


def test_frozen_weights_take_half_of_bf16_in_fp8_and_under_a_third_in_nvfp4():
    """A Llama-like SwiGLU MLP (gate, up: d -> h, down: h -> d, no bias)."""
    bf16 = models.seeded(models.SwiGLU(dim=512, hidden=1024)).to(torch.bfloat16)
    bf16_bytes = sum(p.numel() * p.element_size() for p in bf16.parameters())
    ratios = {}
    for family, recipe in FAMILIES.items():
        compiled = inference_model(copy.deepcopy(bf16), recipe())
        graphquant.freeze(compiled)
        assert list(compiled.parameters()) == []
        frozen_bytes = sum(t.numel() * t.element_size() for t in compiled.state_dict().values() if isinstance(t, torch.Tensor))
        ratios[family] = frozen_bytes / bf16_bytes
    assert all(0.5 <= ratios[f] <= 0.52 for f in ("tensorwise", "rowwise", "deepseek_blockwise", "mxfp8")), ratios
    assert 0.28 <= ratios["nvfp4"] <= 0.3, ratios


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_frozen_checkpoint_loads_weights_only_without_quantizing(family, tmp_path, monkeypatch):
    compiled = inference_model(mlp(), FAMILIES[family]())
    graphquant.freeze(compiled)
    with torch.no_grad():
        expected = compiled(x3())
    torch.save(compiled.state_dict(), tmp_path / "frozen.pt")

    never_quantize_a_weight(monkeypatch)
    with torch.device("meta"):  # no high-precision weight is ever made
        skeleton = models.MLP().to(torch.bfloat16)
    loaded = inference_model(skeleton, FAMILIES[family]())
    graphquant.freeze(loaded, state_dict=torch.load(tmp_path / "frozen.pt", weights_only=True))
    with torch.no_grad():
        assert torch.equal(loaded(x3()), expected)
    assert not any(t.is_meta for t in loaded.state_dict().values() if isinstance(t, torch.Tensor))


def test_a_frozen_checkpoint_is_tensors_alone_which_safetensors_saves():
    """A frozen model's state_dict held its stored weights' descriptions as dicts, which safetensors
    (and transformers' save_pretrained through it) refused with an unrelated message: they are
    tensors of their JSON now, and a safetensors file loads as a torch.save one does."""
    safetensors = pytest.importorskip("safetensors.torch")
    compiled = inference_model(mlp(), FAMILIES["mxfp8"]())
    graphquant.freeze(compiled)
    with torch.no_grad():
        expected = compiled(x3())
    state = compiled.state_dict()
    assert all(isinstance(t, torch.Tensor) for t in state.values())
    with torch.device("meta"):
        skeleton = models.MLP().to(torch.bfloat16)
    loaded = inference_model(skeleton, FAMILIES["mxfp8"]())
    graphquant.freeze(loaded, state_dict=safetensors.load(safetensors.save(state)))
    with torch.no_grad():
        assert torch.equal(loaded(x3()), expected)


class ShortReduction(torch.nn.Module):
    """A linear of an 8-long reduction, which no MXFP8 or NVFP4 block tiles: the plan keeps it in
    high precision (IdentityQuantizer)."""

    def __init__(self):
        super().__init__()
        self.up, self.head = torch.nn.Linear(8, 256), torch.nn.Linear(256, 64)

    def forward(self, x):
        return self.head(torch.relu(self.up(x)))


class Routed(torch.nn.Module):
    """A router of 8 outputs beside an MLP: rowwise MXFP8 and NVFP4 blocks tile its weight, but
    the plan keeps it in high precision, in inference as in training (its few outputs tile no
    columnwise block)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.router = torch.nn.Linear(128, 256), torch.nn.Linear(256, 128), torch.nn.Linear(128, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))), self.router(x)


# The linears a plan keeps in high precision for their shape alone: (the model, its input's size, the linear).
SMALL_LINEARS = {"short reduction": (ShortReduction, (4, 8), "up"), "few outputs": (Routed, (64, 128), "router")}


@pytest.mark.parametrize("shape", ["short reduction", "few outputs"])
@pytest.mark.parametrize("family", ["mxfp8", "nvfp4"])
def test_a_checkpoint_of_a_weight_its_plan_kept_in_high_precision_loads_into_a_model_not_yet_called(family, shape):
    """Built on the meta device, the model cannot be called: freeze refused the checkpoint's high
    precision for a short reduction, asking for a call it cannot make, and for a router's few
    outputs ("frozen as mxfp8 ... the checkpoint's router is identity()"); it asks the planner what
    the first call's plan will keep now, as the checkpoint's did."""
    build, rows, small = SMALL_LINEARS[shape]
    compiled = inference_model(models.seeded(build()), FAMILIES[family]())
    x = torch.randn(*rows, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        compiled(x)
        graphquant.freeze(compiled)
        expected = compiled(x)
    assert compiled._orig_mod.get_submodule(small).weight_format == "identity()"
    with torch.device("meta"):
        skeleton = build()
    loaded = inference_model(skeleton, FAMILIES[family]())
    graphquant.freeze(loaded, state_dict=compiled.state_dict())
    with torch.no_grad():
        assert all(map(torch.equal, torch.utils._pytree.tree_leaves(loaded(x)), torch.utils._pytree.tree_leaves(expected)))


def test_a_weight_frozen_in_high_precision_takes_the_models_cast():
    """IdentityQuantizer's stored codes are the weight's values: .half() after freeze left them
    float32 (twice the memory, other numbers than freezing the half model, a checkpoint that loads
    into neither build); they take the cast now, as a quantized format's codes do not."""
    def keep_fc2(role):
        return graphquant.IdentityQuantizer() if role.name == "fc2" else recipes.mxfp8_block_scaling().qfactory(role)

    recipe = graphquant.CustomRecipe(keep_fc2)
    frozen_then_cast = inference_model(mlp(torch.float32), recipe)
    graphquant.freeze(frozen_then_cast)
    frozen_then_cast.half()
    cast_then_frozen = inference_model(mlp(torch.float32).half(), recipe)
    graphquant.freeze(cast_then_frozen)
    assert torch.equal(frozen_then_cast._orig_mod.fc2.weight_codes, cast_then_frozen._orig_mod.fc2.weight_codes)
    assert frozen_then_cast._orig_mod.fc1.weight_codes.dtype == torch.float8_e4m3fn  # codes of FP8 values keep theirs
    cast_then_frozen.load_state_dict(frozen_then_cast.state_dict())  # one layout: the checkpoint loads


def test_a_model_frozen_under_inference_mode_loads_a_checkpoint_after():
    """A serving script that runs everything under torch.inference_mode froze inference tensors,
    which a later load_state_dict outside it could not write (torch's in-place error)."""
    compiled = inference_model(mlp(), FAMILIES["mxfp8"]())
    with torch.inference_mode():
        compiled(x3())
        graphquant.freeze(compiled)
    other = inference_model(models.seeded(models.MLP(), seed=1).to(torch.bfloat16), FAMILIES["mxfp8"]())
    graphquant.freeze(other)
    compiled.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert torch.equal(compiled(x3()), other(x3()))


@pytest.mark.parametrize("built", ["on meta", "on cpu"])
def test_a_checkpoint_loaded_under_inference_mode_freezes_there_without_a_copy(built, tmp_path):
    """A serving script that loads the checkpoint, builds the model and freezes it all under
    torch.inference_mode gave freeze inference tensors, which torch refused as parameters (or as a
    target of the load's copy, in a model built there) outside inference mode."""
    source = inference_model(mlp(), FAMILIES["mxfp8"]())
    graphquant.freeze(source)
    with torch.no_grad():
        expected = source(x3())
    torch.save(source.state_dict(), tmp_path / "frozen.pt")
    with torch.inference_mode():
        state = torch.load(tmp_path / "frozen.pt", weights_only=True)
        with torch.device("meta" if built == "on meta" else "cpu"):
            skeleton = models.MLP().to(torch.bfloat16)
        loaded = graphquant.freeze(inference_model(skeleton, FAMILIES["mxfp8"]()), state_dict=state)
        assert torch.equal(loaded(x3()), expected)
    assert not any(t.is_inference() for t in loaded.state_dict().values())
    if built == "on meta":  # the checkpoint's memory itself, not a copy
        assert loaded._orig_mod.fc1.weight_codes.data_ptr() == state["_orig_mod.fc1.weight_codes"].data_ptr()
    loaded.load_state_dict(source.state_dict())  # ordinary tensors, which a later load writes


def test_a_weight_given_to_a_frozen_linear_is_refused_saying_why():
    compiled = inference_model(mlp(), FAMILIES["mxfp8"]())
    graphquant.freeze(compiled)
    with pytest.raises(AttributeError, match=r"fc1 is frozen, its weight stored as mxfp8\(fp8_dtype=e4m3\): a weight given to it"):
        compiled._orig_mod.fc1.weight = torch.nn.Parameter(torch.zeros(128, 64, dtype=torch.bfloat16))


@pytest.mark.parametrize("write", ["copy_", "nn.init", "data", "item", "out", "view", "detached", "data=", "foreach"])
def test_a_write_into_a_frozen_linears_weight_is_refused_not_lost(write):
    """The stand-in is a meta tensor, which takes any in-place op and keeps nothing: a weight
    loaded by ``copy_`` (or initialized, as a model's _init_weights does through ``.data``) after
    freeze would have been lost without a word."""
    compiled = inference_model(mlp(), FAMILIES["mxfp8"]())
    expected = compiled(x3())
    graphquant.freeze(compiled)
    weight, zeros = compiled._orig_mod.fc1.weight, torch.zeros(128, 64, dtype=torch.bfloat16)
    writes = {
        "copy_": lambda: weight.copy_(zeros), "nn.init": lambda: torch.nn.init.normal_(weight), "data": lambda: weight.data.normal_(),
        "item": lambda: weight.__setitem__(0, 1.0), "out": lambda: torch.mul(zeros.to("meta"), 2, out=weight),
        "view": lambda: weight.t()[0].fill_(1.0), "detached": lambda: weight.detach().zero_(),
        "data=": lambda: setattr(weight, "data", zeros.to("meta")), "foreach": lambda: torch._foreach_mul_([weight], 2.0),
    }
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"fc1 is frozen, its weight stored as mxfp8\(fp8_dtype=e4m3\): a weight written into it would never be read"):
        writes[write]()
    weight.requires_grad_(False)  # writes no value
    assert torch.equal(compiled(x3()), expected)


def test_frozen_checkpoint_loads_into_a_frozen_model():
    compiled = inference_model(mlp(), FAMILIES["mxfp8"]())
    graphquant.freeze(compiled)
    other = inference_model(models.seeded(models.MLP(), seed=1).to(torch.bfloat16), FAMILIES["mxfp8"]())
    graphquant.freeze(other)
    other.load_state_dict(compiled.state_dict())
    with torch.no_grad():
        assert torch.equal(other(x3()), compiled(x3()))


def test_a_checkpoint_of_another_recipe_or_shape_is_refused(tmp_path):
    frozen = inference_model(mlp(), FAMILIES["tensorwise"]())
    graphquant.freeze(frozen)
    state = frozen.state_dict()

    with pytest.raises(RuntimeError, match=r"fc1 is frozen as mxfp8\(fp8_dtype=e4m3\).*is fp8_current\(fp8_dtype=e4m3\)"):
        graphquant.freeze(inference_model(mlp(), FAMILIES["mxfp8"]()), state_dict=state)
    e5m2 = graphquant.CustomRecipe(lambda role: graphquant.Float8CurrentScalingQuantizer(fp8_dtype="e5m2"))
    with pytest.raises(RuntimeError, match=r"fc1 is frozen as fp8_current\(fp8_dtype=e5m2\)"):
        graphquant.freeze(inference_model(mlp(), e5m2), state_dict=state)
    with pytest.raises(RuntimeError, match=r"fc1 is frozen as .* of shape \(256, 64\).* of shape \(128, 64\)"):
        graphquant.freeze(inference_model(mlp(hidden=256), FAMILIES["tensorwise"]()), state_dict=state)
    tampered = dict(state) | {"_orig_mod.fc2.weight_codes": state["_orig_mod.fc2.weight_codes"].float()}
    with pytest.raises(RuntimeError, match=r"fc2.weight_codes is torch.float32 of shape \(64, 128\), where the format stores torch.float8_e4m3fn"):
        graphquant.freeze(inference_model(mlp(), FAMILIES["tensorwise"]()), state_dict=tampered)
    with pytest.raises(RuntimeError, match=r"high-precision fc1.weight"):
        graphquant.freeze(inference_model(mlp(), FAMILIES["tensorwise"]()), state_dict=mlp().state_dict())


def test_a_checkpoint_a_frozen_model_refuses_changes_nothing_in_it():
    """load_state_dict of a plain (high-precision) checkpoint into a frozen model is refused by its
    stored weights, but torch had copied the tensors of the modules before them (the embedding,
    the norms) already: a server that caught the error kept serving that mix. The refusal comes
    before any tensor is copied now."""
    model = models.seeded(models.TinyLM()).to(torch.bfloat16)
    compiled = graphquant.freeze(inference_model(model, FAMILIES["tensorwise"]()))
    before = {name: t.clone() for name, t in compiled.state_dict().items()}
    plain = {"_orig_mod." + name: t for name, t in models.seeded(models.TinyLM(), seed=1).to(torch.bfloat16).state_dict().items()}
    with pytest.raises(RuntimeError, match=r"layers.0.mlp.down_proj is frozen as fp8_current.*holds a high-precision"):
        compiled.load_state_dict(plain)
    assert all(torch.equal(t, before[name]) for name, t in compiled.state_dict().items())


def test_a_frozen_checkpoint_loaded_into_an_unfrozen_model_says_to_load_it_through_freeze():
    """torch listed the stored weights' entries as unexpected and the weights as missing, naming
    no way to load them; the model is left as it was, and freeze(state_dict=...) loads them."""
    frozen = graphquant.freeze(inference_model(models.seeded(models.TinyLM()).to(torch.bfloat16), FAMILIES["tensorwise"]()))
    compiled = inference_model(models.seeded(models.TinyLM(), seed=1).to(torch.bfloat16), FAMILIES["tensorwise"]())
    before = {name: t.clone() for name, t in compiled.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"for TinyLM: this is a frozen model's checkpoint \(layers.0.attn.q_proj and others .*"
                                           r"load it with graphquant.freeze\(compiled, state_dict=checkpoint\)"):
        compiled.load_state_dict(frozen.state_dict())
    assert all(torch.equal(t, before[name]) for name, t in compiled.state_dict().items())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tied head kept, as in the frozen model
        graphquant.freeze(compiled, state_dict=frozen.state_dict())
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(compiled(ids), frozen(ids))


@pytest.mark.parametrize("given, said", [("frozen.pt", "str 'frozen.pt'"), ([1, 2], r"list \[1, 2\]"), (42, "int 42")])
def test_a_state_dict_that_is_no_mapping_is_refused_saying_what_it_takes(given, said):
    """A checkpoint's path (or anything else) failed in dict()'s conversion, naming nothing."""
    compiled = inference_model(mlp(), FAMILIES["mxfp8"]())
    with pytest.raises(TypeError, match=r"graphquant.freeze: state_dict takes a mapping of names to tensors.*"
                                        r"torch.load\(path, weights_only=True\).*; got " + said):
        graphquant.freeze(compiled, state_dict=given)
    graphquant.freeze(compiled)  # left as it was


def test_freeze_refuses_what_it_cannot_freeze():
    with pytest.raises(ValueError, match=r"mode='inference'.*this one: mode=None"):
        graphquant.freeze(graphquant.compile(mlp(), FAMILIES["tensorwise"](), backend="aot_eager"))
    with pytest.raises(TypeError, match=r"takes the module graphquant.compile.*got MLP"):
        graphquant.freeze(mlp())
    with pytest.raises(ValueError, match=r"fc1.s weight format fp8_delayed.*\(delayed scaling\)"):
        graphquant.freeze(inference_model(mlp(), recipes.delayed_scaling()))
    with torch.device("meta"):
        skeleton = models.MLP()
    with pytest.raises(ValueError, match=r"fc1's weight is on the meta device.*state_dict="):
        graphquant.freeze(inference_model(skeleton, FAMILIES["tensorwise"]()))
    stochastic = graphquant.CustomRecipe(lambda role: graphquant.NVFP4Quantizer(stochastic_rounding=True))
    with pytest.raises(ValueError, match=r"fc1's weight format .*stochastic_rounding=True.* rounds stochastically"):
        graphquant.freeze(inference_model(mlp(), stochastic))


def test_a_refused_freeze_leaves_every_linear_as_it_was():
    """fc2's weight keeps delayed-scaling state, which freeze refuses: fc1, checked first, is not frozen either."""
    def factory(role):
        if role.name == "fc2" and role.tensor_type == "weight":
            return graphquant.Float8DelayedScalingQuantizer()
        return graphquant.Float8CurrentScalingQuantizer()

    model = mlp()
    with pytest.raises(ValueError, match=r"fc2.s weight format fp8_delayed"):
        graphquant.freeze(inference_model(model, graphquant.CustomRecipe(factory)))
    assert type(model.fc1) is torch.nn.Linear and type(model.fc2) is torch.nn.Linear


@pytest.mark.parametrize("checkpoint", ["plain weights", "another recipe's", "another shape's", "missing a bias"])
def test_a_refused_checkpoint_leaves_the_model_as_it_was(checkpoint):
    """freeze replaced every linear by one with room for its stored weight, then the load refused
    the checkpoint: the model was left frozen on empty memory (NaN or garbage outputs, and a
    freeze(model) after it kept them). A checkpoint a frozen linear refuses is refused before any
    linear is replaced, and a load failing otherwise puts them back."""
    recipe = FAMILIES["rowwise" if checkpoint == "missing a bias" else "tensorwise"]()
    source = inference_model(mlp(hidden=256 if checkpoint == "another shape's" else 128), recipe)
    if checkpoint != "plain weights":
        graphquant.freeze(source)
    state = {key: value for key, value in source.state_dict().items() if key != "_orig_mod.fc2.bias"}
    model = mlp()
    compiled = inference_model(model, FAMILIES["rowwise"]())
    with torch.no_grad():
        expected = compiled(x3())
        with pytest.raises(RuntimeError, match="Missing key.*fc2.bias" if checkpoint == "missing a bias" else "graphquant: fc1 is frozen as"):
            graphquant.freeze(compiled, state_dict=state)
        assert type(model.fc1) is torch.nn.Linear and type(model.fc2) is torch.nn.Linear
        assert torch.equal(compiled(x3()), expected)
        graphquant.freeze(compiled)
        assert torch.equal(compiled(x3()), expected)


def test_a_meta_model_whose_buffers_no_checkpoint_holds_is_refused_before_freezing():
    """A rotary embedding's inv_freq is a non-persistent buffer: built on the meta device it stays
    there, since no checkpoint holds it, and the first call would fail deep in the graph."""
    class Rotary(models.MLP):
        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", torch.ones(8), persistent=False)

    compiled = inference_model(models.seeded(Rotary()), FAMILIES["tensorwise"]())
    graphquant.freeze(compiled)
    with torch.device("meta"):
        skeleton = Rotary()
    with pytest.raises(ValueError, match=r"inv_freq are on the meta device and no checkpoint holds them"):
        graphquant.freeze(inference_model(skeleton, FAMILIES["tensorwise"]()), state_dict=compiled.state_dict())
    assert type(skeleton.fc1) is torch.nn.Linear


@pytest.mark.parametrize("x_requires_grad", [True, False])
def test_frozen_model_has_no_backward(x_requires_grad):
    """Where the input requires no grad (a data batch), the linears' biases do, and their
    backward failed with autograd's "does not require grad", naming no frozen linear."""
    compiled = inference_model(mlp(torch.float32), FAMILIES["tensorwise"]())
    graphquant.freeze(compiled)
    x = x3(torch.float32).requires_grad_(x_requires_grad)
    with pytest.warns(UserWarning, match="makes no backward"):
        y = compiled(x)
    with pytest.raises(RuntimeError, match=r"backward through fc\d#0, whose weight graphquant.freeze stored quantized.*no backward"):
        y.sum().backward()


def test_frozen_linear_runs_only_in_its_compiled_model():
    compiled = inference_model(mlp(), FAMILIES["tensorwise"]())
    graphquant.freeze(compiled)
    with pytest.raises(RuntimeError, match=r"fc1 is a frozen linear .* runs only inside the graphquant.compile'd model"):
        compiled._orig_mod(x3())
    with pytest.raises(graphquant.PlanError, match=r"fc1#0 \(linear\) weight: stored frozen as fp8_current.*recipe gives this slot mxfp8"):
        with torch.no_grad():
            inference_model(compiled._orig_mod, FAMILIES["mxfp8"]())(x3())


def test_tied_weight_stays_high_precision():
    model = models.seeded(models.TinyLM()).to(torch.bfloat16)
    compiled = inference_model(model, FAMILIES["mxfp8"]())
    with pytest.warns(UserWarning, match=r"keeps 1 nn.Linear module\(s\) as they are \(lm_head: its weight is tied to embed.weight, which needs it\)"):
        graphquant.freeze(compiled)
    assert type(model.lm_head) is torch.nn.Linear
    assert isinstance(model.layers[0].mlp.down_proj, graphquant.FrozenLinear)


def test_a_frozen_checkpoint_that_saves_a_tied_weight_once_loads():
    """transformers' save_pretrained and safetensors save a tied weight once (the embedding's, not
    the LM head's): loading such a frozen checkpoint failed on the head's missing key. The head
    takes the entry of the weight it shares, and the reloaded model gives the same outputs."""
    model = models.seeded(models.TinyLM()).to(torch.bfloat16)
    compiled = inference_model(model, FAMILIES["mxfp8"]())
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tied head stays as it is, with a warning
        graphquant.freeze(compiled)
        with torch.no_grad():
            expected = compiled(ids)
        saved = {name: t for name, t in model.state_dict().items() if name != "lm_head.weight"}
        skeleton = models.seeded(models.TinyLM(), seed=1).to(torch.bfloat16)
        reloaded = graphquant.freeze(inference_model(skeleton, FAMILIES["mxfp8"]()), state_dict=saved)
        with torch.no_grad():
            assert torch.equal(reloaded(ids), expected)
    assert skeleton.lm_head.weight is skeleton.embed.weight


def test_a_module_registered_under_several_names_is_frozen_in_each_place():
    """A block shared by several places (nn.ModuleList([block] * n), as a universal transformer
    repeats one layer) or a linear under a second attribute holds its weight under several names,
    but no other module reads it: freeze kept such linears in high precision as weights "tied to
    layers.1.mlp.fc1.weight, which needs it". One FrozenLinear now takes every place of its
    linear, computing the unfrozen bits, and its checkpoint loads."""
    def shared():
        model = models.seeded(models.MLPStack(n_layers=1)).to(torch.bfloat16)
        model.layers.append(model.layers[0])
        model.layers[0].mlp.again = model.layers[0].mlp.fc2
        return model

    model = shared()
    compiled = inference_model(model, FAMILIES["mxfp8"]())
    with torch.no_grad():
        expected = compiled(x3())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graphquant.freeze(compiled)
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert model.layers[0].mlp.again is model.layers[1].mlp.fc2
    with torch.no_grad():
        assert torch.equal(compiled(x3()), expected)
    reloaded = graphquant.freeze(inference_model(shared(), FAMILIES["mxfp8"]()), state_dict=model.state_dict())
    with torch.no_grad():
        assert torch.equal(reloaded(x3()), expected)


@pytest.mark.parametrize("family", ["rowwise", "nvfp4"])
def test_a_frozen_model_called_on_no_rows_gives_an_empty_output(family):
    """An empty call keeps its product in high precision, which reads none of the weight: its plan
    was refused for the weight's stored format ("the recipe gives this slot identity()"), and NVFP4's
    packed codes, read as high-precision values, failed the product's shapes."""
    model = torch.nn.Sequential(models.seeded(torch.nn.Linear(64, 128))).to(torch.bfloat16)
    compiled = inference_model(model, FAMILIES[family]())
    with torch.no_grad():
        before = compiled(x3())
        graphquant.freeze(compiled)
        assert compiled(x3()[:0]).shape == (0, 32, 128) and torch.equal(compiled(x3()), before)


def test_freezing_a_model_that_is_an_nn_linear_keeps_it_saying_why():
    """It failed in torch's set_submodule ("Cannot set the submodule without a target name!")."""
    compiled = inference_model(models.seeded(torch.nn.Linear(64, 128)).to(torch.bfloat16), zoo.recipe("rowwise"))
    with torch.no_grad():
        compiled(x3())
    with pytest.warns(UserWarning, match=r"keeps 1 nn.Linear module\(s\) as they are \(: the compiled model itself"):
        graphquant.freeze(compiled)


class TiedHeadOnly(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(256, 64), torch.nn.Linear(64, 256, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.embed(ids))


def test_a_model_whose_one_linear_is_a_tied_head_is_said_to_have_none_freeze_can_store():
    """GPT-2's case: freeze said it found no nn.Linear, then named lm_head, an nn.Linear, as kept
    because its weight "is read other than by its own forward" rather than because it is tied."""
    compiled = inference_model(models.seeded(TiedHeadOnly()), FAMILIES["mxfp8"]())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphquant.freeze(compiled)
    said = " | ".join(str(w.message) for w in caught)
    assert "found nothing it can store" in said and "head: its weight is tied to embed.weight" in said, said


def test_linear_sites_of_no_nn_linear_are_named_as_left_in_high_precision():
    """transformers' GPT-2 Conv1D computes torch.addmm(bias, x, weight): a linear site that freeze,
    which stores nn.Linear weights, leaves with its high-precision weight (quantized at each call)."""

    class Conv1D(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.bias = torch.nn.Parameter(torch.randn(64, 64) / 8), torch.nn.Parameter(torch.zeros(64))

        def forward(self, x):
            return torch.addmm(self.bias, x, self.weight)

    model = torch.nn.Sequential(Conv1D(), torch.nn.Linear(64, 64))
    compiled = inference_model(model, FAMILIES["mxfp8"]())
    with torch.no_grad():
        compiled(torch.randn(32, 64))
    with pytest.warns(UserWarning, match=r"1 linear site\(s\) of this model are neither \(0.linear.0: a transformers Conv1D"):
        graphquant.freeze(compiled)
    assert isinstance(model[1], graphquant.FrozenLinear) and isinstance(model[0].weight, torch.nn.Parameter)


@pytest.mark.parametrize("shape", ["short reduction", "few outputs"])
@pytest.mark.parametrize("family", ["mxfp8", "nvfp4"])
def test_a_linear_its_plan_keeps_in_high_precision_is_frozen_so_before_a_call_too(family, shape):
    """Frozen before the model's first call (README's order), a linear the first call's plan keeps
    in high precision for its shape alone is stored so: a router's 8 outputs were stored in the
    recipe's format, which the plan's high-precision call then multiplied as if they were values
    (outputs 1000x off under MXFP8, a shape error under NVFP4); a short reduction was refused."""
    build, rows, small = SMALL_LINEARS[shape]
    model, x = models.seeded(build()), torch.randn(*rows)
    frozen_first = inference_model(copy.deepcopy(model), FAMILIES[family]())
    compiled = inference_model(model, FAMILIES[family]())
    with torch.no_grad():
        expected = compiled(x)
        graphquant.freeze(compiled)
        graphquant.freeze(frozen_first)
        for frozen in (compiled, frozen_first):
            assert frozen._orig_mod.get_submodule(small).weight_format == "identity()"
            assert all(map(torch.equal, torch.utils._pytree.tree_leaves(frozen(x)), torch.utils._pytree.tree_leaves(expected)))


def test_a_stored_format_a_call_does_not_run_is_refused_not_multiplied(monkeypatch):
    """Should a linear be stored in a format its call's plan does not run (here: freeze made to store
    the router as the recipe says, as it did), the call refuses rather than multiply the codes as
    values."""
    from graphquant.passes.plan import Planner, PlanError

    monkeypatch.setattr(Planner, "keeps_linear_in_high_precision", lambda self, name, shape: False)
    compiled = inference_model(models.seeded(Routed()), FAMILIES["mxfp8"]())
    with torch.no_grad():
        graphquant.freeze(compiled)
        with pytest.raises(PlanError, match=r"router#0 \(linear\) weight: stored frozen as mxfp8.*this call's plan keeps it in high precision"):
            compiled(torch.randn(64, 128))


def test_a_cast_of_a_frozen_model_casts_its_products_not_its_stored_weights():
    linear = models.seeded(torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False)))
    compiled = inference_model(linear, FAMILIES["mxfp8"]())
    x = x3(torch.float32).to(torch.bfloat16)  # bf16 values, given in float32 to the float32 model
    with torch.no_grad():
        compiled(x.float())
        graphquant.freeze(compiled)
        before = compiled(x.float())  # float32: the weight frozen was
        codes = linear[0].weight_codes.clone()
        compiled.to(torch.bfloat16)
        after = compiled(x)
    assert before.dtype == torch.float32 and after.dtype == torch.bfloat16
    assert torch.equal(after, before.to(torch.bfloat16))
    assert torch.equal(linear[0].weight_codes, codes)


def test_a_linear_subclass_with_a_forward_or_parameters_of_its_own_is_kept_as_it_is():
    """A head that scales its logits by a learned parameter (transformers' DoryLMHead) is an
    nn.Linear whose forward a FrozenLinear dropped, with the parameter: the frozen output was a
    third of the per-call one, without a word. Such a subclass keeps its weight, said once."""

    class ScaledHead(torch.nn.Linear):
        def __init__(self):
            super().__init__(64, 128, bias=False)
            self.logit_scale = torch.nn.Parameter(torch.full((128,), 3.0))

        def forward(self, x):
            return super().forward(x) * self.logit_scale

    class ZeroInitialised(torch.nn.Linear):  # a subclass for its initialisation alone is frozen as any linear
        pass

    model = models.seeded(torch.nn.Sequential(ZeroInitialised(64, 64), torch.nn.ReLU(), ScaledHead())).to(torch.bfloat16)
    compiled = inference_model(model, FAMILIES["mxfp8"]())
    with torch.no_grad():
        expected = compiled(x3())
        with pytest.warns(UserWarning, match=r"keeps 1 nn.Linear module\(s\) as they are \(2: a ScaledHead with a forward or state of its own"):
            graphquant.freeze(compiled)
        assert torch.equal(compiled(x3()), expected)
    assert isinstance(model[0], graphquant.FrozenLinear) and type(model[2]) is ScaledHead


def test_a_freeze_after_an_empty_batch_stores_the_recipes_formats():
    """A call of no rows keeps its products in high precision for that call alone: freezing after
    it stored every weight unquantized (identity), and the next call was refused."""
    compiled = inference_model(mlp(), FAMILIES["mxfp8"]())
    with torch.no_grad():
        expected = compiled(x3())
        compiled(x3()[:, :0])
        graphquant.freeze(compiled)
        assert torch.equal(compiled(x3()), expected)
    assert compiled._orig_mod.fc1.weight_format.startswith("mxfp8")


def test_a_second_freeze_says_nothing_false():
    """README has freeze called again after model.to(device): it said nothing was frozen and that
    every linear site kept its high-precision weight."""
    compiled = inference_model(mlp(), FAMILIES["mxfp8"]())
    with torch.no_grad():
        expected = compiled(x3())
        graphquant.freeze(compiled)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="graphquant")
            graphquant.freeze(compiled)
        assert torch.equal(compiled(x3()), expected)


def test_a_frozen_linears_weight_is_a_stand_in_of_its_shape_and_dtype():
    """Model code reads a linear's weight.dtype (T5's feed-forward casts to it): a FrozenLinear had
    no weight. Its stand-in has the weight's shape and dtype on the meta device: no values to
    read, so that code reading them fails rather than compute with them."""
    compiled = inference_model(mlp(), FAMILIES["mxfp8"]())
    graphquant.freeze(compiled)
    weight = compiled._orig_mod.fc1.weight
    assert (weight.shape, weight.dtype, weight.device) == ((128, 64), torch.bfloat16, torch.device("meta"))
    assert "fc1.weight" not in compiled._orig_mod.state_dict()


def test_linears_whose_weight_other_code_reads_or_that_have_hooks_are_kept():
    """nn.MultiheadAttention's one call reads its out_proj's weight, and a model may multiply a
    module's weight itself: a frozen one gave that code a stand-in. A linear with hooks lost them.
    freeze keeps all three, saying why, and the outputs are the per-call ones."""

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = torch.nn.MultiheadAttention(64, 2, batch_first=True)
            self.fc, self.hooked, self.out = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
            self.hooked.register_forward_hook(lambda module, args, out: out * 3)

        def forward(self, x):
            h = self.attention(x, x, x, need_weights=False)[0]
            h = self.hooked(self.fc(h)) + torch.nn.functional.linear(h, self.fc.weight)
            return self.out(h)

    model = models.seeded(Model()).to(torch.bfloat16)
    compiled = inference_model(model, FAMILIES["mxfp8"]())
    with torch.no_grad():
        expected = compiled(x3())
        with pytest.warns(UserWarning, match=r"keeps 3 nn.Linear module\(s\) as they are \(attention.out_proj: nn.MultiheadAttention's "
                                             r"forward reads its weight itself, not through the linear's forward; fc: its weight is "
                                             r"read other than by its own forward; hooked: hooks"):
            graphquant.freeze(compiled)
        assert torch.equal(compiled(x3()), expected)
    assert isinstance(model.out, graphquant.FrozenLinear) and type(model.fc) is torch.nn.Linear


class ReadsItsWeight(torch.nn.Module):
    """fc's weight multiplied by the model's own code, as a tied head's often is."""

    def __init__(self):
        super().__init__()
        self.fc, self.out = torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)

    def forward(self, x):
        return self.out(torch.nn.functional.gelu(torch.nn.functional.linear(x, self.fc.weight, self.fc.bias)))


class WithAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention, self.fc = torch.nn.MultiheadAttention(64, 2, batch_first=True), torch.nn.Linear(64, 128)

    def forward(self, x):
        return self.fc(self.attention(x, x, x, need_weights=False)[0])


def test_a_weight_the_model_reads_itself_frozen_before_the_first_call_fails_naming_the_linear():
    """Frozen before any graph showed freeze that the model multiplies fc's weight itself, fc was
    stored, and the first call failed inside Dynamo on a device mismatch (cpu and meta) naming
    neither graphquant nor fc. The graph that reads the stand-in's values is refused, naming fc
    and what to do."""
    compiled = inference_model(models.seeded(ReadsItsWeight()).to(torch.bfloat16), FAMILIES["mxfp8"]())
    graphquant.freeze(compiled)
    with torch.no_grad(), pytest.raises(graphquant.PlanError, match=r"reads the weight of fc, which graphquant.freeze stored "
                                                                      r"quantized.*call it once, then graphquant.freeze it"):
        compiled(x3())


def test_multihead_attentions_out_proj_is_kept_before_the_first_call_too():
    """nn.MultiheadAttention's forward reads out_proj's weight itself: freeze kept out_proj only once
    a graph had shown it so, and frozen before the first call the model failed at that call."""
    expected = inference_model(models.seeded(WithAttention()).to(torch.bfloat16), FAMILIES["mxfp8"]())
    model = models.seeded(WithAttention()).to(torch.bfloat16)
    compiled = inference_model(model, FAMILIES["mxfp8"]())
    with pytest.warns(UserWarning, match=r"keeps 1 nn.Linear module\(s\) as they are \(attention.out_proj: nn.MultiheadAttention's"):
        graphquant.freeze(compiled)
    assert type(model.attention.out_proj) is not graphquant.FrozenLinear and isinstance(model.fc, graphquant.FrozenLinear)
    with torch.no_grad():
        assert torch.equal(compiled(x3()), expected(x3()))


def test_model_code_that_places_its_input_by_a_frozen_weights_device_runs():
    """x.to(self.fc1.weight.device) (transformers' ESM contact head, Gemma's) failed after freeze
    ("unknown device type for autocast"): the stand-in was on the meta device. In compiled code
    it is on the stored weight's, and the graph drops it."""

    class Placing(models.MLP):
        def forward(self, x):
            return super().forward(x.to(self.fc1.weight.device))

    expected = inference_model(models.seeded(Placing()).to(torch.bfloat16), FAMILIES["mxfp8"]())
    keep = KeepGraphs()
    compiled = inference_model(models.seeded(Placing()).to(torch.bfloat16), FAMILIES["mxfp8"](), backend=keep.backend)
    with torch.no_grad():
        compiled(x3())
        graphquant.freeze(compiled)
        assert torch.equal(compiled(x3()), expected(x3()))
    assert not any("frozen_weight_stand_in" in str(node.target) for node in keep.graphs[-1].graph.nodes)
    assert compiled._orig_mod.fc1.weight.device == torch.device("meta")  # eagerly, the write-refusing stand-in


@pytest.mark.parametrize("model_class", [WithAttention, ReadsItsWeight], ids=["multihead attention", "weight read by F.linear"])
def test_a_frozen_checkpoint_of_a_model_that_kept_a_linear_loads_on_the_meta_device(model_class, tmp_path):
    """A model frozen after a call keeps a linear whose weight other code reads, and its checkpoint
    holds that high-precision weight: freeze(state_dict=...) on a model built on the meta device
    refused it ("save the frozen model's state_dict", which it was). A frozen checkpoint's
    high-precision weight is loaded into the linear, kept as the frozen model kept it; a plain
    checkpoint, with no stored weight, is still refused."""
    source = inference_model(models.seeded(model_class()).to(torch.bfloat16), FAMILIES["mxfp8"]())
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the kept linear, said as it is kept
        source(x3())
        plain = {name: t.clone() for name, t in source.state_dict().items()}
        graphquant.freeze(source)
        expected = source(x3())
    torch.save(source.state_dict(), tmp_path / "frozen.pt")
    with torch.device("meta"):
        skeleton = model_class().to(torch.bfloat16)
    kept = "attention.out_proj: nn.MultiheadAttention's" if model_class is WithAttention else "fc: the frozen checkpoint holds its high-precision weight"
    with pytest.warns(UserWarning, match=f"as they are \\({kept}"):
        reloaded = graphquant.freeze(inference_model(skeleton, FAMILIES["mxfp8"]()), state_dict=torch.load(tmp_path / "frozen.pt", weights_only=True))
    with torch.no_grad():
        assert torch.equal(reloaded(x3()), expected)
    with torch.device("meta"):
        skeleton = model_class().to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"holds a high-precision (fc|out)\.weight instead"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graphquant.freeze(inference_model(skeleton, FAMILIES["mxfp8"]()), state_dict=plain)
