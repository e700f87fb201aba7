"""The backend the plan chooses for each GEMM is the one that runs it, on every compute capability.

The capability is faked (graphquant.kernels.backends.capability) and the native GEMM call too:
this CPU runs the emulated GEMM in its place. What is checked is the decision that reaches
execution: for every GEMM of a small model (fprop, dgrad, wgrad of each site), the backend whose
entry point ran (graphquant.kernels.scaled_mm.run with its GemmBackend, the decode GEMM, or the
emulated GEMM) is the plan's, with static shapes and with symbolic ones whose alignment (or, for
the decode GEMM, row count) the plan cannot see in the sizes of one call.
"""

import copy

import pytest
import torch
from reference import fresh_dynamo, mixed_input_stand_in  # noqa: F401  (fresh_dynamo: an autouse fixture)
from test_native_gemm_arguments import Model  # two linears and a matmul of activations, dims of 128 or 256

import graphquant
from graphquant import recipes, zoo
from graphquant.kernels import backends, block_scaled, emulation, mixed_input, scaled_mm
from graphquant.kernels.backends import GemmBackend, GemmMismatch
from graphquant.ops.functional import quantized_linear
from graphquant.ops.library import SITES_SEPARATOR
from graphquant.ops.site import Site
from graphquant.quantizers import Float8CurrentScalingQuantizer
from graphquant.roles import QuantizerRole

triton_decode = backends.triton_decode  # None where Triton is not installed

# A recipe whose GEMMs run on each native GEMM where the capability has it.
RECIPE_OF = {
    scaled_mm.TENSORWISE: zoo.recipe("tensorwise"),
    scaled_mm.ROWWISE_SCALED: zoo.recipe("rowwise"),
    scaled_mm.BLOCKWISE: recipes.float8_block_scaling(),
    scaled_mm.MXFP8: recipes.mxfp8_block_scaling(),
    scaled_mm.NVFP4: recipes.nvfp4_block_scaling(),
    # Triton's decode GEMM (where Triton is installed), at a static m of at most 16 rows.
    **{decode.backend: zoo.recipe("rowwise") for decode in backends.DECODE_GEMMS},
    # The mixed-input GEMM (where the extension has it), at a static m of 2 to 1024 rows.
    mixed_input.BACKEND: recipes.mxfp8_block_scaling(),
    # graphquant's block-scaled GEMM (where the extension has it): fprop and dgrad of 128x128 weight tiles.
    block_scaled.BACKEND: recipes.float8_block_scaling(),
}
# The GEMMs that need m known when the plan is made (NativeGemm.rows).
SKINNY = {native.backend for native in backends.NATIVE_GEMMS if native.rows is not None}
# The row counts of the two training steps: the decode GEMM's fit it, the others' 128 and 160.
ROWS_OF = {decode.backend: (16, 4) for decode in backends.DECODE_GEMMS}
CAPABILITIES = [None, (8, 9), (9, 0), (10, 0)]
EMULATED_RUN = "emulation.gemm"


@pytest.fixture
def fake_capability(monkeypatch):
    """fake_capability(sm): the devices of this process have compute capability sm (None: no
    low-precision GEMM), with nothing worked out for another one kept."""

    def fake(sm):
        monkeypatch.setattr(backends, "capability", lambda device: sm)
        backends.clear_caches()

    yield fake
    backends.clear_caches()


