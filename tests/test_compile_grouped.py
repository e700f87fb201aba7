"""torch._grouped_mm (MoE experts) under graphquant.compile: each expert its own quantized GEMM.

The reference is tests/reference.py's, independent of graphquant's compiler: for each group g it
quantizes x_g, W_g = w[g]^T and grad_output_g with graphquant.quantizers (each zero-padded to
whole blocks of the site's formats, as TE pads groups), dequantizes them and multiplies in
float64, teacher-forced by the compiled GEMM results (GemmTape). torch._grouped_mm only traces in
bfloat16 on CPU (its meta function requires it), so results are bfloat16.
"""

import copy
import dataclasses
import functools
import re
import types

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import FakeTensor
from reference import (  # noqa: F401  (fresh_dynamo is an autouse fixture)
    INDUCTOR_SLACK,
    GemmTape,
    Reference,
    assert_same_results,
    forward_backward,
    fresh_dynamo,
)
from test_plan_execution import fake_capability  # noqa: F401  (a fixture)

import graphquant
from graphquant import CustomRecipe, PlanError, factories, recipes, zoo
from graphquant.formats import fp8, groups
from graphquant.kernels import backends, native, scaled_mm
from graphquant.kernels import grouped as grouped_kernels
from graphquant.kernels.backends import GemmBackend, GemmMismatch
from graphquant.ops.functional import quantized_linear
from graphquant.ops.grouped import quantized_grouped_mm
from graphquant.ops.site import Site
from graphquant.quantizers import (
    COLUMNWISE,
    ROWWISE,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8DelayedScalingQuantizer,
    Float8RowwiseQuantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    QuantizeContext,
)

E, K, N = 4, 64, 32
SIZES = (40, 0, 57, 27)  # ragged (no multiple of any block, 124 rows in all) and one empty expert
T = sum(SIZES)


def nvfp4_without_sr(role):
    """nvfp4_factory (16x16 weight tiles, RHT on the columnwise input and grad_output) without
    stochastic rounding."""
    q = factories.nvfp4_factory(role)
    return NVFP4Quantizer(with_rht=q.with_rht, with_post_rht_amax=q.with_rht, with_2d_quantization=q.with_2d_quantization)


RECIPES = {
    "identity": lambda: CustomRecipe(factories.high_precision_factory),
    "current": recipes.current_scaling,  # per-group E4M3 scales, E5M2 grad_output
    "rowwise": lambda: zoo.recipe("rowwise"),  # per-row scales; columnwise per column of each group
    "blockwise": lambda: zoo.recipe("deepseek_blockwise"),  # 1x128 activations, 128x128 weights
    "mxfp8": recipes.mxfp8_block_scaling,
    "mxfp8_hp_bwd": lambda: zoo.recipe("mxfp8_fwd_high_precision_bwd"),  # columnwise of rowwise_dequantized
    "nvfp4": lambda: CustomRecipe(nvfp4_without_sr),  # per-group global amax, RHT, 2D tiles
    "nvfp4_block_scaling": recipes.nvfp4_block_scaling,  # grad_output stochastically rounded
    "mxfp8_fwd_nvfp4_bwd": lambda: zoo.recipe("mxfp8_fwd_nvfp4_bwd"),
    "nvfp4_row_scaled_mxfp8_bwd": lambda: zoo.recipe("nvfp4_row_scaled_fwd_mxfp8_bwd"),  # the zoo's expert recipe
    "nvfp4_row_scaled_hp_bwd": lambda: zoo.recipe("nvfp4_row_scaled_fwd_high_precision_bwd"),
}


class MoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        weights = torch.randn(E, K, N, generator=torch.Generator().manual_seed(1)) / K**0.5
        self.experts = torch.nn.Parameter(weights.to(torch.bfloat16))

    def forward(self, x, offs):
        return torch._grouped_mm(x, self.experts, offs=offs)


class Model(torch.nn.Module):
    def __init__(self, sizes=SIZES):
        super().__init__()
        self.moe = MoE()
        self.register_buffer("offs", offsets(sizes))

    def forward(self, x):
        return self.moe(x, self.offs)


def offsets(sizes=SIZES):
    return torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)


def inputs(rows=T):
    """x whose last group is 2^10 larger than the others (one per-tensor scale would not fit both)."""
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(2))
    x[rows - SIZES[-1] :] *= 1024.0
    return x.to(torch.bfloat16)


def run_against_reference(recipe, model, x, reference_recipe=None):
    tape = GemmTape()
    compiled_model, ref_model = copy.deepcopy(model), copy.deepcopy(model)
    compiled = graphquant.compile(compiled_model, recipe, backend=tape.backend, fullgraph=True)
    actual = forward_backward(compiled, compiled_model, x)
    expected = forward_backward(Reference(ref_model, reference_recipe or recipe, tape=tape), ref_model, x)
    tape.assert_all_taken()
    assert_same_results(actual, expected)
    return compiled


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_grouped_mm_matches_per_group_reference(name):
    """Outputs and both gradients of every format and hybrid, with ragged and empty groups,
    against each expert quantized alone (zero-padded to whole blocks) in float64."""
    calls = []
    factory = RECIPES[name]().qfactory
    recipe = CustomRecipe(lambda role: calls.append(role) or factory(role))
    compiled = run_against_reference(recipe, Model(), inputs(), RECIPES[name]())

    assert len(calls) == 3 and {r.tensor_type for r in calls} == {"input", "weight", "grad_output"}
    plan = compiled.graphquant.plan
    assert [(g.site, g.module_type, g.gemm) for g in plan.gemms] == [
        ("moe.grouped_linear.0#0", "grouped_linear", gemm) for gemm in ("fprop", "dgrad", "wgrad")
    ]
    # On the CPU only high-precision pairs (Identity x Identity) are native.
    assert all((g.bucket == "native") == (g.backend.name == "high-precision matmul") for g in plan.gemms)


class KeywordMoE(MoE):
    def forward(self, x, offs):
        return torch._grouped_mm(input=x, mat2=self.experts, offs=offs)


def test_grouped_mm_with_operands_by_keyword_is_a_grouped_site():
    """torch._grouped_mm(input=x, mat2=w, offs=offs) was listed as not of the quantized form and
    ran in high precision: the same site and bits as the positional call now."""
    model, keyword = Model(), Model()
    keyword.moe = KeywordMoE()
    outputs = []
    for m in (model, keyword):
        compiled = graphquant.compile(m, RECIPES["current"](), backend="aot_eager", fullgraph=True)
        outputs.append(compiled(inputs()))
        assert [g.site for g in compiled.graphquant.plan.gemms if g.gemm == "fprop"] == ["moe.grouped_linear.0#0"]
    assert torch.equal(*outputs)


@pytest.mark.slow
def test_identity_recipe_equals_eager_grouped_mm():
    """torch._grouped_mm's own CPU backward fails in torch 2.13, so forward only."""
    model, x = Model(), inputs()
    with pytest.warns(UserWarning, match="quantizes no GEMM"):
        compiled = graphquant.compile(copy.deepcopy(model), CustomRecipe(factories.high_precision_factory), fullgraph=True)
        with torch.no_grad():
            actual = compiled(x)
    with torch.no_grad():
        assert torch.equal(actual, model(x))


HOST_READS = ("tolist", "item", "__bool__", "__int__", "__index__", "__float__", "numpy", "cpu")


@pytest.mark.parametrize("name", ["current", "nvfp4_row_scaled_mxfp8_bwd"])
def test_grouped_path_reads_no_value_on_the_host(name, monkeypatch):
    """The offsets stay on the device: a compiled training step of a grouped site, the ops'
    implementations included, reads no tensor value in Python (on a GPU each read would wait for
    the device). A TorchFunctionMode does not see inside custom ops, so the reads themselves fail."""
    model, x = Model(), inputs()
    compiled = graphquant.compile(model, RECIPES[name](), backend="aot_eager", fullgraph=True)
    forward_backward(compiled, model, x)  # compiled before the reads fail

    def read(method):
        def fail(*args, **kwargs):
            raise AssertionError(f"Tensor.{method} read a value on the host on the grouped path")

        return fail

    for method in HOST_READS:
        monkeypatch.setattr(torch.Tensor, method, read(method))
    forward_backward(compiled, model, x)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name", ["rowwise", "current", "blockwise", "mxfp8", "nvfp4_row_scaled_mxfp8_bwd", "nvfp4_block_scaling"]
)
def test_grouped_training_step_does_not_synchronise_on_gpu(name):
    """Every grouped GEMM keeps the offsets on the device: the Triton FP8 grouped GEMM (every FP8
    GEMM, fast fprop and promoted dgrad and wgrad under rowwise and tensorwise; torch._scaled_grouped_mm
    for the fast ones where Triton is not installed), a bf16 torch._grouped_mm (MXFP8) and the
    Triton fp32-output kernel (NVFP4); stochastic rounding reads the step's [seed, step] there too."""
    model = Model().cuda()
    x = inputs().cuda().requires_grad_()
    grad = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
    compiled = graphquant.compile(model, RECIPES[name](), backend="aot_eager", fullgraph=True)

    def step():
        x.grad = model.moe.experts.grad = None
        compiled(x).backward(grad)

    step()  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(x.grad).all() and torch.isfinite(model.moe.experts.grad).all()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["nvfp4_block_scaling", "mxfp8_fwd_nvfp4_bwd"])
def test_grouped_stochastic_rounding_matches_per_group_reference_on_gpu(name, monkeypatch):
    """The native grouped quantize draws its stochastic rounding from the device's [seed, step]
    as the per-group reference does, each padded group alone (NVFP4's vectorised fallback
    runs only where the compiler traces with fake tensors)."""
    fallback = NVFP4Quantizer.quantize_groups

    def traced_only(self, x, *args):
        assert isinstance(x, FakeTensor), "the grouped NVFP4 quantize fell back to quantize_groups on the GPU"
        return fallback(self, x, *args)

    monkeypatch.setattr(NVFP4Quantizer, "quantize_groups", traced_only)
    run_against_reference(RECIPES[name](), Model().cuda(), inputs().cuda())


def fast_everywhere(recipe: CustomRecipe) -> CustomRecipe:
    """``recipe`` with every GEMM allowed to sum in the tensor cores' accumulator, which
    torch._scaled_grouped_mm always does."""
    return dataclasses.replace(recipe, fast_accumulation=("fprop", "dgrad", "wgrad"))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["rowwise", "current"])
