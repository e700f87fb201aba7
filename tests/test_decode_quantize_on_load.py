"""The decode GEMM that quantizes its activation itself (triton_decode.QuantizedOnLoad): as it
loads it (per-tensor and per-row FP8 current scaling) or in a kernel of its own first (1x128
blocks, in a graph an op of its own that the GEMMs reading one activation share). Its product is,
bit for bit, the decode GEMM's on the activation the reference quantizer made (same codes, same
scales, same kernel).

On the CPU the kernel runs under Triton's interpreter, in a process of its own, its FP8 casts
rounded as the GPU's are (triton_interpreter.round_fp8_to_nearest_even), and the scale rule alone
on every special amax; on the GPU at a Llama-3-8B FFN's shapes.
"""

import json
import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
import triton_interpreter
from reference import fresh_dynamo, hopper_on_cpu  # noqa: F401  (fixtures: fresh_dynamo autouse)

import graphquant
from graphquant import recipes, zoo
from graphquant.formats import fp8
from graphquant.kernels import backends
from graphquant.quantizers import (
    ROWWISE,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8DelayedScalingQuantizer,
    Float8RowwiseQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)

# (the activation's quantizer, the weight's): each FP8 family the decode GEMM quantizes itself.
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
# The recipes whose inference linears run on it at decode rows.
RECIPES = {"tensorwise": zoo.recipe("tensorwise"), "rowwise": zoo.recipe("rowwise"), "deepseek_blockwise": zoo.recipe("deepseek_blockwise")}
# (m, n, k, bias): one row with K split; rows that fill no tile, K a partial block; 16 rows; rows
# whose amaxes come in chunks (fp8.row_chunk_amax), K split and not.
INTERPRETED = [(1, 96, 1024, False), (3, 40, 224, True), (16, 72, 640, True), (2, 32, 5120, False), (2, 512, 5120, True)]