@pytest.fixture
def runs(monkeypatch):
    """The dict that each GEMM call adds its "site gemm" label to, with the backend that ran it (a
    native GemmBackend, or EMULATED_RUN); on the CPU the emulated GEMM stands in for a native one."""
    ran, current = {}, []
    dispatch, native, emulated = backends.gemm, scaled_mm.run, emulation.gemm
    mixed_dispatch, mixed = backends.mixed_input_gemm, mixed_input.multiply
    block = block_scaled.gemm
    decode = triton_decode.gemm if backends.DECODE_GEMMS else None

    def at_site(site, call):
        current.append(site)
        try:
            return call()
        finally:
            current.pop()

    def gemm(a, b, batch, out_dtype, backend, site, bias=None):
        return at_site(site, lambda: dispatch(a, b, batch, out_dtype, backend, site, bias))

    def mixed_input_gemm(values, a_amax, bs, out_dtype, sites, biases, stored_weight=False):
        return at_site(SITES_SEPARATOR.join(sites), lambda: mixed_dispatch(values, a_amax, bs, out_dtype, sites, biases, stored_weight))

    def record(what):
        for site in current[-1].split(SITES_SEPARATOR):  # a call of GEMMs sharing x names them all
            assert site not in ran, f"{site} ran twice"
            ran[site] = what

    def native_run(backend, a, b, out_dtype, bias=None):
        record(backend)
        return native(backend, a, b, out_dtype, bias) if a.data.is_cuda else emulated(a, b, 1, out_dtype, bias)[0]

    def decode_run(a, b, out_dtype, bias=None):
        on_load = isinstance(a, triton_decode.QuantizedOnLoad)
        record(GemmBackend(triton_decode.QUANTIZING_BACKEND if on_load else triton_decode.BACKEND))
        if a.data.is_cuda:
            return decode(a, b, out_dtype, bias)
        a = a.quantizer(a.data, columnwise=False).rowwise if on_load else a  # what the kernel would quantize it to
        return emulated(a, b, 1, out_dtype, bias)[0]

    def mixed_run(values, a_amax, bs, out_dtype, biases=None, stored_weight=False):
        record(GemmBackend(mixed_input.BACKEND))
        return (mixed if values.is_cuda else mixed_input_stand_in([]))(values, a_amax, bs, out_dtype, biases, stored_weight=stored_weight)

    def block_run(a, b, out_dtype, bias=None):
        record(GemmBackend(block_scaled.BACKEND))
        return block(a, b, out_dtype, bias) if a.data.is_cuda else emulated(a, b, 1, out_dtype, bias)[0]

    def emulated_run(*args, **kwargs):
        record(EMULATED_RUN)
        return emulated(*args, **kwargs)

    if decode is not None:
        monkeypatch.setattr(triton_decode, "gemm", decode_run)
    monkeypatch.setattr(backends, "gemm", gemm)
    monkeypatch.setattr(scaled_mm, "run", native_run)
    monkeypatch.setattr(backends, "mixed_input_gemm", mixed_input_gemm)
    monkeypatch.setattr(mixed_input, "multiply", mixed_run)
    monkeypatch.setattr(block_scaled, "gemm", block_run)
    monkeypatch.setattr(emulation, "gemm", emulated_run)
    return ran


def _train_steps_run_as_planned(model, recipe, ran, device, backend, rows_of_steps=(128, 160), inference=False):
    """One training step of ``model`` at 128 rows, then at 160 (which fits GEMMs that need
    multiples of 16, not those of 128, and tiles every format's blocks), or at ``rows_of_steps``,
    with static shapes (a graph each) and with symbolic ones (dynamic=True): every GEMM runs on
    its plan's backend. Gives the plans of the first step, static and symbolic. ``inference``:
    forward steps of the model compiled for inference, under no_grad."""
    plans = []
    for dynamic in (False, True):
        torch._dynamo.reset()
        mode = "inference" if inference else None
        compiled = graphquant.compile(copy.deepcopy(model), recipe, backend=backend, dynamic=dynamic, mode=mode)
        for rows in rows_of_steps:
            ran.clear()
            x = torch.randn(rows, 128, dtype=torch.bfloat16, device=device, requires_grad=not inference)
            if inference:
                with torch.no_grad():
                    compiled(x)
            else:
                compiled(x).float().square().mean().backward()
            plan = compiled.graphquant.plan  # the latest graph's: the one this step ran
            planned = {f"{g.site} {g.gemm}": g.backend if g.backend.native else EMULATED_RUN for g in plan.gemms}
            assert ran == planned, f"dynamic={dynamic}, {rows} rows: plan and run disagree\n{plan}"
            assert {g.bucket for g in plan.gemms} <= {backends.NATIVE, backends.EMULATED}
        plans.append(compiled.graphquant.plans[0])
    return plans


def test_every_native_gemm_has_a_recipe_here():
    assert set(RECIPE_OF) == {native.backend for native in backends.NATIVE_GEMMS}