def test_grouped_gemms_that_promote_match_per_group_reference_on_gpu(name, without_triton_grouped_gemm):
    """With every GEMM's sums kept in fp32 and no native grouped GEMM that promotes, the grouped
    GEMMs run emulated on the GPU too, and match each expert quantized alone in float64, ragged
    and empty groups included."""
    recipe = dataclasses.replace(RECIPES[name](), fast_accumulation=())
    compiled = run_against_reference(recipe, Model().cuda(), inputs().cuda())
    assert {g.backend.name for g in compiled.graphquant.plan.gemms} == {backends.EMULATION}


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["rowwise", "current"])
def test_native_fp8_grouped_gemms_run_where_the_recipe_accumulates_fast_on_gpu(name, grouped_gemm, monkeypatch):
    """Where the recipe lets every GEMM accumulate fast: graphquant's CUDA grouped GEMM, promoted,
    where the extension runs it; else the Triton FP8 grouped GEMM with fast accumulation (every
    GEMM; torch._scaled_grouped_mm where Triton is not installed: E4M3 per-row GEMMs, per-tensor
    fprop, the E5M2 gradients' GEMMs emulated): the step equals the
    promoted, emulated one to within fast accumulation's error (no element bound is claimed for
    the step; tests/test_triton_grouped_fp8.py bounds each GEMM; a wrong layout or scale misses
    this by orders of magnitude)."""
    model, x = Model().cuda(), inputs().cuda()
    promoted, fast = (copy.deepcopy(model) for _ in range(2))
    compiled = graphquant.compile(fast, fast_everywhere(RECIPES[name]()), backend="aot_eager", fullgraph=True)
    actual = forward_backward(compiled, fast, x)
    cuda_kernel = backends.WGMMA_GROUPED_GEMM.available(x.device)
    assert {g.gemm: str(g.backend) for g in compiled.graphquant.plan.gemms} == expected_backends(
        name, torch.cuda.get_device_capability(), grouped_gemm, cuda_kernel
    )
    monkeypatch.setattr(backends, "NATIVE_GROUPED_GEMMS", (backends.NATIVE_GROUPED_GEMM,))
    expected = forward_backward(
        graphquant.compile(promoted, dataclasses.replace(RECIPES[name](), fast_accumulation=()), backend="aot_eager", fullgraph=True), promoted, x
    )
    for key, value in expected.items():
        error = (actual[key].double() - value.double()).norm() / value.double().norm()
        assert error < 2**-8, f"{key}: relative error {error:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["rowwise", "current", "blockwise"])
def test_fp8_grouped_gemms_that_promote_run_natively_on_gpu(name, monkeypatch):
    """With every GEMM's sums kept in fp32, every FP8 grouped GEMM runs natively, partial sums
    promoted into fp32: on graphquant's CUDA grouped GEMM where the extension has it, elsewhere on
    the Triton FP8 grouped GEMM; the step equals the emulated one to within those sums' error
    (tests/test_triton_grouped_fp8.py and test_grouped_fp8.py bound each GEMM; a wrong layout or
    scale misses this by orders of magnitude)."""
    if not backends.TRITON_GROUPED_GEMMS:
        pytest.skip("needs Triton")
    model, x = Model().cuda(), inputs().cuda()
    native, emulated = (copy.deepcopy(model) for _ in range(2))
    recipe = dataclasses.replace(RECIPES[name](), fast_accumulation=())
    compiled = graphquant.compile(native, recipe, backend="aot_eager", fullgraph=True)
    actual = forward_backward(compiled, native, x)
    triton, ours = backends.TRITON_GROUPED_GEMMS[0].backend, backends.WGMMA_GROUPED_GEMM
    runs = dict.fromkeys(("fprop", "dgrad", "wgrad"), ours.backend if ours.available(x.device) else triton)
    assert {(g.gemm, g.backend.name) for g in compiled.graphquant.plan.gemms} == set(runs.items())
    monkeypatch.setattr(backends, "NATIVE_GROUPED_GEMMS", (backends.NATIVE_GROUPED_GEMM,))
    expected = forward_backward(graphquant.compile(emulated, recipe, backend="aot_eager", fullgraph=True), emulated, x)
    for key, value in expected.items():
        error = (actual[key].double() - value.double()).norm() / value.double().norm()
        assert error < 2**-8, f"{key}: relative error {error:.2e}"


def scaled_grouped_mm_on_cpu(mat_a, mat_b, scale_a, scale_b, offs=None, out_dtype=None):
    """torch._scaled_grouped_mm's semantics in fp32 on the CPU, after torch's own meta checks of
    the layouts (row-major A, column-major B, E4M3, scale shapes)."""
    meta = lambda t: t.to("meta")  # noqa: E731
    torch._meta_registrations.meta_scaled_grouped_mm(meta(mat_a), meta(mat_b), meta(scale_a), meta(scale_b), meta(offs), out_dtype=out_dtype)
    bounds = [0, *offs.tolist()]
    if mat_b.dim() == 3:
        out = torch.zeros(mat_a.shape[0], mat_b.shape[2])
        for g, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            out[lo:hi] = (mat_a[lo:hi].float() * scale_a[lo:hi, None]) @ (mat_b[g].float() * scale_b[g])
        return out.to(out_dtype)
    m, n = mat_a.shape[0], mat_b.shape[1]
    out = torch.zeros(len(bounds) - 1, m, n)
    for g, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        a = mat_a[:, lo:hi].float() * scale_a[g * m : (g + 1) * m, None]
        out[g] = a @ (mat_b[lo:hi].float() * scale_b[g * n : (g + 1) * n])
    return out.to(out_dtype)


class TritonGroupedFp8OnCpu:
    """graphquant.kernels.triton_grouped_fp8's semantics on the CPU: each group's dequantized
    operands multiplied in float64, the result rounded to out_dtype once (promoted or not: exact)."""

    PROMOTE_EVERY, FAST_ACCUMULATION = fp8.PROMOTED_PRODUCTS, None  # the kernel module's promotion intervals

    @staticmethod
    def tokens_by_experts(a, b, b_group, tokens, token_rows, n, out_dtype, promote_every):
        left = grouped_kernels.dequantize(a, tokens.row_group, torch.float64)
        stacked = grouped_kernels.dequantize(b, b_group, torch.float64).reshape(tokens.groups, -1, b.shape[1])
        experts = stacked.transpose(1, 2) if b.direction == ROWWISE else stacked  # (groups, k, n)
        return torch.einsum("rk,rkn->rn", left, experts[tokens.row_group])[tokens.position, :n].to(out_dtype)

    @staticmethod
    def tokens_by_tokens(a, a_group, b, b_group, ends, m, out_dtype, promote_every):
        left = grouped_kernels.dequantize(a, a_group, torch.float64)
        right = grouped_kernels.dequantize(b, b_group, torch.float64)
        member = F.one_hot(a_group, ends.shape[0]).double()  # the zero rows after the last group join it
        return torch.einsum("rg,rm,rn->gmn", member, left, right)[:, :m].to(out_dtype)


@pytest.fixture
def scaled_grouped_mm_here(monkeypatch, fake_capability):
    """fake_capability, with ``scaled_grouped_mm_on_cpu`` as torch._scaled_grouped_mm and
    ``TritonGroupedFp8OnCpu`` as the Triton FP8 grouped GEMM (the emulated GEMMs run as on the CPU)."""
    monkeypatch.setattr(torch, "_scaled_grouped_mm", scaled_grouped_mm_on_cpu, raising=False)
    monkeypatch.setattr(backends, "triton_grouped_fp8", TritonGroupedFp8OnCpu)
    return fake_capability


@pytest.fixture
def without_triton_grouped_gemm(monkeypatch):
    """The plan's grouped GEMMs as where Triton is not installed: torch._scaled_grouped_mm for those
    it takes that a recipe lets accumulate fast, the emulated GEMM for the rest; for the tests of
    those paths and of the reference's fp32 bound, which the tensor cores' sums do not meet
    (tests/test_triton_grouped_fp8.py tests the Triton GEMM's)."""
    monkeypatch.setattr(backends, "NATIVE_GROUPED_GEMMS", (backends.NATIVE_GROUPED_GEMM,))


@pytest.fixture(params=["triton", "no triton"])
def grouped_gemm(request):
    """Whether the native grouped GEMMs are Triton's (where it is installed), or as where it is
    not (without_triton_grouped_gemm)."""
    if request.param == "no triton":
        request.getfixturevalue("without_triton_grouped_gemm")
    elif not backends.TRITON_GROUPED_GEMMS:
        pytest.skip("needs Triton")
    return request.param == "triton"


GEMMS = ("fprop", "dgrad", "wgrad")
# The GEMMs of Model() that torch._scaled_grouped_mm runs on sm90 and sm100 (E4M3 on both sides)
# under a recipe that lets them accumulate fast, where Triton is not installed.
NATIVE_ON_HOPPER = {"rowwise": {"fprop", "dgrad", "wgrad"}, "current": {"fprop"}, "blockwise": set(), "mxfp8": set()}


def expected_backends(name: str, sm, triton: bool, cuda_kernel: bool = False) -> dict[str, str]:
    """{GEMM: its backend as the plan prints it} of Model() under fast_everywhere(RECIPES[name]())
    on compute capability ``sm``: where graphquant's extension runs its CUDA grouped GEMM
    (``cuda_kernel``), every FP8 GEMM there, promoted; else with Triton, every FP8 GEMM on its
    grouped GEMM from sm89 on, fast but where the scales are per block; without,
    NATIVE_ON_HOPPER's on torch._scaled_grouped_mm."""
    emulated = str(GemmBackend(backends.EMULATION))
    if cuda_kernel and triton:
        return {gemm: str(backends.WGMMA_GROUPED_GEMM.backend) if name != "mxfp8" else emulated for gemm in GEMMS}
    if triton:
        on_triton = name != "mxfp8" and sm is not None and sm >= (8, 9)
        native = GemmBackend(backends.TRITON_GROUPED_GEMMS[0].backend, fast_accumulation=name != "blockwise")
        return {gemm: str(native) if on_triton else emulated for gemm in GEMMS}
    native = GemmBackend(backends.SCALED_GROUPED_MM, fast_accumulation=True)
    return {gemm: str(native) if sm in ((9, 0), (10, 0)) and gemm in NATIVE_ON_HOPPER[name] else emulated for gemm in GEMMS}


@pytest.mark.parametrize("name", ["rowwise", "current", "blockwise"])
def test_native_grouped_dispatch_gives_the_native_gemms_their_layouts(name, grouped_gemm, scaled_grouped_mm_here):
    """The CPU has neither torch._scaled_grouped_mm nor the Triton FP8 grouped GEMM: in their place
    their semantics (torch's behind its own checks of its arguments) on a faked sm90; the training
    step then matches the per-group reference as the emulated one does (up to the native GEMMs'
    bf16 output)."""
    scaled_grouped_mm_here((9, 0))
    compiled = run_against_reference(fast_everywhere(RECIPES[name]()), Model(), inputs())
    assert {g.gemm: str(g.backend) for g in compiled.graphquant.plan.gemms} == expected_backends(name, (9, 0), grouped_gemm)


