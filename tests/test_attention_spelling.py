"""Attention spelled matmul-softmax-matmul (issue 33): under CustomRecipe(fp8_dpa=True) it is a
dpa site like F.scaled_dot_product_attention, where the spelling is exactly attention; anything
else, and everything without fp8_dpa, keeps its two matmul sites."""

import contextlib
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
    probabilities back with .type, "llama_reference" with .type_as), Meta's Llama reference code
    ("llama_meta": the scores cast with .float(), the softmax in float32, .type_as back), or
    "masked_fill" (a scale divided out, the bool mask filled with -inf, Tensor.softmax, the @
    operator; "where" and "where_fill_first" fill it with torch.where); "rotary" and "sdpa_rotary"
    are "eager" and "sdpa" with q and k multiplied by a float32 table first, as transformers'
    rotary embedding multiplies them; the others are near-matches that are not attention as sdpa
    computes it."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling, self.scaling = spelling, DIM**-0.5
        self.qkv = torch.nn.Linear(HEADS * DIM, 3 * HEADS * DIM, bias=False)
        self.temperature = torch.nn.Parameter(torch.tensor(self.scaling))
        self.register_buffer("table", torch.rand(LENGTH, DIM) + 0.5)

    def _cast_back(self, probs, q):
        if self.spelling == "gpt2":
            return probs.type(q.dtype)
        return probs.type_as(q) if self.spelling == "llama_reference" else probs.to(q.dtype)

    def forward(self, x, mask):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, DIM).permute(2, 0, 3, 1, 4)
        if self.spelling.endswith("rotary"):
            q, k = q * self.table, k * self.table
        if self.spelling in ("sdpa", "sdpa_bool", "sdpa_rotary"):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling)
        if self.spelling in ("masked_fill", "where", "where_fill_first", "where_method"):
            scores = (q @ k.transpose(-1, -2)) / DIM**0.5
            if self.spelling == "where":
                scores = torch.where(mask, scores, float("-inf"))
            elif self.spelling == "where_method":
                scores = scores.where(mask, float("-inf"))
            elif self.spelling == "where_fill_first":
                scores = torch.where(~mask, float("-inf"), scores)
            else:
                scores = scores.masked_fill(~mask, float("-inf"))
            return scores.softmax(-1) @ v
        if self.spelling == "einsum":
            scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * self.scaling + mask
            return torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v)
        if self.spelling == "bmm":  # on 3-D (batch * heads) tensors, as DeBERTa spells it
            q, k, v = (t.reshape(b * HEADS, s, DIM) for t in (q, k, v))
            probs = F.softmax(torch.bmm(q, k.transpose(1, 2)) * self.scaling + mask[0], dim=-1)
            return torch.bmm(probs, v).view(b, HEADS, s, DIM)
        scores = torch.matmul(q, k.transpose(2, 3))
        if self.spelling == "tensor_scale":
            scores = scores * self.temperature
        elif self.spelling == "torch_functions":  # torch.mul and torch.add for * and +
            scores = torch.add(torch.mul(scores, self.scaling), mask)
        elif self.spelling == "soft_cap":  # Gemma 2's logit soft-cap
            scores = torch.tanh(scores * self.scaling / 50.0) * 50.0
        else:
            scores = scores * self.scaling
        if self.spelling == "where_finfo":  # transformers' GPT-2 fills the masked scores with finfo.min
            scores = torch.where(mask == 0, scores, torch.finfo(scores.dtype).min)
        elif self.spelling != "torch_functions":
            scores = scores + mask
        if self.spelling in ("llama_meta", "scores_double"):
            probs = F.softmax(scores.float() if self.spelling == "llama_meta" else scores.double(), dim=-1).type_as(q)
        else:
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


@pytest.mark.parametrize("spelling, sdpa", [
    ("eager", "sdpa"), ("gpt2", "sdpa"), ("llama_reference", "sdpa"),
    ("llama_meta", "sdpa"),  # .float() raised StopIteration
    ("torch_functions", "sdpa"),  # torch.mul and torch.add were no steps
    ("masked_fill", "sdpa_bool"), ("where", "sdpa_bool"), ("where_fill_first", "sdpa_bool"),  # torch.where was neither folded nor listed
    ("where_method", "sdpa_bool"),  # Tensor.where was listed, not folded
])
def test_spelling_is_the_sdpa_site_bit_for_bit(spelling, sdpa):
    """transformers' eager spelling (matmul, * scaling, + mask, softmax in float32 and back,
    dropout 0, matmul), and one with / and masked_fill, plan and train as the same module written
    with sdpa: one dpa site named after its owner (here the compiled module itself)."""
    _check_bit_for_bit(spelling, sdpa, contextlib.nullcontext)


