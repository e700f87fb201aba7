"""graphquant.compile(model, recipe) computes what the eager reference of the recipe computes.

The reference (tests/reference.py) re-derives every GEMM of the model, quantizes its operands with
graphquant.quantizers in the directions of the design's table, and multiplies them in float64. It
runs *teacher-forced*: each of its GEMMs takes the result of the compiled model's matching
graphquant::gemm call after checking that it lies within the fp32 accumulation bound
(K + 4) 2^-24 sum|a||b| of its own float64 product (reference.gemm_bound). Without that, a GEMM
result that lands exactly on a rounding tie of the next quantizer (common: products of
low-precision values are short binary fractions, e.g. causal-attention rows with one or two
non-zero probabilities) rounds one way in float64 and the other way after fp32 accumulation, and
the two runs legitimately part by one FP8 step; see test_float64_chain_can_split_at_ties. With
teacher forcing both sides see the same bits at every quantizer, so outputs and gradients must
then agree to the order of fp32 gradient additions (reference.ORDER_SLACK).
"""

import copy

import models
import pytest
import torch
from reference import (  # noqa: F401  (fresh_dynamo is an autouse fixture)
    INDUCTOR_SLACK,
    STREAMS_PER_STEP,
    GemmTape,
    Reference,
    assert_same_results,
    forward_backward,
    fresh_dynamo,
)

import graphquant
from graphquant import factories, recipes, zoo
from graphquant.quantizers import HybridQuantizer, IdentityQuantizer


def seed_demo_factory(role):
    """The fine-grained recipe guide's example (reference/seeds/000): demo.fc1 has MXFP8 fprop,
    NVFP4 dgrad (weight columnwise from the dequantized MXFP8, grad_output rowwise NVFP4 with
    stochastic rounding) and a high-precision wgrad on the original tensors; demo.fc2 is all
    high precision; every other module is MXFP8."""
    if role is not None and role.name == "demo.fc1":
        if role.tensor_type == "input":
            return HybridQuantizer(
                rowwise_quantizer=factories.mxfp8_factory(role), columnwise_quantizer=IdentityQuantizer(), columnwise_source="original"
            )
        if role.tensor_type == "weight":
            return HybridQuantizer(
                rowwise_quantizer=factories.mxfp8_factory(role),
                columnwise_quantizer=factories.nvfp4_factory(role),
                columnwise_source="rowwise_dequantized",
            )
        if role.tensor_type == "grad_output":
            return HybridQuantizer(
                rowwise_quantizer=factories.nvfp4_factory(role), columnwise_quantizer=IdentityQuantizer(), columnwise_source="original"
            )
    if role is not None and role.name == "demo.fc2":
        return IdentityQuantizer()
    return factories.mxfp8_factory(role)


RECIPES = {
    "mxfp8": recipes.mxfp8_block_scaling,
    "nvfp4": recipes.nvfp4_block_scaling,  # RHT on wgrad operands, 2D weights, SR on grad_output
    "current": recipes.current_scaling,  # per-tensor E4M3, E5M2 grad_output
    "block": recipes.float8_block_scaling,  # 1x128 activations / gradients, 128x128 weights
    "hybrid_zoo": lambda: zoo.recipe("mxfp8_fwd_high_precision_bwd"),  # Identity wgrad of rowwise_dequantized
    "seed_demo": lambda: graphquant.CustomRecipe(seed_demo_factory),
}


def x3(batch=2, seq=32, dim=64, seed=7):
    return torch.randn(batch, seq, dim, generator=torch.Generator().manual_seed(seed))


def ids(batch=2, seq=32, vocab=128, seed=8):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