def test_plan_and_graph_dump_name_each_grouped_gemms_backend_and_its_sums(grouped_gemm, scaled_grouped_mm_here, tmp_path):
    """Under the zoo's rowwise recipe (fprop accumulates fast, dgrad and wgrad keep fp32 sums) on
    a faked sm90, the plan table and the rewritten graph's Site say which backend runs each
    grouped GEMM and whether it accumulates fast: the plan's choice, made once."""
    scaled_grouped_mm_here((9, 0))
    model = Model()
    compiled = graphquant.compile(model, RECIPES["rowwise"](), backend="aot_eager", fullgraph=True, dump_dir=str(tmp_path))
    forward_backward(compiled, model, inputs())
    plan_text = (tmp_path / "graph_000_plan.txt").read_text()
    rewritten = (tmp_path / "graph_000_rewritten.py").read_text()
    rows = {gemm: [line for line in plan_text.splitlines() if re.match(rf"moe\.grouped_linear\.0#0 +grouped_linear +{gemm} ", line)] for gemm in GEMMS}
    if grouped_gemm:
        triton = backends.TRITON_GROUPED_GEMMS[0].backend
        fast, kept = GemmBackend(triton, fast_accumulation=True), GemmBackend(triton)
    else:
        fast, kept = GemmBackend(backends.SCALED_GROUPED_MM, fast_accumulation=True), GemmBackend(backends.EMULATION)
    assert [f" {fast} " in row for row in rows["fprop"]] == [True], plan_text
    assert [f" {kept} " in row and "(fast accumulation)" not in row for row in rows["dgrad"] + rows["wgrad"]] == [True, True], plan_text
    assert f"fprop={fast!r}" in rewritten and f"dgrad={kept!r}" in rewritten and f"wgrad={kept!r}" in rewritten, rewritten


@pytest.fixture
def grouped_runs(monkeypatch):
    """The dict that each grouped GEMM call adds its "site gemm" label to, with what ran it: the
    native grouped GEMM's GemmBackend, or "emulated"."""
    ran, current = {}, []
    dispatch, scaled, emulated = grouped_kernels.gemm, grouped_kernels._scaled_grouped_mm, grouped_kernels._emulated
    triton_kernels = backends.triton_grouped_fp8

    def gemm(*args):
        current.append(args[-1])  # the GEMM's name
        try:
            return dispatch(*args)
        finally:
            current.pop()

    def record(what):
        assert current[-1] not in ran, f"{current[-1]} ran twice"
        ran[current[-1]] = what

    def native_run(*args):
        record(GemmBackend(backends.SCALED_GROUPED_MM, fast_accumulation=True))
        return scaled(*args)

    def emulated_run(*args):
        record("emulated")
        return emulated(*args)

    def triton_run(product):
        def run(*args):  # the last: the promotion interval
            record(GemmBackend(backends.TRITON_GROUPED_GEMMS[0].backend, fast_accumulation=args[-1] is triton_kernels.FAST_ACCUMULATION))
            return product(*args)

        return run

    monkeypatch.setattr(grouped_kernels, "gemm", gemm)
    monkeypatch.setattr(grouped_kernels, "_scaled_grouped_mm", native_run)
    monkeypatch.setattr(grouped_kernels, "_emulated", emulated_run)
    if triton_kernels is not None:
        recorded = {name: triton_run(getattr(triton_kernels, name)) for name in ("tokens_by_experts", "tokens_by_tokens")}
        constants = {name: getattr(triton_kernels, name) for name in ("PROMOTE_EVERY", "FAST_ACCUMULATION")}
        monkeypatch.setattr(backends, "triton_grouped_fp8", types.SimpleNamespace(**recorded, **constants))

    def cuda_run(product):
        def run(*args):
            record(GemmBackend(cuda_kernel.BACKEND))
            return product(*args)

        return run

    cuda_kernel = grouped_kernels.grouped_fp8
    recorded = {name: cuda_run(getattr(cuda_kernel, name)) for name in ("tokens_by_experts", "tokens_by_tokens")}
    monkeypatch.setattr(grouped_kernels, "grouped_fp8", types.SimpleNamespace(**recorded, PROMOTE_EVERY=cuda_kernel.PROMOTE_EVERY))
    return ran


GROUPED_CAPABILITIES = [None, (8, 9), (9, 0), (10, 0)]


@pytest.mark.parametrize("sm", GROUPED_CAPABILITIES, ids=["cpu" if sm is None else f"sm{sm[0]}{sm[1]}" for sm in GROUPED_CAPABILITIES])
@pytest.mark.parametrize("name", sorted(NATIVE_ON_HOPPER))
def test_each_grouped_gemm_runs_on_the_backend_its_plan_chose(name, sm, grouped_gemm, scaled_grouped_mm_here, grouped_runs):
    """A grouped site's fprop, dgrad and wgrad each run on the backend of its plan row, which the
    graph carries in the site's Site, on every capability: the Triton GEMM with the sums the plan
    chose."""
    scaled_grouped_mm_here(sm)
    plan = _grouped_step_runs_as_planned(Model(), inputs(), fast_everywhere(RECIPES[name]()), grouped_runs)
    assert {g.gemm: str(g.backend) for g in plan.gemms} == expected_backends(name, sm, grouped_gemm)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["rowwise", "current"])
def test_each_grouped_gemm_runs_on_the_backend_its_plan_chose_on_this_gpu(name, grouped_gemm, grouped_runs):
    """The same on the GPU, with torch._scaled_grouped_mm, the Triton kernel and graphquant's CUDA
    kernel themselves."""
    x = inputs().cuda()
    plan = _grouped_step_runs_as_planned(Model().cuda(), x, fast_everywhere(RECIPES[name]()), grouped_runs)
    cuda_kernel = backends.WGMMA_GROUPED_GEMM.available(x.device)
    assert {g.gemm: str(g.backend) for g in plan.gemms} == expected_backends(name, torch.cuda.get_device_capability(), grouped_gemm, cuda_kernel)


def _grouped_step_runs_as_planned(model, x, recipe, ran):
    """One compiled training step of ``model``, each grouped GEMM on its plan's backend; the plan."""
    compiled = graphquant.compile(model, recipe, backend="aot_eager", fullgraph=True)
    forward_backward(compiled, model, x)
    plan = compiled.graphquant.plan
    assert ran == {f"{g.site} {g.gemm}": g.backend if g.backend.native else "emulated" for g in plan.gemms}, plan
    return plan


def _grouped_site(backend: GemmBackend, spec: str) -> Site:
    return Site(name="moe", call=0, input=spec, weight=spec, grad_output=spec, streams=(0, 1, 2), fprop=backend)


def test_a_grouped_call_its_backend_cannot_run_fails_naming_site_shape_format_and_backend(scaled_grouped_mm_here):
    """graphquant::grouped_gemm runs the plan's backend or fails: never another backend."""
    spec = Float8RowwiseQuantizer().spec
    x, w, offs = inputs(), Model().moe.experts.detach(), offsets()
    native = GemmBackend(backends.SCALED_GROUPED_MM, fast_accumulation=True)
    scaled_grouped_mm_here(None)
    with pytest.raises(GemmMismatch, match=r"moe#0 fprop: its plan chose torch._scaled_grouped_mm fp8 rowwise \(fast accumulation\), .*: it does not run on cpu"):
        quantized_grouped_mm(x, w, offs, site=_grouped_site(native, spec))
    scaled_grouped_mm_here((9, 0))
    with pytest.raises(GemmMismatch, match=r"moe#0 fprop: .*\(640, 512, 24\), .*needs m, n, k multiples of 16"):
        quantized_grouped_mm(x[:, :24].contiguous(), w[:, :24].contiguous(), offs, site=_grouped_site(native, spec))
    with pytest.raises(GemmMismatch, match=r"moe#0 fprop: its plan chose cublaslt fp8 rowwise, but this call runs (.*, )?torch._scaled_grouped_mm"):
        quantized_grouped_mm(x, w, offs, site=_grouped_site(GemmBackend(scaled_mm.ROWWISE_SCALED), spec))
    with pytest.raises(GemmMismatch, match=r"moe#0 fprop: its plan chose torch._scaled_grouped_mm fp8 rowwise \(fast accumulation\), but this call runs (.*, )?cublaslt fp8 tensorwise"):
        quantized_linear(torch.randn(32, 64), torch.randn(32, 64), site=_grouped_site(native, spec))


TRITON_PROGRAM = """
import torch
import triton_interpreter
triton_interpreter.accept_numpy_scalars()  # a branch on a loaded value
triton_interpreter.round_bfloat16_to_nearest()
from graphquant.formats import fp8, groups
from graphquant.kernels import triton_grouped_gemm as kernels

offs = torch.tensor([40, 0, 57, 27]).cumsum(0).to(torch.int32)
layout = groups.padding(offs, 124, 128, groups.padded_bound(124, 4, 128))
generator = torch.Generator().manual_seed(0)
a = layout.pad(torch.randn(124, 64, generator=generator))
b = layout.pad(torch.randn(124, 96, generator=generator))
experts = torch.randn(4, 96, 64, generator=generator).transpose(1, 2)  # column-major, as the GEMM gives them
bounds = [0, *layout.ends.tolist()]

def check(got, pairs):
    # fp32 sums (fp8.accumulation_bound) of products of fp32 values, each rounded once.
    exact = torch.stack([p @ q for p, q in pairs])
    bound = torch.stack([fp8.accumulation_bound(p, q, fp8.FP32) + 2.0**-24 * (p.abs() @ q.abs()) for p, q in pairs])
    assert ((got.double() - exact).abs() <= bound).all(), ((got.double() - exact).abs() / bound).max()

for rows in (groups.GROUP_ROWS, groups.FEW_TOKEN_ROWS):  # a training graph's layout, an inference graph's
    tokens = groups.padding(offs, 124, rows, groups.padded_bound(124, 4, rows))
    x = tokens.pad(a[layout.position])
    got = kernels.tokens_by_experts(x, experts, tokens, rows, 90, None, None, torch.float32)  # 90 of the 96 columns
    check(got, [(x[r].double(), experts[tokens.row_group[r], :, :90].double()) for r in tokens.position.tolist()])
got = kernels.tokens_by_tokens(a, b, layout.ends, 60, None, None, torch.float32)  # 60 of the 64 rows
check(got, [(a[lo:hi, :60].double().t(), b[lo:hi].double()) for lo, hi in zip(bounds, bounds[1:])])
assert torch.equal(got[1], torch.zeros(60, 96))  # the empty expert

# The factors multiply the fp32 sums in the epilogue as torch's ops do after (a_factor * b_factor,
# then the sums times that, then the one rounding): the same bits, unpadded.
fa = torch.rand(layout.padded_rows, 1, generator=generator) + 0.5  # per padded row
for fb in (torch.rand(4, 96, generator=generator) + 0.5, torch.rand(4, 1, generator=generator) + 0.5):  # per column, per group
    sums = kernels.tokens_by_experts(a, experts, layout, 128, 96, None, None, torch.float32)
    want = (sums * (fa[layout.position] * fb[layout.row_group[layout.position]])).bfloat16()
    assert torch.equal(kernels.tokens_by_experts(a, experts, layout, 128, 96, fa, fb, torch.bfloat16), want)
fa, fb = torch.rand(4, 64, generator=generator) + 0.5, torch.rand(4, 1, generator=generator) + 0.5  # wgrad's: per row, per group
sums = kernels.tokens_by_tokens(a, b, layout.ends, 64, None, None, torch.float32)
want = (sums * (fa[:, :, None] * fb[:, None, :])).bfloat16()
assert torch.equal(kernels.tokens_by_tokens(a, b, layout.ends, 64, fa, fb, torch.bfloat16), want)

# NVFP4's values times a per-row global decode in the dequantize kernel (a hybrid's columnwise
# quantized from the rowwise values): torch's values.float() * factor, then the rounding.
from graphquant.kernels import triton_dequantize
from graphquant.formats import nvfp4
from graphquant.quantizers import NVFP4Quantizer
rep = NVFP4Quantizer(row_scaled_nvfp4=True)(torch.randn(40, 272, generator=generator) * 7, rowwise=True, columnwise=False).rowwise
q_times_s = nvfp4.e2m1_values(nvfp4.unpack(rep.data)) * rep.scale.float().repeat_interleave(16, dim=1)
factor = torch.rand(40, 1, generator=generator) * 3
assert torch.equal(triton_dequantize.nvfp4_block_values(rep.data, rep.scale, dtype=torch.float32), q_times_s)
for dtype in (torch.float32, torch.bfloat16):
    got = triton_dequantize.nvfp4_block_values(rep.data, rep.scale, row_factor=factor, dtype=dtype)
    assert torch.equal(got, (q_times_s * factor).to(dtype))
# MXFP8's rowwise values of gathered rows (the tokens read out of the padded layout), in their order.
from graphquant.formats import mxfp8
data, scale = mxfp8.quantize(torch.randn(40, 288, generator=generator) * 5, "e4m3", axis=1)
values = mxfp8.dequantize(data, scale, axis=1).bfloat16()
rows = torch.tensor([3, 0, 39, 17, 17, 8, 21, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15, 30])  # more than a program's 16
assert torch.equal(triton_dequantize.mxfp8_values(data, scale, rowwise=True), values)
assert torch.equal(triton_dequantize.mxfp8_values(data, scale, rowwise=True, rows=rows), values[rows])

# torch's grouped products may leave an empty group unwritten: zeroed in place, nothing else touched.
product = torch.randn(4, 64, 96, generator=generator)
want = product.clone()
want[1] = 0
assert kernels.zero_empty_groups(product, layout.ends) is product and torch.equal(product, want)
print("ok")
"""


