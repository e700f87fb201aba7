"""The decode GEMM that quantizes its activation as it loads it (triton_decode.QuantizedOnLoad):
its product is, bit for bit, the decode GEMM's on the activation the reference quantizer made
(same codes, same scales, same kernel), for per-tensor, per-row and 1x128-block FP8 current
scaling.

On the CPU the kernel runs under Triton's interpreter, in a process of its own, its FP8 casts
rounded as the GPU's are (triton_interpreter.round_fp8_to_nearest_even), and the scale rule alone
on every special amax; on the GPU at a Llama-3-8B FFN's shapes.
"""

import json

import pytest
import torch
import triton_interpreter

from graphquant.formats import fp8
from graphquant.quantizers import (
    ROWWISE,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8DelayedScalingQuantizer,
    Float8RowwiseQuantizer,
    MXFP8Quantizer,
)

# (the activation's quantizer, the weight's): each FP8 family the kernel quantizes as it loads it.
PAIRS = {
    "tensorwise": (Float8CurrentScalingQuantizer("e4m3"), Float8CurrentScalingQuantizer("e4m3")),
    "tensorwise e5m2, pow2, epsilon": (
        Float8CurrentScalingQuantizer("e5m2", force_pow_2_scales=True, amax_epsilon=1e-3),
        Float8CurrentScalingQuantizer("e4m3"),
    ),
    "rowwise": (Float8RowwiseQuantizer(), Float8RowwiseQuantizer()),
    "rowwise, scales not powers of two": (Float8RowwiseQuantizer(force_pow_2_scales=False), Float8RowwiseQuantizer()),
    "block 1x128 x 128x128": (Float8BlockQuantizer(block_scaling_dim=1), Float8BlockQuantizer(block_scaling_dim=2)),
    "block 1x128, scales not powers of two": (
        Float8BlockQuantizer(block_scaling_dim=1, force_pow_2_scales=False),
        Float8BlockQuantizer(block_scaling_dim=1, force_pow_2_scales=False),
    ),
}
# (m, n, k, bias): one row with K split; rows that fill no tile, K a partial block; 16 rows.
INTERPRETED = [(1, 96, 1024, False), (3, 40, 224, True), (16, 72, 640, True)]