@pytest.mark.parametrize("sm", CAPABILITIES, ids=["cpu" if sm is None else f"sm{sm[0]}{sm[1]}" for sm in CAPABILITIES])
@pytest.mark.parametrize("native", list(RECIPE_OF), ids=[name.replace(" ", "_") for name in RECIPE_OF])
def test_each_gemm_runs_on_the_backend_its_plan_chose(runs, fake_capability, native, sm):
    fake_capability(sm)
    torch.manual_seed(0)
    rows = ROWS_OF.get(native, (128, 160))
    inference = backends.NATIVE_BY_NAME[native].quantizes_a  # it quantizes an x that no backward keeps
    static, symbolic = _train_steps_run_as_planned(Model().to(torch.bfloat16), RECIPE_OF[native], runs, "cpu", "eager", rows, inference)
    # Where the capability has the native GEMM, the aligned shapes ran on it.
    gemm = backends.NATIVE_BY_NAME[native]
    runs_here = sm is not None and gemm.runs_on(sm) and gemm.available(torch.device("cpu"))
    assert (native in {g.backend.name for g in static.gemms}) == runs_here
    if native in SKINNY:  # the skinny GEMMs need m known when the plan is made: not under symbolic rows
        assert native not in {g.backend.name for g in symbolic.gemms}
    if native in ROWS_OF:  # nor the decode GEMM another of its names
        assert not set(ROWS_OF) & {g.backend.name for g in symbolic.gemms}
    # Elsewhere they may take MXFP8's and NVFP4's GEMMs at 128 rows where the tokens are static (x's
    # two dims of 128 share one symbol, which fc1 then makes 128) and not at 160, and say why not.
    for planned, symbolically in zip(static.gemms, symbolic.gemms, strict=True):
        if SKINNY & {planned.backend.name, symbolically.backend.name}:
            continue
        if any(name in planned.reason + symbolically.reason for name in SKINNY):
            assert (planned.bucket, planned.backend) == (symbolically.bucket, symbolically.backend)
        else:
            assert planned == symbolically


ON_THIS_GPU = [scaled_mm.TENSORWISE, scaled_mm.BLOCKWISE, *ROWS_OF, mixed_input.BACKEND, block_scaled.BACKEND]


@pytest.mark.gpu
@pytest.mark.parametrize("native", ON_THIS_GPU, ids=[name.replace(" ", "_") for name in ON_THIS_GPU])
def test_each_gemm_runs_on_the_backend_its_plan_chose_on_this_gpu(runs, native):
    """The same on the GPU, through aot_autograd, with the native GEMMs themselves."""
    torch.manual_seed(0)
    rows = ROWS_OF.get(native, (128, 160))
    inference = backends.NATIVE_BY_NAME[native].quantizes_a
    static, _ = _train_steps_run_as_planned(Model().to("cuda", torch.bfloat16), RECIPE_OF[native], runs, "cuda", "aot_eager", rows, inference)
    sm = torch.cuda.get_device_capability()
    gemm = backends.NATIVE_BY_NAME[native]
    assert (native in {g.backend.name for g in static.gemms}) == (gemm.runs_on(sm) and gemm.available(torch.device("cuda")))


@pytest.mark.skipif(not backends.DECODE_GEMMS, reason="no Triton: no decode GEMM")
@pytest.mark.parametrize(
    "recipe,rows",
    [(zoo.recipe("rowwise"), 4), (recipes.mxfp8_block_scaling(), 1), (recipes.nvfp4_block_scaling(), 16)],
    ids=["rowwise 4 rows", "mxfp8 1 row", "nvfp4 16 rows"],
)
def test_decode_gemm_runs_both_inference_products_as_planned(runs, fake_capability, recipe, rows):
    """Inference at the decode GEMM's rows (those it keeps from the mixed-input GEMM where the
    extension has that: MXFP8's one row, NVFP4's 16): each linear's product, its weight quantized per call and then frozen
    (graphquant.freeze), runs on the decode GEMM its plan chose: FP8 current scaling's on the one
    that quantizes x as it loads it."""
    fake_capability((9, 0))
    compiled = graphquant.compile(Model().to(torch.bfloat16), recipe, mode="inference", backend="eager")
    x = torch.randn(rows, 128, dtype=torch.bfloat16)
    x_format = recipe.qfactory(QuantizerRole("linear", "input", "fc1"))
    on_load = not triton_decode.quantize_on_load_refusal(x_format)
    decode = GemmBackend(triton_decode.QUANTIZING_BACKEND if on_load else triton_decode.BACKEND)
    with torch.no_grad():
        for freeze in (False, True):
            if freeze:
                graphquant.freeze(compiled)
            runs.clear()
            compiled(x)
            plan = compiled.graphquant.plan
            linears = [g for g in plan.gemms if g.module_type == "linear"]
            assert [g.b.endswith("(frozen)") for g in linears] == [freeze, freeze], str(plan)
            assert {f"{g.site} {g.gemm}": g.backend if g.backend.native else EMULATED_RUN for g in plan.gemms} == runs
            assert all(runs[f"{g.site} {g.gemm}"] == decode for g in linears), str(plan)


