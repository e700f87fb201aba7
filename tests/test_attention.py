"""FP8 attention (issue 33): dpa sites, roles and plan under CustomRecipe(fp8_dpa=True), and the
emulation against a float64 reference.

The reference (``reference_attention``) quantizes with graphquant.quantizers as tests/reference.py
does and takes each product in float64, checked against the op's fp32 product within the fp32
accumulation bound and then teacher-forced with it; the steps between products (scale and mask,
softmax, D, dS) are the ones the op documents, in fp32, so both sides feed the same bits to every
quantizer. It derives from TE's behaviour alone: Q, K and V joined under one per-tensor scale, a
block format per tensor; P quantized by s before P V; dO by do; dS (the gradient of the scaled
scores) by dp before dQ and dK; each product reading the direction that reduces over its inner
dim; a delayed-scaling slot quantizing with its current scale and then recording the amax.
"""

import copy
import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F

import graphquant
from graphquant import recipes, zoo
from graphquant.ops.attention import AttentionSite, quantized_attention
from graphquant.ops.recording import recording
from graphquant.passes.plan import PlanError
from graphquant.quantizers import (
    COLUMNWISE,
    ROWWISE,
    DelayedScalingRequest,
    Float8CurrentScalingQuantizer,
    Float8DelayedScalingQuantizer,
    Float8RowwiseQuantizer,
    HybridQuantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    QuantizeContext,
)
from graphquant.recipes import CustomRecipe
from graphquant.roles import QuantizerRole

import models
from reference import EPS32, delayed_update, fresh_dynamo, gemm_bound, ref_dequantize, ref_quantize  # noqa: F401

# What the plan gives a per-tensor s slot, whatever scaling the factory asked for (softmax_output_format).
P_FORMAT = "fp8_current(fp8_dtype=e4m3, amax_epsilon=1.0)"
CURRENT = {"qkv": "fp8_current(fp8_dtype=e4m3)", "s": P_FORMAT, "do": "fp8_current(fp8_dtype=e5m2)", "dp": "fp8_current(fp8_dtype=e5m2)"}
MXFP8 = {"qkv": "mxfp8(fp8_dtype=e4m3)", "s": "mxfp8(fp8_dtype=e4m3)", "do": "mxfp8(fp8_dtype=e5m2)", "dp": "mxfp8(fp8_dtype=e5m2)"}
DELAYED_S = "fp8_delayed(fp8_dtype=e4m3, amax_history_len=1, amax_compute_algo=most_recent)"
DELAYED_DP = "fp8_delayed(fp8_dtype=e5m2, amax_history_len=1, amax_compute_algo=most_recent)"
ZOO = {**CURRENT, "dp": DELAYED_DP}  # nvfp4_linear_fp8_dpa's attention as planned
DELAYED = {"qkv": "fp8_delayed(fp8_dtype=e4m3, amax_history_len=4)", "s": P_FORMAT, "do": "fp8_delayed(fp8_dtype=e5m2, amax_history_len=4)", "dp": DELAYED_DP}
FORMATS = {"current": CURRENT, "mxfp8": MXFP8, "zoo": ZOO, "delayed": DELAYED}


# -- the float64 reference ---------------------------------------------------------------------

class Slots:
    """The reference's quantizers and delayed-scaling state, by slot."""

    def __init__(self, formats: dict[str, str], device: torch.device = torch.device("cpu")):
        self.quantizers = {slot: graphquant.parse_spec(spec) for slot, spec in formats.items()}
        self.delayed = {
            slot: (torch.ones(1, device=device), torch.zeros(q.amax_history_len, device=device))
            for slot, q in self.quantizers.items()
            if isinstance(q, Float8DelayedScalingQuantizer)
        }

    def quantize(self, slot: str, tensors: list[torch.Tensor], directions: list[str]) -> list[torch.Tensor]:
        """Float64 values of each 2-D tensor in its direction; a per-tensor format scales all of
        them by their joint amax (TE quantizes Q, K and V joined), then records it."""
        quantizer = self.quantizers[slot]
        ctx = QuantizeContext(scale=self.delayed[slot][0] if slot in self.delayed else None)
        if isinstance(quantizer, MXFP8Quantizer):
            return [ref_dequantize(ref_quantize(t, quantizer, d, ctx)) for t, d in zip(tensors, directions)]
        joint = torch.cat([t.reshape(-1) for t in tensors]).reshape(1, -1)
        values = ref_dequantize(ref_quantize(joint, quantizer, ROWWISE, ctx)).reshape(-1)
        if slot in self.delayed:
            self.delayed[slot] = delayed_update(*self.delayed[slot], joint.abs().max(), quantizer)
        return [v.view(t.shape) for v, t in zip(values.split([t.numel() for t in tensors]), tensors)]


