"""Reference numerics of per-tensor (current, delayed) and blockwise FP8.

Golden vectors are worked out by hand from the rules in te-fine-grained-spec.md 3.1-3.3 and 11;
property tests bound the round-trip error and check layout identities bit for bit.
"""

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphquant.formats import block, fp8, per_tensor
from graphquant.quantizers import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8DelayedScalingQuantizer,
    QuantizeContext,
)
from graphquant.quantizers.float8 import traced_scales

FLT_MAX = torch.finfo(torch.float32).max
NAN, INF = float("nan"), float("inf")
FORMATS = ["e4m3", "e5m2"]
# Per format: half an ulp relative to a normal value (3 or 2 mantissa bits), and half the
# subnormal step (min normal 2**-6 or 2**-14, over 2**3 or 2**2 steps).
HALF_ULP = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}
HALF_SUBNORMAL_STEP = {"e4m3": 2.0**-10, "e5m2": 2.0**-17}


def f32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def fp8_tensor(values, fmt: str) -> torch.Tensor:
    """Values that are exactly representable in ``fmt``, encoded (the cast is exact)."""
    return f32(values).to(fp8.FP8_DTYPES[fmt])


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8)), (actual, expected)


def assert_same_f32(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    assert torch.equal(actual.view(torch.int32), expected.to(torch.float32).view(torch.int32)), (actual, expected)


def spread(seed: int, shape: tuple[int, int], lo: int, hi: int) -> torch.Tensor:
    """Random finite fp32 values of both signs with binary exponents uniform in [lo, hi]."""
    g = torch.Generator().manual_seed(seed)
    exponent = torch.randint(lo, hi + 1, shape, generator=g).double()
    mantissa = 1 + torch.rand(shape, generator=g, dtype=torch.float64)
    sign = torch.randint(0, 2, shape, generator=g).double() * 2 - 1
    return (sign * mantissa * 2.0**exponent).float()


def exact_dequantize(data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """data * scale_inv in float64: an fp8 significand (<= 4 bits) times an fp32 one (24) is exact."""
    return data.double() * scale_inv.double()


def roundtrip_bound(x: torch.Tensor, scale_inv: torch.Tensor, fmt: str) -> torch.Tensor:
    """Largest |exact_dequantize(quantize(x)) - x| allowed, in float64 (scale_inv broadcast to x).

    y = fl32(x * s) is within max(2**-24 |x s|, 2**-150) of x s; the RNE cast moves it by at most
    max(HALF_ULP |y|, HALF_SUBNORMAL_STEP) (saturation only trims the fp32 excess of amax * s
    over fp8_max); scale_inv = fl32(1/s) is within 2**-22 of 1/s relatively, even where it is an
    fp32 subnormal. Multiplying out, with the 2**-150 terms absorbed by the (1 + 2**-20) factor:
        max(HALF_ULP |x|, HALF_SUBNORMAL_STEP scale_inv) (1 + 2**-20) + 2**-20 |x|.
    The bound is on the exact product: the fp32 dequantize rounds it once more and overflows to
    inf where it exceeds FLT_MAX (x within HALF_ULP of FLT_MAX, rounded up to the next fp8 value).
    """
    x, scale_inv = x.double().abs(), scale_inv.double()
    step = torch.maximum(HALF_ULP[fmt] * x, HALF_SUBNORMAL_STEP[fmt] * scale_inv)
    return step * (1 + 2.0**-20) + 2.0**-20 * x


# -- fp8.py ----------------------------------------------------------------------------------


def test_fp8_max():
    assert fp8.fp8_max("e4m3") == 448.0 and fp8.fp8_max("e5m2") == 57344.0
    assert fp8.FP8_DTYPES == {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@pytest.mark.parametrize(
    "fmt, values, expected",
    [
        # e4m3 in [16, 32) has step 2: 17 is halfway between 16 (mantissa 000) and 18 (001).
        ("e4m3", [17.0, 19.0, -17.0, -19.0], [16.0, 20.0, -16.0, -20.0]),
        # In [1, 2) the step is 1/8.
        ("e4m3", [1.0625, 1.1875], [1.0, 1.25]),
        # Just above a tie rounds away from the even neighbour.
        ("e4m3", [17.000002], [18.0]),
        # Subnormals step by 2**-9: 2**-10 ties to 0, 3 * 2**-10 ties to 2**-8 (even).
        ("e4m3", [2.0**-10, 3 * 2.0**-10, -(2.0**-10)], [0.0, 2.0**-8, -0.0]),
        # Top binade (step 32): 400 -> 384 (1.100b), 432 -> 448 (1.110b).
        ("e4m3", [400.0, 432.0], [384.0, 448.0]),
        # Saturation: beyond 448 (464 would tie with a nonexistent 480), and inf.
        ("e4m3", [464.0, 1000.0, -1000.0, INF, -INF], [448.0, 448.0, -448.0, 448.0, -448.0]),
        # e5m2 in [16, 32) has step 4: 18 -> 16 (00b), 22 -> 24 (10b).
        ("e5m2", [18.0, 22.0, -22.0], [16.0, 24.0, -24.0]),
        # e5m2 subnormals step by 2**-16: 2**-17 ties to 0, 3 * 2**-17 to 2**-15.
        ("e5m2", [2.0**-17, 3 * 2.0**-17], [0.0, 2.0**-15]),
        # 61440 is halfway to 65536 (inf in e5m2): saturates to 57344, as does inf.
        ("e5m2", [61440.0, 1e6, INF, -INF], [57344.0, 57344.0, 57344.0, -57344.0]),
        ("e4m3", [0.0, -0.0], [0.0, -0.0]),
    ],
)
def test_cast_rne_and_saturation(fmt, values, expected):
    assert_same_bits(fp8.cast_to_fp8(f32(values), fmt), fp8_tensor(expected, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_cast_keeps_nan(fmt):
    out = fp8.cast_to_fp8(f32([NAN, 1.0]), fmt)
    assert torch.isnan(out.float()[0]) and out.float()[1] == 1.0


def test_tensor_amax():
    x = f32([[-3.0, 2.0], [1.0, 0.0]])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        amax = fp8.tensor_amax(x.to(dtype))
        assert amax.dtype == torch.float32 and amax.shape == () and amax.item() == 3.0
    assert torch.isnan(fp8.tensor_amax(f32([1.0, NAN, INF])))
    assert fp8.tensor_amax(f32([1.0, -INF])).item() == INF
    empty = fp8.tensor_amax(torch.empty(0, 4))
    assert empty.dtype == torch.float32 and empty.shape == () and empty.item() == 0.0


@pytest.mark.parametrize("columns", [4096, 5120, 4608, 5000])  # whole rows, chunks of 1024, of 512, rows no chunk tiles
def test_tensor_amax_of_long_rows(columns):
    x = torch.randn(3, columns, generator=torch.Generator().manual_seed(columns)).to(torch.bfloat16)
    x[2, columns - 1] = -7.5
    assert fp8.tensor_amax(x).item() == 7.5 == x.float().abs().max().item()
    x[1, 100] = NAN
    assert torch.isnan(fp8.tensor_amax(x))
    transposed = x[:, :4096].t()  # not contiguous
    assert torch.isnan(fp8.tensor_amax(transposed))


def test_amax_rounding_to_bfloat16_is_torchs():
    """Every exponent, ties both ways, the largest finite values, subnormals, inf and NaNs."""
    exponents = torch.arange(256, dtype=torch.int32) << 23
    mantissas = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0x17FFF, 0x18000, 0x7FFFFF], dtype=torch.int32)
    edges = (exponents[:, None] | mantissas[None, :]).flatten()
    random = torch.randint(0, 2**31 - 1, (1 << 16,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    bits = torch.cat([edges, random])
    rounded = fp8.rounded_to_bfloat16(bits).view(torch.float32)
    expected = bits.view(torch.float32).to(torch.bfloat16).float()
    assert torch.equal(rounded.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(rounded[finite].view(torch.int32), expected[finite].view(torch.int32))


def _fused_amax(a, b):
    return fp8.tensor_amax(a * b)  # one rounding in eager: a product of two 16-bit floats is exact in fp32


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("columns", [1024, 8192, 4608])  # whole rows, chunks of 1024, of 512
def test_compiled_amax_of_a_fused_producer_is_eagers(device, dtype, columns):
    """Inductor keeps a fused producer's values unrounded: the max must still be of the rounded
    values. Random inputs make the largest product fall between two values of x's dtype almost surely."""
    torch._dynamo.reset()
    compiled = torch.compile(_fused_amax, dynamic=False)
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        a, b = (torch.randn(64, columns, generator=g).to(dtype).to(device) * 3 for _ in range(2))
        assert torch.equal(compiled(a, b), _fused_amax(a, b)), seed


@pytest.mark.parametrize(
    "fmt, amax, kwargs, expected",
    [
        ("e4m3", 448.0, {}, 1.0),
        ("e4m3", 2.0, {}, 224.0),
        ("e4m3", 2.0, {"pow2": True}, 128.0),
        ("e4m3", 0.5, {}, 896.0),
        ("e4m3", 4.0, {"pow2": True}, 64.0),  # 112 -> 64
        ("e4m3", 3.0, {}, 149.33332824707031),  # 149 + 21845 / 2**16: the rest, 1/3 ulp, rounds down
        ("e4m3", 3.0, {"pow2": True}, 128.0),
        ("e4m3", 0.0, {}, 1.0),
        ("e4m3", 0.0, {"pow2": True}, 1.0),
        ("e4m3", INF, {}, 1.0),
        ("e4m3", NAN, {}, 1.0),
        ("e4m3", NAN, {"pow2": True}, 1.0),
        ("e4m3", 1e-45, {}, FLT_MAX),  # 448 / 2**-149 overflows
        ("e4m3", 1e-45, {"pow2": True}, 2.0**127),
        ("e4m3", 0.0, {"epsilon": 0.5}, 896.0),  # the floor comes before the zero rule
        ("e4m3", 0.25, {"epsilon": 1.0}, 448.0),
        ("e4m3", 2.0, {"epsilon": 1.0}, 224.0),
        ("e5m2", 57344.0, {}, 1.0),
        ("e5m2", 2.0, {}, 28672.0),
        ("e5m2", 2.0, {"pow2": True}, 16384.0),
        ("e5m2", 0.0, {}, 1.0),
    ],
)
def test_scale_from_amax_golden(fmt, amax, kwargs, expected):
    scale = fp8.scale_from_amax(f32(amax), fmt, **kwargs)
    assert_same_f32(scale, f32(expected))


def amaxes_of_every_exponent() -> torch.Tensor:
    """Every fp32 exponent (subnormals, inf and NaN included) with the significands at and around
    1.75's (both FP8 maxima's), the extremes and 4000 random ones."""
    generator = torch.Generator().manual_seed(0)
    edges = torch.tensor([0, 1, 0x600000 - 1, 0x600000, 0x600001, 0x400000, 0x7FFFFF], dtype=torch.int32)
    significands = torch.cat([edges, torch.randint(0, 1 << 23, (4000,), generator=generator, dtype=torch.int32)])
    return ((torch.arange(256, dtype=torch.int32)[:, None] << 23) | significands).reshape(-1).view(torch.float32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("epsilon", [0.0, 1e-12, 3.0])
def test_scales_are_correctly_rounded_fp32_divisions(fmt, epsilon):
    """fp8.scales divides in float64 (so that compiled code cannot approximate it): its scale and
    inverse are the CPU's IEEE fp32 divisions, bit for bit, at every exponent."""
    amax = amaxes_of_every_exponent()
    scale, inverse = fp8.scales(amax, fmt, epsilon, False)
    floored = torch.where(amax < epsilon, torch.full_like(amax, epsilon), amax)
    expected = torch.div(torch.full_like(floored, fp8.fp8_max(fmt)), floored).nan_to_num(nan=1.0, posinf=FLT_MAX)
    expected = torch.where((floored == 0) | floored.isinf(), 1.0, expected)
    assert_same_f32(scale, expected)
    assert_same_f32(inverse, torch.reciprocal(expected))
    pow2 = fp8.scale_from_amax(amax, fmt, epsilon=epsilon, pow2=True)
    assert_same_f32(pow2, torch.exp2(torch.floor(torch.log2(expected.double()))).float())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("epsilon", [0.0, 1e-12, 2.0**-10, 3.0])
def test_pow2_scales_from_the_bits_are_the_rules(fmt, epsilon):
    """The bits of scales(pow2=True), scale and inverse, at every exponent."""
    amax = amaxes_of_every_exponent()
    for got, expected in zip(fp8.pow2_scales(amax, fmt, epsilon), fp8.scales(amax, fmt, epsilon, True), strict=True):
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


def _assert_same_codes(codes: torch.Tensor, expected: torch.Tensor, message: str) -> None:
    nan = expected.float().isnan()  # a NaN's sign bit is the compiler's
    assert torch.equal(codes.float().isnan(), nan), message
    assert torch.equal(codes.view(torch.uint8)[~nan], expected.view(torch.uint8)[~nan]), message


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    "pow2, blocking", [(True, (1, None)), (False, (1, None)), (False, (1, 128)), (False, (128, 128))], ids=["pow2 rows", "rows", "1x128", "128x128"]
)
def test_compiled_block_quantize_is_the_rules(device, fmt, pow2, blocking):
    """Inductor fuses float8.traced_scales (integer ops or float64 divisions; the scale op for
    tiles) with the amax and the cast around them: the scales and codes keep the eager rule's
    bits, blocks of amaxes from subnormal to near FLT_MAX, zero, inf and NaN included."""
    torch._dynamo.reset()
    rows, cols = blocking

    def quantize(x, scales):
        return block.quantize(x, fmt, block=(rows, cols or x.shape[1]), epsilon=0.0, pow2=pow2, scales=scales)

    scales = functools.partial(traced_scales, blocks_in_rows=rows == 1)
    compiled = torch.compile(functools.partial(quantize, scales=scales), dynamic=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 640, generator=g) * torch.exp2(torch.randint(-150, 126, (256, 1), generator=g).float())
    x[:3, 5] = f32([INF, NAN, 0.0])
    x[3] = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype).to(device)
        (codes, scale_inv), (expected_codes, expected_scale_inv) = compiled(xd), quantize(xd, fp8.scales)
        assert torch.equal(scale_inv.view(torch.int32), expected_scale_inv.view(torch.int32)), dtype
        _assert_same_codes(codes, expected_codes, str(dtype))


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_compiled_tensor_quantize_is_the_rules(device, fmt):
    """A tensor's one scale, float64 divisions fused by Inductor into the amax and the cast: the
    bits of the eager rule for tensors whose amaxes span every exponent, with random significands,
    and for amaxes of zero, inf and NaN."""
    torch._dynamo.reset()

    def quantize(x, scales):
        scale, scale_inv = scales(fp8.tensor_amax(x), fmt, 0.0, False)
        return per_tensor.quantize(x, scale, fmt, transpose=False), scale_inv

    compiled = torch.compile(functools.partial(quantize, scales=traced_scales), dynamic=False)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g)
    magnitudes = [*torch.exp2(torch.arange(-150.0, 128.0, 3.0)) * (1 + torch.rand(93, generator=g)), 0.0, INF, NAN]
    for magnitude in magnitudes:
        xd = (x * torch.where(x.abs() == x.abs().max(), 1.0, 0.5) * magnitude / x.abs().max()).to(device)
        (codes, scale_inv), (expected_codes, expected_scale_inv) = compiled(xd), quantize(xd, fp8.scales)
        assert torch.equal(scale_inv.view(torch.int32), expected_scale_inv.view(torch.int32)), magnitude
        _assert_same_codes(codes, expected_codes, str(magnitude))


# -- per-tensor current scaling ----------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt, x, kwargs, scale, expected",
    [
        ("e4m3", [[448.0, -2.0], [1.0, 0.5]], {}, 1.0, [[448.0, -2.0], [1.0, 0.5]]),
        ("e4m3", [[2.0, -1.0], [0.5, 0.0]], {}, 224.0, [[448.0, -224.0], [112.0, 0.0]]),
        ("e4m3", [[2.0, -1.0], [0.5, 0.0]], {"force_pow_2_scales": True}, 128.0, [[256.0, -128.0], [64.0, 0.0]]),
        ("e4m3", [[0.0, 0.0], [-0.0, 0.0]], {}, 1.0, [[0.0, 0.0], [-0.0, 0.0]]),
        ("e4m3", [[INF, 1.0], [-2.0, 1000.0]], {}, 1.0, [[448.0, 1.0], [-2.0, 448.0]]),
        ("e4m3", [[0.25, -0.125]], {"amax_epsilon": 1.0}, 448.0, [[112.0, -56.0]]),
        ("e5m2", [[2.0, -1.0]], {}, 28672.0, [[57344.0, -28672.0]]),
        ("e5m2", [[-INF, 3.0]], {}, 1.0, [[-57344.0, 3.0]]),
    ],
)
def test_current_scaling_golden(fmt, x, kwargs, scale, expected):
    q = Float8CurrentScalingQuantizer(fp8_dtype=fmt, **kwargs)
    qt = q(f32(x))
    row, col = qt.rowwise, qt.columnwise
    assert_same_bits(row.data, fp8_tensor(expected, fmt))
    assert_same_bits(col.data, fp8_tensor(expected, fmt).t().contiguous())
    assert col.transposed and not row.transposed and col.shape == row.shape == tuple(f32(x).shape)
    assert_same_f32(row.scale, torch.reciprocal(f32(scale)))
    assert_same_f32(col.scale, row.scale)
    assert row.amax.item() == f32(x).abs().max().item()


def test_current_scaling_nan_input():
    rep = Float8CurrentScalingQuantizer()(f32([[NAN, 1.0, 3.0]]), columnwise=False).rowwise
    assert rep.scale.item() == 1.0 and torch.isnan(rep.amax)
    values = rep.data.float()
    assert torch.isnan(values[0, 0]) and values[0, 1:].tolist() == [1.0, 3.0]


def test_per_tensor_functions_saturate_and_dequantize():
    x = f32([[1000.0, -1000.0, 1.0]])
    data = per_tensor.quantize(x, f32([1.0]), "e4m3", transpose=False)
    assert_same_bits(data, fp8_tensor([[448.0, -448.0, 1.0]], "e4m3"))
    data = per_tensor.quantize(x, f32(0.5), "e4m3", transpose=True)
    assert_same_bits(data, fp8_tensor([[448.0], [-448.0], [0.5]], "e4m3"))
    assert_same_f32(per_tensor.dequantize(data, f32([2.0])), f32([[896.0], [-896.0], [1.0]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_current_scaling_input_dtypes(dtype, fmt):
    x = spread(1, (16, 24), -8, 8).to(dtype)
    qt = Float8CurrentScalingQuantizer(fp8_dtype=fmt)(x)
    scale = fp8.scale_from_amax(x.float().abs().amax(), fmt)
    assert_same_bits(qt.rowwise.data, fp8.cast_to_fp8(x.float() * scale, fmt))
    assert_same_bits(qt.columnwise.data, qt.rowwise.data.t().contiguous())
    assert qt.rowwise.dtype == dtype and qt.dequantize().dtype == dtype
    assert torch.equal(qt.dequantize(torch.float32), qt.rowwise.data.float() * torch.reciprocal(scale))


@pytest.mark.parametrize(
    "quantizer", [Float8CurrentScalingQuantizer(), Float8DelayedScalingQuantizer(), Float8BlockQuantizer()]
)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.float8_e4m3fn])
def test_non_float_inputs_rejected(quantizer, dtype):
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        quantizer(torch.zeros(4, 4).to(dtype), ctx=QuantizeContext(scale=f32([1.0])))


# -- per-tensor delayed scaling ----------------------------------------------------------------


def run_steps(update, amaxes, history_len):
    scale, history = torch.ones(1), torch.zeros(history_len)
    scales, histories = [], []
    for amax in amaxes:
        scale, history = update(scale, history, f32(amax))
        scales.append(scale.item())
        histories.append(history.tolist())
    return scales, histories


@pytest.mark.parametrize(
    "algo, scales",
    [
        # history [a, b, c] after a step is [0, older, newest]; "max" sees the last 3 amaxes.
        ("max", [224.0, 112.0, 112.0, 112.0, 448.0]),
        ("most_recent", [224.0, 112.0, 448.0, 448.0, 448.0]),
    ],
)
def test_delayed_scaling_history_and_algo(algo, scales):
    update = functools.partial(per_tensor.delayed_scaling_update, fp8_dtype="e4m3", margin=0, algo=algo)
    got_scales, histories = run_steps(update, [2.0, 4.0, 1.0, 1.0, 1.0], 3)
    assert got_scales == scales
    assert histories == [[0, 0, 2], [0, 2, 4], [0, 4, 1], [0, 1, 1], [0, 1, 1]]


def test_a_nan_amax_in_the_history_is_skipped_as_te_s_fmaxf_skips_it():
    """One NaN step must not keep the scale until it leaves the window: the third step's amax of
    2 sets the scale at once."""
    update = functools.partial(per_tensor.delayed_scaling_update, fp8_dtype="e4m3", margin=0, algo="max")
    got_scales, _ = run_steps(update, [1.0, NAN, 2.0], 3)
    assert got_scales == [448.0, 448.0, 224.0]


def test_delayed_scaling_under_compile():
    for algo in ("max", "most_recent"):
        eager = functools.partial(per_tensor.delayed_scaling_update, fp8_dtype="e5m2", margin=1, algo=algo)
        compiled = torch.compile(eager, fullgraph=True, backend="eager")
        scale, history = eager_state = torch.ones(1), torch.zeros(4)
        for amax in [2.0, 0.0, INF, 3.0, NAN, 1e-45, 5.0]:
            scale, history = compiled(scale, history, f32(amax))
            eager_state = eager(*eager_state, f32(amax))
            assert_same_f32(scale, eager_state[0])
            assert_same_f32(history, eager_state[1])  # bitwise, so NaN compares equal


@pytest.mark.parametrize(
    "fmt, margin, amax, previous, expected",
    [
        ("e4m3", 0, 2.0, 1.0, 224.0),
        ("e4m3", 2, 2.0, 1.0, 56.0),  # (448 / 2) / 2**2
        ("e4m3", 1, 3.0, 1.0, 74.66666412353516),  # fp32(448 / 3) / 2
        ("e5m2", 0, 2.0, 1.0, 28672.0),
        ("e4m3", 0, 0.0, 5.0, 5.0),  # amax <= 0: keep the previous scale
        ("e4m3", 0, INF, 5.0, 5.0),  # not finite: keep
        ("e4m3", 0, NAN, 5.0, 5.0),
        ("e4m3", 0, 1e-45, 5.0, FLT_MAX),  # 448 / 2**-149 overflows
    ],
)
def test_delayed_scaling_scale_rule(fmt, margin, amax, previous, expected):
    scale, history = f32([previous]), torch.zeros(1)
    before = (scale.clone(), history.clone())
    new_scale, new_history = per_tensor.delayed_scaling_update(
        scale, history, f32(amax), fp8_dtype=fmt, margin=margin, algo="max"
    )
    assert_same_f32(new_scale, f32([expected]))
    assert_same_f32(new_history, f32([0.0]))
    assert torch.equal(scale, before[0]) and torch.equal(history, before[1])


def test_delayed_scaling_quantizer():
    q = Float8DelayedScalingQuantizer(amax_history_len=2, margin=1)
    scale, history = q.initial_state()
    assert scale.tolist() == [1.0] and history.tolist() == [0.0, 0.0]
    x = f32([[1000.0, -2.0], [0.5, 3.0]])
    qt = q(x, ctx=QuantizeContext(scale=scale))
    assert_same_bits(qt.rowwise.data, fp8_tensor([[448.0, -2.0], [0.5, 3.0]], "e4m3"))
    assert_same_bits(qt.columnwise.data, qt.rowwise.data.t().contiguous())
    scale, history = q.update(scale, history, qt.rowwise.amax)
    assert_same_f32(scale, f32([448.0 / 1000.0]) / 2)
    assert history.tolist() == [0.0, 1000.0]
    qt = q(x / 4, ctx=QuantizeContext(scale=f32([64.0])))
    assert_same_bits(qt.rowwise.data, fp8_tensor([[448.0, -32.0], [8.0, 48.0]], "e4m3"))
    with pytest.raises(ValueError, match="QuantizeContext"):
        q(x)


# -- blockwise ---------------------------------------------------------------------------------


def reference_block_quantize(x, fmt, block_shape, epsilon, pow2):
    """One block at a time, straight from the rule (slow, for checking the vectorized version)."""
    rows, cols = block_shape
    m, k = x.shape
    data = torch.empty(m, k, dtype=fp8.FP8_DTYPES[fmt])
    scale_inv = torch.empty(-(-m // rows), -(-k // cols))
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            tile = x[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols].float()
            scale = fp8.scale_from_amax(tile.abs().max(), fmt, epsilon=epsilon, pow2=pow2)
            data[i * rows : (i + 1) * rows, j * cols : (j + 1) * cols] = fp8.cast_to_fp8(tile * scale, fmt)
            scale_inv[i, j] = torch.reciprocal(scale)
    return data, scale_inv


@pytest.mark.parametrize("block_shape", [(1, 128), (128, 128)])
@pytest.mark.parametrize("shape", [(200, 300), (128, 256), (1, 5), (130, 129)])
@pytest.mark.parametrize("pow2", [False, True])
def test_block_matches_block_by_block_reference(block_shape, shape, pow2):
    x = spread(2, shape, -20, 20)
    x[-1, -1] = 1e30  # in the corner's partial block only
    data, scale_inv = block.quantize(x, "e4m3", block=block_shape, epsilon=0.0, pow2=pow2)
    ref_data, ref_scale_inv = reference_block_quantize(x, "e4m3", block_shape, 0.0, pow2)
    assert scale_inv.shape == (-(-shape[0] // block_shape[0]), -(-shape[1] // block_shape[1]))
    assert data.is_contiguous()
    assert_same_bits(data, ref_data)
    assert_same_f32(scale_inv, ref_scale_inv)


def test_block_special_blocks_stay_local():
    x = torch.ones(2, 384)
    x[0, :128] = 0.0
    x[0, 128] = INF
    x[1, 300] = NAN
    x[1, :128] *= 2.0
    data, scale_inv = block.quantize(x, "e4m3", block=(1, 128), epsilon=0.0, pow2=False)
    assert_same_f32(scale_inv, torch.reciprocal(f32([[1.0, 1.0, 448.0], [224.0, 448.0, 1.0]])))
    values = data.float()
    assert values[0, :128].eq(0).all() and values[0, 128] == 448.0 and values[0, 129:256].eq(1).all()
    assert values[0, 256:].eq(448).all() and values[1, :256].eq(448).all()
    assert torch.isnan(values[1, 300]) and values[1, 256:300].eq(1).all()


def test_block_epsilon_and_e5m2():
    x = torch.full((1, 128), 0.25)
    data, scale_inv = block.quantize(x, "e5m2", block=(1, 128), epsilon=1.0, pow2=True)
    assert_same_f32(scale_inv, f32([[2.0**-15]]))  # 57344 / 1 rounds down to 2**15
    assert data.float().eq(8192.0).all()


def test_block_1d_rowwise_and_columnwise_differ():
    # x[i, j] = r_i * c_j: rowwise blocks see c's shape, columnwise blocks see r's.
    r = 2.0 ** (torch.arange(128) % 7) * (1 + torch.arange(128) / 128)
    c = 1 + torch.arange(128) % 5 / 3
    x = r[:, None] * c[None, :]
    q = Float8BlockQuantizer(block_scaling_dim=1, force_pow_2_scales=False)
    qt = q(x)
    row, col = qt.rowwise, qt.columnwise
    assert q.block("rowwise") == (1, 128) and q.block("columnwise") == (128, 1)
    assert row.data.shape == (128, 128) and col.transposed and row.scale.shape == col.scale.shape == (128, 1)
    expected_row = torch.reciprocal(fp8.scale_from_amax(x.abs().amax(dim=1), "e4m3"))[:, None]
    expected_col = torch.reciprocal(fp8.scale_from_amax(x.abs().amax(dim=0), "e4m3"))[:, None]
    assert_same_f32(row.scale, expected_row)
    assert_same_f32(col.scale, expected_col)
    assert not torch.equal(row.scale, col.scale)
    assert not torch.equal(row.data.view(torch.uint8), col.data.t().view(torch.uint8))
    for rep, source in ((row, x), (col, x.t())):
        err = (exact_dequantize(rep.data, rep.scale) - source.double()).abs()
        assert (err <= roundtrip_bound(source, rep.scale, "e4m3")).all()


@pytest.mark.parametrize("shape", [(256, 384), (200, 300)])
def test_block_2d_columnwise_is_exact_transpose(shape):
    x = spread(3, shape, -30, 30)
    qt = Float8BlockQuantizer(block_scaling_dim=2)(x)
    row, col = qt.rowwise, qt.columnwise
    assert row.scale.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    assert_same_bits(col.data, row.data.t().contiguous())
    assert_same_f32(col.scale, row.scale.t())
    assert (torch.log2(row.scale).frac() == 0).all()  # pow2 is the block default
    assert torch.equal(col.dequantize().t(), row.dequantize())


def q_block(dim: int) -> tuple[int, int]:
    return (1, 128) if dim == 1 else (128, 128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [1, 2])
def test_block_input_dtypes(dtype, dim):
    x = spread(4, (130, 260), -10, 10).to(dtype)
    qt = Float8BlockQuantizer(block_scaling_dim=dim)(x)
    data, scale_inv = block.quantize(x.float(), "e4m3", block=q_block(dim), epsilon=0.0, pow2=True)
    assert_same_bits(qt.rowwise.data, data)
    assert_same_f32(qt.rowwise.scale, scale_inv)
    assert qt.dequantize().dtype == dtype
    assert torch.equal(qt.dequantize(torch.float32), block.dequantize(data, scale_inv, block=q_block(dim)))


# -- properties --------------------------------------------------------------------------------

finite_f32 = st.floats(allow_nan=False, allow_infinity=False, width=32)


@st.composite
def matrices(draw):
    m, k = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    return f32(draw(st.lists(finite_f32, min_size=m * k, max_size=m * k))).reshape(m, k)


@settings(max_examples=300, deadline=None)
@given(x=matrices(), fmt=st.sampled_from(FORMATS), pow2=st.booleans(), epsilon=st.sampled_from([0.0, 1e-12]))
def test_per_tensor_properties(x, fmt, pow2, epsilon):
    q = Float8CurrentScalingQuantizer(fp8_dtype=fmt, force_pow_2_scales=pow2, amax_epsilon=epsilon)
    qt = q(x)
    row = qt.rowwise
    exact = exact_dequantize(row.data, row.scale)
    assert ((exact - x.double()).abs() <= roundtrip_bound(x, row.scale, fmt)).all()
    values = row.dequantize(torch.float32)
    assert_same_f32(values, exact.float())  # one correctly rounded fp32 product
    assert_same_bits(qt.columnwise.data, row.data.t().contiguous())
    # Requantizing the dequantized values with the same scale gives the same bits: they are
    # within a few fp32 ulps of the fp8 grid points. Not where the fp32 dequantize overflowed.
    again = per_tensor.quantize(values, fp8.scales(q.amax(x), fmt, epsilon, pow2)[0], fmt, transpose=False)
    finite = values.isfinite()
    assert torch.equal(again.view(torch.uint8)[finite], row.data.view(torch.uint8)[finite])


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    m=st.integers(1, 300),
    k=st.integers(1, 300),
    exponents=st.tuples(st.integers(-149, 126), st.integers(-149, 126)).map(sorted),
    fmt=st.sampled_from(FORMATS),
    block_shape=st.sampled_from([(1, 128), (128, 128)]),
    pow2=st.booleans(),
)
def test_block_properties(seed, m, k, exponents, fmt, block_shape, pow2):
    x = spread(seed, (m, k), *exponents)
    data, scale_inv = block.quantize(x, fmt, block=block_shape, epsilon=0.0, pow2=pow2)
    values = block.dequantize(data, scale_inv, block=block_shape)
    expanded = scale_inv.repeat_interleave(block_shape[0], 0).repeat_interleave(block_shape[1], 1)[:m, :k]
    exact = exact_dequantize(data, expanded)
    assert ((exact - x.double()).abs() <= roundtrip_bound(x, expanded, fmt)).all()
    assert_same_f32(values, exact.float())
    if pow2:  # then reciprocal(scale_inv) is exactly the scale that was used
        again = fp8.cast_to_fp8(values * torch.reciprocal(expanded), fmt)
        finite = values.isfinite()
        assert torch.equal(again.view(torch.uint8)[finite], data.view(torch.uint8)[finite])


# -- the accumulation model --------------------------------------------------------------------

def _truncated(x: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """x with every bit below 2^(exponent - ACCUMULATOR_FRACTION_BITS) dropped by a sign-filling
    shift (toward -inf: the most a truncation can lose)."""
    lsb = torch.exp2(exponent - fp8.ACCUMULATOR_FRACTION_BITS)
    return torch.floor(x / lsb) * lsb


def _modelled_sum(a: torch.Tensor, b: torch.Tensor, promote_every) -> torch.Tensor:
    """a @ b as fp8.accumulation_bound's model of Hopper sums it: wgmmas of 32 products and the
    carried sum, each truncated below the largest term's bits and its result to its own; the
    partial sum of every ``promote_every`` products added in fp32 (each product under FP32)."""
    k = a.shape[-1]
    step = k if promote_every is fp8.FAST else promote_every
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32)
    for start in range(0, k, step):
        carried = torch.zeros(out.shape, dtype=torch.float64)
        for lo in range(start, min(start + step, k), fp8.WGMMA_PRODUCTS if step > fp8.FP32 else 1):
            hi = min(lo + fp8.WGMMA_PRODUCTS, start + step, k)
            terms = torch.cat([carried[..., None], a[:, None, lo:hi] * b.t()[None, :, lo:hi]], -1)
            largest = terms.abs().amax(-1).clamp_min(2.0**-126)
            total = _truncated(terms, torch.floor(torch.log2(largest))[..., None]).sum(-1)
            carried = _truncated(total, torch.floor(torch.log2(total.abs().clamp_min(2.0**-126))))
        out = out + carried.float()
    return out.double()


def _adversarial(m: int, k: int, n: int):
    """E4M3 values whose products, row by row, are one large term and then many that the
    accumulator drops whole (1.875 2^-14 of it), or random ones of both signs."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g) * 4
    b = torch.randn(k, n, generator=g)
    a[: m // 2] = 1.0
    b[:, : n // 2] = 1.875 * 2.0**-6
    b[:: fp8.PROMOTED_PRODUCTS, : n // 2] = 256.0
    return tuple(t.to(torch.float8_e4m3fn).double() for t in (a, b))


@pytest.mark.parametrize("promote_every", [fp8.PROMOTED_PRODUCTS, 64, fp8.FAST, fp8.FP32], ids=["promoted", "every 64", "fast", "fp32"])
def test_accumulation_bound_holds_for_the_modelled_accumulator(promote_every):
    """The modelled sums of products with one large term a step and many that the accumulator
    drops (the case its bound is made for), and of random ones, lie within fp8.accumulation_bound,
    the former within a factor of 4 of it (it is not loose); an empty sum's bound is 0."""
    a, b = _adversarial(8, 512, 8)
    assert not fp8.accumulation_bound(a[:, :0], b[:0], promote_every).any()
    error = (_modelled_sum(a, b, promote_every) - a @ b).abs()
    bound = fp8.accumulation_bound(a, b, promote_every)
    assert (error <= bound).all(), (error / bound).max()
    if promote_every is not fp8.FP32:
        assert (error[:4, :4] > bound[:4, :4] / 4).all(), (error / bound)[:4, :4].min()
