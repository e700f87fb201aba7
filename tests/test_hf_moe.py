"""transformers' MoE models (Mixtral, Qwen3-MoE) under graphquant: which experts code paths it sees.

transformers 5 picks a model's experts code with ``experts_implementation``
(transformers/integrations/moe.py), the same on the CPU and on CUDA:

- "grouped_mm" (the default): token-expert pairs sorted by expert, then two grouped GEMMs
  (F.grouped_mm, i.e. torch._grouped_mm) on the experts' 3-D weights with device offsets. Under
  torch.compile transformers takes this only for bfloat16 weights (and, on CUDA, sm_80 and
  later); otherwise it calls its own custom op ``transformers::grouped_mm_fallback``, a loop over
  experts no graph pass can look into.
- "batched_mm": each pair's expert weights gathered into a (pairs, N, K) copy and one torch.bmm.
- "eager": the modeling file's loop over the experts that ``nonzero`` finds, an F.linear on each
  one's rows: its length depends on the data, so Dynamo breaks the graph and runs the loop in
  plain PyTorch.
- "deepgemm", "sonicmoe": CUDA kernels from the kernels hub (not on the CPU).

Each test builds a tiny random model (1 layer, hidden 64), compiles it with aot_eager, runs one
forward and backward and pins what the plan lists for the experts.
"""

import copy

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend
from torch._dynamo.utils import counters

transformers = pytest.importorskip("transformers")

import graphquant  # noqa: E402
from graphquant import factories, recipes, zoo  # noqa: E402

from reference import fresh_dynamo  # noqa: E402,F401  (an autouse fixture)

VOCAB = 256
EXPERTS = "model.layers.0.mlp.experts"


def mixtral(experts_implementation, dtype):
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
        attn_implementation="sdpa", experts_implementation=experts_implementation,
    )
    return transformers.MixtralForCausalLM(config).to(dtype)


def qwen3_moe(experts_implementation, dtype):
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=128, attn_implementation="sdpa", experts_implementation=experts_implementation,
    )
    return transformers.Qwen3MoeForCausalLM(config).to(dtype)


MODELS = {"mixtral": mixtral, "qwen3_moe": qwen3_moe}


def token_ids(batch=2, seq=32, device="cpu"):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)


def build(name, experts_implementation, dtype):
    torch.manual_seed(0)
    model = MODELS[name](experts_implementation, dtype)
    assert model.config._experts_implementation == experts_implementation
    return model


def step(model, recipe, fullgraph=True):
    """Compile, run one forward and backward; returns the compiled model, its logits and the names
    of the functions and ops called in the graphs its backend received (after graphquant's rewrite)."""
    targets = set()

    def recording_aot_eager(gm, example_inputs):
        targets.update(n.target.__name__ for n in gm.graph.nodes if n.op == "call_function")
        return lookup_backend("aot_eager")(gm, example_inputs)

    counters.clear()
    compiled = graphquant.compile(model, recipe, backend=recording_aot_eager, fullgraph=fullgraph)
    logits = compiled(token_ids(device=model.device)).logits
    logits.float().square().mean().backward()
    return compiled, logits, targets


def expert_gemms(compiled):
    """{(site name, gemm): (module_type, a_format, b_format)} of the experts' GEMMs in every plan."""
    return {
        (g.site.rsplit("#", 1)[0], g.gemm): (g.module_type, g.a_format, g.b_format)
        for plan in compiled.graphquant.plans for g in plan.gemms if ".experts." in g.site
    }


def assert_experts_trained(model):
    for name, p in model.named_parameters():
        if ".experts." in name:
            assert p.grad is not None and p.grad.isfinite().all() and p.grad.abs().sum() > 0, name


def relative_error(actual, expected):
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def eager_step(model):
    """The same step on a copy of the model in plain PyTorch (bfloat16): its logits and the copy."""
    model = copy.deepcopy(model)
    logits = model(token_ids(device=model.device)).logits
    logits.float().square().mean().backward()
    return logits, model