def _taken(products: dict, name: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The op's fp32 product ``name`` (batch, m, n), checked to lie within the fp32 accumulation
    bound of the float64 a @ b^T (a (batch, m, k), b (batch, n, k))."""
    exact = a @ b.transpose(1, 2)
    bound = gemm_bound(a, b.transpose(1, 2))
    actual = products.pop(name).double()
    assert actual.shape == exact.shape, (name, actual.shape, exact.shape)
    excess = ((actual - exact).abs() - bound).max().item()
    assert excess <= 0, f"{name}: the op's product is {excess:.3g} beyond the fp32 bound of the float64 product"
    return actual.float()


def reference_attention(q, k, v, mask, scale, dout, slots: Slots, products: dict):
    """(O, dQ, dK, dV) of attention in the slots' formats, teacher-forced by the op's ``products``."""
    b, h, lq, d = q.shape
    groups = h // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    lk, dv = k.shape[2], v.shape[3]
    rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    per_head = lambda t, n: t.reshape(b * h, -1, n)  # noqa: E731
    training = dout is not None
    q2, k2, v2 = rows(q), rows(k), rows(v)
    qr, kr, vc, *more = slots.quantize(
        "qkv", [q2, k2, v2] + ([q2, k2, v2] if training else []),
        [ROWWISE, ROWWISE, COLUMNWISE] + ([COLUMNWISE, COLUMNWISE, ROWWISE] if training else []),
    )
    s = _taken(products, "qk", per_head(qr, d), per_head(kr, d)).view(b, h, lq, lk) * scale
    logits = s if mask is None else s + mask
    p = torch.softmax(logits, -1)
    p = torch.where(torch.isneginf(logits).all(-1, keepdim=True), 0.0, p).reshape(-1, lk)
    pr, *pc = slots.quantize("s", [p, p] if training else [p], [ROWWISE, COLUMNWISE][: 2 if training else 1])
    o = _taken(products, "pv", per_head(pr, lk), per_head(vc, dv).transpose(1, 2)).to(q.dtype)
    if not training:
        return (o.view(b, h, lq, dv),)
    qc, kc, vr = more
    do2 = rows(dout)
    dor, doc = slots.quantize("do", [do2, do2], [ROWWISE, COLUMNWISE])
    dv_ = _taken(products, "dv", per_head(pc[0], lk).transpose(1, 2), per_head(doc, dv).transpose(1, 2))
    dp = _taken(products, "dp", per_head(dor, dv), per_head(vr, dv))
    dd = (dor.float().view(o.shape) * o.float()).sum(-1, keepdim=True)
    ds = (p.view(dp.shape) * (dp - dd)).reshape(-1, lk)
    dsr, dsc = slots.quantize("dp", [ds, ds], [ROWWISE, COLUMNWISE])
    dq = _taken(products, "dq", per_head(dsr, lk), per_head(kc, d).transpose(1, 2)) * scale
    dk = _taken(products, "dk", per_head(dsc, lk).transpose(1, 2), per_head(qc, d).transpose(1, 2)) * scale
    grouped = lambda t: t.view(b, h // groups, groups, lk, t.shape[-1]).sum(2)  # noqa: E731
    return o.view(b, h, lq, dv), dq.view(b, h, lq, d), grouped(dk), grouped(dv_)


def _run_op(site, states, q, k, v, dout, **kwargs):
    """The op's (O, dQ, dK, dV) and its fp32 products by name, recorded as graphquant.numerics does."""
    products = {}
    leaves = [t.detach().requires_grad_(dout is not None) for t in (q, k, v)]
    with recording(lambda g: products.__setitem__(g.gemm, g.out.detach().clone())):
        o = quantized_attention(*leaves, site=site, states=states, **kwargs)
        grads = torch.autograd.grad(o, leaves, dout) if dout is not None else ()
    return (o.detach(), *grads), products


def _inputs(b=2, hq=4, hkv=2, lq=64, lk=64, d=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, hq, lq, d, generator=g) * 2).to(dtype)
    k = torch.randn(b, hkv, lk, d, generator=g).to(dtype)
    v = (torch.randn(b, hkv, lk, d, generator=g) * 3).to(dtype)
    dout = (torch.randn(b, hq, lq, d, generator=g) * 1e-3).to(dtype)
    return q, k, v, dout


MASKS = {
    "none": lambda lq, lk: ({}, None),
    "causal": lambda lq, lk: ({"is_causal": True}, torch.zeros(lq, lk).masked_fill(~torch.ones(lq, lk, dtype=torch.bool).tril(), -math.inf)),
    "bool": lambda lq, lk: _bool_mask(lq, lk),
    "float": lambda lq, lk: _float_mask(lq, lk),
}


def _bool_mask(lq, lk):
    allowed = torch.rand(2, 1, lq, lk, generator=torch.Generator().manual_seed(5)) > 0.3
    allowed[:, :, 3] = False  # a row that sees no key gives zeros, as F.scaled_dot_product_attention does
    return {"attn_mask": allowed}, torch.zeros(allowed.shape).masked_fill(~allowed, -math.inf)


def _float_mask(lq, lk):
    bias = torch.randn(lq, lk, generator=torch.Generator().manual_seed(6))
    return {"attn_mask": bias}, bias


