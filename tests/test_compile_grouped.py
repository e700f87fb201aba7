"""torch._grouped_mm (MoE experts) under graphquant.compile: each expert its own quantized GEMM.

The reference below is independent of graphquant's compiler: for each group g it quantizes
x_g, W_g^T = w[g]^T and grad_output_g with graphquant.quantizers (reference.ref_quantize, which
honours hybrids), dequantizes them and multiplies in float64. torch._grouped_mm only traces in
bfloat16 on CPU (its meta function requires it), so results are bfloat16: a compiled value may
differ from the float64 one by the fp32 accumulation bound plus one bfloat16 rounding.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from reference import (  # noqa: F401  (fresh_dynamo is an autouse fixture)
    EPS32,
    INDUCTOR_SLACK,
    GemmTape,
    Reference,
    assert_same_results,
    forward_backward,
    fresh_dynamo,
    ref_dequantize,
    ref_quantize,
)

import graphquant
from graphquant import CustomRecipe, PlanError, factories, recipes, zoo
from graphquant.quantizers import COLUMNWISE, ROWWISE, Float8CurrentScalingQuantizer, IdentityQuantizer, MXFP8Quantizer

E, K, N, T = 4, 64, 32, 128
SIZES = (32, 0, 64, 32)  # expert 1 gets no rows
BF16_ROUNDING = 2.0**-8

RECIPES = {
    "mxfp8": recipes.mxfp8_block_scaling,
    "current": recipes.current_scaling,  # per-group E4M3 scales, E5M2 grad_output
    "hybrid": lambda: zoo.recipe("mxfp8_fwd_high_precision_bwd"),  # columnwise of rowwise_dequantized
    "identity": lambda: CustomRecipe(factories.high_precision_factory),
}


class MoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        weights = torch.randn(E, K, N, generator=torch.Generator().manual_seed(1)) / K**0.5
        self.experts = torch.nn.Parameter(weights.to(torch.bfloat16))

    def forward(self, x, offs):
        return torch._grouped_mm(x, self.experts, offs=offs)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.moe = MoE()

    def forward(self, x, offs):
        return self.moe(x, offs)


def offsets(sizes=SIZES):
    return torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)


def inputs():
    """x whose groups differ in magnitude by 2^10 (one per-tensor scale would not fit both), and a
    bfloat16 probe so that grad_output of the loss (y * probe).sum() is the probe exactly."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(T, K, generator=generator)
    x[96:] *= 1024.0
    probe = torch.randn(T, N, generator=generator).to(torch.bfloat16).float()
    return x.to(torch.bfloat16), probe


def run(model, x, offs, probe):
    x = x.clone().requires_grad_()
    model.moe.experts.grad = None
    y = model(x, offs)
    (y.float() * probe).sum().backward()
    return {"y": y, "dx": x.grad, "dw": model.moe.experts.grad}


def product(a, b):
    """a @ b in float64 and its fp32 accumulation bound (reference.gemm_bound's rule)."""
    return a @ b, (a.shape[1] + 4) * EPS32 * (a.abs() @ b.abs())


def reference(recipe, x, w, offs, probe):
    """Outputs and gradients of the grouped product, group by group, in float64, with bounds."""
    roles = {t: graphquant.QuantizerRole("grouped_linear", t, "moe.grouped_linear.0") for t in ("input", "weight", "grad_output")}
    q = {t: recipe.qfactory(role) for t, role in roles.items()}
    dy = probe.to(torch.bfloat16)
    bounds = [0] + offs.tolist()

    def deq(tensor, tensor_type, direction):
        return ref_dequantize(ref_quantize(tensor, q[tensor_type], direction, graphquant.QuantizeContext()))

    ys, dxs, dws = [], [], []
    for g, (a, b) in enumerate(zip(bounds, bounds[1:])):
        wt = w[g].t().contiguous()  # W_g, (N, K)
        ys.append(product(deq(x[a:b], "input", ROWWISE), deq(wt, "weight", ROWWISE).t()))
        dxs.append(product(deq(dy[a:b], "grad_output", ROWWISE), deq(wt, "weight", COLUMNWISE)))
        dw_t = product(deq(dy[a:b], "grad_output", COLUMNWISE).t(), deq(x[a:b], "input", COLUMNWISE))
        dws.append(tuple(t.t().unsqueeze(0) for t in dw_t))
    cat = lambda parts, dim=0: tuple(torch.cat([p[i] for p in parts], dim) for i in range(2))  # noqa: E731
    return {"y": cat(ys), "dx": cat(dxs), "dw": cat(dws)}


