"""The Triton kernels behind fp8_scales and the emulated GEMM's dequantization, bit for bit."""

import pytest
import torch

from graphquant.formats import fp8, mxfp8, nvfp4
from graphquant.quantizers import COLUMNWISE, ROWWISE, MXFP8Quantizer, NVFP4Quantizer

pytestmark = pytest.mark.gpu

SPECIAL = [0.0, float("inf"), float("nan"), 1e-45, 1e-40, 3e38, 448.0, 1.0]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("epsilon", [0.0, 1e-12])
def test_fp8_scales_kernel_matches_reference(fmt, pow2, epsilon):
    torch.manual_seed(0)
    amax = torch.cat([torch.tensor(SPECIAL), torch.rand(5000) * 10.0 ** torch.randint(-30, 30, (5000,))])
    cpu_scale, cpu_inverse = fp8.scales(amax, fmt, epsilon, pow2)
    gpu_scale, gpu_inverse = torch.ops.graphquant.fp8_scales(amax.cuda(), fmt, epsilon, pow2)
    # The Triton kernel ran, not the reference: the op has a CUDA kernel of its own.
    assert torch._C._dispatch_has_kernel_for_dispatch_key("graphquant::fp8_scales", "CUDA")
    assert torch.equal(gpu_scale.cpu().view(torch.int32), cpu_scale.view(torch.int32))
    assert torch.equal(gpu_inverse.cpu().view(torch.int32), cpu_inverse.view(torch.int32))


@pytest.mark.parametrize("shape", [(256, 512), (100, 70), (1, 33)])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_transposed_kernel_is_the_transpose(shape, dtype):
    from graphquant.ops import library

    data = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda").view(dtype)
    assert torch._C._dispatch_has_kernel_for_dispatch_key("graphquant::transposed", "CUDA")
    out = library.transposed(data)
    assert out.is_contiguous() and torch.equal(out.view(torch.uint8), data.t().contiguous().view(torch.uint8))


def _same_bits(values: torch.Tensor, reference: torch.Tensor) -> bool:
    """bf16 values bit for bit equal to the fp32 reference (exact in bf16), signs of zeros included."""
    return torch.equal(values.view(torch.int16), reference.to(torch.bfloat16).view(torch.int16))


# Whole programs, and partial ones in both dims (the kernels cover 16 x 256 elements each).
SHAPES = [(256, 512), (96, 544)]


@pytest.mark.parametrize("direction", [ROWWISE, COLUMNWISE])
@pytest.mark.parametrize("shape", SHAPES)
def test_mxfp8_dequantize_kernel_matches_reference(direction, shape):
    from graphquant.kernels import triton_dequantize

    torch.manual_seed(0)
    x = torch.randn(*shape, device="cuda") * torch.logspace(-20, 20, shape[1], device="cuda")
    x[3, :32] = 0.0
    rep = MXFP8Quantizer()(x, rowwise=direction == ROWWISE, columnwise=direction == COLUMNWISE).get(direction)
    values = triton_dequantize.mxfp8_values(rep.data, rep.scale, rowwise=direction == ROWWISE)
    reference = mxfp8.dequantize(rep.data, rep.scale, axis=1 if direction == ROWWISE else 0)
    assert _same_bits(values, reference)
    # A slice of columns (emulation.rows_of's cut of a columnwise operand) is read where it lies.
    cols = slice(256, shape[1])
    sliced = triton_dequantize.mxfp8_values(rep.data[:, cols], rep.scale[:, cols], rowwise=False) if direction == COLUMNWISE else None
    assert sliced is None or (sliced.is_contiguous() and _same_bits(sliced, reference[:, cols]))
    # Gathered rows (the tokens read out of a grouped padded layout), rowwise alone.
    rows = torch.randint(0, shape[0], (shape[0] + 7,), device="cuda")
    gathered = triton_dequantize.mxfp8_values(rep.data, rep.scale, rowwise=True, rows=rows) if direction == ROWWISE else None
    assert gathered is None or _same_bits(gathered, reference[rows])


@pytest.mark.parametrize("shape", [(128, 256), (40, 272)])
def test_nvfp4_block_values_kernel_matches_reference(shape):
    from graphquant.kernels import triton_dequantize

    torch.manual_seed(0)
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    rep = NVFP4Quantizer()(x, rowwise=True, columnwise=False).rowwise
    values = triton_dequantize.nvfp4_block_values(rep.data, rep.scale)
    reference = nvfp4.e2m1_values(nvfp4.unpack(rep.data)) * rep.scale.float().repeat_interleave(16, dim=1)
    assert _same_bits(values, reference)
    # A per-row factor (the global decode a row takes) before the one store: torch's values.float() * factor.
    factor = torch.rand(values.shape[0], 1, device="cuda") * 3
    for dtype in (torch.float32, torch.bfloat16):
        scaled = triton_dequantize.nvfp4_block_values(rep.data, rep.scale, row_factor=factor, dtype=dtype)
        assert torch.equal(scaled, (reference * factor).to(dtype))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_e8m0_kernel_matches_reference(fmt):
    torch.manual_seed(0)
    amax = torch.cat([torch.tensor(SPECIAL), torch.rand(5000) * 10.0 ** torch.randint(-44, 38, (5000,))])
    biased, multiplier = torch.ops.graphquant.e8m0_scales(amax.cuda(), fmt)
    expected = mxfp8.e8m0_from_amax(amax, fmt)
    assert torch.equal(biased.cpu(), expected)
    assert torch.equal(multiplier.cpu().view(torch.int32), mxfp8.encode_multiplier(expected).view(torch.int32))


def test_columnwise_nvfp4_dequantize_kernel_reads_noncontiguous_inputs():
    from graphquant.kernels import triton_dequantize

    x = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    rep = NVFP4Quantizer(with_2d_quantization=True)(x, rowwise=False, columnwise=True).columnwise
    values = triton_dequantize.nvfp4_block_values(rep.data, rep.scale)
    reference = nvfp4.e2m1_values(nvfp4.unpack(rep.data)) * rep.scale.float().repeat_interleave(16, dim=1)
    assert _same_bits(values, reference)
    # A per-row factor (the global decode a row takes) before the one store: torch's values.float() * factor.
    factor = torch.rand(values.shape[0], 1, device="cuda") * 3
    for dtype in (torch.float32, torch.bfloat16):
        scaled = triton_dequantize.nvfp4_block_values(rep.data, rep.scale, row_factor=factor, dtype=dtype)
        assert torch.equal(scaled, (reference * factor).to(dtype))
