"""graphquant._C.mixed_gemm (graphquant.kernels.mixed_input): MXFP8 and NVFP4 weights decoded in
registers on Hopper's bf16 tensor cores, against the float64 product of the reference's values:
the bound is fp32 accumulation's (the emulation's numerics, summed in another order), at row
counts and shapes that leave partial tiles of rows, of tokens and of the weight's block scales,
split K or not (x's values in the kernel's order, mixed_input.operand, are tested on the CPU:
tests/test_mixed_input_plan.py)."""

import pytest
import torch
from reference import cuda_graph_of

from graphquant.formats import fp8
from graphquant.kernels import mixed_input, native
from graphquant.quantizers import ROWWISE, MXFP8Quantizer, NVFP4Quantizer

pytestmark = pytest.mark.gpu

QUANTIZERS = {"mxfp8": MXFP8Quantizer(), "nvfp4": NVFP4Quantizer()}
U = 2.0**-24


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and native.extension_for(torch.device("cuda")) is not None


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="the mixed-input GEMM runs on sm_90 with graphquant's extension built")


def _operands(name: str, m: int, n: int, k: int, device: str = "cuda"):
    torch.manual_seed(0)
    q = QUANTIZERS[name]
    x = (torch.randn(m, k) * torch.rand(m, 1) * 8).to(device)
    w = (torch.randn(n, k) * torch.rand(n, 1) / 8).to(device).to(torch.bfloat16)
    return q(x, rowwise=True, columnwise=False).get(ROWWISE), q(w, rowwise=True, columnwise=False).get(ROWWISE)