@pytest.mark.gpu
def test_triton_grouped_gemm_epilogue_is_torch_ops_on_gpu():
    """The fp32-output grouped kernels' factors and bf16 rounding in their epilogue give the bits
    of torch's ops on their fp32 sums, ragged and empty groups (bf16 operands, 128-row tiles)."""
    from graphquant.formats import groups
    from graphquant.kernels import triton_grouped_gemm as kernels

    torch.manual_seed(0)
    offs = torch.tensor([300, 0, 57, 200], device="cuda").cumsum(0).to(torch.int32)
    layout = groups.padding(offs, 557, 128, groups.padded_bound(557, 4, 128))
    a = layout.pad(torch.randn(557, 256, device="cuda")).bfloat16()
    b = layout.pad(torch.randn(557, 320, device="cuda")).bfloat16()
    experts = torch.randn(4, 320, 256, device="cuda").bfloat16().transpose(1, 2)
    fa = torch.rand(layout.padded_rows, 1, device="cuda") + 0.5
    for fb in (torch.rand(4, 320, device="cuda") + 0.5, torch.rand(4, 1, device="cuda") + 0.5):
        sums = kernels.tokens_by_experts(a, experts, layout, 128, 300, None, None, torch.float32)
        want = (sums * (fa[layout.position] * fb[layout.row_group[layout.position], :300])).bfloat16()
        assert torch.equal(kernels.tokens_by_experts(a, experts, layout, 128, 300, fa, fb, torch.bfloat16), want)
    fa, fb = torch.rand(4, 256, device="cuda") + 0.5, torch.rand(4, 320, device="cuda") + 0.5
    sums = kernels.tokens_by_tokens(a, b, layout.ends, 250, None, None, torch.float32)
    want = (sums * (fa[:, :250, None] * fb[:, None, :])).bfloat16()
    got = kernels.tokens_by_tokens(a, b, layout.ends, 250, fa, fb, torch.bfloat16)
    assert torch.equal(got, want) and not got[1].any()  # group 1 is empty


@pytest.mark.gpu
def test_tokens_by_experts_through_tma_gives_the_strided_kernels_bits(monkeypatch):
    """bf16 tokens x experts whose operands TMA copies (wider tiles) computes the strided kernel's
    bits: zeros past k (100, not a multiple of the tile's 64), a tile's columns past n read from
    the next expert's rows and not written, pad rows and an empty expert."""
    from graphquant.kernels import triton_grouped_gemm as kernels

    generator = torch.Generator().manual_seed(0)
    offs = torch.tensor([300, 0, 517, 270]).cumsum(0).to(torch.int32).cuda()
    layout = groups.padding(offs, 1087, 128, groups.padded_bound(1087, 4, 128))
    a = layout.pad(torch.randn(1087, 104, generator=generator).cuda().bfloat16())
    stack = torch.randn(4, 300, 104, generator=generator).cuda().bfloat16()
    fa = torch.rand(layout.padded_rows, 1, generator=generator).cuda() + 0.5
    fb = torch.rand(4, 300, generator=generator).cuda() + 0.5
    assert kernels._tma_operands(a, stack.transpose(1, 2), kernels._tile(torch.bfloat16, 128))
    tma = kernels.tokens_by_experts(a, stack.transpose(1, 2), layout, 128, 290, fa, fb, torch.bfloat16)
    monkeypatch.setattr(kernels, "_tma_operands", lambda *args: False)
    assert torch.equal(tma, kernels.tokens_by_experts(a, stack.transpose(1, 2), layout, 128, 290, fa, fb, torch.bfloat16))


