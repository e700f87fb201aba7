"""The native FP8 grouped GEMM (graphquant.kernels.triton_grouped_fp8): every product of a grouped
site (fprop, dgrad, wgrad) equals the float64 product of each group's dequantized operands, for
per-tensor (E5M2 gradients), per-row and DeepSeek's block scales, ragged and empty groups, K
that fills no whole block; and the plan chooses it for the grouped GEMMs that keep fp32 sums.

On the CPU the kernel runs under Triton's interpreter, in a process of its own, with an fp32
output (the interpreter rounds fp32 to bf16 toward zero) and exact products: within fp32
accumulation. On the GPU at an MoE layer's widths with a bf16 output, within the bound of
promoted FP8 tensor-core sums (tests/test_gemm_backends.py): fp8.PROMOTED_ERROR of sum |a b| per
output.
"""

import json

import pytest
import torch
import torch.nn.functional as F
import triton_interpreter

from graphquant.formats import fp8, groups
from graphquant.kernels import backends
from graphquant.kernels import grouped as grouped_kernels
from graphquant.quantizers import (
    COLUMNWISE,
    ROWWISE,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8RowwiseQuantizer,
    QuantizeContext,
)

U = 2.0**-24
# (input, weight, grad_output) quantizers: the zoo's tensorwise, rowwise and deepseek_blockwise;
# 128x128 tiles on every operand (power-of-two scales, an E5M2 weight).
FORMATS = {
    "tensorwise": (Float8CurrentScalingQuantizer("e4m3"), Float8CurrentScalingQuantizer("e4m3"), Float8CurrentScalingQuantizer("e5m2")),
    "rowwise": (Float8RowwiseQuantizer(), Float8RowwiseQuantizer(), Float8RowwiseQuantizer()),
    "blockwise": (
        Float8BlockQuantizer(block_scaling_dim=1, force_pow_2_scales=False),
        Float8BlockQuantizer(block_scaling_dim=2, force_pow_2_scales=False),
        Float8BlockQuantizer(block_scaling_dim=1, force_pow_2_scales=False),
    ),
    "128x128 blocks": (Float8BlockQuantizer(), Float8BlockQuantizer(fp8_dtype="e5m2"), Float8BlockQuantizer()),
}
GEMMS = ("fprop", "dgrad", "wgrad")
# (group sizes, k: x's columns, n: each expert's output features): ragged groups and an empty
# one, k with a partial block, n that is no multiple of 128 (the expert stack pads it).
INTERPRETED_SHAPE = ((40, 0, 57, 27), 192, 160)
GPU_SHAPE = ((700, 0, 1301, 128, 2900, 61, 1000, 5), 2048, 1408)