def _products(name: str, x: torch.Tensor, w: torch.Tensor, bias, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(the decode GEMM on x quantized by the reference first, the one that quantizes x itself)."""
    from graphquant.kernels import triton_decode

    qa, qb = PAIRS[name]
    b = qb(w, columnwise=False).get(ROWWISE)
    first = triton_decode.gemm(qa(x, columnwise=False).get(ROWWISE), b, out_dtype, bias)
    on_load = triton_decode.gemm(triton_decode.QuantizedOnLoad(x, triton_decode.amaxes(x, qa), qa), b, out_dtype, bias)
    return first, on_load


class FeedForward(torch.nn.Module):
    """A SwiGLU FFN, as a decoder's: x + w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int = 128, hidden: int = 256) -> None:
        super().__init__()
        self.w1 = torch.nn.Linear(dim, hidden, bias=False)
        self.w3 = torch.nn.Linear(dim, hidden, bias=False)
        self.w2 = torch.nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(F.silu(self.w1(x)) * self.w3(x))


def _frozen_outputs(recipe, xs: list[torch.Tensor], dump_dir=None) -> tuple[list[torch.Tensor], list]:
    """A frozen FFN's outputs for each of ``xs`` (a static graph each, aot_eager, on their device) and its plans."""
    torch.manual_seed(0)
    compiled = graphquant.compile(
        FeedForward().to(xs[0].device, torch.bfloat16), recipe, mode="inference", backend="aot_eager", dynamic=False, dump_dir=dump_dir
    )
    graphquant.freeze(compiled)
    with torch.no_grad():
        outputs = [compiled(x) for x in xs]
    return outputs, compiled.graphquant.plans


def _planned_alike_results(device: torch.device) -> dict:
    """For each recipe, the frozen FFN at one and three rows with the kernel that quantizes x
    itself, and with it refused (x quantized first, the plain decode GEMM): whether each planned
    as expected and gave the same bits. On the CPU on a faked Hopper (the kernels interpreted)."""
    from graphquant.kernels import triton_decode

    if device.type == "cpu":
        backends.capability = lambda device: (9, 0)
    refusal = triton_decode.quantize_on_load_refusal
    xs = [torch.randn(1, 128, device=device).to(torch.bfloat16), torch.randn(3, 128, device=device).to(torch.bfloat16)]
    results = {}
    try:
        for name, recipe in RECIPES.items():
            runs = {}
            for backend, refuse in ((triton_decode.QUANTIZING_BACKEND, False), (triton_decode.BACKEND, True)):
                triton_decode.quantize_on_load_refusal = (lambda quantizer: "refused") if refuse else refusal
                backends.clear_caches()
                torch._dynamo.reset()
                outputs, plans = _frozen_outputs(recipe, xs)
                planned = {g.backend.name for plan in plans for g in plan.gemms}
                runs[backend] = (outputs, planned == {backend})
            (fused, fused_planned), (first, first_planned) = runs.values()
            results[f"frozen ffn {name}"] = fused_planned and first_planned and all(map(torch.equal, fused, first))
    finally:
        triton_decode.quantize_on_load_refusal = refusal
        backends.clear_caches()
    return results


def _interpreted_results() -> dict:
    from graphquant.kernels import triton_scales

    torch.manual_seed(0)
    results = {}
    for name in PAIRS:
        for m, n, k, with_bias in INTERPRETED:
            x = torch.randn(m, k) * torch.logspace(-2, 2, m)[:, None]
            x[:, -1] = x.abs().amax(1) * 8  # each row's amax in its last chunk, and the tensor's
            x = x.to(torch.bfloat16)
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
    return results | _planned_alike_results(torch.device("cpu"))


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


@pytest.mark.parametrize("name", RECIPES)
def test_a_frozen_ffn_quantizing_on_load_gives_the_bits_of_quantizing_first_interpreted(interpreted, name):
    """The same model planned with the kernel that quantizes x itself and without it (x
    quantized first, then the plain decode GEMM), at one row and three, computes the same bits."""
    assert interpreted[f"frozen ffn {name}"]


@pytest.mark.parametrize("name", RECIPES)
def test_the_plan_runs_decode_rows_of_inference_linears_on_the_gemm_that_quantizes_x(hopper_on_cpu, name):
    """A frozen FFN at one row: every linear's fprop on the decode GEMM that quantizes x itself,
    in the plan and in the rewritten graph's calls (the graph dump), and it gets x in bf16 (with
    the amaxes of x's rows where it takes them); at 17 rows (past the decode GEMM's 16) none; the
    same bits as the CPU's emulated GEMM on x quantized first. 1x128 blocks come to it quantized
    by its block-codes kernel (an op of its own, graphquant::block_codes)."""
    triton_decode = backends.triton_decode
    on_load = backends.GemmBackend(triton_decode.QUANTIZING_BACKEND)
    xs = [torch.randn(1, 128).to(torch.bfloat16), torch.randn(17, 128).to(torch.bfloat16)]
    with tempfile.TemporaryDirectory() as dump_dir:
        outputs, plans = _frozen_outputs(RECIPES[name], xs, dump_dir)
        rewritten = [open(os.path.join(dump_dir, f"graph_{i:03d}_rewritten.py")).read() for i in range(2)]
    assert [g.backend for g in plans[0].gemms] == [on_load] * 3, str(plans[0])
    assert on_load not in {g.backend for g in plans[1].gemms}, str(plans[1])
    assert rewritten[0].count(f"fprop={on_load!r}") == 3 and repr(on_load) not in rewritten[1]
    first = name == "deepseek_blockwise"
    assert len(hopper_on_cpu) == 3 and all(isinstance(a, triton_decode.QuantizedOnLoad) != first for a in hopper_on_cpu)
    assert first or all(a.data.dtype == torch.bfloat16 and a.amax.dtype == torch.float32 for a in hopper_on_cpu)
    backends.capability = lambda device: None  # the CPU's emulated GEMM, x quantized first
    backends.clear_caches()
    torch._dynamo.reset()
    emulated, _ = _frozen_outputs(RECIPES[name], xs[:1])
    assert torch.equal(outputs[0], emulated[0])


def test_training_and_formats_it_cannot_quantize_keep_x_quantized_first(hopper_on_cpu):
    """Training keeps x's quantized copies for backward, so its fprop quantizes x first; so does
    inference in a format the kernel does not quantize (MXFP8: its plan says why) or at rows the
    plan cannot see."""
    triton_decode = backends.triton_decode
    model = FeedForward().to(torch.bfloat16)
    training = graphquant.compile(model, RECIPES["tensorwise"], backend="aot_eager")
    training(torch.randn(1, 128).to(torch.bfloat16)).sum().backward()
    fprops = [g.backend.name for g in training.graphquant.plan.gemms if g.gemm == "fprop"]
    assert fprops == [triton_decode.BACKEND] * 3
    mxfp8 = recipes.mxfp8_block_scaling()
    for recipe, dynamic in ((mxfp8, False), (RECIPES["tensorwise"], True)):
        torch._dynamo.reset()
        compiled = graphquant.compile(model, recipe, mode="inference", backend="aot_eager", dynamic=dynamic)
        with torch.no_grad():
            compiled(torch.randn(2, 128).to(torch.bfloat16))
        assert triton_decode.QUANTIZING_BACKEND not in {g.backend.name for g in compiled.graphquant.plan.gemms}
        if recipe is mxfp8:
            reasons = {g.reason for g in compiled.graphquant.plan.gemms}
            assert reasons == {f"x quantized first: {triton_decode.quantize_on_load_refusal(MXFP8Quantizer())}"}
            assert "measured slower than quantizing them first" in reasons.pop()
    assert not any(isinstance(a, triton_decode.QuantizedOnLoad) for a in hopper_on_cpu)


class _Captured(Exception):
    """Stops Inductor once the post-grad graph is in hand."""


@pytest.mark.parametrize("name", RECIPES)
def test_a_decode_step_quantizes_a_tensor_read_by_two_linears_once(hopper_on_cpu, name):
    """A SwiGLU's gate and up projections read one x: at one row, frozen, the graph Inductor lowers
    runs them as one op (passes/gemms_sharing_x.py) that takes x's 1x128 block codes, made once
    (graphquant::block_codes), or x in high precision with its row amaxes (the other formats);
    the down projection's GEMM takes its input alike."""
    from torch._inductor import config as inductor_config

    graphs = []

    def capture(graph):
        graphs.append(graph)
        raise _Captured

    compiled = graphquant.compile(FeedForward().to(torch.bfloat16), RECIPES[name], mode="inference", dynamic=False)
    graphquant.freeze(compiled)
    with inductor_config.patch(post_grad_custom_post_pass=capture, fx_graph_cache=False), torch.no_grad():
        with pytest.raises(Exception):  # _Captured, as this torch's Inductor and Dynamo wrap it
            compiled(torch.randn(1, 128, dtype=torch.bfloat16))
    (graph,) = graphs
    ops = torch.ops.graphquant
    targets = [n.target for n in graph.nodes]
    blocks = name == "deepseek_blockwise"
    assert targets.count(ops.block_codes.default) == (2 if blocks else 0), graph
    assert targets.count(ops.gemms_quantizing_a.default) == targets.count(ops.gemm_quantizing_a.default) == (0 if blocks else 1), graph
    assert targets.count(ops.gemms_sharing_a.default) == targets.count(ops.gemm.default) == (1 if blocks else 0), graph
    assert not {ops.quantize.default, ops.fp8_scales.default, ops.e8m0_scales.default} & set(targets), graph


def test_the_quantizing_gemm_op_passes_opcheck(hopper_on_cpu):
    triton_decode = backends.triton_decode
    quantizer = Float8RowwiseQuantizer()
    x = torch.randn(2, 128).to(torch.bfloat16)
    w = quantizer(torch.randn(64, 128).to(torch.bfloat16), columnwise=False).get(ROWWISE)
    args = (x, triton_decode.amaxes(x, quantizer), quantizer.spec, list(w.tensors()), quantizer.spec, ROWWISE, [64, 128])
    args += (torch.bfloat16, triton_decode.QUANTIZING_BACKEND, "fc#0 fprop", None)
    op = torch.ops.graphquant.gemm_quantizing_a.default
    torch.library.opcheck(op, args, test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))
    blocks = Float8BlockQuantizer(block_scaling_dim=1)
    torch.library.opcheck(torch.ops.graphquant.block_codes.default, (torch.randn(3, 256).to(torch.bfloat16), blocks.spec))
    with pytest.raises(backends.GemmMismatch, match="takes A in high precision"):
        backends.gemm(w, w, 1, torch.bfloat16, backends.GemmBackend(triton_decode.QUANTIZING_BACKEND), "fc#0 fprop")