def test_triton_grouped_gemm_under_the_interpreter():
    """The factored grouped kernels' indexing (each tile's group, each group's bounds read on the
    device, the empty group) and epilogue, zero_empty_groups, NVFP4's values times a per-row
    factor and MXFP8's values of gathered rows, under Triton's CPU interpreter. fp32 operands: the interpreter
    multiplies bf16 wrongly; on the GPU the bf16 ones run in the gpu tests above."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", TRITON_PROGRAM], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


GROUPABLE = {
    "fp8_current": Float8CurrentScalingQuantizer("e4m3"),
    "fp8_delayed": Float8DelayedScalingQuantizer("e5m2"),  # a slot a group: its own scale
    "fp8_rowwise": Float8RowwiseQuantizer(),
    "fp8_block_1d": Float8BlockQuantizer(block_scaling_dim=1),
    "fp8_block_2d": Float8BlockQuantizer(block_scaling_dim=2, force_pow_2_scales=False),
    "mxfp8": MXFP8Quantizer(),
    "nvfp4": NVFP4Quantizer(),
    "nvfp4_2d_rht": NVFP4Quantizer(with_2d_quantization=True, with_rht=True, with_post_rht_amax=True),
    "nvfp4_row_scaled": NVFP4Quantizer(row_scaled_nvfp4=True),
    "nvfp4_rht_sr": NVFP4Quantizer(with_rht=True, with_post_rht_amax=True, stochastic_rounding=True),
    "nvfp4_2d_sr_row_scaled": NVFP4Quantizer(with_2d_quantization=True, stochastic_rounding=True, row_scaled_nvfp4=True),
}


def assert_same_numbers(a, b, what):
    """Bit for bit, except that a NaN may carry another sign (the CPU's vector and scalar code
    paths make NaNs of different signs)."""
    assert a.shape == b.shape and a.dtype == b.dtype, what
    if a.dtype == torch.uint8:  # packed E2M1 codes
        assert torch.equal(a, b), what
    else:
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=0, equal_nan=True, msg=what)


@pytest.mark.parametrize("direction", [ROWWISE, COLUMNWISE])
@pytest.mark.parametrize("name", sorted(GROUPABLE))
def test_vectorised_grouped_quantize_equals_per_group_reference(name, direction):
    """Quantizer.quantize_groups (one pass, offsets on the device) gives the numbers of the
    reference that quantizes each padded group alone (native.reference_grouped_quantize),
    non-finite values included; stochastic rounding draws what each padded group draws alone."""
    quantizer, x = GROUPABLE[name], inputs()
    ctx = QuantizeContext(seed=11, offset=5, scale=torch.linspace(0.25, 40.0, E) if quantizer.keeps_state else None)
    x[5, 3], x[100, 7] = float("inf"), float("nan")  # in groups 0 and 2: the others keep finite scales
    # The reference cannot quantize an empty slice in these formats, so give every group rows.
    sizes = (40, 20, 57, 7) if name.startswith("nvfp4") or (name == "fp8_rowwise" and direction == COLUMNWISE) else SIZES
    layout = groups.padding(offsets(sizes), T, groups.GROUP_ROWS, groups.padded_bound(T, E, groups.GROUP_ROWS))
    padded = layout.pad(x)
    got = quantizer.quantize_groups(padded, layout.row_group, E, direction, ctx)
    want = native.reference_grouped_quantize(quantizer, padded, layout.bounds, direction, ctx)
    for part in ("data", "scale", "amax"):
        g, w = getattr(got, part), getattr(want, part)
        assert (g is None) == (w is None), part
        if w is not None:
            assert_same_numbers(g, w, part)


@pytest.mark.parametrize("sizes", [(0, 0, 0, 1), (0, 0, 1, 1)], ids=["one_row", "two_rows"])
def test_stochastic_rounding_of_fewer_tokens_than_experts_matches_per_group_reference(sizes):
    """Fewer rows than experts pad only the groups they can fill, so the last group's part of the
    layout, which its draws depend on, is shorter than E blocks."""
    model, x = Model(sizes), inputs(sum(sizes))
    run_against_reference(RECIPES["nvfp4_block_scaling"](), model, x)


def test_padding_places_groups_at_block_starts_without_reading_offsets():
    layout = groups.padding(offsets(), T, 32, groups.padded_bound(T, E, 32))
    assert layout.padded_rows == 256  # 124 rows + 4 groups * 31, rounded up to 32
    assert layout.ends.tolist() == [64, 64, 128, 160]
    assert layout.position[:41].tolist() == list(range(40)) + [64]  # group 2 (after the empty one) starts at 64
    x = torch.arange(T, dtype=torch.float32)[:, None]
    assert torch.equal(layout.pad(x)[layout.position], x)
    assert layout.row_group[[0, 63, 64, 127, 128, 223]].tolist() == [0, 0, 2, 2, 3, 3]


def test_a_few_rows_among_many_groups_pad_only_the_groups_they_fill():
    """3 rows routed to 3 of 64 experts take 3 blocks, not one for every expert."""
    offs = torch.tensor([0] * 10 + [1] * 20 + [2] * 30 + [3] * 4, dtype=torch.int32)
    assert groups.padded_bound(3, 64, 128) == 384
    layout = groups.padding(offs, 3, 128, groups.padded_bound(3, 64, 128))
    assert layout.position.tolist() == [0, 128, 256] and layout.ends[-1] == 384
    assert layout.row_group[[0, 127, 128, 256, 383]].tolist() == [10, 10, 30, 60, 60]


@pytest.mark.parametrize("experts, rows", [(4, 256), (3, 200), (1, 5), (5, 128)])
def test_an_expert_stacks_closed_form_layout_is_the_searched_one(experts, rows):
    ends = torch.arange(1, experts + 1, dtype=torch.int32) * rows
    searched = groups.padding(ends, experts * rows, groups.GROUP_ROWS, experts * -(-rows // groups.GROUP_ROWS) * groups.GROUP_ROWS)
    closed = groups.uniform_padding(experts, rows, groups.GROUP_ROWS, torch.device("cpu"))
    for name, a, b in zip(groups.GroupPadding._fields, closed, searched):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_offsets_that_do_not_end_at_the_rows_fail():
    model = Model(sizes=(40, 0, 57, 26))  # 123 rows in groups, 124 given
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend="aot_eager", fullgraph=True)
    with pytest.raises(RuntimeError, match=r"moe\.grouped_linear\.0#0: the grouped GEMM.s offsets must be non-decreasing and end at the input.s 124 rows \(rows past offs\[-1\] stay unwritten\)") as error:
        compiled(inputs())
    assert len(str(error.value)) < 255  # CUDA's device-side assert refuses longer messages


def test_stochastic_rounding_draws_per_seed_and_step():
    """nvfp4_block_scaling's stochastically rounded grad_output on a grouped site: the same seed
    gives the same bits, the next step and another seed draw other numbers."""

    def steps(seed, count):
        model = Model()
        compiled = graphquant.compile(model, recipes.nvfp4_block_scaling(), backend="aot_eager", fullgraph=True, seed=seed)
        return [forward_backward(compiled, model, inputs()) for _ in range(count)]

    first, second = steps(seed=3, count=2)
    [again] = steps(seed=3, count=1)
    [other_seed] = steps(seed=4, count=1)
    for name in ("input.grad", "moe.experts.grad"):
        assert torch.equal(first[name], again[name]), name
        assert not torch.equal(first[name], second[name]), name
        assert not torch.equal(first[name], other_seed[name]), name
    assert torch.equal(first["output"], second["output"])  # the forward rounds to nearest


def test_other_grouped_mm_forms_are_skipped_with_a_reason():
    """The 3-D x 3-D form (tokens bucketed per expert to a capacity) is torch.bmm's product, which
    is quantized spelled so: the reason says it, and the warning that nothing was quantized
    names what was found and skipped, where it said no GEMM was found."""
    a = torch.randn(E, 32, K, dtype=torch.bfloat16)
    b = torch.randn(E, K, N, dtype=torch.bfloat16)
    compiled = graphquant.compile(lambda a, b: torch._grouped_mm(a, b), recipes.mxfp8_block_scaling(), backend="aot_eager", fullgraph=True)
    with pytest.warns(UserWarning, match=r"found no GEMM it quantizes .*Not quantized: .*_grouped_mm\(l_a_, l_b_\) \(torch._grouped_mm: only"):
        compiled(a, b)
    [(_, reason)] = compiled.graphquant.plan.skipped
    assert "only x (T, K) with w (E, K, N) and offs" in reason and "torch.bmm(x, w) or x @ w" in reason
    torch._dynamo.reset()
    bmm = graphquant.compile(lambda a, b: torch.bmm(a, b), recipes.mxfp8_block_scaling(), backend="aot_eager", fullgraph=True)
    bmm(a, b)
    assert [g.module_type for g in bmm.graphquant.plan.gemms] == ["matmul"]


def test_a_hidden_size_no_block_tiles_is_named_with_the_models_tokens():
    """K = 72 tiles no MXFP8 block: the error named "the 128x72 tensor", the op's padded layout,
    where the model passed 45 tokens."""
    class OddK(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 72, N).bfloat16())

        def forward(self, x):
            return torch._grouped_mm(x, self.w, offs=torch.tensor([10, 10, 30, 45], dtype=torch.int32))

    compiled = graphquant.compile(OddK(), recipes.mxfp8_block_scaling(), backend="aot_eager", fullgraph=True)
    with pytest.raises(PlanError) as error:
        compiled(torch.randn(45, 72).bfloat16())
    assert str(error.value).startswith(
        "grouped_linear.0#0 (grouped_linear) input: mxfp8(fp8_dtype=e4m3): the rowwise representation has 1x32 blocks, "
        "so dim 1 of the 45x72 tensor must be a multiple of 32 (got 72)"
    ), error.value


@pytest.mark.parametrize("quantizer", [MXFP8Quantizer(), Float8CurrentScalingQuantizer("e5m2")], ids=str)
def test_grouped_ops_pass_opcheck(quantizer):
    x = inputs()
    tokens = groups.padding(offsets(), T, groups.GROUP_ROWS, groups.padded_bound(T, E, groups.GROUP_ROWS))
    stack = groups.padding(torch.arange(1, E + 1, dtype=torch.int32) * N, E * N, groups.GROUP_ROWS, E * groups.GROUP_ROWS)
    xp, w = tokens.pad(x), stack.pad(torch.randn(E * N, K, dtype=torch.bfloat16))
    xq = torch.ops.graphquant.grouped_quantize(x, tokens.row_group, tokens.bounds, tokens.source, tokens.runs, quantizer.spec, True, False, None, 0, None, False, None, None)
    wq = torch.ops.graphquant.grouped_quantize(w, stack.row_group, stack.bounds, None, None, quantizer.spec, True, False, None, 0, None, False, None, None)
    for spec, rng in ((quantizer.spec, None), (NVFP4Quantizer(stochastic_rounding=True).spec, torch.tensor([3, 1]))):
        for rowwise in (False, True):  # the columnwise alone, and both directions from one call
            for rows, source, runs in ((x, tokens.source, tokens.runs), (xp, None, None)):  # gathered into the layout, or in it already
                args = (rows, tokens.row_group, tokens.bounds, source, runs, spec, rowwise, True, rng, 2, None, False, None, None)
                torch.library.opcheck(torch.ops.graphquant.grouped_quantize.default, args)
        # The rowwise and the amaxes its columnwise scales from; then that columnwise, given them.
        *_, amax = torch.ops.graphquant.grouped_quantize(x, tokens.row_group, tokens.bounds, tokens.source, tokens.runs, spec, True, False, rng, 2, None, True, None, None)
        for args in ((True, False, rng, 2, None, True, None, None), (False, True, rng, 2, amax, False, None, None)):
            torch.library.opcheck(torch.ops.graphquant.grouped_quantize.default, (x, tokens.row_group, tokens.bounds, tokens.source, tokens.runs, spec, *args))
    without_schema = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")  # no allclose for FP8
    dequantize_args = (xq, quantizer.spec, ROWWISE, list(xp.shape), tokens.row_group, torch.bfloat16)
    gemm_args = (
        xq, quantizer.spec, ROWWISE, list(xp.shape), tokens.row_group, wq, quantizer.spec, ROWWISE, list(w.shape), stack.row_group,
        tokens.ends, tokens.position, tokens.source, tokens.row_ends, N, torch.bfloat16, groups.GROUP_ROWS, backends.EMULATION, False,
        "moe#0 fprop",
    )
    torch.library.opcheck(torch.ops.graphquant.grouped_dequantize.default, dequantize_args, test_utils=without_schema)
    torch.library.opcheck(torch.ops.graphquant.grouped_gemm.default, gemm_args, test_utils=without_schema)


# -- what a grouped site keeps for backward -----------------------------------------------------------


class ExpertsStoredAsLinears(torch.nn.Module):
    """Expert weights stored (E, N, K) as nn.Linear's are (and TorchTitan's), multiplied
    transposed; N a multiple of 128, so that the expert stack is a view of the parameter."""

    def __init__(self):
        super().__init__()
        weight = torch.randn(E, 128, K, generator=torch.Generator().manual_seed(1)) / K**0.5
        self.weight = torch.nn.Parameter(weight.to(torch.bfloat16))
        self.register_buffer("offs", offsets())

    def forward(self, x):
        return torch._grouped_mm(x, self.weight.transpose(-2, -1), offs=self.offs)


def test_grouped_site_keeps_the_weights_for_backward_not_their_quantized_copy():
    """The experts' columnwise weights (dgrad's operand) are made in backward from the parameter,
    which lives anyway, and neither kept from forward to backward (at an MoE step's shapes, 1 GiB
    of FP8) nor made in forward too: with Inductor's partitioning, the forward quantizes x in both
    directions and w rowwise only (taking, in that read of w, the amaxes its columnwise copy
    scales from: per expert and column here), and backward keeps x's columnwise copy and those
    amaxes, no copy of w. Made alone, w's columnwise copy has the bits it has made with the
    rowwise one (tests/test_kernels_gpu.py::test_grouped_quantize_of_both_directions_equals_each_alone
    and ::test_grouped_columnwise_takes_the_amaxes_the_rowwise_call_took)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.compile_fx import select_decomp_table

    forward = []
    backend = aot_autograd(
        fw_compiler=lambda gm, example_inputs: forward.append(gm) or gm,
        bw_compiler=lambda gm, example_inputs: gm,
        decompositions=select_decomp_table(),
        partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"),
    )
    model = ExpertsStoredAsLinears()
    compiled = graphquant.compile(model, RECIPES["rowwise"](), backend=backend, fullgraph=True)
    x = inputs().requires_grad_()
    compiled(x).sum().backward()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = compiled(x)
    y.sum().backward()

    quantizes = [n.args[6:8] for n in forward[0].graph.nodes if n.target is torch.ops.graphquant.grouped_quantize.default]
    assert quantizes == [(True, True), (True, False)]
    padded_rows = groups.padded_bound(T, E, groups.GROUP_ROWS)
    assert [tuple(t.shape) for t in saved if t.dtype == torch.float8_e4m3fn] == [(K, padded_rows)]
    assert [tuple(t.shape) for t in saved if t.dtype == torch.float32 and t.dim() == 1 and t.numel()] == [(E * K,)]


def test_grouped_site_quantizes_the_rows_through_the_layout_without_a_padded_copy():
    """x, grad_output and the experts' weights reach the grouped quantize as they are, with the
    padded layout's gather, which the native kernel reads them through: neither graph makes a
    high-precision copy of any of them in the padded layout (at an MoE step's shapes, each a
    write and a read of up to 1.1 GB that only the quantize reads)."""
    graphs = []
    keep = lambda gm, example_inputs: graphs.append(gm) or make_boxed_func(gm)  # noqa: E731
    compiled = graphquant.compile(Model(), RECIPES["rowwise"](), backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
    compiled(inputs().requires_grad_()).sum().backward()

    def rows(node):
        return node.meta["val"].shape[0]

    quantized = [n.args[0] for g in graphs for n in g.graph.nodes if n.target is torch.ops.graphquant.grouped_quantize.default]
    assert sorted(rows(n) for n in quantized) == [T, T, E * N, E * N]  # x, w rowwise; grad_output, w columnwise
    padded = {groups.padded_bound(T, E, groups.GROUP_ROWS), E * groups.GROUP_ROWS}  # the tokens', the expert stack's
    copies = [n for g in graphs for n in g.graph.nodes if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)]
    assert not [n for n in copies if n.meta["val"].dtype == torch.bfloat16 and rows(n) in padded], "a padded copy"