def test_strict_rejects_a_native_gemm_that_symbolic_sizes_misalign(fake_capability):
    """Under dynamic shapes the plan tests the alignment on the symbols, so strict=True sees the
    emulated GEMM instead of planning a native one that would not run."""
    fake_capability((10, 0))
    compiled = graphquant.compile(Model(), recipes.mxfp8_block_scaling(), backend="eager", dynamic=True, strict=True)
    with pytest.raises(graphquant.PlanError, match=r"fc1#0 \(linear\) fprop: .*strict=True .*needs m, n, k multiples of 128"):
        compiled(torch.randn(160, 128))


def _site(backend: GemmBackend) -> Site:
    spec = Float8CurrentScalingQuantizer().spec
    return Site(name="fc", call=0, input=spec, weight=spec, grad_output=spec, streams=(0, 1, 2), fprop=backend)


def test_a_call_its_backend_cannot_run_fails_naming_site_shape_format_and_backend(fake_capability):
    x, w = torch.randn(40, 64), torch.randn(40, 64)
    fake_capability(None)
    with pytest.raises(GemmMismatch, match=r"fc#0 fprop: its plan chose cublaslt fp8 tensorwise, .*: it does not run on cpu"):
        quantized_linear(x, w, site=_site(GemmBackend(scaled_mm.TENSORWISE)))
    fake_capability((9, 0))
    with pytest.raises(
        GemmMismatch,
        match=r"fc#0 fprop: its plan chose cublaslt fp8 blockwise, which cannot run this call "
        r"\(1 x \(m, n, k\) = \(40, 40, 64\), fp8_current\(fp8_dtype=e4m3\) x fp8_current\(fp8_dtype=e4m3\) on cpu\): "
        r"it does not multiply fp8_current\(fp8_dtype=e4m3\) by fp8_current\(fp8_dtype=e4m3\)",
    ):
        quantized_linear(x, w, site=_site(GemmBackend(scaled_mm.BLOCKWISE)))


@pytest.mark.skipif(not backends.DECODE_GEMMS, reason="no Triton: no decode GEMM")
def test_a_decode_gemm_call_of_more_rows_than_it_takes_fails(fake_capability):
    """The decode GEMM runs where the plan chose it, on the rows it was planned for: a call of more
    rows than it takes does not fall back to another GEMM."""
    fake_capability((9, 0))
    with pytest.raises(
        GemmMismatch,
        match=r"fc#0 fprop: its plan chose triton decode gemm, which cannot run this call \(1 x \(m, n, k\) = \(17, 32, 64\), .*"
        r"triton decode gemm multiplies at most 16 rows of A for fp8_tensorwise x fp8_tensorwise, a number known when the plan is made",
    ):
        quantized_linear(torch.randn(17, 64), torch.randn(32, 64), site=_site(GemmBackend(triton_decode.BACKEND)))
    with pytest.raises(ValueError, match="has no fast accumulation"):
        GemmBackend(triton_decode.BACKEND, fast_accumulation=True)


def test_a_gemm_backend_is_a_known_one():
    with pytest.raises(ValueError, match="unknown GEMM backend 'cublaslt fp8 tensorwise \\(fast accumulation\\)'"):
        GemmBackend("cublaslt fp8 tensorwise (fast accumulation)")
    with pytest.raises(ValueError, match="has no fast accumulation"):
        GemmBackend(scaled_mm.MXFP8, fast_accumulation=True)
    with pytest.raises(ValueError, match="sums only in the tensor cores' accumulator"):
        GemmBackend(backends.SCALED_GROUPED_MM)
    assert eval(repr(GemmBackend(scaled_mm.ROWWISE_SCALED, True)), {"GemmBackend": GemmBackend}) == GemmBackend(scaled_mm.ROWWISE_SCALED, True)