def _states(formats):
    return tuple(
        torch.cat([torch.ones(1), torch.zeros(graphquant.parse_spec(formats[slot]).amax_history_len)]) if "delayed" in formats[slot] else None
        for slot in ("qkv", "s", "do", "dp")
    )


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("formats", list(FORMATS))
def test_matches_the_float64_reference(formats, mask):
    """Outputs and every gradient over two steps (the second uses the delayed scales the first
    recorded), grouped-query attention (4 query heads, 2 key/value heads) and each kind of mask."""
    _check_against_reference(formats, mask, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("mask", ["causal", "bool"])
@pytest.mark.parametrize("formats", ["zoo", "mxfp8"])
def test_matches_the_float64_reference_on_cuda(formats, mask):
    """The same on CUDA, where the emulated products multiply bfloat16-exact operands on the GPU."""
    _check_against_reference(formats, mask, torch.device("cuda"))


def _check_against_reference(formats: str, mask: str, device: torch.device) -> None:
    site = AttentionSite(name="layers.0.attn", call=0, **FORMATS[formats])
    states = tuple(s if s is None else s.to(device) for s in _states(FORMATS[formats]))
    slots = Slots(FORMATS[formats], device)
    kwargs, additive = MASKS[mask](64, 64)
    kwargs = {k: v.to(device) for k, v in kwargs.items() if isinstance(v, torch.Tensor)} | {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
    additive = None if additive is None else additive.to(device)
    for step in range(2):
        q, k, v, dout = (t.to(device) for t in _inputs(seed=step))
        actual, products = _run_op(site, states, q, k, v, dout, **kwargs)
        expected = reference_attention(q, k, v, additive, 1 / math.sqrt(32), dout, slots, products)
        assert not products, f"the op ran products the reference did not: {sorted(products)}"
        for name, a, e in zip(("O", "dQ", "dK", "dV"), actual, expected):
            torch.testing.assert_close(a, e, rtol=4 * EPS32, atol=0, msg=lambda m: f"step {step} {name}: {m}")
        assert all(torch.isfinite(t).all() for t in actual)
    for slot, state in zip(("qkv", "s", "do", "dp"), states):
        if state is not None:
            torch.testing.assert_close(state, torch.cat(slots.delayed[slot]), rtol=0, atol=0, msg=f"{slot}'s delayed state")


def test_an_attention_called_twice_a_step_rolls_its_delayed_slots_once():
    """The first call of a step (records_amax_only qkv) records its amax and keeps the scale, so
    the second quantizes with the same one; the second rolls the history once with the larger
    amax and rescales. (The plan marks the second call's do and dp, whose backward runs first.)"""
    early = AttentionSite(name="layers.0.attn", call=0, **DELAYED, records_amax_only=("qkv",))
    late = AttentionSite(name="layers.0.attn", call=1, **DELAYED, records_amax_only=("do", "dp"))
    states = _states(DELAYED)
    q, k, v, dout = _inputs(seed=0)
    _run_op(early, states, q, k, v, None)
    qkv = states[0].clone()
    amax = torch.cat([t.reshape(-1) for t in (q, k, v)]).abs().max()
    assert qkv[0] == 1 and qkv[1] == amax and not qkv[2:].any()  # scale kept, the amax recorded
    _run_op(late, states, q * 4, k, v, None)
    larger = torch.cat([t.reshape(-1) for t in (q * 4, k, v)]).abs().max()
    assert larger > amax and states[0][1] == 0 and states[0][-1] == larger  # rolled once, with the larger amax
    assert states[0][0] == graphquant.parse_spec(DELAYED["qkv"]).update(torch.ones(1), torch.zeros(4), larger)[0]


def test_bfloat16_inference_and_custom_scale():
    """bfloat16 inputs (O rounded once from the fp32 product), no grad (no backward directions),
    a scale of the caller's and a query shorter than the keys."""
    site = AttentionSite(name="attn", call=0, **CURRENT)
    q, k, v, _ = _inputs(lq=32, lk=64, dtype=torch.bfloat16)
    (o,), products = _run_op(site, (None,) * 4, q, k, v, None, scale=0.3, is_causal=True)
    _, causal = MASKS["causal"](32, 64)
    (expected,) = reference_attention(q, k, v, causal, 0.3, None, Slots(CURRENT), products)
    assert o.dtype == torch.bfloat16 and not products
    torch.testing.assert_close(o, expected, rtol=0, atol=0)


def test_close_to_high_precision_attention():
    """FP8 attention lands near F.scaled_dot_product_attention (E4M3 forward, E5M2 backward)."""
    q, k, v, dout = _inputs(seed=3)
    (o, dq, dk, dv), _ = _run_op(AttentionSite(name="attn", call=0, **CURRENT), (None,) * 4, q, k, v, dout * 1e3, is_causal=True)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    grads = torch.autograd.grad(ref, leaves, dout * 1e3)
    for a, e in zip((o, dq, dk, dv), (ref, *grads)):
        assert (a - e).norm() / e.norm() < 0.15


def test_dropout_is_refused_naming_the_module():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="layers.0.attn#0: FP8 attention runs without dropout"):
        quantized_attention(q, k, v, dropout_p=0.1, site=AttentionSite(name="layers.0.attn", call=0, **CURRENT))


# -- sites, roles and the plan -----------------------------------------------------------------

class Asked:
    """A factory that records the roles it is asked for and answers like ``factory``."""

    def __init__(self, factory):
        self.factory, self.roles = factory, []

    def __call__(self, role):
        self.roles.append(role)
        return self.factory(role)


def current_dpa_factory(role):
    """Current scaling everywhere (E5M2 for every backward slot, the hint dpa_grad_input too)."""
    backward = role is not None and (role.tensor_type in ("grad_output", "do", "dp") or role.name.endswith("dpa_grad_input"))
    return Float8CurrentScalingQuantizer(fp8_dtype="e5m2" if backward else "e4m3")


def _decoder():
    return models.seeded(models.DecoderBlock(attention="sdpa"))


def test_dpa_roles_are_asked_for_only_under_fp8_dpa():
    x = torch.randn(2, 32, 64)
    asked = Asked(current_dpa_factory)
    plan = graphquant.explain(_decoder(), CustomRecipe(asked), x)
    assert not [r for r in asked.roles if r.module_type == "dpa" or "dpa_" in r.name]
    assert "dpa" not in {g.module_type for g in plan.gemms}

    asked = Asked(current_dpa_factory)
    plan = graphquant.explain(_decoder(), CustomRecipe(asked, fp8_dpa=True), x)
    attention = [r for r in asked.roles if r.module_type == "dpa" or "dpa_" in r.name]
    assert [str(r) for r in attention] == [
        "module_type=dpa|tensor_type=qkv|name=attn",
        "name=attn.dpa_output",
        "module_type=dpa|tensor_type=s|name=attn",
        "name=attn.dpa_grad_input",
        "module_type=dpa|tensor_type=do|name=attn",
        "module_type=dpa|tensor_type=dp|name=attn",
    ]
    rows = [(g.site, g.gemm, g.a, g.b) for g in plan.gemms if g.module_type == "dpa"]
    assert rows == [
        ("attn#0", "qk", "Q: qkv.rowwise", "K: qkv.rowwise"),
        ("attn#0", "pv", "P: s.rowwise", "V: qkv.columnwise"),
        ("attn#0", "dv", "P: s.columnwise", "dO: do.columnwise"),
        ("attn#0", "dp", "dO: do.rowwise", "V: qkv.rowwise"),
        ("attn#0", "dq", "dS: dp.rowwise", "K: qkv.columnwise"),
        ("attn#0", "dk", "dS: dp.columnwise", "Q: qkv.columnwise"),
    ]
    formats = {(g.gemm, g.a): g.a_format for g in plan.gemms if g.module_type == "dpa"}
    assert formats[("dq", "dS: dp.rowwise")] == "fp8_current(fp8_dtype=e5m2)"
    text = str(plan)
    assert "attn#0" in text and "attention emulation" in text
    doc = json.loads(plan.to_json())
    assert {"role": {"module_type": "", "tensor_type": "", "name": "attn.dpa_output"}, "quantizer": "fp8_current(fp8_dtype=e4m3)"} in doc["slots"]
    assert graphquant.Plan.from_json(plan.to_json()) == plan


def test_a_delayed_scaling_request_gives_the_backward_slots_and_the_grad_input_hint_e5m2():
    recipe = dataclasses.replace(recipes.delayed_scaling(), fp8_dpa=True)
    plan = graphquant.explain(_decoder(), recipe, torch.randn(2, 32, 64))
    formats = {str(role): quantizer.fp8_dtype for role, quantizer in plan.slots if role.name.startswith("attn") and "proj" not in role.name}
    assert formats == {
        "module_type=dpa|tensor_type=qkv|name=attn": "e4m3", "name=attn.dpa_output": "e4m3",
        "module_type=dpa|tensor_type=s|name=attn": "e4m3", "name=attn.dpa_grad_input": "e5m2",
        "module_type=dpa|tensor_type=do|name=attn": "e5m2", "module_type=dpa|tensor_type=dp|name=attn": "e5m2",
    }


def test_fp8_attention_joins_a_delayed_scaling_recipe_with_its_own_requests():
    plan = graphquant.explain(_decoder(), zoo.with_fp8_attention(recipes.delayed_scaling()), torch.randn(2, 32, 64))
    histories = {(role.module_type, role.tensor_type): getattr(q, "amax_history_len", None) for role, q in plan.slots if role.name.startswith("attn")}
    assert histories[("dpa", "dp")] == 1 and histories[("dpa", "s")] is None  # s: softmax_output_format's, no history
    assert histories[("linear", "input")] == 1024


def test_te_slots_of_a_site():
    """TE's DotProductAttention: 9 forward slots (qkv x3, output boundary x3, s x3) and 6 backward
    (grad_input boundary x2, do x2, dp x2); the factory is asked once per distinct role."""
    from graphquant.passes.find_attention import DpaSite

    site = DpaSite("layers.1.attn", 0, (2, 4, 64, 32), (2, 2, 64, 32), (2, 2, 64, 32))
    roles = site.roles()
    assert len(roles) == 15
    assert [r.tensor_type or r.name for r in roles] == (
        ["qkv"] * 3 + ["layers.1.attn.dpa_output"] * 3 + ["s"] * 3
        + ["layers.1.attn.dpa_grad_input"] * 2 + ["do"] * 2 + ["dp"] * 2
    )


def test_zoo_nvfp4_linear_fp8_dpa_reaches_attention():
    recipe = zoo.recipe("nvfp4_linear_fp8_dpa")
    assert recipe.fp8_dpa
    plan = graphquant.explain(_decoder(), recipe, torch.randn(2, 32, 64))
    slots = {str(role): q.spec for role, q in plan.slots}
    assert slots["module_type=dpa|tensor_type=qkv|name=attn"] == "fp8_current(fp8_dtype=e4m3)"
    assert slots["module_type=dpa|tensor_type=s|name=attn"] == P_FORMAT  # the factory's DELAYED_S, as P takes it
    assert slots["module_type=dpa|tensor_type=do|name=attn"] == "fp8_current(fp8_dtype=e5m2)"
    assert slots["module_type=dpa|tensor_type=dp|name=attn"] == DELAYED_DP
    assert slots["name=attn.dpa_grad_input"] == "fp8_current(fp8_dtype=e5m2)"
    assert slots["module_type=linear|tensor_type=input|name=attn.q_proj"].startswith("nvfp4(")


def _with_dpa(dpa_answer, hint_answer=None, tensor_type="s"):
    """current_dpa_factory with the dpa role of ``tensor_type`` (or, given, the hint roles)
    answered otherwise."""
    def factory(role):
        if hint_answer is not None and role is not None and "dpa_" in role.name:
            return hint_answer()
        if role is not None and role.module_type == "dpa" and dpa_answer is not None and role.tensor_type == tensor_type:
            return dpa_answer()
        return current_dpa_factory(role)
    return factory


@pytest.mark.parametrize(
    "factory, message",
    [
        (_with_dpa(NVFP4Quantizer), r"attn#0 \(dpa\) s: the factory gave nvfp4\(\) \(attention takes no NVFP4\)"),
        (_with_dpa(IdentityQuantizer), r"attn#0 \(dpa\) s: the factory gave identity\(\)"),
        (_with_dpa(lambda: HybridQuantizer(rowwise_quantizer=MXFP8Quantizer(), columnwise_quantizer=MXFP8Quantizer())), r"\(dpa\) s: .*Float8CurrentScalingQuantizer or Float8DelayedScalingQuantizer or MXFP8Quantizer"),
        (_with_dpa(None, hint_answer=NVFP4Quantizer), r"attn#0 \(dpa\) attn.dpa_output: the factory gave nvfp4\(\)"),
        (_with_dpa(NVFP4Quantizer, tensor_type="qkv"), r"attn#0 \(dpa\) qkv: the factory gave nvfp4\(\) \(attention takes no NVFP4\)"),
        (_with_dpa(lambda: Float8RowwiseQuantizer("e4m3"), tensor_type="qkv"),
         r"attn#0 \(dpa\) qkv: the factory gave fp8_rowwise\(fp8_dtype=e4m3\), .*Float8CurrentScalingQuantizer or Float8DelayedScalingQuantizer or MXFP8Quantizer"),
    ],
)
def test_te_constraints_are_plan_errors(factory, message):
    with pytest.raises(PlanError, match=message):
        graphquant.explain(_decoder(), CustomRecipe(factory, fp8_dpa=True), torch.randn(2, 32, 64))


def test_a_delayed_scaling_request_unlike_the_zoo_s_names_both_roles():
    """The user's qkv request (history 4) against the zoo's s request (history 1): the error named s alone."""
    def factory(role):
        if role is not None and role.module_type == "dpa" and role.tensor_type == "qkv":
            return DelayedScalingRequest(fp8_format="HYBRID", amax_history_len=4)
        return zoo.fp8_attention_factory(role)

    with pytest.raises(PlanError, match=r"DelayedScalingRequests of different amax_history_len for roles "
                                        r"module_type=dpa\|tensor_type=qkv\|name=attn \(4\) and module_type=dpa\|tensor_type=s\|name=attn \(1\)"):
        graphquant.explain(_decoder(), CustomRecipe(factory, fp8_dpa=True), torch.randn(2, 32, 64))


@dataclasses.dataclass(frozen=True)
class OwnDelayed(Float8DelayedScalingQuantizer):
    """A user's delayed-scaling format (its own class, so its own scaling)."""

    tag = "own_delayed"
    attention_format = True


@dataclasses.dataclass(frozen=True)
class OwnCurrent(Float8CurrentScalingQuantizer):
    """A user's stateless per-tensor format."""

    tag = "own_current"
    attention_format = True


def test_p_takes_a_stateless_format_of_the_users_own_and_refuses_one_with_state():
    """The built-in per-tensor formats scale P by its bound; a user's own stateless format scales
    P as it does; a user's format keeping state (carried between calls) is refused."""
    plan = graphquant.explain(_decoder(), CustomRecipe(_with_dpa(OwnCurrent), fp8_dpa=True), torch.randn(2, 32, 64))
    assert dict(plan.slots)[QuantizerRole("dpa", "s", "attn")] == OwnCurrent()
    with pytest.raises(PlanError, match=r"attn#0 \(dpa\) s: the s slot takes a format that keeps no state .*, not own_delayed\("):
        graphquant.explain(_decoder(), CustomRecipe(_with_dpa(lambda: OwnDelayed(amax_history_len=1)), fp8_dpa=True), torch.randn(2, 32, 64))


def test_mxfp8_blocks_must_tile_the_sequence():
    def factory(role):
        return MXFP8Quantizer() if role is not None and (role.module_type == "dpa" or "dpa_" in role.name) else IdentityQuantizer()

    with pytest.raises(PlanError, match=r"attn#0 \(dpa\) Q \(qkv\): mxfp8.* each of the 4 batch entries has 24 rows; .* multiple of 32"
                       r".*This attention's query length 24, key length 24, head dims 32 and 32: a block format needs them whole blocks"):
        graphquant.explain(_decoder(), CustomRecipe(factory, fp8_dpa=True), torch.randn(2, 24, 64))
    # In a dynamic graph the message names this call's sizes, not the graph's symbols ("s27 rows").
    compiled = graphquant.compile(_decoder(), CustomRecipe(factory, fp8_dpa=True), backend="aot_eager", dynamic=True)
    compiled(torch.randn(2, 32, 64))
    with pytest.raises(PlanError, match=r"each of the 4 batch entries has 24 rows; .* query length 24, key length 24, head dims 32"):
        compiled(torch.randn(2, 24, 64))


class DropoutAttention(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = DropoutAttention()

    def forward(self, q, k, v):
        return self.attn(q, k, v)


def test_dropout_is_a_plan_error():
    """It names the site and the call, not the FX node, and the configs' keys for dropout."""
    q = torch.randn(1, 2, 32, 32)
    with pytest.raises(PlanError, match=r"^attn#0: F.scaled_dot_product_attention\(\.\.\., dropout_p=0.1\) under fp8_dpa; .*"
                                        r"\(e.g. attention_dropout or attn_pdrop in a transformers config\)"):
        graphquant.explain(Block(), CustomRecipe(current_dpa_factory, fp8_dpa=True), q, q, q)


class BiasedAttention(torch.nn.Module):
    """T5's learned relative-position bias as a mask that requires grad; its key and value may be
    of batch 1 against the query's batch (a shared prefix)."""

    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(1, 2, 32, 32))

    def forward(self, q, k, v, learned):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias if learned else None)