# (model, input). NVFP4's default factory gives every non-weight role RHT, so the dgrad of an
# activation x activation matmul (grad_output.rowwise x other.columnwise) is rejected; NVFP4 runs
# the SDPA variants (see test_errors for that rejection). FP8 blockwise needs seq % 128 == 0 in
# matmul attention and head_dim % 128 == 0 (its 128-row columnwise blocks must not straddle two
# heads, and the values' columnwise blocks run along head_dim).
MODELS = {
    "mlp": (lambda: models.MLP(), x3),
    "decoder": (lambda: models.DecoderBlock(attention="matmul"), x3),
    "decoder_sdpa": (lambda: models.DecoderBlock(attention="sdpa"), x3),
    "decoder_seq128": (lambda: models.DecoderBlock(dim=256, hidden=128, attention="matmul"), lambda: x3(batch=1, seq=128, dim=256)),
    "tiny_lm": (lambda: models.TinyLM(attention=("matmul",)), ids),
    "tiny_lm_sdpa": (lambda: models.TinyLM(attention=("sdpa",)), ids),
    "shared": (lambda: models.SharedLinear(), x3),
    "functional": (lambda: models.Wrapped(models.FunctionalGemms()), x3),
    "einsum": (lambda: models.Attention(kind="einsum"), x3),
    "norm_mlp": (lambda: models.NormMLP(), x3),
    "demo": (lambda: models.Demo(), x3),
}

CASES = [
    ("mxfp8", "mlp"),
    ("mxfp8", "tiny_lm"),
    ("mxfp8", "shared"),
    ("mxfp8", "functional"),
    ("mxfp8", "einsum"),
    ("nvfp4", "mlp"),
    ("nvfp4", "decoder_sdpa"),
    ("nvfp4", "tiny_lm_sdpa"),
    ("current", "mlp"),
    ("current", "decoder"),
    ("current", "functional"),
    ("block", "mlp"),
    ("block", "decoder_seq128"),
    ("hybrid_zoo", "mlp"),
    ("hybrid_zoo", "tiny_lm"),
    ("seed_demo", "demo"),
]


def compiled_and_reference(recipe_name, model_name, init_seed=0, **compile_kwargs):
    make_model, make_input = MODELS[model_name]
    model = models.seeded(make_model(), init_seed)
    ref_model = copy.deepcopy(model)
    tape = GemmTape()
    recipe = RECIPES[recipe_name]()
    compiled = graphquant.compile(model, recipe, backend=tape.backend, fullgraph=True, **compile_kwargs)
    reference = Reference(ref_model, recipe, seed=compile_kwargs.get("seed", 0), tape=tape)
    return model, compiled, ref_model, reference, tape, make_input


@pytest.mark.parametrize("recipe_name, model_name", CASES, ids=[f"{r}-{m}" for r, m in CASES])
def test_outputs_and_gradients_match_reference(recipe_name, model_name):
    model, compiled, ref_model, reference, tape, make_input = compiled_and_reference(recipe_name, model_name)
    x = make_input()
    actual = forward_backward(compiled, model, x)
    expected = forward_backward(reference, ref_model, x)
    tape.assert_all_taken()
    assert len(reference.sites) > 0
    assert_same_results(actual, expected, what=f"{recipe_name}/{model_name}: ")


def test_stochastic_rounding_streams_follow_the_step_counter():
    """NVFP4 (SR on grad_output): two steps on one compiled model; each matches a reference that
    uses offset = step * STREAMS_PER_STEP + 3 * gemm + tensor, with step 1 then 2. The two steps'
    gradients differ (same input, same weights: only the random stream changed), and a reference
    with another seed fails, so SR is really exercised."""
    assert graphquant.quantizers.STREAMS_PER_STEP == STREAMS_PER_STEP
    model, compiled, ref_model, reference, tape, make_input = compiled_and_reference("nvfp4", "mlp", init_seed=1)
    x = make_input()
    steps = []
    for _ in range(2):
        tape.clear()
        actual = forward_backward(compiled, model, x)
        expected = forward_backward(reference, ref_model, x)
        tape.assert_all_taken()
        assert_same_results(actual, expected, what=f"step {reference.step}: ")
        steps.append(actual)
    assert not torch.equal(steps[0]["fc1.weight.grad"], steps[1]["fc1.weight.grad"])
    assert torch.equal(steps[0]["output"], steps[1]["output"])  # the forward has no SR

    wrong_seed = Reference(copy.deepcopy(model), RECIPES["nvfp4"](), seed=1, tape=tape)
    wrong_seed.step = 2  # its next call is step 3, like the compiled model's, with seed 1 instead of 0
    tape.clear()
    forward_backward(compiled, model, x)
    with pytest.raises(AssertionError, match="no GEMM of the compiled model matches"):
        forward_backward(wrong_seed, wrong_seed.model, x)