@needs_sm90
@pytest.mark.parametrize("splits", [1, 3, 0], ids=["whole K", "K in 3", "K split for the SMs"])
@pytest.mark.parametrize("tokens", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("m,n,k", [(1, 256, 256), (17, 384, 512), (100, 4096, 1024), (256, 300, 1280), (1000, 1024, 4096)])
@pytest.mark.parametrize("name", QUANTIZERS)
def test_mixed_gemm_matches_float64_reference(name, m, n, k, tokens, splits):
    a, b = _operands(name, m, n, k)
    bias = (torch.randn(n) * 4).cuda().to(torch.bfloat16)
    out = mixed_input.gemm(a, b, torch.float32, bias, tokens=tokens, splits=splits)
    assert out.shape == (m, n) and out.dtype == torch.float32
    left, right = a.gemm_operand(torch.float64), b.gemm_operand(torch.float64)
    ref = left @ right.t() + bias.double()
    bound = fp8.accumulation_bound(left, right.t(), fp8.FP32) + 4 * U * (left.abs() @ right.abs().t()) + ref.abs() * 2 * U
    assert ((out.double() - ref).abs() - bound).max().item() <= 0


@needs_sm90
@pytest.mark.parametrize("name", QUANTIZERS)
def test_mixed_gemm_writes_bf16_and_repeats_its_bits(name):
    a, b = _operands(name, 200, 4096, 14336 // 2)
    first = mixed_input.gemm(a, b, torch.bfloat16)
    assert torch.equal(first, mixed_input.gemm(a, b, torch.bfloat16))
    emulated = (a.gemm_operand(torch.float64) @ b.gemm_operand(torch.float64).t()).to(torch.bfloat16)
    assert (first.double() - emulated.double()).abs().max().item() <= 2**-7 * emulated.double().abs().max().item()


@needs_sm90
@pytest.mark.parametrize("splits", [1, 3, 0], ids=["whole K", "K in 3", "K split for the SMs"])
@pytest.mark.parametrize("m", [1, 16, 100])
@pytest.mark.parametrize("name", QUANTIZERS)
def test_gemms_reading_one_x_in_one_launch(name, m, splits):
    """Three weights that read one x (q, k and v scaled down, the last a partial tile), each with
    its own bias (bf16, none, float16) and, for NVFP4, its own global amax, in one launch: at a K
    split given, each output is its GEMM's alone bit for bit (a CTA's sums do not depend on the
    tiles beside it); split for the SMs (for all their tiles together), each is within the float64
    reference's bound."""
    torch.manual_seed(0)
    q = QUANTIZERS[name]
    x = (torch.randn(m, 1024) * 8).cuda()
    a = q(x, rowwise=True, columnwise=False).get(ROWWISE)
    bs = [q((torch.randn(n, 1024) / scale).cuda().to(torch.bfloat16), rowwise=True, columnwise=False).get(ROWWISE) for n, scale in ((512, 8), (128, 64), (200, 2))]
    biases = [(torch.randn(512) * 4).cuda().to(torch.bfloat16), None, (torch.randn(200) * 4).cuda().to(torch.float16)]
    values, amax = mixed_input.operand(a), mixed_input.a_amax(a)
    outs = mixed_input.multiply(values, amax, bs, torch.float32, biases, splits=splits)
    for out, b, bias in zip(outs, bs, biases, strict=True):
        assert out.shape == (m, b.data.shape[0]) and out.dtype == torch.float32
        if splits:
            assert torch.equal(out, mixed_input.multiply(values, amax, [b], torch.float32, [bias], splits=splits)[0])
        left, right = a.gemm_operand(torch.float64), b.gemm_operand(torch.float64)
        ref = left @ right.t() + (0 if bias is None else bias.double())
        bound = fp8.accumulation_bound(left, right.t(), fp8.FP32) + 4 * U * (left.abs() @ right.abs().t()) + ref.abs() * 2 * U
        assert ((out.double() - ref).abs() - bound).max().item() <= 0


@needs_sm90
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="one GPU")
@pytest.mark.parametrize("name", QUANTIZERS)
def test_mixed_gemm_runs_on_each_device_of_the_process(name):
    """Each device holds its own copy of the kernel, so its shared memory is opted into on each
    (hopper.cuh's opt_in_shared_memory), not on the first device the process used alone: the same
    product, bit for bit, on the second device and back on the first."""
    first = mixed_input.gemm(*_operands(name, 100, 1024, 1024, "cuda:0"), torch.float32)
    for device in ("cuda:1", "cuda:0"):
        out = mixed_input.gemm(*_operands(name, 100, 1024, 1024, device), torch.float32)
        assert out.device == torch.device(device) and torch.equal(out.cpu(), first.cpu()), device


def _x_values(x: torch.Tensor, q):
    """x's values and (NVFP4) global amax as a frozen model's graph makes them: the amax by torch
    ops, the values by graphquant::mixed_input_operand's kernel, a dependent launch."""
    from graphquant.kernels import triton_mixed_operand

    amax = mixed_input.x_amax(x, q)
    return triton_mixed_operand.values(x, amax, q), amax


@needs_sm90
@pytest.mark.parametrize("m", [16, 100], ids=["16 rows, two CTAs an SM", "100 rows"])
@pytest.mark.parametrize("name", QUANTIZERS)
def test_dependent_launches_read_what_the_kernels_before_them_left(name, m):
    """Every mixed-input GEMM is a dependent launch that copies a stored weight's first steps before
    the kernel before it has finished, and lets the kernel after it start once that kernel has: a
    chain as a frozen layer runs it, behind a spinning kernel (x's values made, two GEMMs reading
    them, the second with its K split, in a launch of two; the first's output made into values for a third), eagerly
    and in CUDA graph replays on a new x each: each output is the one made a kernel at a time (a
    GEMM that read x early would give the last replay's product, or a partly written one's)."""
    q = QUANTIZERS[name]
    torch.manual_seed(0)
    weights = [q(w.cuda().to(torch.bfloat16), rowwise=True, columnwise=False).get(ROWWISE) for w in (torch.randn(4096, 1024) / 32, torch.randn(1024, 4096) / 64)]
    x = torch.empty(m, 1024, device="cuda", dtype=torch.bfloat16)

    def chain(synchronized: bool):
        def then(y):
            if synchronized:
                torch.cuda.synchronize()
            return y

        values, amax = then(_x_values(x, q))
        (first,) = then(mixed_input.multiply(values, amax, weights[:1], torch.bfloat16, stored_weight=True))
        beside, shared = then(mixed_input.multiply(values, amax, weights[:1] * 2, torch.float32, splits=4, stored_weight=True))
        (after,) = then(mixed_input.multiply(*then(_x_values(first, q)), weights[1:], torch.float32, stored_weight=True))
        return first, beside, shared, after

    def step():
        torch.cuda._sleep(1 << 20)
        return chain(synchronized=False)

    generator = torch.Generator(device="cuda").manual_seed(1)
    new_xs = [torch.randn(m, 1024, device="cuda", generator=generator).to(torch.bfloat16) for _ in range(6)]
    for new_x in new_xs[:2]:
        x.copy_(new_x)
        expected = chain(synchronized=True)
        for out, want in zip(step(), expected, strict=True):
            assert torch.equal(out, want)
    graph, outs = cuda_graph_of(step)
    for new_x in new_xs[2:]:
        x.copy_(new_x)
        graph.replay()
        for out, want in zip(outs, chain(synchronized=True), strict=True):
            assert torch.equal(out, want)


@needs_sm90
@pytest.mark.parametrize("name", QUANTIZERS)
def test_a_weight_quantized_by_the_kernel_before_is_read_as_it_left_it(name):
    """A weight not stored (quantized at each call, as a model not frozen runs it) may be written by
    the kernel just before the GEMM, here the small quantize whose dependents may start as soon as it
    begins: the GEMM reads it only after that kernel has finished, so each replay multiplies the
    weight of that replay."""
    q = QUANTIZERS[name]
    torch.manual_seed(0)
    values, amax = _x_values(torch.randn(16, 1024, device="cuda").to(torch.bfloat16), q)
    w = torch.empty(256, 1024, device="cuda", dtype=torch.bfloat16)

    def step():
        torch.cuda._sleep(1 << 20)
        return mixed_input.multiply(values, amax, [q(w, rowwise=True, columnwise=False).get(ROWWISE)], torch.float32)[0]

    def alone(new_w):
        wq = q(new_w, rowwise=True, columnwise=False).get(ROWWISE)
        torch.cuda.synchronize()
        return mixed_input.multiply(values, amax, [wq], torch.float32)[0]

    graph, out = cuda_graph_of(step)
    generator = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(4):
        new_w = torch.randn(256, 1024, device="cuda", generator=generator).to(torch.bfloat16)
        w.copy_(new_w)
        graph.replay()
        assert torch.equal(out, alone(new_w))