@pytest.mark.parametrize("case, reason", [
    ("learned bias", "its attn_mask requires grad (a learned attention bias"),
    ("broadcast batch", "key and value of batch 1 and 1 broadcast against the query's 2"),
    ("broadcast query head", "a query of 1 head broadcast against 2 key and value heads"),  # was an error blaming the key/value heads
])
def test_attention_fp8_cannot_take_stays_in_high_precision_saying_why(case, reason):
    q = torch.randn(2, 2, 32, 32, requires_grad=True)
    kv = q.detach()[:1] if case == "broadcast batch" else q.detach()
    if case == "broadcast query head":
        q = torch.randn(2, 1, 32, 32, requires_grad=True)
    model = BiasedAttention()
    plan = graphquant.explain(model, CustomRecipe(current_dpa_factory, fp8_dpa=True), q, kv, kv, case == "learned bias")
    assert "dpa" not in {g.module_type for g in plan.gemms}
    assert any(reason in why for _, why in plan.skipped), plan.skipped
    compiled = graphquant.compile(model, CustomRecipe(current_dpa_factory, fp8_dpa=True), backend="aot_eager")
    assert torch.equal(compiled(q, kv, kv, case == "learned bias"), model(q, kv, kv, case == "learned bias"))


def test_trains_compiled_and_dumps_the_attention_site(tmp_path):
    """Compiled (aot_eager), the attention runs as graphquant.ops.attention with its formats in the
    graph; two training steps keep every value finite and move the delayed scales."""
    model = _decoder()
    compiled = graphquant.compile(model, zoo.recipe("nvfp4_linear_fp8_dpa"), backend="aot_eager", dump_dir=str(tmp_path))
    x = torch.randn(2, 32, 64)
    for _ in range(2):
        compiled(x).square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    rewritten = (tmp_path / "graph_000_rewritten.py").read_text()
    assert "quantized_attention" in rewritten and "AttentionSite(name='attn', call=0, qkv='fp8_current(fp8_dtype=e4m3)'" in rewritten
    states = compiled.graphquant.state_dict()
    assert states["module_type=dpa|tensor_type=dp|name=attn"][0] != 1  # the second step's scale, from the first's amax
    assert "module_type=dpa|tensor_type=s|name=attn" not in states  # P's scale is its bound's, no state