def test_backward_uses_the_stochastic_rounding_step_of_its_forward():
    """Two forwards, then one backward through both (two micro-batches' losses summed): each
    backward quantizes grad_output with its own forward's step, so the gradients equal those of
    the same two steps run forward-backward one after the other."""

    def run(together):
        torch._dynamo.reset()
        model = models.seeded(models.MLP(), 5)
        compiled = graphquant.compile(model, recipes.nvfp4_block_scaling(), backend="aot_eager")
        first, second = x3(seed=1), x3(seed=2)
        if together:
            (compiled(first).sum() + compiled(second).sum()).backward()
        else:
            compiled(first).sum().backward()
            compiled(second).sum().backward()
        return {name: p.grad for name, p in model.named_parameters()}

    together, one_by_one = run(together=True), run(together=False)
    for name, grad in one_by_one.items():
        assert torch.equal(together[name], grad), name


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_interleaved_backwards_use_the_step_of_their_own_forward(backend):
    """Forward A, forward B, backward A, backward B (a pipeline schedule's order): each backward
    rounds grad_output with its own forward's step, so both gradients equal those of forward A,
    backward A, forward B, backward B bit for bit. A's input at B's step gives other gradients
    (NVFP4's forward has no SR: only the step differs), so a backward that took the step of
    another forward would show."""

    def run(first, second, interleaved):
        torch._dynamo.reset()
        model = models.seeded(models.MLP(), 5)
        compiled = graphquant.compile(model, recipes.nvfp4_block_scaling(), backend=backend)
        grads = []

        def backward(y):
            y.sum().backward()
            grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
            model.zero_grad(set_to_none=True)

        if interleaved:
            y_first, y_second = compiled(first), compiled(second)
            backward(y_first)
            backward(y_second)
        else:
            backward(compiled(first))
            backward(compiled(second))
        return grads

    a, b = x3(seed=1), x3(seed=2)
    interleaved, one_after_another, a_second = run(a, b, True), run(a, b, False), run(b, a, False)[1]
    for step, (actual, expected) in enumerate(zip(interleaved, one_after_another), start=1):
        for name, grad in expected.items():
            assert torch.equal(actual[name], grad), (step, name)
    assert not torch.equal(a_second["fc1.weight"], one_after_another[0]["fc1.weight"])


def test_same_seed_is_bit_for_bit_reproducible():
    """Two compiles with the same seed give the same bits (SR included); the test above shows a
    different seed gives different ones."""
    model = models.seeded(models.MLP(), 3)
    x = x3()
    runs = []
    for _ in range(2):
        torch._dynamo.reset()
        m = copy.deepcopy(model)
        runs.append(forward_backward(graphquant.compile(m, recipes.nvfp4_block_scaling(), backend="aot_eager", seed=5), m, x))
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


def test_reference_detects_a_different_recipe():
    """The comparison can fail: the MXFP8-compiled model against a current-scaling reference."""
    model, compiled, ref_model, _, tape, make_input = compiled_and_reference("mxfp8", "mlp")
    x = make_input()
    forward_backward(compiled, model, x)
    wrong = Reference(ref_model, recipes.current_scaling(), tape=tape)
    with pytest.raises(AssertionError, match="fc1#0 fprop: no GEMM of the compiled model matches"):
        forward_backward(wrong, ref_model, x)


