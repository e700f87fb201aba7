"""Where the plan runs graphquant's mixed-input GEMM (graphquant.kernels.mixed_input) on a faked
Hopper whose extension has it: MXFP8 x MXFP8 (E4M3) and NVFP4 x NVFP4 fprops of 2 to 1024 rows whose
k is a multiple of 128; fewer rows go to the decode GEMM, more to the emulation, other
formats and shapes elsewhere, each with the reason in the plan; x's values in the order the kernel
reads them. The kernel's numerics are tested on the GPU (tests/test_mixed_gemm_gpu.py); here the
call is stood in for by its numerics in torch (reference.mixed_input_stand_in)."""

import copy

import models
import pytest
import torch
from reference import mixed_input_stand_in

import graphquant
from graphquant import recipes
from graphquant.kernels import backends, mixed_input
from graphquant.kernels.backends import GemmBackend
from graphquant.quantizers import COLUMNWISE, ROWWISE, MXFP8Quantizer, NVFP4Quantizer

CUDA = torch.device("cuda")
MIXED = GemmBackend(mixed_input.BACKEND)


@pytest.fixture
def hopper(monkeypatch):
    """A CUDA device of capability 9.0 whose extension has the mixed-input GEMM (both faked)."""
    monkeypatch.setattr(backends, "capability", lambda device: (9, 0))
    monkeypatch.setattr(mixed_input, "extension_runs", lambda device: True)
    backends.clear_caches()
    yield
    backends.clear_caches()


def _backend(qa, qb, dims, a_direction=ROWWISE, b_direction=ROWWISE):
    return backends.select(qa, a_direction, qb, b_direction, CUDA, dims).backend


