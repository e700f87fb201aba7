"""HuggingFace transformers models nobody here wrote, built from a config with random weights.

Each compiles with graphquant in one graph (fullgraph=True: plain torch.compile captures each of
these in one graph too), trains two steps whose outputs and gradients match the eager reference
of the same recipe (tests/reference.py: every GEMM re-derived and quantized with
graphquant.quantizers, teacher-forced by the compiled GEMM results), and names its sites as
``model.named_modules()`` does. Llama also generates under torch.inference_mode.

Models are tiny (hidden 64, 2 layers, vocabulary 256). Dropout is off (GPT-2's default is 0.1),
so the compiled and reference runs see the same values.
"""

import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

import graphquant  # noqa: E402
from graphquant import factories, recipes  # noqa: E402

from reference import (  # noqa: E402,F401  (fresh_dynamo is an autouse fixture)
    GemmTape,
    Reference,
    assert_same_results,
    forward_backward,
    fresh_dynamo,
)

VOCAB = 256


def mxfp8_except_routers_factory(role):
    """MXFP8 everywhere except MoE routers, which stay in high precision (as TE keeps them): a
    router's few output rows (one per expert) cannot tile MXFP8's 32-row columnwise blocks."""
    if role is not None and role.name.endswith((".gate.linear.0", ".shared_expert_gate")):
        return graphquant.IdentityQuantizer()
    return factories.mxfp8_factory(role)


def llama():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, attn_implementation="sdpa", bos_token_id=0, eos_token_id=None,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config)


def gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=2, n_positions=128, attn_implementation="sdpa", bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def mixtral():
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
        attn_implementation="sdpa",
    )
    return transformers.MixtralForCausalLM(config)


def vit():
    config = transformers.ViTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, image_size=32, patch_size=8,
        num_channels=3, num_labels=32, attn_implementation="sdpa",
    )
    return transformers.ViTForImageClassification(config)


def token_ids(batch=2, seq=32, seed=1):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def images(batch=2, seed=1):
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


# name: (model, recipe, input, how to call it, sites that must be in the plan (module_type)).
# ViT runs per-tensor current scaling: its 2 x 17 tokens do not tile MXFP8's 32-row blocks.
CASES = {
    "llama": (llama, lambda: graphquant.CustomRecipe(mxfp8_except_routers_factory), token_ids, lambda m, x: m(x).logits, {
        "model.layers.0.self_attn.q_proj": "linear", "model.layers.1.mlp.down_proj": "linear", "lm_head": "linear",
    }),
    "gpt2": (gpt2, lambda: graphquant.CustomRecipe(mxfp8_except_routers_factory), token_ids, lambda m, x: m(x).logits, {
        # Conv1D computes torch.addmm(bias, x, weight) with weight a Parameter: a linear, named as
        # a functional GEMM of its owner.
        "transformer.h.0.attn.c_attn.linear.0": "linear", "transformer.h.1.mlp.c_proj.linear.0": "linear", "lm_head": "linear",
    }),
    "mixtral": (mixtral, lambda: graphquant.CustomRecipe(mxfp8_except_routers_factory), token_ids, lambda m, x: m(x).logits, {
        "model.layers.0.self_attn.o_proj": "linear", "model.layers.0.mlp.gate.linear.0": "linear", "lm_head": "linear",
    }),
    "vit": (vit, recipes.current_scaling, images, lambda m, x: m(pixel_values=x).logits, {
        "vit.layers.0.attention.q_proj": "linear", "vit.layers.1.mlp.fc2": "linear", "classifier": "linear",
    }),
}


@pytest.mark.parametrize("name", list(CASES))
def test_trains_like_the_eager_reference(name):
    make_model, make_recipe, make_input, call, expected_sites = CASES[name]
    torch.manual_seed(0)
    model = make_model()
    ref_model = copy.deepcopy(model)
    recipe = make_recipe()
    tape = GemmTape()
    compiled = graphquant.compile(model, recipe, backend=tape.backend, fullgraph=True)
    reference = Reference(ref_model, recipe, tape=tape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = make_input()
    before = copy.deepcopy(model.state_dict())
    for step in range(2):
        tape.clear()
        actual = forward_backward(lambda t: call(compiled, t), model, x)
        expected = forward_backward(lambda t: call(reference, t), ref_model, x)
        tape.assert_all_taken()
        assert_same_results(actual, expected, what=f"{name} step {step}: ")
        optimizer.step()
        ref_model.load_state_dict(model.state_dict())  # the reference follows the compiled model's training

    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items()), "the optimizer changed nothing"
    assert len(compiled.graphquant.plans) == 1
    plan = compiled.graphquant.plan
    planned = {g.site.rsplit("#", 1)[0]: g.module_type for g in plan.gemms}
    assert planned == {site_name: kind for site_name, _, kind in reference.sites}
    assert {k: planned.get(k) for k in expected_sites} == expected_sites
    named = {n for n, _ in model.named_modules()}
    assert all(site.rsplit(".linear.", 1)[0] in named for site in planned), sorted(set(planned) - named)
    assert all(g.bucket == "emulated" for g in plan.gemms if "identity" not in g.a_format), plan