@pytest.mark.parametrize("name", list(MODELS))
def test_grouped_mm_in_bfloat16_gives_grouped_sites(name):
    """The default path in bfloat16: both expert GEMMs are grouped_linear sites (up/gate and
    down projections, in that order), in one graph, quantized in fprop, dgrad and wgrad, and the
    step trains with logits close to the same model's in bfloat16 (a sanity bound: FP8 rowwise
    through one layer gives about 0.05; tests/test_compile_grouped.py proves the numerics)."""
    model = build(name, "grouped_mm", torch.bfloat16)
    eager_logits, _ = eager_step(model)
    compiled, logits, targets = step(model, zoo.recipe("rowwise"))

    assert not counters["graph_break"]
    assert len(compiled.graphquant.plans) == 1
    rowwise = ("grouped_linear", "fp8_rowwise(fp8_dtype=e4m3)", "fp8_rowwise(fp8_dtype=e4m3)")
    assert expert_gemms(compiled) == {
        (f"{EXPERTS}.grouped_linear.{i}", gemm): rowwise for i in (0, 1) for gemm in ("fprop", "dgrad", "wgrad")
    }
    assert "quantized_grouped_mm" in targets and "_grouped_mm" not in targets
    assert_experts_trained(model)
    assert relative_error(logits, eager_logits) < 0.1


@pytest.mark.parametrize("name", list(MODELS))
def test_grouped_sites_in_high_precision_match_eager_bfloat16(name):
    """The same sites under the identity recipe give the eager model's logits and expert
    gradients up to bfloat16 rounding: graphquant's grouped op follows transformers' routing,
    offsets and weight layout (gate_up_proj (E, 2I, H) used transposed)."""
    model = build(name, "grouped_mm", torch.bfloat16)
    eager_logits, eager_model = eager_step(model)
    compiled, logits, _ = step(model, graphquant.CustomRecipe(factories.high_precision_factory))

    assert set(expert_gemms(compiled)) == {
        (f"{EXPERTS}.grouped_linear.{i}", gemm) for i in (0, 1) for gemm in ("fprop", "dgrad", "wgrad")
    }
    assert relative_error(logits, eager_logits) < 1e-3
    for (what, p), expected in zip(model.named_parameters(), eager_model.parameters()):
        if ".experts." in what:
            assert relative_error(p.grad, expected.grad) < 1e-3, what


def test_grouped_mm_under_mxfp8_keeps_the_router_high_precision():
    """The built-in MXFP8 recipe: experts are MXFP8 grouped sites (groups padded inside the op),
    the router's 4 outputs cannot tile, so it stays in high precision with the reason."""
    model = build("mixtral", "grouped_mm", torch.bfloat16)
    compiled, _, _ = step(model, recipes.mxfp8_block_scaling())

    mxfp8 = ("grouped_linear", "mxfp8(fp8_dtype=e4m3)", "mxfp8(fp8_dtype=e4m3)")
    assert set(expert_gemms(compiled).values()) == {mxfp8}
    router = [g for g in compiled.graphquant.plan.gemms if g.site.startswith("model.layers.0.mlp.gate.")]
    assert router and all(g.a_format == g.b_format == "identity()" and g.reason for g in router), router
    assert_experts_trained(model)


@pytest.mark.parametrize("name", list(MODELS))
def test_grouped_mm_in_float32_hides_the_experts_in_transformers_op(name):
    """grouped_mm with float32 weights: under torch.compile transformers calls its custom op
    transformers::grouped_mm_fallback, opaque to graphquant: no expert sites, the experts' products
    run in float32 unquantized (the plan lists the op as not seen into), and the rest of the model
    is still quantized."""
    model = build(name, "grouped_mm", torch.float32)
    compiled, _, targets = step(model, zoo.recipe("rowwise"))

    assert not counters["graph_break"]
    assert "grouped_mm_fallback" in targets and "quantized_grouped_mm" not in targets
    assert expert_gemms(compiled) == {}
    assert any("transformers::grouped_mm_fallback is a custom op" in why for _, why in compiled.graphquant.plan.skipped)
    assert any(g.site.startswith("model.layers.0.self_attn.q_proj") for g in compiled.graphquant.plan.gemms)
    assert_experts_trained(model)