def _kernel_position(k: int, family: str) -> int:
    """Where mixed_gemm.cu reads x's value of K offset ``k`` within its 64-wide atom: thread t of a
    quad decodes the weight's K 16t..16t+15 into fragment columns 2t, 2t+1, 2t+8, 2t+9 of the four
    k16 slices, a bf16 pair the two values a decoding step makes (MXFP8: bytes (0 2)(1 3) of a
    word; NVFP4: nibbles (0 4)(1 5)(2 6)(3 7))."""
    t, i = divmod(k, 16)
    if family == "mxfp8":
        return 16 * (i // 4) + 2 * t + 8 * (i & 1) + (i >> 1) % 2
    return 16 * (i % 4) + 2 * t + 8 * (i // 8) + (i // 4) % 2


@pytest.mark.parametrize("q", [MXFP8Quantizer(), NVFP4Quantizer(), NVFP4Quantizer(with_2d_quantization=True)], ids=str)
def test_x_values_are_the_reference_values_in_the_kernel_order(q):
    torch.manual_seed(0)
    a = q(torch.randn(33, 640) * torch.rand(33, 1) * 8, rowwise=True, columnwise=False).get(ROWWISE)
    values = mixed_input.operand(a)
    reference = a.quantizer.emulated_values(a).to(torch.bfloat16)  # without NVFP4's global factor, as the kernel
    family = q.gemm_input(ROWWISE).family
    order = torch.tensor([atom * 64 + _kernel_position(i, family) for atom in range(10) for i in range(64)])
    assert values.dtype == torch.bfloat16 and values.is_contiguous()
    assert torch.equal(values[:, order].view(torch.int16), reference.view(torch.int16))
    assert torch.equal(a.quantizer.emulated_values(a), reference.float())  # the values are bf16 numbers: exact


@pytest.mark.parametrize("q", [MXFP8Quantizer(), NVFP4Quantizer(), NVFP4Quantizer(with_2d_quantization=True)], ids=str)
def test_each_formats_rows_run_on_it(hopper, q):
    """Both formats from 2 rows to 1024; one row on the decode GEMM, more than 1024 emulated."""
    fewest = 2
    for m in (m for m in (2, 16, 17, 100, 128, 512, 1024) if m >= fewest):
        for fast in (False, True):  # it sums in fp32 whatever the recipe allows
            assert backends.select(q, ROWWISE, q, ROWWISE, CUDA, (m, 4096, 14336), 1, fast).backend == MIXED
    assert _backend(q, q, (100, 200, 256)) == MIXED  # any n: partial tiles of the weight's rows
    decode = GemmBackend(backends.triton_decode.BACKEND) if backends.DECODE_GEMMS else GemmBackend(backends.EMULATION)
    assert _backend(q, q, (fewest - 1, 4096, 4096)) == decode
    assert _backend(q, q, (1025, 4096, 4096)) == GemmBackend(backends.EMULATION)
    family, element = q.gemm_input(ROWWISE).family, q.gemm_input(ROWWISE).element
    misfit = backends.MIXED_INPUT_GEMM.misfit((fewest - 1, 4096, 4096), families=(family, family), elements=(element, element))
    assert misfit.startswith(f"{mixed_input.BACKEND} multiplies {fewest} to 1024 rows of A for {family} x {family}"), misfit


def test_what_it_does_not_take_goes_elsewhere_with_the_reason(hopper):
    mx = MXFP8Quantizer()
    nv, nv_rows = NVFP4Quantizer(), NVFP4Quantizer(row_scaled_nvfp4=True)  # a factor a row of A: no one alpha
    for qa, qb in ((MXFP8Quantizer("e5m2"), mx), (mx, MXFP8Quantizer("e5m2")), (nv_rows, nv), (mx, nv), (nv, mx)):
        assert _backend(qa, qb, (100, 4096, 4096)) != MIXED
    selection = backends.select(mx, ROWWISE, mx, ROWWISE, CUDA, (300, 4096, 4000))  # past the decode GEMM's rows
    assert selection.backend != MIXED and "needs k a multiple of 128; got (m, n, k) = (300, 4096, 4000)" in selection.reason
    selection = backends.select(mx, ROWWISE, mx, ROWWISE, CUDA, (2048, 4096, 4096))
    assert selection.backend != MIXED and "multiplies 2 to 1024 rows of A for mxfp8 x mxfp8" in selection.reason
    # A dgrad's weight (MXFP8's columnwise data keeps the reduction dim first), a batch, unknown rows.
    assert _backend(mx, mx, (100, 4096, 4096), b_direction=COLUMNWISE) != MIXED
    assert backends.select(mx, ROWWISE, mx, ROWWISE, CUDA, (100, 4096, 4096), batch=2).backend != MIXED
    assert _backend(mx, mx, (None, 4096, 4096)) != MIXED


def test_not_where_the_extension_lacks_it_or_on_blackwell(hopper, monkeypatch):
    mx = MXFP8Quantizer()
    monkeypatch.setattr(mixed_input, "extension_runs", lambda device: False)
    backends.clear_caches()
    assert _backend(mx, mx, (100, 4096, 4096)) != MIXED
    monkeypatch.setattr(mixed_input, "extension_runs", lambda device: True)
    monkeypatch.setattr(backends, "capability", lambda device: (10, 0))
    backends.clear_caches()
    assert _backend(mx, mx, (128, 4096, 4096)) == GemmBackend(backends.scaled_mm.MXFP8)


@pytest.mark.parametrize(
    "recipe,m",
    [(recipes.mxfp8_block_scaling, 100), (recipes.nvfp4_block_scaling, 100), (recipes.mxfp8_block_scaling, 4)],
    ids=["mxfp8 100 rows", "nvfp4 100 rows", "mxfp8 4 rows"],
)
def test_a_frozen_model_runs_its_rows_on_it(hopper, monkeypatch, recipe, m):
    """Every linear's fprop at m rows (MXFP8's 4: a batch of 4 generating) planned on it, the
    plan's dump naming it, and each call reaching it with its rows (stood in for by
    reference.mixed_input_stand_in on this CPU); at 2048 rows not. (One row is the decode GEMM's:
    test_each_formats_rows_run_on_it; a CPU tensor cannot reach Triton's where it is installed.)"""
    rows = []
    monkeypatch.setattr(mixed_input, "multiply", mixed_input_stand_in(rows))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 384), torch.nn.GELU(), torch.nn.Linear(384, 256))
    compiled = graphquant.compile(model.to(torch.bfloat16), recipe(), mode="inference", backend="aot_eager", dynamic=False)
    graphquant.freeze(compiled)
    with torch.no_grad():
        for rows_of_x in (m, 2048):
            compiled(torch.randn(rows_of_x, 256, dtype=torch.bfloat16))
    plans = compiled.graphquant.plans
    fprops = [g for g in plans[0].gemms if g.gemm == "fprop"]
    assert len(fprops) == 2 and all(g.backend == MIXED for g in fprops), str(plans[0])
    assert sum(mixed_input.BACKEND in line for line in str(plans[0]).splitlines()) == 2, str(plans[0])
    assert all(g.backend != MIXED for g in plans[1].gemms), str(plans[1])
    assert rows == [m, m]