def test_float64_chain_can_split_at_ties():
    """Why the reference is teacher-forced: without it, the float64 reference and the compiled
    model (fp32 GEMMs) can round a tie differently in a later quantizer. Attention output rows
    with few non-zero probabilities are short binary fractions; with current scaling, values of
    o_proj's input land exactly on FP8 midpoints (e.g. 21.0 between 20 and 22). This documents the
    effect on one case where it happens (the per-GEMM checks above are immune to it)."""
    model, compiled, ref_model, reference, _, make_input = compiled_and_reference("current", "decoder")
    free_reference = Reference(copy.deepcopy(ref_model), RECIPES["current"]())  # no tape
    x = make_input()
    actual = forward_backward(compiled, model, x)
    forced = forward_backward(reference, ref_model, x)
    free = forward_backward(free_reference, free_reference.model, x)
    assert_same_results(actual, forced)
    worst = max(((actual[k] - free[k]).abs().max() / free[k].abs().max()).item() for k in free)
    assert worst > 1e-4, "expected at least one tie to round differently (fp32 vs float64 accumulation)"


# -- Inductor ------------------------------------------------------------------------------------
# Inductor compiles C++ kernels, seconds each on a cold cache: three small cases, two of them
# slow. MXFP8 and current scaling are traced into the graph (Inductor fuses them, here with
# RMSNorm); NVFP4 runs as custom ops and takes the random stream's state as a graph input.
INDUCTOR_CASES = [
    pytest.param("mxfp8", "norm_mlp", id="mxfp8-norm_mlp"),
    pytest.param("current", "mlp", id="current-mlp", marks=pytest.mark.slow),
    pytest.param("nvfp4", "mlp", id="nvfp4-mlp", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("recipe_name, model_name", INDUCTOR_CASES)
def test_inductor_matches_aot_eager_and_reference(recipe_name, model_name):
    model, compiled, ref_model, reference, tape, make_input = compiled_and_reference(recipe_name, model_name)
    x = make_input()
    eager_graph = forward_backward(compiled, model, x)
    expected = forward_backward(reference, ref_model, x)
    tape.assert_all_taken()
    assert_same_results(eager_graph, expected, what="aot_eager: ")

    torch._dynamo.reset()
    inductor_model = copy.deepcopy(ref_model)
    inductor = graphquant.compile(inductor_model, RECIPES[recipe_name](), fullgraph=True)  # backend="inductor"
    # Inductor's FX-graph and AOT caches key on the graph, not on the code of graphquant's custom
    # ops: a cache filled before a change to an op's fake (its output strides) replays stale
    # stride assertions. Kernels are still cached (by their source).
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        actual = forward_backward(inductor, inductor_model, x)
    assert_same_results(actual, eager_graph, slack=INDUCTOR_SLACK, what="inductor: ")


def test_tensorwise_linear_of_huge_inputs_is_the_product_by_hand():
    """Inputs near 1e36 give a finite output: the emulated GEMM multiplies the product of the FP8
    codes by one factor, the two scales' product (fp32), as cuBLASLt's alpha does; applied one
    after the other, the input's scale (~2e33) took the product of the codes past fp32's range.
    The codes are multiples of 16 below 2^9, so their sums are exact in fp32 in any order."""
    x = torch.tensor([[(i * 7 + j * 3) % 9 - 4 for j in range(32)] for i in range(4)], dtype=torch.float32) * 0.25e36
    linear = torch.nn.Linear(32, 16, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.tensor([[(i * 5 + j) % 9 - 4 for j in range(32)] for i in range(16)]) * 2.0**-6)
    out = graphquant.compile(linear, zoo.recipe("tensorwise"), backend="aot_eager", fullgraph=True)(x)

    quantizer = zoo.tensorwise_factory(None)
    qx, qw = (quantizer(t.detach(), columnwise=False).rowwise for t in (x, linear.weight))
    codes = (qx.data.double() @ qw.data.double().t()).float()
    expected = codes * (qx.scale * qw.scale)
    assert torch.isfinite(expected).all() and expected.abs().max() > 1e35
    assert torch.equal(out, expected)