def assert_close(actual, expected):
    for key, (value, bound) in expected.items():
        diff = (actual[key].double() - value).abs()
        allowed = bound + BF16_ROUNDING * value.abs()
        worst = (diff - allowed).max().item()
        assert worst <= 0, f"{key}: exceeds fp32 accumulation + bf16 rounding by {worst:.3g}"


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_grouped_mm_matches_per_group_reference(name):
    calls = []
    factory = RECIPES[name]().qfactory
    recipe = CustomRecipe(lambda role: calls.append(role) or factory(role))
    model, (x, probe), offs = Model(), inputs(), offsets()
    compiled = graphquant.compile(copy.deepcopy(model), recipe, backend="aot_eager", fullgraph=True)
    actual = run(compiled, x, offs, probe)
    run(compiled, x, offs, probe)  # a second call asks the factory nothing

    assert len(calls) == 3 and {r.tensor_type for r in calls} == {"input", "weight", "grad_output"}
    plan = compiled.graphquant.plan
    assert [(g.site, g.module_type, g.gemm) for g in plan.gemms] == [
        ("moe.grouped_linear.0#0", "grouped_linear", gemm) for gemm in ("fprop", "dgrad", "wgrad")
    ]
    # No native grouped GEMM yet: only high-precision pairs (Identity x Identity) are native.
    assert all((g.bucket == "native") == (g.backend.name == "high-precision matmul") for g in plan.gemms)
    assert all(g.bucket == "native" for g in plan.gemms) == (name == "identity")
    assert_close(actual, reference(RECIPES[name](), x, model.moe.experts.detach(), offs, probe))


@pytest.mark.slow
def test_identity_recipe_equals_eager_grouped_mm():
    """torch._grouped_mm's own CPU backward fails in torch 2.13, so forward only; the gradients
    of the all-Identity recipe are checked against the float64 reference above."""
    model, (x, _), offs = Model(), inputs(), offsets()
    with pytest.warns(UserWarning, match="quantizes no GEMM"):
        compiled = graphquant.compile(copy.deepcopy(model), CustomRecipe(factories.high_precision_factory), fullgraph=True)
        with torch.no_grad():
            actual = compiled(x, offs)
    with torch.no_grad():
        eager = model(x, offs)
    value, bound = reference(CustomRecipe(factories.high_precision_factory), x, model.moe.experts.detach(), offs, torch.zeros(T, N))["y"]
    allowed = 2 * bound + BF16_ROUNDING * value.abs()
    assert ((actual.double() - eager.double()).abs() <= allowed).all()


def test_per_tensor_formats_get_one_scale_per_group():
    x, _ = inputs()
    quantizer = Float8CurrentScalingQuantizer("e4m3")
    data, scale, amax = torch.ops.graphquant.grouped_quantize(x, offsets(), quantizer.spec, ROWWISE, "moe")
    assert scale.shape == (E,) and amax.shape == (E,)
    assert scale[3] > 500 * scale[0]  # the 1024x group has its own, larger decode scale
    assert torch.equal(scale[2], quantizer.quantize_rowwise(x[32:96], graphquant.QuantizeContext()).scale.reshape(()))


def test_group_that_does_not_tile_the_block_names_module_group_and_size():
    model, (x, probe), offs = Model(), inputs(), offsets((48, 16, 32, 32))
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match=r"moe\.grouped_linear\.0#0: group 0 of torch._grouped_mm has 48 rows"):
        run(compiled, x, offs, probe)


def test_unsupported_format_fails_the_plan():
    model, (x, probe), offs = Model(), inputs(), offsets()
    compiled = graphquant.compile(model, recipes.nvfp4_block_scaling(), backend="aot_eager", fullgraph=True)
    with pytest.raises(PlanError) as info:
        run(compiled, x, offs, probe)
    assert "moe.grouped_linear.0#0 (grouped_linear) input: nvfp4" in str(info.value)
    assert "not supported for torch._grouped_mm" in str(info.value)


def test_other_grouped_mm_forms_are_skipped_with_a_reason():
    a = torch.randn(E, 32, K, dtype=torch.bfloat16)
    b = torch.randn(E, K, N, dtype=torch.bfloat16)
    compiled = graphquant.compile(lambda a, b: torch._grouped_mm(a, b), recipes.mxfp8_block_scaling(), backend="aot_eager", fullgraph=True)
    with pytest.warns(UserWarning, match="found no GEMM"):
        compiled(a, b)
    [(_, reason)] = compiled.graphquant.plan.skipped
    assert "only x (T, K) with w (E, K, N) and offs" in reason


@pytest.mark.parametrize("quantizer", [MXFP8Quantizer(), Float8CurrentScalingQuantizer("e5m2")], ids=str)
def test_grouped_ops_pass_opcheck(quantizer):
    x, _ = inputs()
    w = torch.randn(E * N, K, dtype=torch.bfloat16)
    offs, w_offs = offsets(), torch.arange(1, E + 1, dtype=torch.int32) * N
    xq = torch.ops.graphquant.grouped_quantize(x, offs, quantizer.spec, ROWWISE, "moe")
    wq = torch.ops.graphquant.grouped_quantize(w, w_offs, quantizer.spec, ROWWISE, "moe")
    torch.library.opcheck(torch.ops.graphquant.grouped_quantize.default, (x, offs, quantizer.spec, COLUMNWISE, "moe"))
    without_schema = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")  # no allclose for FP8
    dequantize_args = (xq, quantizer.spec, ROWWISE, [T, K], offs, torch.bfloat16)
    gemm_args = (xq, quantizer.spec, ROWWISE, [T, K], offs, wq, quantizer.spec, ROWWISE, [E * N, K], w_offs, torch.bfloat16)
    torch.library.opcheck(torch.ops.graphquant.grouped_dequantize.default, dequantize_args, test_utils=without_schema)
    torch.library.opcheck(torch.ops.graphquant.grouped_gemm.default, gemm_args, test_utils=without_schema)