@pytest.mark.parametrize("name", list(MODELS))
def test_batched_mm_gives_batched_matmul_sites(name):
    """batched_mm: one torch.bmm per projection over per-pair copies of the expert weights. graphquant
    sees two ``matmul`` sites (roles input / other, not grouped_linear: the weights are gathered
    activations by then), quantized by rowwise; each batch is one token, so block formats cannot
    tile them (see the next test)."""
    model = build(name, "batched_mm", torch.bfloat16)
    compiled, _, _ = step(model, zoo.recipe("rowwise"))

    assert not counters["graph_break"]
    rowwise = ("matmul", "fp8_rowwise(fp8_dtype=e4m3)", "fp8_rowwise(fp8_dtype=e4m3)")
    assert expert_gemms(compiled) == {
        (f"{EXPERTS}.matmul.{i}", gemm): rowwise for i in (0, 1) for gemm in ("fprop", "dgrad", "wgrad")
    }
    assert_experts_trained(model)


def test_batched_mm_under_mxfp8_stays_high_precision():
    model = build("mixtral", "batched_mm", torch.bfloat16)
    compiled, _, _ = step(model, recipes.mxfp8_block_scaling())

    gemms = expert_gemms(compiled)
    assert {site for site, _ in gemms} == {f"{EXPERTS}.matmul.0", f"{EXPERTS}.matmul.1"}
    assert set(gemms.values()) == {("matmul", "identity()", "identity()")}
    assert_experts_trained(model)


@pytest.mark.parametrize("name", list(MODELS))
def test_eager_experts_loop_cannot_be_captured_in_one_graph(name):
    """eager: the loop over the experts ``nonzero`` finds has a data-dependent length; with
    fullgraph=True Dynamo refuses it."""
    model = build(name, "eager", torch.bfloat16)
    with pytest.raises(torch._dynamo.exc.UserError, match="data-dependent"):
        step(model, zoo.recipe("rowwise"))


@pytest.mark.slow
def test_eager_experts_loop_runs_outside_graphquant():
    """Without fullgraph the graph breaks at ``nonzero`` and the experts' loop runs in plain
    PyTorch: their per-expert F.linear products are in no plan (unquantized), which the first call
    says, while attention, the router and lm_head are still sites."""
    model = build("mixtral", "eager", torch.bfloat16)
    with pytest.warns(UserWarning, match=r"2 parameter\(s\) of 2 or more dims that no compiled graph reads \(model\.layers\.0\.mlp\.experts\.gate_up_proj"):
        compiled, _, _ = step(model, zoo.recipe("rowwise"), fullgraph=False)

    assert any("aten.nonzero" in reason for reason in counters["graph_break"])
    assert expert_gemms(compiled) == {}
    sites = {g.site.rsplit("#", 1)[0] for plan in compiled.graphquant.plans for g in plan.gemms}
    assert {"model.layers.0.self_attn.q_proj", "model.layers.0.mlp.gate.linear.0", "lm_head"} <= sites
    assert_experts_trained(model)


@pytest.mark.gpu
def test_grouped_mm_on_cuda_gives_grouped_sites():
    """On CUDA (sm_80 and later) transformers' bfloat16 experts reach torch._grouped_mm too, so
    graphquant plans them as grouped sites: the same sites as on the CPU."""
    model = build("mixtral", "grouped_mm", torch.bfloat16).cuda()
    eager_logits, _ = eager_step(model)
    compiled, logits, targets = step(model, zoo.recipe("rowwise"))

    assert not counters["graph_break"]
    assert {site for site, _ in expert_gemms(compiled)} == {f"{EXPERTS}.grouped_linear.0", f"{EXPERTS}.grouped_linear.1"}
    assert "quantized_grouped_mm" in targets and "grouped_mm_fallback" not in targets
    assert_experts_trained(model)
    assert relative_error(logits, eager_logits) < 0.1