def _tiny_llama(layers: int):
    """A transformers Llama of ``layers`` layers with sdpa attention, grouped-query (2 query heads,
    1 key/value head), seeded."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, attn_implementation="sdpa", bos_token_id=0,
        eos_token_id=None, pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def test_a_checkpoint_with_an_s_entry_loads_leaving_it_out():
    """A state saved when the s slot kept delayed-scaling state loads, before the first call or
    after it, its s entry left out with a word."""
    compiled = graphquant.compile(_decoder(), zoo.recipe("nvfp4_linear_fp8_dpa"), backend="aot_eager")
    x = torch.randn(2, 32, 64)
    compiled(x).square().mean().backward()
    old = compiled.graphquant.state_dict() | {"module_type=dpa|tensor_type=s|name=attn": torch.tensor([448.0, 1.0])}
    for calls_first in (False, True):
        resumed = graphquant.compile(_decoder(), zoo.recipe("nvfp4_linear_fp8_dpa"), backend="aot_eager")
        if calls_first:
            resumed(x).square().mean().backward()
        with pytest.warns(UserWarning, match=r"attention s entries \(module_type=dpa\|tensor_type=s\|name=attn\) are left out"):
            resumed.graphquant.load_state_dict(old)
        resumed(x).square().mean().backward()
        assert "module_type=dpa|tensor_type=s|name=attn" not in resumed.graphquant.state_dict()


def test_p_is_scaled_by_its_bound_whatever_ran_before():
    """A decode step's P (one query over many keys) peaks far under 1; a delayed-scaling history of
    P's amax carried it into the next prefill, whose first row's P of 1 then saturated (logits
    half off after a generate). P's scale is now its bound's: a prefill gives the same bits
    before and after a generate, and on a fresh model's first call."""
    model = _tiny_llama(layers=1).eval()
    only_attention = zoo.with_fp8_attention(CustomRecipe(lambda role: IdentityQuantizer()))  # the zoo's attention formats
    compiled = graphquant.compile(model, only_attention, backend="aot_eager")
    ids = torch.randint(1, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        first = compiled(ids).logits
        compiled.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        after_generate = compiled(ids).logits
        reference = model(ids).logits
    torch.testing.assert_close(after_generate, first, rtol=0, atol=0)
    assert (first - reference).norm() / reference.norm() < 0.05


def test_numerics_report_lists_attention_products():
    report = graphquant.numerics(_decoder(), CustomRecipe(current_dpa_factory, fp8_dpa=True), torch.randn(2, 32, 64))
    rows = {(g.site, g.gemm) for g in report.gemms}
    assert {("attn#0", p) for p in ("qk", "pv", "dv", "dp", "dq", "dk")} <= rows


def test_hugging_face_llama_trains_with_fp8_attention():
    """A transformers Llama (sdpa attention, grouped-query: 2 query heads, 1 key/value head)
    compiles in one graph with a dpa site per layer named as named_modules() names its attention,
    and trains a step."""
    model = _tiny_llama(layers=2)
    compiled = graphquant.compile(model, CustomRecipe(current_dpa_factory, fp8_dpa=True), backend="aot_eager", fullgraph=True)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    before = copy.deepcopy(model.state_dict())
    loss = compiled(ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    names = {name for name, _ in model.named_modules()}
    sites = {g.site for g in compiled.graphquant.plan.gemms if g.module_type == "dpa"}
    assert sites == {"model.layers.0.self_attn#0", "model.layers.1.self_attn#0"}
    assert {s.removesuffix("#0") for s in sites} <= names
    assert torch.isfinite(loss)
    changed = [n for n, p in model.state_dict().items() if not torch.equal(p, before[n])]
    assert "model.layers.0.self_attn.q_proj.weight" in changed and "model.layers.1.self_attn.k_proj.weight" in changed


def test_with_fp8_attention_keeps_the_recipe_elsewhere():
    """zoo.with_fp8_attention: attention as TE's validated combination quantizes it, every other
    role as the recipe did; the recipe still pickles."""
    import pickle

    recipe = zoo.with_fp8_attention(graphquant.recipes.mxfp8_block_scaling())
    assert recipe.fp8_dpa and pickle.loads(pickle.dumps(recipe)).fp8_dpa
    plan = graphquant.explain(_decoder(), recipe, torch.randn(2, 32, 64))
    slots = {str(role): q.spec for role, q in plan.slots}
    assert slots["module_type=dpa|tensor_type=dp|name=attn"] == DELAYED_DP
    assert slots["name=attn.dpa_output"] == "fp8_current(fp8_dtype=e4m3)"
    assert slots["module_type=linear|tensor_type=input|name=attn.q_proj"] == "mxfp8(fp8_dtype=e4m3)"


def test_inference_runs_the_forward_products_alone():
    """Under torch.no_grad the plan lists qk and pv only, and the compiled model runs."""
    model = _decoder()
    recipe = CustomRecipe(current_dpa_factory, fp8_dpa=True)
    x = torch.randn(2, 32, 64)
    with torch.no_grad():
        plan = graphquant.explain(model, recipe, x, mode="inference")
        out = graphquant.compile(model, recipe, backend="aot_eager")(x)
    assert [g.gemm for g in plan.gemms if g.module_type == "dpa"] == ["qk", "pv"]
    assert torch.isfinite(out).all()


class _Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


def test_inference_mode_runs_no_attention_backward_as_it_runs_no_linear_backward():
    """mode="inference" plans qk and pv alone: with inputs that require a gradient the attention's
    output required one too, and backward() ran dQ, dK and dV, which the plan did not list."""
    recipe = CustomRecipe(current_dpa_factory, fp8_dpa=True)
    q, k, v = (torch.randn(2, 2, 32, 32, requires_grad=True) for _ in range(3))
    compiled = graphquant.compile(_Attention(), recipe, backend="aot_eager", mode="inference")
    with pytest.warns(UserWarning, match="no gradient flows"):
        out = compiled(q, k, v)
    assert [g.gemm for g in compiled.graphquant.plan.gemms] == ["qk", "pv"]
    assert not out.requires_grad


@pytest.mark.parametrize("kv_length, empty", [
    (32, "q batch = 0, k batch = 0, v batch = 0"),  # was a ZeroDivisionError
    (0, "k length = 0, v length = 0"),  # was "cannot reshape tensor of 0 elements"
])
def test_an_empty_attention_runs_in_high_precision_saying_why(kv_length, empty):
    """As an empty linear does: nothing to quantize, torch's attention runs it."""
    batch = 0 if kv_length else 2
    q = torch.randn(batch, 2, 32, 32, requires_grad=True)
    k, v = (torch.randn(batch, 2, kv_length, 32, requires_grad=True) for _ in range(2))
    compiled = graphquant.compile(_Attention(), CustomRecipe(current_dpa_factory, fp8_dpa=True), backend="aot_eager")
    with pytest.warns(UserWarning, match="found no GEMM"):
        out = compiled(q, k, v)
    out.sum().backward()
    assert torch.equal(out, _Attention()(q, k, v)) and torch.equal(q.grad, torch.zeros_like(q))
    assert [why for _, why in compiled.graphquant.plan.skipped] == [f"attention in high precision: it is empty ({empty}), nothing to quantize"]
    assert not compiled.graphquant.plan.gemms


class _AtenAttention(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.ops.aten.scaled_dot_product_attention(q, k, v)


def test_attention_called_as_an_aten_op_is_listed_as_in_high_precision_with_what_to_call():
    """It was neither a site nor listed under fp8_dpa, as torch.ops.aten.mm is listed."""
    q = torch.randn(1, 2, 32, 32)
    plan = graphquant.explain(_AtenAttention(), CustomRecipe(current_dpa_factory, fp8_dpa=True), q, q, q)
    assert not plan.gemms
    assert [why for _, why in plan.skipped] == [
        "torch.ops.aten.scaled_dot_product_attention called as an op runs in high precision: call "
        "torch.nn.functional.scaled_dot_product_attention, which FP8 attention (fp8_dpa) quantizes"
    ]


class _FixedQueries(torch.nn.Module):
    """Attention of fixed queries (a buffer: no gradient) over keys and values of the input."""

    def __init__(self):
        super().__init__()
        self.kv = torch.nn.Linear(64, 128)
        self.register_buffer("queries", torch.randn(2, 2, 32, 32, generator=torch.Generator().manual_seed(3)))

    def forward(self, x):
        k, v = self.kv(x).view(2, 32, 2, 2, 32).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(self.queries, k, v).sum()


@pytest.mark.parametrize("case", ["fixed queries", "frozen projections"])
def test_the_plan_lists_the_backward_products_that_run(case):
    """The backward runs dQ where Q gets a gradient, dK and dV where theirs do, dP for either: the
    plan listed all four whenever a graph trained, and graphquant.numerics reported a dQ the
    compiled model never ran (its eager backward computed it anyway)."""
    recipe = CustomRecipe(current_dpa_factory, fp8_dpa=True)
    if case == "fixed queries":
        model, x, expected = models.seeded(_FixedQueries()), torch.randn(2, 32, 64), ["qk", "pv", "dv", "dp", "dk"]
    else:
        model, x, expected = _decoder(), torch.randn(2, 32, 64), ["qk", "pv"]
        for frozen in (model.norm1, model.attn.q_proj, model.attn.k_proj, model.attn.v_proj):  # o_proj and the MLP train
            frozen.requires_grad_(False)
    compiled = graphquant.compile(model, recipe, backend="aot_eager")
    compiled(x).sum().backward()
    assert [g.gemm for g in compiled.graphquant.plan.gemms if g.module_type == "dpa"] == expected
    report = graphquant.numerics(model, recipe, x)
    assert sorted(g.gemm for g in report.gemms if g.module_type == "dpa") == sorted(expected)


def test_strict_rejects_the_emulated_attention():
    plan = graphquant.explain(_decoder(), CustomRecipe(current_dpa_factory, fp8_dpa=True), torch.randn(2, 32, 64), strict=True)
    rows = [g for g in plan.gemms if g.module_type == "dpa"]
    assert rows and all(g.bucket == "rejected" and "strict=True rejects emulated attention" in g.reason for g in rows)


def fp8_attention_only_factory(role):
    """Attention as the zoo's validated combination, every GEMM in high precision."""
    return zoo.fp8_attention_factory(role) if zoo.is_attention(role) else IdentityQuantizer()


class EagerAttention(torch.overrides.TorchFunctionMode):
    """Runs every F.scaled_dot_product_attention as graphquant.ops.attention with one site."""

    def __init__(self, site, states):
        super().__init__()
        self.site, self.states = site, states

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            return quantized_attention(*args, **(kwargs or {}), site=self.site, states=self.states)
        return func(*args, **(kwargs or {}))


def test_the_compiled_graph_runs_the_op_with_the_plan_s_formats_and_state():
    """Compiled, a model computes what it computes eagerly with the op in place of
    F.scaled_dot_product_attention, the site's formats the plan's, over three steps in which the
    delayed-scaling state the compiled model keeps moves as the eager one does."""
    model = _decoder()
    eager = copy.deepcopy(model)
    compiled = graphquant.compile(model, CustomRecipe(fp8_attention_only_factory, fp8_dpa=True), backend="aot_eager")
    site = AttentionSite(name="attn", call=0, **ZOO)
    states = _states(ZOO)
    for step in range(3):
        x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(step))
        y = compiled(x)
        y.square().mean().backward()
        with EagerAttention(site, states):
            y_eager = eager(x)
        y_eager.square().mean().backward()
        torch.testing.assert_close(y, y_eager, rtol=0, atol=0)
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0, msg=lambda m: f"step {step} {name}.grad: {m}")
    kept = compiled.graphquant.state_dict()
    for slot, state in zip(("qkv", "s", "do", "dp"), states):
        if state is not None:
            torch.testing.assert_close(kept[f"module_type=dpa|tensor_type={slot}|name=attn"], state, rtol=0, atol=0)


def test_attention_inside_torch_vmap_runs_in_high_precision_and_is_listed():
    """Attention vmapped over a stack of (batch, heads, length, dim) operands became a dpa site,
    whose op then failed under vmap with functorch's message about autograd.Function: it runs in
    high precision, listed with why, and the model trains."""

    class Stacked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(64, 192)

        def forward(self, x):
            q, k, v = self.qkv(x).view(2, 32, 3, 2, 32).permute(2, 0, 3, 1, 4).unsqueeze(1).expand(3, 3, 2, 2, 32, 32)
            attend = lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True)  # noqa: E731
            return torch.vmap(attend)(q, k, v)

    compiled = graphquant.compile(Stacked(), CustomRecipe(current_dpa_factory, fp8_dpa=True), backend="aot_eager")
    compiled(torch.randn(2, 32, 64)).sum().backward()
    [(what, why)] = compiled.graphquant.plan.skipped
    assert "scaled_dot_product_attention(" in what and why.startswith("inside torch.func's vmap")
    assert {g.module_type for g in compiled.graphquant.plan.gemms} == {"linear"}


class _AttributeAttention(torch.nn.Module):
    """Attention whose dropout and scale are float attributes, as transformers' are
    (``dropout_p=self.attention_dropout`` while training, ``scale=self.scaling``)."""

    def __init__(self, p: float):
        super().__init__()
        self.p, self.scaling = p, 32**-0.5

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, scale=self.scaling)


def test_float_attributes_traced_as_symbols_are_their_numbers():
    """Under dynamic=True Dynamo traces a model's float attributes as symbols: a transformers
    model training with attention dropout 0.0 was refused as "dropout_p=item_3". The check reads
    the number, guarded, so that another dropout recompiles and is refused naming it."""
    model = _AttributeAttention(0.0)
    compiled = graphquant.compile(model, CustomRecipe(current_dpa_factory, fp8_dpa=True), backend="aot_eager", dynamic=True)
    q = torch.randn(2, 2, 32, 32, requires_grad=True)
    compiled(q, q, q).sum().backward()
    assert {g.site for g in compiled.graphquant.plan.gemms} == {"dpa#0"}
    assert torch.isfinite(q.grad).all()
    model.p = 0.1
    with pytest.raises(PlanError, match=r"dropout_p=0.1\) under fp8_dpa"):
        compiled(q, q, q)