def _products(name: str, x: torch.Tensor, w: torch.Tensor, bias, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(the decode GEMM on x quantized by the reference first, the one that quantizes x as it loads it)."""
    from graphquant.kernels import triton_decode

    qa, qb = PAIRS[name]
    b = qb(w, columnwise=False).get(ROWWISE)
    first = triton_decode.gemm(qa(x, columnwise=False).get(ROWWISE), b, out_dtype, bias)
    on_load = triton_decode.gemm(triton_decode.QuantizedOnLoad(x, triton_decode.amaxes(x, qa), qa), b, out_dtype, bias)
    return first, on_load


def _interpreted_results() -> dict:
    from graphquant.kernels import triton_scales

    torch.manual_seed(0)
    results = {}
    for name in PAIRS:
        for m, n, k, with_bias in INTERPRETED:
            x = (torch.randn(m, k) * torch.logspace(-2, 2, m)[:, None]).to(torch.bfloat16)
            w = (torch.randn(n, k) / 8).to(torch.bfloat16)
            bias = torch.randn(n).to(torch.bfloat16) if with_bias else None
            first, on_load = _products(name, x, w, bias, torch.float32)
            results[f"{name} | {m}x{n}x{k}"] = torch.equal(first, on_load)
    amax = torch.tensor([0.0, 1e-30, 1e-3, 0.7, 1.0, 448.0, 3e38, float("inf"), float("nan"), 2.0**-149])
    for element, epsilon, pow2 in (("e4m3", 0.0, False), ("e4m3", 1e-3, True), ("e5m2", 0.0, True)):
        scale, inverse = triton_scales.fp8_scales(amax, element, epsilon, pow2)
        expected, expected_inverse = fp8.scales(amax, element, epsilon, pow2)
        same = torch.equal(scale.view(torch.int32), expected.view(torch.int32)) and torch.equal(
            inverse.view(torch.int32), expected_inverse.view(torch.int32)
        )
        results[f"scale rule {element} {epsilon} {pow2}"] = same
    return results


@pytest.fixture(scope="module")
def interpreted() -> dict:
    pytest.importorskip("triton")
    return triton_interpreter.results_of(__file__)


@pytest.mark.parametrize("case", [f"{m}x{n}x{k}" for m, n, k, _ in INTERPRETED])
@pytest.mark.parametrize("name", PAIRS)
def test_quantizing_on_load_equals_quantizing_first_interpreted(interpreted, name, case):
    assert interpreted[f"{name} | {case}"]


def test_the_kernels_scale_rule_is_the_references_interpreted(interpreted):
    """Every special amax (0, subnormal, under the epsilon, overflowing the scale, inf, NaN)."""
    rules = [key for key in interpreted if key.startswith("scale rule")]
    assert len(rules) == 3 and all(interpreted[key] for key in rules)


@pytest.mark.parametrize("name", PAIRS)
def test_amaxes_make_the_reference_scales(name):
    """The amaxes the kernel takes give, by the format's rule, the scales the reference quantizer
    stores: rows of zeros, tiny and huge values, a partial last block."""
    pytest.importorskip("triton")
    from graphquant.kernels import triton_decode

    torch.manual_seed(0)
    qa, _ = PAIRS[name]
    x = (torch.randn(5, 300) * torch.logspace(-20, 20, 5)[:, None]).to(torch.bfloat16)
    x[2] = 0
    rep = qa(x, columnwise=False).get(ROWWISE)
    encoding = qa.kernel_encoding(ROWWISE)
    _, scale_inv = fp8.scales(triton_decode.amaxes(x, qa), encoding.element, encoding.amax_epsilon, encoding.pow2_scales)
    assert torch.equal(scale_inv.reshape(rep.scale.shape), rep.scale)


def test_the_kernels_quantize_on_load_what_they_can_and_say_what_else():
    pytest.importorskip("triton")
    from graphquant.kernels import triton_decode

    for qa, _ in PAIRS.values():
        assert triton_decode.quantize_on_load_refusal(qa) == ""
    refusals = {
        Float8DelayedScalingQuantizer(): "from the amax of A alone",
        Float8CurrentScalingQuantizer(with_amax_reduction=True): "from the amax of A alone",
        Float8BlockQuantizer(block_scaling_dim=2): "FP8 current scaling per fp8_tensorwise, fp8_rowwise, fp8_block_1x128",
        MXFP8Quantizer(): "not mxfp8",
    }
    for quantizer, refusal in refusals.items():
        assert refusal in triton_decode.quantize_on_load_refusal(quantizer)
    x = torch.randn(1, 128)
    w = Float8CurrentScalingQuantizer()(torch.randn(64, 128), columnwise=False).get(ROWWISE)
    delayed = Float8DelayedScalingQuantizer()
    with pytest.raises(ValueError, match="from the amax of A alone"):
        triton_decode.gemm(triton_decode.QuantizedOnLoad(x, x.abs().amax(), delayed), w, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4096, 14336), (14336, 4096)], ids=["down", "up"])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("name", PAIRS)
def test_quantizing_on_load_equals_quantizing_first_on_gpu(name, m, n, k):
    """Random bf16 activations, a row of zeros, rows six orders of magnitude apart; K split
    across programs (the down projection) or not; with a bias; fp32 and bf16 out."""
    torch.manual_seed(0)
    x = (torch.randn(m, k, device="cuda") * torch.logspace(-3, 3, m, device="cuda")[:, None]).to(torch.bfloat16)
    if m > 1:
        x[1] = 0
    w = (torch.randn(n, k, device="cuda") / 64).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    for out_dtype in (torch.float32, torch.bfloat16):
        first, on_load = _products(name, x, w, bias, out_dtype)
        assert torch.equal(first, on_load)


if __name__ == "__main__":  # the interpreted cases, as the fixture ``interpreted`` runs them
    triton_interpreter.accept_numpy_scalars()
    triton_interpreter.round_fp8_to_nearest_even()
    print(json.dumps(_interpreted_results()))