@pytest.mark.parametrize("from_x", [True, False], ids=["values from x", "values from x's representation"])
@pytest.mark.parametrize("recipe", [recipes.mxfp8_block_scaling, recipes.nvfp4_block_scaling], ids=lambda r: r.__name__)
def test_only_a_frozen_models_gemms_are_told_their_weights_are_stored(hopper, monkeypatch, recipe, from_x):
    """A frozen model's weights are written by no kernel of its graph, so its GEMMs may copy their
    first steps before the kernel before them has finished (mixed_gemm.cu's dependent launch); a
    model that quantizes its weights at each call must not let them (the quantize may be that
    kernel), whichever way x's values are made."""
    stored = []
    monkeypatch.setattr(mixed_input, "multiply", mixed_input_stand_in([], stored))
    monkeypatch.setattr(mixed_input, "values_from_x", lambda q: from_x)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 384), torch.nn.GELU(), torch.nn.Linear(384, 256)).to(torch.bfloat16)
    x = torch.randn(100, 256, dtype=torch.bfloat16)
    for freeze in (False, True):
        compiled = graphquant.compile(copy.deepcopy(model), recipe(), mode="inference", backend="aot_eager", dynamic=False)
        if freeze:
            graphquant.freeze(compiled)
        with torch.no_grad():
            compiled(x)
        torch._dynamo.reset()
    assert stored == [False, False, True, True]


@pytest.mark.parametrize("recipe", [recipes.mxfp8_block_scaling, recipes.nvfp4_block_scaling], ids=lambda r: r.__name__)
def test_a_frozen_models_x_values_are_made_from_x_by_one_op(hopper, monkeypatch, recipe):
    """Each linear's x goes to graphquant::mixed_input_operand whole (mixed_input.operand_of_x on
    this CPU), and the model's output is the one it gives with x's values made from x's
    representation, bit for bit."""
    monkeypatch.setattr(mixed_input, "multiply", mixed_input_stand_in([]))
    made, operand_of_x = [], mixed_input.operand_of_x
    monkeypatch.setattr(mixed_input, "operand_of_x", lambda x, amax, q: made.append(tuple(x.shape)) or operand_of_x(x, amax, q))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 384), torch.nn.GELU(), torch.nn.Linear(384, 256)).to(torch.bfloat16)
    x = torch.randn(100, 256, dtype=torch.bfloat16)
    outputs = []
    for from_x in (True, False):
        monkeypatch.setattr(mixed_input, "values_from_x", lambda q, from_x=from_x: from_x)
        compiled = graphquant.compile(copy.deepcopy(model), recipe(), mode="inference", backend="aot_eager", dynamic=False)
        graphquant.freeze(compiled)
        with torch.no_grad():
            outputs.append(compiled(x))
        torch._dynamo.reset()
    assert made == [(100, 256), (100, 384)]
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [recipes.mxfp8_block_scaling, recipes.nvfp4_block_scaling], ids=lambda r: r.__name__)
def test_under_inductor_a_swiglus_gate_and_up_share_one_values_op(hopper, monkeypatch, recipe):
    """A frozen SwiGLU compiled by Inductor makes x's values once for the gate and up projections
    (one op call each forward for x and one for the product) and gives aot_eager's output bit for
    bit (Inductor rounding the SwiGLU's intermediates to bf16 as eager does, from torch 2.13 on:
    2.11's CPU kernels round silu(g) * u otherwise, emulate_precision_casts or not, torch's own
    compile of it alone included)."""
    monkeypatch.setattr(mixed_input, "multiply", mixed_input_stand_in([]))
    made, operand_of_x = [], mixed_input.operand_of_x
    monkeypatch.setattr(mixed_input, "operand_of_x", lambda x, amax, q: made.append(tuple(x.shape)) or operand_of_x(x, amax, q))
    torch.manual_seed(0)
    model = models.SwiGLU(dim=256, hidden=384).to(torch.bfloat16)
    x = torch.randn(100, 256, dtype=torch.bfloat16)
    outputs = {}
    for backend in ("inductor", "aot_eager"):
        compiled = graphquant.compile(copy.deepcopy(model), recipe(), mode="inference", backend=backend, dynamic=False)
        graphquant.freeze(compiled)
        made.clear()
        with torch.no_grad(), torch._inductor.config.patch(emulate_precision_casts=True):
            outputs[backend] = compiled(x)
        torch._dynamo.reset()
        if backend == "inductor":
            assert made == [(100, 256), (100, 384)], made
    if torch.torch_version.TorchVersion(torch.__version__) >= (2, 13):
        assert torch.equal(outputs["inductor"], outputs["aot_eager"])