@pytest.mark.parametrize("cols", [300, 4096, 14336])
def test_row_chunk_amaxes_give_each_rows_and_the_tensors_amax(cols):
    """The amaxes the kernel takes (rows longer than 4096 in chunks of 1024): their max over a row
    is the row's amax, over all the tensor's (fp8.tensor_amax), through rows of zeros and values
    40 orders of magnitude apart."""
    torch.manual_seed(0)
    x = (torch.randn(5, cols) * torch.logspace(-20, 20, 5)[:, None]).to(torch.bfloat16)
    x[2] = 0
    chunks = fp8.row_chunk_amax(x)
    assert chunks.shape == (5, 14 if cols == 14336 else 1) and chunks.dtype == torch.float32
    assert torch.equal(chunks.amax(1), x.float().abs().amax(1))
    assert torch.equal(chunks.max(), fp8.tensor_amax(x))


def test_the_kernels_quantize_on_load_what_they_can_and_say_what_else():
    pytest.importorskip("triton")
    from graphquant.kernels import triton_decode

    for qa, _ in PAIRS.values():
        assert triton_decode.quantize_on_load_refusal(qa) == ""
    refusals = {
        Float8DelayedScalingQuantizer(): "from the amax of A alone",
        Float8CurrentScalingQuantizer(with_amax_reduction=True): "from the amax of A alone",
        Float8BlockQuantizer(block_scaling_dim=2): "FP8 current scaling per fp8_tensorwise, fp8_rowwise, fp8_block_1x128, not",
        MXFP8Quantizer(): "quantizing mxfp8 activations itself was measured slower",
        NVFP4Quantizer(): "quantizing nvfp4 activations itself was measured slower",
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
@pytest.mark.parametrize("name", PAIRS)
def test_quantizing_on_load_equals_quantizing_first_on_gpu(name, n, k):
    """One row, three (a partial tile) and sixteen; random bf16 activations, a row of zeros, rows
    six orders of magnitude apart; K split across programs (the down projection) or not; with a
    bias; fp32 and bf16 out."""
    torch.manual_seed(0)
    w = (torch.randn(n, k, device="cuda") / 64).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    for m in (1, 3, 16):
        x = (torch.randn(m, k, device="cuda") * torch.logspace(-3, 3, m, device="cuda")[:, None]).to(torch.bfloat16)
        if m > 1:
            x[1] = 0
        for out_dtype in (torch.float32, torch.bfloat16):
            first, on_load = _products(name, x, w, bias, out_dtype)
            assert torch.equal(first, on_load), f"{m} rows, {out_dtype}"


@pytest.mark.gpu
def test_a_frozen_ffn_quantizing_on_load_gives_the_bits_of_quantizing_first_on_gpu():
    """Every recipe's frozen FFN at one row and three, as the interpreted test, with the GPU's
    kernels (the block-codes op's CUDA kernel among them)."""
    pytest.importorskip("triton")
    results = _planned_alike_results(torch.device("cuda"))
    assert all(results.values()), results


if __name__ == "__main__":  # the interpreted cases, as the fixture ``interpreted`` runs them
    triton_interpreter.accept_numpy_scalars()
    triton_interpreter.round_fp8_to_nearest_even()
    print(json.dumps(_interpreted_results()))