@pytest.mark.parametrize("spelling, sdpa", [("eager", "sdpa"), ("rotary", "sdpa_rotary")])
def test_spelling_under_autocast_is_the_sdpa_site_bit_for_bit(spelling, sdpa):
    """float32 weights under torch.autocast(bfloat16), as mixed-precision training runs them: q, k
    and v come out of the projection in bfloat16 beside the float32 mask, or q and k in float32
    beside a bfloat16 v where a float32 table multiplies them (transformers' Llama), and autocast
    runs both products in bfloat16. Such a chain stayed two matmul sites ("the additive mask is not
    a fixed tensor of the query's dtype", "attention keeps one dtype"), which sdpa under autocast
    is not."""
    _check_bit_for_bit(spelling, sdpa, lambda: torch.autocast("cpu", dtype=torch.bfloat16))


def _check_bit_for_bit(spelling, sdpa, context):
    x, mask = _inputs(bool_mask=sdpa == "sdpa_bool")
    plans, results = {}, {}
    for name in (spelling, sdpa):
        model = _seeded(name)
        with context():
            plans[name] = graphquant.explain(model, RECIPE, x, mask)
            compiled = graphquant.compile(model, RECIPE, backend="aot_eager")
            xs = x.clone().requires_grad_()
            out = compiled(xs, mask)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype))
        results[name] = (out, xs.grad, model.qkv.weight.grad)
    assert _rows(plans[spelling]) == _rows(plans[sdpa])
    assert {g.site for g in plans[spelling].gemms if g.module_type == "dpa"} == {"dpa#0"}
    assert "matmul" not in {g.module_type for g in plans[spelling].gemms} and not plans[spelling].skipped
    for a, b in zip(results[spelling], results[sdpa]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("spelling, reason", [
    ("other_dim", "softmax over dim 1, not the last"),
    ("tensor_scale", "the scores are scaled by the tensor temperature, not a nonzero constant"),  # said l_self_parameters_temperature_
    ("scores_twice", "scores_2 has 2 users"),
    ("probs_twice", "probs_1 has 2 users"),
    ("soft_cap", "(tanh) between the products is no step attention takes (scale, mask, cast)"),
    ("bmm", "its products (bmm, bmm) multiply 3-D (batch * heads, length, dim) tensors"),  # said nothing
    ("einsum", "its products (einsum, einsum) are einsums"),  # said nothing
    ("where_finfo", "torch.where does not fill a bool mask with -inf"),  # said nothing
    ("scores_double", "the scores are cast to torch.float64 by double (double), not to float32"),
])
def test_near_matches_stay_matmul_sites_and_say_why(spelling, reason):
    x, mask = _inputs()
    plan = graphquant.explain(_seeded(spelling), RECIPE, x, mask)
    assert "dpa" not in {g.module_type for g in plan.gemms}
    assert len({g.site for g in plan.gemms if g.module_type == "matmul"}) == 2
    assert any("matmul-softmax-matmul not folded into attention" in why and reason in why for _, why in plan.skipped), plan.skipped


class CastBack(torch.nn.Module):
    """The probabilities cast back with a Tensor method of no argument (.half(), .bfloat16())."""

    def __init__(self, method):
        super().__init__()
        self.method = method

    def forward(self, q, k, v):
        probs = F.softmax((q @ k.transpose(-2, -1) * DIM**-0.5).float(), dim=-1)
        return getattr(probs, self.method)() @ v


@pytest.mark.parametrize("dtype, method", [(torch.bfloat16, "bfloat16"), (torch.float16, "half")])
def test_the_probabilities_cast_back_by_a_method_of_no_argument_fold(dtype, method):
    """Such a cast was neither folded nor listed."""
    q = torch.randn(2, HEADS, LENGTH, DIM, dtype=dtype)
    plan = graphquant.explain(CastBack(method), RECIPE, q, q, q)
    assert {g.module_type for g in plan.gemms} == {"dpa"} and not plan.skipped


def test_without_fp8_dpa_the_eager_spelling_keeps_its_matmul_sites():
    x, mask = _inputs()
    with_dpa = graphquant.explain(_seeded("eager"), RECIPE, x, mask)
    plan = graphquant.explain(_seeded("eager"), CustomRecipe(current_dpa_factory), x, mask)
    assert "dpa" not in {g.module_type for g in plan.gemms}
    assert len({g.site for g in plan.gemms if g.module_type == "matmul"}) == 2
    assert {g.module_type for g in with_dpa.gemms} == {"linear", "dpa"}


def test_a_scale_attribute_traced_as_a_symbol_folds():
    """Under dynamic=True Dynamo traces ``* self.scaling`` (a float attribute, as transformers'
    eager attention multiplies by) as a symbol: the chain stayed two matmul sites, "scaled by the
    tensor item", in high precision; it folds with the number, guarded."""
    x, mask = _inputs()
    model = _seeded("eager")
    compiled = graphquant.compile(model, RECIPE, backend="aot_eager", dynamic=True)
    compiled(x, mask).sum().backward()
    plan = compiled.graphquant.plan
    assert {g.module_type for g in plan.gemms} == {"linear", "dpa"} and not plan.skipped
    sdpa = graphquant.explain(_seeded("sdpa"), RECIPE, x, mask)
    assert _rows(plan) == _rows(sdpa)


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
    with pytest.raises(PlanError, match=r"^attn#0: F.dropout\(p=0.1\) of the probabilities of its matmul-softmax-matmul attention under fp8_dpa; "):
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