# -- an MoE layer's experts: two chained grouped GEMMs ---------------------------------------------

EXPERTS, DIM, HIDDEN, ROWS = 8, 128, 256, 64  # 64 rows an expert: whole MXFP8 blocks


class ExpertMLP(torch.nn.Module):
    """Up projection, SiLU, down projection, each a torch._grouped_mm over the experts.

    routed: inside the forward, a router picks each row's expert (argmax), the rows are sorted by
    expert and the group offsets counted (bincount, cumsum), as an MoE layer does; else the rows
    come sorted with fixed offsets. The router is a buffer: argmax passes no gradient back.
    """

    def __init__(self, routed: bool):
        super().__init__()
        generator = torch.Generator().manual_seed(3)
        self.routed = routed
        self.up = torch.nn.Parameter((torch.randn(EXPERTS, DIM, HIDDEN, generator=generator) / DIM**0.5).to(torch.bfloat16))
        self.down = torch.nn.Parameter((torch.randn(EXPERTS, HIDDEN, DIM, generator=generator) / HIDDEN**0.5).to(torch.bfloat16))
        self.register_buffer("router", torch.eye(EXPERTS, DIM, dtype=torch.bfloat16))  # reads the first EXPERTS features
        self.register_buffer("offs", torch.arange(1, EXPERTS + 1, dtype=torch.int32) * ROWS)

    def forward(self, x):
        offs, order = self.offs, None
        if self.routed:
            expert = F.linear(x, self.router).argmax(-1)
            order = expert.argsort(stable=True)
            offs = torch.bincount(expert, minlength=EXPERTS).cumsum(0).to(torch.int32)
            x = x[order]
        h = torch._grouped_mm(x, self.up, offs=offs)
        y = torch._grouped_mm(F.silu(h), self.down, offs=offs)
        return y if order is None else y[order.argsort()]


def chain_input(device):
    """ROWS rows an expert, shuffled; feature e of a row of expert e is raised by 8, so the
    router's argmax picks e with a margin no rounding can cross."""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(EXPERTS * ROWS, DIM, generator=generator)
    expert = torch.randperm(EXPERTS * ROWS, generator=generator) % EXPERTS
    x[:, :EXPERTS] += 8.0 * F.one_hot(expert, EXPERTS)
    return x.to(torch.bfloat16).to(device)


def experts_quantized(recipe):
    """``recipe`` on the grouped GEMMs; the router in high precision (its 8 outputs tile no
    32-row MXFP8 block)."""
    return CustomRecipe(lambda role: recipe.qfactory(role) if role.module_type == "grouped_linear" else IdentityQuantizer())


CHAIN_RECIPES = {"tensorwise": lambda: zoo.recipe("tensorwise"), "mxfp8": recipes.mxfp8_block_scaling}


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("routed", [False, True], ids=["fixed_offsets", "routed"])
@pytest.mark.parametrize("name", sorted(CHAIN_RECIPES))
def test_chained_grouped_mms_match_reference_under_aot_eager_and_inductor(name, routed, device):
    """aot_eager against the eager per-group reference (teacher-forced, tests/reference.py),
    then Inductor against aot_eager: the non-GEMM code Inductor compiles (SiLU, the routing)
    moves no quantized value."""
    recipe = experts_quantized(CHAIN_RECIPES[name]())
    model, x, tape = ExpertMLP(routed).to(device), chain_input(device), GemmTape()
    eager_model, ref_model, inductor_model = (copy.deepcopy(model) for _ in range(3))
    compiled = graphquant.compile(eager_model, recipe, backend=tape.backend, fullgraph=True)
    eager_graph = forward_backward(compiled, eager_model, x)
    expected = forward_backward(Reference(ref_model, recipe, tape=tape), ref_model, x)
    tape.assert_all_taken()
    assert_same_results(eager_graph, expected, what="aot_eager: ")
    grouped = [(g.site, g.bucket) for g in compiled.graphquant.plan.gemms if g.module_type == "grouped_linear"]
    assert grouped == [(f"grouped_linear.{i}#0", "emulated") for i in (0, 1) for _ in range(3)]

    torch._dynamo.reset()
    inductor = graphquant.compile(inductor_model, recipe, fullgraph=True)  # backend="inductor"
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        actual = forward_backward(inductor, inductor_model, x)
    assert_same_results(actual, eager_graph, slack=INDUCTOR_SLACK, what="inductor: ")