def test_grouped_ops_take_the_layouts_bounds_tile_runs_and_source_rows_from_the_graph():
    """What the grouped ops derive from a layout (each group's first padded row, the tile runs the
    native quantize reads x's rows by, each padded row's source row) is made in the graph, where
    Inductor fuses it with the layout's arithmetic, not by small torch calls inside the ops at
    every call (each a launch: at a decode step's size most of a grouped site's launches)."""
    graphs = []
    keep = lambda gm, example_inputs: graphs.append(gm) or make_boxed_func(gm)  # noqa: E731
    compiled = graphquant.compile(Model(), RECIPES["rowwise"](), backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
    compiled(inputs().requires_grad_()).sum().backward()
    nodes = [n for g in graphs for n in g.graph.nodes]
    quantizes = [n for n in nodes if n.target is torch.ops.graphquant.grouped_quantize.default]
    gathered = [n for n in quantizes if n.args[3] is not None]
    assert gathered and all(isinstance(n.args[2], torch.fx.Node) and n.args[2].meta["val"].dtype == torch.int64 for n in quantizes)
    assert all(isinstance(n.args[4], torch.fx.Node) and n.args[4].meta["val"].dtype == torch.int32 for n in gathered)
    gemms = [n for n in nodes if n.target is torch.ops.graphquant.grouped_gemm.default]
    assert gemms and all(isinstance(n.args[12], torch.fx.Node) for n in gemms)  # the layout's source rows


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_a_rowwise_alone_quantize_of_a_traceable_format_is_traced_where_training_keeps_the_op(recipe):
    """Inference quantizes tokens and weights rowwise alone: FP8 and MXFP8 formats are traced
    there, so that Inductor fuses the rows' gather, amaxes and cast with their producer (a decode
    step's grouped quantize kernel was a few launches of its own); training, which makes x's two
    directions in one read, keeps the op."""
    graphs = {}

    def keeping(name):
        return aot_autograd(fw_compiler=lambda gm, example_inputs: graphs.setdefault(name, gm) and make_boxed_func(gm))

    x = inputs()
    with torch.no_grad():
        graphquant.compile(Model(), RECIPES[recipe](), mode="inference", backend=keeping("inference"), fullgraph=True)(x)
    graphquant.compile(Model(), RECIPES[recipe](), backend=keeping("training"), fullgraph=True)(x.clone().requires_grad_())
    quantizes = {name: [n for n in gm.graph.nodes if n.target is torch.ops.graphquant.grouped_quantize.default] for name, gm in graphs.items()}
    assert not quantizes["inference"] and quantizes["training"]


# Where an inference graph pads each group of tokens to 16 rows, where to 128: a stateless,
# deterministic rowwise format of x whose blocks span at most 16 rows.
TOKEN_ROWS = {
    "current": groups.FEW_TOKEN_ROWS, "rowwise": groups.FEW_TOKEN_ROWS, "blockwise": groups.FEW_TOKEN_ROWS,
    "mxfp8": groups.FEW_TOKEN_ROWS,
    "delayed": groups.GROUP_ROWS,  # on the native grouped quantize, whose tiles are 128 rows
    "nvfp4": groups.GROUP_ROWS,  # not traced: on the native grouped quantize too
    "128x128 blocks": groups.GROUP_ROWS,  # x's blocks span 128 rows
}


def _inference_recipe(name):
    if name == "delayed":
        return recipes.delayed_scaling()
    if name == "128x128 blocks":
        return CustomRecipe(lambda role: Float8BlockQuantizer())
    return RECIPES[name]()


@pytest.mark.parametrize("sizes", [SIZES, (200, 0, 57, 27)], ids=["few tokens", "many"])
@pytest.mark.parametrize("name", sorted(TOKEN_ROWS))
def test_an_inference_graph_pads_few_tokens_to_few_rows_where_the_format_allows_and_gives_the_training_forwards_output(name, sizes):
    """The padding is the plan's (GemmPlan.token_rows, carried as Site.token_rows in the graph's code)
    where the tokens are few (groups.FEW_TOKENS_AN_EXPERT an expert on average), 128 rows where they
    are more, and changes no value: the inference graph's output is the training graph's forward
    output bit for bit, ragged and empty groups included."""
    model, x, codes, gemms = Model(sizes), inputs(sum(sizes)), [], []
    training = graphquant.compile(copy.deepcopy(model), _inference_recipe(name), backend="aot_eager", fullgraph=True)
    expected = training(x.clone().requires_grad_())

    def keep(gm, example_inputs):  # the rewritten graph's code, and its grouped GEMMs' padding
        codes.append(gm.code)

        def forward(gm, example_inputs):
            gemms.extend(n.args[16] for n in gm.graph.nodes if n.target is torch.ops.graphquant.grouped_gemm.default)
            return make_boxed_func(gm)

        return aot_autograd(fw_compiler=forward)(gm, example_inputs)

    inference = graphquant.compile(copy.deepcopy(model), _inference_recipe(name), mode="inference", backend=keep, fullgraph=True)
    with torch.no_grad():
        actual = inference(x)
    assert torch.equal(actual, expected.detach())
    [site] = [line for line in codes[0].splitlines() if "Site(name='moe" in line]
    rows = TOKEN_ROWS[name]
    assert (f"token_rows={rows}" in site) == (rows != groups.GROUP_ROWS) and "inference=True" in site, site
    assert [g.token_rows for g in inference.graphquant.plan.gemms] == [rows]
    assert graphquant.Plan.from_json(inference.graphquant.plan.to_json()) == inference.graphquant.plan
    assert {g.token_rows for g in training.graphquant.plan.gemms} == {groups.GROUP_ROWS}
    assert gemms == [rows if sum(sizes) <= groups.FEW_TOKENS_AN_EXPERT * E else groups.GROUP_ROWS]


MX_CASES = {  # (tokens of each expert, the recipe's fast GEMMs, inference): the plan's fprop backend
    "few tokens": (SIZES, ("fprop",), True),
    "many tokens": ((200, 0, 57, 27), ("fprop",), True),
    "a decode step's tokens": ((1, 0, 2, 1), ("fprop",), True),  # one a program, on the decoding programs
    "fp32 sums": (SIZES, (), True),
    "training": (SIZES, ("fprop",), False),
}


@pytest.mark.parametrize("case", sorted(MX_CASES))
def test_mxfp8_fprop_of_few_tokens_takes_hoppers_fp8_tensor_cores_where_the_recipe_lets_it_accumulate_fast(case, scaled_grouped_mm_here):
    """On Hopper, MXFP8's fprop of few tokens an expert in an inference graph runs on the FP8 grouped
    kernel's few-token tiles, each 32-block's sum in the tensor cores' accumulator: only where the
    recipe lets fprop accumulate fast (its default); with fp32 sums, more tokens, a decode step's
    (one a program) or in training, the emulation. The plan says which, and the call runs it (here
    the kernel's float64 stand-in: its numerics are tests/test_triton_grouped_fp8.py's), its output
    the emulation's up to their sums' rounding."""
    if not backends.TRITON_GROUPED_GEMMS:
        pytest.skip("needs Triton")
    sizes, fast, inference = MX_CASES[case]
    scaled_grouped_mm_here((9, 0))
    recipe = dataclasses.replace(recipes.mxfp8_block_scaling(), fast_accumulation=fast)
    model, x = Model(sizes), inputs(sum(sizes))
    compiled = graphquant.compile(copy.deepcopy(model), recipe, mode="inference" if inference else None, backend="aot_eager", fullgraph=True)
    with torch.set_grad_enabled(not inference):
        out = compiled(x.clone().requires_grad_(not inference)).detach()
    [fprop] = [g for g in compiled.graphquant.plan.gemms if g.gemm == "fprop"]
    mx = backends.TRITON_GROUPED_GEMMS[1].backend
    assert str(fprop.backend) == (f"{mx} (fast accumulation)" if case == "few tokens" else backends.EMULATION), fprop
    scaled_grouped_mm_here(None)
    with torch.no_grad():
        emulated = graphquant.compile(copy.deepcopy(model), recipe, mode="inference", backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(out, emulated)


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
    """``recipe`` on the grouped GEMMs, every sum in fp32 (so that each GEMM meets the reference's
    bound); the router in high precision (its 8 outputs tile no 32-row MXFP8 block)."""
    return CustomRecipe(lambda role: recipe.qfactory(role) if role.module_type == "grouped_linear" else IdentityQuantizer(), fast_accumulation=())


CHAIN_RECIPES = {"tensorwise": lambda: zoo.recipe("tensorwise"), "mxfp8": recipes.mxfp8_block_scaling}


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("routed", [False, True], ids=["fixed_offsets", "routed"])
@pytest.mark.parametrize("name", sorted(CHAIN_RECIPES))
def test_chained_grouped_mms_match_reference_under_aot_eager_and_inductor(name, routed, device, without_triton_grouped_gemm):
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
    grouped = [(g.site, g.gemm, g.bucket) for g in compiled.graphquant.plan.gemms if g.module_type == "grouped_linear"]
    assert grouped == [(f"grouped_linear.{i}#0", gemm, "emulated") for i in (0, 1) for gemm in ("fprop", "dgrad", "wgrad")]

    torch._dynamo.reset()
    inductor = graphquant.compile(inductor_model, recipe, fullgraph=True)  # backend="inductor"
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        actual = forward_backward(inductor, inductor_model, x)
    assert_same_results(actual, eager_graph, slack=INDUCTOR_SLACK, what="inductor: ")


# -- routers -----------------------------------------------------------------------------------


class RoutedLayer(torch.nn.Module):
    """A top-1 MoE layer whose router (an nn.Linear with 8 outputs) tiles no MXFP8 block."""

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(DIM, EXPERTS, bias=False, dtype=torch.bfloat16)
        self.up = torch.nn.Parameter((torch.randn(EXPERTS, DIM, DIM, generator=torch.Generator().manual_seed(5)) / DIM**0.5).to(torch.bfloat16))

    def forward(self, x):
        gate, expert = self.router(x).softmax(-1).max(-1)
        order = expert.argsort(stable=True)
        offs = torch.bincount(expert, minlength=EXPERTS).cumsum(0).to(torch.int32)
        y = torch._grouped_mm(x[order], self.up, offs=offs)
        return y[order.argsort()] * gate[:, None]


class GatheredLayer(RoutedLayer):
    """RoutedLayer whose gather indexes from the end (negative indices, as x[i - T]) where
    ``from_end``."""

    def __init__(self, from_end=False):
        super().__init__()
        self.from_end = from_end

    def forward(self, x):
        gate, expert = self.router(x).softmax(-1).max(-1)
        order = expert.argsort(stable=True)
        offs = torch.bincount(expert, minlength=EXPERTS).cumsum(0).to(torch.int32)
        y = torch._grouped_mm(x[order - x.shape[0] if self.from_end else order], self.up, offs=offs)
        return y[order.argsort()] * gate[:, None]


@pytest.mark.parametrize("name", ["rowwise", "tensorwise", "mxfp8"])
def test_tokens_gathered_for_a_grouped_site_alone_are_read_through_the_gather(name, monkeypatch):
    """x[order] that only a grouped site reads (an MoE layer's tokens sorted by expert) reaches
    the site as x and the index, which the quantize reads x's rows through: no copy of the
    gathered tokens is written, x's gradient sums its rows as indexing's backward does, and the
    output and every gradient are the bits of the copied tokens' path; an index counted from the
    end reads the same rows."""
    recipe = recipes.mxfp8_block_scaling() if name == "mxfp8" else zoo.recipe(name)
    x = chain_input("cpu")
    rows = x.shape[0]

    def run(model):
        graphs = []
        keep = lambda gm, example_inputs: graphs.append(gm) or make_boxed_func(gm)  # noqa: E731
        compiled = graphquant.compile(model, recipe, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
        torch._dynamo.reset()
        return forward_backward(compiled, model, x), graphs

    layer = GatheredLayer()
    through, graphs = run(copy.deepcopy(layer))
    forward = graphs[0].graph.nodes
    copies = [n for n in forward if n.target is torch.ops.aten.index.Tensor and n.args[0].op == "placeholder"]  # x[order]
    assert not copies, "the gathered tokens were copied"
    quantizes = [n for n in forward if n.target is torch.ops.graphquant.grouped_quantize.default and n.args[0].meta["val"].shape == (rows, DIM)]
    assert quantizes and all(n.args[3] is not None and n.args[4] is None for n in quantizes)  # a source, no runs
    # x's gradient sums each token's rows as an accumulating index_put, which Inductor compiles;
    # it leaves an index_add to ATen's eager kernel (4.5 ms against 1.2 in the MoE step, H100).
    backward = graphs[1].graph.nodes
    assert not [n for n in backward if n.target is torch.ops.aten.index_add.default]
    assert [n for n in backward if n.target is torch.ops.aten.index_put.default and n.args[3] is True]
    from_end = copy.deepcopy(layer)
    from_end.from_end = True
    assert_same_results(run(from_end)[0], through, what="an index from the end: ")
    monkeypatch.setattr("graphquant.passes.rewrite._tokens_gather", lambda x: None)
    assert_same_results(run(copy.deepcopy(layer))[0], through, what="the copied tokens: ")


# What a model writes between gathering its tokens (tokens = h[tok]) and their grouped GEMM: h or
# tok in place, by each spelling Dynamo keeps in the graph, or h through a view of it.
WRITES_AFTER_THE_GATHER = {
    "none": lambda h, tok: None,
    "h.mul_": lambda h, tok: h.mul_(0.5),
    "h[i] = v": lambda h, tok: h.__setitem__(tok[:8], 0.0),
    "h.index_put_": lambda h, tok: h.index_put_((tok[:8],), h.new_zeros(8, h.shape[1])),
    "h.copy_": lambda h, tok: h.copy_(h.flip(0)),
    "out=h": lambda h, tok: torch.mul(h, 2, out=h),
    "a view of h": lambda h, tok: h.view(4, -1, h.shape[1])[1:].mul_(3),
    "tok.zero_": lambda h, tok: tok.zero_(),
}


class WrittenAfterGather(torch.nn.Module):
    """The tokens h[tok] of a grouped GEMM, and then, before it, h or tok written (WRITES_AFTER_THE_GATHER)."""

    def __init__(self, write):
        super().__init__()
        self.write = WRITES_AFTER_THE_GATHER[write]
        self.w = torch.nn.Parameter((torch.randn(4, DIM, 64, generator=torch.Generator().manual_seed(0)) / 8).bfloat16())
        self.register_buffer("offs", torch.tensor([16, 16, 40, 64], dtype=torch.int32))

    def forward(self, h, tok):
        tok = tok.clone()
        tokens = h[tok]
        self.write(h, tok)
        return torch._grouped_mm(tokens, self.w, offs=self.offs)


def _written_after_gather_runs(write, backend, training, tmp_path):
    """(eager's output, the compiled one's, its rewritten graph's code) of WrittenAfterGather, high precision."""
    model = WrittenAfterGather(write)
    h, tok = torch.randn(64, DIM, generator=torch.Generator().manual_seed(1)).bfloat16(), torch.randperm(64)
    with torch.no_grad():
        expected = model(h.clone(), tok)
    compiled = graphquant.compile(model, CustomRecipe(factories.high_precision_factory), backend=backend, fullgraph=True, dump_dir=str(tmp_path))
    with torch.set_grad_enabled(training), pytest.warns(UserWarning, match="quantizes no GEMM"):
        actual = compiled(h.clone(), tok)
    if training:
        actual.float().sum().backward()
        assert torch.isfinite(model.w.grad).all()
    return expected, actual.detach(), (tmp_path / "graph_000_rewritten.py").read_text()


@pytest.mark.parametrize("training", [False, True], ids=["no_grad", "training"])
@pytest.mark.parametrize("write", sorted(WRITES_AFTER_THE_GATHER))
def test_a_gather_whose_source_or_index_is_written_before_the_grouped_gemm_keeps_its_copy(write, training, tmp_path):
    """The site read h[tok] where it stood, after the model wrote h or tok in place (the graph
    Dynamo hands graphquant keeps in-place ops): eager's gathered values were lost, even in high
    precision. Now the gather is folded into the site only where nothing between writes h, tok
    or a view of them; otherwise the site reads the gathered copy, so the output is eager's
    bit for bit. A training step's forward too."""
    expected, actual, rewritten = _written_after_gather_runs(write, "aot_eager", training, tmp_path)
    assert torch.equal(actual, expected), (actual.float() - expected.float()).abs().max()
    [call] = [line for line in rewritten.splitlines() if "quantized_grouped_mm(" in line]
    assert (", rows = " in call) == (write == "none"), call  # folded only where nothing writes


@pytest.mark.slow
@pytest.mark.parametrize("write", ["h.mul_", "none"])
def test_a_gather_whose_source_is_written_before_the_grouped_gemm_keeps_its_copy_under_inductor(write, tmp_path):
    expected, actual, _ = _written_after_gather_runs(write, "inductor", False, tmp_path)
    assert torch.equal(actual, expected), (actual.float() - expected.float()).abs().max()


class TopTwoLayer(torch.nn.Module):
    """An MoE layer routing each token to two experts, whose tokens sorted by expert are gathered
    by indexing (x[order // 2]: read through the gather) for two chained grouped GEMMs."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.router = torch.nn.Linear(DIM, 4, bias=False, dtype=torch.bfloat16)
        self.up = torch.nn.Parameter((torch.randn(4, DIM, 64, generator=generator) / 8).bfloat16())
        self.down = torch.nn.Parameter((torch.randn(4, 64, DIM, generator=generator) / 8).bfloat16())

    def forward(self, x):
        gate, expert = self.router(x).float().softmax(-1).topk(2, -1)
        order = expert.reshape(-1).argsort(stable=True)
        offs = torch.bincount(expert.reshape(-1), minlength=4).cumsum(0).to(torch.int32)
        y = torch._grouped_mm(F.silu(torch._grouped_mm(x[order // 2], self.up, offs=offs)), self.down, offs=offs)
        return torch.zeros_like(x).index_add(0, order // 2, y * gate.reshape(-1)[order, None].to(y.dtype))


def _empty_batch_step(name, backend, tmp_path):
    """(eager's training step on 0 tokens, graphquant's under recipe ``name``, its rewritten graphs' code)."""
    model, x = TopTwoLayer(), torch.zeros(0, DIM, dtype=torch.bfloat16)
    compiled_model = copy.deepcopy(model)
    compiled = graphquant.compile(compiled_model, RECIPES[name](), backend=backend, dump_dir=str(tmp_path))
    actual = forward_backward(compiled, compiled_model, x)
    reasons = {g.reason for plan in compiled.graphquant.plans for g in plan.gemms}
    assert reasons == {"in high precision: it is empty (m = 0), nothing to quantize"}, reasons
    rewritten = "".join(path.read_text() for path in sorted(tmp_path.glob("graph_*_rewritten.py")))  # bincount breaks the graph
    return forward_backward(model, model, x), actual, rewritten


@pytest.mark.parametrize("name", ["current", "mxfp8", "nvfp4_block_scaling"])
def test_a_training_step_of_no_tokens_gathered_by_indexing_gives_eagers_results(name, tmp_path):
    """0 tokens (a rank or micro-batch that routed none) gathered by indexing: the site read its
    rows through the gather composed with the padded training layout, whose rows indexed the empty
    gather (an IndexError naming nothing under aot_eager). Now the step keeps its products in high
    precision for that call (README), with eager's output and gradients."""
    expected, actual, rewritten = _empty_batch_step(name, "aot_eager", tmp_path)
    assert rewritten.count(", rows = ") == 1, rewritten  # the first GEMM reads its tokens through the gather
    _assert_same_bits(actual, expected)


@pytest.mark.slow
def test_a_training_step_of_no_tokens_gathered_by_indexing_gives_eagers_results_under_inductor(tmp_path):
    expected, actual, _ = _empty_batch_step("mxfp8", "inductor", tmp_path)
    _assert_same_bits(actual, expected)


def _assert_same_bits(actual, expected):
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    for key, e in expected.items():
        a = actual[key]
        assert a.dtype == e.dtype and torch.equal(a, e), f"{key}: {a.shape}/{a.dtype} vs {e.shape}/{e.dtype}"


def test_a_frozen_expert_stack_plans_no_wgrad():
    """A grouped site's plan listed a wgrad for an expert stack that takes no gradient (frozen
    experts, an adapter trained beside them), where a frozen nn.Linear's lists none; the op skipped
    it at run time. The plan lists the GEMMs that run: fprop and dgrad."""
    model = RoutedLayer()
    model.up.requires_grad_(False)
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend="aot_eager", fullgraph=True)
    result = forward_backward(compiled, model, chain_input("cpu"))
    assert model.up.grad is None and torch.isfinite(result["input.grad"]).all()
    assert sorted(g.gemm for g in compiled.graphquant.plan.gemms if g.module_type == "grouped_linear") == ["dgrad", "fprop"]


def test_built_in_recipes_keep_a_narrow_router_in_high_precision_with_the_reason():
    model, x = RoutedLayer(), chain_input("cpu")
    compiled = graphquant.compile(model, recipes.mxfp8_block_scaling(), backend="aot_eager", fullgraph=True)
    result = forward_backward(compiled, model, x)
    assert all(torch.isfinite(t).all() for t in result.values())
    plan = compiled.graphquant.plan
    router = [g for g in plan.gemms if g.site == "router#0"]
    assert [(g.gemm, g.a_format, g.backend.name) for g in router] == [
        (gemm, "identity()", "high-precision matmul") for gemm in ("fprop", "dgrad", "wgrad")
    ]
    assert all(g.reason.startswith("in high precision: its 8 output features tile no block of the recipe's formats") for g in router)
    assert all(g.a_format.startswith("mxfp8") for g in plan.gemms if g.module_type == "grouped_linear")

    # A token count no block divides: the router, small, stays in high precision (the grouped
    # GEMMs pad their groups themselves), where it failed the compile though it would run so.
    torch._dynamo.reset()
    ragged = graphquant.compile(RoutedLayer(), recipes.mxfp8_block_scaling(), backend="aot_eager", fullgraph=True)
    ragged(x[:37])
    reasons = {g.reason for g in ragged.graphquant.plan.gemms if g.site == "router#0"}
    assert reasons == {"in high precision: its 8 output features and 37 rows tile no block of the recipe's formats (mxfp8(fp8_dtype=e4m3))"}

    # Evaluated or served, the router stays in high precision as in training: rowwise blocks alone
    # tile its 8-row weight, and quantized it routed other tokens than the training plan did.
    for mode in (None, "inference"):
        torch._dynamo.reset()
        evaluated = graphquant.compile(RoutedLayer(), recipes.mxfp8_block_scaling(), backend="aot_eager", fullgraph=True, mode=mode)
        with torch.no_grad():
            evaluated(x)
        assert [(g.gemm, g.a_format, g.reason) for g in evaluated.graphquant.plan.gemms if g.site == "router#0"] == [(
            "fprop", "identity()", "in high precision, as in training: its 8 output features tile no block of the recipe's formats (mxfp8(fp8_dtype=e4m3)) there"
        )]

    # Trained behind a frozen backbone (its input takes no gradient, so no dgrad), the router stays
    # in high precision too: its weight's rowwise blocks and wgrad's alone tile, and quantized it
    # routed otherwise than where its input takes a gradient.
    torch._dynamo.reset()
    behind_frozen = graphquant.compile(RoutedLayer(), recipes.mxfp8_block_scaling(), backend="aot_eager", fullgraph=True)
    behind_frozen(x).sum().backward()
    assert [(g.gemm, g.a_format, g.reason) for g in behind_frozen.graphquant.plan.gemms if g.site == "router#0"] == [
        (gemm, "identity()", "in high precision, as where its input takes a gradient: its 8 output features tile no block of the "
         "recipe's formats (mxfp8(fp8_dtype=e4m3)) there")
        for gemm in ("fprop", "wgrad")
    ]

    # Token counts that tile no block take no guard of that check: evaluation compiles the first
    # size's graphs and dynamic ones (two each: the routing breaks the graph), not graphs a count
    # up to the recompile limit.
    torch._dynamo.reset()
    evaluated = graphquant.compile(RoutedLayer(), recipes.mxfp8_block_scaling(), backend="aot_eager")
    with torch.no_grad():
        for rows in (64, 96, 37, 45, 53, 61, 69, 77, 85, 93):
            evaluated(torch.cat([x] * 2)[:rows])
    assert len(evaluated.graphquant.plans) <= 4

    # A factory of the user's own decides per slot: the same formats without the built-in default fail
    # where a GEMM that runs needs the 8-row weight columnwise (dgrad, its input getting a gradient).
    torch._dynamo.reset()
    own = graphquant.compile(RoutedLayer(), CustomRecipe(factories.mxfp8_factory), backend="aot_eager", fullgraph=True)
    with pytest.raises(PlanError, match=r"^router#0 \(linear\) weight: .*multiple of 32"):
        own(x.clone().requires_grad_())


@pytest.mark.slow
def test_moe_benchmark_runs_tiny_on_cpu():
    """benchmarks/moe_step.py --tiny: the MoE layer (router, top-k, shared expert, grouped
    experts) trains under bf16 and graphquant's grouped recipes, every row a time, none an error."""
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).parents[1] / "benchmarks" / "moe_step.py"
    names = "bf16 eager,graphquant rowwise,graphquant nvfp4_row_scaled_fwd_mxfp8_bwd"
    result = subprocess.run(
        [sys.executable, str(script), "--tiny", "--rounds", "1", "--reps", "1", "--configs", names],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in result.stdout.splitlines() if line.startswith("| bf16") or line.startswith("| graphquant")]
    assert [row[0] for row in rows] == names.split(","), result.stdout
    assert all(row[1] and not row[-1] for row in rows), result.stdout  # a time, no error


def test_moe_layer_with_aligned_token_groups_computes_the_same_layer():
    """benchmarks/models.py's MoE with token_group_alignment=16 (how moe_step.py runs torchao's FP8
    grouped GEMMs, which need every expert's rows a multiple of 16) pads each expert's rows with
    zero rows and drops them again: the same outputs and gradients, bit for bit."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "models.py"
    spec = importlib.util.spec_from_file_location("benchmark_models", path)
    benchmark_models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark_models)
    torch.manual_seed(0)
    plain = benchmark_models.MoE(dim=32, experts=4, top_k=2, hidden=32, shared_hidden=32)
    aligned = copy.deepcopy(plain)
    aligned.token_group_alignment = 16
    seen = []
    aligned.experts.register_forward_pre_hook(lambda module, args: seen.append(args[1].clone()))
    x = torch.randn(37, 32, dtype=torch.bfloat16)
    results = [forward_backward(model, model, x) for model in (plain, aligned)]
    for key, value in results[0].items():
        assert torch.equal(results[1][key], value), key
    (offs,) = seen
    assert torch.all(offs % 16 == 0) and offs[-1] > 37 * 2, offs  # the experts saw aligned, padded groups


@pytest.mark.gpu
@pytest.mark.parametrize("quantizer", [NVFP4Quantizer(), Float8CurrentScalingQuantizer("e4m3"), Float8RowwiseQuantizer()], ids=str)
def test_grouped_quantize_of_both_directions_returns_no_aliases_on_gpu(quantizer):
    """A custom op's outputs may not share memory with each other or its input (an error from
    torch 2.12 on), though the kernel makes NVFP4's two directions one global amax."""
    x = inputs().cuda()
    tokens = groups.padding(offsets().cuda(), T, groups.GROUP_ROWS, groups.padded_bound(T, E, groups.GROUP_ROWS))
    tensors = torch.ops.graphquant.grouped_quantize(x, tokens.row_group, tokens.bounds, tokens.source, tokens.runs, quantizer.spec, True, True, None, 0, None, False, None, None)
    storages = [t.untyped_storage().data_ptr() for t in tensors if t.numel()]
    assert len(set(storages)) == len(storages) and x.untyped_storage().data_ptr() not in storages


# -- where a grouped backward's quantized copies die ------------------------------------------------


def extractions_deferred_to_their_readers(nodes):
    """Inductor's scheduler nodes with each result extraction moved to right before its first
    reader: where a fusion that pulls a later kernel ahead leaves the extractions that kernel does
    not need (the H200's MoE backward: grad_output's columnwise copy taken out after the gates'
    gradient kernel, with the wgrad that reads it)."""
    from torch._inductor import ir

    is_extraction = [isinstance(getattr(node, "node", None), ir.MultiOutput) for node in nodes]
    pending = [node for node, extraction in zip(nodes, is_extraction) if extraction]
    ordered = []
    for node in (node for node, extraction in zip(nodes, is_extraction) if not extraction):
        reads = {dep.name for dep in node.read_writes.reads}
        ordered += [e for e in pending if e.get_buffer_names() & reads]
        pending = [e for e in pending if not e.get_buffer_names() & reads]
        ordered.append(node)
    return ordered + pending


def test_grouped_backward_frees_each_quantized_copy_after_its_own_reader():
    """Inductor keeps the list a quantize op returns until its last result is taken out of it: a
    result taken out late (with a wgrad that a fusion left behind) kept grad_output's rowwise FP8
    copy alive past dgrad, its only reader, through the next grouped GEMM (the MoE step's peak on
    the H200). Whatever order the scheduler leaves (here every extraction deferred to its reader),
    each list of the backward is taken apart, and dropped, before the next kernel runs."""
    from torch._inductor.utils import run_and_get_code

    model = ExpertMLP(routed=False)
    deferred = []  # a pass the user set in the same hook still runs, before graphquant's
    options = {"_post_fusion_custom_pass": lambda nodes: deferred.append(1) or extractions_deferred_to_their_readers(nodes)}
    compiled = graphquant.compile(model, experts_quantized(zoo.recipe("rowwise")), fullgraph=True, options=options)
    x = chain_input("cpu").requires_grad_()
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        _, (_, backward) = run_and_get_code(lambda: compiled(x).sum().backward())
    assert len(deferred) == 2  # forward and backward
    lines = [line.strip() for line in backward.splitlines()]
    lists = [(i, line.split(" = ")[0]) for i, line in enumerate(lines) if re.match(r"buf\d+ = torch\.ops\.graphquant\.\w*quantize\.", line)]
    assert len(lists) >= 2, backward  # grad_output's copies for each grouped GEMM (and any weights' made in backward)
    for start, name in lists:
        end = lines.index(f"del {name}", start)
        between = [line for line in lines[start + 1 : end] if not re.match(rf"(buf\d+ = {name}\[\d+\]|assert_|#|del )", line)]
        assert not between, (lines[start], between)


def test_delayed_scaling_keeps_a_slot_per_expert():
    """TE's grouped linear keeps a delayed-scaling slot per GEMM: each expert's input, weight and
    grad_output quantize with their own scale and roll their own amax history (an empty group's
    with amax 0), step after step, in one graph, against the reference's per-expert slots; the
    inputs grow every step and group 3's are 2^10 larger, so a shared or stale scale shows."""
    recipe = recipes.delayed_scaling(amax_history_len=3)
    model, ref_model = Model(), Model()
    tape = GemmTape()
    compiled = graphquant.compile(model, recipe, backend=tape.backend, fullgraph=True)
    reference = Reference(ref_model, recipe, tape=tape)
    for step in range(3):
        tape.clear()
        x = inputs() * (1.0 + step)
        actual = forward_backward(compiled, model, x, grad_seed=step)
        expected = forward_backward(reference, ref_model, x, grad_seed=step)
        tape.assert_all_taken()
        assert_same_results(actual, expected, what=f"step {step}: ")
        for role, state in compiled.graphquant.run_state.delayed.items():
            assert state.shape == (E, 1 + 3)
            for group in range(E):
                scale, history = reference.delayed[(role, group)]
                assert torch.equal(state[group, :1], scale) and torch.equal(state[group, 1:], history), (step, str(role), group)
    scales = compiled.graphquant.run_state.delayed
    assert {r.tensor_type for r in scales} == {"input", "weight", "grad_output"}
    assert all(len(set(state[:, 0].tolist())) > 2 for state in scales.values())  # the experts' scales differ
    assert len(compiled.graphquant.plans) == 1
