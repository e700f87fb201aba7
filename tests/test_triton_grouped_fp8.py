"""The native FP8 grouped GEMM (graphquant.kernels.triton_grouped_fp8): every product of a grouped
site (fprop, dgrad, wgrad) equals the float64 product of each group's dequantized operands, for
per-tensor (E5M2 gradients), per-row and DeepSeek's block scales, ragged and empty groups, K
that fills no whole block; and the plan chooses it for every FP8 grouped GEMM of these formats.

Each GEMM runs as the plan runs it: its sums promoted into fp32 every PROMOTE_EVERY products, and
for per-tensor and per-row scales also with fast accumulation (FAST_ACCUMULATION: the tensor
cores' accumulator takes the whole sum). On the CPU the kernel runs under Triton's interpreter, in
a process of its own, with an fp32 output (the interpreter rounds fp32 to bf16 toward zero) and
exact products: within fp32 accumulation, promoted or not (the interpreter has no tensor cores'
accumulator). On the GPU at an MoE layer's widths with a bf16 output, within the bounds
tests/test_gemm_backends.py gives cuBLASLt's FP8 GEMMs: fp8.accumulation_bound of the sums,
promoted or fast. That fast accumulation leaves the whole sum
in the tensor cores is checked on the CPU too, in the kernel's PTX for sm_90 (Triton compiles it
without a GPU).
"""

import json
import re

import pytest
import torch
import torch.nn.functional as F
import ptxas
import triton_interpreter

from graphquant import recipes
from graphquant.formats import fp8, groups
from graphquant.kernels import backends
from graphquant.kernels import grouped as grouped_kernels
from graphquant.quantizers import (
    COLUMNWISE,
    ROWWISE,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8RowwiseQuantizer,
    MXFP8Quantizer,
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
    "mxfp8": (MXFP8Quantizer(), MXFP8Quantizer(), MXFP8Quantizer()),  # fprop alone, of few tokens an expert
}
GEMMS = ("fprop", "dgrad", "wgrad")
# How each format's GEMMs sum, as the plan can choose: block scales always promote.
SUMS = {name: ("promoted", "fast") if name in ("tensorwise", "rowwise") else ("promoted",) for name in FORMATS}
SUMS["mxfp8"] = ("fast",)  # each 32-block in the tensor cores' accumulator, where the recipe lets it
TRAINED = [name for name in FORMATS if name != "mxfp8"]  # the formats whose every GEMM it runs
# (group sizes, k: x's columns, n: each expert's output features): ragged groups and an empty
# one, k with a partial block, n that is no multiple of 128 (the expert stack pads it).
INTERPRETED_SHAPE = ((40, 0, 57, 27), 192, 160)
GPU_SHAPE = ((700, 0, 1301, 128, 2900, 61, 1000, 5), 2048, 1408)