def test_mixtral_router_stays_high_precision_and_experts_are_not_sites():
    """The factory keeps the router in high precision. transformers runs the experts through its
    own custom op (transformers::grouped_mm_fallback on CPU, float32), which no graph pass can
    see into: those products stay in high precision and are not listed as sites."""
    torch.manual_seed(0)
    compiled = graphquant.compile(mixtral(), graphquant.CustomRecipe(mxfp8_except_routers_factory), backend="aot_eager", fullgraph=True)
    compiled(token_ids())
    formats = {(g.site, g.gemm): (g.a_format, g.b_format) for g in compiled.graphquant.plan.gemms}
    assert formats[("model.layers.0.mlp.gate.linear.0#0", "fprop")] == ("identity()", "identity()")
    assert formats[("model.layers.0.self_attn.q_proj#0", "fprop")] == ("mxfp8(fp8_dtype=e4m3)", "mxfp8(fp8_dtype=e4m3)")
    assert not any("experts" in site for site, _ in formats)


def test_llama_generates_under_inference_mode():
    """generate() with the compiled forward under torch.inference_mode: every plan is an
    inference plan (fprop only, quantized), and the first step's scores are the eager reference's
    logits."""
    torch.manual_seed(0)
    model = llama().eval()
    ref_model = copy.deepcopy(model)
    recipe = recipes.mxfp8_block_scaling()
    model.forward = graphquant.compile(model.forward, recipe, backend="aot_eager")
    prompt = token_ids(batch=2, seq=16)
    with torch.inference_mode():
        out = model.generate(prompt, max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
        expected = Reference(ref_model, recipe)(prompt).logits[:, -1]
    assert out.sequences.shape == (2, 22)
    assert torch.equal(out.sequences[:, :16], prompt)
    backend = model.forward.graphquant
    assert len(backend.plans) >= 2  # the prompt, then the decode steps
    for plan in backend.plans:
        assert {g.gemm for g in plan.gemms} == {"fprop"}
        assert all(g.a_format == "mxfp8(fp8_dtype=e4m3)" for g in plan.gemms)
    torch.testing.assert_close(out.scores[0], expected, rtol=0, atol=1e-5 * expected.abs().max().item())


def test_an_encoder_decoders_generate_runs_its_encoder_quantized():
    """transformers' generate runs a T5's encoder through get_encoder(), not the model's forward:
    compiled.generate compiles it too, so its GEMMs are quantized (named from the model's root)
    and its output is not the unquantized encoder's; the encoder keeps its own forward after."""
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=32, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=2,
        relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        feed_forward_proj="relu", attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    plain = copy.deepcopy(model)
    compiled = graphquant.compile(model, recipes.current_scaling(), backend="aot_eager")
    prompt = token_ids(batch=2, seq=32)
    seen = []
    model.encoder.register_forward_hook(lambda module, args, out: seen.append(out.last_hidden_state))
    with torch.inference_mode():
        compiled.generate(prompt, max_new_tokens=3, do_sample=False)
        unquantized = plain.encoder(input_ids=prompt).last_hidden_state
    sites = {g.site for plan in compiled.graphquant.plans for g in plan.gemms}
    assert len({site for site in sites if site.startswith("encoder.")}) == 12  # 2 blocks of q, k, v, o, wi, wo
    assert len(seen) == 1 and not torch.equal(seen[0], unquantized)
    assert "forward" not in model.encoder.__dict__


@pytest.mark.parametrize("cache", ["dynamic", "static, compiled by transformers"])
def test_the_compiled_models_generate_runs_quantized(cache):
    """compiled.generate (the module's own generate, which calls the module, not the compiled
    model) runs each forward through graphquant: the tokens and scores of the compiled forward's
    generate, and the module keeps its own forward after. With a static cache transformers
    compiles the decode step itself (by default on CUDA; _compile_all_devices asks it here), whose
    graph took in graphquant's compiled forward, unquantized: it breaks its graph there now."""
    torch.manual_seed(0)
    model = llama().eval()
    twin = copy.deepcopy(model)
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend="aot_eager")
    twin.forward = graphquant.compile(twin.forward, recipes.mxfp8_block_scaling(), backend="aot_eager")
    prompt = token_ids(batch=2, seq=16)
    kwargs = dict(max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.inference_mode():
        expected = twin.generate(prompt, **kwargs)
        if cache != "dynamic":
            config = transformers.CompileConfig(fullgraph=False, backend="aot_eager")
            config._compile_all_devices = True
            kwargs.update(cache_implementation="static", compile_config=config)
        out = compiled.generate(prompt, **kwargs)
    assert len(compiled.graphquant.plans) >= 2 and "forward" not in model.__dict__
    assert torch.equal(out.sequences, expected.sequences)
    for a, b in zip(out.scores, expected.scores):
        assert torch.equal(a, b)


def test_generate_calls_that_overlap_in_threads_run_every_step_quantized():
    """Two compiled.generate calls of a server's threads, the first ending while the second runs:
    each call put in graphquant's forward and put back what it found when it ended, so the first
    to end took the second's away (its later steps ran unquantized) and the last left graphquant's
    in the module for good. Every step of both runs quantized now, and the module keeps its own."""
    import threading

    torch.manual_seed(0)
    model = llama().eval()
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend="aot_eager", mode="inference")
    prompts = {"first": token_ids(batch=1, seq=8), "second": token_ids(batch=1, seq=8, seed=2)}
    kwargs = dict(do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.inference_mode():
        alone = {name: compiled.generate(prompt, max_new_tokens=4, **kwargs) for name, prompt in prompts.items()}
    second_started, first_ended = threading.Event(), threading.Event()
    calls = {"first": 0, "second": 0}

    class Pacing(transformers.LogitsProcessor):
        """Holds the second call's steps after its first until the first call has ended."""

        def __init__(self, name):
            self.name = name

        def __call__(self, input_ids, scores):
            calls[self.name] += 1
            if self.name == "second" and calls["second"] == 1:
                second_started.set()
                assert first_ended.wait(60)
            if self.name == "first" and calls["first"] == 1:
                assert second_started.wait(60)
            return scores

    out = {}

    def run(name):
        with torch.inference_mode():
            out[name] = compiled.generate(prompts[name], max_new_tokens=4, logits_processor=[Pacing(name)], **kwargs)
        if name == "first":
            first_ended.set()

    threads = [threading.Thread(target=run, args=(name,)) for name in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for name in prompts:
        assert torch.equal(out[name].sequences, alone[name].sequences), name
        for a, b in zip(out[name].scores, alone[name].scores):
            assert torch.equal(a, b), name
    assert "forward" not in model.__dict__


def test_a_thread_calling_the_plain_module_while_another_generates_gets_its_own_forward():
    """generate puts graphquant's forward into the module, which every thread calls: a server's
    other thread calling the plain module meanwhile ran quantized, which it never asked for. It
    gets the module's own forward now, and the generate every step quantized."""
    import threading

    torch.manual_seed(0)
    model = llama().eval()
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend="aot_eager", mode="inference")
    prompt, plain_input = token_ids(batch=1, seq=8), token_ids(batch=1, seq=8, seed=2)
    kwargs = dict(max_new_tokens=3, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with torch.inference_mode():
        plain_expected = model(plain_input).logits
        generated_expected = compiled.generate(prompt, **kwargs)
    plain_ran, plain = threading.Event(), {}

    def call_the_plain_module():
        with torch.inference_mode():
            plain["logits"] = model(plain_input).logits
        plain_ran.set()

    signatures = []

    class Meanwhile(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            signatures.append(inspect.signature(model.forward))  # generate reads it to pass logits_to_keep and position_ids
            if not plain_ran.is_set():
                threading.Thread(target=call_the_plain_module).start()
                assert plain_ran.wait(60)
            return scores

    with torch.inference_mode():
        out = compiled.generate(prompt, logits_processor=[Meanwhile()], **kwargs)
    assert torch.equal(plain["logits"], plain_expected)
    assert signatures and all(signature == inspect.signature(type(model).forward.__get__(model)) for signature in signatures)
    assert torch.equal(out.sequences, generated_expected.sequences)
    for a, b in zip(out.scores, generated_expected.scores):
        assert torch.equal(a, b)
    assert "forward" not in model.__dict__


def test_a_thread_calling_graphquant_models_of_the_module_while_another_generates_runs_them_quantized():
    """While a generate has put graphquant's forward into the module, a call of the graphquant
    model from another thread (a server scoring while it generates) ran the module's own forward,
    unquantized, and so did a call of a second graphquant model of the module (another recipe).
    Each runs its own recipe's forward now."""
    import threading

    torch.manual_seed(0)
    model = llama().eval()
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend="aot_eager", mode="inference")
    other = graphquant.compile(model, recipes.current_scaling(), backend="aot_eager", mode="inference")
    prompt, scored_input = token_ids(batch=1, seq=8), token_ids(batch=1, seq=8, seed=2)
    with torch.inference_mode():
        expected = {"compiled": compiled(scored_input).logits, "other": other(scored_input).logits, "plain": model(scored_input).logits}
    assert not torch.equal(expected["compiled"], expected["plain"]) and not torch.equal(expected["other"], expected["plain"])
    scored, scored_all = {}, threading.Event()

    def score():
        with torch.inference_mode():
            scored.update(compiled=compiled(scored_input).logits, other=other(scored_input).logits, plain=model(scored_input).logits)
        scored_all.set()

    class Meanwhile(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            if not scored_all.is_set():
                threading.Thread(target=score).start()
                assert scored_all.wait(120)
            return scores

    with torch.inference_mode():
        compiled.generate(prompt, max_new_tokens=2, do_sample=False, logits_processor=[Meanwhile()])
    for name in expected:
        assert torch.equal(scored[name], expected[name]), name
    assert "forward" not in model.__dict__


def test_two_graphquant_models_of_one_module_do_not_generate_at_once():
    """generate runs through the module's own forward attribute, which holds one model's forward:
    a second graphquant model of the module (another recipe) generating meanwhile took it away
    (its steps ran the other recipe, the first's later ones none). It is refused, saying why."""
    torch.manual_seed(0)
    model = llama().eval()
    first = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend="aot_eager", mode="inference")
    second = graphquant.compile(model, recipes.current_scaling(), backend="aot_eager", mode="inference")
    refused = []

    class Meanwhile(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            if not refused:
                with pytest.raises(RuntimeError, match="another graphquant model of this LlamaForCausalLM is generating") as error:
                    second.generate(token_ids(batch=1, seq=8), max_new_tokens=1)
                refused.append(error)
            return scores

    with torch.inference_mode():
        alone = first.generate(token_ids(batch=1, seq=8), max_new_tokens=3, do_sample=False)
        out = first.generate(token_ids(batch=1, seq=8), max_new_tokens=3, do_sample=False, logits_processor=[Meanwhile()])
        assert refused and torch.equal(out, alone) and "forward" not in model.__dict__
        second.generate(token_ids(batch=1, seq=8), max_new_tokens=1)  # once the first has ended


@pytest.mark.parametrize("checkpointed", [False, True])
def test_gpt2s_functional_products_keep_their_names_and_state_in_evaluation(checkpointed):
    """GPT-2's Conv1D multiplies by torch.addmm, a functional linear named by its place in the
    source, as are its eager attention's matmuls. Its evaluation graph enters through transformers'
    decorators, frames its training graph did not have, and a checkpointing layer calls a block
    from another line: the same products were named anew (".linear.1", "matmul.2"), so under
    delayed scaling the evaluation started fresh slots at scale 1 beside the training's history."""
    import warnings

    model = gpt2()
    model.config._attn_implementation = "eager"
    if checkpointed:
        model.gradient_checkpointing_enable()
    recipe = recipes.mxfp8_block_scaling() if checkpointed else recipes.delayed_scaling()  # no delayed state under a checkpoint
    compiled = graphquant.compile(model, recipe, backend="aot_eager")
    ids = token_ids()
    compiled(input_ids=ids, labels=ids).loss.backward()
    trained = {g.site for plan in compiled.graphquant.plans for g in plan.gemms}
    graphs = len(compiled.graphquant.plans)
    model.eval()
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        compiled(input_ids=ids)
    assert {g.site for plan in compiled.graphquant.plans[graphs:] for g in plan.gemms} <= trained
    assert not [w for w in caught if "with no amax history" in str(w.message)]
