"""Attention spelled matmul-softmax-matmul (issue 33): under CustomRecipe(fp8_dpa=True) it is a
dpa site like F.scaled_dot_product_attention, where the spelling is exactly attention; anything
else, and everything without fp8_dpa, keeps its two matmul sites."""

import math

import pytest
import torch
import torch.nn.functional as F

import graphquant
from graphquant.passes.plan import PlanError
from graphquant.recipes import CustomRecipe

from test_attention import current_dpa_factory

HEADS, LENGTH, DIM = 2, 32, 16


class Attention(torch.nn.Module):
    """q, k, v projections of x (batch, length, heads * dim) and causal attention over them, the
    products spelled as ``spelling`` says: "sdpa" (an additive mask) or "sdpa_bool" (a bool mask
    of the positions attended), transformers' eager_attention_forward ("eager"; "gpt2" casts the
    probabilities back with .type, "llama_reference" with .type_as), or "masked_fill" (a scale
    divided out, the bool mask filled with -inf, Tensor.softmax, the @ operator); the others are
    near-matches that are not attention as sdpa computes it."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling, self.scaling = spelling, DIM**-0.5
        self.qkv = torch.nn.Linear(HEADS * DIM, 3 * HEADS * DIM, bias=False)
        self.temperature = torch.nn.Parameter(torch.tensor(self.scaling))

    def _cast_back(self, probs, q):
        if self.spelling == "gpt2":
            return probs.type(q.dtype)
        return probs.type_as(q) if self.spelling == "llama_reference" else probs.to(q.dtype)

    def forward(self, x, mask):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, DIM).permute(2, 0, 3, 1, 4)
        if self.spelling in ("sdpa", "sdpa_bool"):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)
        if self.spelling == "masked_fill":
            scores = (q @ k.transpose(-1, -2)) / DIM**0.5
            return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        if self.spelling == "bmm":  # on 3-D (batch * heads) tensors, as DeBERTa spells it
            q, k, v = (t.reshape(b * HEADS, s, DIM) for t in (q, k, v))
            probs = F.softmax(torch.bmm(q, k.transpose(1, 2)) * self.scaling + mask[0], dim=-1)
            return torch.bmm(probs, v).view(b, HEADS, s, DIM)
        scores = torch.matmul(q, k.transpose(2, 3))
        if self.spelling == "tensor_scale":
            scores = scores * self.temperature
        elif self.spelling == "soft_cap":  # Gemma 2's logit soft-cap
            scores = torch.tanh(scores * self.scaling / 50.0) * 50.0
        else:
            scores = scores * self.scaling
        scores = scores + mask
        probs = self._cast_back(F.softmax(scores, dim=1 if self.spelling == "other_dim" else -1, dtype=torch.float32), q)
        probs = F.dropout(probs, p=0.0, training=self.training)
        out = torch.matmul(probs, v)
        if self.spelling == "scores_twice":
            return out + scores.mean()
        if self.spelling == "probs_twice":
            return out, probs
        return out


def _causal_mask():
    return torch.full((LENGTH, LENGTH), -math.inf).triu(1)[None, None]


def _inputs(bool_mask=False):
    mask = torch.ones(LENGTH, LENGTH, dtype=torch.bool).tril() if bool_mask else _causal_mask()
    return torch.randn(2, LENGTH, HEADS * DIM, generator=torch.Generator().manual_seed(1)), mask


def _rows(plan):
    return [(g.site, g.module_type, g.gemm, g.a, g.a_format, g.b, g.b_format, str(g.backend)) for g in plan.gemms]


def _seeded(spelling):
    torch.manual_seed(0)
    return Attention(spelling)


RECIPE = CustomRecipe(current_dpa_factory, fp8_dpa=True)


@pytest.mark.parametrize("spelling, sdpa", [("eager", "sdpa"), ("gpt2", "sdpa"), ("llama_reference", "sdpa"), ("masked_fill", "sdpa_bool")])
def test_spelling_is_the_sdpa_site_bit_for_bit(spelling, sdpa):
    """transformers' eager spelling (matmul, * scaling, + mask, softmax in float32 and back,
    dropout 0, matmul), and one with / and masked_fill, plan and train as the same module written
    with sdpa: one dpa site named after its owner (here the compiled module itself)."""
    x, mask = _inputs(bool_mask=sdpa == "sdpa_bool")
    plans, results = {}, {}
    for name in (spelling, sdpa):
        model = _seeded(name)
        plans[name] = graphquant.explain(model, RECIPE, x, mask)
        compiled = graphquant.compile(model, RECIPE, backend="aot_eager")
        xs = x.clone().requires_grad_()
        out = compiled(xs, mask)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)))
        results[name] = (out, xs.grad, model.qkv.weight.grad)
    assert _rows(plans[spelling]) == _rows(plans[sdpa])
    assert {g.site for g in plans[spelling].gemms if g.module_type == "dpa"} == {"dpa#0"}
    assert "matmul" not in {g.module_type for g in plans[spelling].gemms} and not plans[spelling].skipped
    for a, b in zip(results[spelling], results[sdpa]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("spelling, reason", [
    ("other_dim", "softmax over dim 1, not the last"),
    ("tensor_scale", "the scores are scaled by the tensor l_self_parameters_temperature_, not a nonzero constant"),
    ("scores_twice", "scores_2 has 2 users"),
    ("probs_twice", "probs_1 has 2 users"),
    ("soft_cap", "(tanh) between the products is no step attention takes (scale, mask, cast)"),
    ("bmm", "its products (bmm, bmm) multiply 3-D (batch * heads, length, dim) tensors"),  # said nothing
])
def test_near_matches_stay_matmul_sites_and_say_why(spelling, reason):
    x, mask = _inputs()
    plan = graphquant.explain(_seeded(spelling), RECIPE, x, mask)
    assert "dpa" not in {g.module_type for g in plan.gemms}
    assert len({g.site for g in plan.gemms if g.module_type == "matmul"}) == 2
    assert any("matmul-softmax-matmul not folded into attention" in why and reason in why for _, why in plan.skipped), plan.skipped


def test_without_fp8_dpa_the_eager_spelling_keeps_its_matmul_sites():
    x, mask = _inputs()
    with_dpa = graphquant.explain(_seeded("eager"), RECIPE, x, mask)
    plan = graphquant.explain(_seeded("eager"), CustomRecipe(current_dpa_factory), x, mask)
    assert "dpa" not in {g.module_type for g in plan.gemms}
    assert len({g.site for g in plan.gemms if g.module_type == "matmul"}) == 2
    assert {g.module_type for g in with_dpa.gemms} == {"linear", "dpa"}


class DropoutAttention(Attention):
    def _cast_back(self, probs, q):
        if self.spelling == "gpt2":
            return probs.type(q.dtype)
        return probs.type_as(q) if self.spelling == "llama_reference" else probs.to(q.dtype)

    def forward(self, x, mask):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, DIM).permute(2, 0, 3, 1, 4)
        probs = torch.softmax(q @ k.transpose(-2, -1) / DIM**0.5 + mask, dim=-1)
        return F.dropout(probs, p=0.1, training=self.training) @ v


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = DropoutAttention("eager")

    def forward(self, x, mask):
        return self.attn(x, mask)


def test_dropout_is_a_plan_error_naming_the_module():
    """Training, the spelling's dropout is refused as sdpa's is; in eval it is no dropout."""
    torch.manual_seed(0)
    model = Block()
    with pytest.raises(PlanError, match=r"^attn#0 \(.*\): .*dropout_p=0.1 under fp8_dpa"):
        graphquant.explain(model, RECIPE, *_inputs())
    plan = graphquant.explain(model.eval(), RECIPE, *_inputs())
    assert {g.site for g in plan.gemms if g.module_type == "dpa"} == {"attn#0"}


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_hugging_face_llama_eager_attention_is_a_dpa_site_per_layer(kv_heads):
    """transformers' eager attention (grouped-query with one key/value head: repeat_kv expands k
    and v to the query heads, folded as multi-head attention over the copies) compiles in one
    graph with a dpa site per layer, and trains a step."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=kv_heads, max_position_embeddings=128, attn_implementation="eager", bos_token_id=0,
        eos_token_id=None, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    compiled = graphquant.compile(model, RECIPE, backend="aot_eager", fullgraph=True)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    loss = compiled(ids, labels=ids).loss
    loss.backward()
    plan = compiled.graphquant.plan
    assert {g.site for g in plan.gemms if g.module_type == "dpa"} == {"model.layers.0.self_attn#0", "model.layers.1.self_attn#0"}
    assert "matmul" not in {g.module_type for g in plan.gemms}
    assert torch.isfinite(loss) and torch.isfinite(model.model.layers[0].self_attn.q_proj.weight.grad).all()