class Projections(torch.nn.Module):
    """Four linears with biases that read one x (of 128 to 384 rows each), their outputs side by side."""

    def __init__(self, dim: int):
        super().__init__()
        self.projections = torch.nn.ModuleList(torch.nn.Linear(dim, n) for n in (256, 128, 384, 128))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([projection(x) for projection in self.projections], dim=-1)


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "per call"])
@pytest.mark.parametrize("recipe", [recipes.mxfp8_block_scaling, recipes.nvfp4_block_scaling], ids=lambda r: r.__name__)
def test_linears_that_read_one_x_share_a_launch_up_to_three(hopper, monkeypatch, recipe, frozen):
    """Four linears that read one x, frozen or quantizing their weights at each call: the first
    three in one launch (one call, naming their three sites), the fourth in its own, each output
    with its own bias in its place: the model's output is the one it gives a launch each, bit for
    bit (the stand-in's numerics are each product's alone; on the GPU, at a K split given, so are
    the kernel's: tests/test_mixed_gemm_gpu.py)."""
    launches, outputs = [], []
    monkeypatch.setattr(mixed_input, "multiply", mixed_input_stand_in([], launches=launches))
    torch.manual_seed(0)
    model = Projections(256).to(torch.bfloat16)
    x = torch.randn(16, 256, dtype=torch.bfloat16)
    for shared_launch in (mixed_input.SHARED_LAUNCH, 1):
        monkeypatch.setattr(mixed_input, "SHARED_LAUNCH", shared_launch)
        compiled = graphquant.compile(copy.deepcopy(model), recipe(), mode="inference", backend="aot_eager", dynamic=False)
        if frozen:
            graphquant.freeze(compiled)
        with torch.no_grad():
            outputs.append(compiled(x))
        torch._dynamo.reset()
    assert launches == [3, 1, 1, 1, 1, 1]
    assert torch.equal(outputs[0], outputs[1])


def test_one_launch_refuses_what_it_cannot_run():
    """More weights than SHARED_LAUNCH, weights of two formats, or a bias short of one a weight:
    refused before any kernel, naming what it runs."""
    mx, nv = MXFP8Quantizer(), NVFP4Quantizer()
    x = mx(torch.randn(16, 128), columnwise=False).get(ROWWISE)
    values = mixed_input.operand(x)

    def weights(quantizer, count):
        return [quantizer(torch.randn(128, 128).to(torch.bfloat16), columnwise=False).get(ROWWISE) for _ in range(count)]

    refused = {
        "runs 1 to 3 weights": (weights(mx, 4), None),
        "all of one format": (weights(mx, 1) + weights(nv, 1), None),
        "each with its bias or None": (weights(mx, 2), [None]),
    }
    for message, (bs, biases) in refused.items():
        with pytest.raises(ValueError, match=message):
            mixed_input.multiply(values, None, bs, torch.bfloat16, biases)


def test_the_shared_op_passes_opcheck(hopper, monkeypatch):
    """graphquant::mixed_input_gemms (the kernel stood in for on this CPU): its fake's outputs, one
    a weight, match the op's, and it registers no autograd of its own."""
    monkeypatch.setattr(mixed_input, "multiply", mixed_input_stand_in([]))
    quantizer = NVFP4Quantizer()
    x = quantizer(torch.randn(16, 128).to(torch.bfloat16), columnwise=False).get(ROWWISE)
    ws = [quantizer(torch.randn(rows, 128).to(torch.bfloat16), columnwise=False).get(ROWWISE) for rows in (64, 32)]
    args = (
        mixed_input.operand(x), mixed_input.a_amax(x), [t for w in ws for t in w.tensors()], quantizer.spec, ROWWISE, [64, 128, 32, 128],
        torch.bfloat16, "fc1#0 fprop, fc3#0 fprop", [None, torch.randn(32).to(torch.bfloat16)],
    )
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.graphquant.mixed_input_gemms.default, args, test_utils=utils)