def excess(
    name: str, gemm: str, sums: str, sizes, k: int, n: int, out_dtype: torch.dtype, device: str, kernels=None
) -> float:
    """How far the kernel's ``gemm`` of a grouped site, its ``sums`` "promoted" or "fast", exceeds
    its bound (<= 0: within it), the operands quantized per group as graphquant.ops.grouped lays
    them out; "fprop alone": fprop in an inference graph's layout (groups.FEW_TOKEN_ROWS). The
    bound: fp8.accumulation_bound of the sums, fp32's under the interpreter (no tensor cores), on
    the GPU the kernel's, promoted or fast, and 4 u sum |a b| for the factors; plus the rounding
    to ``out_dtype``. ``kernels``: the Triton kernel's module (None) or one with its functions."""
    kernels = kernels or backends.triton_grouped_fp8
    promote_every = kernels.PROMOTE_EVERY if sums == "promoted" else kernels.FAST_ACCUMULATION
    summed = fp8.FP32 if device == "cpu" else kernels.MX_BLOCK if name == "mxfp8" else promote_every

    def allowed(p, q):
        return fp8.accumulation_bound(p, q, summed) + 4 * U * (p.abs() @ q.abs())

    qx, qw, qg = FORMATS[name]
    experts, rows = len(sizes), sum(sizes)
    generator = torch.Generator().manual_seed(0)
    token_rows = groups.FEW_TOKEN_ROWS if gemm == "fprop alone" else groups.GROUP_ROWS
    tokens = groups.padding(
        torch.tensor(sizes).cumsum(0).to(torch.int32).to(device), rows, token_rows, groups.padded_bound(rows, experts, token_rows)
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
        out = kernels.tokens_by_tokens(a, tokens.row_group, b, tokens.row_group, tokens.ends, n, out_dtype, promote_every)
        left, right = dequantized(a, tokens), dequantized(b, tokens)
        pairs = [(left[lo:hi].t(), right[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]
        exact = torch.stack([p @ q for p, q in pairs])[:, :n]
        bound = torch.stack([allowed(p, q) for p, q in pairs])[:, :n]
        assert torch.equal(out[1], torch.zeros_like(out[1])), "the empty expert's weight gradient"
    else:
        fprop = gemm != "dgrad"
        a = quantized(qx if fprop else qg, x if fprop else dy, tokens, ROWWISE)
        b = quantized(qw, w, stack, ROWWISE if fprop else COLUMNWISE)
        width = n if fprop else k
        out = kernels.tokens_by_experts(a, b, stack.row_group, tokens, token_rows, width, out_dtype, promote_every)
        left, stacked = dequantized(a, tokens)[tokens.position], dequantized(b, stack).reshape(experts, padded_n, k)
        ends = [0, *torch.tensor(sizes).cumsum(0).tolist()]
        pairs = [(left[lo:hi], stacked[g].t() if fprop else stacked[g]) for g, (lo, hi) in enumerate(zip(ends, ends[1:]))]
        exact = torch.cat([p @ q for p, q in pairs])[:, :width]
        bound = torch.cat([allowed(p, q) for p, q in pairs])[:, :width]
    assert out.shape == exact.shape and out.dtype == out_dtype
    rounding = U if out_dtype == torch.float32 else 2.0**-8
    return ((out.double() - exact).abs() - bound - rounding * exact.abs()).max().item()


def _cases():
    """Every format's GEMMs; fprop alone where x's blocks span one row, as an inference graph pads
    it (backends.token_rows)."""
    alone = [(name, "fprop alone", sums) for name in FORMATS if FORMATS[name][0].block(ROWWISE)[0] <= 1 for sums in SUMS[name]]
    return [(name, gemm, sums) for name in TRAINED for gemm in GEMMS for sums in SUMS[name]] + alone



@pytest.fixture(scope="module")
def interpreted() -> dict:
    """Every case's excess, from one process running the kernels under Triton's interpreter."""
    pytest.importorskip("triton")
    return triton_interpreter.results_of(__file__)


CASE_IDS = ["-".join(case) for case in _cases()]


@pytest.mark.parametrize("name,gemm,sums", _cases(), ids=CASE_IDS)
def test_grouped_fp8_gemm_matches_float64_reference_interpreted(interpreted, name, gemm, sums):
    assert interpreted[f"{name} {gemm} {sums}"] <= 0


@pytest.mark.gpu
@pytest.mark.parametrize("name,gemm,sums", _cases(), ids=CASE_IDS)
def test_grouped_fp8_gemm_matches_float64_reference_on_gpu(name, gemm, sums):
    if not backends.TRITON_GROUPED_GEMMS:
        pytest.skip("needs Triton")
    assert excess(name, gemm, sums, *GPU_SHAPE, torch.bfloat16, "cuda") <= 0


@pytest.mark.parametrize("fast_accumulation", [False, True], ids=["fp32 sums", "fast accumulation"])
@pytest.mark.parametrize("name", sorted(TRAINED))
def test_plan_runs_grouped_fp8_gemms_natively_on_hopper(name, fast_accumulation, monkeypatch):
    """On sm90 every grouped GEMM of these formats runs on the Triton kernel, which sums in the
    tensor cores' accumulator alone where the recipe lets the GEMM and its scales are per tensor
    or per row, and promotes its sums into fp32 everywhere else (block scales always)."""
    if not backends.TRITON_GROUPED_GEMMS:
        pytest.skip("needs Triton")
    monkeypatch.setattr(backends, "capability", lambda device: (9, 0))
    monkeypatch.setattr(backends.grouped_fp8, "extension_runs", lambda device: False)  # the CUDA kernel's: test_grouped_fp8
    qx, qw, qg = FORMATS[name]
    pairs = {"fprop": (qx, ROWWISE, qw, ROWWISE), "dgrad": (qg, ROWWISE, qw, COLUMNWISE), "wgrad": (qg, COLUMNWISE, qx, COLUMNWISE)}
    for gemm, (qa, da, qb, db) in pairs.items():
        selection = backends.select_grouped(qa, da, qb, db, torch.device("cuda"), 4096, fast_accumulation)
        fast = fast_accumulation and "fast" in SUMS[name]
        expected = backends.GemmBackend(backends.triton_grouped_fp8.BACKEND, fast_accumulation=fast)
        assert (selection.bucket, selection.backend) == (backends.NATIVE, expected), (gemm, selection)


@pytest.mark.parametrize("kernel", ["_tokens_by_experts", "_tokens_by_tokens"])
def test_autotuner_offers_a_call_the_tiles_of_its_kind(kernel):
    """Block scales get tiles of one scale block's K, promoted and fast sums tiles of their own
    (fast ones a wider one too); and a dot promotes every PROMOTE_EVERY products, or every K tile
    where the tile is shorter (Triton takes no max_num_imprecise_acc above a dot's K)."""
    kernels = backends.triton_grouped_fp8
    if kernels is None:
        pytest.skip("needs Triton")
    tuner = getattr(kernels, kernel)  # the GPU's autotuner: this process runs no interpreter

    def offered(block_scaled, promote_every):
        return tuner.early_config_prune(tuner.configs, None, BLOCK_SCALED=block_scaled, PROMOTE_EVERY=promote_every)

    assert all(tile.kwargs["BLOCK_K"] == kernels.SCALE_BLOCK for tile in offered(True, kernels.PROMOTE_EVERY))
    if kernel == "_tokens_by_experts":  # every tile within a group of its layout's alignment
        for rows in (groups.GROUP_ROWS, groups.FEW_TOKEN_ROWS):
            for block_scaled, every in ((True, kernels.PROMOTE_EVERY), (False, kernels.PROMOTE_EVERY), (False, kernels.FAST_ACCUMULATION)):
                tiles = tuner.early_config_prune(tuner.configs, None, BLOCK_SCALED=block_scaled, PROMOTE_EVERY=every, TOKEN_ROWS=rows)
                assert tiles and all(rows % tile.kwargs["BLOCK_M"] == 0 for tile in tiles), (rows, block_scaled, every)
        mx = tuner.early_config_prune(tuner.configs, None, BLOCK_SCALED=True, PROMOTE_EVERY=None, TOKEN_ROWS=16, SCALE_BLOCK=kernels.MX_BLOCK)
        assert mx and all(tile.kwargs["BLOCK_K"] == kernels.MX_BLOCK for tile in mx)  # a K tile an MXFP8 block
    fast, promoted = ({str(tile) for tile in offered(False, every)} for every in (kernels.FAST_ACCUMULATION, kernels.PROMOTE_EVERY))
    assert fast > promoted and any("BLOCK_N: 256," in tile for tile in fast - promoted)
    imprecise = {
        (every, block_k): kernels._imprecise_products({"PROMOTE_EVERY": every, "BLOCK_K": block_k})
        for every in (kernels.FAST_ACCUMULATION, 32, 128) for block_k in (64, 128)
    }
    assert imprecise == {(None, 64): None, (None, 128): None, (32, 64): 32, (32, 128): 32, (128, 64): 64, (128, 128): 128}


def compiled_ptx(promote_every, capability: int = 90, few_tokens: bool = False, mx: bool = False) -> str:
    """The PTX of the tokens x tokens kernel compiled for sm_``capability`` by Triton (its own
    ptxas, which assembles it: no GPU) at its first promoted tile, E4M3 operands with per-row
    scales, promoting every ``promote_every`` products (FAST_ACCUMULATION: never); with
    ``few_tokens``, of the tokens x experts kernel at its tile for groups of FEW_TOKEN_ROWS (``mx``:
    MXFP8's)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernels = backends.triton_grouped_fp8
    jit = kernels._tokens_by_experts if few_tokens else kernels._tokens_by_tokens
    while not isinstance(jit, triton.runtime.JITFunction):  # under the autotuner and heuristics
        jit = jit.fn
    if few_tokens:
        tile = kernels._TOKENS_BY_EXPERTS_TILES["few tokens, MX blocks" if mx else "few tokens"][0]
        own = {"TOKEN_ROWS": groups.FEW_TOKEN_ROWS, "EVEN_K": True, "WEIGHTS_LEFT": True, "E8M0": mx, "B_TILE_SCALE": False}
    else:
        tile, own = kernels._TOKENS_BY_TOKENS_TILES["promoted"][0], {"GROUP_ROWS": groups.GROUP_ROWS}
    constexprs = {
        **tile.kwargs, "BLOCK_SCALED": mx, "A_ROWS": 1, "B_ROWS": 1, "A_E5M2": False, "B_E5M2": False, "PROMOTE_EVERY": promote_every,
        "SCALE_BLOCK": kernels.MX_BLOCK if mx else kernels.SCALE_BLOCK, "GROUP_TILES": kernels.GROUP_TILES, **own,
    }
    constexprs["IMPRECISE"] = kernels._imprecise_products(constexprs)
    pointers = {
        "a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "out_ptr": "*bf16", "ends_ptr": "*i32", "sa_ptr": "*fp32", "sb_ptr": "*fp32",
        "row_group_ptr": "*i64", "source_ptr": "*i64", **({"sa_ptr": "*u8", "sb_ptr": "*u8"} if mx else {}),
    }
    signature = {name: "constexpr" if name in constexprs else pointers.get(name, "i32") for name in jit.arg_names}
    source = ASTSource(jit, signature, {(jit.arg_names.index(name),): value for name, value in constexprs.items()})
    options = {"num_warps": tile.num_warps, "num_stages": tile.num_stages}
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options).asm["ptx"]


@pytest.mark.parametrize("promote_every", [None, 32, 128], ids=["fast", "every 32", "every 128"])
def test_on_hopper_fast_accumulation_leaves_the_sum_in_the_tensor_cores(promote_every):
    """Compiled for sm_90, the kernel with max_num_imprecise_acc left to Triton's default (fast
    accumulation) makes no fp32 add: its wgmmas accumulate in the tensor cores alone. Promoting
    every P products adds each P-product partial sum into the fp32 accumulator: one add per
    accumulator element a thread holds, K tile / P times a tile."""
    kernels = backends.triton_grouped_fp8
    if kernels is None:
        pytest.skip("needs Triton")
    ptx = compiled_ptx(promote_every)
    tile = kernels._TOKENS_BY_TOKENS_TILES["promoted"][0]
    block_k = tile.kwargs["BLOCK_K"]
    held = tile.kwargs["BLOCK_M"] * tile.kwargs["BLOCK_N"] // (32 * tile.num_warps)
    promotions = 0 if promote_every is kernels.FAST_ACCUMULATION else block_k // min(promote_every, block_k)
    assert "wgmma.mma_async" in ptx
    assert ptx.count("add.f32") + ptx.count("add.rn.f32") == held * promotions


@pytest.mark.parametrize("promote_every", [None, 128], ids=["fast", "every 128"])
def test_assembles_for_sm89_on_its_fp8_tensor_cores(promote_every):
    """The plan gives the FP8 grouped GEMM to sm_89 GPUs too (backends.TRITON_GROUPED_GEMMS):
    there, without wgmma, it assembles to FP8 mma.sync."""
    if backends.triton_grouped_fp8 is None:
        pytest.skip("needs Triton")
    ptx = compiled_ptx(promote_every, capability=89)
    assert "wgmma" not in ptx and re.search(r"mma\.sync\.aligned\.\w+\.row\.col\.f32\.e4m3\.e4m3\.f32", ptx)


@pytest.mark.parametrize("promote_every", [None, 128], ids=["fast", "every 128"])
def test_few_tokens_an_expert_take_fp8_wgmmas_transposed_on_hopper(promote_every):
    """Tiles of FEW_TOKEN_ROWS tokens (an inference graph's groups) are too few rows for a wgmma's
    left operand: on sm_90 the weights take that side and the tokens are its 16 columns, FP8 on
    the tensor cores, promoted as the other tiles are (one add per accumulator element a thread
    holds, K tile / P times a tile)."""
    kernels = backends.triton_grouped_fp8
    if kernels is None:
        pytest.skip("needs Triton")
    ptx = compiled_ptx(promote_every, few_tokens=True)
    tile = kernels._TOKENS_BY_EXPERTS_TILES["few tokens"][0]
    held = tile.kwargs["BLOCK_M"] * tile.kwargs["BLOCK_N"] // (32 * tile.num_warps)
    promotions = 0 if promote_every is kernels.FAST_ACCUMULATION else tile.kwargs["BLOCK_K"] // min(promote_every, tile.kwargs["BLOCK_K"])
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n16k32\.f32\.e4m3\.e4m3", ptx)
    assert ptx.count("add.f32") + ptx.count("add.rn.f32") == held * promotions


def test_few_tokens_mxfp8_blocks_take_fp8_wgmmas_on_hopper():
    """MXFP8's few-token tiles multiply its E4M3 codes on the FP8 tensor cores, a 32-long block a
    wgmma (the weights its 64-row side), each block's sum scaled in fp32 by the two E8M0 scales."""
    if backends.triton_grouped_fp8 is None:
        pytest.skip("needs Triton")
    ptx = compiled_ptx(None, few_tokens=True, mx=True)
    tile = backends.triton_grouped_fp8._TOKENS_BY_EXPERTS_TILES["few tokens, MX blocks"][0]
    wgmmas = tile.kwargs["BLOCK_N"] // 64 * tile.kwargs["BLOCK_K"] // 32  # the weight rows 64 a wgmma, K 32
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n16k32\.f32\.e4m3\.e4m3", ptx)) == wgmmas


# The gate and up projections' fprop at moe_step.py's shapes, DeepSeek-V3's scales: 1x128 tokens
# (padded rows, 4096) by a stack of 64 experts' (2816, 4096) weights in 128x128 blocks.
_BLOCK_SCALED_FPROP = dict(
    groups=64, rows=139264, n=2816, k=4096, stride_am=4096, stride_ak=1, stride_bg=2816 * 4096, stride_bk=1, stride_bn=4096,
    stride_om=2816, sa_g=0, sa_i=32, sa_k=1, sb_g=22 * 32, sb_i=32, sb_k=1,
)


def test_block_scaled_tiles_scale_each_k_block_by_one_weight_scale_and_spill_nothing_on_hopper():
    """Compiled for sm_90 at the kernel's first block-scaled tile, DeepSeek-V3's fprop: B's 128x128
    block scales span the tile's columns (B_TILE_SCALE), so each K block's partial sums take A's
    row scales times B's one scale, one fma an element and no product of two scales an element;
    ptxas spills nothing."""
    if backends.triton_grouped_fp8 is None:
        pytest.skip("needs Triton")
    kernels = backends.triton_grouped_fp8
    tile = kernels._TOKENS_BY_EXPERTS_TILES["block scaled"][0]
    args = {
        **tile.kwargs, "BLOCK_SCALED": True, "A_ROWS": 1, "B_ROWS": kernels.SCALE_BLOCK, "A_E5M2": False, "B_E5M2": False,
        "PROMOTE_EVERY": kernels.PROMOTE_EVERY, "SCALE_BLOCK": kernels.SCALE_BLOCK, "E8M0": False, "GROUP_TILES": kernels.GROUP_TILES,
        "TOKEN_ROWS": groups.GROUP_ROWS, **_BLOCK_SCALED_FPROP,
    }
    heuristics = kernels._tokens_by_experts.fn  # under the autotuner
    constants = {name: value for name, value in args.items() if name not in _BLOCK_SCALED_FPROP}
    constants |= {name: rule(args) for name, rule in heuristics.values.items()}
    assert constants["B_TILE_SCALE"]
    pointers = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "out_ptr": "*bf16", "ends_ptr": "*i32", "row_group_ptr": "*i64", "source_ptr": "*i64"}
    ptx = ptxas.compiled_for(heuristics.fn, pointers, _BLOCK_SCALED_FPROP, constants, tile.num_warps, tile.num_stages).asm["ptx"]
    per_thread = tile.kwargs["BLOCK_M"] * tile.kwargs["BLOCK_N"] // (32 * tile.num_warps)
    assert len(re.findall(r"fma\.rn\.f32", ptx)) == per_thread
    assert len(re.findall(r"\bmul\.f32", ptx)) < per_thread
    assert "0 bytes spill stores" in ptxas.report(ptx)


def step_backends(name: str, fast: bool) -> list[str]:
    """A compiled training step of test_compile_grouped's expert layer under the zoo recipe
    ``name``, every GEMM's sums in fp32 or (``fast``) every GEMM let accumulate fast, on a
    pretended Hopper: against the per-group float64 reference (teacher-forced, each GEMM within
    fp32 accumulation, which the interpreter's exact products meet); the backends its grouped
    GEMMs ran on, as the plan prints them."""
    import dataclasses

    import test_compile_grouped as grouped

    backends.capability = lambda device: (9, 0)
    backends.clear_caches()
    torch._dynamo.reset()
    recipe = dataclasses.replace(grouped.RECIPES[name](), fast_accumulation=recipes.GEMM_NAMES if fast else ())
    compiled = grouped.run_against_reference(recipe, grouped.Model(), grouped.inputs())
    return sorted({str(g.backend) for g in compiled.graphquant.plan.gemms})


STEP_RECIPES = {"tensorwise": "current", "rowwise": "rowwise", "blockwise": "blockwise"}
STEPS = [(name, sums) for name in STEP_RECIPES for sums in SUMS[name]]


@pytest.mark.parametrize("name,sums", STEPS, ids=["-".join(step) for step in STEPS])
def test_training_step_on_the_kernel_matches_per_group_reference_interpreted(interpreted, name, sums):
    """The ops hand the kernel its operands as it reads them (layouts, scales, groups, widths),
    and the plan's choice of sums: every GEMM let accumulate fast runs with fast accumulation."""
    if not backends.TRITON_GROUPED_GEMMS:
        pytest.skip("needs Triton")
    expected = backends.GemmBackend(backends.triton_grouped_fp8.BACKEND, fast_accumulation=sums == "fast")
    assert interpreted[f"step {name} {sums}"] == [str(expected)]


if __name__ == "__main__":  # under TRITON_INTERPRET=1: every case's excess and step's backends, as JSON
    triton_interpreter.accept_numpy_scalars()
    triton_interpreter.round_bfloat16_to_nearest()
    results = {" ".join(case): excess(*case, *INTERPRETED_SHAPE, torch.float32, "cpu") for case in _cases()}
    results.update({f"step {name} {sums}": step_backends(STEP_RECIPES[name], sums == "fast") for name, sums in STEPS})
    print(json.dumps(results))