def excess(name: str, gemm: str, sizes, k: int, n: int, out_dtype: torch.dtype, device: str) -> float:
    """How far the kernel's ``gemm`` of a grouped site exceeds its bound (<= 0: within it), the
    operands quantized per group as graphquant.ops.grouped lays them out. The bound: fp32
    accumulation ((K + 4) u sum |a b|) where the products are exact (the interpreter), promoted
    tensor-core sums (fp8.PROMOTED_ERROR sum |a b|) on the GPU; plus the rounding to ``out_dtype``."""
    kernels = backends.triton_grouped_fp8
    qx, qw, qg = FORMATS[name]
    experts, rows = len(sizes), sum(sizes)
    generator = torch.Generator().manual_seed(0)
    tokens = groups.padding(
        torch.tensor(sizes).cumsum(0).to(torch.int32).to(device), rows, groups.GROUP_ROWS,
        groups.padded_bound(rows, experts, groups.GROUP_ROWS),
    )
    padded_n = -(-n // groups.GROUP_ROWS) * groups.GROUP_ROWS
    stack_ends = torch.arange(1, experts + 1, dtype=torch.int32, device=device) * n
    stack = groups.padding(stack_ends, experts * n, groups.GROUP_ROWS, experts * padded_n)
    x = tokens.pad((torch.randn(rows, k, generator=generator) * torch.rand(rows, 1, generator=generator) * 8).to(device, torch.bfloat16))
    w = stack.pad((torch.randn(experts * n, k, generator=generator) / 8).to(device, torch.bfloat16))
    dy = tokens.pad(F.pad(torch.randn(rows, n, generator=generator), (0, padded_n - n)).to(device, torch.bfloat16))

    def quantized(quantizer, values, layout, direction):
        return quantizer.quantize_groups(values, layout.row_group, layout.groups, direction, QuantizeContext())

    def dequantized(rep, layout):
        return grouped_kernels.dequantize(rep, layout.row_group, torch.float32).double()

    bounds = [0, *tokens.ends.tolist()]
    if gemm == "wgrad":
        a, b = quantized(qg, dy, tokens, COLUMNWISE), quantized(qx, x, tokens, COLUMNWISE)
        out = kernels.tokens_by_tokens(a, tokens.row_group, b, tokens.row_group, tokens.ends, n, out_dtype)
        left, right = dequantized(a, tokens), dequantized(b, tokens)
        pairs = [(left[lo:hi].t(), right[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]
        exact = torch.stack([p @ q for p, q in pairs])[:, :n]
        magnitude = torch.stack([p.abs() @ q.abs() for p, q in pairs])[:, :n]
        reduced = max(hi - lo for lo, hi in zip(bounds, bounds[1:]))
        assert torch.equal(out[1], torch.zeros_like(out[1])), "the empty expert's weight gradient"
    else:
        a = quantized(qx if gemm == "fprop" else qg, x if gemm == "fprop" else dy, tokens, ROWWISE)
        b = quantized(qw, w, stack, ROWWISE if gemm == "fprop" else COLUMNWISE)
        width = n if gemm == "fprop" else k
        out = kernels.tokens_by_experts(a, tokens.row_group, b, stack.row_group, tokens.ends, tokens.position, width, out_dtype)
        left, stacked = dequantized(a, tokens)[tokens.position], dequantized(b, stack).reshape(experts, padded_n, k)
        ends = [0, *torch.tensor(sizes).cumsum(0).tolist()]
        pairs = [(left[lo:hi], stacked[g].t() if gemm == "fprop" else stacked[g]) for g, (lo, hi) in enumerate(zip(ends, ends[1:]))]
        exact = torch.cat([p @ q for p, q in pairs])[:, :width]
        magnitude = torch.cat([p.abs() @ q.abs() for p, q in pairs])[:, :width]
        reduced = left.shape[1]
    assert out.shape == exact.shape and out.dtype == out_dtype
    accumulation = (reduced + 4) * U if device == "cpu" else fp8.PROMOTED_ERROR
    rounding = U if out_dtype == torch.float32 else 2.0**-8
    bound = accumulation * magnitude + rounding * exact.abs()
    return ((out.double() - exact).abs() - bound).max().item()


def _cases():
    return [(name, gemm) for name in FORMATS for gemm in GEMMS]


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """Every case's excess, from one process running the kernels under Triton's interpreter."""
    pytest.importorskip("triton")
    return triton_interpreter.results_of(__file__)


@pytest.mark.parametrize("name,gemm", _cases(), ids=[f"{name}-{gemm}" for name, gemm in _cases()])
def test_grouped_fp8_gemm_matches_float64_reference_interpreted(interpreted, name, gemm):
    assert interpreted[f"{name} {gemm}"] <= 0


@pytest.mark.gpu
@pytest.mark.parametrize("name,gemm", _cases(), ids=[f"{name}-{gemm}" for name, gemm in _cases()])
def test_grouped_fp8_gemm_matches_float64_reference_on_gpu(name, gemm):
    if not backends.TRITON_GROUPED_GEMMS:
        pytest.skip("needs Triton")
    assert excess(name, gemm, *GPU_SHAPE, torch.bfloat16, "cuda") <= 0


@pytest.mark.parametrize("fast_accumulation", [False, True], ids=["fp32 sums", "fast accumulation"])
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_plan_runs_grouped_fp8_gemms_natively_on_hopper(name, fast_accumulation, monkeypatch):
    """On sm90 every grouped GEMM of these formats is native: torch._scaled_grouped_mm where it
    takes the pair (E4M3, per-tensor or per-row scales) and the recipe lets the GEMM sum in the
    tensor cores' accumulator, the Triton kernel everywhere else."""
    if not backends.TRITON_GROUPED_GEMMS:
        pytest.skip("needs Triton")
    monkeypatch.setattr(backends, "capability", lambda device: (9, 0))
    qx, qw, qg = FORMATS[name]
    pairs = {"fprop": (qx, ROWWISE, qw, ROWWISE), "dgrad": (qg, ROWWISE, qw, COLUMNWISE), "wgrad": (qg, COLUMNWISE, qx, COLUMNWISE)}
    for gemm, (qa, da, qb, db) in pairs.items():
        selection = backends.select_grouped(qa, da, qb, db, torch.device("cuda"), 4096, fast_accumulation)
        cublas = fast_accumulation and name == "rowwise" or (fast_accumulation and name == "tensorwise" and gemm == "fprop")
        expected = backends.SCALED_GROUPED_MM if cublas else backends.triton_grouped_fp8.BACKEND
        assert (selection.bucket, selection.backend.name) == (backends.NATIVE, expected), (gemm, selection)


def step_backends(name: str) -> list[str]:
    """A compiled training step of test_compile_grouped's expert layer under the zoo recipe
    ``name``, every GEMM's sums in fp32, on a pretended Hopper: against the per-group float64
    reference (teacher-forced, each GEMM within fp32 accumulation, which the interpreter's exact
    products meet); the backends its grouped GEMMs ran on."""
    import dataclasses

    import test_compile_grouped as grouped

    backends.capability = lambda device: (9, 0)
    backends.clear_caches()
    torch._dynamo.reset()
    recipe = dataclasses.replace(grouped.RECIPES[name](), fast_accumulation=())
    compiled = grouped.run_against_reference(recipe, grouped.Model(), grouped.inputs())
    return sorted({g.backend.name for g in compiled.graphquant.plan.gemms})


STEP_RECIPES = {"tensorwise": "current", "rowwise": "rowwise", "blockwise": "blockwise"}


@pytest.mark.parametrize("name", STEP_RECIPES)
def test_training_step_on_the_kernel_matches_per_group_reference_interpreted(interpreted, name):
    """The ops hand the kernel its operands as it reads them (layouts, scales, groups, widths)."""
    assert interpreted[f"step {name}"] == [backends.triton_grouped_fp8.BACKEND if backends.TRITON_GROUPED_GEMMS else "none"]


if __name__ == "__main__":  # under TRITON_INTERPRET=1: every case's excess and step's backends, as JSON
    triton_interpreter.accept_numpy_scalars()
    triton_interpreter.round_bfloat16_to_nearest()
    results = {f"{name} {gemm}": excess(name, gemm, *INTERPRETED_SHAPE, torch.float32, "cpu") for name, gemm in _cases()}
    results.update({f"step {name}": step_backends(recipe) for name, recipe in STEP_RECIPES.items()})
    print(json.dumps(results))
